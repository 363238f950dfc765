//! docs/CONFIG.md is generated from the one configuration schema (the clap + serde structs); this
//! test fails when the two drift. Regenerate with `KVGATE_UPDATE_DOCS=1 cargo test --test docs`.

use clap::{Args, Command, CommandFactory, Parser};
use kvgate_gateway::GatewayConfig;
use kvgate_mock::MockArgs;
use kvgate_replay::ReplayArgs;
use kvgate_sim::SimArgs;

#[derive(Parser)]
struct Launch {
    #[command(flatten)]
    config: GatewayConfig,
}

#[derive(Parser)]
struct Mock {
    #[command(flatten)]
    mock: MockArgs,
}

fn table(command: &Command) -> String {
    let mut out = String::from("| flag | field | default | meaning |\n| --- | --- | --- | --- |\n");
    for arg in command.get_arguments() {
        let Some(long) = arg.get_long() else { continue };
        if long == "help" {
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
        out.push_str(&format!("| {flag} | `{}` | {default} | {help} |\n", arg.get_id()));
    }
    out
}

fn render() -> String {
    let launch = table(&Launch::command());
    let mock = table(&Mock::augment_args(Command::new("mock")));
    let sim = table(&SimArgs::augment_args(Command::new("sim")));
    let replay = table(&ReplayArgs::augment_args(Command::new("replay")));
    format!(
        "# kvgate configuration reference\n\n\
         Generated from the configuration schema by `KVGATE_UPDATE_DOCS=1 cargo test --test docs`;\n\
         do not edit by hand. The second column is the field's name in the configuration structs\n\
         (`GatewayConfig`, `PolicyConfig`, `MockArgs`), which is also its key in the YAML file of\n\
         `kvgate launch --config FILE` (the policy options, from `--policy` to\n\
         `--least-load-default-throughput`, go under `routing:`).\n\n\
         ## `kvgate launch`\n\n{launch}\n\
         `kvgate launch` also takes `--config FILE` (YAML; flags given on the command line override it),\n\
         `--mock-workers N` (start N simulated engines in-process and route to them) and\n\
         `--worker-threads N` (async runtime threads).\n\n\
         ## `kvgate mock`\n\n{mock}\n\
         ## `kvgate sim`\n\n{sim}\n\
         ## `kvgate replay`\n\n{replay}"
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
        "docs/CONFIG.md is out of date: run `KVGATE_UPDATE_DOCS=1 cargo test --test docs` and commit it"
    );
}
