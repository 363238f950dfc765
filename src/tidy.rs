//! Rules on the repository's own tests, checked over its sources (rust-analyzer's `tidy.rs`
//! shape): a test waits on an event (a metric, a `Notify`, a condition polled with a deadline),
//! never on a fixed sleep followed by an assertion, which fails under load when the sleep is too
//! short and wastes time when it is long.
//!
//! A sleep counts as a fixed wait when it is a statement of its own (`sleep(..).await;`,
//! `thread::sleep(..);`, Python's `time.sleep(..)`), an assertion follows it within a few lines
//! of the same task, and no enclosing loop polls (a `while` loop, a `loop`, or a `for` loop that
//! can `break` or `return`). Where the sleep is the input under test (a client idle for longer
//! than a timeout), the line above it says so with a comment starting `// fixed sleep:` (`#` in
//! Python).

use std::path::{Path, PathBuf};

/// Code lines after a sleep in which an assertion makes it a fixed wait.
const WINDOW: usize = 6;
const MARKER: &str = "fixed sleep:";

#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Language {
    Rust,
    Python,
}

struct Line<'a> {
    number: usize,
    indent: usize,
    code: &'a str,
    comment: &'a str,
}

fn split_lines(text: &str, language: Language) -> Vec<Line<'_>> {
    let comment_start = match language {
        Language::Rust => "//",
        Language::Python => "#",
    };
    text.lines()
        .enumerate()
        .map(|(index, raw)| {
            let (code, comment) = match raw.find(comment_start) {
                Some(at) if !raw[..at].contains('"') => (&raw[..at], &raw[at..]),
                _ => (raw, ""),
            };
            Line {
                number: index + 1,
                indent: raw.len() - raw.trim_start().len(),
                code: code.trim(),
                comment: comment.trim(),
            }
        })
        .collect()
}

fn is_sleep_statement(code: &str, language: Language) -> bool {
    let call = match language {
        Language::Rust => code.strip_suffix(';').map(|c| c.trim_end_matches(".await")),
        Language::Python => Some(code),
    };
    let Some(call) = call else { return false };
    let name = call.split('(').next().unwrap_or("");
    call.ends_with(')')
        && (name == "sleep"
            || name.ends_with("::sleep")
            || name.ends_with(".sleep")
            || name.ends_with("sleep_until"))
}

fn opens_block(line: &Line, language: Language) -> bool {
    match language {
        Language::Rust => line.code.ends_with('{'),
        Language::Python => line.code.ends_with(':'),
    }
}

/// The lines of the block opened at `lines[open]`.
fn block_body<'a, 'b>(lines: &'b [Line<'a>], open: usize) -> &'b [Line<'a>] {
    let indent = lines[open].indent;
    let end = lines[open + 1..]
        .iter()
        .position(|line| !line.code.is_empty() && line.indent <= indent)
        .map_or(lines.len(), |offset| open + 1 + offset);
    &lines[open + 1..end]
}

fn polls(lines: &[Line], open: usize) -> bool {
    let opener = lines[open].code;
    let first_word = opener.split_whitespace().find(|word| !word.ends_with('=') && *word != "let");
    match first_word.unwrap_or("") {
        "while" | "loop" => true,
        word if word.starts_with("loop") || opener.ends_with("loop {") => true,
        "for" => block_body(lines, open).iter().any(|line| {
            line.code.split(|c: char| !c.is_alphanumeric()).any(|word| word == "break" || word == "return")
        }),
        _ => false,
    }
}

/// The line numbers of the fixed sleeps followed by an assertion in `text`.
fn fixed_sleeps(text: &str, language: Language) -> Vec<usize> {
    let lines = split_lines(text, language);
    let mut found = Vec::new();
    for (at, line) in lines.iter().enumerate() {
        if !is_sleep_statement(line.code, language) {
            continue;
        }
        // The comment lines right above the sleep (blank lines between them are skipped).
        let mut above = lines[..at].iter().rev().filter(|l| !l.code.is_empty() || !l.comment.is_empty());
        let marked_above =
            above.by_ref().take_while(|l| l.code.is_empty()).any(|l| l.comment.contains(MARKER));
        if line.comment.contains(MARKER) || marked_above {
            continue;
        }
        // The enclosing blocks, innermost first: any polling loop makes the sleep a poll interval.
        let mut indent = line.indent;
        let mut in_poll = false;
        for open in (0..at).rev() {
            let candidate = &lines[open];
            if candidate.code.is_empty() || candidate.indent >= indent || !opens_block(candidate, language) {
                continue;
            }
            indent = candidate.indent;
            if polls(&lines, open) {
                in_poll = true;
                break;
            }
        }
        if in_poll {
            continue;
        }
        // What runs next in the same task: stop where a closure or task body ends.
        let mut seen = 0;
        for next in &lines[at + 1..] {
            if next.code.is_empty() {
                continue;
            }
            let leaves_task = next.indent < line.indent && next.code.starts_with('}') && next.code != "}";
            if next.indent == 0 || leaves_task || seen == WINDOW {
                break;
            }
            seen += 1;
            if next.code.contains("assert") {
                found.push(line.number);
                break;
            }
        }
    }
    found
}

/// The test sources: `tests/` directories, test modules (from the first `#[cfg(test)]` of a
/// file under `src/`, or the whole of a `tests.rs` or a file under `src/**/tests/`), the
/// Python package's tests.
fn test_sources(root: &Path) -> Vec<(PathBuf, Language)> {
    let mut files = Vec::new();
    let mut dirs = vec![root.join("tests"), root.join("src"), root.join("bindings/python")];
    if let Ok(crates) = std::fs::read_dir(root.join("crates")) {
        dirs.extend(crates.flatten().map(|entry| entry.path()));
    }
    while let Some(dir) = dirs.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else { continue };
        for entry in entries.flatten() {
            let path = entry.path();
            let name = entry.file_name().to_string_lossy().into_owned();
            if path.is_dir() {
                if !matches!(name.as_str(), "target" | "node_modules" | ".venv") && !name.starts_with('.') {
                    dirs.push(path);
                }
            } else if name.ends_with(".rs") {
                files.push((path, Language::Rust));
            } else if name.ends_with(".py") && path.components().any(|c| c.as_os_str() == "tests") {
                files.push((path, Language::Python));
            }
        }
    }
    files.sort();
    files
}

/// The part of a source file that is test code.
fn test_part<'a>(root: &Path, path: &Path, text: &'a str) -> (&'a str, usize) {
    let relative = path.strip_prefix(root).unwrap_or(path).to_string_lossy().replace('\\', "/");
    let whole = relative.starts_with("tests/")
        || relative.contains("/tests/")
        || relative.ends_with("tests.rs")
        || relative.ends_with(".py");
    if whole {
        return (text, 0);
    }
    match text.find("#[cfg(test)]") {
        Some(at) => (&text[at..], text[..at].lines().count()),
        None => ("", 0),
    }
}

#[test]
fn tests_wait_on_events_not_on_a_fixed_sleep_followed_by_an_assertion() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut offenders = Vec::new();
    for (path, language) in test_sources(root) {
        let text = std::fs::read_to_string(&path).unwrap_or_default();
        let (part, skipped) = test_part(root, &path, &text);
        for number in fixed_sleeps(part, language) {
            offenders.push(format!(
                "{}:{}",
                path.strip_prefix(root).unwrap_or(&path).display(),
                number + skipped
            ));
        }
    }
    assert!(
        offenders.is_empty(),
        "a fixed sleep followed by an assertion (wait on an event or poll with a deadline; where the \
         sleep is the input under test, say so in a `// {MARKER}` comment above it):\n{}",
        offenders.join("\n")
    );
}

#[cfg(test)]
mod checks {
    use super::{fixed_sleeps, Language};

    fn rust(text: &str) -> Vec<usize> {
        fixed_sleeps(text, Language::Rust)
    }

    #[test]
    fn a_sleep_then_an_assertion_is_found() {
        let text = "async fn t() {\n    spawn_request();\n    tokio::time::sleep(Duration::from_millis(100)).await;\n    let full = send().await;\n    assert_eq!(full.status(), 429);\n}\n";
        assert_eq!(rust(text), [3]);
        let repeated = "fn t() {\n    for _ in 0..5 {\n        send();\n        std::thread::sleep(D);\n    }\n    assert_eq!(n, 5);\n}\n";
        assert_eq!(rust(repeated), [4], "a for loop that cannot exit early does not poll");
    }

    #[test]
    fn polls_sleeps_in_other_tasks_and_marked_inputs_are_not() {
        let poll = "fn t() {\n    loop {\n        if ready() {\n            break;\n        }\n        assert!(Instant::now() < deadline);\n        std::thread::sleep(D);\n    }\n    assert!(x);\n}\n";
        assert_eq!(rust(poll), Vec::<usize>::new());
        let probe = "async fn t() {\n    for _ in 0..100 {\n        if seen() {\n            return;\n        }\n        tokio::time::sleep(D).await;\n    }\n    panic!(\"never\");\n}\n";
        assert_eq!(rust(probe), Vec::<usize>::new());
        let task = "async fn t() {\n    tokio::spawn(async move {\n        tokio::time::sleep(D).await;\n        drop(stream);\n    });\n    assert!(x);\n}\n";
        assert_eq!(rust(task), Vec::<usize>::new());
        let marked = "async fn t() {\n    // fixed sleep: idle for longer than the header timeout\n    tokio::time::sleep(D).await;\n    assert!(served().await);\n}\n";
        assert_eq!(rust(marked), Vec::<usize>::new());
        let marked_long = "async fn t() {\n    // fixed sleep: idle for longer than the header timeout\n    // and shorter than the keep-alive timeout\n    tokio::time::sleep(D).await;\n    assert!(served().await);\n}\n";
        assert_eq!(rust(marked_long), Vec::<usize>::new(), "the marker opens a comment of several lines");
        let marked_earlier = "async fn t() {\n    // fixed sleep: idle\n    tokio::time::sleep(D).await;\n    send();\n    tokio::time::sleep(D).await;\n    assert!(served().await);\n}\n";
        assert_eq!(rust(marked_earlier), [5], "a marker marks only the sleep right below it");
        let select = "async fn t() {\n    tokio::select! {\n        () = tokio::time::sleep(D) => {}\n    }\n    assert!(x);\n}\n";
        assert_eq!(rust(select), Vec::<usize>::new(), "a sleep raced against an event is a deadline");
    }

    #[test]
    fn python_sleeps_follow_the_same_rule() {
        let text = "def test_x():\n    start()\n    time.sleep(0.5)\n    assert running()\n\ndef test_y():\n    for _ in range(200):\n        if ready():\n            break\n        time.sleep(0.05)\n    assert done()\n";
        assert_eq!(fixed_sleeps(text, Language::Python), [3]);
    }
}
