//! Writes to the client, each bounded by the session's write timeout:
//! the proxy's answers (replays, problems) and the heads, chunks and ends
//! it relays from an upstream. Pingora bounds a body chunk's write by that
//! timeout, but not a head's, nor the last chunk and flush that end a
//! body: a client that stopped reading just there held its task (and a
//! paced exchange, its upstream connection) for good.

use std::future::{poll_fn, Future};
use std::pin::{pin, Pin};
use std::task::Poll;
use std::time::Duration;

use bytes::Bytes;
use http::{header, Response};
use pingora_error::{Error, ErrorType, Result};
use pingora_http::ResponseHeader;
use pingora_proxy::Session;
use tower_idempotency::engine::headers;

/// Writes a whole response (a replay or one of the engine's problems).
pub async fn write_response(session: &mut Session, response: Response<Bytes>) -> Result<()> {
    let (parts, body) = response.into_parts();
    let mut head: ResponseHeader = parts.into();
    // RFC 9110, 8.6: never on a 1xx or 204; a 304's would describe the
    // resource, not this empty body.
    if !headers::bodiless(head.status) {
        head.insert_header(header::CONTENT_LENGTH, body.len())?;
    }
    let end = body.is_empty();
    write_head(session, Box::new(head), end).await?;
    // In pieces, each within the write timeout: a client reading steadily
    // but slowly still gets a large replay (written whole, the timeout
    // bounded the whole body: under ~35 KB/s a 1 MiB replay never made it).
    let mut rest = body;
    while !rest.is_empty() {
        let piece = rest.split_to(rest.len().min(WRITE_PIECE));
        write_body(session, Some(piece), rest.is_empty()).await?;
    }
    Ok(())
}

/// The most bytes of a whole response written to the client at once.
const WRITE_PIECE: usize = 64 * 1024;

/// Writes a response head to the client within the session's write
/// timeout (with `end`, the end of an empty body too).
pub async fn write_head(session: &mut Session, head: Box<ResponseHeader>, end: bool) -> Result<()> {
    let limit = session.get_write_timeout();
    within(limit, pin!(session.write_response_header(head, end))).await
}

/// Writes a body chunk (`None`: no more) to the client, and with `end` its
/// end, within the session's write timeout (see [`write_head`]). A chunk
/// that does not end the body is Pingora's own bounded write.
pub async fn write_body(session: &mut Session, chunk: Option<Bytes>, end: bool) -> Result<()> {
    if !end {
        return session.write_response_body(chunk, false).await;
    }
    let limit = session.get_write_timeout();
    within(limit, pin!(session.write_response_body(chunk, true))).await
}

/// `write` within `limit` (none: unbounded). Polled once first: most
/// writes finish at once, and then no timer is made (the write, pinned by
/// its caller, is never moved either).
async fn within<F>(limit: Option<Duration>, mut write: Pin<&mut F>) -> Result<()>
where
    F: Future<Output = Result<()>>,
{
    let first = poll_fn(|cx| Poll::Ready(write.as_mut().poll(cx))).await;
    if let Poll::Ready(written) = first {
        return written;
    }
    let Some(limit) = limit else {
        return write.await;
    };
    match pingora_timeout::timeout(limit, write).await {
        Ok(written) => written,
        Err(_) => Error::e_explain(
            ErrorType::WriteTimedout,
            "the client took none of its answer",
        )
        .map_err(|e| e.into_down()),
    }
}
