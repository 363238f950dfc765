//! The gateway's own keys: the admin key (`--admin-api-key`) in front of its management
//! endpoints, and the client keys (`--client-api-keys`, `--client-api-keys-file`) in front of
//! the proxied ones, each naming its tenant (and optionally its priority class). Both are
//! `Authorization: Bearer` tokens compared in constant time.

use std::path::{Path, PathBuf};

use arc_swap::ArcSwap;
use http::{header, HeaderMap, HeaderName};

use crate::error::ApiError;
use crate::tenant::{check_tenant_name, identify, Claims, Identity, PriorityClass, DEFAULT_TENANT};

/// Refuses the request unless it carries the admin key (when one is configured).
pub fn check_admin_key(expected: Option<&str>, headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(expected) = expected else { return Ok(()) };
    if constant_time_eq(bearer_token(headers).as_bytes(), expected.as_bytes()) {
        Ok(())
    } else {
        Err(ApiError::Unauthorized)
    }
}

/// As [`check_admin_key`], and also accepting the key as the password of `Authorization: Basic`
/// (any user name): what a browser sends after asking, so the fleet page opens where a key is set.
pub fn check_admin_browser(expected: Option<&str>, headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(expected) = expected else { return Ok(()) };
    if check_admin_key(Some(expected), headers).is_ok() {
        return Ok(());
    }
    let password = basic_password(headers).unwrap_or_default();
    if constant_time_eq(password.as_bytes(), expected.as_bytes()) {
        Ok(())
    } else {
        Err(ApiError::Unauthorized)
    }
}

/// The password of `Authorization: Basic base64(user:password)`.
fn basic_password(headers: &HeaderMap) -> Option<String> {
    use base64::Engine as _;
    let encoded = headers.get(header::AUTHORIZATION)?.to_str().ok()?.strip_prefix("Basic ")?;
    let decoded = base64::engine::general_purpose::STANDARD.decode(encoded.trim()).ok()?;
    let text = String::from_utf8(decoded).ok()?;
    text.split_once(':').map(|(_, password)| password.to_string())
}

/// One client key and whom it names.
#[derive(Clone, Debug, PartialEq)]
pub struct ClientKey {
    pub key: String,
    pub tenant: String,
    /// The class the file gave the key (else the tenant's from `tenants:`).
    pub class: Option<PriorityClass>,
}

impl ClientKey {
    /// A `--client-api-keys` entry: `KEY=TENANT` (split at the last `=`, so base64 padding stays
    /// in the key when nothing follows it), or a plain `KEY` (the tenant `default`).
    pub fn parse_flag(entry: &str) -> Result<ClientKey, String> {
        let (key, tenant) = match entry.rsplit_once('=') {
            Some((key, tenant)) if !key.is_empty() && !tenant.is_empty() => (key, tenant),
            _ => (entry, DEFAULT_TENANT),
        };
        if key.is_empty() {
            return Err("a client key must not be empty".into());
        }
        check_tenant_name(tenant).map_err(|message| format!("the tenant of a key: {message}"))?;
        Ok(ClientKey { key: key.to_string(), tenant: tenant.to_string(), class: None })
    }
}

/// The client keys in force (the flag's and the file's), or none: no key needed.
#[derive(Debug, Default)]
pub struct ClientKeys {
    keys: Vec<ClientKey>,
    /// Keys are required (some were given, or a key file was, even an empty one).
    required: bool,
}

impl ClientKeys {
    /// The keys of `--client-api-keys` and of the file's text.
    pub fn new(flag: &[String], file: Option<&str>) -> Result<ClientKeys, String> {
        let mut keys = Vec::new();
        for entry in flag {
            keys.push(ClientKey::parse_flag(entry)?);
        }
        if let Some(text) = file {
            keys.extend(parse_key_file(text)?);
        }
        Ok(ClientKeys { required: !keys.is_empty() || file.is_some(), keys })
    }

    /// The keys of the flag and of the file at `path` (read now).
    pub fn load(flag: &[String], path: Option<&Path>) -> Result<ClientKeys, String> {
        let text =
            match path {
                Some(path) => Some(std::fs::read_to_string(path).map_err(|error| {
                    format!("cannot read the client keys file {}: {error}", path.display())
                })?),
                None => None,
            };
        ClientKeys::new(flag, text.as_deref()).map_err(|message| match path {
            Some(path) => format!("{}: {message}", path.display()),
            None => message,
        })
    }

    pub fn required(&self) -> bool {
        self.required
    }

    pub fn len(&self) -> usize {
        self.keys.len()
    }

    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// Every tenant a key names.
    pub fn tenants(&self) -> impl Iterator<Item = &str> {
        self.keys.iter().map(|key| key.tenant.as_str())
    }

    /// With keys required, the key the request presents (401 without one); `None` when no key is
    /// needed. Every key is compared, so the time taken does not say which one nearly matched.
    pub fn check(&self, headers: &HeaderMap) -> Result<Option<&ClientKey>, ApiError> {
        if !self.required {
            return Ok(None);
        }
        let presented = bearer_token(headers);
        let mut found = None;
        for key in &self.keys {
            if constant_time_eq(presented.as_bytes(), key.key.as_bytes()) && found.is_none() {
                found = Some(key);
            }
        }
        found.map(Some).ok_or(ApiError::InvalidApiKey)
    }
}

/// Who may call the proxied endpoints and for which tenant: the client keys in force
/// (replaced whole on reload, so a request sees the old keys or the new ones) and the tenant
/// and priority headers.
pub struct Clients {
    keys: ArcSwap<ClientKeys>,
    flag: Vec<String>,
    file: Option<PathBuf>,
    tenant_header: HeaderName,
    priority_header: HeaderName,
}

/// What the key check found, before the body is read.
#[derive(Debug)]
pub struct Caller {
    /// The key's tenant and class.
    key: Option<(String, Option<PriorityClass>)>,
    keys_required: bool,
}

impl Clients {
    /// The keys of `--client-api-keys` and `--client-api-keys-file` (read now), and the headers.
    pub fn new(
        flag: &[String],
        file: Option<&Path>,
        tenant_header: &str,
        priority_header: &str,
    ) -> Result<Clients, String> {
        let header = |name: &str| {
            HeaderName::from_bytes(name.as_bytes()).map_err(|_| format!("invalid header name {name:?}"))
        };
        Ok(Clients {
            keys: ArcSwap::from_pointee(ClientKeys::load(flag, file)?),
            flag: flag.to_vec(),
            file: file.map(Path::to_path_buf),
            tenant_header: header(tenant_header)?,
            priority_header: header(priority_header)?,
        })
    }

    /// Reads the key file again and puts its keys in force (with the flag's); on an error the
    /// keys in use stay. Returns how many keys are now in force.
    pub fn reload(&self) -> Result<usize, String> {
        let keys = ClientKeys::load(&self.flag, self.file.as_deref())?;
        let count = keys.len();
        self.keys.store(std::sync::Arc::new(keys));
        Ok(count)
    }

    /// The tenants the keys in force name.
    pub fn tenants(&self) -> Vec<String> {
        self.keys.load().tenants().map(str::to_string).collect()
    }

    /// Whether `name` is one of the gateway's own request headers: its `x-kvgate-*` namespace
    /// and the tenant and priority headers (of whatever name). They steer the gateway and are
    /// never forwarded to a worker.
    pub fn is_gateway_header(&self, name: &HeaderName) -> bool {
        kvgate_protocol::headers::is_gateway_header(name)
            || *name == self.tenant_header
            || *name == self.priority_header
    }

    /// Checks the request's key (401 when keys are required and it has none of them).
    pub fn authenticate(&self, headers: &HeaderMap) -> Result<Caller, ApiError> {
        let keys = self.keys.load();
        let key = keys.check(headers)?.map(|key| (key.tenant.clone(), key.class));
        Ok(Caller { key, keys_required: keys.required() })
    }

    /// The request's tenant and class (`user`: the body's field; `class_of`: a tenant's class
    /// from `tenants:`).
    pub fn identify(
        &self,
        caller: &Caller,
        headers: &HeaderMap,
        user: Option<&str>,
        class_of: impl Fn(&str) -> Option<PriorityClass>,
    ) -> Result<Identity, ApiError> {
        let text = |name: &HeaderName| headers.get(name).and_then(|value| value.to_str().ok());
        let claims = Claims {
            key: caller.key.as_ref().map(|(tenant, class)| (tenant.as_str(), *class)),
            tenant_header: text(&self.tenant_header),
            user,
            priority_header: text(&self.priority_header),
        };
        identify(claims, caller.keys_required, class_of).map_err(ApiError::BadRequest)
    }
}

/// A key file: one `KEY TENANT [CLASS]` per line, blank lines and `#` comments skipped; every bad
/// line is reported at once, by number.
fn parse_key_file(text: &str) -> Result<Vec<ClientKey>, String> {
    let mut keys = Vec::new();
    let mut problems = Vec::new();
    for (number, line) in text.lines().enumerate() {
        let line = line.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let words: Vec<&str> = line.split_whitespace().collect();
        let parsed = match words.as_slice() {
            [key, tenant] => Ok((key, tenant, None)),
            [key, tenant, class] => match PriorityClass::parse(class) {
                Some(class) => Ok((key, tenant, Some(class))),
                None => Err(format!("unknown priority class {class:?} (high, normal, low)")),
            },
            _ => Err("expected `KEY TENANT [CLASS]`".to_string()),
        }
        .and_then(|(key, tenant, class)| {
            check_tenant_name(tenant)?;
            Ok(ClientKey { key: key.to_string(), tenant: tenant.to_string(), class })
        });
        match parsed {
            Ok(key) => keys.push(key),
            Err(message) => problems.push(format!("line {}: {message}", number + 1)),
        }
    }
    if problems.is_empty() {
        Ok(keys)
    } else {
        Err(problems.join("; "))
    }
}

/// The `Authorization: Bearer TOKEN` token of a request ("" when there is none).
fn bearer_token(headers: &HeaderMap) -> &str {
    headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("")
}

/// Whether two keys are equal, in time that depends on their length only (`subtle`: a plain
/// comparison, or a fold the compiler may shorten, would tell a guesser how many bytes matched).
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    bool::from(subtle::ConstantTimeEq::ct_eq(a, b))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_compare_equal_only_when_every_byte_and_the_length_agree() {
        assert!(constant_time_eq(b"sk-secret", b"sk-secret"));
        assert!(!constant_time_eq(b"sk-secret", b"sk-secreT"));
        assert!(!constant_time_eq(b"sk-secret", b"sk-secret2"));
        assert!(!constant_time_eq(b"", b"x"));
        assert!(constant_time_eq(b"", b""));
    }

    fn headers(token: &str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(header::AUTHORIZATION, format!("Bearer {token}").parse().unwrap());
        headers
    }

    #[test]
    fn flag_entries_name_their_tenant_and_plain_keys_are_the_default_tenant() {
        let key = |entry| ClientKey::parse_flag(entry).unwrap();
        assert_eq!((key("k1=team-a").key, key("k1=team-a").tenant), ("k1".into(), "team-a".into()));
        assert_eq!(key("plain").tenant, DEFAULT_TENANT);
        // Base64 padding stays in the key.
        assert_eq!((key("YWJj==").key, key("YWJj==").tenant), ("YWJj==".into(), DEFAULT_TENANT.into()));
        assert!(ClientKey::parse_flag("k=bad tenant").is_err());
    }

    #[test]
    fn the_key_file_gives_tenants_and_classes_and_reports_every_bad_line() {
        let keys = ClientKeys::new(&[], Some("# keys\nk1 chat high\n\nk2 batch   # nightly\n")).unwrap();
        assert_eq!(keys.len(), 2);
        let found = keys.check(&headers("k1")).unwrap().unwrap();
        assert_eq!((found.tenant.as_str(), found.class), ("chat", Some(PriorityClass::High)));
        assert_eq!(keys.check(&headers("k2")).unwrap().unwrap().class, None);
        assert!(matches!(keys.check(&headers("k3")), Err(ApiError::InvalidApiKey)));
        let error = ClientKeys::new(&[], Some("k1\nk2 t urgent\nk3 t\n")).unwrap_err();
        assert!(error.contains("line 1") && error.contains("line 2: unknown priority class"), "{error}");
    }

    #[test]
    fn an_empty_key_file_still_requires_a_key() {
        let keys = ClientKeys::new(&[], Some("# nobody yet\n")).unwrap();
        assert!(keys.required());
        assert!(keys.check(&headers("anything")).is_err());
        assert!(ClientKeys::new(&[], None).unwrap().check(&HeaderMap::new()).unwrap().is_none());
    }
}
