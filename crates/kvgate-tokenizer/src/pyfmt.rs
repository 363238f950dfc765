//! Python's text forms of template values: `json.dumps` (transformers' `tojson` filter) and `str()`/`repr()` (what Jinja2 prints).

use minijinja::value::{Kwargs, Rest, ValueKind};
use minijinja::{Error, ErrorKind, Value};

/// The options of transformers' `tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`.
struct JsonStyle {
    ensure_ascii: bool,
    indent: Option<String>,
    item_separator: String,
    key_separator: String,
    sort_keys: bool,
}

/// The `tojson` filter as transformers defines it: `json.dumps` with `ensure_ascii=False` and no
/// HTML escaping (unlike Jinja2's own `tojson`). Arguments may be positional or keywords.
pub(crate) fn tojson_filter(value: &Value, positional: Rest<Value>, kwargs: Kwargs) -> Result<Value, Error> {
    const NAMES: [&str; 4] = ["ensure_ascii", "indent", "separators", "sort_keys"];
    if positional.len() > NAMES.len() {
        return Err(Error::new(ErrorKind::TooManyArguments, "tojson takes at most 4 arguments"));
    }
    let mut args: [Value; 4] = Default::default();
    for (slot, given) in args.iter_mut().zip(positional.iter()) {
        *slot = given.clone();
    }
    for (index, name) in NAMES.iter().enumerate() {
        if let Some(given) = kwargs.get::<Option<Value>>(name)? {
            args[index] = given;
        }
    }
    kwargs.assert_all_used()?;
    let [ensure_ascii, indent, separators, sort_keys] = args;
    let indent = match indent.kind() {
        ValueKind::Undefined | ValueKind::None => None,
        ValueKind::String => Some(indent.as_str().unwrap_or_default().to_string()),
        ValueKind::Number => Some(" ".repeat(indent.as_usize().unwrap_or(0))),
        _ => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                "tojson: indent must be a number or a string",
            ))
        }
    };
    let (item_separator, key_separator) = if separators.is_none() || separators.is_undefined() {
        (if indent.is_some() { "," } else { ", " }.to_string(), ": ".to_string())
    } else {
        let pair: Vec<Value> = separators.try_iter()?.collect();
        match pair.as_slice() {
            [item, key] if item.as_str().is_some() && key.as_str().is_some() => {
                (item.as_str().unwrap_or_default().to_string(), key.as_str().unwrap_or_default().to_string())
            }
            _ => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson: separators must be two strings",
                ));
            }
        }
    };
    let style = JsonStyle {
        ensure_ascii: ensure_ascii.is_true(),
        indent,
        item_separator,
        key_separator,
        sort_keys: sort_keys.is_true(),
    };
    let mut out = String::new();
    write_json(&mut out, value, &style, 0)?;
    Ok(Value::from(out))
}

fn write_json(out: &mut String, value: &Value, style: &JsonStyle, depth: usize) -> Result<(), Error> {
    match value.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => write_number(out, value, true),
        ValueKind::String => write_json_string(out, value.as_str().unwrap_or_default(), style.ensure_ascii),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (index, item) in items.iter().enumerate() {
                if index > 0 {
                    out.push_str(&style.item_separator);
                }
                newline_indent(out, style, depth + 1);
                write_json(out, item, style, depth + 1)?;
            }
            newline_indent(out, style, depth);
            out.push(']');
        }
        ValueKind::Map => {
            let mut entries = Vec::new();
            for key in value.try_iter()? {
                let item = value.get_item(&key)?;
                entries.push((json_key(&key)?, item));
            }
            if entries.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            if style.sort_keys {
                entries.sort_by(|left, right| left.0.cmp(&right.0));
            }
            out.push('{');
            for (index, (key, item)) in entries.iter().enumerate() {
                if index > 0 {
                    out.push_str(&style.item_separator);
                }
                newline_indent(out, style, depth + 1);
                write_json_string(out, key, style.ensure_ascii);
                out.push_str(&style.key_separator);
                write_json(out, item, style, depth + 1)?;
            }
            newline_indent(out, style, depth);
            out.push('}');
        }
        kind => {
            let type_name =
                if kind == ValueKind::Undefined { "Undefined".to_string() } else { kind.to_string() };
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson: object of type {type_name} is not JSON serializable"),
            ));
        }
    }
    Ok(())
}

/// A map key as `json.dumps` writes it: strings as they are, numbers, booleans and None converted.
fn json_key(key: &Value) -> Result<String, Error> {
    match key.kind() {
        ValueKind::String => Ok(key.as_str().unwrap_or_default().to_string()),
        ValueKind::None => Ok("null".to_string()),
        ValueKind::Bool => Ok(if key.is_true() { "true" } else { "false" }.to_string()),
        ValueKind::Number => {
            let mut text = String::new();
            write_number(&mut text, key, true);
            Ok(text)
        }
        kind => Err(Error::new(
            ErrorKind::InvalidOperation,
            format!("tojson: keys must be str, int, float, bool or None, not {kind}"),
        )),
    }
}

fn newline_indent(out: &mut String, style: &JsonStyle, depth: usize) {
    if let Some(indent) = &style.indent {
        out.push('\n');
        for _ in 0..depth {
            out.push_str(indent);
        }
    }
}

/// A JSON string literal as Python's `json` module writes it (lowercase `\u00xx` escapes; with
/// `ensure_ascii` every non-ASCII character is escaped, astral ones as surrogate pairs).
fn write_json_string(out: &mut String, text: &str, ensure_ascii: bool) {
    out.push('"');
    for ch in text.chars() {
        match ch {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            ch if (ch as u32) < 0x20 || (ensure_ascii && !(' '..='~').contains(&ch)) => {
                let mut units = [0u16; 2];
                for unit in ch.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
            ch => out.push(ch),
        }
    }
    out.push('"');
}

/// Writes a number as Python does: integers in full, floats as `repr(float)`
/// (`json` writes non-finite floats as `NaN`/`Infinity`, `str()` as `nan`/`inf`).
fn write_number(out: &mut String, value: &Value, json: bool) {
    if value.is_integer() {
        match i128::try_from(value.clone()) {
            Ok(number) => out.push_str(&number.to_string()),
            Err(_) => out.push_str(&value.to_string()),
        }
        return;
    }
    let number = f64::try_from(value.clone()).unwrap_or(f64::NAN);
    match (number.is_nan(), number.is_infinite(), json) {
        (true, _, true) => out.push_str("NaN"),
        (true, _, false) => out.push_str("nan"),
        (_, true, true) => out.push_str(if number > 0.0 { "Infinity" } else { "-Infinity" }),
        (_, true, false) => out.push_str(if number > 0.0 { "inf" } else { "-inf" }),
        _ => out.push_str(&py_float_repr(number)),
    }
}

/// `repr(x)` of a finite Python float: the shortest round-trip digits, in positional notation
/// when the decimal exponent is in -4..16, else as `d.ddde+XX`.
pub(crate) fn py_float_repr(number: f64) -> String {
    let scientific = format!("{number:e}");
    let (mantissa, exponent) = scientific.split_once('e').unwrap_or((&scientific, "0"));
    let exponent: i32 = exponent.parse().unwrap_or(0);
    let (sign, mantissa) = mantissa.strip_prefix('-').map_or(("", mantissa), |rest| ("-", rest));
    let digits: String = mantissa.chars().filter(char::is_ascii_digit).collect();
    let point = exponent + 1; // digits d1d2... mean 0.d1d2... * 10^point
    if number == 0.0 {
        return format!("{sign}0.0");
    }
    if (-3..=16).contains(&point) {
        if point <= 0 {
            format!("{sign}0.{}{digits}", "0".repeat(point.unsigned_abs() as usize))
        } else if point as usize >= digits.len() {
            format!("{sign}{digits}{}.0", "0".repeat(point as usize - digits.len()))
        } else {
            let (whole, fraction) = digits.split_at(point as usize);
            format!("{sign}{whole}.{fraction}")
        }
    } else {
        let (first, rest) = digits.split_at(1);
        let fraction = if rest.is_empty() { String::new() } else { format!(".{rest}") };
        let exponent_sign = if exponent < 0 { '-' } else { '+' };
        format!("{sign}{first}{fraction}e{exponent_sign}{:02}", exponent.unsigned_abs())
    }
}

/// Writes `str(value)` as Jinja2 prints a value: `None`, `True`/`False`, Python float and
/// container reprs; undefined prints nothing.
pub(crate) fn write_py_str(out: &mut String, value: &Value) {
    match value.kind() {
        ValueKind::Undefined => {}
        ValueKind::String => out.push_str(value.as_str().unwrap_or_default()),
        _ => write_py_repr(out, value),
    }
}

/// Writes `repr(value)`: strings quoted the way Python quotes them, lists and dicts recursively.
fn write_py_repr(out: &mut String, value: &Value) {
    match value.kind() {
        ValueKind::Undefined => {}
        ValueKind::None => out.push_str("None"),
        ValueKind::Bool => out.push_str(if value.is_true() { "True" } else { "False" }),
        ValueKind::Number => write_number(out, value, false),
        ValueKind::String => write_py_string_repr(out, value.as_str().unwrap_or_default()),
        ValueKind::Seq => {
            let (open, close) = if value.is_tuple() { ('(', ")") } else { ('[', "]") };
            out.push(open);
            let mut count = 0;
            if let Ok(items) = value.try_iter() {
                for (index, item) in items.enumerate() {
                    if index > 0 {
                        out.push_str(", ");
                    }
                    write_py_repr(out, &item);
                    count += 1;
                }
            }
            out.push_str(if open == '(' && count == 1 { ",)" } else { close });
        }
        ValueKind::Map => {
            out.push('{');
            if let Ok(keys) = value.try_iter() {
                for (index, key) in keys.enumerate() {
                    if index > 0 {
                        out.push_str(", ");
                    }
                    write_py_repr(out, &key);
                    out.push_str(": ");
                    write_py_repr(out, &value.get_item(&key).unwrap_or_default());
                }
            }
            out.push('}');
        }
        _ => out.push_str(&value.to_string()),
    }
}

/// `repr(str)`: single quotes unless the text has a single quote and no double quote; control
/// characters escaped. (Python also escapes other non-printable code points; those are rare in chats.)
fn write_py_string_repr(out: &mut String, text: &str) {
    let quote = if text.contains('\'') && !text.contains('"') { '"' } else { '\'' };
    out.push(quote);
    for ch in text.chars() {
        match ch {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            ch if ch == quote => {
                out.push('\\');
                out.push(ch);
            }
            ch if (ch as u32) < 0x20 || (0x7f..0xa0).contains(&(ch as u32)) => {
                out.push_str(&format!("\\x{:02x}", ch as u32))
            }
            '\u{2028}' | '\u{2029}' => out.push_str(&format!("\\u{:04x}", ch as u32)),
            ch => out.push(ch),
        }
    }
    out.push(quote);
}
