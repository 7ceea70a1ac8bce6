//! Per-route configuration, shared by the tower layer and the proxy.
//!
//! A [`Policy`] says how one route is made idempotent; [`Routes`] maps
//! request paths to policies. Both deserialize with serde (the proxy reads
//! them from TOML) and are checked once, by [`Policy::validate`], before the
//! engine uses them — a bad value is refused at start, never at request time.

use std::fmt;
use std::ops::RangeInclusive;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use http::{header, HeaderMap, HeaderName, Method, StatusCode};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::principal::PrincipalSource;
pub use crate::principal::{JwtPolicy, PrincipalPolicy};

/// One mebibyte, the default request and response size cap.
pub const MIB: usize = 1024 * 1024;

/// Where the idempotency key of a request is found.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum KeySource {
    /// A request header, by default `Idempotency-Key`: a bare token or the
    /// IETF draft's quoted sf-string (`"…"`). More than one header of that
    /// name is a malformed key.
    Header(String),
    /// A field of an `application/x-www-form-urlencoded` or
    /// `multipart/form-data` body, such as a hidden `submission_token`.
    FormField(String),
    /// A JSON pointer (RFC 6901) into a JSON body, such as `/idempotency_key`.
    /// The value must be a string.
    JsonPointer(String),
    /// A query parameter.
    Query(String),
}

impl Default for KeySource {
    fn default() -> Self {
        KeySource::Header("Idempotency-Key".to_owned())
    }
}

/// What a request does when its key is held by another request in flight.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum InFlightPolicy {
    /// Wait (at most [`Policy::wait_timeout`]) for the first request to
    /// finish, then replay its response. A double-clicked form shows the same
    /// result page twice.
    #[default]
    Wait,
    /// Answer 409 with `Retry-After` at once.
    Reject,
}

/// What "same key, different request" gets once the key's request has
/// consumed it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MismatchPolicy {
    /// Refuse with [`Policy::mismatch_status`] (422 or 409): an API client
    /// that changed its request under an old key learns about it.
    #[default]
    Reject,
    /// Answer with the key's stored response, marked replayed: the form
    /// token *is* the submission (the Laravel seed's semantics), so a
    /// corrected or changed form sent again with a consumed token gets the
    /// success page, never a second execution. A key whose request is
    /// still in flight is waited for as usual.
    Replay,
}

/// What happens when the store cannot be reached.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FailMode {
    /// 503 with `Retry-After`; the upstream is not called. The safe default.
    #[default]
    Closed,
    /// Forward the request without protection. A duplicate may execute
    /// while the store is down: an explicit opt-in only.
    Open,
}

/// A set of status codes, written as `"2xx"`, `"303"` or `"200-299"`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StatusSet(Vec<RangeInclusive<u16>>);

impl StatusSet {
    /// Whether `status` is in the set.
    pub fn contains(&self, status: StatusCode) -> bool {
        let code = status.as_u16();
        self.0.iter().any(|range| range.contains(&code))
    }
}

impl Default for StatusSet {
    /// `2xx` and `3xx`: successes and redirects (a 303 Post/Redirect/Get is
    /// replayed as the same redirect).
    fn default() -> Self {
        StatusSet(vec![200..=299, 300..=399])
    }
}

impl FromStr for StatusSet {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let mut ranges = Vec::new();
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            ranges.push(parse_status_range(part)?);
        }
        Ok(StatusSet(ranges))
    }
}

fn parse_status_range(part: &str) -> Result<RangeInclusive<u16>, String> {
    let code = |s: &str| -> Result<u16, String> {
        match s.trim().parse::<u16>() {
            Ok(code) if (100..=599).contains(&code) => Ok(code),
            _ => Err(format!("`{s}` is not an HTTP status code (100..=599)")),
        }
    };
    if let Some(class) = part.strip_suffix("xx").or_else(|| part.strip_suffix("XX")) {
        return match class {
            "1" | "2" | "3" | "4" | "5" => {
                let start = class.parse::<u16>().unwrap_or(0) * 100;
                Ok(start..=start + 99)
            }
            _ => Err(format!("`{part}` is not a status class (1xx..5xx)")),
        };
    }
    if let Some((from, to)) = part.split_once('-') {
        let (from, to) = (code(from)?, code(to)?);
        if from > to {
            return Err(format!("`{part}` is an empty range"));
        }
        return Ok(from..=to);
    }
    let code = code(part)?;
    Ok(code..=code)
}

impl fmt::Display for StatusSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, range) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            let (start, end) = (*range.start(), *range.end());
            if start == end {
                write!(f, "{start}")?;
            } else if start % 100 == 0 && end == start + 99 {
                write!(f, "{}xx", start / 100)?;
            } else {
                write!(f, "{start}-{end}")?;
            }
        }
        Ok(())
    }
}

impl Serialize for StatusSet {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let parts: Vec<String> = self
            .to_string()
            .split(',')
            .map(str::to_owned)
            .filter(|p| !p.is_empty())
            .collect();
        parts.serialize(serializer)
    }
}

impl<'de> Deserialize<'de> for StatusSet {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let parts = Vec::<String>::deserialize(deserializer)?;
        let mut ranges = Vec::new();
        for part in &parts {
            ranges.push(parse_status_range(part.trim()).map_err(serde::de::Error::custom)?);
        }
        Ok(StatusSet(ranges))
    }
}

/// How one route is made idempotent. Every field has a default, so an
/// empty policy is the documented default behaviour.
///
/// Field names are the TOML keys of the proxy's configuration file.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Policy {
    /// Methods the guarantee applies to; other methods pass through
    /// untouched, without body buffering. Default `["POST", "PATCH"]`.
    pub methods: Vec<String>,
    /// Where the key is read. Default: the `Idempotency-Key` header.
    pub key: KeySource,
    /// A request without a key gets 400 (`true`) or passes through
    /// unprotected (`false`, the default).
    pub required: bool,
    /// Accept only UUIDs (hyphenated, 36 characters) as keys.
    pub uuid_only: bool,
    /// Request headers that identify the caller (e.g. `Authorization`).
    /// They are hashed into the key's scope, never stored raw: two callers
    /// with the same key never see each other's responses.
    pub scope_headers: Vec<String>,
    /// Request headers hashed into the fingerprint. Default `["content-type"]`.
    pub fingerprint_headers: Vec<String>,
    /// Body fields left out of the fingerprint: JSON pointers (`/meta/sent_at`)
    /// for JSON bodies, field names (`_token`) for form bodies.
    pub fingerprint_exclude: Vec<String>,
    /// How long a completed record is kept and replayed. Default 24 h.
    #[serde(with = "humantime_serde")]
    pub ttl: Duration,
    /// How long an in-flight record is held before another request may take
    /// it over; renewed by a heartbeat while the upstream runs. Default 30 s.
    #[serde(with = "humantime_serde")]
    pub lease: Duration,
    /// What a duplicate does while the first is in flight. Default `wait`.
    pub in_flight: InFlightPolicy,
    /// The longest a duplicate waits before 409. Default 10 s.
    #[serde(with = "humantime_serde")]
    pub wait_timeout: Duration,
    /// Tower layer: the longest an execution may take, from calling the
    /// inner service to the end of its response body. Past it the layer
    /// stops waiting and answers 504 `upstream-timeout`, and — as the
    /// handler may still be running and may still act — stores that
    /// answer as the key's outcome ("executed, outcome unknown"): retries
    /// replay the 504 and never execute again; a new attempt needs a new
    /// key. So a hung handler holds its key (409 to its retries) for at
    /// most this long, not for ever.
    ///
    /// Default 5 min: well above the usual client and load-balancer
    /// timeouts (30–60 s), because the layer keeps an execution whose
    /// caller left running and stores its answer for the retry, and cutting
    /// a slow but healthy request would turn its success into "outcome
    /// unknown". The proxy does not use it: there the upstream is another
    /// process, and `[proxy] read_timeout` bounds the wait for its answer
    /// (and each silence within it).
    #[serde(with = "humantime_serde")]
    pub execution_timeout: Duration,
    /// The status for "same key, different request": 422 (IETF draft,
    /// default) or 409.
    pub mismatch_status: u16,
    /// What "same key, different request" gets once the key is consumed:
    /// `reject` (default, [`Policy::mismatch_status`]) or `replay` (the
    /// stored response, for form routes; see [`MismatchPolicy`]).
    pub mismatch: MismatchPolicy,
    /// The status of the in-flight conflict (a duplicate on an
    /// `in_flight = "reject"` route, or one that waited out `wait_timeout`),
    /// with `Retry-After`. Default 409. A client that tells conflicts apart
    /// by status alone needs it to differ from `mismatch_status` (e.g. 425
    /// or 429); any 4xx or 5xx is accepted.
    pub in_flight_status: u16,
    /// Which upstream statuses are stored and replayed; any other status
    /// releases the key so a corrected request can go through.
    /// Default `["2xx", "3xx"]`.
    pub store_statuses: StatusSet,
    /// The redirect targets that mean success. When set, a stored 3xx
    /// consumes the key only if its `Location` (absolute or relative; its
    /// path, normalised) matches one of these patterns (the route pattern
    /// syntax: a prefix or a glob); any other redirect — the redirect
    /// *back* to a form after a validation error (Laravel) — releases the
    /// key. Default empty: every stored 3xx consumes it.
    pub success_redirects: Vec<String>,
    /// What to do when the store is unreachable. Default `closed`.
    pub fail_mode: FailMode,
    /// The largest request body accepted, in bytes; larger ones get 413
    /// before anything is reserved. Default 1 MiB.
    pub max_body_bytes: usize,
    /// The largest response body stored, in bytes. A larger response is
    /// still delivered whole, but only a marker is stored: retries get a
    /// `response-not-stored` problem and the request never runs twice.
    /// Default 1 MiB.
    pub max_response_bytes: usize,
    /// Replay `Set-Cookie` headers. Default `false`: a replay never hands out
    /// a session cookie minted for the first request.
    pub replay_set_cookie: bool,
    /// Hash the request's host name (the URI's, else the `Host` header's;
    /// lowercased, without port, see [`scope_host`]) into the key's scope.
    /// Default `true`: two virtual hosts (tenants) behind one engine never
    /// share a key space. Turn it off only when several host names serve
    /// one and the same application and a retry may arrive under another
    /// name.
    pub scope_authority: bool,
    /// The caller's stable identity, hashed into the key's scope: a
    /// header set by a trusted gateway, or a verified JWT's `sub` (see
    /// [`PrincipalPolicy`] and the [`principal`](crate::principal) module).
    /// Unlike `scope_headers = ["Authorization"]`, a refreshed token of the
    /// same caller is the same scope, so its retry replays. A present but
    /// unverifiable credential is refused (401 `principal-invalid`); a
    /// missing one is refused when `required` (401 `principal-missing`).
    /// Default none. In the tower layer, a [`Principal`](crate::Principal)
    /// request extension wins over it when set.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub principal: Option<PrincipalPolicy>,
}

impl Default for Policy {
    fn default() -> Self {
        Policy {
            methods: vec!["POST".into(), "PATCH".into()],
            key: KeySource::default(),
            required: false,
            uuid_only: false,
            scope_headers: Vec::new(),
            fingerprint_headers: vec!["content-type".into()],
            fingerprint_exclude: Vec::new(),
            ttl: Duration::from_secs(24 * 60 * 60),
            lease: Duration::from_secs(30),
            in_flight: InFlightPolicy::Wait,
            wait_timeout: Duration::from_secs(10),
            execution_timeout: Duration::from_secs(5 * 60),
            mismatch_status: 422,
            mismatch: MismatchPolicy::Reject,
            in_flight_status: 409,
            store_statuses: StatusSet::default(),
            success_redirects: Vec::new(),
            fail_mode: FailMode::Closed,
            max_body_bytes: MIB,
            max_response_bytes: MIB,
            replay_set_cookie: false,
            scope_authority: true,
            principal: None,
        }
    }
}

/// A policy that failed [`Policy::validate`]: which field, and why.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("invalid `{field}`: {reason}")]
pub struct PolicyError {
    /// The offending field, as named in TOML.
    pub field: &'static str,
    /// What is wrong with it.
    pub reason: String,
}

fn invalid(field: &'static str, reason: impl Into<String>) -> PolicyError {
    PolicyError {
        field,
        reason: reason.into(),
    }
}

fn header_names(field: &'static str, names: &[String]) -> Result<Vec<HeaderName>, PolicyError> {
    names
        .iter()
        .map(|name| {
            HeaderName::from_bytes(name.as_bytes())
                .map_err(|_| invalid(field, format!("`{name}` is not a header name")))
        })
        .collect()
}

impl Policy {
    /// Builder-style: require a key.
    pub fn required(mut self, required: bool) -> Self {
        self.required = required;
        self
    }

    /// Builder-style: read the key from `source`.
    pub fn key(mut self, source: KeySource) -> Self {
        self.key = source;
        self
    }

    /// Checks every field and prepares the policy for the engine. This is
    /// the only place a policy can be refused.
    pub fn validate(&self) -> Result<Arc<RoutePolicy>, PolicyError> {
        if self.methods.is_empty() {
            return Err(invalid(
                "methods",
                "is empty, so the route would cover nothing; list the methods it covers, \
                 or write an exclusion to leave its paths alone",
            ));
        }
        let methods = self
            .methods
            .iter()
            .map(|m| {
                Method::from_bytes(m.to_ascii_uppercase().as_bytes())
                    .map_err(|_| invalid("methods", format!("`{m}` is not an HTTP method")))
            })
            .collect::<Result<Vec<_>, _>>()?;
        if let Some(safe) = methods.iter().find(|m| {
            matches!(
                **m,
                Method::GET | Method::HEAD | Method::OPTIONS | Method::TRACE
            )
        }) {
            return Err(invalid(
                "methods",
                format!("{safe} is a safe method; idempotency keys apply to unsafe methods"),
            ));
        }
        match &self.key {
            KeySource::Header(name) => {
                HeaderName::from_bytes(name.as_bytes())
                    .map_err(|_| invalid("key", format!("`{name}` is not a header name")))?;
            }
            KeySource::JsonPointer(pointer) if !pointer.starts_with('/') => {
                return Err(invalid("key", "a JSON pointer starts with `/`"));
            }
            KeySource::FormField(name) | KeySource::Query(name) if name.is_empty() => {
                return Err(invalid("key", "the field name is empty"));
            }
            _ => {}
        }
        let scope_headers = header_names("scope_headers", &self.scope_headers)?;
        let fingerprint_headers = header_names("fingerprint_headers", &self.fingerprint_headers)?;
        let principal = match &self.principal {
            Some(principal) => Some(Arc::new(principal.load(&scope_headers)?)),
            None => None,
        };
        if self.lease < Duration::from_millis(10) {
            return Err(invalid("lease", "must be at least 10ms"));
        }
        if self.execution_timeout.is_zero() {
            return Err(invalid("execution_timeout", "must be longer than zero"));
        }
        if self.ttl < self.lease {
            return Err(invalid("ttl", "must be at least as long as the lease"));
        }
        let mismatch_status = match self.mismatch_status {
            409 => StatusCode::CONFLICT,
            422 => StatusCode::UNPROCESSABLE_ENTITY,
            other => {
                return Err(invalid(
                    "mismatch_status",
                    format!("{other} is not 409 or 422"),
                ))
            }
        };
        let in_flight_status = StatusCode::from_u16(self.in_flight_status)
            .ok()
            .filter(|status| status.is_client_error() || status.is_server_error())
            .ok_or_else(|| {
                invalid(
                    "in_flight_status",
                    format!("{} is not a 4xx or 5xx status", self.in_flight_status),
                )
            })?;
        let success_redirects = self
            .success_redirects
            .iter()
            .map(|pattern| {
                PathPattern::parse(pattern)
                    .map_err(|error| invalid("success_redirects", error.reason))
            })
            .collect::<Result<Vec<_>, _>>()?;
        if !success_redirects.is_empty()
            && !(300..=399).any(|code| {
                StatusCode::from_u16(code).is_ok_and(|status| self.store_statuses.contains(status))
            })
        {
            return Err(invalid(
                "success_redirects",
                "no 3xx status is in `store_statuses`, so no redirect is ever stored",
            ));
        }
        if self.max_body_bytes == 0 {
            return Err(invalid("max_body_bytes", "must be greater than 0"));
        }
        let (json_exclude, form_exclude) = self
            .fingerprint_exclude
            .iter()
            .cloned()
            .partition::<Vec<_>, _>(|field| field.starts_with('/'));
        Ok(Arc::new(RoutePolicy {
            methods,
            scope_headers,
            fingerprint_headers,
            mismatch: mismatch_status,
            in_flight_status,
            success_redirects,
            json_exclude: json_exclude
                .iter()
                .map(|p| crate::formats::parse_pointer(p))
                .collect(),
            form_exclude,
            case_insensitive_paths: false,
            principal,
            policy: self.clone(),
        }))
    }
}

/// A [`Policy`] that passed [`Policy::validate`], with its strings parsed.
#[derive(Clone, Debug)]
pub struct RoutePolicy {
    pub(crate) methods: Vec<Method>,
    pub(crate) scope_headers: Vec<HeaderName>,
    pub(crate) fingerprint_headers: Vec<HeaderName>,
    /// The status answered for a key mismatch: `Policy::mismatch_status`,
    /// checked to be 409 or 422.
    pub(crate) mismatch: StatusCode,
    /// `Policy::in_flight_status`, checked to be 4xx or 5xx.
    pub(crate) in_flight_status: StatusCode,
    /// `Policy::success_redirects`, parsed.
    pub(crate) success_redirects: Vec<PathPattern>,
    pub(crate) json_exclude: Vec<Vec<String>>,
    pub(crate) form_exclude: Vec<String>,
    /// Whether its table routes paths case-insensitively (set by
    /// [`Routes`]); the scope then uses the lowercased path too.
    pub(crate) case_insensitive_paths: bool,
    /// `Policy::principal`, its keys loaded.
    pub(crate) principal: Option<Arc<PrincipalSource>>,
    pub(crate) policy: Policy,
}

impl RoutePolicy {
    /// The policy as configured.
    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    /// The request body limit in bytes.
    pub fn max_body_bytes(&self) -> usize {
        self.policy().max_body_bytes
    }

    /// Whether `method` is one the guarantee applies to on this route.
    pub fn applies_to(&self, method: &Method) -> bool {
        self.methods.contains(method)
    }

    /// Whether an upstream answer with `status` and `headers` consumes the
    /// key (it is stored and replayed from now on): its status is in
    /// `store_statuses` and, for a redirect on a route with
    /// `success_redirects`, its `Location` matches one of them. Any other
    /// answer releases the key. `request_path` resolves a relative
    /// `Location` such as `thanks`.
    pub fn consumes(&self, status: StatusCode, headers: &HeaderMap, request_path: &str) -> bool {
        if !self.policy.store_statuses.contains(status) {
            return false;
        }
        if !status.is_redirection() || self.success_redirects.is_empty() {
            return true;
        }
        let Some(target) = headers
            .get(header::LOCATION)
            .and_then(|location| location_path(location.as_bytes(), request_path))
        else {
            return false;
        };
        self.success_redirects
            .iter()
            .any(|pattern| pattern.matches(&target))
    }

    /// Feeds the request target's part of the key's scope to `put`: the
    /// host (unless [`Policy::scope_authority`] is off; see [`scope_host`])
    /// and the normalised path (see [`normalize_path`]), each as one part.
    /// Two spellings of one path share a scope; two hosts never do.
    pub(crate) fn scope_target(
        &self,
        uri: &http::Uri,
        headers: &http::HeaderMap,
        put: &mut impl FnMut(&[u8]),
    ) {
        if self.policy.scope_authority {
            put(scope_host(uri, headers).as_bytes());
        }
        put(normalize_path(uri.path(), self.case_insensitive_paths).as_bytes());
    }
}

/// The path a `Location` points to: the path of an absolute URL
/// (`http://host/contact/thanks`), of a network-path reference
/// (`//host/x`), an absolute path (`/x?y`), or a relative reference
/// resolved against `base` (`thanks` from `/contact` is `/thanks`),
/// normalised as request paths are (see [`normalize_path`]). `None` for a
/// value that is not UTF-8.
fn location_path(location: &[u8], base: &str) -> Option<String> {
    let location = std::str::from_utf8(location).ok()?.trim();
    let location = location.split(['?', '#']).next().unwrap_or_default();
    let path = if let Some(rest) = location.strip_prefix("//") {
        rest.find('/').map_or("/", |i| &rest[i..]).to_owned()
    } else if location.starts_with('/') {
        location.to_owned()
    } else if let Some(scheme) = location.find("://").filter(|&i| {
        location[..i]
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'+' | b'-' | b'.'))
    }) {
        let rest = &location[scheme + 3..];
        rest.find('/').map_or("/", |i| &rest[i..]).to_owned()
    } else {
        let directory = base.rfind('/').map_or("/", |i| &base[..=i]);
        format!("{directory}{location}")
    };
    Some(normalize_path(&path, false).into_owned())
}

/// The host a request's key is scoped by: the URI's authority, else the
/// `Host` header, without port or trailing dot, lowercased; empty when
/// there is none. Host names select tenants; the port does not (instances
/// of one deployment listen on different ports, and `example.com` and
/// `example.com:443` are one target).
pub fn scope_host(uri: &http::Uri, headers: &http::HeaderMap) -> String {
    let host = match uri.authority() {
        Some(authority) => authority.host().to_owned(),
        None => match headers.get(http::header::HOST) {
            Some(value) => match http::uri::Authority::try_from(value.as_bytes()) {
                Ok(authority) => authority.host().to_owned(),
                // Not a valid authority: the value itself, as it came.
                Err(_) => String::from_utf8_lossy(value.as_bytes()).into_owned(),
            },
            None => String::new(),
        },
    };
    let host = host.strip_suffix('.').unwrap_or(&host);
    host.to_ascii_lowercase()
}

/// The form a path is routed and scoped by; the request itself is
/// forwarded unchanged.
///
/// * percent-encoded unreserved characters (`A-Z a-z 0-9 - . _ ~`) are
///   decoded (`/%61pi` is `/api`); other escapes keep their meaning and get
///   upper-case hex digits (`%2f` is `%2F`, never `/`);
/// * repeated slashes are merged (`//api` is `/api`);
/// * `.` and `..` segments are removed (`/./api`, `/x/../api` are `/api`;
///   `..` never climbs above the root);
/// * a trailing slash is dropped (`/api/pay/` is `/api/pay`); `/` stays;
/// * with `case_insensitive`, ASCII letters are lowercased.
///
/// An empty path is `/`.
pub fn normalize_path(path: &str, case_insensitive: bool) -> std::borrow::Cow<'_, str> {
    normalize(path, case_insensitive, true)
}

/// Whether `path` holds a percent-encoded dot (`%2e`): backends disagree
/// on whether `/%2e%2e/` is a `..` segment.
fn has_encoded_dot(path: &str) -> bool {
    path.as_bytes()
        .windows(3)
        .any(|w| w[0] == b'%' && w[1] == b'2' && w[2].eq_ignore_ascii_case(&b'e'))
}

/// [`normalize_path`]; with `decode_dots` off, `%2e` stays encoded (as
/// `%2E`), so it never makes a dot segment.
fn normalize(path: &str, case_insensitive: bool, decode_dots: bool) -> std::borrow::Cow<'_, str> {
    let bytes = path.as_bytes();
    let simple = bytes.first() == Some(&b'/')
        && !bytes.contains(&b'%')
        && !bytes.windows(2).any(|w| w == b"//" || w == b"/.")
        && (bytes.len() == 1 || bytes.last() != Some(&b'/'))
        && !(case_insensitive && bytes.iter().any(u8::is_ascii_uppercase));
    if simple {
        return std::borrow::Cow::Borrowed(path);
    }
    // Percent-decoding of unreserved characters first (RFC 3986 6.2.2.2),
    // then dot segments (6.2.2.3), so `/%2e%2e/` is a `..` segment too.
    let mut decoded = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let byte = bytes[i];
        if byte == b'%' && i + 2 < bytes.len() {
            let hex = |b: u8| (b as char).to_digit(16);
            if let (Some(hi), Some(lo)) = (hex(bytes[i + 1]), hex(bytes[i + 2])) {
                let value = (hi * 16 + lo) as u8;
                let unreserved = value.is_ascii_alphanumeric()
                    || matches!(value, b'-' | b'_' | b'~')
                    || (value == b'.' && decode_dots);
                if unreserved {
                    decoded.push(value);
                } else {
                    decoded.push(b'%');
                    decoded.push(bytes[i + 1].to_ascii_uppercase());
                    decoded.push(bytes[i + 2].to_ascii_uppercase());
                }
                i += 3;
                continue;
            }
        }
        decoded.push(byte);
        i += 1;
    }
    if case_insensitive {
        decoded.make_ascii_lowercase();
    }
    let mut segments: Vec<&[u8]> = Vec::new();
    for segment in decoded.split(|&b| b == b'/') {
        match segment {
            b"" | b"." => {}
            b".." => {
                segments.pop();
            }
            segment => segments.push(segment),
        }
    }
    let mut out = String::with_capacity(decoded.len());
    for segment in &segments {
        out.push('/');
        // Only ASCII bytes were decoded; the rest is the input's own text.
        out.push_str(&String::from_utf8_lossy(segment));
    }
    if out.is_empty() {
        out.push('/');
    }
    std::borrow::Cow::Owned(out)
}

/// How a route matches request paths. Paths are matched in their
/// normalised form (see [`normalize_path`]), and patterns must be written
/// in that form.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PathPattern {
    /// `/orders` matches `/orders` and `/orders/…`, not `/orders-archive`.
    /// `/` matches every path.
    Prefix(String),
    /// A glob: `*` matches within one segment, `**` matches anything,
    /// e.g. `/api/*/submit` or `/forms/**`. Matched in time linear in the
    /// path's length (times the pattern's), whatever the pattern.
    Glob(String),
}

impl PathPattern {
    /// Parses `pattern`: a glob when it contains `*`, a prefix otherwise.
    ///
    /// Refused: a pattern that does not start with `/`; one that ends with
    /// `/` (other than `/` itself: paths are matched without their
    /// trailing slash, so `/orders/` would never match `/orders`); and one
    /// that is not in normal form (`//`, `.` or `..` segments, `%`
    /// escapes), which no normalised path could match.
    pub fn parse(pattern: &str) -> Result<Self, PolicyError> {
        if !pattern.starts_with('/') {
            return Err(invalid(
                "path",
                format!("`{pattern}` does not start with `/`"),
            ));
        }
        if pattern.len() > 1 && pattern.ends_with('/') {
            return Err(invalid(
                "path",
                format!(
                    "`{pattern}` ends with `/`; write `{}`, which covers that path with or \
                     without the slash and everything under it",
                    pattern.trim_end_matches('/')
                ),
            ));
        }
        if pattern.contains('%')
            || pattern.contains("//")
            || pattern
                .split('/')
                .any(|segment| segment == "." || segment == "..")
        {
            return Err(invalid(
                "path",
                format!(
                    "`{pattern}` is not a normalised path (no `//`, `.` or `..` segments, or \
                     `%` escapes): requests are matched in that form"
                ),
            ));
        }
        Ok(if pattern.contains('*') {
            PathPattern::Glob(pattern.to_owned())
        } else {
            PathPattern::Prefix(pattern.to_owned())
        })
    }

    /// Whether `path` (without query, already normalised) matches.
    pub fn matches(&self, path: &str) -> bool {
        match self {
            PathPattern::Prefix(prefix) => match path.strip_prefix(prefix.as_str()) {
                Some(rest) => rest.is_empty() || prefix.ends_with('/') || rest.starts_with('/'),
                None => false,
            },
            PathPattern::Glob(glob) => glob_match(glob.as_bytes(), path.as_bytes()),
        }
    }

    fn make_ascii_lowercase(&mut self) {
        match self {
            PathPattern::Prefix(p) | PathPattern::Glob(p) => p.make_ascii_lowercase(),
        }
    }
}

/// One step of a glob.
#[derive(Clone, Copy, PartialEq, Eq)]
enum GlobToken {
    Byte(u8),
    /// `*`: any bytes but `/`.
    Star,
    /// `**`: any bytes.
    AnyStar,
}

fn glob_tokens(pattern: &[u8]) -> Vec<GlobToken> {
    let mut tokens = Vec::with_capacity(pattern.len());
    let mut i = 0;
    while i < pattern.len() {
        if pattern[i] == b'*' {
            if pattern.get(i + 1) == Some(&b'*') {
                tokens.push(GlobToken::AnyStar);
                i += 2;
            } else {
                tokens.push(GlobToken::Star);
                i += 1;
            }
        } else {
            tokens.push(GlobToken::Byte(pattern[i]));
            i += 1;
        }
    }
    tokens
}

/// Glob matching as a simulation of the pattern's automaton: the set of
/// pattern positions the path read so far can be at is carried along the
/// path, one byte at a time. Each byte costs at most one step per pattern
/// token, so a match costs O(path × pattern) steps whatever the input: no
/// backtracking, however many `*` and `**` the pattern has.
fn glob_match(pattern: &[u8], path: &[u8]) -> bool {
    glob_match_counting(pattern, path, &mut 0)
}

/// [`glob_match`], adding the steps it takes to `steps`.
fn glob_match_counting(pattern: &[u8], path: &[u8], steps: &mut u64) -> bool {
    let tokens = glob_tokens(pattern);
    let m = tokens.len();
    // `now[i]`: the path read so far can end before token `i`.
    let mut now = vec![false; m + 1];
    let mut next = vec![false; m + 1];
    now[0] = true;
    close(&tokens, &mut now);
    for &byte in path {
        next.iter_mut().for_each(|state| *state = false);
        let mut any = false;
        for (i, token) in tokens.iter().enumerate() {
            *steps += 1;
            if !now[i] {
                continue;
            }
            match *token {
                GlobToken::Byte(expected) if expected == byte => next[i + 1] = true,
                GlobToken::Star if byte != b'/' => next[i] = true,
                GlobToken::AnyStar => next[i] = true,
                _ => continue,
            }
            any = true;
        }
        if !any {
            return false;
        }
        close(&tokens, &mut next);
        std::mem::swap(&mut now, &mut next);
    }
    now[m]
}

/// Adds the positions reachable without reading: past any `*` or `**`
/// (they may match nothing).
fn close(tokens: &[GlobToken], states: &mut [bool]) {
    for (i, token) in tokens.iter().enumerate() {
        if states[i] && !matches!(token, GlobToken::Byte(_)) {
            states[i + 1] = true;
        }
    }
}

/// One route: a path pattern and its policy, or `None` to leave matching
/// paths alone entirely.
#[derive(Clone, Debug)]
pub struct Route {
    /// Which paths it covers.
    pub path: PathPattern,
    /// The policy, or `None` for "no idempotency here".
    pub policy: Option<Arc<RoutePolicy>>,
}

/// An ordered route table. A request is decided by the first route whose
/// pattern matches its normalised path (see [`normalize_path`]) **and**
/// that covers its method: an exclusion (any method), or a route whose
/// policy lists the method. A route whose pattern matches but whose
/// methods do not is skipped, so a later route can still cover the
/// request. A request no route decides is left alone.
#[derive(Clone, Debug, Default)]
pub struct Routes {
    routes: Vec<Route>,
    case_insensitive: bool,
}

impl Routes {
    /// An empty table: nothing is covered.
    pub fn new() -> Self {
        Self::default()
    }

    /// One policy for every path.
    pub fn all(policy: Policy) -> Result<Self, PolicyError> {
        Routes::new().route("/", policy)
    }

    /// Routes paths without regard to ASCII case (`/API/Pay` is `/api/pay`),
    /// for backends that do the same (ASP.NET, IIS): the scope then uses
    /// the lowercased path too, so both spellings share one key space.
    /// Applies to every route, added before or after this call (their
    /// patterns are kept lowercased from then on, so turning it off again
    /// needs a new table). Default off.
    pub fn case_insensitive(mut self, on: bool) -> Self {
        self.case_insensitive = on;
        for route in &mut self.routes {
            if on {
                route.path.make_ascii_lowercase();
            }
            if let Some(policy) = &mut route.policy {
                Arc::make_mut(policy).case_insensitive_paths = on;
            }
        }
        self
    }

    /// Appends a route covering `pattern` with `policy`.
    pub fn route(mut self, pattern: &str, policy: Policy) -> Result<Self, PolicyError> {
        let mut policy = policy.validate()?;
        Arc::make_mut(&mut policy).case_insensitive_paths = self.case_insensitive;
        let path = self.pattern(pattern)?;
        self.routes.push(Route {
            path,
            policy: Some(policy),
        });
        Ok(self)
    }

    fn pattern(&self, pattern: &str) -> Result<PathPattern, PolicyError> {
        let mut path = PathPattern::parse(pattern)?;
        if self.case_insensitive {
            path.make_ascii_lowercase();
        }
        Ok(path)
    }

    /// Appends a route that leaves `pattern` alone (no idempotency), for
    /// every method.
    pub fn exclude(mut self, pattern: &str) -> Result<Self, PolicyError> {
        let path = self.pattern(pattern)?;
        self.routes.push(Route { path, policy: None });
        Ok(self)
    }

    /// The policy that applies to `method` on `path` (raw, as in the
    /// request; it is normalised here), if any.
    ///
    /// A path with an encoded dot (`/api/pay/%2e%2e`) is read both ways, as
    /// backends differ on it (some decode `%2e` and then remove dot
    /// segments, others take it as text): it is covered when either reading
    /// is, so neither kind of backend can be reached around a route. The
    /// first reading (dots decoded) wins when both are covered.
    pub fn find(&self, method: &Method, path: &str) -> Option<&Arc<RoutePolicy>> {
        let decoded = self.decide(method, &normalize(path, self.case_insensitive, true));
        if decoded.is_some() || !has_encoded_dot(path) {
            return decoded;
        }
        self.decide(method, &normalize(path, self.case_insensitive, false))
    }

    /// The first route matching normalised `path` and `method` decides.
    fn decide(&self, method: &Method, path: &str) -> Option<&Arc<RoutePolicy>> {
        for route in &self.routes {
            if !route.path.matches(path) {
                continue;
            }
            match &route.policy {
                None => return None,
                Some(policy) if policy.applies_to(method) => return Some(policy),
                Some(_) => {}
            }
        }
        None
    }

    /// The routes, in order.
    pub fn iter(&self) -> impl Iterator<Item = &Route> {
        self.routes.iter()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_sets_parse_and_match() {
        let set: StatusSet = "2xx, 303,400-401".parse().unwrap();
        assert!(set.contains(StatusCode::CREATED));
        assert!(set.contains(StatusCode::SEE_OTHER));
        assert!(set.contains(StatusCode::UNAUTHORIZED));
        assert!(!set.contains(StatusCode::FOUND));
        assert!("6xx".parse::<StatusSet>().is_err());
        assert!("300-200".parse::<StatusSet>().is_err());
        assert_eq!(set.to_string(), "2xx,303,400-401");
        let default = StatusSet::default();
        assert!(default.contains(StatusCode::SEE_OTHER));
        assert!(!default.contains(StatusCode::UNPROCESSABLE_ENTITY));
    }

    #[test]
    fn prefixes_respect_segments() {
        let p = PathPattern::parse("/orders").unwrap();
        assert!(p.matches("/orders"));
        assert!(p.matches("/orders/7"));
        assert!(!p.matches("/orders-archive"));
        assert!(PathPattern::parse("/").unwrap().matches("/anything"));
        assert!(PathPattern::parse("orders").is_err());
    }

    #[test]
    fn globs() {
        let p = PathPattern::parse("/api/*/submit").unwrap();
        assert!(p.matches("/api/forms/submit"));
        assert!(!p.matches("/api/a/b/submit"));
        let p = PathPattern::parse("/forms/**").unwrap();
        assert!(p.matches("/forms/a/b/c"));
        assert!(!p.matches("/other/a"));
    }

    #[test]
    fn first_matching_route_decides() {
        let routes = Routes::new()
            .exclude("/health")
            .unwrap()
            .route("/", Policy::default())
            .unwrap();
        assert!(routes.find(&Method::POST, "/health").is_none());
        assert!(routes.find(&Method::POST, "/orders").is_some());
        assert!(routes.find(&Method::GET, "/orders").is_none());
        assert!(routes.find(&Method::PUT, "/orders").is_none());
    }

    /// The old backtracking matcher: obviously right on short inputs, and
    /// the reference for the automaton.
    fn reference_glob(pattern: &[u8], path: &[u8]) -> bool {
        match pattern.split_first() {
            None => path.is_empty(),
            Some((b'*', rest)) => {
                if let Some(rest) = rest.strip_prefix(b"*") {
                    (0..=path.len()).any(|i| reference_glob(rest, &path[i..]))
                } else {
                    let segment_end = path.iter().position(|&b| b == b'/').unwrap_or(path.len());
                    (0..=segment_end).any(|i| reference_glob(rest, &path[i..]))
                }
            }
            Some((&c, rest)) => path.first() == Some(&c) && reference_glob(rest, &path[1..]),
        }
    }

    /// A 40 KB path of near-matches against `/a/**/b/**/c` (2.3 s of CPU
    /// with the backtracking matcher) takes one step per path byte and
    /// pattern token, and still matches right.
    #[test]
    fn a_long_path_costs_linear_steps() {
        let pattern = b"/a/**/b/**/c";
        let tokens = glob_tokens(pattern).len() as u64;
        let long = format!("/a/{}", "b/".repeat(20_000));
        let mut steps = 0;
        assert!(!glob_match_counting(pattern, long.as_bytes(), &mut steps));
        assert!(steps <= long.len() as u64 * tokens, "{steps} steps");
        let matching = format!("{long}c");
        let mut steps = 0;
        assert!(glob_match_counting(
            pattern,
            matching.as_bytes(),
            &mut steps
        ));
        assert!(steps <= matching.len() as u64 * tokens, "{steps} steps");
        assert!(PathPattern::parse("/a/**/b/**/c")
            .unwrap()
            .matches(&matching));
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(4000))]

        /// The automaton agrees with the backtracking reference.
        #[test]
        fn globs_agree_with_the_reference(
            pattern in "[ab/*]{0,8}",
            path in "[ab/]{0,10}",
        ) {
            proptest::prop_assert_eq!(
                glob_match(pattern.as_bytes(), path.as_bytes()),
                reference_glob(pattern.as_bytes(), path.as_bytes()),
                "pattern {:?} path {:?}", pattern, path
            );
        }
    }

    #[test]
    fn paths_are_normalised() {
        for (raw, normal) in [
            ("/api/pay", "/api/pay"),
            ("//api/pay", "/api/pay"),
            ("/./api/pay", "/api/pay"),
            ("/%61pi/pay", "/api/pay"),
            ("/api/pay/", "/api/pay"),
            ("/api//pay//", "/api/pay"),
            ("/x/../api/pay", "/api/pay"),
            ("/../../api/pay", "/api/pay"),
            ("/%2e%2E/api/./pay", "/api/pay"),
            ("/a%2fb", "/a%2Fb"),
            ("/a%2Fb", "/a%2Fb"),
            ("/%7euser", "/~user"),
            ("/", "/"),
            ("", "/"),
            ("//", "/"),
            ("/.well-known/x", "/.well-known/x"),
            ("/é/%zz", "/é/%zz"),
        ] {
            assert_eq!(normalize_path(raw, false), normal, "{raw}");
        }
        assert_eq!(normalize_path("/API/Pay/", true), "/api/pay");
        assert_eq!(normalize_path("/API/Pay", false), "/API/Pay");
    }

    #[test]
    fn the_first_route_matching_path_and_method_decides() {
        let routes = Routes::new()
            .route("/api/payments", Policy::default())
            .unwrap()
            .route(
                "/api/**",
                Policy {
                    methods: vec!["PUT".into(), "DELETE".into()],
                    ..Policy::default()
                },
            )
            .unwrap();
        assert!(routes.find(&Method::PUT, "/api/payments/7").is_some());
        assert!(routes.find(&Method::POST, "/api/payments/7").is_some());
        assert!(routes.find(&Method::PATCH, "/api/other").is_none());
        // An exclusion decides for every method.
        let routes = Routes::new()
            .exclude("/health")
            .unwrap()
            .route("/", Policy::default())
            .unwrap();
        assert!(routes.find(&Method::POST, "/health").is_none());
        assert!(routes.find(&Method::POST, "//health/").is_none());
    }

    /// `%2e%2e` is a `..` segment to some backends and text to others: a
    /// path is covered when either reading is.
    #[test]
    fn encoded_dots_are_covered_either_way() {
        let routes = Routes::new().route("/api/pay", Policy::default()).unwrap();
        // Read as text: `/api/pay/%2E%2E` is under `/api/pay`.
        assert!(routes.find(&Method::POST, "/api/pay/%2e%2e").is_some());
        // Read as a dot segment: `/api/x/../pay` is `/api/pay`.
        assert!(routes.find(&Method::POST, "/api/x/%2e%2e/pay").is_some());
        assert!(routes.find(&Method::POST, "/api/x/%2E./pay").is_some());
        assert!(routes.find(&Method::POST, "/api/other/%2e").is_none());
        assert_eq!(normalize("/a/%2e%2e/b", false, false), "/a/%2E%2E/b");
    }

    #[test]
    fn silent_gaps_are_refused_at_start() {
        let empty = Policy {
            methods: Vec::new(),
            ..Policy::default()
        };
        assert_eq!(empty.validate().unwrap_err().field, "methods");
        for pattern in [
            "/orders/", "/api/*/", "//orders", "/a/./b", "/a/../b", "/%61pi",
        ] {
            assert_eq!(
                Routes::new()
                    .route(pattern, Policy::default())
                    .unwrap_err()
                    .field,
                "path",
                "{pattern}"
            );
        }
        assert!(Routes::new().route("/", Policy::default()).is_ok());
    }

    #[test]
    fn case_insensitive_routing() {
        let routes = Routes::new()
            .route("/Api/Pay", Policy::default().required(true))
            .unwrap();
        assert!(routes.find(&Method::POST, "/api/pay").is_none());
        let routes = routes.case_insensitive(true);
        assert!(routes.find(&Method::POST, "/API/pay").is_some());
        let later = Routes::new()
            .case_insensitive(true)
            .route("/Api/**", Policy::default())
            .unwrap();
        assert!(later.find(&Method::POST, "/aPI/x").is_some());
    }

    #[test]
    fn validation_names_the_field() {
        let bad = Policy {
            mismatch_status: 400,
            ..Policy::default()
        };
        assert_eq!(bad.validate().unwrap_err().field, "mismatch_status");
        let bad = Policy {
            methods: vec!["GET".into()],
            ..Policy::default()
        };
        assert_eq!(bad.validate().unwrap_err().field, "methods");
        let bad = Policy {
            scope_headers: vec!["bad header".into()],
            ..Policy::default()
        };
        assert_eq!(bad.validate().unwrap_err().field, "scope_headers");
        let bad = Policy::default().key(KeySource::JsonPointer("key".into()));
        assert_eq!(bad.validate().unwrap_err().field, "key");
    }
}
