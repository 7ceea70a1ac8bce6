//! Reading a covered request's body from the client: whole, within the
//! route's limit, or refused.

use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::header;
use pingora_error::ErrorType;
use pingora_http::RequestHeader;
use pingora_proxy::Session;

/// Why a body was not read whole.
pub enum BodyFailure {
    /// Over the route's limit (declared or read); `sending` unless it was
    /// refused by its declared length before a client that waits for
    /// `100 Continue` was told to send it (it sends nothing then, and the
    /// connection can close at once).
    TooLarge { sending: bool },
    /// The client broke off or was too slow (`timed_out`).
    Unreadable { timed_out: bool },
}

/// Reads the whole request body, refusing it (before reading, when
/// `Content-Length` says so) once it exceeds `limit`.
pub async fn read_body(session: &mut Session, limit: usize) -> Result<Bytes, BodyFailure> {
    let request = session.req_header();
    let declared = request
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    let waits = expects_continue(request);
    if declared.is_some_and(|length| length > limit as u64) {
        return Err(BodyFailure::TooLarge { sending: !waits });
    }
    if waits && session.write_continue_response().await.is_err() {
        return Err(BodyFailure::Unreadable { timed_out: false });
    }
    let mut body = BytesMut::with_capacity(declared.map_or(0, |n| n as usize));
    loop {
        match session.read_request_body().await {
            Ok(Some(chunk)) => {
                if body.len() + chunk.len() > limit {
                    return Err(BodyFailure::TooLarge { sending: true });
                }
                body.extend_from_slice(&chunk);
            }
            Ok(None) => return Ok(body.freeze()),
            Err(error) => {
                return Err(BodyFailure::Unreadable {
                    timed_out: matches!(error.etype(), ErrorType::ReadTimedout),
                })
            }
        }
    }
}

/// Whether the client waits for `100 Continue` before it sends the body:
/// an HTTP/1.1 request saying `Expect: 100-continue`. An HTTP/1.0 one's
/// expectation is ignored (RFC 9110, 10.1.1: an HTTP/1.0 intermediary may
/// take a 100 for the final answer); its body comes unasked.
fn expects_continue(request: &RequestHeader) -> bool {
    request.version == http::Version::HTTP_11
        && request
            .headers
            .get(header::EXPECT)
            .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"))
}

/// The most a refused body is read (and dropped) after its 413, in bytes
/// and in time, before the connection is closed.
const LINGER_BYTES: usize = 8 << 20;
const LINGER_TIME: Duration = Duration::from_secs(2);

/// Reads and drops what is left of the request body, within the linger
/// bounds: closing a socket with unread data resets it, and the client
/// could see the reset instead of the answer already sent.
pub async fn discard_body(session: &mut Session) {
    let drain = async {
        let mut left = LINGER_BYTES;
        while let Ok(Some(chunk)) = session.read_request_body().await {
            left = left.saturating_sub(chunk.len());
            if left == 0 {
                break;
            }
        }
    };
    let _ = tokio::time::timeout(LINGER_TIME, drain).await;
}
