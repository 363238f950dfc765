//! Preparing a request for planning, one path for the proxy and the dry run (`POST /v1/route`):
//! the model's pools and the plan's shape, the request's fields checked for its endpoint, the
//! routing key (tokenized when the keying pool's exact index needs token ids) and the session
//! key. Each is computed once per request, here.

use bytes::Bytes;
use http::HeaderMap;
use kvgate_index::Namespace;
use kvgate_policy::{RouteRequest, RoutingKey};

use super::plan::Shape;
use crate::state::AppState;
use kvgate_fleet::registry::ModelPools;
use kvgate_gateway_core::error::ApiError;
use kvgate_protocol::endpoint::Endpoint;
use kvgate_protocol::request::{OwnedKey, RequestFields};

/// A request ready to be planned.
pub(super) struct Prepared<'a> {
    pub shape: Shape,
    /// What prefix-aware policies match (`None` when no policy of the shape reads it).
    pub key: OwnedKey<'a>,
    /// The prompt's estimated length in tokens (of the whole prompt, also when the key is cut
    /// at `--max-tokenize-chars`).
    pub prompt_tokens: u64,
    /// The routing-key header, else the body's `user` field.
    pub session: Option<&'a str>,
    /// The request's blocks in the exact index: a LoRA adapter's (a `model` that is not the
    /// pool's own: vLLM serves adapters under their own names), a `cache_salt`'s.
    pub namespace: Namespace<'a>,
}

impl Prepared<'_> {
    /// The request as the policies see it.
    pub fn route_request(&self) -> RouteRequest<'_> {
        RouteRequest {
            key: match &self.key {
                OwnedKey::None => RoutingKey::None,
                OwnedKey::Text(text) => RoutingKey::Text(text),
                OwnedKey::Tokens(ids) => RoutingKey::Tokens(ids),
            },
            prompt_tokens: self.prompt_tokens,
            session: self.session,
        }
    }
}

/// Prepares the request whose `fields` were read from `body`, for `endpoint`: the 404/400/503 a
/// client gets when its model has no pool or its body does not fit the endpoint.
pub(super) async fn prepare<'a>(
    state: &AppState,
    endpoint: Endpoint,
    fields: &'a RequestFields<'a>,
    headers: &'a HeaderMap,
    body: &Bytes,
) -> Result<Prepared<'a>, ApiError> {
    let pools = model_pools(state, fields.model.as_deref())?;
    let shape = Shape::of(state, &pools, endpoint)?;
    fields.check(endpoint).map_err(ApiError::BadRequest)?;
    let (key, prompt_tokens) = if shape.needs_routing_key() {
        let tokenization = state.tokenization.as_deref();
        let max_chars = state.config.max_tokenize_chars;
        let pool = shape.key_pool();
        kvgate_fleet::tokenize::routing_key(
            tokenization,
            &state.metrics,
            max_chars,
            pool,
            endpoint,
            fields,
            body,
        )
        .await
    } else {
        (OwnedKey::None, 0)
    };
    let session = headers
        .get(&state.routing_key_header)
        .and_then(|value| value.to_str().ok())
        .or(fields.user.as_deref());
    let adapter = fields.model.as_deref().filter(|model| *model != shape.key_pool().model);
    let namespace = Namespace { adapter: adapter.map(kvgate_index::Adapter::Name), cache_salt: None }
        .with_salt(fields.cache_salt.as_deref());
    Ok(Prepared { shape, key, prompt_tokens, session, namespace })
}

/// The pools of the request's model (a copy of the registry's handles, so no snapshot is held
/// while the request runs), or the 404/400 a client gets when there is none.
fn model_pools(state: &AppState, model: Option<&str>) -> Result<ModelPools, ApiError> {
    let snapshot = state.registry.snapshot();
    match snapshot.pool_for(model) {
        Some(pools) => Ok(pools.clone()),
        None => Err(no_pool_error(snapshot.models.len(), model)),
    }
}

fn no_pool_error(model_count: usize, model: Option<&str>) -> ApiError {
    match (model_count, model) {
        (0, _) => ApiError::NoHealthyWorker(String::new()),
        (_, Some(model)) => ApiError::ModelNotFound(model.to_string()),
        (_, None) => ApiError::BadRequest(
            "the `model` field is required: several models are served (see GET /v1/models)".into(),
        ),
    }
}
