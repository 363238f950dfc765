//! kvgate-protocol: the engines' HTTP protocol in one place, each writer beside its reader, so
//! the gateway, the simulated engines (`kvgate-mock`), the tokenizer's mock and the replayer
//! speak it alike:
//! - [`request`]: a generation request (model, stream flag, messages or prompt, generation
//!   options, the routing key) and the one chat rendering ([`render_chat`]);
//! - [`endpoint`]: the generation endpoints' paths;
//! - [`usage`]: what an answer says of its prompt (tokens, cached tokens), whole or streamed;
//! - [`loads`]: the engines' load reports (SGLang's `/v1/loads`, vLLM's `/metrics`);
//! - [`exposition`]: the Prometheus text format read, the one reader of a `/metrics` page;
//! - [`transfer`]: the prefill/decode KV-transfer fields (SGLang's bootstrap fields, vLLM's
//!   `kv_transfer_params`);
//! - [`role`]: a worker's role in a disaggregated fleet and the PD protocols;
//! - [`headers`]: kvgate's own `x-kvgate-*` headers;
//! - [`sse`]: server-sent-event framing;
//! - [`edit`]: the one editor of a JSON request body.
//!
//! No I/O: bytes and values in, bytes and values out.

pub mod edit;
pub mod endpoint;
pub mod exposition;
pub mod headers;
pub mod loads;
pub mod request;
pub mod role;
pub mod sse;
pub mod transfer;
pub mod usage;

pub use edit::{edit_body, EditError, FieldEdit};
pub use endpoint::Endpoint;
pub use loads::LoadSample;
pub use request::{render_chat, ChatTurn, RequestFields};
pub use role::{PdProtocol, WorkerRole};
pub use sse::SseData;
pub use usage::EngineUsage;
