//! docs/CONFIG.md is generated from the one configuration schema (the clap + serde structs); this
//! test fails when the two drift. Regenerate with `KVGATE_UPDATE_DOCS=1 cargo test --test commands docs`.
//! The Python stubs (`bindings/python/python/kvgate/__init__.pyi`) are rendered from the same
//! schema by `python3 bindings/python/gen_stubs.py` (with the extension built): after a change
//! to a flag's help, regenerate both (CI's `tests/test_stubs.py` checks the stubs).

use clap::{Args, Command};
use kvgate_gateway::GatewayConfig;

/// A subcommand's flags as a table; `fields` says which are keys of the YAML file (the others are
/// command-line only).
fn table(command: &Command, fields: Option<&[String]>) -> String {
    let mut out = String::from("| flag | field | default | meaning |\n| --- | --- | --- | --- |\n");
    for arg in command.get_arguments() {
        let Some(long) = arg.get_long() else { continue };
        if long == "help" || arg.is_hide_set() {
            continue;
        }
        let defaults: Vec<String> =
            arg.get_default_values().iter().map(|v| v.to_string_lossy().into_owned()).collect();
        let default =
            if defaults.is_empty() { "—".to_string() } else { format!("`{}`", defaults.join(" ")) };
        let help = arg.get_long_help().or(arg.get_help()).map(|h| h.to_string()).unwrap_or_default();
        let mut help = help.replace('\n', " ").replace('|', "\\|");
        let values: Vec<String> =
            arg.get_possible_values().iter().map(|v| format!("`{}`", v.get_name())).collect();
        let boolean = values == ["`true`", "`false`"];
        if !values.is_empty() && !boolean {
            help.push_str(&format!(". One of {}.", values.join(", ")));
        }
        let aliases: Vec<String> = arg
            .get_visible_aliases()
            .unwrap_or_default()
            .iter()
            .map(|a| format!(" (alias `--{a}`)"))
            .collect();
        let flag = format!("`--{long}`{}", aliases.concat());
        let id = arg.get_id().as_str();
        let field = match fields {
            Some(fields) if !fields.iter().any(|f| f == id) => "(command line only)".to_string(),
            _ => format!("`{id}`"),
        };
        out.push_str(&format!("| {flag} | {field} | {default} | {help} |\n",));
    }
    out
}

fn render() -> String {
    let cli = kvgate::command();
    let sub = |name: &str| cli.find_subcommand(name).unwrap().clone();
    let schema = GatewayConfig::augment_args(Command::new("schema"));
    let fields: Vec<String> = schema.get_arguments().map(|arg| arg.get_id().to_string()).collect();
    let launch = table(&sub("launch"), Some(&fields));
    let [mock, sim, replay, soak] = ["mock", "sim", "replay", "soak"].map(|name| table(&sub(name), None));
    format!(
        "# kvgate configuration reference\n\n\
         Generated from the configuration schema by `KVGATE_UPDATE_DOCS=1 cargo test --test commands docs`;\n\
         do not edit by hand. The second column is the field's name in the configuration structs\n\
         (`GatewayConfig`, `PolicyConfig`, `MockArgs`, `SimArgs`, `ReplayArgs`), which is also its\n\
         key in the YAML file of `kvgate launch --config FILE` (the policy options, from `--policy`\n\
         to `--bucket-adjust-interval-secs`, go under `routing:`), the name of its setter in\n\
         `GatewayConfig::builder()` / `PolicyConfig::builder()` and its keyword in the Python\n\
         package's `kvgate.Gateway(...)`.\n\n\
         ## `kvgate launch`\n\n{launch}\n\
         ## `kvgate mock`\n\n{mock}\n\
         ## `kvgate sim`\n\n{sim}\n\
         ## `kvgate replay`\n\n{replay}\n\
         ## `kvgate soak`\n\n{soak}"
    )
}

#[test]
fn config_reference_matches_the_schema() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/docs/CONFIG.md");
    let expected = render();
    if std::env::var_os("KVGATE_UPDATE_DOCS").is_some() {
        std::fs::write(path, &expected).unwrap();
    }
    let actual = std::fs::read_to_string(path).unwrap_or_default();
    assert!(
        actual == expected,
        "docs/CONFIG.md is out of date: run `KVGATE_UPDATE_DOCS=1 cargo test --test commands docs` and commit it \
         (the Python stubs follow the same schema: also run `python3 bindings/python/gen_stubs.py`)"
    );
}

/// Every long flag (and visible or hidden alias) of every `kvgate` subcommand.
fn all_flags() -> std::collections::BTreeMap<String, clap::Arg> {
    fn collect(command: &Command, flags: &mut std::collections::BTreeMap<String, clap::Arg>) {
        for arg in command.get_arguments() {
            let names = arg.get_long().into_iter().chain(arg.get_all_aliases().unwrap_or_default());
            for name in names {
                flags.entry(name.to_string()).or_insert_with(|| arg.clone());
            }
        }
        for sub in command.get_subcommands() {
            collect(sub, flags);
        }
    }
    let mut flags = std::collections::BTreeMap::new();
    collect(&kvgate::command(), &mut flags);
    // The routing guard's (scripts/routing_guard.sh).
    collect(&<kvgate_sim::guard::GuardArgs as clap::CommandFactory>::command(), &mut flags);
    flags
}

/// Flags of other programs that the documents mention (cargo's, vLLM's, SGLang's, the simulator's
/// `scenario` example's).
const FOREIGN_FLAGS: [&str; 12] = [
    "bin",
    "example",
    "guard",
    "release",
    "workspace",
    "kv-events-config",
    "enable-prompt-tokens-details",
    "enable-cache-report",
    "scheduling-policy",
    "enable-priority-scheduling",
    "schedule-low-priority-values-first",
    "enable-mixed-chunk",
];

/// The benchmark logs: they quote the command lines of the builds they measured, flags since
/// renamed included.
fn is_figures(path: &std::path::Path) -> bool {
    path.file_name().and_then(|name| name.to_str()).is_some_and(|name| name.starts_with("BENCHMARKS"))
}

#[test]
fn every_flag_the_documents_name_exists() {
    let flags = all_flags();
    // SMG's options `kvgate launch` takes or refuses by name (src/smg).
    let smg_names: std::collections::BTreeSet<String> =
        kvgate::smg::smg_options().into_iter().flat_map(|option| option.names).collect();
    let chapters = std::fs::read_dir("docs").unwrap().map(|entry| entry.unwrap().path());
    let chapters = chapters.filter(|path| path.extension().is_some_and(|ext| ext == "md"));
    let generated = ["docs/CONFIG.md", "docs/SMG.md"].map(std::path::Path::new);
    let chapters = chapters.filter(|path| !generated.contains(&path.as_path()) && !is_figures(path));
    let docs: Vec<std::path::PathBuf> =
        ["README.md", "ARCHITECTURE.md"].map(Into::into).into_iter().chain(chapters).collect();
    let mut unknown = Vec::new();
    for doc in &docs {
        let doc = doc.display();
        let text = std::fs::read_to_string(doc.to_string()).unwrap();
        for (index, _) in text.match_indices("--") {
            let name: String = text[index + 2..]
                .chars()
                .take_while(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '-')
                .collect();
            let name = name.trim_end_matches('-');
            let wildcard = text[index + 2 + name.len()..].starts_with("-*");
            if name.is_empty() || FOREIGN_FLAGS.contains(&name) || !text[..index].ends_with(['`', ' ', '(']) {
                continue;
            }
            // clap's own flags, which every subcommand has.
            let known = if ["help", "version"].contains(&name) {
                true
            } else if wildcard {
                flags.keys().any(|flag| flag.starts_with(&format!("{name}-")))
            } else {
                flags.contains_key(name) || smg_names.contains(&format!("--{name}"))
            };
            if !known {
                unknown.push(format!("{doc} names --{name}"));
            }
        }
    }
    assert!(unknown.is_empty(), "flags no kvgate subcommand has (nor SMG 1.13):\n{}", unknown.join("\n"));
}

#[test]
fn the_readme_flag_table_gives_the_schema_defaults() {
    let readme = std::fs::read_to_string("README.md").unwrap();
    let section = readme.split("## Flags").nth(1).unwrap();
    let table = section.split("\n\n").find(|chunk| chunk.starts_with("| flag")).unwrap();
    let launch = kvgate::command();
    let launch = launch.find_subcommand("launch").unwrap();
    let mut checked = 0;
    for row in table.lines().skip(2) {
        let cells: Vec<&str> = row.split(" | ").collect();
        let flags: Vec<&str> = cells[0].trim_start_matches("| ").split(", ").collect();
        let defaults: Vec<&str> = cells[1].split(", ").collect();
        if flags.len() != defaults.len() {
            continue;
        }
        for (flag, default) in flags.iter().zip(defaults) {
            let name = flag.trim_matches('`').split(' ').next().unwrap().trim_start_matches("--");
            let Some(arg) = launch.get_arguments().find(|arg| arg.get_long() == Some(name)) else { continue };
            let schema: Vec<String> =
                arg.get_default_values().iter().map(|v| v.to_string_lossy().into_owned()).collect();
            let written = default.trim_matches('`');
            let matches = match (written, schema.as_slice()) {
                ("none" | "off", []) => true,
                ("off", [value]) => value == "false",
                (written, [value]) => match (written.parse::<f64>(), value.parse::<f64>()) {
                    (Ok(a), Ok(b)) => a == b,
                    _ => {
                        written == value
                            || !written.chars().all(|c| c.is_ascii_alphanumeric() || "._/".contains(c))
                    }
                },
                _ => true,
            };
            assert!(matches, "README says --{name} defaults to {written}; the schema says {schema:?}");
            checked += 1;
        }
    }
    assert!(checked >= 15, "only {checked} README defaults checked: has the table's shape changed?");
}

#[test]
fn the_readme_configuration_file_example_loads() {
    let readme = std::fs::read_to_string("README.md").unwrap();
    let yaml = readme.split("```yaml\n# kvgate.yaml\n").nth(1).unwrap().split("```").next().unwrap();
    let config = GatewayConfig::with_file(yaml, &GatewayConfig::default(), &[]).unwrap();
    config.validate().unwrap();
    for url in &config.worker_urls {
        assert!(url.starts_with("http://127.0.0.1:"), "examples use loopback addresses: {url}");
    }
}

#[test]
fn policy_names_agree_across_flag_file_and_code() {
    use clap::ValueEnum;
    for kind in kvgate_policy::PolicyKind::value_variants() {
        let flag = kind.to_possible_value().unwrap().get_name().to_string();
        let file = serde_json::to_value(kind).unwrap();
        assert_eq!((flag.as_str(), file.as_str().unwrap()), (kind.as_str(), kind.as_str()));
    }
}

/// The out-of-range values a help text's stated range excludes (`in (0, 1]`, `> 0`, `>= 0`,
/// `>= 1`), nearest first.
fn excluded_by_help(help: &str) -> Vec<f64> {
    let help = help.trim_end_matches('.');
    let mut bad = Vec::new();
    if help.contains("in (0, 1]") {
        bad.extend([0.0, 1.5]);
    } else if help.contains("in [0, 1]") {
        bad.extend([-0.5, 1.5]);
    } else if help.ends_with(">= 1") || help.ends_with(">= 1 (leave unset for no limit)") {
        bad.extend([0.5, 0.0]);
    } else if help.ends_with(">= 0") {
        bad.push(-1.0);
    } else if help.ends_with("> 0") || help.contains(", > 0") {
        bad.push(0.0);
    }
    bad
}

#[test]
fn the_ranges_the_help_states_are_the_ranges_validation_enforces() {
    let schema = GatewayConfig::augment_args(Command::new("schema"));
    let routing: Vec<String> = kvgate_policy::PolicyConfig::augment_args(Command::new("routing"))
        .get_arguments()
        .map(|arg| arg.get_id().to_string())
        .collect();
    let mut checked = 0;
    for arg in schema.get_arguments() {
        let id = arg.get_id().as_str();
        let help = arg.get_help().map(|h| h.to_string()).unwrap_or_default();
        let (path, yaml_of) = if routing.iter().any(|r| r == id) {
            (
                format!("routing.{id}"),
                Box::new(|v: String| format!("routing:\n  {id}: {v}\n")) as Box<dyn Fn(String) -> String>,
            )
        } else {
            (id.to_string(), Box::new(|v: String| format!("{id}: {v}\n")) as Box<dyn Fn(String) -> String>)
        };
        for bad in excluded_by_help(&help) {
            // Integers where the field is one (a float would not parse), else the float itself.
            let mut candidates = vec![format!("{bad:?}")];
            if bad.fract() == 0.0 {
                candidates.insert(0, format!("{}", bad as i64));
            }
            let Some(config) = candidates.into_iter().find_map(|text| {
                GatewayConfig::with_file(&yaml_of(text), &GatewayConfig::default(), &[]).ok()
            }) else {
                continue; // not representable in the field's type (e.g. -1 for an unsigned count)
            };
            let errors = config.validate().expect_err(&format!("{path} = {bad} is outside `{help}`"));
            assert!(errors.names(&path), "{path} = {bad}: {errors}");
            checked += 1;
        }
    }
    assert!(checked >= 25, "only {checked} stated ranges checked: has the help text's wording changed?");
}
