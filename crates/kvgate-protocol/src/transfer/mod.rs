//! The request fields that steer an engine's KV transfer, which only the gateway sets: SGLang's
//! `bootstrap_host`, `bootstrap_port`, `bootstrap_room`, `bootstrap_pair_key`, `decode_tp_size`
//! and `disagg_prefill_dp_rank` (`python/sglang/srt/managers/io_struct.py`, `GenerateReqInput`,
//! and the OpenAI requests of `entrypoints/openai/protocol.py`, 0.5.x: where a decode engine
//! pulls its KV from) and vLLM's `kv_transfer_params` (read by the KV connectors:
//! `do_remote_prefill` with `remote_host`/`remote_port` make a decode engine pull from there). A
//! client's values would make an engine connect where the client chose, so they are taken out
//! of every request before any path (regular, a pair, in place, the fallback in place) sends it;
//! a pair's are then the gateway's own: the writers here ([`sglang_bootstrap`],
//! [`vllm_prefill`], [`vllm_decode`]) beside the engine side's reader ([`PdRequest`]) and the
//! prefill engine's answer ([`vllm_prefill_answer`], [`params_of_prefill_answer`]).

mod read;

use std::ops::Range;

use bytes::Bytes;
use serde_json::{json, Value};

pub use read::{KvSource, PdRequest};

use crate::edit::{edit_body, EditError, FieldEdit};

/// The KV-transfer fields of both protocols.
pub const TRANSFER_FIELDS: [&str; 7] = [
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
    "bootstrap_pair_key",
    "decode_tp_size",
    "disagg_prefill_dp_rank",
    "kv_transfer_params",
];

/// `body` (a JSON object known to carry at least one of [`TRANSFER_FIELDS`], escaped key
/// spellings included: `RequestFields` decoded them) without those fields; the rest is kept,
/// re-serialized.
pub fn strip(body: &[u8]) -> Result<Bytes, EditError> {
    edit_body(body, &TRANSFER_FIELDS.map(FieldEdit::Remove))
}

/// SGLang: the same request to both sides, naming the prefill engine's bootstrap server and a
/// room (`bootstrap_host`, `bootstrap_port`, `bootstrap_room`).
pub fn sglang_bootstrap(host: &str, port: Option<u16>, room: u64) -> [FieldEdit<'static>; 3] {
    [
        FieldEdit::Set("bootstrap_host", Value::from(host)),
        FieldEdit::Set("bootstrap_port", port.map_or(Value::Null, Value::from)),
        FieldEdit::Set("bootstrap_room", Value::from(room)),
    ]
}

/// vLLM, first step: the prefill engine computes the prompt's KV and one token, keeps the KV for
/// a decode engine (`kv_transfer_params.do_remote_decode`), and answers whole.
pub fn vllm_prefill() -> [FieldEdit<'static>; 5] {
    [
        FieldEdit::Set("max_tokens", Value::from(1)),
        FieldEdit::Replace("max_completion_tokens", Value::from(1)),
        FieldEdit::Set("stream", Value::Bool(false)),
        FieldEdit::Remove("stream_options"),
        FieldEdit::Set(
            "kv_transfer_params",
            json!({"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null,
                   "remote_block_ids": null, "remote_host": null, "remote_port": null}),
        ),
    ]
}

/// vLLM, second step: the decode engine pulls the KV the prefill answer's `params` name.
pub fn vllm_decode(params: Value) -> [FieldEdit<'static>; 1] {
    [FieldEdit::Set("kv_transfer_params", params)]
}

/// Where a vLLM prefill engine keeps a request's KV for the decode engine.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RemotePrefill<'a> {
    pub engine_id: &'a str,
    pub block_ids: Range<u64>,
    pub host: &'a str,
    pub port: u16,
    pub request_id: &'a str,
}

/// The `kv_transfer_params` a vLLM prefill engine's answer carries (NixlConnector's
/// `request_finished`): what the decode request then sends ([`vllm_decode`]).
pub fn vllm_prefill_answer(remote: &RemotePrefill<'_>) -> Value {
    json!({
        "do_remote_prefill": true,
        "do_remote_decode": false,
        "remote_engine_id": remote.engine_id,
        "remote_block_ids": remote.block_ids.clone().collect::<Vec<u64>>(),
        "remote_host": remote.host,
        "remote_port": remote.port,
        "remote_request_id": remote.request_id,
        "tp_size": 1,
    })
}

/// The `kv_transfer_params` object of a vLLM prefill answer, if it carries one.
pub fn params_of_prefill_answer(answer: &[u8]) -> Option<Value> {
    let mut answer: Value = serde_json::from_slice(answer).ok()?;
    match answer.get_mut("kv_transfer_params").map(Value::take) {
        Some(params @ Value::Object(_)) => Some(params),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::RequestFields;

    #[test]
    fn what_the_gateway_writes_the_engines_read() {
        let body =
            br#"{"model": "m", "prompt": "p", "stream": true, "stream_options": {"include_usage": true}}"#;
        let sglang = edit_body(body, &sglang_bootstrap("10.0.0.2", Some(8998), 42)).unwrap();
        assert_eq!(
            PdRequest::read(&sglang),
            Ok(PdRequest::Sglang { room: 42, bootstrap: Some(("10.0.0.2".into(), 8998)) })
        );
        let prefill = edit_body(body, &vllm_prefill()).unwrap();
        assert_eq!(PdRequest::read(&prefill), Ok(PdRequest::VllmPrefill));
        let prefill: Value = serde_json::from_slice(&prefill).unwrap();
        assert_eq!((prefill["max_tokens"].clone(), prefill["stream"].clone()), (json!(1), json!(false)));
        assert!(prefill.get("stream_options").is_none() && prefill.get("max_completion_tokens").is_none());
        let remote = RemotePrefill {
            engine_id: "e",
            block_ids: 3..5,
            host: "127.0.0.1",
            port: 5600,
            request_id: "e-0",
        };
        let answer = json!({"choices": [], "kv_transfer_params": vllm_prefill_answer(&remote)});
        let params = params_of_prefill_answer(answer.to_string().as_bytes()).unwrap();
        assert_eq!(params["remote_block_ids"], json!([3, 4]));
        let decode = edit_body(body, &vllm_decode(params)).unwrap();
        assert_eq!(
            PdRequest::read(&decode),
            Ok(PdRequest::VllmDecode(KvSource { host: "127.0.0.1".into(), port: 5600, room: "e-0".into() }))
        );
        assert_eq!(params_of_prefill_answer(br#"{"kv_transfer_params": "no"}"#), None);
    }

    #[test]
    fn every_spelling_of_a_transfer_field_is_found_and_taken_out() {
        let escaped = br#"{"model": "m", "bootstr\u0061p_host": "10.0.0.1", "kv_transfer_params": {"remote_host": "x"}, "prompt": "bootstrap_host"}"#;
        let fields = RequestFields::parse(escaped).unwrap();
        assert!(fields.carries_transfer_fields());
        let stripped: Value = serde_json::from_slice(&strip(escaped).unwrap()).unwrap();
        assert_eq!(stripped, serde_json::json!({"model": "m", "prompt": "bootstrap_host"}));
        // A field named only inside a value, or null, is no transfer field.
        let plain = br#"{"model": "m", "prompt": "bootstrap_host", "kv_transfer_params": null}"#;
        assert!(!RequestFields::parse(plain).unwrap().carries_transfer_fields());
    }
}
