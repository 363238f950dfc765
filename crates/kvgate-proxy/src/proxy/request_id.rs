//! Request ids (`--request-id-headers`, SMG's name): a proxied request's id is the value of the
//! first of those headers the client sent, else a new one (sent to the worker as `x-request-id`);
//! the client's response carries it as `x-request-id`, whatever the outcome, and the gateway's
//! log lines of the request name it.

use http::{HeaderMap, HeaderName, HeaderValue};

/// The header a generated id is sent to the worker in, and the response's.
pub(super) static REQUEST_ID_HEADER: HeaderName = HeaderName::from_static("x-request-id");

/// The request's id: the first of `names` present with a usable value, else a new random one
/// (inserted into `headers` as `x-request-id`, so the worker sees it too). `None` when the
/// feature is off (no names).
pub(super) fn take(names: &[HeaderName], headers: &mut HeaderMap) -> Option<HeaderValue> {
    if names.is_empty() {
        return None;
    }
    if let Some(given) = names.iter().find_map(|name| headers.get(name).filter(|value| !value.is_empty())) {
        return Some(given.clone());
    }
    let generated = HeaderValue::from_str(&format!("{:032x}", rand::random::<u128>())).ok()?;
    headers.insert(REQUEST_ID_HEADER.clone(), generated.clone());
    Some(generated)
}

/// The configured header names, parsed (validation refused invalid ones).
pub fn header_names(names: &[String]) -> Vec<HeaderName> {
    names.iter().filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(list: &[&str]) -> Vec<HeaderName> {
        header_names(&list.iter().map(|name| name.to_string()).collect::<Vec<_>>())
    }

    #[test]
    fn the_first_given_header_is_the_id_else_one_is_generated() {
        let mut headers = HeaderMap::new();
        assert_eq!(take(&[], &mut headers), None);
        assert!(headers.is_empty());

        headers.insert("x-correlation-id", HeaderValue::from_static("corr-1"));
        headers.insert("x-trace-id", HeaderValue::from_static("trace-1"));
        let list = names(&["x-request-id", "x-correlation-id", "x-trace-id"]);
        assert_eq!(take(&list, &mut headers).unwrap(), "corr-1");
        assert!(headers.get("x-request-id").is_none(), "a given id is not duplicated");

        let mut empty = HeaderMap::new();
        let generated = take(&list, &mut empty).unwrap();
        assert_eq!(generated.len(), 32);
        assert_eq!(empty.get("x-request-id"), Some(&generated));
        let again = take(&list, &mut HeaderMap::new()).unwrap();
        assert_ne!(generated, again);
    }
}
