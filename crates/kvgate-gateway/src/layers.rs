//! The gateway's layer rule, checked over its source text: every top-level module has a layer
//! (`LAYERS`, bottom first), a module refers only to modules of its own layer or below (every
//! `crate::` path, `super::` paths that climb to the crate root, grouped `use crate::{..}`
//! imports), and the module graph has no cycle. Comments and string literals are not code.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The gateway's layers, bottom first. A module may use modules of its own layer or of a lower
/// one, never of a higher one.
const LAYERS: &[(&str, &[&str])] = &[
    ("request parts", &["body"]),
    ("subsystems", &["replica_sync"]),
    ("state", &["state"]),
    ("proxy", &["cors", "proxy"]),
    ("edge", &["admin", "browser_guard", "listen", "metrics_listener", "server"]),
];

/// One reference from a module to another, where it was found.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Reference {
    from: String,
    to: String,
    file: String,
    line: usize,
}

/// The layer index of each module of `layers`.
fn layer_of(layers: &[(&str, &[&str])]) -> BTreeMap<String, usize> {
    let mut of = BTreeMap::new();
    for (index, (_, modules)) in layers.iter().enumerate() {
        for module in *modules {
            assert!(of.insert(module.to_string(), index).is_none(), "{module} is in two layers");
        }
    }
    of
}

/// Every problem of `files` (path relative to `src/`, text) against `layers`: modules without a
/// layer, paths to names that are no module, upward references, and a cycle.
fn check(files: &[(String, String)], layers: &[(&str, &[&str])]) -> Vec<String> {
    let layer = layer_of(layers);
    let mut problems = Vec::new();
    let mut references = Vec::new();
    for (path, text) in files {
        let module = file_module(path);
        if let Some(top) = module.first() {
            if !layer.contains_key(top) {
                problems.push(format!("{path}: module `{top}` has no layer in the table"));
            }
        }
        references.extend(references_of(path, &module, text));
    }
    for reference in &references {
        let (Some(&from), to) = (layer.get(&reference.from), layer.get(&reference.to)) else { continue };
        let Some(&to) = to else {
            problems.push(format!(
                "{}:{}: `crate::{}` is not a module of the layer table",
                reference.file, reference.line, reference.to
            ));
            continue;
        };
        if to > from {
            problems.push(format!(
                "{}:{}: `{}` ({}) uses `{}` ({}), a higher layer",
                reference.file, reference.line, reference.from, layers[from].0, reference.to, layers[to].0
            ));
        }
    }
    if let Some(cycle) = find_cycle(&references) {
        problems.push(format!("the module graph has a cycle: {}", cycle.join(" -> ")));
    }
    problems
}

/// The module path of a file: `proxy/plan.rs` is `proxy::plan`, `proxy/mod.rs` is `proxy`,
/// `lib.rs` the crate root (empty).
fn file_module(path: &str) -> Vec<String> {
    let path = path.strip_suffix(".rs").unwrap_or(path);
    let mut parts: Vec<String> = path.split('/').map(str::to_string).collect();
    if matches!(parts.last().map(String::as_str), Some("mod" | "lib")) {
        parts.pop();
    }
    parts
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Token {
    Ident(String),
    Punct(char),
    PathSep,
}

/// The tokens of `text` with their line numbers, comments and string and char literals removed.
fn tokens(text: &str) -> Vec<(Token, usize)> {
    let chars: Vec<char> = text.chars().collect();
    let mut out = Vec::new();
    let (mut i, mut line) = (0, 1);
    let peek = |i: usize| chars.get(i).copied().unwrap_or('\0');
    while i < chars.len() {
        let c = chars[i];
        if c == '\n' {
            line += 1;
            i += 1;
        } else if c == '/' && peek(i + 1) == '/' {
            while i < chars.len() && chars[i] != '\n' {
                i += 1;
            }
        } else if c == '/' && peek(i + 1) == '*' {
            let mut depth = 0;
            while i < chars.len() {
                if chars[i] == '/' && peek(i + 1) == '*' {
                    depth += 1;
                    i += 2;
                } else if chars[i] == '*' && peek(i + 1) == '/' {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    line += usize::from(chars[i] == '\n');
                    i += 1;
                }
            }
        } else if let Some(after) = raw_string_at(&chars, i) {
            // A raw string: r"..", r#".."#, br#".."#, ...
            let mut hashes = 0;
            i = after;
            while peek(i) == '#' {
                hashes += 1;
                i += 1;
            }
            i += 1;
            while i < chars.len() {
                if chars[i] == '"' && (0..hashes).all(|h| peek(i + 1 + h) == '#') {
                    i += 1 + hashes;
                    break;
                }
                line += usize::from(chars[i] == '\n');
                i += 1;
            }
        } else if c == '"' {
            i += 1;
            while i < chars.len() && chars[i] != '"' {
                if chars[i] == '\\' {
                    i += 1;
                }
                line += usize::from(peek(i) == '\n');
                i += 1;
            }
            i += 1;
        } else if c == '\'' && (peek(i + 2) == '\'' || peek(i + 1) == '\\') {
            // A char literal ('x', '\n', '\'', '\u{..}'); a lifetime ('a) has no closing quote.
            i += if peek(i + 1) == '\\' { 3 } else { 2 };
            while i < chars.len() && chars[i] != '\'' {
                i += 1;
            }
            i += 1;
        } else if c.is_alphanumeric() || c == '_' {
            let start = i;
            while i < chars.len() && (chars[i].is_alphanumeric() || chars[i] == '_') {
                i += 1;
            }
            out.push((Token::Ident(chars[start..i].iter().collect()), line));
        } else if c == ':' && peek(i + 1) == ':' {
            out.push((Token::PathSep, line));
            i += 2;
        } else {
            if !c.is_whitespace() {
                out.push((Token::Punct(c), line));
            }
            i += 1;
        }
    }
    out
}

/// Where the hashes and quote of a raw string literal starting at `at` begin, if one does.
fn raw_string_at(chars: &[char], at: usize) -> Option<usize> {
    let peek = |i: usize| chars.get(i).copied().unwrap_or('\0');
    let after = match (peek(at), peek(at + 1)) {
        ('r', _) => at + 1,
        ('b', 'r') => at + 2,
        _ => return None,
    };
    let mut quote = after;
    while peek(quote) == '#' {
        quote += 1;
    }
    (peek(quote) == '"').then_some(after)
}

fn ident(token: Option<&(Token, usize)>) -> Option<&str> {
    match token {
        Some((Token::Ident(name), _)) => Some(name),
        _ => None,
    }
}

/// The references to other top-level modules in one file of module `module`.
fn references_of(file: &str, module: &[String], text: &str) -> Vec<Reference> {
    let tokens = tokens(text);
    let from = module.first().cloned().unwrap_or_default();
    let mut found = Vec::new();
    // Inline modules (`mod tests { .. }`) deepen the module path until their brace closes.
    let mut inline: Vec<(String, usize)> = Vec::new();
    let mut depth = 0;
    let mut i = 0;
    while i < tokens.len() {
        let (token, line) = &tokens[i];
        match token {
            Token::Punct('{') => depth += 1,
            Token::Punct('}') => {
                depth -= 1;
                if inline.last().is_some_and(|(_, at)| *at == depth) {
                    inline.pop();
                }
            }
            Token::Ident(word) if word == "mod" => {
                if let (Some(name), Some((Token::Punct('{'), _))) =
                    (ident(tokens.get(i + 1)), tokens.get(i + 2))
                {
                    inline.push((name.to_string(), depth));
                }
            }
            Token::Ident(word) if word == "crate" || word == "super" => {
                let preceded_by_path = i > 0 && tokens[i - 1].0 == Token::PathSep;
                if !preceded_by_path && tokens.get(i + 1).map(|t| &t.0) == Some(&Token::PathSep) {
                    let mut path: Vec<String> = module.to_vec();
                    path.extend(inline.iter().map(|(name, _)| name.clone()));
                    let mut j = i;
                    if word == "crate" {
                        path.clear();
                        j += 2;
                    } else {
                        while ident(tokens.get(j)) == Some("super")
                            && tokens.get(j + 1).map(|t| &t.0) == Some(&Token::PathSep)
                        {
                            path.pop();
                            j += 2;
                        }
                    }
                    let targets = match (path.first(), tokens.get(j)) {
                        (Some(top), _) => vec![top.clone()],
                        (None, Some((Token::Ident(name), _))) => vec![name.clone()],
                        (None, Some((Token::Punct('{'), _))) => group_heads(&tokens[j..]),
                        (None, _) => vec!["*".to_string()],
                    };
                    for to in targets {
                        if to != from {
                            found.push(Reference {
                                from: from.clone(),
                                to,
                                file: file.to_string(),
                                line: *line,
                            });
                        }
                    }
                    i = j;
                    continue;
                }
            }
            _ => {}
        }
        i += 1;
    }
    found
}

/// The first name of each item of a `{a::b, c, d::{e, f}}` group starting at `tokens[0]`.
fn group_heads(tokens: &[(Token, usize)]) -> Vec<String> {
    let mut heads = Vec::new();
    let mut depth = 0;
    let mut item_start = true;
    for (token, _) in tokens {
        match token {
            Token::Punct('{') => {
                depth += 1;
                item_start = depth == 1;
            }
            Token::Punct('}') => {
                depth -= 1;
                if depth == 0 {
                    break;
                }
            }
            Token::Punct(',') if depth == 1 => item_start = true,
            Token::Ident(name) if depth == 1 && item_start => {
                heads.push(name.clone());
                item_start = false;
            }
            _ => {}
        }
    }
    heads
}

/// A cycle of the module graph, as the modules along it, if there is one.
fn find_cycle(references: &[Reference]) -> Option<Vec<String>> {
    let mut edges: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
    for reference in references {
        edges.entry(&reference.from).or_default().insert(&reference.to);
    }
    // Depth-first search: 1 = on the current path, 2 = done.
    fn visit<'a>(
        node: &'a str,
        edges: &BTreeMap<&'a str, BTreeSet<&'a str>>,
        state: &mut BTreeMap<&'a str, u8>,
        path: &mut Vec<&'a str>,
    ) -> Option<Vec<String>> {
        match state.get(node) {
            Some(2) => return None,
            Some(_) => {
                let start = path.iter().position(|&n| n == node).unwrap_or(0);
                let mut cycle: Vec<String> = path[start..].iter().map(|n| n.to_string()).collect();
                cycle.push(node.to_string());
                return Some(cycle);
            }
            None => {}
        }
        state.insert(node, 1);
        path.push(node);
        for next in edges.get(node).into_iter().flatten() {
            if let Some(cycle) = visit(next, edges, state, path) {
                return Some(cycle);
            }
        }
        path.pop();
        state.insert(node, 2);
        None
    }
    let mut state = BTreeMap::new();
    for node in edges.keys() {
        if let Some(cycle) = visit(node, &edges, &mut state, &mut Vec::new()) {
            return Some(cycle);
        }
    }
    None
}

/// Every `.rs` file under `dir`, as (path relative to `root`, text).
fn read_sources(root: &Path, dir: &Path, files: &mut Vec<(String, String)>) {
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
        .expect("src is readable")
        .map(|e| e.expect("a directory entry").path())
        .collect();
    entries.sort();
    for path in entries {
        if path.is_dir() {
            read_sources(root, &path, files);
        } else if path.extension().is_some_and(|ext| ext == "rs") {
            let relative = path.strip_prefix(root).expect("under src").to_string_lossy().replace('\\', "/");
            files.push((relative, std::fs::read_to_string(&path).expect("a UTF-8 source file")));
        }
    }
}

fn gateway_sources() -> Vec<(String, String)> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    read_sources(&src, &src, &mut files);
    // This checker's own test cases are not the gateway's code.
    files.retain(|(path, _)| path != "layers.rs");
    files
}

#[test]
fn gateway_modules_import_only_downward_and_have_no_cycle() {
    let files = gateway_sources();
    assert!(files.len() > 10, "found the gateway's sources");
    let problems = check(&files, LAYERS);
    assert!(problems.is_empty(), "layer rule broken (see ARCHITECTURE.md):\n{}", problems.join("\n"));
}

#[test]
fn every_module_of_the_crate_has_a_layer() {
    let lib = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("src/lib.rs")).unwrap();
    let declared: BTreeSet<String> = tokens(&lib)
        .windows(2)
        .filter_map(|pair| match (&pair[0].0, &pair[1].0) {
            (Token::Ident(word), Token::Ident(name)) if word == "mod" && name != "layers" => {
                Some(name.clone())
            }
            _ => None,
        })
        .collect();
    let table: BTreeSet<String> = layer_of(LAYERS).into_keys().collect();
    assert_eq!(declared, table, "lib.rs's modules and the layer table differ");
}

#[cfg(test)]
mod checker {
    //! The checker itself, on synthetic crates: it must catch what it exists to catch.
    use super::*;

    const TABLE: &[(&str, &[&str])] = &[("low", &["low", "peer_a", "peer_b"]), ("high", &["high"])];

    fn files(sources: &[(&str, &str)]) -> Vec<(String, String)> {
        sources.iter().map(|(path, text)| (path.to_string(), text.to_string())).collect()
    }

    fn problems(sources: &[(&str, &str)]) -> Vec<String> {
        check(&files(sources), TABLE)
    }

    #[test]
    fn an_upward_import_is_caught_in_every_spelling() {
        for upward in [
            "use crate::high::Thing;",
            "use crate::{low::A, high::B};",
            "use crate::{\n    low::{self, A},\n    high::{B, C},\n};",
            "fn f() { crate::high::g(); }",
            "use super::high::Thing;",
            "pub(crate) use crate :: high :: Thing;",
        ] {
            let found = problems(&[("low.rs", upward), ("high.rs", "")]);
            assert_eq!(found.len(), 1, "{upward:?}: {found:?}");
            assert!(found[0].contains("`low` (low) uses `high` (high)"), "{upward:?}: {found:?}");
        }
        // From a file of a submodule, `super::super::` climbs to the root.
        let nested = problems(&[("low/deep.rs", "use super::super::high::X;"), ("high.rs", "")]);
        assert_eq!(nested.len(), 1, "{nested:?}");
        assert!(nested[0].starts_with("low/deep.rs:1:"), "{nested:?}");
    }

    #[test]
    fn downward_local_and_non_code_references_pass() {
        let clean = problems(&[
            ("high.rs", "use crate::low::A;\nuse crate::{low::B, peer_a::C};\nfn f() { crate::high::x(); }"),
            ("low/mod.rs", "mod inner;\nuse inner::X;\nuse self::inner::Y;"),
            ("low/inner.rs", "use super::Z;\nuse super::super::low::W;"),
            ("peer_a.rs", "// use crate::high::A;\n/* crate::high */ const S: &str = \"crate::high::B\";\n#[cfg(test)]\nmod tests {\n    use super::*;\n}"),
            ("peer_b.rs", "const R: &str = r#\"use crate::high::C;\"#;\nfn f<'a>(x: &'a str) -> char { 'c' }"),
            ("low/bytes.rs", "const B: &[u8] = br#\"{\"a\": \"crate::high::D\"}\"#;\nconst Q: char = '\\'';"),
        ]);
        assert!(clean.is_empty(), "{clean:?}");
    }

    #[test]
    fn inline_modules_resolve_super_from_where_they_are() {
        // Inside `mod tests` of a top-level file, `super::` is the file's own module.
        assert!(problems(&[("low.rs", "mod tests {\n    use super::x;\n}")]).is_empty());
        // Outside it, `super::` from a top-level file is the crate root.
        let found = problems(&[("low.rs", "mod tests {\n}\nuse super::high::Y;"), ("high.rs", "")]);
        assert_eq!(found.len(), 1, "{found:?}");
    }

    #[test]
    fn a_cycle_within_a_layer_is_caught() {
        let found =
            problems(&[("peer_a.rs", "use crate::peer_b::X;"), ("peer_b.rs", "use crate::peer_a::Y;")]);
        assert_eq!(found, ["the module graph has a cycle: peer_a -> peer_b -> peer_a"]);
    }

    #[test]
    fn unknown_modules_and_root_items_are_refused() {
        let found = problems(&[("stray.rs", ""), ("low.rs", "use crate::start;")]);
        assert_eq!(found.len(), 2, "{found:?}");
        assert!(found[0].contains("module `stray` has no layer"), "{found:?}");
        assert!(found[1].contains("`crate::start` is not a module"), "{found:?}");
    }
}
