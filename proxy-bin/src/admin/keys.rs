//! The operator API's `/keys/...` routes (behind the admin token):
//!
//! | route | body or query | answer |
//! |---|---|---|
//! | `POST /keys/lookup` | `{key, path, method?, host?, headers?, principal?, body?}` or `{scope, body?}` | the record: state, times, status, sizes (the stored response only with `"body": true`) |
//! | `POST /keys/purge` | as lookup | `{scope, purged}` |
//! | `POST /keys/purge-principal` | `{principal}` | `{purged: n}` |
//! | `POST /keys/release` | as lookup, and optional `holder` | `{scope, released}` (and `state`, `holder` when not released) |
//! | `GET /keys/in-flight` | `?older_than=30s&limit=100` | `{records: [...]}` |
//! | `GET /keys/counts` | | records by state |
//!
//! Answers are JSON; errors are `{"error": "..."}` with 400 (the input;
//! the message says what is expected), 405, 501 (a store without an
//! operator side) or 503 (the store failed). See `keys.rs` for the
//! operations themselves.

use http::{Method, StatusCode};
use pingora_core::protocols::http::ServerSession;
use serde_json::{json, Value};
use tower_idempotency::Engine;

use super::Answer;
use crate::keys::{self, Failure, Op, Target};

/// The largest request body the key routes read.
const MAX_BODY: usize = 64 * 1024;

/// Answers a `/keys/...` request; `None` for any other path.
pub async fn serve(engine: &Engine, session: &mut ServerSession) -> Option<Answer> {
    let head = session.req_header();
    let path = head.uri.path().strip_prefix("/keys/")?.to_owned();
    let method = head.method.clone();
    let query = head.uri.query().unwrap_or("").to_owned();
    let expected = match path.as_str() {
        "lookup" | "purge" | "purge-principal" | "release" => Method::POST,
        "in-flight" | "counts" => Method::GET,
        _ => {
            return Some(error(
                StatusCode::NOT_FOUND,
                format!(
                    "no key route /keys/{path}: expected lookup, purge, purge-principal, \
                     release (POST) or in-flight, counts (GET)"
                ),
            ))
        }
    };
    if method != expected {
        return Some(error(
            StatusCode::METHOD_NOT_ALLOWED,
            format!("/keys/{path} answers {expected} only"),
        ));
    }
    let op = match parse(session, &path, &query).await {
        Ok(op) => op,
        Err(failure) => return Some(failed(failure)),
    };
    Some(match keys::run(engine, op).await {
        Ok(answer) => ok(&answer),
        Err(failure) => failed(failure),
    })
}

/// The operation a request asks for.
async fn parse(session: &mut ServerSession, path: &str, query: &str) -> Result<Op, Failure> {
    let allowed: &[&str] = match path {
        "in-flight" => &["older_than", "limit"],
        _ => &[],
    };
    let params = super::query_params(query, allowed).map_err(Failure::Input)?;
    if path == "counts" {
        return Ok(Op::Counts);
    }
    if path == "in-flight" {
        let mut older_than = std::time::Duration::ZERO;
        let mut limit = keys::DEFAULT_LIMIT;
        for (name, value) in params {
            match &*name {
                "older_than" => older_than = keys::parse_age(&value)?,
                _ => {
                    limit = value.parse().map_err(|_| {
                        Failure::Input(format!(
                            "limit: expected a number of records (at most {}), got `{value}`",
                            keys::MAX_LIMIT
                        ))
                    })?
                }
            }
        }
        return Ok(Op::InFlight { older_than, limit });
    }
    let mut body = read_json(session).await?;
    if path == "purge-principal" {
        let principal = body
            .get_mut("principal")
            .map(Value::take)
            .filter(|principal| !principal.is_null())
            .ok_or_else(|| {
                Failure::Input(
                    "principal: expected {\"principal\": \"text\"} or \
                     {\"principal\": {\"sub\": ..., \"iss\": ...}}"
                        .into(),
                )
            })?;
        let principal = serde_json::from_value(principal).map_err(|_| {
            Failure::Input(
                "principal: expected a string (a trusted header's value) or {\"sub\": ..., \
                 \"iss\": ...} (a JWT's claims)"
                    .into(),
            )
        })?;
        // A field beside it (a `host`, a `route`) would narrow nothing: the
        // purge takes every record of this principal, on every host and
        // route; refused, so no one believes otherwise.
        let mut fields = body
            .as_object()
            .into_iter()
            .flat_map(|fields| fields.keys());
        if let Some(other) = fields.find(|name| *name != "principal") {
            return Err(Failure::Input(format!(
                "unknown field `{other}`: a purge takes only `principal`, and removes its \
                 records on every host and route"
            )));
        }
        return Ok(Op::PurgePrincipal(principal));
    }
    let with_body = match body
        .as_object_mut()
        .and_then(|fields| fields.remove("body"))
    {
        None | Some(Value::Bool(false)) => false,
        Some(Value::Bool(true)) if path == "lookup" => true,
        Some(_) => {
            return Err(Failure::Input(
                "body: expected true or false (lookup only)".into(),
            ))
        }
    };
    let holder = match body
        .as_object_mut()
        .and_then(|fields| fields.remove("holder"))
    {
        None => None,
        Some(Value::String(text)) if path == "release" => Some(
            text.parse()
                .map_err(|error: keys::HolderError| Failure::Input(format!("holder: {error}")))?,
        ),
        // `null` (a lookup's answer for a record no one holds) is refused
        // rather than read as "whoever holds it": a key reserved since would
        // be released.
        Some(_) if path == "release" => {
            return Err(Failure::Input(
                "holder: expected 16 hex characters, as a lookup or the in-flight list \
                 prints it; leave it out to release whoever holds the key"
                    .into(),
            ))
        }
        Some(_) => return Err(Failure::Input("holder: only a release takes it".into())),
    };
    let target = Target::from_json(body)?;
    Ok(match path {
        "lookup" => Op::Lookup {
            target,
            body: with_body,
        },
        "purge" => Op::Purge(target),
        _ => Op::Release { target, holder },
    })
}

/// The request body as a JSON object.
async fn read_json(session: &mut ServerSession) -> Result<Value, Failure> {
    let mut bytes = Vec::new();
    loop {
        match session.read_request_body().await {
            Ok(Some(chunk)) => {
                bytes.extend_from_slice(&chunk);
                if bytes.len() > MAX_BODY {
                    return Err(Failure::Input(format!(
                        "the request body is over {MAX_BODY} bytes"
                    )));
                }
            }
            Ok(None) => break,
            Err(error) => return Err(Failure::Input(format!("unreadable body: {error}"))),
        }
    }
    let value: Value = serde_json::from_slice(&bytes).map_err(|error| {
        Failure::Input(format!(
            "the body is not JSON ({error}); expected {}",
            keys::QUERY_FIELDS
        ))
    })?;
    if !value.is_object() {
        return Err(Failure::Input(format!(
            "expected a JSON object: {}",
            keys::QUERY_FIELDS
        )));
    }
    Ok(value)
}

fn ok(answer: &Value) -> Answer {
    json_answer(StatusCode::OK, answer)
}

fn failed(failure: Failure) -> Answer {
    let status = match failure {
        Failure::Input(_) => StatusCode::BAD_REQUEST,
        Failure::Unsupported(_) => StatusCode::NOT_IMPLEMENTED,
        Failure::Store(_) => StatusCode::SERVICE_UNAVAILABLE,
    };
    error(status, failure.to_string())
}

fn error(status: StatusCode, message: String) -> Answer {
    json_answer(status, &json!({ "error": message }))
}

fn json_answer(status: StatusCode, value: &Value) -> Answer {
    let mut body = serde_json::to_vec_pretty(value).unwrap_or_default();
    body.push(b'\n');
    Answer {
        status,
        content_type: "application/json",
        body,
    }
}
