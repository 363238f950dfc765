//! The proxied endpoints: their paths, and their labels in metrics and `POST /v1/route`.

/// The proxied endpoints.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    ChatCompletions,
    Completions,
    Generate,
    Embeddings,
}

impl Endpoint {
    pub const ALL: [Endpoint; 4] =
        [Endpoint::ChatCompletions, Endpoint::Completions, Endpoint::Generate, Endpoint::Embeddings];

    pub fn path(self) -> &'static str {
        match self {
            Endpoint::ChatCompletions => "/v1/chat/completions",
            Endpoint::Completions => "/v1/completions",
            Endpoint::Generate => "/generate",
            Endpoint::Embeddings => "/v1/embeddings",
        }
    }

    /// The endpoint served at `path`, if any.
    pub fn from_path(path: &str) -> Option<Endpoint> {
        Endpoint::ALL.into_iter().find(|endpoint| endpoint.path() == path)
    }

    /// The metrics label.
    pub fn label(self) -> &'static str {
        match self {
            Endpoint::ChatCompletions => "chat_completions",
            Endpoint::Completions => "completions",
            Endpoint::Generate => "generate",
            Endpoint::Embeddings => "embeddings",
        }
    }
}
