//! Reading a Hugging Face tokenizer from local files the way transformers' `AutoTokenizer.from_pretrained(dir)` does: tokenizer.json, tokenizer_config.json, chat template files. Never downloads.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use minijinja::Value;
use serde_json::Value as Json;

use crate::cache::SegmentCache;
use crate::error::TokenizerError;
use crate::hf::{HfTokenizer, Segments};
use crate::split::{listed_added_tokens, Splitter};
use crate::template::{ChatTemplates, TemplateSource};
use crate::{ContentFormatOption, TokenizerOptions};

/// transformers' `SPECIAL_TOKENS_ATTRIBUTES`: each one found (and not empty) becomes a template variable.
const SPECIAL_TOKEN_NAMES: [&str; 7] =
    ["bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"];

/// Loads a tokenizer from `path` (a directory or its tokenizer.json) and an optional template file.
pub(crate) fn load(
    path: &Path,
    chat_template: Option<&Path>,
    options: &TokenizerOptions,
) -> Result<HfTokenizer, TokenizerError> {
    let metadata = std::fs::metadata(path).map_err(|source| io_error(path, source))?;
    let (directory, tokenizer_file) = if metadata.is_dir() {
        (path.to_path_buf(), path.join("tokenizer.json"))
    } else {
        (path.parent().map(Path::to_path_buf).unwrap_or_default(), path.to_path_buf())
    };
    let tokenizer_bytes =
        std::fs::read(&tokenizer_file).map_err(|source| io_error(&tokenizer_file, source))?;
    let invalid_tokenizer =
        |message: String| TokenizerError::InvalidTokenizer { path: tokenizer_file.clone(), message };
    let mut tokenizer = tokenizers::Tokenizer::from_bytes(&tokenizer_bytes)
        .map_err(|error| invalid_tokenizer(error.to_string()))?;
    // transformers encodes without the truncation and padding a tokenizer.json may carry
    // (`tokenizer(text)` turns them off), and so do the engines.
    tokenizer.with_truncation(None).map_err(|error| invalid_tokenizer(error.to_string()))?;
    tokenizer.with_padding(None);

    let config_path = directory.join("tokenizer_config.json");
    let config = read_json_if_exists(&config_path)?;
    let mut special_tokens = special_tokens(config.as_ref(), &config_path)?;
    // Legacy repositories keep their special tokens in special_tokens_map.json; transformers reads
    // it when tokenizer_config.json has no `added_tokens_decoder`.
    if config.as_ref().is_none_or(|config| config.get("added_tokens_decoder").is_none()) {
        let map_path = directory.join("special_tokens_map.json");
        if let Some(map) = read_json_if_exists(&map_path)? {
            special_tokens.extend(self::special_tokens(Some(&map), &map_path)?);
        }
    }

    let templates = match chat_template {
        Some(file) => {
            Some(ChatTemplates::compile(vec![template_file("default", file)?], true, options.content_format)?)
        }
        None => model_templates(&directory, config.as_ref(), &config_path, options.content_format)?,
    };
    let segments = segments(&tokenizer, &tokenizer_bytes, options.segment_cache_tokens);
    Ok(HfTokenizer::new(tokenizer, templates, special_tokens, segments))
}

/// The segment cache if it is wanted and exact for this tokenizer.
fn segments(tokenizer: &tokenizers::Tokenizer, tokenizer_json: &[u8], capacity: u64) -> Segments {
    if capacity == 0 {
        return Segments::Off;
    }
    let splitter =
        listed_added_tokens(tokenizer_json).and_then(|listed| Splitter::for_tokenizer(tokenizer, &listed));
    match splitter {
        Ok(splitter) => Segments::On(SegmentCache::new(splitter, capacity)),
        Err(reason) => Segments::Unsupported(reason),
    }
}

/// The model's own templates. As in transformers, `chat_template.jinja` and
/// `additional_chat_templates/*.jinja` take precedence over tokenizer_config.json's `chat_template`.
fn model_templates(
    directory: &Path,
    config: Option<&Json>,
    config_path: &Path,
    messages: ContentFormatOption,
) -> Result<Option<ChatTemplates>, TokenizerError> {
    let mut files = Vec::new();
    let default_file = directory.join("chat_template.jinja");
    if default_file.is_file() {
        files.push(template_file("default", &default_file)?);
    }
    let extra_directory = directory.join("additional_chat_templates");
    if extra_directory.is_dir() {
        let entries =
            std::fs::read_dir(&extra_directory).map_err(|source| io_error(&extra_directory, source))?;
        let mut paths = Vec::new();
        for entry in entries {
            paths.push(entry.map_err(|source| io_error(&extra_directory, source))?.path());
        }
        paths.sort();
        for path in paths {
            let name =
                path.file_name().and_then(|name| name.to_str()).and_then(|name| name.strip_suffix(".jinja"));
            if let Some(name) = name {
                files.push(template_file(name, &path)?);
            }
        }
    }
    if !files.is_empty() {
        let single = files.len() == 1 && files[0].name == "default";
        return ChatTemplates::compile(files, single, messages).map(Some);
    }

    let invalid = |message: &str| TokenizerError::InvalidConfig {
        path: config_path.to_path_buf(),
        message: message.to_string(),
    };
    let origin = |name: &str| format!("{name:?} in {}", config_path.display());
    match config.and_then(|config| config.get("chat_template")) {
        None | Some(Json::Null) => Ok(None),
        Some(Json::String(source)) => {
            let template = TemplateSource {
                name: "default".to_string(),
                origin: origin("chat_template"),
                source: source.clone(),
            };
            ChatTemplates::compile(vec![template], true, messages).map(Some)
        }
        Some(Json::Array(entries)) => {
            let mut templates = Vec::with_capacity(entries.len());
            for entry in entries {
                let name = entry.get("name").and_then(Json::as_str);
                let source = entry.get("template").and_then(Json::as_str);
                let (Some(name), Some(source)) = (name, source) else {
                    return Err(invalid(
                        "each entry of the `chat_template` list needs a string `name` and `template`",
                    ));
                };
                let origin = origin(&format!("chat_template {name}"));
                templates.push(TemplateSource { name: name.to_string(), origin, source: source.to_string() });
            }
            if templates.is_empty() {
                return Ok(None);
            }
            ChatTemplates::compile(templates, false, messages).map(Some)
        }
        Some(_) => Err(invalid("`chat_template` must be a string or a list of {name, template}")),
    }
}

fn template_file(name: &str, path: &Path) -> Result<TemplateSource, TokenizerError> {
    let source = std::fs::read_to_string(path).map_err(|source| io_error(path, source))?;
    Ok(TemplateSource { name: name.to_string(), origin: path.display().to_string(), source })
}

/// The special tokens transformers puts in every template's context (`special_tokens_map`):
/// strings, from plain strings or `{"content": ...}` objects; null and empty ones are left out.
fn special_tokens(config: Option<&Json>, path: &Path) -> Result<BTreeMap<String, Value>, TokenizerError> {
    let mut tokens = BTreeMap::new();
    let Some(config) = config else {
        return Ok(tokens);
    };
    let invalid = |message: String| TokenizerError::InvalidConfig { path: path.to_path_buf(), message };
    for name in SPECIAL_TOKEN_NAMES {
        match config.get(name).map(token_text) {
            None | Some(Ok(None)) => {}
            Some(Ok(Some(text))) => {
                tokens.insert(name.to_string(), Value::from(text));
            }
            Some(Err(())) => {
                return Err(invalid(format!("`{name}` must be a string, an object with `content`, or null")))
            }
        }
    }
    if let Some(additional) = config.get("additional_special_tokens").filter(|value| !value.is_null()) {
        let Some(list) = additional.as_array() else {
            return Err(invalid("`additional_special_tokens` must be a list".to_string()));
        };
        let mut texts = Vec::with_capacity(list.len());
        for item in list {
            match token_text(item) {
                Ok(Some(text)) => texts.push(Value::from(text)),
                _ => {
                    return Err(invalid(
                        "`additional_special_tokens` must hold strings or objects with `content`".to_string(),
                    ))
                }
            }
        }
        if !texts.is_empty() {
            tokens.insert("additional_special_tokens".to_string(), Value::from(texts));
        }
    }
    Ok(tokens)
}

fn token_text(value: &Json) -> Result<Option<String>, ()> {
    match value {
        Json::Null => Ok(None),
        Json::String(text) => Ok(Some(text.clone()).filter(|text| !text.is_empty())),
        Json::Object(fields) => match fields.get("content") {
            Some(Json::String(text)) => Ok(Some(text.clone()).filter(|text| !text.is_empty())),
            _ => Err(()),
        },
        _ => Err(()),
    }
}

fn read_json_if_exists(path: &Path) -> Result<Option<Json>, TokenizerError> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => return Err(io_error(path, source)),
    };
    serde_json::from_str(&text).map(Some).map_err(|error| TokenizerError::InvalidConfig {
        path: path.to_path_buf(),
        message: error.to_string(),
    })
}

fn io_error(path: &Path, source: std::io::Error) -> TokenizerError {
    TokenizerError::Io { path: PathBuf::from(path), source }
}
