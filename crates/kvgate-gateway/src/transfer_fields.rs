//! The request fields that steer an engine's KV transfer, which only the gateway sets: SGLang's
//! `bootstrap_host`, `bootstrap_port`, `bootstrap_room`, `bootstrap_pair_key`, `decode_tp_size`
//! and `disagg_prefill_dp_rank` (`python/sglang/srt/managers/io_struct.py`, `GenerateReqInput`,
//! and the OpenAI requests of `entrypoints/openai/protocol.py`, 0.5.x: where a decode engine
//! pulls its KV from) and vLLM's `kv_transfer_params` (read by the KV connectors:
//! `do_remote_prefill` with `remote_host`/`remote_port` make a decode engine pull from there). A
//! client's values would make an engine connect where the client chose, so they are taken out
//! of every request before any path (regular, a pair, in place, the fallback in place) sends it;
//! a pair's are then the gateway's own (`proxy/pd.rs`).

use bytes::Bytes;
use serde_json::{Map, Value};

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
pub fn strip(body: &[u8]) -> Result<Bytes, String> {
    let mut object: Map<String, Value> =
        serde_json::from_slice(body).map_err(|error| format!("invalid request body: {error}"))?;
    for field in TRANSFER_FIELDS {
        object.remove(field);
    }
    serde_json::to_vec(&object)
        .map(Bytes::from)
        .map_err(|error| format!("could not re-encode the request: {error}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::RequestFields;

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
