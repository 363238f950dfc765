//! `TokenizerError`: what failed while loading a tokenizer or turning a request into token ids, and whose fault it was.

use std::path::PathBuf;

/// Who caused a [`TokenizerError`]: the request (answer 400), the loaded files (a startup or
/// configuration error), or the tokenizer itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorSide {
    /// The request cannot be rendered or tokenized as sent (an engine would refuse it too).
    Client,
    /// The tokenizer files or the chat template are missing or invalid.
    Config,
    /// The tokenizer failed on valid input.
    Internal,
}

/// Errors of loading a tokenizer and of encoding requests. Messages are meant for users: they
/// name the file, the template line or the part of the request that is wrong.
#[derive(thiserror::Error, Debug)]
pub enum TokenizerError {
    /// A file could not be read (missing, unreadable, not UTF-8).
    #[error("cannot read {}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// tokenizer.json was read but the `tokenizers` library could not load it.
    #[error("{} is not a valid tokenizer.json: {message}", path.display())]
    InvalidTokenizer { path: PathBuf, message: String },
    /// tokenizer_config.json (or special_tokens_map.json) is not what transformers expects.
    #[error("{} is not a valid tokenizer config: {message}", path.display())]
    InvalidConfig { path: PathBuf, message: String },
    /// A chat request reached a tokenizer that has no (usable) chat template.
    #[error("no chat template: {message}")]
    NoChatTemplate { message: String },
    /// A chat template does not parse.
    #[error(
        "chat template {template} has a syntax error at line {line}: {message}{}",
        source_line_suffix(source_line)
    )]
    TemplateSyntax { template: String, line: usize, message: String, source_line: String },
    /// The template called `raise_exception(message)`: it refuses these messages.
    #[error("the chat template rejected the request: {message}")]
    TemplateRaised { message: String },
    /// Rendering failed for another reason (usually messages of a shape the template cannot handle).
    #[error("rendering the chat template failed{}: {message}", line_suffix(*line))]
    Render { message: String, line: Option<usize> },
    /// The chat request's messages or options are not of the expected shape.
    #[error("invalid chat request: {message}")]
    InvalidRequest { message: String },
    /// The tokenizer failed to encode the text.
    #[error("tokenizing failed: {message}")]
    Encode { message: String },
}

impl TokenizerError {
    /// Whose fault the error is; the gateway maps `Client` to 400 and the rest to 5xx or a startup failure.
    pub fn side(&self) -> ErrorSide {
        match self {
            TokenizerError::Io { .. }
            | TokenizerError::InvalidTokenizer { .. }
            | TokenizerError::InvalidConfig { .. }
            | TokenizerError::TemplateSyntax { .. } => ErrorSide::Config,
            TokenizerError::NoChatTemplate { .. }
            | TokenizerError::TemplateRaised { .. }
            | TokenizerError::Render { .. }
            | TokenizerError::InvalidRequest { .. } => ErrorSide::Client,
            TokenizerError::Encode { .. } => ErrorSide::Internal,
        }
    }

    pub(crate) fn invalid_request(message: impl Into<String>) -> TokenizerError {
        TokenizerError::InvalidRequest { message: message.into() }
    }
}

fn source_line_suffix(source_line: &str) -> String {
    if source_line.is_empty() {
        String::new()
    } else {
        format!("\n    {}", source_line.trim_end())
    }
}

fn line_suffix(line: Option<usize>) -> String {
    line.map(|line| format!(" at template line {line}")).unwrap_or_default()
}
