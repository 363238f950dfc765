//! Chat templates compiled once into a minijinja environment set up like transformers' Jinja2 one, and their selection and rendering.

use std::collections::BTreeMap;
use std::fmt;

use minijinja::syntax::SyntaxConfig;
use minijinja::{AutoEscape, Environment, Error, ErrorKind, Value};

use crate::content_format::ContentFormat;
use crate::error::TokenizerError;
use crate::pyfmt::{tojson_filter, write_py_str};
use crate::strftime::strftime_now;
use crate::ContentFormatOption;

/// The model's chat templates, compiled. A model has one template, or several by name (a list
/// in tokenizer_config.json, or `additional_chat_templates/*.jinja`).
pub(crate) struct ChatTemplates {
    env: Environment<'static>,
    /// Names of the compiled templates; a single template is named "default".
    names: Vec<String>,
    /// One template given as such (not by name): it serves every request, tools or not.
    single: bool,
    /// Per template (as `names`), how vLLM hands it the messages: its content format and whether
    /// it names the `developer` role; `None` when messages are passed as sent.
    vllm: Vec<Option<VllmRendering>>,
}

/// How vLLM prepares messages for one template.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct VllmRendering {
    pub(crate) format: ContentFormat,
    /// The template's source names the role (`'developer'` or `"developer"`, vLLM's test).
    pub(crate) supports_developer: bool,
}

impl fmt::Debug for ChatTemplates {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ChatTemplates").field("names", &self.names).field("single", &self.single).finish()
    }
}

/// Where a template came from, for error messages.
pub(crate) struct TemplateSource {
    pub(crate) name: String,
    pub(crate) origin: String,
    pub(crate) source: String,
}

impl ChatTemplates {
    /// Compiles `templates`; `single` when the model has one unnamed template (or it was overridden).
    pub(crate) fn compile(
        templates: Vec<TemplateSource>,
        single: bool,
        content_format: ContentFormatOption,
    ) -> Result<ChatTemplates, TokenizerError> {
        let mut env = environment()?;
        let mut names = Vec::with_capacity(templates.len());
        let mut vllm = Vec::with_capacity(templates.len());
        for template in templates {
            let source = rewrite_generation_tags(&template.source);
            vllm.push(content_format.resolve(&source).map(|format| VllmRendering {
                format,
                supports_developer: template.source.contains("\"developer\"")
                    || template.source.contains("'developer'"),
            }));
            env.add_template_owned(template.name.clone(), source.clone())
                .map_err(|error| syntax_error(&template.origin, &source, &error))?;
            names.push(template.name);
        }
        Ok(ChatTemplates { env, names, single, vllm })
    }

    /// How vLLM prepares the messages for the template a request with or without tools gets
    /// (`None`: passed as sent).
    pub(crate) fn vllm_rendering(&self, has_tools: bool) -> Result<Option<VllmRendering>, TokenizerError> {
        let name = self.select(has_tools)?;
        let position = self.names.iter().position(|known| known == name).unwrap_or(0);
        Ok(self.vllm.get(position).copied().flatten())
    }

    /// The template transformers' `get_chat_template` picks: the only one, or by name
    /// "tool_use" when tools are given and it exists, else "default".
    fn select(&self, has_tools: bool) -> Result<&str, TokenizerError> {
        let has = |name: &str| self.names.iter().any(|known| known == name);
        if self.single {
            return Ok(&self.names[0]);
        }
        if has_tools && has("tool_use") {
            return Ok("tool_use");
        }
        if has("default") {
            return Ok("default");
        }
        Err(TokenizerError::NoChatTemplate {
            message: format!(
                "the model has several chat templates ({}) and none is named \"default\"; pass one with --chat-template",
                self.names.join(", ")
            ),
        })
    }

    /// Renders the selected template with `context` (a map value).
    pub(crate) fn render(&self, has_tools: bool, context: Value) -> Result<String, TokenizerError> {
        let name = self.select(has_tools)?;
        let template = self.env.get_template(name).map_err(|error| render_error(&error, ""))?;
        template.render(context).map_err(|error| render_error(&error, template.source()))
    }
}

/// An environment that behaves like transformers' ImmutableSandboxedEnvironment: `trim_blocks`,
/// `lstrip_blocks`, loop controls, no auto-escaping, its `tojson`, `raise_exception` and
/// `strftime_now`, Python string/dict methods, and values printed as Python prints them.
fn environment() -> Result<Environment<'static>, TokenizerError> {
    let mut env = Environment::new();
    let syntax = SyntaxConfig::builder()
        .trim_blocks(true)
        .lstrip_blocks(true)
        .build()
        .map_err(|error| TokenizerError::Render { message: error.to_string(), line: None })?;
    env.set_syntax(syntax);
    env.set_auto_escape_callback(|_| AutoEscape::None);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.set_formatter(|out, _state, value| {
        if let Some(text) = value.as_str() {
            return out.write_str(text).map_err(|_| Error::from(ErrorKind::WriteFailure));
        }
        let mut text = String::new();
        write_py_str(&mut text, value);
        out.write_str(&text).map_err(|_| Error::from(ErrorKind::WriteFailure))
    });
    env.add_filter("tojson", tojson_filter);
    env.add_filter("string", |value: Value| {
        let mut text = String::new();
        write_py_str(&mut text, &value);
        text
    });
    env.add_function("raise_exception", raise_exception);
    env.add_function("strftime_now", |format: String| strftime_now(&format));
    Ok(env)
}

/// The message a template gave `raise_exception`, carried as the minijinja error's source.
#[derive(Debug)]
struct RaisedException(String);

impl fmt::Display for RaisedException {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for RaisedException {}

fn raise_exception(message: Option<Value>) -> Result<Value, Error> {
    let mut text = String::new();
    if let Some(message) = &message {
        write_py_str(&mut text, message);
    }
    Err(Error::new(ErrorKind::InvalidOperation, text.clone()).with_source(RaisedException(text)))
}

/// A rendering error; `template_text` is the template's source, to quote the failing line.
fn render_error(error: &Error, template_text: &str) -> TokenizerError {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(error);
    while let Some(current) = source {
        if let Some(raised) = current.downcast_ref::<RaisedException>() {
            return TokenizerError::TemplateRaised { message: raised.0.clone() };
        }
        source = current.source();
    }
    let mut message = match error.detail() {
        Some(detail) => format!("{}: {detail}", error.kind()),
        None => error.kind().to_string(),
    };
    let quoted = error.line().and_then(|line| template_text.lines().nth(line.saturating_sub(1)));
    if let Some(quoted) = quoted {
        message.push_str(&format!("\n    {}", quoted.trim()));
    }
    TokenizerError::Render { message, line: error.line() }
}

fn syntax_error(origin: &str, source: &str, error: &Error) -> TokenizerError {
    let line = error.line().unwrap_or(0);
    let source_line = source.lines().nth(line.saturating_sub(1)).unwrap_or_default().to_string();
    let message = match error.detail() {
        Some(detail) => format!("{}: {detail}", error.kind()),
        None => error.kind().to_string(),
    };
    TokenizerError::TemplateSyntax { template: origin.to_string(), line, message, source_line }
}

/// transformers' `{% generation %}...{% endgeneration %}` marks assistant text for its token
/// mask and otherwise renders its body. minijinja has no such tag, so it becomes
/// `{% if true %}...{% endif %}`, a block tag with the same whitespace handling.
fn rewrite_generation_tags(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(start) = rest.find("{%") {
        let (before, tag) = rest.split_at(start);
        out.push_str(before);
        let mut inner_start = 2;
        if tag[inner_start..].starts_with(['-', '+']) {
            inner_start += 1;
        }
        let inner = &tag[inner_start..];
        let keyword_start = inner.len() - inner.trim_start().len();
        let keyword = &inner[keyword_start..];
        let replacement =
            [("endgeneration", "endif"), ("generation", "if true")].into_iter().find(|(name, _)| {
                keyword.starts_with(name)
                    && keyword[name.len()..].starts_with(|ch: char| ch.is_whitespace() || "-+%".contains(ch))
            });
        match replacement {
            Some((name, replacement)) => {
                out.push_str(&tag[..inner_start + keyword_start]);
                out.push_str(replacement);
                rest = &keyword[name.len()..];
            }
            None => {
                out.push_str("{%");
                rest = &tag[2..];
            }
        }
    }
    out.push_str(rest);
    out
}

/// The context transformers renders a template with, in its precedence order: special tokens,
/// then `chat_template_kwargs`, then the named variables.
pub(crate) fn context(
    special_tokens: &BTreeMap<String, Value>,
    kwargs: &[(String, Value)],
    named: [(&str, Value); 4],
) -> Value {
    let mut variables: BTreeMap<String, Value> = special_tokens.clone();
    variables.extend(kwargs.iter().cloned());
    variables.extend(named.into_iter().map(|(name, value)| (name.to_string(), value)));
    Value::from_pairs(variables)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generation_tags_become_if_blocks() {
        assert_eq!(
            rewrite_generation_tags("a{% generation %}b{%- endgeneration -%}c{%generation%}"),
            "a{% if true %}b{%- endif -%}c{%if true%}"
        );
        assert_eq!(
            rewrite_generation_tags("{% if generation_x %}{{ '{%' }}"),
            "{% if generation_x %}{{ '{%' }}"
        );
        assert_eq!(rewrite_generation_tags("{% generations %}"), "{% generations %}");
    }
}
