//! The one editor of a JSON request body: fields set (put first), set inside a nested object,
//! replaced where present, or taken out. Where every edit only adds a field the body does not
//! have, the fields are put first and the rest of the body is kept byte for byte (key order
//! matters to chat templates that print JSON, and nothing is parsed twice); otherwise the object
//! is parsed, edited and re-serialized.

use bytes::Bytes;
use serde_json::{Map, Value};

/// One change to a body's top-level JSON object.
#[derive(Clone, Debug, PartialEq)]
pub enum FieldEdit<'a> {
    /// `"name": value`, replacing a value the body gave.
    Set(&'a str, Value),
    /// `name` set to `value` only where the body has it.
    Replace(&'a str, Value),
    /// `"object": {.., "name": value}`: the object kept with `name` set (made an object when
    /// absent or of another kind).
    SetIn(&'a str, &'a str, Value),
    /// `name` taken out.
    Remove(&'a str),
}

impl FieldEdit<'_> {
    /// The top-level field the edit touches.
    fn field(&self) -> &str {
        match self {
            FieldEdit::Set(field, _)
            | FieldEdit::Replace(field, _)
            | FieldEdit::SetIn(field, _, _)
            | FieldEdit::Remove(field) => field,
        }
    }
}

/// Why a body could not be edited.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EditError {
    /// The body is no JSON object.
    NotAnObject,
    /// The edited object could not be written (the reason).
    Encode(String),
}

/// `body` (a JSON object) with `edits` applied in order.
pub fn edit_body(body: &[u8], edits: &[FieldEdit<'_>]) -> Result<Bytes, EditError> {
    if edits.iter().all(|edit| matches!(edit, FieldEdit::Set(..) | FieldEdit::SetIn(..)))
        && !has_escapes(body)
        && !edits.iter().any(|edit| mentions(body, edit.field()))
    {
        return splice_first(body, edits);
    }
    let mut object: Map<String, Value> = serde_json::from_slice(body).map_err(|_| EditError::NotAnObject)?;
    for edit in edits {
        match edit {
            FieldEdit::Set(field, value) => {
                object.insert((*field).into(), value.clone());
            }
            FieldEdit::Replace(field, value) => {
                if let Some(old) = object.get_mut(*field) {
                    *old = value.clone();
                }
            }
            FieldEdit::SetIn(field, name, value) => {
                let inner = object.entry(*field).or_insert_with(|| Value::Object(Map::new()));
                if !inner.is_object() {
                    *inner = Value::Object(Map::new());
                }
                if let Value::Object(inner) = inner {
                    inner.insert((*name).into(), value.clone());
                }
            }
            FieldEdit::Remove(field) => {
                object.remove(*field);
            }
        }
    }
    serde_json::to_vec(&object).map(Bytes::from).map_err(|error| EditError::Encode(error.to_string()))
}

/// Whether `"field"` occurs anywhere in `body` (a conservative test for the key).
fn mentions(body: &[u8], field: &str) -> bool {
    let quoted_len = field.len() + 2;
    body.windows(quoted_len).any(|window| {
        window[0] == b'"' && window[quoted_len - 1] == b'"' && &window[1..quoted_len - 1] == field.as_bytes()
    })
}

/// Whether the body spells anything with a `\u` escape (a key could then be spelled so that
/// [`mentions`] misses it).
fn has_escapes(body: &[u8]) -> bool {
    body.windows(2).any(|window| window == b"\\u")
}

/// The set fields written first, then the rest of the object byte for byte.
fn splice_first(body: &[u8], edits: &[FieldEdit<'_>]) -> Result<Bytes, EditError> {
    let start = body.iter().position(|b| !b.is_ascii_whitespace()).ok_or(EditError::NotAnObject)?;
    if body[start] != b'{' {
        return Err(EditError::NotAnObject);
    }
    let rest = &body[start + 1..];
    let empty = rest.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'}');
    let mut out = Vec::with_capacity(body.len() + 64);
    out.push(b'{');
    for (index, edit) in edits.iter().enumerate() {
        if index > 0 {
            out.push(b',');
        }
        let (field, value) = match edit {
            FieldEdit::Set(field, value) => (*field, value.clone()),
            FieldEdit::SetIn(field, name, value) => {
                (*field, Value::Object(Map::from_iter([((*name).to_string(), value.clone())])))
            }
            FieldEdit::Replace(..) | FieldEdit::Remove(_) => unreachable!("only set edits are spliced"),
        };
        serde_json::to_writer(&mut out, field).map_err(|error| EditError::Encode(error.to_string()))?;
        out.push(b':');
        serde_json::to_writer(&mut out, &value).map_err(|error| EditError::Encode(error.to_string()))?;
    }
    if !empty && !edits.is_empty() {
        out.push(b',');
    }
    out.extend_from_slice(rest);
    Ok(Bytes::from(out))
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn edited(body: &str, edits: &[FieldEdit<'_>]) -> String {
        String::from_utf8(edit_body(body.as_bytes(), edits).unwrap().to_vec()).unwrap()
    }

    #[test]
    fn a_new_field_goes_first_and_the_rest_is_kept_byte_for_byte() {
        let body = r#"{"model": "m",  "messages": [{"role": "user", "content": "{\"a\": 1}"}]}"#;
        assert_eq!(
            edited(body, &[FieldEdit::Set("data_parallel_rank", json!(3))]),
            format!("{{\"data_parallel_rank\":3,{}", &body[1..])
        );
        assert_eq!(edited(" {} ", &[FieldEdit::Set("priority", json!(-2))]), r#"{"priority":-2} "#);
        assert_eq!(
            edited(
                r#"{"stream": true}"#,
                &[FieldEdit::SetIn("stream_options", "include_usage", json!(true))]
            ),
            r#"{"stream_options":{"include_usage":true},"stream": true}"#
        );
    }

    #[test]
    fn a_field_the_body_has_is_replaced_in_a_reserialized_object() {
        assert_eq!(
            edited(r#"{"z": 1, "priority": 5}"#, &[FieldEdit::Set("priority", json!(0))]),
            r#"{"priority":0,"z":1}"#
        );
        let options = r#"{"stream_options": {"include_usage": false, "continuous_usage_stats": true}}"#;
        let value: Value = serde_json::from_str(&edited(
            options,
            &[FieldEdit::SetIn("stream_options", "include_usage", json!(true))],
        ))
        .unwrap();
        assert_eq!(value["stream_options"], json!({"include_usage": true, "continuous_usage_stats": true}));
        let odd: Value = serde_json::from_str(&edited(
            r#"{"stream_options": null}"#,
            &[FieldEdit::SetIn("stream_options", "include_usage", json!(true))],
        ))
        .unwrap();
        assert_eq!(odd["stream_options"], json!({"include_usage": true}));
    }

    #[test]
    fn an_escaped_spelling_of_the_field_is_replaced_too() {
        let body = r#"{"data_parallel_r\u0061nk": 7, "model": "m"}"#;
        let value: Value =
            serde_json::from_str(&edited(body, &[FieldEdit::Set("data_parallel_rank", json!(1))])).unwrap();
        assert_eq!(value, json!({"data_parallel_rank": 1, "model": "m"}));
    }

    #[test]
    fn replace_and_remove_touch_only_what_is_there() {
        let body = r#"{"max_tokens": 9, "stream_options": {}, "stream": true}"#;
        let value: Value = serde_json::from_str(&edited(
            body,
            &[
                FieldEdit::Set("max_tokens", json!(1)),
                FieldEdit::Replace("max_completion_tokens", json!(1)),
                FieldEdit::Remove("stream_options"),
            ],
        ))
        .unwrap();
        assert_eq!(value, json!({"max_tokens": 1, "stream": true}));
    }

    #[test]
    fn a_body_that_is_no_object_is_refused() {
        for body in ["", "  ", "[1]", "\"x\"", "{not json"] {
            for edits in [&[FieldEdit::Set("a", json!(1))][..], &[FieldEdit::Remove("a")]] {
                if body == "{not json" && matches!(edits[0], FieldEdit::Set(..)) {
                    continue; // spliced unparsed: the engine refuses it, as it would the original
                }
                assert_eq!(edit_body(body.as_bytes(), edits), Err(EditError::NotAnObject), "{body:?}");
            }
        }
    }
}
