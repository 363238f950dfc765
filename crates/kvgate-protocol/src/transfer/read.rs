//! Reading a generation body's PD fields (SGLang's `bootstrap_*`, vLLM's `kv_transfer_params`)
//! into what the request asks of the engine that receives it (the simulated engines' reader of
//! what `mod.rs` writes).

use serde::Deserialize;
use serde_json::Value;

/// Where a decode request's KV is: a prefill engine's bootstrap address and the room (SGLang's
/// `bootstrap_room` as digits, or vLLM's `remote_request_id`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvSource {
    pub host: String,
    pub port: u16,
    pub room: String,
}

/// The PD fields of a generation body; everything else is skipped unparsed.
#[derive(Deserialize)]
struct PdFields {
    #[serde(default)]
    bootstrap_host: Option<Value>,
    #[serde(default)]
    bootstrap_port: Option<Value>,
    #[serde(default)]
    bootstrap_room: Option<Value>,
    #[serde(default)]
    kv_transfer_params: Option<Value>,
}

/// vLLM's `kv_transfer_params` (NixlConnector's fields; the others are ignored).
#[derive(Deserialize)]
struct KvTransferParams {
    #[serde(default)]
    do_remote_decode: Option<bool>,
    #[serde(default)]
    do_remote_prefill: Option<bool>,
    #[serde(default)]
    remote_host: Option<String>,
    #[serde(default)]
    remote_port: Option<Value>,
    #[serde(default)]
    remote_request_id: Option<String>,
}

/// What a body's PD fields ask for.
#[derive(Debug, PartialEq, Eq)]
pub enum PdRequest {
    /// No PD fields: a regular request.
    None,
    /// SGLang: the same body goes to the prefill and the decode engine.
    Sglang { room: u64, bootstrap: Option<(String, u16)> },
    /// vLLM step 1, to the prefill engine (`do_remote_decode`).
    VllmPrefill,
    /// vLLM step 2, to the decode engine (`do_remote_prefill`), with the prefill's answer.
    VllmDecode(KvSource),
}

impl PdRequest {
    /// Reads the PD fields of `body` (`Err`: a client error, the reason). A body that is not
    /// JSON reads as `None`: the endpoint's own parsing reports it.
    pub fn read(body: &[u8]) -> Result<Self, String> {
        let Ok(fields) = serde_json::from_slice::<PdFields>(body) else {
            return Ok(Self::None);
        };
        match (fields.bootstrap_room, fields.kv_transfer_params) {
            (None, None) => Ok(Self::None),
            (Some(_), Some(_)) => Err(String::from(
                "a request has either SGLang's bootstrap_room or vLLM's kv_transfer_params, not both",
            )),
            (Some(room), None) => {
                let room = integer(&room, "bootstrap_room")?;
                let bootstrap = match (fields.bootstrap_host, fields.bootstrap_port) {
                    (Some(Value::String(host)), Some(port)) => {
                        Some((host, port_number(&port, "bootstrap_port")?))
                    }
                    (Some(_), Some(_)) => return Err(String::from("bootstrap_host must be a string")),
                    _ => None,
                };
                Ok(Self::Sglang { room, bootstrap })
            }
            (None, Some(params)) => {
                let params: KvTransferParams = serde_json::from_value(params)
                    .map_err(|error| format!("invalid kv_transfer_params: {error}"))?;
                match (params.do_remote_decode == Some(true), params.do_remote_prefill == Some(true)) {
                    (true, true) => Err(String::from(
                        "kv_transfer_params cannot ask for both do_remote_decode and do_remote_prefill",
                    )),
                    (true, false) => Ok(Self::VllmPrefill),
                    (false, true) => {
                        let missing =
                            |field| format!("kv_transfer_params with do_remote_prefill needs {field}");
                        let host = params.remote_host.ok_or_else(|| missing("remote_host"))?;
                        let port = params.remote_port.ok_or_else(|| missing("remote_port"))?;
                        let room = params.remote_request_id.ok_or_else(|| missing("remote_request_id"))?;
                        let port = port_number(&port, "kv_transfer_params.remote_port")?;
                        Ok(Self::VllmDecode(KvSource { host, port, room }))
                    }
                    (false, false) => Ok(Self::None),
                }
            }
        }
    }
}

/// A non-negative integer given as a JSON number or a string of digits.
fn integer(value: &Value, field: &str) -> Result<u64, String> {
    let parsed = match value {
        Value::Number(number) => number.as_u64(),
        Value::String(digits) if !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()) => {
            digits.parse().ok()
        }
        _ => None,
    };
    parsed.ok_or_else(|| {
        format!("{field} must be an unsigned 64-bit integer (a number or digits), got {value}")
    })
}

fn port_number(value: &Value, field: &str) -> Result<u16, String> {
    u16::try_from(integer(value, field)?).map_err(|_| format!("{field} must be a port number, got {value}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(body: &str) -> Result<PdRequest, String> {
        PdRequest::read(body.as_bytes())
    }

    #[test]
    fn sglang_rooms_are_numbers_or_digits() {
        assert_eq!(read(r#"{"prompt": "a"}"#), Ok(PdRequest::None));
        assert_eq!(read("not json"), Ok(PdRequest::None));
        assert_eq!(
            read(r#"{"bootstrap_room": 18446744073709551615}"#),
            Ok(PdRequest::Sglang { room: u64::MAX, bootstrap: None })
        );
        assert_eq!(
            read(r#"{"bootstrap_room": "42", "bootstrap_host": "127.0.0.1", "bootstrap_port": 8998}"#),
            Ok(PdRequest::Sglang { room: 42, bootstrap: Some(("127.0.0.1".into(), 8998)) })
        );
        for bad in [r#""4x""#, "-1", "1.5", r#""""#, "[1]"] {
            assert!(read(&format!(r#"{{"bootstrap_room": {bad}}}"#)).is_err(), "{bad}");
        }
        assert!(read(r#"{"bootstrap_room": 1, "bootstrap_host": "h", "bootstrap_port": 70000}"#).is_err());
        assert_eq!(read(r#"{"bootstrap_room": null, "kv_transfer_params": null}"#), Ok(PdRequest::None));
    }

    #[test]
    fn vllm_params_pick_the_side() {
        let prefill = r#"{"kv_transfer_params": {"do_remote_decode": true, "do_remote_prefill": false,
            "remote_engine_id": null, "remote_block_ids": null, "remote_host": null, "remote_port": null}}"#;
        assert_eq!(read(prefill), Ok(PdRequest::VllmPrefill));
        let decode = r#"{"kv_transfer_params": {"do_remote_prefill": true, "do_remote_decode": false,
            "remote_engine_id": "e", "remote_block_ids": [1, 2], "remote_host": "127.0.0.1",
            "remote_port": 5600, "remote_request_id": "vllm-0-3", "tp_size": 1}}"#;
        assert_eq!(
            read(decode),
            Ok(PdRequest::VllmDecode(KvSource {
                host: "127.0.0.1".into(),
                port: 5600,
                room: "vllm-0-3".into()
            }))
        );
        assert!(read(r#"{"kv_transfer_params": {"do_remote_prefill": true}}"#).is_err());
        assert!(read(r#"{"kv_transfer_params": "yes"}"#).is_err());
        assert_eq!(read(r#"{"kv_transfer_params": {}}"#), Ok(PdRequest::None));
        assert!(read(r#"{"kv_transfer_params": {}, "bootstrap_room": 1}"#).is_err());
    }
}
