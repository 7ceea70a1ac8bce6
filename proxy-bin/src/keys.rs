//! The key operations an operator runs, shared by the admin API
//! (`/keys/...`, `admin/keys.rs`) and the command line (`keys ...`,
//! `cli.rs`): what each takes, how it calls the engine, and the JSON it
//! answers. Every rule (the route, the scope hash, what a purge deletes)
//! is the engine's; this file only moves fields.

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime};

use http::{HeaderMap, HeaderName, HeaderValue, Method, Uri};
use serde::Deserialize;
use serde_json::{json, Value};
use tower_idempotency::engine::{AdminError, RequestHead};
use tower_idempotency::policy::principal::jwt_principal_in;
pub use tower_idempotency::store::HolderError;
use tower_idempotency::store::{Holder, Outcome, RecordInfo, ScopeKey};
use tower_idempotency::Engine;

/// What a client sent, as far as its key's scope goes.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Query {
    /// The raw idempotency key (a quoted header value without its quotes).
    pub key: String,
    /// The method (default POST).
    #[serde(default)]
    pub method: Option<String>,
    /// The path as the client sent it (a query string is allowed).
    pub path: String,
    /// The `Host` the client addressed (routes scope by it by default).
    #[serde(default)]
    pub host: Option<String>,
    /// Other headers the route scopes by (`scope_headers`), or a trusted
    /// gateway's principal header.
    #[serde(default)]
    pub headers: BTreeMap<String, OneOrMany>,
    /// The principal, when the route scopes by one.
    #[serde(default)]
    pub principal: Option<PrincipalInput>,
}

/// One header value or several.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum OneOrMany {
    /// One value.
    One(String),
    /// Repeated values, in order.
    Many(Vec<String>),
}

/// A principal as the route resolves it: a trusted header's value (or the
/// layer's `Principal`) as text, or a verified JWT's `sub` and `iss`.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum PrincipalInput {
    /// The principal's bytes, as text.
    Raw(String),
    /// A JWT route's caller.
    Jwt(JwtCaller),
}

/// A JWT route's caller, as a token names it. No other field is taken: a
/// claim given beside these (`{"sub": …, "org_id": …}`) instead of under
/// `tenant` would name another principal and find nothing.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JwtCaller {
    /// The token's `sub`.
    pub sub: String,
    /// The token's `iss`, if it has one.
    #[serde(default)]
    pub iss: Option<String>,
    /// Its route's `tenant_claims` as the token holds them (`null` for
    /// one it lacks); none for a route without them.
    #[serde(default)]
    pub tenant: BTreeMap<String, serde_json::Value>,
}

impl Query {
    /// Adds a header value (repeated names keep every value, in order).
    pub fn add_header(&mut self, name: &str, value: &str) {
        let name = name.to_ascii_lowercase();
        let value = value.to_owned();
        match self.headers.remove(&name) {
            None => self.headers.insert(name, OneOrMany::One(value)),
            Some(OneOrMany::One(first)) => self
                .headers
                .insert(name, OneOrMany::Many(vec![first, value])),
            Some(OneOrMany::Many(mut values)) => {
                values.push(value);
                self.headers.insert(name, OneOrMany::Many(values))
            }
        };
    }
}

impl PrincipalInput {
    fn bytes(&self) -> Vec<u8> {
        match self {
            PrincipalInput::Raw(text) => text.as_bytes().to_vec(),
            PrincipalInput::Jwt(JwtCaller { sub, iss, tenant }) => {
                jwt_principal_in(iss.as_deref(), sub, tenant)
            }
        }
    }
}

/// Which record: computed from what the client sent, or a scope hash (64
/// hex characters, as a lookup prints it).
#[derive(Clone, Debug)]
pub enum Target {
    /// By its scope hash.
    Scope {
        /// The hash, in hex.
        scope: String,
    },
    /// From what the client sent.
    Query(Query),
}

impl Op {
    /// Whether it finds its records by a scope computed from what the
    /// client sent (a key and path, a principal), which takes the proxy's
    /// routes and key secret: under another configuration it names other
    /// records, or none.
    pub fn computes_scopes(&self) -> bool {
        match self {
            Op::Lookup { target, .. } | Op::Purge(target) | Op::Release { target, .. } => {
                matches!(target, Target::Query(_))
            }
            Op::PurgePrincipal(_) => true,
            Op::InFlight { .. } | Op::Counts => false,
        }
    }
}

/// One operation.
#[derive(Clone, Debug)]
pub enum Op {
    /// The record a request would meet; its stored response too when
    /// `body`.
    Lookup {
        /// Which record.
        target: Target,
        /// Include the stored status, headers and body.
        body: bool,
    },
    /// Delete a record in any state.
    Purge(Target),
    /// Delete every record of one principal.
    PurgePrincipal(PrincipalInput),
    /// Release an in-flight key, fencing its holder off.
    Release {
        /// Which record.
        target: Target,
        /// Only while this holder (as a lookup or the in-flight list
        /// showed it) still holds it.
        holder: Option<Holder>,
    },
    /// In-flight records at least this old.
    InFlight {
        /// The least age.
        older_than: Duration,
        /// The most records listed.
        limit: usize,
    },
    /// Records by state.
    Counts,
}

/// Why an operation failed.
#[derive(Debug)]
pub enum Failure {
    /// The input is wrong (the message says what is expected).
    Input(String),
    /// The store has no operator side.
    Unsupported(String),
    /// The store failed.
    Store(String),
}

impl From<AdminError> for Failure {
    fn from(error: AdminError) -> Self {
        if error.is_input() {
            Failure::Input(error.to_string())
        } else if matches!(error, AdminError::Unsupported) {
            Failure::Unsupported(error.to_string())
        } else {
            Failure::Store(error.to_string())
        }
    }
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Failure::Input(message) | Failure::Unsupported(message) | Failure::Store(message) => {
                f.write_str(message)
            }
        }
    }
}

/// The default and largest number of records `in-flight` lists.
pub const DEFAULT_LIMIT: usize = 100;
/// The largest `limit` accepted.
pub const MAX_LIMIT: usize = 10_000;

impl Target {
    /// `{"scope": HEX}`, or a [`Query`]'s fields; an error names the field
    /// at fault and what is expected.
    pub fn from_json(value: Value) -> Result<Self, Failure> {
        if let Some(scope) = value.get("scope") {
            let Some(scope) = scope.as_str() else {
                return Err(Failure::Input("scope: expected 64 hex characters".into()));
            };
            // A scope names the record whole: a `key` or `path` beside it
            // would be silently dropped (the command line refuses the pair).
            let beside = value
                .as_object()
                .and_then(|fields| fields.keys().find(|name| *name != "scope").cloned());
            if let Some(other) = beside {
                return Err(Failure::Input(format!(
                    "`{other}` beside `scope`: a scope names the record on its own; give \
                     either {{\"scope\": hex}} or the request's fields"
                )));
            }
            return Ok(Target::Scope {
                scope: scope.to_owned(),
            });
        }
        serde_json::from_value(value)
            .map(Target::Query)
            .map_err(|error| Failure::Input(format!("{error} (expected {QUERY_FIELDS})")))
    }
}

/// The fields of a [`Query`], for error messages.
pub const QUERY_FIELDS: &str = "{\"key\", \"path\", optional \"method\" (POST), \"host\", \
     \"headers\": {name: value}, \"principal\": \"text\" or {\"sub\", \"iss\"}} or {\"scope\": hex}";

/// Parses an age such as `30s`, `5m` or `90` (seconds).
pub fn parse_age(text: &str) -> Result<Duration, Failure> {
    let text = text.trim();
    if let Ok(seconds) = text.parse::<u64>() {
        return Ok(Duration::from_secs(seconds));
    }
    humantime_serde::re::humantime::parse_duration(text).map_err(|_| {
        Failure::Input(format!(
            "older_than: expected a duration such as 30s, 5m or 90 (seconds), got `{text}`"
        ))
    })
}

/// Runs `op` on `engine`; the JSON answer.
pub async fn run(engine: &Engine, op: Op) -> Result<Value, Failure> {
    match op {
        Op::Lookup { target, body } => {
            let (scope, route) = scope(engine, &target)?;
            let record = engine.inspect(&scope).await?;
            let mut answer = describe(scope, record.as_ref());
            if let Some(route) = route {
                answer["route"] = json!(route);
            }
            if body {
                let outcome = engine.stored_outcome(&scope).await?;
                answer["response"] = outcome.map_or(Value::Null, |outcome| response(&outcome));
            }
            Ok(answer)
        }
        Op::Purge(target) => {
            let (scope, _) = scope(engine, &target)?;
            let purged = engine.purge(&scope).await?;
            Ok(json!({ "scope": scope.to_hex(), "purged": purged }))
        }
        Op::PurgePrincipal(principal) => {
            let purged = engine.purge_principal(&principal.bytes()).await?;
            Ok(json!({ "purged": purged }))
        }
        Op::Release { target, holder } => {
            let (scope, _) = scope(engine, &target)?;
            let released = match holder {
                Some(holder) => engine.force_release_held_by(&scope, holder).await?,
                None => engine.force_release(&scope).await?,
            };
            let mut answer = json!({ "scope": scope.to_hex(), "released": released });
            if !released {
                // Say why: absent, completed (purge it instead), or held by
                // another holder now (a retry took it over).
                let record = engine.inspect(&scope).await?;
                answer["state"] =
                    json!(record.as_ref().map_or("absent", |info| info.state.as_str()));
                if let Some(now) = record.as_ref().and_then(RecordInfo::holder) {
                    answer["holder"] = json!(now.to_string());
                }
            }
            Ok(answer)
        }
        Op::InFlight { older_than, limit } => {
            let limit = limit.min(MAX_LIMIT);
            let found = engine.in_flight_older_than(older_than, limit).await?;
            let records: Vec<Value> = found
                .iter()
                .map(|info| describe(info.key, Some(info)))
                .collect();
            Ok(json!({
                "older_than_seconds": older_than.as_secs_f64(),
                "records": records,
            }))
        }
        Op::Counts => {
            let counts = engine.counts().await?;
            Ok(json!({
                "in_flight": counts.in_flight,
                "lease_expired": counts.lease_expired,
                "completed": counts.completed,
                "too_large": counts.too_large,
                "incomplete": counts.incomplete,
                "expired": counts.expired,
                "total": counts.total(),
            }))
        }
    }
}

/// The scope hash of `target`, and the route that covers it (for a
/// query).
fn scope(engine: &Engine, target: &Target) -> Result<(ScopeKey, Option<String>), Failure> {
    let query = match target {
        Target::Scope { scope } => {
            let scope = scope
                .parse::<ScopeKey>()
                .map_err(|error| Failure::Input(format!("scope: {error}")))?;
            return Ok((scope, None));
        }
        Target::Query(query) => query,
    };
    let method = match query.method.as_deref() {
        None => Method::POST,
        Some(text) => {
            Method::from_bytes(text.trim().to_ascii_uppercase().as_bytes()).map_err(|_| {
                Failure::Input(format!(
                    "method: expected an HTTP method such as POST, got `{text}`"
                ))
            })?
        }
    };
    if !query.path.starts_with('/') {
        return Err(Failure::Input(format!(
            "path: expected the path as the client sent it, starting with / (such as /orders), got `{}`",
            query.path
        )));
    }
    let uri: Uri = query.path.parse().map_err(|_| {
        Failure::Input(format!(
            "path: `{}` is not a valid request path (percent-encode what is not URL text)",
            query.path
        ))
    })?;
    let mut headers = HeaderMap::new();
    if let Some(host) = &query.host {
        headers.insert(http::header::HOST, header_value("host", host)?);
    }
    for (name, values) in &query.headers {
        let name = HeaderName::from_bytes(name.trim().as_bytes())
            .map_err(|_| Failure::Input(format!("headers: `{name}` is not a header name")))?;
        let values = match values {
            OneOrMany::One(value) => std::slice::from_ref(value),
            OneOrMany::Many(values) => values.as_slice(),
        };
        for value in values {
            headers.append(name.clone(), header_value(name.as_str(), value)?);
        }
    }
    let principal = query.principal.as_ref().map(PrincipalInput::bytes);
    let head = RequestHead {
        method: &method,
        uri: &uri,
        headers: &headers,
        principal: principal.as_deref(),
        routed: None,
    };
    // The proxy's principal is only ever the route's own: one given for a
    // route without a principal would name a scope no request has.
    let route_policy = engine.route_policy(&head);
    let unscoped = route_policy.is_some_and(|policy| policy.principal.is_none());
    if principal.is_some() && unscoped {
        return Err(Failure::Input(format!(
            "principal: the route covering {} {} does not scope keys by a principal; leave it out",
            method,
            uri.path()
        )));
    }
    // A principal in the form the route does not take names a scope no
    // request has: the answer would be "absent" (or "purged: 0") while the
    // record lives.
    let route_principal = route_policy.and_then(|policy| policy.principal.as_ref());
    if let (Some(given), Some(route)) = (&query.principal, route_principal) {
        match given {
            PrincipalInput::Raw(_) if route.header.is_none() => {
                return Err(Failure::Input(
                    "principal: the route takes a JWT's caller; give it as {\"sub\": …, \"iss\": …}"
                        .to_owned(),
                ))
            }
            PrincipalInput::Jwt(_) if route.jwt.is_none() => {
                return Err(Failure::Input(
                    "principal: the route takes its caller from a header; give the header's value as text"
                        .to_owned(),
                ))
            }
            _ => {}
        }
    }
    let (scope, route) = engine.scope_of(&head, query.key.as_bytes())?;
    // Without the host, a host-scoped route's scope is one no request over
    // HTTP/1.1 has: "absent" would be the answer for a record that lives.
    let host_scoped = route_policy.is_some_and(|policy| policy.scope_authority);
    if host_scoped && !headers.contains_key(http::header::HOST) {
        return Err(Failure::Input(format!(
            "host: the route covering {} {} scopes keys by host; give the host the client addressed (such as shop.example)",
            method,
            uri.path()
        )));
    }
    Ok((scope, Some(route.to_string())))
}

fn header_value(name: &str, value: &str) -> Result<HeaderValue, Failure> {
    HeaderValue::from_str(value).map_err(|_| {
        Failure::Input(format!(
            "headers: the value of `{name}` is not a header value"
        ))
    })
}

/// A record (or its absence) as JSON: never its body.
fn describe(scope: ScopeKey, record: Option<&RecordInfo>) -> Value {
    let mut answer = json!({ "scope": scope.to_hex(), "scope_short": scope.short() });
    let Some(info) = record else {
        answer["state"] = json!("absent");
        return answer;
    };
    let now = SystemTime::now();
    let at = |time: Option<SystemTime>| {
        time.map(|time| humantime_serde::re::humantime::format_rfc3339_seconds(time).to_string())
    };
    answer["state"] = json!(info.state.as_str());
    answer["fingerprint"] = json!(hex(&info.fingerprint.0[..4]));
    answer["created"] = json!(at(now.checked_sub(info.age)));
    answer["age_seconds"] = json!(info.age.as_secs_f64());
    answer["expires"] = json!(at(now.checked_add(info.expires_in)));
    answer["expires_in_seconds"] = json!(info.expires_in.as_secs_f64());
    answer["lease_remaining_seconds"] = json!(info.lease_remaining.map(|d| d.as_secs_f64()));
    answer["status"] = json!(info.status.map(|status| status.as_u16()));
    answer["body_bytes"] = json!(info.body_bytes);
    answer["header_bytes"] = json!(info.header_bytes);
    answer["principal_kept"] = json!(info.has_principal);
    answer["holder"] = json!(info.holder().map(|holder| holder.to_string()));
    answer
}

/// A stored outcome as JSON: status, headers, and the body as text (or
/// hex when it is not UTF-8).
fn response(outcome: &Outcome) -> Value {
    match outcome {
        Outcome::Stored(response) => {
            let headers: Vec<Value> = response
                .headers
                .iter()
                .map(|(name, value)| {
                    json!([name.as_str(), String::from_utf8_lossy(value.as_bytes())])
                })
                .collect();
            let mut answer = json!({ "status": response.status.as_u16(), "headers": headers });
            match std::str::from_utf8(&response.body) {
                Ok(text) => answer["body"] = json!(text),
                Err(_) => answer["body_hex"] = json!(hex(&response.body)),
            }
            answer
        }
        Outcome::TooLarge { status } | Outcome::Incomplete { status } => {
            json!({ "status": status.as_u16(), "body": null })
        }
        // The engine opens sealed outcomes before they get here.
        Outcome::Sealed(_) => json!({ "status": null, "body": null, "sealed": true }),
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|byte| format!("{byte:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// From a review: `{"scope", "key", "path"}` used the scope and
    /// dropped the rest without a word (the command line refuses the pair).
    #[test]
    fn a_scope_beside_request_fields_is_refused() {
        let scope = "ab".repeat(32);
        let refused = Target::from_json(json!({ "scope": scope, "key": "k", "path": "/x" }));
        let Err(Failure::Input(message)) = refused else {
            panic!("accepted a scope beside request fields");
        };
        assert!(message.contains("beside `scope`"), "{message}");
        assert!(matches!(
            Target::from_json(json!({ "scope": scope })),
            Ok(Target::Scope { .. })
        ));
    }
}
