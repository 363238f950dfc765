//! Which OpenAI-compatible endpoint a trace line is sent to, and how its prompt text goes in the
//! body: `kvgate replay` sends it, `kvgate sim --tokenizer-path` renders and tokenizes the same body.

use serde_json::{json, Value};

/// Which OpenAI-compatible endpoint requests go to.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
#[clap(rename_all = "snake_case")]
pub enum Endpoint {
    /// `POST /v1/completions` with the prompt text.
    #[default]
    Completions,
    /// `POST /v1/chat/completions` with the prompt as one user message.
    Chat,
}

impl Endpoint {
    pub fn path(self) -> &'static str {
        match self {
            Endpoint::Completions => "/v1/completions",
            Endpoint::Chat => "/v1/chat/completions",
        }
    }

    /// Puts the prompt `text` into `body` (an object): `prompt` for completions, one user
    /// message for chat.
    pub fn put_prompt(self, body: &mut Value, text: String) {
        match self {
            Endpoint::Completions => body["prompt"] = Value::String(text),
            Endpoint::Chat => body["messages"] = json!([{"role": "user", "content": text}]),
        }
    }
}
