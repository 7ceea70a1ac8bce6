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
            mismatch_status: 422,
            mismatch: MismatchPolicy::Reject,
            in_flight_status: 409,
            store_statuses: StatusSet::default(),
            success_redirects: Vec::new(),
            fail_mode: FailMode::Closed,
            max_body_bytes: MIB,
            max_response_bytes: MIB,
            replay_set_cookie: false,
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
        if self.lease < Duration::from_millis(10) {
            return Err(invalid("lease", "must be at least 10ms"));
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
            policy: self.clone(),
        }))
    }
}

/// A [`Policy`] that passed [`Policy::validate`], with its strings parsed.
#[derive(Debug)]
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
}

/// The path a `Location` points to: the path of an absolute URL
/// (`http://host/contact/thanks`), of a network-path reference
/// (`//host/x`), an absolute path (`/x?y`), or a relative reference
/// resolved against `base` (`thanks` from `/contact` is `/thanks`); dot
/// segments and repeated slashes removed. `None` for a value that is not
/// a URI reference.
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
    let mut segments: Vec<&str> = Vec::new();
    for segment in path.split('/').filter(|s| !s.is_empty() && *s != ".") {
        if segment == ".." {
            segments.pop();
        } else {
            segments.push(segment);
        }
    }
    Some(format!("/{}", segments.join("/")))
}

/// How a route matches request paths.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PathPattern {
    /// `/orders` matches `/orders` and `/orders/…`, not `/orders-archive`.
    /// `/` matches every path.
    Prefix(String),
    /// A glob: `*` matches within one segment, `**` matches anything,
    /// e.g. `/api/*/submit` or `/forms/**`.
    Glob(String),
}

impl PathPattern {
    /// Parses `pattern`: a glob when it contains `*`, a prefix otherwise.
    pub fn parse(pattern: &str) -> Result<Self, PolicyError> {
        if !pattern.starts_with('/') {
            return Err(invalid(
                "path",
                format!("`{pattern}` does not start with `/`"),
            ));
        }
        Ok(if pattern.contains('*') {
            PathPattern::Glob(pattern.to_owned())
        } else {
            PathPattern::Prefix(pattern.to_owned())
        })
    }

    /// Whether `path` (without query) matches.
    pub fn matches(&self, path: &str) -> bool {
        match self {
            PathPattern::Prefix(prefix) => match path.strip_prefix(prefix.as_str()) {
                Some(rest) => rest.is_empty() || prefix.ends_with('/') || rest.starts_with('/'),
                None => false,
            },
            PathPattern::Glob(glob) => glob_match(glob.as_bytes(), path.as_bytes()),
        }
    }
}

fn glob_match(pattern: &[u8], path: &[u8]) -> bool {
    match pattern.split_first() {
        None => path.is_empty(),
        Some((b'*', rest)) => {
            if let Some(rest) = rest.strip_prefix(b"*") {
                (0..=path.len()).any(|i| glob_match(rest, &path[i..]))
            } else {
                let segment_end = path.iter().position(|&b| b == b'/').unwrap_or(path.len());
                (0..=segment_end).any(|i| glob_match(rest, &path[i..]))
            }
        }
        Some((&c, rest)) => path.first() == Some(&c) && glob_match(rest, &path[1..]),
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

/// An ordered route table: the first route whose pattern matches a path
/// decides; a path no route matches is left alone.
#[derive(Clone, Debug, Default)]
pub struct Routes {
    routes: Vec<Route>,
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

    /// Appends a route covering `pattern` with `policy`.
    pub fn route(mut self, pattern: &str, policy: Policy) -> Result<Self, PolicyError> {
        self.routes.push(Route {
            path: PathPattern::parse(pattern)?,
            policy: Some(policy.validate()?),
        });
        Ok(self)
    }

    /// Appends a route that leaves `pattern` alone (no idempotency).
    pub fn exclude(mut self, pattern: &str) -> Result<Self, PolicyError> {
        self.routes.push(Route {
            path: PathPattern::parse(pattern)?,
            policy: None,
        });
        Ok(self)
    }

    /// The policy that applies to `method` on `path`, if any.
    pub fn find(&self, method: &Method, path: &str) -> Option<&Arc<RoutePolicy>> {
        self.routes
            .iter()
            .find(|route| route.path.matches(path))
            .and_then(|route| route.policy.as_ref())
            .filter(|policy| policy.applies_to(method))
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
