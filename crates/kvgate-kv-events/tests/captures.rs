//! The conformance suite: every capture in `testdata/kv-wire/` (multipart messages recorded from
//! the engines' own publishers, one folder per publisher version, one case per file; see the
//! README there) replayed through the decoder, the feed's sequence logic and the block index, in
//! the order it was received. Each case's holdings (`meta.expected`: the final state and every
//! checkpoint) must come out exactly, every prompt must match what `meta.prompts` says, and every
//! replay the feed asks for must start where the engine's own subscriber asked.
//!
//! A new publisher version is one more folder: the suite picks it up.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytes::Bytes;
use kvgate_index::{
    block_content, Adapter, BlockIndex, CacheBlocks, CacheId, ChainRoot, Namespace, PrefixMatch, Residency,
};
use kvgate_kv_events::{
    block_hash_from_bytes, decode_batch, encode_batch, Feed, Live, Replayed, WireFormat, REPLAY_END,
};
use serde_json::Value;

const WORKER: u32 = 3;

fn captures_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("testdata/kv-wire")
}

/// Every capture file, as (publisher folder, case, path), sorted.
fn captures() -> Vec<(String, String, PathBuf)> {
    let mut all = Vec::new();
    for folder in std::fs::read_dir(captures_dir()).expect("testdata/kv-wire exists") {
        let folder = folder.unwrap().path();
        if !folder.is_dir() {
            continue;
        }
        for file in std::fs::read_dir(&folder).unwrap() {
            let path = file.unwrap().path();
            if path.extension().is_some_and(|ext| ext == "jsonl") {
                let publisher = folder.file_name().unwrap().to_string_lossy().into_owned();
                let case = path.file_stem().unwrap().to_string_lossy().into_owned();
                all.push((publisher, case, path));
            }
        }
    }
    all.sort();
    all
}

pub struct Capture {
    pub meta: Value,
    /// (socket, frames, replay request index) per line after the meta line.
    pub lines: Vec<(String, Vec<Vec<u8>>, Option<usize>)>,
}

pub fn read_capture(path: &Path) -> Capture {
    let text = std::fs::read_to_string(path).unwrap();
    let mut lines = text.lines();
    let meta: Value = serde_json::from_str(lines.next().expect("a meta line")).unwrap();
    let meta = meta["meta"].clone();
    let lines = lines
        .map(|line| {
            let line: Value = serde_json::from_str(line).unwrap();
            let frames =
                line["frames_hex"].as_array().unwrap().iter().map(|h| hex(h.as_str().unwrap())).collect();
            let request = line.get("request").and_then(Value::as_u64).map(|r| r as usize);
            (line["socket"].as_str().unwrap().to_owned(), frames, request)
        })
        .collect();
    Capture { meta, lines }
}

pub fn hex(text: &str) -> Vec<u8> {
    (0..text.len()).step_by(2).map(|i| u8::from_str_radix(&text[i..i + 2], 16).unwrap()).collect()
}

/// A hash as the captures write it (a JSON number, signed or not, or `{"bytes_hex": ..}`) as the
/// decoder reports it.
fn hash_of(value: &Value) -> u64 {
    if let Some(bytes) = value.get("bytes_hex") {
        return block_hash_from_bytes(&hex(bytes.as_str().unwrap()));
    }
    value.as_u64().or_else(|| value.as_i64().map(|v| v as u64)).unwrap_or_else(|| panic!("a hash: {value}"))
}

fn tokens_of(value: &Value) -> Vec<u32> {
    value.as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect()
}

/// The publisher's data-parallel rank (the engine stamps it into each batch too).
fn rank_of(meta: &Value) -> u32 {
    let config = &meta["config"][0];
    config
        .get("data_parallel_rank")
        .or_else(|| config.get("attn_dp_rank"))
        .and_then(Value::as_u64)
        .unwrap_or(0) as u32
}

/// What the expected blocks say a block is, as the index keys and hashes it.
#[derive(Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Held {
    group: u32,
    engine_hash: u64,
    /// `None` for a block whose extra keys kvgate cannot reproduce (checked apart).
    content: Option<u64>,
    residencies: BTreeSet<String>,
}

/// The expected holdings of `rank` in one state (`[{dp_rank, blocks}]`), with each block's
/// content hash computed from its own expected fields (tokens, parent, adapter, salt, lookahead).
fn expected_holdings(state: &Value, rank: u32) -> Vec<Held> {
    let mut out = Vec::new();
    for entry in state.as_array().unwrap() {
        let blocks: Vec<&Value> = entry["blocks"].as_array().unwrap().iter().collect();
        if entry["dp_rank"].as_u64().unwrap() as u32 != rank {
            assert!(blocks.is_empty(), "only the publisher's rank holds blocks");
            continue;
        }
        for block in &blocks {
            let group = block["group_idx"].as_u64().unwrap_or(0) as u32;
            let residencies = block["resident_on"]
                .as_array()
                .unwrap()
                .iter()
                // vLLM 0.10's events have no medium field: the engine's one cache, the GPU.
                .map(|r| r.as_str().unwrap().replace("(no medium field)", "GPU"))
                .collect();
            let engine_hash = hash_of(&block["hash"]);
            out.push(Held { group, engine_hash, content: content(&blocks, group, block), residencies });
        }
    }
    out.sort();
    out
}

/// A block's content hash from its expected fields and its parent's (`None` when it, or a block
/// it chains on, has extra keys kvgate cannot reproduce). A parent no longer held in the group
/// (a sliding window dropped it) is the same hash's block of another group: hybrid groups cache
/// the same blocks.
fn content(blocks: &[&Value], group: u32, block: &Value) -> Option<u64> {
    let (tokens, mut lookahead) = match block["token_ids"].as_array().unwrap().first() {
        Some(first) if first.is_array() => {
            let pairs: Vec<Vec<u32>> = block["token_ids"].as_array().unwrap().iter().map(tokens_of).collect();
            (pairs.iter().map(|pair| pair[0]).collect(), vec![pairs.last().unwrap()[1]])
        }
        _ => (tokens_of(&block["token_ids"]), Vec::new()),
    };
    assert_eq!(tokens.len() as u64, block["block_size"].as_u64().unwrap(), "{block}");
    if let Some(after) = block.get("lookahead_token_ids") {
        lookahead = tokens_of(after);
    }
    let lora_name = block["lora_name"].as_str();
    let adapter = match (lora_name, block["lora_id"].as_i64()) {
        (Some(name), _) => Some(Adapter::Name(name)),
        (None, Some(id)) => Some(Adapter::Id(id)),
        (None, None) => None,
    };
    let extra: Vec<&Value> = block
        .get("extra_keys")
        .and_then(Value::as_array)
        .map(|keys| keys.iter().collect())
        .unwrap_or_default();
    if extra.iter().any(|key| !key.is_string()) {
        return None;
    }
    let parent = if block["parent"].is_null() {
        // vLLM's extra keys: the LoRA name, then the salt (a bare string); SGLang's own field.
        let salt = block["cache_salt"]
            .as_str()
            .or_else(|| extra.iter().filter_map(|key| key.as_str()).find(|key| Some(*key) != lora_name));
        let namespace = Namespace { adapter, cache_salt: salt };
        ChainRoot { namespace, group, lookahead: lookahead.len() as u32 }.hash()
    } else {
        let parent_hash = hash_of(&block["parent"]);
        let same_group = |b: &&&Value| {
            hash_of(&b["hash"]) == parent_hash && b["group_idx"].as_u64().unwrap_or(0) as u32 == group
        };
        let parent = blocks
            .iter()
            .find(same_group)
            .or_else(|| blocks.iter().find(|b| hash_of(&b["hash"]) == parent_hash))
            .unwrap_or_else(|| panic!("the parent of {block}"));
        content(blocks, group, parent)?
    };
    Some(block_content(parent, &tokens, &lookahead, 0))
}

fn actual_holdings(cache: &CacheBlocks, expected: &[Held]) -> Vec<Held> {
    let mut out: Vec<Held> = cache
        .holdings()
        .into_iter()
        .map(|block| {
            let opaque = expected.iter().any(|held| {
                held.group == block.group && held.engine_hash == block.engine_hash && held.content.is_none()
            });
            Held {
                group: block.group,
                engine_hash: block.engine_hash,
                content: (!opaque).then_some(block.content),
                residencies: block.residencies.iter().map(Residency::to_string).collect(),
            }
        })
        .collect();
    out.sort();
    out
}

/// One case replayed: the feed's holdings checked at every checkpoint and at the end.
struct Run {
    index: Arc<BlockIndex>,
    feed: Feed,
    /// Replay requests the feed asked for: (after line, start seq).
    asked: Vec<(usize, u64)>,
}

fn run(capture: &Capture, on_state: &mut dyn FnMut(&Run, Option<u64>)) -> Run {
    let rank = rank_of(&capture.meta);
    let index = Arc::new(BlockIndex::new());
    let cache = CacheBlocks::new(index.clone(), CacheId { worker: WORKER, rank });
    let mut run = Run { index, feed: Feed::new(cache), asked: Vec::new() };
    let mut replaying = false;
    for (i, (socket, frames, _request)) in capture.lines.iter().enumerate() {
        let line_no = i + 2; // the meta line is line 1
        match socket.as_str() {
            "pub" => match run.feed.on_live(frames) {
                Live::Applied | Live::Duplicate => {}
                Live::ReplayFrom(start) => {
                    run.asked.push((line_no, start));
                    replaying = true;
                }
                Live::Dropped(error) => panic!("line {line_no}: {error}"),
            },
            "replay" => {
                if !replaying {
                    // A request the capture's subscriber made on its own (at start, or past
                    // the newest batch): the feed treats it as a resync.
                    run.feed.begin_resync();
                    replaying = true;
                }
                match run.feed.on_replay(frames).unwrap_or_else(|e| panic!("line {line_no}: {e}")) {
                    Replayed::Batch { .. } => {}
                    Replayed::End => {
                        run.feed.end_replay(true);
                        replaying = false;
                    }
                }
            }
            other => panic!("line {line_no}: socket {other}"),
        }
        if !replaying {
            on_state(&run, run.feed.sequence().last());
        }
    }
    assert!(!replaying, "every replay ends with its end marker");
    run
}

fn matched(index: &BlockIndex, tokens: &[u32], namespace: Namespace<'_>) -> usize {
    let mut out = PrefixMatch::default();
    index.overlap(tokens, namespace, &mut out);
    out.matched(WORKER)
}

/// The prompt's lookups in the state after `after_seq` (`None`: the final state).
fn check_prompts(publisher: &str, meta: &Value, index: &BlockIndex, after_seq: Option<u64>) {
    let Some(prompts) = meta.get("prompts").and_then(Value::as_object) else { return };
    for (name, prompt) in prompts {
        let tokens = tokens_of(prompt.get("token_ids").or_else(|| prompt.get("raw_token_ids")).unwrap());
        let expected = match after_seq {
            None => prompt.get("expected_match_tokens"),
            Some(seq) => prompt.get(format!("expected_match_tokens_after_seq_{seq}").as_str()),
        };
        let lora = prompt["lora_name"].as_str();
        let salt = prompt["cache_salt"].as_str();
        // vLLM 0.10 names a LoRA's blocks by its integer id only, which no request can name (the
        // capture notes its engine could not even publish them): looked up by that id here.
        let lora_id = meta["lora_request"]["lora_int_id"].as_i64().filter(|_| publisher == "vllm-0.10.1.1");
        let adapter = match (lora, lora_id) {
            (Some(_), Some(id)) => Some(Adapter::Id(id)),
            (Some(name), None) => Some(Adapter::Name(name)),
            (None, _) => None,
        };
        let namespace = Namespace { adapter, cache_salt: salt };
        let got = matched(index, &tokens, namespace);
        if let Some(expected) = expected {
            assert_eq!(got as u64, expected.as_u64().unwrap(), "prompt {name} after {after_seq:?}");
        }
        if after_seq.is_some() {
            continue;
        }
        // Never a LoRA's or a salted block for a base, unsalted prompt; never an image's block
        // for a prompt without the image (the gateway cannot name it).
        if adapter.is_some() || salt.is_some() {
            assert_eq!(matched(index, &tokens, Namespace::BASE), 0, "prompt {name} as a base prompt");
        }
        if let (Some(name), Some(_)) = (lora, lora_id) {
            assert_eq!(matched(index, &tokens, Namespace::adapter(name)), 0, "a LoRA id is not its name");
        }
        if prompt.get("mm").is_some() {
            assert_eq!(got, 0, "prompt {name}: its image's blocks are not the gateway's to claim");
        }
    }
}

#[test]
fn every_capture_gives_its_expected_holdings() {
    let all = captures();
    let publishers: BTreeSet<&str> = all.iter().map(|(publisher, ..)| publisher.as_str()).collect();
    assert!(
        ["sglang-0.5.23", "vllm-0.10.1.1", "vllm-0.25.0", "vllm-0.33.0"]
            .iter()
            .all(|p| publishers.contains(p)),
        "{publishers:?}"
    );
    assert!(all.len() >= 40, "{} captures", all.len());
    for (publisher, case, path) in &all {
        let capture = read_capture(path);
        let meta = &capture.meta;
        assert_eq!(meta["case"].as_str(), Some(case.as_str()));
        let rank = rank_of(meta);
        let expected = &meta["expected"];
        let mut checkpoints: Vec<(u64, &Value)> = expected
            .get("checkpoints")
            .and_then(Value::as_array)
            .map(|points| {
                points
                    .iter()
                    .map(|point| {
                        let after = point["after"].as_str().unwrap();
                        let seq = after.strip_prefix("seq ").unwrap().parse().unwrap();
                        (seq, &point["state"])
                    })
                    .collect()
            })
            .unwrap_or_default();
        let mut seen = Vec::new();
        let finished = run(&capture, &mut |run, last| {
            let Some(last) = last else { return };
            if let Some(at) = checkpoints.iter().position(|(seq, _)| *seq == last) {
                let (seq, state) = checkpoints.remove(at);
                let want = expected_holdings(state, rank);
                let got = actual_holdings(run.feed.cache(), &want);
                assert_eq!(got, want, "{publisher}/{case} after seq {seq}");
                check_prompts(publisher, meta, &run.index, Some(seq));
                seen.push(seq);
            }
        });
        assert!(checkpoints.is_empty(), "{publisher}/{case}: checkpoints never reached: {checkpoints:?}");
        let want = expected_holdings(&expected["final"], rank);
        let got = actual_holdings(finished.feed.cache(), &want);
        assert_eq!(got, want, "{publisher}/{case} final");
        check_prompts(publisher, meta, &finished.index, None);
        // Every replay the feed asked for is the one the capture's subscriber sent.
        for (line, start) in &finished.asked {
            let request = meta["replay_requests"]
                .as_array()
                .and_then(|requests| {
                    requests.iter().find(|r| r["sent_after_line"].as_u64() == Some(*line as u64))
                })
                .unwrap_or_else(|| {
                    panic!("{publisher}/{case}: the feed asked for a replay after line {line}")
                });
            assert_eq!(request["start_seq"].as_u64(), Some(*start), "{publisher}/{case}");
        }
        // Nothing refused, nothing malformed: these are the engines' own events.
        let mut finished = finished;
        let counts = finished.feed.take_counts();
        assert_eq!((counts.refused, counts.malformed), (vec![], 0), "{publisher}/{case}");
        // The hash cases list every value (both sides of 2^63, negative ones): the first store
        // carries them as the decoder reads them.
        if let Some(hashes) = meta.get("hashes").and_then(Value::as_array) {
            let (_, batch) = kvgate_kv_events::decode_message(&capture.lines[0].1).unwrap();
            let kvgate_kv_events::KvEvent::BlockStored(stored) = &batch.events[0] else {
                panic!("{batch:?}")
            };
            let want: Vec<u64> = hashes.iter().map(|h| hash_of(&h["hash"])).collect();
            assert_eq!(stored.block_hashes, want, "{publisher}/{case}");
        }
    }
}

/// The encoder against the engines' own bytes: every captured payload decoded and encoded again
/// in its publisher's format is byte-identical (a payload with `bytes` hashes decodes to the same
/// events: the decoder keeps their 64-bit digest, not the bytes), and every message's frames are
/// the ones the format builds.
#[test]
fn the_encoder_writes_what_each_engine_writes() {
    let mut identical = 0;
    for (publisher, case, path) in captures() {
        let format = WireFormat::ALL
            .into_iter()
            .find(|format| format.publisher() == publisher)
            .unwrap_or_else(|| panic!("no wire format for {publisher}"));
        let capture = read_capture(&path);
        let topic = capture.meta["config"][0]
            .get("KVEventsConfig")
            .or_else(|| capture.meta["config"][0].get("kv_events_config"))
            .and_then(|config| config["topic"].as_str())
            .unwrap_or("")
            .as_bytes()
            .to_vec();
        let bytes_hashes = case == "hashes-bytes";
        for (i, (socket, frames, _)) in capture.lines.iter().enumerate() {
            let at = format!("{publisher}/{case} line {}", i + 2);
            let (seq, payload) = match socket.as_str() {
                "pub" => (frames[1].clone(), frames[2].clone()),
                _ if frames[frames.len() - 2] == REPLAY_END.to_be_bytes() => {
                    let end: Vec<Vec<u8>> = format.replay_end().iter().map(|f| f.to_vec()).collect();
                    assert_eq!(&frames[1..], &end[..], "{at}: the end marker");
                    continue;
                }
                _ => (frames[frames.len() - 2].clone(), frames[frames.len() - 1].clone()),
            };
            let seq = u64::from_be_bytes(seq.try_into().unwrap());
            let batch = decode_batch(&payload).unwrap();
            let encoded = encode_batch(&batch, format);
            assert_eq!(decode_batch(&encoded).unwrap(), batch, "{at}: decodes to the same batch");
            if !bytes_hashes {
                assert_eq!(hex_of(&encoded), hex_of(&payload), "{at}: byte-identical");
                identical += 1;
            }
            let rebuilt: Vec<Vec<u8>> = match socket.as_str() {
                "pub" => format.message(&topic, seq, payload.clone().into()),
                _ => [vec![Bytes::new()], format.replay_reply(&topic, seq, payload.clone().into())].concat(),
            }
            .iter()
            .map(|f| f.to_vec())
            .collect();
            assert_eq!(&rebuilt, frames, "{at}: frames");
        }
    }
    assert!(identical > 80, "{identical} payloads compared byte for byte");
}

fn hex_of(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn capture(publisher: &str, case: &str) -> Capture {
    read_capture(&captures_dir().join(publisher).join(format!("{case}.jsonl")))
}

/// Regression: from vLLM 0.26 on (and in SGLang 0.5) replay replies carry the topic frame, four
/// frames as a DEALER sees them; the decoder read two or three, so a gateway started after the
/// engines learned nothing and every gap cleared the worker.
#[test]
fn regression_replay_replies_have_four_frames() {
    for publisher in ["vllm-0.33.0", "sglang-0.5.23"] {
        let capture = capture(publisher, "replay-topic");
        let replies: Vec<&Vec<Vec<u8>>> = capture
            .lines
            .iter()
            .filter(|(socket, ..)| socket == "replay")
            .map(|(_, frames, _)| frames)
            .collect();
        assert!(replies.iter().all(|frames| frames.len() == 4), "{publisher}");
        let index = Arc::new(BlockIndex::new());
        let mut feed = Feed::new(CacheBlocks::new(index, CacheId { worker: WORKER, rank: 0 }));
        for (socket, frames, _) in &capture.lines {
            match socket.as_str() {
                "pub" => {
                    if let Live::ReplayFrom(start) = feed.on_live(frames) {
                        assert_eq!(start, 2, "{publisher}: seq 2 and 3 were missed");
                    }
                }
                _ => {
                    if feed.on_replay(frames).unwrap() == Replayed::End {
                        feed.end_replay(true);
                    }
                }
            }
        }
        let counts = feed.take_counts();
        assert_eq!(
            counts.gaps,
            [(kvgate_kv_events::Recovery::Replayed, 1)],
            "{publisher}: recovered, not cleared"
        );
        assert_eq!(feed.cache().len(), 15, "{publisher}: S0-S4");
    }
}

/// Regression: vLLM 0.33's offloading connector sends `BlockStored(token_ids=[], block_size=0)`
/// in the same batch as the GPU stores; the whole batch was refused and the worker cleared.
#[test]
fn regression_offload_placeholders_do_not_spoil_their_batch() {
    let capture = capture("vllm-0.33.0", "offload-placeholder");
    let (_, batch) = kvgate_kv_events::decode_message(&capture.lines[0].1).unwrap();
    assert_eq!(batch.events.len(), 3, "the GPU store and two placeholders");
    let index = Arc::new(BlockIndex::new());
    let mut cache = CacheBlocks::new(index.clone(), CacheId { worker: WORKER, rank: 0 });
    let mut refused = Vec::new();
    kvgate_kv_events::apply_batch(&mut cache, &batch, &mut |refusal| refused.push(refusal));
    assert_eq!(refused, []);
    let tiers: Vec<usize> = cache.holdings().iter().map(|block| block.residencies.len()).collect();
    assert_eq!(cache.len(), 4, "A0-A3, and no block of the placeholders' own");
    assert_eq!(tiers.iter().filter(|&&n| n == 2).count(), 2, "A1 and A3 also on the CPU: {tiers:?}");
    let prompt = tokens_of(&capture.meta["prompts"]["A"]["token_ids"]);
    assert_eq!(matched(&index, &prompt, Namespace::BASE), 64);
}

/// Regression: SGLang with EAGLE publishes bigram token ids (`[[t0, t1], [t1, t2], ...]`); the
/// batch was refused and the cache cleared.
#[test]
fn regression_eagle_bigrams_are_indexed() {
    let capture = capture("sglang-0.5.23", "bigram");
    let (_, batch) = kvgate_kv_events::decode_message(&capture.lines[0].1).unwrap();
    let index = Arc::new(BlockIndex::new());
    let mut cache = CacheBlocks::new(index.clone(), CacheId { worker: WORKER, rank: 0 });
    let mut refused = Vec::new();
    kvgate_kv_events::apply_batch(&mut cache, &batch, &mut |refusal| refused.push(refusal));
    assert_eq!((refused, cache.len()), (vec![], 3));
    let raw = tokens_of(&capture.meta["prompts"]["A"]["raw_token_ids"]);
    assert_eq!(matched(&index, &raw, Namespace::BASE), 48, "49 raw tokens: 3 pages of 16 bigrams");
    assert_eq!(matched(&index, &raw[..48], Namespace::BASE), 32, "the third page needs token 48 after it");
}
