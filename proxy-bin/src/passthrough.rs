//! The direct path for requests the engine does not cover: sent upstream
//! by the proxy itself over the shared keep-alive pool, the answer relayed
//! to the client as it arrives.
//!
//! Pingora's general proxy path (two tasks joined over a channel per
//! request, its module and cache machinery) cost a plain request about
//! twice the CPU of a replay; this path does one thing in one task. It
//! takes only requests it can handle exactly like that path: HTTP/1.1, no
//! `Upgrade`, no `Expect`, and a body framed by `Content-Length` of at most
//! [`DIRECT_BODY_BYTES`] (or none). Everything else (chunked or larger
//! bodies, which must stream; upgrades, which must be bidirectional)
//! takes Pingora's path, unchanged.

use std::time::Duration;

use bytes::Bytes;
use http::{header, Method, Version};
use pingora_error::{Error, ErrorType, Result};
use pingora_http::RequestHeader;
use pingora_proxy::Session;
use tower_idempotency::engine::headers;
use tower_idempotency::Engine;

use crate::body::read_body;
use crate::client::{write_body, write_head, write_response};
use crate::exchange::relayed_head;
use crate::upstream::Upstream;

/// The largest request body the direct path reads before it forwards the
/// request (one or two reads of a client's socket); larger bodies stream
/// through Pingora's path.
pub const DIRECT_BODY_BYTES: u64 = 16 * 1024;

/// The body length (0: none) when `request` may take the direct path.
pub fn eligible(request: &RequestHeader) -> Option<usize> {
    if request.version != Version::HTTP_11 || request.method == Method::CONNECT {
        return None;
    }
    let headers = &request.headers;
    for name in [header::UPGRADE, header::EXPECT, header::TRANSFER_ENCODING] {
        if headers.contains_key(name) {
            return None;
        }
    }
    let mut lengths = headers.get_all(header::CONTENT_LENGTH).iter();
    let length = match (lengths.next(), lengths.next()) {
        (None, _) => 0,
        (Some(value), None) => value.to_str().ok()?.trim().parse::<u64>().ok()?,
        // Repeated lengths: Pingora's path judges them.
        (Some(_), Some(_)) => return None,
    };
    (length <= DIRECT_BODY_BYTES).then_some(length as usize)
}

/// Forwards an [`eligible`] request whose body is `length` bytes and
/// relays the answer; always answers the client itself (`Ok(true)`), or
/// fails the downstream connection.
pub async fn forward(
    session: &mut Session,
    engine: &Engine,
    upstream: &Upstream,
    length: usize,
    body_timeout: Duration,
) -> Result<bool> {
    let body = if length == 0 {
        Bytes::new()
    } else {
        let read = tokio::time::timeout(body_timeout, read_body(session, length)).await;
        match read {
            Ok(Ok(body)) => body,
            _ => {
                return Error::e_explain(ErrorType::ReadError, "reading the request body")
                    .map_err(|e| e.into_down())
            }
        }
    };
    let mut request = session.req_header().clone();
    for name in headers::not_forwarded(&request.headers) {
        request.remove_header(&name);
    }
    if length > 0 {
        let _ = request.insert_header(header::CONTENT_LENGTH, body.len());
    }
    let client = session
        .client_addr()
        .and_then(|addr| addr.as_inet())
        .copied();
    upstream.add_forwarding_headers(&mut request, client);
    let check = crate::upstream::Check::Seen;
    let mut exchange = match upstream.send(&request, &body, None, check).await {
        Ok(exchange) => exchange,
        Err(failure) => {
            tracing::warn!(error = %crate::logs::Redacted(&failure.error), timed_out = failure.timed_out, "upstream failed");
            session.set_keepalive(None);
            let problem = engine.upstream_failed(failure.timed_out, &request.headers);
            write_response(session, problem).await?;
            return Ok(true);
        }
    };
    let answered = exchange.resp_header().expect("a response head was read");
    let head = relayed_head(&request, answered);
    write_head(session, Box::new(head), false).await?;
    // Time spent waiting for the client to take the body: the upstream may
    // have written all of it meanwhile, so its idle clock for the
    // connection may have started that much before the body's end was read.
    let mut waited = std::time::Duration::ZERO;
    let finished = loop {
        match exchange.read_body_bytes().await {
            Ok(Some(chunk)) => {
                let writing = std::time::Instant::now();
                write_body(session, Some(chunk), false).await?;
                waited += writing.elapsed();
            }
            // The upstream's idle clock for the connection started no later.
            Ok(None) => break crate::upstream::idle_since(waited),
            Err(error) => {
                tracing::warn!(error = %crate::logs::Redacted(&error), "upstream broke off its response");
                return Err(error.into_up());
            }
        }
    };
    write_body(session, None, true).await?;
    upstream.release(exchange, finished).await;
    Ok(true)
}
