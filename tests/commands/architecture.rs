//! ARCHITECTURE.md's code map against the workspace: its table of crate arrows (each crate's own
//! crates, from `[dependencies]`) is what `cargo metadata` says, and every workspace crate has its
//! section (`### \`crates/NAME\``, or a crate named in its heading), none more.

use std::collections::{BTreeMap, BTreeSet};
use std::process::Command;

use serde_json::Value;

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// The workspace's crates (the root package left out: it is the CLI, "root package" in the map)
/// and, for each, its normal dependencies among them, without the `kvgate-` prefix.
fn workspace_arrows() -> BTreeMap<String, BTreeSet<String>> {
    let output = Command::new(env!("CARGO"))
        .args(["metadata", "--no-deps", "--format-version", "1", "--offline"])
        .current_dir(ROOT)
        .output()
        .expect("cargo metadata runs");
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let metadata: Value = serde_json::from_slice(&output.stdout).expect("cargo metadata's JSON");
    let packages = metadata["packages"].as_array().expect("packages");
    let names: BTreeSet<&str> =
        packages.iter().filter_map(|p| p["name"].as_str()).filter(|n| *n != "kvgate").collect();
    let mut arrows = BTreeMap::new();
    for package in packages {
        let name = package["name"].as_str().unwrap();
        if name == "kvgate" {
            continue;
        }
        let uses = package["dependencies"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|d| d["kind"].is_null())
            .filter_map(|d| d["name"].as_str())
            .filter(|d| names.contains(d))
            .map(|d| d.trim_start_matches("kvgate-").to_string())
            .collect();
        arrows.insert(name.to_string(), uses);
    }
    arrows
}

fn architecture() -> String {
    std::fs::read_to_string(format!("{ROOT}/ARCHITECTURE.md")).expect("ARCHITECTURE.md")
}

/// The table between the `crate-arrows` markers: crate → the crates it uses.
fn documented_arrows(text: &str) -> BTreeMap<String, BTreeSet<String>> {
    let start = text.find("<!-- crate-arrows:begin -->").expect("the crate-arrows table's start");
    let end = text.find("<!-- crate-arrows:end -->").expect("the crate-arrows table's end");
    let mut arrows = BTreeMap::new();
    for row in text[start..end].lines().filter(|l| l.starts_with("| `")) {
        let cells: Vec<&str> = row.trim_matches('|').split('|').map(str::trim).collect();
        let [name, uses] = cells[..] else { panic!("a row of two cells: {row}") };
        let uses = match uses {
            "—" => BTreeSet::new(),
            list => list.split(',').map(|u| u.trim().to_string()).collect(),
        };
        assert!(arrows.insert(name.trim_matches('`').to_string(), uses).is_none(), "listed twice: {row}");
    }
    arrows
}

/// The crates the code map has a section of: `### \`crates/NAME\`` headings, and crates named
/// in a heading's parentheses (`### \`bindings/python\` (crate \`kvgate-python\`, ...)`).
fn sections(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for heading in text.lines().filter(|l| l.starts_with("### ")) {
        if let Some(rest) = heading.strip_prefix("### `crates/") {
            names.insert(rest.split('`').next().unwrap().to_string());
        } else if let Some((_, rest)) = heading.split_once("(crate `") {
            names.insert(rest.split('`').next().unwrap().to_string());
        }
    }
    names
}

#[test]
fn the_code_map_lists_every_crate_and_its_arrows_as_cargo_does() {
    let actual = workspace_arrows();
    let text = architecture();
    let documented = documented_arrows(&text);
    assert_eq!(
        documented.keys().collect::<Vec<_>>(),
        actual.keys().collect::<Vec<_>>(),
        "ARCHITECTURE.md's arrow table names other crates than the workspace"
    );
    for (name, uses) in &actual {
        assert_eq!(&documented[name], uses, "ARCHITECTURE.md's arrows of {name}");
    }
    let actual_names: BTreeSet<String> = actual.keys().cloned().collect();
    assert_eq!(sections(&text), actual_names, "ARCHITECTURE.md's crate sections");
}

#[test]
fn the_table_reader_sees_a_wrong_row() {
    let text = "<!-- crate-arrows:begin -->\n| crate | uses |\n| --- | --- |\n| `kvgate-a` | b, c |\n| `kvgate-b` | — |\n<!-- crate-arrows:end -->\n### `crates/kvgate-a`\n### `bindings/x` (crate `kvgate-b`, more)\n### root package `kvgate`\n";
    let arrows = documented_arrows(text);
    assert_eq!(arrows["kvgate-a"], BTreeSet::from(["b".to_string(), "c".to_string()]));
    assert!(arrows["kvgate-b"].is_empty());
    assert_eq!(sections(text), BTreeSet::from(["kvgate-a".to_string(), "kvgate-b".to_string()]));
}
