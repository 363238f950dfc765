//! Workload traces: parsing Mooncake jsonl, turning a line into prompt tokens or prompt text with the same prefix structure, and the trace's infinite-cache ceiling (the pooled references are in `reference.rs`).
//!
//! A line may name its session (`session_id`, a string or an integer) and the think or tool time
//! after the previous turn's answer (`think_ms`, or AIPerf's name `delay`): the replayers then
//! send that turn only once the previous one of its session has been answered
//! ([`crate::SessionSchedule`]). A later turn with a `think_ms` may leave out its `timestamp`: it
//! is then the previous line of its session's timestamp plus the think time.
//!
//! A Mooncake line names its prompt as a list of `hash_ids`, each a block of
//! [`MOONCAKE_BLOCK_TOKENS`] tokens; `input_length` is authoritative, so the last block may be
//! partial. Token `j` of block `b` is the word [`block_word`]`(b, j)`, and its id is the simulated
//! engines' [`kvgate_words::token_id`] of that word: the simulator routes on exactly the tokens
//! that a simulated engine computes from the text that `kvgate replay` sends ([`prompt_text`]).
//! Equal block ids give equal words; different ids give words that differ from the first one.

use std::collections::{HashMap, HashSet};
use std::io::BufRead;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// Tokens named by one Mooncake `hash_id`.
pub const MOONCAKE_BLOCK_TOKENS: usize = 512;

/// Trace file formats.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
#[clap(rename_all = "snake_case")]
pub enum TraceFormat {
    /// One JSON object per line: `timestamp` (ms), `input_length`, `output_length`, `hash_ids`.
    #[default]
    Mooncake,
}

/// One request of a trace.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct TraceRequest {
    /// Arrival time in milliseconds from the trace's epoch.
    pub timestamp_ms: f64,
    /// Prompt tokens.
    pub input_length: u32,
    /// Tokens to generate (at least 1).
    pub output_length: u32,
    /// Prefix blocks of [`MOONCAKE_BLOCK_TOKENS`] tokens.
    pub hash_ids: Vec<u64>,
    /// The tenant the request is for (the line's optional `tenant`; `kvgate replay` sends it as
    /// the tenant header, `kvgate sim` queues by it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    /// Its priority class (the line's optional `priority`: `high`, `normal` or `low`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<String>,
    /// The session the request is a turn of (the line's optional `session_id`): its turns are
    /// sent one at a time, each once the previous one is answered (closed loop).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_id: Option<String>,
    /// Milliseconds from the previous turn's answer to this turn (the line's optional `think_ms`,
    /// or `delay`): the user's think time or the agent's tool time. Without it a later turn is
    /// sent at its timestamp, or when the previous answer ends if that is later.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub think_ms: Option<f64>,
}

/// A parsed trace, in file order (arrival order is by timestamp, ties in file order).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Trace {
    pub requests: Vec<TraceRequest>,
}

/// Why a trace could not be read. Line numbers start at 1.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    #[error("reading trace {path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("trace line {line}: {message}")]
    Line { line: usize, message: String },
    #[error("the trace has no requests")]
    Empty,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct MooncakeLine {
    #[serde(default)]
    timestamp: Option<f64>,
    input_length: u64,
    output_length: u64,
    hash_ids: Vec<u64>,
    #[serde(default)]
    tenant: Option<String>,
    #[serde(default, alias = "class")]
    priority: Option<String>,
    #[serde(default)]
    session_id: Option<serde_json::Value>,
    #[serde(default, alias = "delay")]
    think_ms: Option<f64>,
}

/// A line's `session_id`: a non-empty string, or an integer (written as its decimal digits).
fn session_id(value: Option<serde_json::Value>) -> Result<Option<String>, String> {
    match value {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(serde_json::Value::String(text)) if !text.is_empty() => Ok(Some(text)),
        Some(serde_json::Value::Number(number)) if number.is_i64() || number.is_u64() => {
            Ok(Some(number.to_string()))
        }
        Some(other) => Err(format!("session_id must be a non-empty string or an integer, got {other}")),
    }
}

impl Trace {
    /// Reads a trace file.
    pub fn load(path: &Path, format: TraceFormat) -> Result<Trace, TraceError> {
        let file = std::fs::File::open(path)
            .map_err(|source| TraceError::Io { path: path.to_path_buf(), source })?;
        match format {
            TraceFormat::Mooncake => {
                Trace::parse_mooncake(std::io::BufReader::new(file)).map_err(|error| match error {
                    TraceError::Io { source, .. } => TraceError::Io { path: path.to_path_buf(), source },
                    other => other,
                })
            }
        }
    }

    /// Parses Mooncake jsonl. Blank lines are skipped; every other problem names its line.
    pub fn parse_mooncake(reader: impl BufRead) -> Result<Trace, TraceError> {
        let mut requests = Vec::new();
        // Each session's latest timestamp in file order (a later turn may be timed from it).
        let mut session_times: HashMap<String, f64> = HashMap::new();
        for (index, line) in reader.lines().enumerate() {
            let line_no = index + 1;
            let line = line.map_err(|source| TraceError::Io { path: PathBuf::new(), source })?;
            if line.trim().is_empty() {
                continue;
            }
            let bad = |message: String| TraceError::Line { line: line_no, message };
            let raw: MooncakeLine = serde_json::from_str(&line).map_err(|e| bad(e.to_string()))?;
            let session_id = session_id(raw.session_id).map_err(bad)?;
            if let Some(think_ms) = raw.think_ms {
                if !(think_ms.is_finite() && think_ms >= 0.0) {
                    return Err(bad(format!("think_ms must be a finite number >= 0, got {think_ms}")));
                }
                if session_id.is_none() {
                    return Err(bad("think_ms (or delay) needs a session_id: the turn it follows".into()));
                }
            }
            let previous = session_id.as_ref().and_then(|session| session_times.get(session)).copied();
            let timestamp = match (raw.timestamp, previous, raw.think_ms) {
                (Some(timestamp), _, _) => timestamp,
                (None, Some(previous), Some(think_ms)) => previous + think_ms,
                (None, _, _) => {
                    return Err(bad("missing field `timestamp` (only a later turn of a session with a \
                                    think_ms may leave it out)"
                        .into()))
                }
            };
            if !(timestamp.is_finite() && timestamp >= 0.0) {
                return Err(bad(format!("timestamp must be a finite number >= 0, got {timestamp}")));
            }
            if let Some(session) = &session_id {
                session_times.insert(session.clone(), timestamp);
            }
            let input_length = u32::try_from(raw.input_length).ok().filter(|&n| n > 0).ok_or_else(|| {
                bad(format!("input_length must be in 1..=2^32-1, got {}", raw.input_length))
            })?;
            let output_length = u32::try_from(raw.output_length)
                .map_err(|_| bad(format!("output_length {} is too large", raw.output_length)))?
                .max(1);
            let covered = raw.hash_ids.len() * MOONCAKE_BLOCK_TOKENS;
            if covered < input_length as usize {
                return Err(bad(format!(
                    "{} hash_ids cover {covered} tokens but input_length is {input_length}",
                    raw.hash_ids.len()
                )));
            }
            requests.push(TraceRequest {
                timestamp_ms: timestamp,
                input_length,
                output_length,
                hash_ids: raw.hash_ids,
                tenant: raw.tenant,
                priority: raw.priority,
                session_id,
                think_ms: raw.think_ms,
            });
        }
        if requests.is_empty() {
            return Err(TraceError::Empty);
        }
        Ok(Trace { requests })
    }

    /// Indices of the requests in arrival order (by timestamp, ties in file order).
    pub fn arrival_order(&self) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.requests.len()).collect();
        order.sort_by(|&a, &b| self.requests[a].timestamp_ms.total_cmp(&self.requests[b].timestamp_ms));
        order
    }

    /// The first `n` requests in arrival order (all when `n` is `None`).
    pub fn truncated(&self, n: Option<usize>) -> Trace {
        let mut order = self.arrival_order();
        order.truncate(n.unwrap_or(usize::MAX));
        Trace { requests: order.into_iter().map(|i| self.requests[i].clone()).collect() }
    }

    /// What an engine with an infinite prefix cache could serve from cache, replaying the
    /// requests in arrival order: for each request, the tokens of its leading blocks whose whole
    /// prefix (this block and every block before it) was part of an earlier request.
    pub fn cache_ceiling(&self) -> CacheCeiling {
        let mut seen: HashSet<u64> = HashSet::new();
        let mut ceiling = CacheCeiling::default();
        for index in self.arrival_order() {
            let request = &self.requests[index];
            let chain = prefix_chain(&request.hash_ids);
            let matched = chain.iter().take_while(|hash| seen.contains(hash)).count();
            let cached = (matched * MOONCAKE_BLOCK_TOKENS).min(request.input_length as usize);
            ceiling.cached_tokens += cached as u64;
            ceiling.prompt_tokens += u64::from(request.input_length);
            seen.extend(chain);
        }
        ceiling
    }
}

/// The infinite-cache ceiling of a trace.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct CacheCeiling {
    pub cached_tokens: u64,
    pub prompt_tokens: u64,
}

impl CacheCeiling {
    /// Cached over prompt tokens, in [0, 1].
    pub fn rate(&self) -> f64 {
        if self.prompt_tokens == 0 {
            0.0
        } else {
            self.cached_tokens as f64 / self.prompt_tokens as f64
        }
    }
}

/// One hash per leading run of blocks: `chain[k]` identifies `hash_ids[..=k]`.
pub fn prefix_chain(hash_ids: &[u64]) -> Vec<u64> {
    let mut parent = 0x243f_6a88_85a3_08d3u64;
    hash_ids
        .iter()
        .map(|&id| {
            parent = kvgate_words::splitmix64(parent ^ kvgate_words::splitmix64(id));
            parent
        })
        .collect()
}

const HEX: &[u8; 16] = b"0123456789abcdef";
const LETTERS: &[u8; 26] = b"abcdefghijklmnopqrstuvwxyz";

/// Appends the word's block part: two letters drawn from the block id's hash (so that texts of
/// different blocks differ from the first character, usually), the id in hex, and a dot.
fn push_block_prefix(block: u64, out: &mut Vec<u8>) {
    let mixed = kvgate_words::splitmix64(block);
    out.push(LETTERS[(mixed % 26) as usize]);
    out.push(LETTERS[((mixed >> 8) % 26) as usize]);
    push_hex(block, out);
    out.push(b'.');
}

fn push_hex(mut value: u64, out: &mut Vec<u8>) {
    let start = out.len();
    loop {
        out.push(HEX[(value & 15) as usize]);
        value >>= 4;
        if value == 0 {
            break;
        }
    }
    out[start..].reverse();
}

/// The word of token `j` of block `block`, e.g. `qk1f.a3`: unique per `(block, j)`.
pub fn block_word(block: u64, j: usize) -> String {
    let mut bytes = Vec::with_capacity(24);
    push_block_prefix(block, &mut bytes);
    push_hex(j as u64, &mut bytes);
    String::from_utf8(bytes).expect("ASCII")
}

const FNV_OFFSET: u32 = 0x811c_9dc5;
const FNV_PRIME: u32 = 0x0100_0193;

fn fnv_continue(mut hash: u32, bytes: &[u8]) -> u32 {
    for &byte in bytes {
        hash ^= u32::from(byte);
        hash = hash.wrapping_mul(FNV_PRIME);
    }
    hash
}

/// Appends the prompt's token ids: `kvgate_words::token_id(&block_word(b, j))` for every token,
/// `input_length` in all. FNV-1a is streamed: the block part is hashed once per block.
pub fn extend_prompt_tokens(request: &TraceRequest, out: &mut Vec<u32>) {
    let total = request.input_length as usize;
    out.reserve(total);
    let mut prefix = Vec::with_capacity(24);
    let mut digits = Vec::with_capacity(8);
    for (index, &block) in request.hash_ids.iter().enumerate() {
        let start = index * MOONCAKE_BLOCK_TOKENS;
        if start >= total {
            break;
        }
        prefix.clear();
        push_block_prefix(block, &mut prefix);
        let state = fnv_continue(FNV_OFFSET, &prefix);
        for j in 0..MOONCAKE_BLOCK_TOKENS.min(total - start) {
            digits.clear();
            push_hex(j as u64, &mut digits);
            out.push(fnv_continue(state, &digits));
        }
    }
}

/// The prompt's token ids (see [`extend_prompt_tokens`]).
pub fn prompt_tokens(request: &TraceRequest) -> Vec<u32> {
    let mut tokens = Vec::new();
    extend_prompt_tokens(request, &mut tokens);
    tokens
}

/// The prompt as text: the words of [`prompt_tokens`] separated by single spaces, so that the
/// simulated engines' tokenizer (one word, one token) turns it into exactly those tokens.
pub fn prompt_text(request: &TraceRequest) -> String {
    let total = request.input_length as usize;
    let mut text = Vec::with_capacity(total * 12);
    let mut prefix = Vec::with_capacity(24);
    for (index, &block) in request.hash_ids.iter().enumerate() {
        let start = index * MOONCAKE_BLOCK_TOKENS;
        if start >= total {
            break;
        }
        prefix.clear();
        push_block_prefix(block, &mut prefix);
        for j in 0..MOONCAKE_BLOCK_TOKENS.min(total - start) {
            if !text.is_empty() {
                text.push(b' ');
            }
            text.extend_from_slice(&prefix);
            push_hex(j as u64, &mut text);
        }
    }
    String::from_utf8(text).expect("ASCII")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Trace, TraceError> {
        Trace::parse_mooncake(text.as_bytes())
    }

    fn request(input_length: u32, hash_ids: &[u64]) -> TraceRequest {
        TraceRequest {
            timestamp_ms: 0.0,
            input_length,
            output_length: 1,
            hash_ids: hash_ids.to_vec(),
            ..Default::default()
        }
    }

    #[test]
    fn parses_lines_and_clamps_output() {
        let trace = parse(
            "{\"timestamp\": 0, \"input_length\": 600, \"output_length\": 0, \"hash_ids\": [1, 2]}\n\n\
             {\"timestamp\": 12.5, \"input_length\": 10, \"output_length\": 7, \"hash_ids\": [1]}\n",
        )
        .unwrap();
        assert_eq!(trace.requests.len(), 2);
        assert_eq!(trace.requests[0].output_length, 1);
        assert_eq!(trace.requests[1].timestamp_ms, 12.5);
    }

    #[track_caller]
    fn check_error(text: &str, line: usize, needle: &str) {
        match parse(text) {
            Err(TraceError::Line { line: got, message }) => {
                assert_eq!(got, line, "{message}");
                assert!(message.contains(needle), "{message:?} lacks {needle:?}");
                let shown = TraceError::Line { line: got, message }.to_string();
                assert!(shown.starts_with(&format!("trace line {line}:")), "{shown}");
            }
            other => panic!("expected an error on line {line}, got {other:?}"),
        }
    }

    #[test]
    fn errors_name_the_line() {
        let good = "{\"timestamp\": 0, \"input_length\": 5, \"output_length\": 1, \"hash_ids\": [1]}\n";
        check_error(&format!("{good}{good}{{\"timestamp\": 0,"), 3, "EOF");
        check_error(&format!("{good}\n{{\"timestamp\": 1, \"input_length\": 5}}"), 3, "output_length");
        check_error(
            &format!(
                "{good}{{\"timestamp\": 1, \"input_length\": 1000, \"output_length\": 1, \"hash_ids\": [1]}}"
            ),
            2,
            "cover 512 tokens",
        );
        check_error(
            "{\"timestamp\": -1, \"input_length\": 5, \"output_length\": 1, \"hash_ids\": [1]}",
            1,
            ">= 0",
        );
        check_error(
            "{\"timestamp\": 1, \"input_length\": 0, \"output_length\": 1, \"hash_ids\": [1]}",
            1,
            "input_length",
        );
        check_error(
            "{\"timestamp\": 1, \"input_length\": 1, \"output_length\": 1, \"hash_ids\": [1], \"x\": 2}",
            1,
            "x",
        );
        assert!(matches!(parse("\n\n"), Err(TraceError::Empty)));
    }

    #[test]
    fn sessions_and_think_times_are_read_and_checked() {
        let trace = parse(
            "{\"timestamp\": 0, \"input_length\": 5, \"output_length\": 1, \"hash_ids\": [1], \"session_id\": \"a\"}\n\
             {\"timestamp\": 3, \"input_length\": 5, \"output_length\": 1, \"hash_ids\": [2], \"session_id\": 7}\n\
             {\"input_length\": 9, \"output_length\": 1, \"hash_ids\": [1], \"session_id\": \"a\", \"delay\": 250}\n\
             {\"timestamp\": 4, \"input_length\": 5, \"output_length\": 1, \"hash_ids\": [3]}\n\
             {\"timestamp\": 9, \"input_length\": 5, \"output_length\": 1, \"hash_ids\": [2], \"session_id\": 7, \"think_ms\": 1.5}\n",
        )
        .unwrap();
        let sessions: Vec<_> = trace.requests.iter().map(|r| r.session_id.as_deref()).collect();
        assert_eq!(sessions, [Some("a"), Some("7"), Some("a"), None, Some("7")]);
        let thinks: Vec<_> = trace.requests.iter().map(|r| r.think_ms).collect();
        assert_eq!(thinks, [None, None, Some(250.0), None, Some(1.5)]);
        // A later turn without a timestamp: its session's previous line's plus its think time.
        assert_eq!(trace.requests[2].timestamp_ms, 250.0);
        assert_eq!(trace.requests[4].timestamp_ms, 9.0, "an explicit timestamp stays");
        let line = |extra: &str| {
            format!(
                "{{\"timestamp\": 1, \"input_length\": 5, \"output_length\": 1, \"hash_ids\": [1]{extra}}}"
            )
        };
        check_error(&line(", \"think_ms\": 5"), 1, "needs a session_id");
        check_error(&line(", \"session_id\": \"s\", \"think_ms\": -1"), 1, "think_ms must be");
        for bad in ["true", "1.5", "\"\"", "[1]"] {
            check_error(&line(&format!(", \"session_id\": {bad}")), 1, "session_id must be");
        }
        check_error(
            "{\"input_length\": 5, \"output_length\": 1, \"hash_ids\": [1], \"session_id\": \"s\", \"think_ms\": 5}",
            1,
            "missing field `timestamp`",
        );
    }

    #[test]
    fn tokens_match_the_engine_tokenizer_of_the_text() {
        let request = request(1200, &[7, 300, 9]);
        let tokens = prompt_tokens(&request);
        assert_eq!(tokens.len(), 1200);
        assert_eq!(kvgate_words::tokenize(&prompt_text(&request)), tokens);
        assert_eq!(tokens[513], kvgate_words::token_id(&block_word(300, 1)));
    }

    #[test]
    fn equal_blocks_share_tokens_and_different_blocks_do_not() {
        let a = prompt_tokens(&request(1024, &[1, 2]));
        let b = prompt_tokens(&request(700, &[1, 2]));
        let c = prompt_tokens(&request(1024, &[1, 3]));
        let d = prompt_tokens(&request(1024, &[4, 2]));
        assert_eq!(a[..700], b[..]);
        assert_eq!(a[..512], c[..512]);
        assert!(a[512..].iter().zip(&c[512..]).all(|(x, y)| x != y));
        assert_ne!(a[0], d[0]);
        assert_ne!(block_word(1, 0), block_word(16, 0));
    }

    #[test]
    fn ceiling_counts_leading_blocks_seen_before() {
        let trace = Trace {
            requests: vec![
                request(1024, &[1, 2]),
                request(1536, &[1, 2, 3]), // 1024 of 1536
                request(1024, &[5, 2]),    // 0: block 2 follows another prefix here
                request(600, &[1, 2]),     // 600: a prefix of an earlier prompt
            ],
        };
        let ceiling = trace.cache_ceiling();
        assert_eq!(ceiling, CacheCeiling { cached_tokens: 1624, prompt_tokens: 4184 });
    }

    #[test]
    fn arrival_order_is_by_time_then_file_order() {
        let mut trace = Trace { requests: vec![request(1, &[1]), request(1, &[2]), request(1, &[3])] };
        trace.requests[0].timestamp_ms = 5.0;
        assert_eq!(trace.arrival_order(), [1, 2, 0]);
        assert_eq!(trace.truncated(Some(1)).requests[0].hash_ids, [2]);
    }
}
