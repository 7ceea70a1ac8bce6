//! The operator API's outbox routes (behind the admin token), answering
//! JSON:
//!
//! * `GET /outbox/counts`: rows per state;
//! * `GET /outbox/dead[?limit=N][&payload=1]`: dead rows with their error
//!   columns, oldest first (100 by default, at most 1000); payloads only
//!   with `payload=1`;
//! * `POST /outbox/dead/{id}/retry`: a dead row back in the queue;
//! * `POST /outbox/purge?id=N` or `?older_than=DURATION[&topic=NAME]`:
//!   deletes dead rows (`older_than=0s`: every dead row).

use http::{Method, StatusCode};
use pingora_http::RequestHeader;
use tower_idempotency::outbox::Outbox;

use super::Answer;
use crate::outbox::ops::{self, Purge, Refused};

/// The answer for `/outbox/…` paths; `None` for any other path.
pub async fn route(outbox: Option<&Outbox>, request: &RequestHeader) -> Option<Answer> {
    let path = request.uri.path().strip_prefix("/outbox")?;
    if !path.is_empty() && !path.starts_with('/') {
        return None;
    }
    let Some(outbox) = outbox else {
        return Some(refused(Refused {
            status: 404,
            message: "no outbox here: configure [outbox] to run outbox workers in this proxy"
                .to_owned(),
        }));
    };
    let method = &request.method;
    let segments: Vec<&str> = path.split('/').skip(1).collect();
    // The parameters each route takes; read only once the route and method
    // are known (`None`: an unknown route is 404 and a wrong method 405,
    // whatever the query).
    let allowed: Option<&[&str]> = match (segments.as_slice(), method) {
        (["dead"], &Method::GET) => Some(&["limit", "payload"]),
        (["purge"], &Method::POST) => Some(&["id", "older_than", "topic"]),
        (["counts"], &Method::GET) | (["dead", _, "retry"], &Method::POST) => Some(&[]),
        _ => None,
    };
    let query = match allowed {
        None => Vec::new(),
        Some(allowed) => {
            match super::query_params(request.uri.query().unwrap_or_default(), allowed) {
                Ok(query) => query,
                Err(message) => return Some(refused(Refused::bad(message))),
            }
        }
    };
    let param = |name: &str| {
        query
            .iter()
            .find(|(key, _)| key == name)
            .map(|(_, value)| value.as_str())
    };
    let result = match (segments.as_slice(), method) {
        (["counts"], &Method::GET) => ops::counts(outbox).await,
        (["dead"], &Method::GET) => {
            match (param("limit").map(str::parse::<usize>), param("payload")) {
                (Some(Err(_)), _) => Err(Refused::bad("`limit` must be a whole number")),
                (_, Some(other)) if !matches!(other, "1" | "true" | "0" | "false") => {
                    Err(Refused::bad(format!(
                        "`payload`: expected 1, true, 0 or false, got `{other}`"
                    )))
                }
                (limit, payload) => {
                    let payload = matches!(payload, Some("1" | "true"));
                    ops::dead(outbox, limit.and_then(Result::ok).unwrap_or(100), payload).await
                }
            }
        }
        (["dead", id, "retry"], &Method::POST) => match id.parse() {
            Ok(id) => ops::retry(outbox, id).await,
            Err(_) => Err(Refused::bad(format!("`{id}` is not a row id"))),
        },
        (["purge"], &Method::POST) => match purge_of(param) {
            Ok(purge) => ops::purge(outbox, &purge).await,
            Err(refusal) => Err(refusal),
        },
        (["counts" | "dead" | "purge"] | ["dead", _, "retry"], _) => {
            return Some(Answer::text(
                StatusCode::METHOD_NOT_ALLOWED,
                format!("method {method} not allowed here\n"),
            ))
        }
        _ => Err(Refused {
            status: 404,
            message: format!(
                "no outbox route {}: GET /outbox/counts, GET /outbox/dead, \
                 POST /outbox/dead/ID/retry, POST /outbox/purge",
                request.uri.path()
            ),
        }),
    };
    Some(match result {
        Ok(value) => json(StatusCode::OK, &value),
        Err(refusal) => refused(refusal),
    })
}

fn purge_of<'a>(param: impl Fn(&str) -> Option<&'a str>) -> Result<Purge, Refused> {
    let id = param("id")
        .map(|id| {
            id.parse()
                .map_err(|_| Refused::bad(format!("`id`: `{id}` is not a row id")))
        })
        .transpose()?;
    let older_than = param("older_than")
        .map(|value| {
            humantime::parse_duration(value).map_err(|_| {
                Refused::bad(format!(
                    "`older_than`: `{value}` is not a duration (e.g. 7d, 12h, 0s)"
                ))
            })
        })
        .transpose()?;
    Ok(Purge {
        id,
        older_than,
        topic: param("topic").map(str::to_owned),
    })
}

fn json(status: StatusCode, value: &serde_json::Value) -> Answer {
    let mut body = serde_json::to_vec_pretty(value).expect("JSON values serialize");
    body.push(b'\n');
    Answer {
        status,
        content_type: "application/json",
        body,
    }
}

fn refused(refusal: Refused) -> Answer {
    let status = StatusCode::from_u16(refusal.status).unwrap_or(StatusCode::BAD_REQUEST);
    json(status, &serde_json::json!({ "error": refusal.message }))
}
