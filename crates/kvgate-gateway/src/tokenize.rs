//! The routing key of a request for a model whose exact index needs token ids: the request
//! tokenized as its engine will tokenize it (chat template included), or, when that is not
//! needed or not possible, the key `request.rs` extracts.

use std::borrow::Cow;

use kvgate_tokenizer::Tokenizer;

use crate::endpoint::Endpoint;
use crate::metrics::Metrics;
use crate::registry::ModelPool;
use crate::request::{OwnedKey, RequestFields};

/// The key a prefix-aware policy matches `fields` on. Tokenizes only when the model's workers
/// publish KV events, the policy matches against the exact index, and a tokenizer is
/// configured; a request the tokenizer cannot handle is routed on its text (never refused).
pub(crate) fn routing_key<'a>(
    tokenizer: Option<&Tokenizer>,
    metrics: &Metrics,
    pool: &ModelPool,
    endpoint: Endpoint,
    fields: &'a RequestFields<'a>,
    body: &[u8],
) -> OwnedKey<'a> {
    let tokenizer = match tokenizer {
        Some(tokenizer) if pool.has_kv_events && pool.config.uses_exact_index() => tokenizer,
        _ => return fields.routing_key(),
    };
    let encoded = match endpoint {
        Endpoint::ChatCompletions if fields.input_ids.is_none() => tokenizer.encode_chat_request(body),
        Endpoint::Completions | Endpoint::Generate => match fields.routing_key() {
            OwnedKey::Text(text) => tokenizer.encode_prompt(&text),
            other => return other,
        },
        _ => return fields.routing_key(),
    };
    match encoded {
        Ok(ids) => OwnedKey::Tokens(Cow::Owned(ids)),
        Err(error) => {
            metrics.tokenize_failures.with_label_values(&[endpoint.label()]).inc();
            tracing::debug!(endpoint = endpoint.label(), %error, "could not tokenize; routing on the text");
            fields.routing_key()
        }
    }
}
