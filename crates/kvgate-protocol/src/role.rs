//! Worker roles in a prefill/decode (PD) disaggregated fleet, and the PD protocols: how a pair
//! of workers is told about each other (SGLang's bootstrap fields, vLLM's `kv_transfer_params`).

use serde::{Deserialize, Serialize};

/// What a worker does: serves whole requests, or one side of a disaggregated pair.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, clap::ValueEnum,
)]
#[serde(rename_all = "snake_case")]
pub enum WorkerRole {
    /// Prefill and decode every request (PD fields in a request are ignored).
    #[default]
    Regular,
    /// Prefill engine: PD requests are prefilled (one output token) and their KV is held until
    /// a decode engine pulls it over the bootstrap port.
    Prefill,
    /// Decode engine: PD requests pull their prompt's KV from the prefill engine, then decode.
    Decode,
}

impl WorkerRole {
    pub const ALL: [WorkerRole; 3] = [WorkerRole::Regular, WorkerRole::Prefill, WorkerRole::Decode];

    pub fn as_str(self) -> &'static str {
        match self {
            WorkerRole::Regular => "regular",
            WorkerRole::Prefill => "prefill",
            WorkerRole::Decode => "decode",
        }
    }
}

/// How a prefill worker hands its KV cache to a decode worker.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
#[clap(rename_all = "snake_case")]
pub enum PdProtocol {
    /// SGLang: the same request goes to both workers at once, with `bootstrap_host`,
    /// `bootstrap_port` and a random `bootstrap_room` naming the transfer.
    #[default]
    Sglang,
    /// vLLM (KV connector): first to the prefill worker with `max_tokens: 1` and
    /// `kv_transfer_params.do_remote_decode`, then to the decode worker with the
    /// `kv_transfer_params` the prefill answer returned.
    Vllm,
}

impl PdProtocol {
    pub fn as_str(self) -> &'static str {
        match self {
            PdProtocol::Sglang => "sglang",
            PdProtocol::Vllm => "vllm",
        }
    }
}
