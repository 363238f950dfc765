//! The Prometheus text exposition format, read: the one reader of a `/metrics` page, the
//! engines' (vLLM's load, read by [`crate::loads::parse_vllm`]) and, in the tests, the gateway's
//! own and the simulated engines'.
//!
//! A sample line is `name{label="value",...} value [timestamp]`; names may hold colons (every
//! vLLM metric does: `vllm:num_requests_running`), label values may hold any character, with
//! `\\`, `\"` and `\n` escaped. Comments (`# HELP`, `# TYPE`), blank lines and lines that do not
//! parse are passed over, so one bad line never hides the rest of a page.
//!
//! Why not a kept crate: `prometheus-parse` 0.2.5 reads names as `\w+` (it drops every metric
//! with a colon, that is all of vLLM's) and splits label values at `,` and `=`;
//! `openmetrics-parser` is LGPL-3.0.

use std::borrow::Cow;

/// One sample of a page: a series (its name and labels) and its value.
#[derive(Clone, Debug, PartialEq)]
pub struct Sample<'a> {
    /// The sample's name as written: a histogram's series are `<family>_bucket`, `_sum`, `_count`.
    pub name: &'a str,
    /// The labels in their order on the line, values unescaped.
    pub labels: Vec<(&'a str, Cow<'a, str>)>,
    /// The value; `NaN`, `+Inf` and `-Inf` are read as such.
    pub value: f64,
}

impl Sample<'_> {
    /// The value of label `name`, if the series has it.
    pub fn label(&self, name: &str) -> Option<&str> {
        self.labels.iter().find(|(key, _)| *key == name).map(|(_, value)| value.as_ref())
    }
}

/// Every sample of `text`, in order.
pub fn samples(text: &str) -> impl Iterator<Item = Sample<'_>> {
    text.lines().filter_map(parse_line)
}

/// A set of series as a query names it: `name` alone, or `name{label="value",...}` for the
/// series of that name that have those labels (among others). Names are matched whole.
#[derive(Clone, Debug, PartialEq)]
pub struct Selector<'a> {
    pub name: &'a str,
    pub labels: Vec<(&'a str, Cow<'a, str>)>,
}

impl<'a> Selector<'a> {
    /// Reads `name` or `name{label="value",...}` (a sample line without its value).
    pub fn parse(text: &'a str) -> Result<Self, String> {
        let error = || format!("not a series selector (name{{label=\"value\",...}}): {text:?}");
        let (name, rest) = read_name(text).ok_or_else(error)?;
        let mut labels = Vec::new();
        let rest = match rest.strip_prefix('{') {
            Some(after_brace) => parse_labels(after_brace, &mut labels).ok_or_else(error)?,
            None => rest,
        };
        if !rest.is_empty() {
            return Err(error());
        }
        Ok(Self { name, labels })
    }

    /// Whether `sample` is one of the selected series.
    pub fn matches(&self, sample: &Sample) -> bool {
        sample.name == self.name && self.labels.iter().all(|(key, value)| sample.label(key) == Some(value))
    }

    /// The sum of the selected series in `text` (0 when it has none).
    pub fn sum(&self, text: &str) -> f64 {
        samples(text).filter(|sample| self.matches(sample)).map(|sample| sample.value).sum()
    }

    /// The value of the first selected series in `text`, if it has one.
    pub fn first(&self, text: &str) -> Option<f64> {
        samples(text).find(|sample| self.matches(sample)).map(|sample| sample.value)
    }
}

/// One line read as a sample: `None` for a comment, a blank line or a line that does not parse.
pub fn parse_line(line: &str) -> Option<Sample<'_>> {
    let line = line.trim();
    if line.is_empty() || line.starts_with('#') {
        return None;
    }
    let (name, mut rest) = read_name(line)?;
    let mut labels = Vec::new();
    if let Some(after_brace) = rest.strip_prefix('{') {
        rest = parse_labels(after_brace, &mut labels)?;
    }
    // The value, then an optional timestamp (integer milliseconds), then nothing.
    if !rest.starts_with([' ', '\t']) {
        return None;
    }
    let mut fields = rest.split_whitespace();
    let value = parse_value(fields.next()?)?;
    if let Some(timestamp) = fields.next() {
        timestamp.parse::<i64>().ok()?;
    }
    if fields.next().is_some() {
        return None;
    }
    Some(Sample { name, labels, value })
}

/// A metric name (`[a-zA-Z_:][a-zA-Z0-9_:]*`) at the start of `text`, and what follows it.
fn read_name(text: &str) -> Option<(&str, &str)> {
    let end = text.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':')).unwrap_or(text.len());
    let name = &text[..end];
    if name.is_empty() || name.starts_with(|c: char| c.is_ascii_digit()) {
        return None;
    }
    Some((name, &text[end..]))
}

/// Reads `a="x",b="y"}` into `labels`; returns what follows the closing brace.
fn parse_labels<'a>(mut rest: &'a str, labels: &mut Vec<(&'a str, Cow<'a, str>)>) -> Option<&'a str> {
    loop {
        rest = rest.trim_start();
        if let Some(after) = rest.strip_prefix('}') {
            return Some(after);
        }
        let key_end = rest.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))?;
        let key = &rest[..key_end];
        if key.is_empty() {
            return None;
        }
        rest = rest[key_end..].trim_start().strip_prefix('=')?.trim_start().strip_prefix('"')?;
        let (value, after) = parse_quoted(rest)?;
        labels.push((key, value));
        rest = after.trim_start();
        if let Some(after_comma) = rest.strip_prefix(',') {
            rest = after_comma;
        } else if !rest.starts_with('}') {
            return None;
        }
    }
}

/// Reads a label value up to its closing quote (`rest` starts after the opening one); returns
/// the unescaped value and what follows the closing quote.
fn parse_quoted(rest: &str) -> Option<(Cow<'_, str>, &str)> {
    let end = rest.find(['"', '\\'])?;
    if rest.as_bytes()[end] == b'"' {
        return Some((Cow::Borrowed(&rest[..end]), &rest[end + 1..]));
    }
    let mut value = String::from(&rest[..end]);
    let mut chars = rest[end..].char_indices();
    while let Some((at, c)) = chars.next() {
        match c {
            '"' => return Some((Cow::Owned(value), &rest[end + at + 1..])),
            '\\' => match chars.next()?.1 {
                'n' => value.push('\n'),
                escaped => value.push(escaped),
            },
            c => value.push(c),
        }
    }
    None
}

fn parse_value(text: &str) -> Option<f64> {
    match text {
        "NaN" => Some(f64::NAN),
        "+Inf" | "Inf" => Some(f64::INFINITY),
        "-Inf" => Some(f64::NEG_INFINITY),
        _ => text.parse().ok(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_with_colons_labels_with_escapes_and_timestamps() {
        let text = "# HELP vllm:num_requests_running Running.\n# TYPE vllm:num_requests_running gauge\n\
            vllm:num_requests_running{engine=\"0\",model_name=\"a,b=\\\"c\\\"}\\n\\\\\"} 3 1700000000000\n\
            vllm:num_requests_running{engine=\"1\",} 4\n\
            plain_total 2.5e1\n\
            histo_bucket{le=\"+Inf\"} 7\n";
        let read: Vec<Sample> = samples(text).collect();
        assert_eq!(read.len(), 4);
        assert_eq!(read[0].name, "vllm:num_requests_running");
        assert_eq!(read[0].label("model_name"), Some("a,b=\"c\"}\n\\"));
        assert_eq!(read[0].value, 3.0);
        assert_eq!(read[1].labels, vec![("engine", Cow::Borrowed("1"))]);
        assert_eq!((read[2].name, read[2].value), ("plain_total", 25.0));
        assert_eq!(read[3].label("le"), Some("+Inf"));
        let select = |selector| Selector::parse(selector).unwrap();
        assert_eq!(select("vllm:num_requests_running").sum(text), 7.0);
        assert_eq!(select(r#"vllm:num_requests_running{engine="1"}"#).sum(text), 4.0);
        assert_eq!(select(r#"vllm:num_requests_running{engine="2"}"#).first(text), None);
        assert_eq!(select("plain").first(text), None, "a name is matched whole, never as a prefix");
        assert_eq!(select(r#"histo_bucket{le="+Inf"}"#).first(text), Some(7.0));
    }

    #[test]
    fn a_malformed_selector_is_an_error() {
        for selector in ["", "a ", "a{", r#"a{b="c""#, r#"a{b="c"} 1"#, "a{b}", "9a"] {
            assert!(Selector::parse(selector).is_err(), "{selector}");
        }
    }

    #[test]
    fn special_values() {
        let values: Vec<f64> = samples("a NaN\nb +Inf\nc -Inf\n").map(|sample| sample.value).collect();
        assert!(values[0].is_nan());
        assert_eq!(values[1..], [f64::INFINITY, f64::NEG_INFINITY]);
    }

    #[test]
    fn lines_that_do_not_parse_are_passed_over_alone() {
        for line in [
            "garbage line here",
            "x{a=\"1\" 2",
            "x{a=1} 2",
            "x{a=\"1\"}2",
            "x{=\"1\"} 2",
            "x{a=\"1\"} two",
            "x 1 2 3",
            "x 1 later",
            "9x 1",
            "{a=\"1\"} 1",
            "x{a=\"unterminated} 1",
            "\u{0}\u{1}{{{ }}} 1 2 3",
        ] {
            assert_eq!(parse_line(line), None, "{line}");
            assert_eq!(samples(&format!("{line}\nok 1\n")).count(), 1, "{line}");
        }
    }
}
