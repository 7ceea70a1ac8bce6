//! Per-route configuration, shared by the tower layer and the proxy.
//!
//! A [`Policy`] says how one route is made idempotent; [`Routes`] maps
//! request paths to policies. Both deserialize with serde (the proxy reads
//! them from TOML) and are checked once, by [`Policy::validate`], before the
//! engine uses them — a bad value is refused at start, never at request time.

use std::sync::Arc;
use std::time::Duration;

use http::{header, HeaderMap, HeaderName, Method, StatusCode};
use serde::{Deserialize, Serialize};

mod paths;
mod routes;
mod status;
#[cfg(test)]
mod tests;

pub(crate) use paths::has_other_readings;
pub use paths::{normalize_path, scope_host, RequestTarget};
pub(crate) use routes::{prefer, Reached};
pub use routes::{PathPattern, Route, Routes};
pub use status::StatusSet;

use paths::{decode_escapes, location_path, respelled};

pub mod principal;

use principal::PrincipalSource;
pub use principal::{JwtPolicy, PrincipalPolicy};

/// The longest duration a policy may name (100 years): every duration is
/// added to a clock somewhere, and `Duration::MAX` would overflow it.
const MAX_DURATION: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// The shortest `lease` a policy may name: renewed every third of it,
/// a shorter lease's renewals swamp a busy store (SQLite's one writer
/// first) until leases lapse under requests still running, and a retry
/// takes the key over and runs again.
pub const MIN_LEASE: Duration = Duration::from_millis(100);

/// The shortest `ttl` a policy may name: a duplicate waiting for the first
/// request looks at the store at least every 200 ms
/// ([`backoff`](crate::store::backoff)'s cap), so its record outlives the
/// completion long enough to be seen and replayed, not found gone (a key
/// free to run again).
pub const MIN_TTL: Duration = Duration::from_secs(1);

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
    /// `multipart/form-data` body, such as a hidden `submission_token`;
    /// also read where frameworks read the same field (a JSON body's
    /// top-level member, a name PHP or Rack reads as it, a body Rack reads
    /// as a form), when it holds a well-formed key.
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
    /// A version of what the route's requests mean, hashed into every
    /// fingerprint when set (the Next.js seed hashes its form's schema
    /// version): change it with the backend's schema, and a retry sent
    /// before the change, arriving after it, is refused as a changed
    /// request (`mismatch_status`) instead of replayed the answer to the
    /// old schema. Changing it changes every fingerprint of the route, so
    /// any retry spanning the change is refused; on a `mismatch = "replay"`
    /// route it is answered as any changed form is, with the key's stored
    /// outcome. Default empty (none).
    pub fingerprint_version: String,
    /// How long a completed record is kept and replayed. Default 24 h; at
    /// least the lease and [`MIN_TTL`].
    #[serde(with = "humantime_serde")]
    pub ttl: Duration,
    /// How long an in-flight record is held before another request may take
    /// it over; renewed by a heartbeat while the upstream runs. Default 30 s;
    /// at least [`MIN_LEASE`], and keep it at least 3 × the engine's
    /// `store_timeout` (the engine warns at start when it is not).
    #[serde(with = "humantime_serde")]
    pub lease: Duration,
    /// What a duplicate does while the first is in flight. Default `wait`.
    pub in_flight: InFlightPolicy,
    /// The longest a duplicate waits before 409. Default 10 s.
    #[serde(with = "humantime_serde")]
    pub wait_timeout: Duration,
    /// The longest an execution may take: in the tower layer from calling
    /// the inner service to the end of its response body; in the proxy
    /// from the start of the upstream exchange until the answer's head has
    /// come and a recorded body has ended (connecting and writing keep
    /// their own timeouts; `[proxy] read_timeout` bounds each read). Past
    /// it the front end stops waiting and answers 504 `upstream-timeout`
    /// (the proxy cuts a client that has the head already), and — as the
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
    /// unknown".
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
    /// The status answered to a retry of a request that ran but whose
    /// response cannot be replayed: `response-incomplete` (it broke off
    /// after its head) and `response-not-stored` (over
    /// `max_response_bytes`). Default 409. A client that drops its key on
    /// 409 (the Next.js seed's does) sends its next attempt under a new
    /// key, which executes again: give such a client another 4xx or 5xx
    /// (e.g. 502), on which it keeps the key.
    pub unreplayable_status: u16,
    /// Which upstream statuses are stored and replayed; any other status
    /// releases the key so a corrected request can go through.
    /// Default `["2xx", "3xx"]`. A 1xx status is never stored, whatever
    /// the set holds: an interim answer, or a 101 protocol switch, is no
    /// outcome to replay.
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
    /// Hash the request's host name (the URI's and the `Host` header's,
    /// both when they differ; lowercased, without port, see
    /// [`scope_host`]) into the key's scope.
    /// Default `true`: two virtual hosts (tenants) behind one engine never
    /// share a key space. Turn it off only when several host names serve
    /// one and the same application and a retry may arrive under another
    /// name.
    pub scope_authority: bool,
    /// The caller's stable identity, hashed into the key's scope: a
    /// header set by a trusted gateway, or a verified JWT's `sub` (see
    /// [`PrincipalPolicy`] and the [`principal`] module).
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
            fingerprint_version: String::new(),
            ttl: Duration::from_secs(24 * 60 * 60),
            lease: Duration::from_secs(30),
            in_flight: InFlightPolicy::Wait,
            wait_timeout: Duration::from_secs(10),
            execution_timeout: Duration::from_secs(5 * 60),
            mismatch_status: 422,
            mismatch: MismatchPolicy::Reject,
            in_flight_status: 409,
            unreplayable_status: 409,
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
        if self.lease < MIN_LEASE {
            return Err(invalid(
                "lease",
                "must be at least 100ms: it is renewed every third of it, and shorter \
                 renewals swamp a busy store until leases lapse under running requests",
            ));
        }
        if self.execution_timeout.is_zero() {
            return Err(invalid("execution_timeout", "must be longer than zero"));
        }
        if self.ttl < self.lease {
            return Err(invalid("ttl", "must be at least as long as the lease"));
        }
        if self.ttl < MIN_TTL {
            return Err(invalid(
                "ttl",
                "must be at least 1s: a duplicate waiting for the first request looks \
                 at the store every 200ms or sooner, and a record that expired between \
                 two looks would let it run again",
            ));
        }
        // Added to clocks (the stores' expiries, a waiter's deadline): a
        // "forever" such as `Duration::MAX` would overflow them.
        for (field, duration) in [
            ("ttl", self.ttl),
            ("wait_timeout", self.wait_timeout),
            ("execution_timeout", self.execution_timeout),
        ] {
            if duration > MAX_DURATION {
                return Err(invalid(field, "must be at most 100 years"));
            }
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
        let error_status = |field: &'static str, code: u16| {
            StatusCode::from_u16(code)
                .ok()
                .filter(|status| status.is_client_error() || status.is_server_error())
                .ok_or_else(|| invalid(field, format!("{code} is not a 4xx or 5xx status")))
        };
        let in_flight_status = error_status("in_flight_status", self.in_flight_status)?;
        let unreplayable_status = error_status("unreplayable_status", self.unreplayable_status)?;
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
            unreplayable_status,
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
    /// `Policy::unreplayable_status`, checked to be 4xx or 5xx.
    pub(crate) unreplayable_status: StatusCode,
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

    /// Whether the route reads requests by the header `name`: its key's
    /// header, its principal's, a scope or a fingerprint header.
    pub fn reads_header(&self, name: &HeaderName) -> bool {
        let key = match &self.policy().key {
            KeySource::Header(key) => name.as_str().eq_ignore_ascii_case(key),
            _ => false,
        };
        key || self.scope_headers.contains(name)
            || self.fingerprint_headers.contains(name)
            || self
                .principal
                .as_ref()
                .is_some_and(|principal| principal.header() == name)
    }

    /// The request body limit in bytes.
    pub fn max_body_bytes(&self) -> usize {
        self.policy().max_body_bytes
    }

    /// Whether `method` is one the guarantee applies to on this route,
    /// in any ASCII case: backends such as Django and Symfony upper-case
    /// the method before dispatching, so `post` must not get around a
    /// `POST` route.
    pub fn applies_to(&self, method: &Method) -> bool {
        self.methods
            .iter()
            .any(|covered| covered.as_str().eq_ignore_ascii_case(method.as_str()))
    }

    /// Whether a request's scope under this route holds every part of its
    /// scope under `other`: the same principal source, the same scope
    /// headers (in any order), the host where `other` scopes by it.
    pub(crate) fn scoped_alike(&self, other: &RoutePolicy) -> bool {
        let headers = |a: &RoutePolicy, b: &RoutePolicy| {
            a.scope_headers
                .iter()
                .all(|name| b.scope_headers.contains(name))
        };
        headers(self, other)
            && headers(other, self)
            && (self.policy.scope_authority || !other.policy.scope_authority)
            && self.policy.principal == other.policy.principal
    }

    /// Whether an upstream answer with `status` and `headers` consumes the
    /// key (it is stored and replayed from now on): its status is in
    /// `store_statuses` and, for a redirect on a route with
    /// `success_redirects`, its `Location` matches one of them. On a route
    /// without them, a 301, 307 or 308 that asks for the request again
    /// under another spelling of its path (see `respelled`: a trailing
    /// slash, `//`, `;jsessionid`, on the same host with the same query)
    /// does not: nothing ran, and stored it would be replayed to the very
    /// request it asks for. Any other answer releases the key. `target` is
    /// the request as the client sent it: its path resolves a relative
    /// `Location` such as `thanks`, and its `mount` is the prefix a
    /// router mounted the routes under (axum's `nest`; empty when none):
    /// a `Location` under it matches also as the routes are written,
    /// without it (`/shop-a/contact/thanks` matches `/contact/thanks`). A
    /// `Location` is matched with its escapes decoded too, as requests are
    /// routed (`/kontakt/best%C3%A4tigt` matches `/kontakt/bestätigt`).
    pub fn consumes(
        &self,
        status: StatusCode,
        headers: &HeaderMap,
        target: &RequestTarget<'_>,
    ) -> bool {
        // An interim answer, or a 101 protocol switch, is no outcome to
        // replay, whatever the set says ("100-599" is "everything").
        if status.is_informational() || !self.policy.store_statuses.contains(status) {
            return false;
        }
        if !status.is_redirection() {
            return true;
        }
        let location = headers.get(header::LOCATION);
        if self.success_redirects.is_empty() {
            let again = matches!(status.as_u16(), 301 | 307 | 308)
                && location.is_some_and(|location| {
                    respelled(location.as_bytes(), target, self.case_insensitive_paths)
                });
            return !again;
        }
        let Some(target_path) =
            location.and_then(|location| location_path(location.as_bytes(), target.path))
        else {
            return false;
        };
        let mount = target.mount;
        let target = target_path;
        let unmounted = Some(mount)
            .filter(|mount| !mount.is_empty())
            .and_then(|mount| target.strip_prefix(mount))
            .filter(|rest| rest.starts_with('/'));
        // Frameworks escape what they redirect to (`/kontakt/bestätigt` is
        // sent as `/kontakt/best%C3%A4tigt`), and patterns are written
        // unescaped: each reading is matched decoded too, as routes are.
        let readings = [Some(target.as_str()), unmounted];
        let decoded: Vec<String> = readings
            .iter()
            .flatten()
            .filter(|path| path.contains('%'))
            .filter_map(|path| decode_escapes(path))
            .collect();
        self.success_redirects.iter().any(|pattern| {
            let plain = readings.iter().flatten().copied();
            plain
                .chain(decoded.iter().map(String::as_str))
                .any(|path| pattern.matches(path))
        })
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

/// The method as scopes and fingerprints read it: upper-cased, so `post`
/// and `POST` (which backends dispatch alike) are one request.
pub(crate) fn method_name(method: &Method) -> std::borrow::Cow<'_, str> {
    let name = method.as_str();
    match name.bytes().any(|b| b.is_ascii_lowercase()) {
        true => std::borrow::Cow::Owned(name.to_ascii_uppercase()),
        false => std::borrow::Cow::Borrowed(name),
    }
}
