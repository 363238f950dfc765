//! The text forms of the run list: a `--policies` entry (`name[:flag=value...][@label]`), a sweep axis (`NAME=V1,V2,...`), the grid of axes and each run's label. One parser for `kvgate sim` and for the hosts of outside policies (benches/dynamo-sim's `dynamo` entries and `--dynamo-sweep`).

/// A flag override, `(snake_case name, value as written)`.
pub type Override = (String, String);

/// A flag's name as the overrides key it: written as in a config file (`kv_aware_wait_margin`)
/// or as on the command line (`kv-aware-wait-margin`, `--kv-aware-wait-margin`), both mean the
/// same field.
pub fn flag_name(written: &str) -> String {
    let written = written.trim();
    written.strip_prefix("--").unwrap_or(written).replace('-', "_")
}

/// A `--policies` entry split into its parts; the name and flags are checked by whoever runs it.
#[derive(Clone, Debug, PartialEq)]
pub struct Entry {
    /// The entry as written.
    pub text: String,
    pub name: String,
    /// The `@label`, shown instead of the name and the entry's own overrides.
    pub label: Option<String>,
    pub overrides: Vec<Override>,
}

impl Entry {
    pub fn parse(text: &str) -> Result<Entry, String> {
        let (spec, label) = match text.rsplit_once('@') {
            Some((spec, label)) if !label.trim().is_empty() => (spec, Some(label.trim().to_string())),
            Some(_) => return Err(format!("--policies entry `{text}` has an empty @label")),
            None => (text, None),
        };
        let mut parts = spec.split(':');
        let name = parts.next().unwrap_or_default().trim().to_string();
        let overrides = parts
            .map(|part| match part.split_once('=') {
                Some((key, value)) => Ok((flag_name(key), value.trim().to_string())),
                None => Err(format!("`{part}` in --policies entry `{text}` is not flag=value")),
            })
            .collect::<Result<_, _>>()?;
        Ok(Entry { text: text.to_string(), name, label, overrides })
    }

    /// The run of this entry at a sweep grid `point`: its label and every override (the
    /// entry's, then the point's).
    pub fn at(&self, point: &[Override]) -> (String, Vec<Override>) {
        let mut overrides = self.overrides.clone();
        overrides.extend(point.iter().cloned());
        let label = match &self.label {
            Some(name) => label(name, point),
            None => label(&self.name, &overrides),
        };
        (label, overrides)
    }
}

/// One sweep axis: a flag and the values it takes.
#[derive(Clone, Debug, PartialEq)]
pub struct SweepAxis {
    pub name: String,
    pub values: Vec<String>,
}

impl SweepAxis {
    /// `NAME=V1,V2,...`; `option` names the command-line option in errors.
    pub fn parse(text: &str, option: &str) -> Result<SweepAxis, String> {
        let (name, values) =
            text.split_once('=').ok_or_else(|| format!("{option} `{text}` is not NAME=V1,V2,..."))?;
        let values: Vec<String> =
            values.split(',').map(|v| v.trim().to_string()).filter(|v| !v.is_empty()).collect();
        if values.is_empty() {
            return Err(format!("{option} `{text}` lists no value"));
        }
        Ok(SweepAxis { name: flag_name(name), values })
    }
}

/// Every combination of the axes' values, the first axis varying slowest; one empty point
/// when there is no axis.
pub fn grid(axes: &[SweepAxis]) -> Vec<Vec<Override>> {
    let mut points: Vec<Vec<Override>> = vec![Vec::new()];
    for axis in axes {
        points = points
            .iter()
            .flat_map(|point| {
                axis.values.iter().map(move |value| {
                    let mut point = point.clone();
                    point.push((axis.name.clone(), value.clone()));
                    point
                })
            })
            .collect();
    }
    points
}

/// `name flag=value ...`, the run's name in reports.
pub fn label(name: &str, overrides: &[Override]) -> String {
    let mut label = name.to_string();
    for (key, value) in overrides {
        label.push(' ');
        label.push_str(key);
        label.push('=');
        label.push_str(value);
    }
    label
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_entry_runs_at_each_grid_point_under_its_label() {
        let entry = Entry::parse("dynamo:overlap_score_credit=2@credit").unwrap();
        assert_eq!(entry.name, "dynamo");
        let axes = [SweepAxis::parse("w=1,2", "--dynamo-sweep").unwrap()];
        let runs: Vec<_> = grid(&axes).iter().map(|point| entry.at(point)).collect();
        assert_eq!(runs[1].0, "credit w=2");
        assert_eq!(runs[1].1, [("overlap_score_credit".into(), "2".into()), ("w".into(), "2".into())]);
        let plain = Entry::parse("dynamo:w=4").unwrap();
        assert_eq!(plain.at(&[]).0, "dynamo w=4");
    }

    #[test]
    fn malformed_text_names_the_option() {
        assert!(Entry::parse("dynamo:w").unwrap_err().contains("not flag=value"));
        assert!(Entry::parse("dynamo@").unwrap_err().contains("empty @label"));
        assert!(SweepAxis::parse("w=", "--dynamo-sweep").unwrap_err().starts_with("--dynamo-sweep"));
    }

    #[test]
    fn a_flag_may_be_written_as_on_the_command_line() {
        let entry = Entry::parse("kv_aware:kv-aware-wait-margin=2:--kv-aware-wait-slack-ms=0").unwrap();
        let keys: Vec<&str> = entry.overrides.iter().map(|(key, _)| key.as_str()).collect();
        assert_eq!(keys, ["kv_aware_wait_margin", "kv_aware_wait_slack_ms"]);
        assert_eq!(SweepAxis::parse(" --block-size =16,32", "--sweep").unwrap().name, "block_size");
        assert_eq!(flag_name("cache_threshold"), "cache_threshold");
    }
}
