//! The upstream exchange of a covered request: sent by the proxy itself,
//! its answer relayed to the client and handed to the engine's
//! [`Recorder`].
//!
//! The exchange runs in the client's own task, next to the relay, as an
//! [`Execution`]: if the client goes away (writing to it fails) before the
//! exchange ends, the exchange is dropped there and so runs on in a task of
//! its own; it is never cancelled, and its answer is still stored.
//!
//! Recording follows the upstream's pace, not the client's: while the
//! answer is recorded, the exchange reads the upstream as fast as it sends
//! and queues what the client has not taken yet (at most the route's
//! `max_response_bytes`, the bytes the recorder holds anyway), so a client
//! that stops reading never holds the key in flight. Only bytes that are
//! not recorded (past the storage cap, a status not stored, an unprotected
//! request) are read at the client's pace, [`ROOM`] chunks ahead.

use std::future::{poll_fn, Future};
use std::pin::{pin, Pin};
use std::sync::Arc;

use bytes::Bytes;
use http::{header, Response};
use pingora_error::{Error, ErrorType, Result};
use pingora_http::{RequestHeader, ResponseHeader};
use pingora_proxy::Session;
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};
use tower_idempotency::engine::{headers, Ended, Execution, Flow, Recorder, Reservation};
use tower_idempotency::Engine;

use crate::client::{write_body, write_head, write_response};
use crate::shutdown::Active;
use crate::upstream::Upstream;

/// What the upstream exchange hands to the client side.
pub enum Frame {
    /// The upstream's response head, and whether its answer is recorded
    /// (the recorder holds it whole: so may the relay).
    Head(Box<ResponseHeader>, bool),
    /// A body chunk.
    Body(Bytes),
    /// The response is complete.
    End,
    /// The upstream failed before answering: this problem replaces it.
    Failed(Response<Bytes>),
    /// The upstream broke off mid-response: cut the client's connection.
    Abort,
}

/// How many chunks read at the client's pace may wait for the client.
pub const ROOM: usize = 16;

/// A frame on its way to the client; a chunk read at the client's pace
/// holds one of the [`ROOM`] places until it is written.
pub struct Relayed {
    frame: Frame,
    _room: Option<OwnedSemaphorePermit>,
}

/// The way from an exchange to the client side: the exchange's end and
/// [`relay`]'s end.
pub fn channel() -> (ToClient, mpsc::UnboundedReceiver<Relayed>) {
    let (frames, receiver) = mpsc::unbounded_channel();
    let to_client = ToClient { frames, room: None };
    (to_client, receiver)
}

/// The exchange's end of [`channel`].
pub struct ToClient {
    frames: mpsc::UnboundedSender<Relayed>,
    /// The [`ROOM`] places, made for the first chunk read at the client's
    /// pace (most answers are recorded whole and never need them).
    room: Option<Arc<Semaphore>>,
}

/// Runs `exchange` (an [`Exchange::run`]) in the client's task while
/// [`relay`] writes its frames to the client; both make progress
/// independently, so a client that does not read never holds up the
/// upstream or the recording. Returns the relay's outcome. If the relay
/// ends first (the client went away), the exchange is dropped here and,
/// being an [`Execution`], runs on to its end in a task of its own.
pub async fn run_and_relay(
    session: &mut Session,
    exchange: Execution<()>,
    frames: &mut mpsc::UnboundedReceiver<Relayed>,
    hold: usize,
) -> Result<bool> {
    let mut exchange = Some(exchange);
    let mut relayed = pin!(relay(session, frames, hold));
    poll_fn(|cx| {
        if let Some(running) = exchange.as_mut() {
            if Pin::new(running).poll(cx).is_ready() {
                exchange = None;
            }
        }
        relayed.as_mut().poll(cx)
    })
    .await
    // `exchange`, if it has not ended, is detached as it is dropped here.
}

/// Writes the frames of one exchange to the client.
///
/// An HTTP/1.0 client reads no chunks ([`for_client`]): a recorded answer
/// without a length is held for it, up to `hold` bytes, and written with
/// its `Content-Length` once it ended, so a cut shows as a cut (the
/// connection closed without an answer) rather than as an end. A larger or
/// unrecorded one goes out framed by the close.
pub async fn relay(
    session: &mut Session,
    frames: &mut mpsc::UnboundedReceiver<Relayed>,
    hold: usize,
) -> Result<bool> {
    let mut held: Option<Held> = None;
    // A chunk's place is given back once it is written (or held).
    while let Some(Relayed { frame, _room }) = frames.recv().await {
        match frame {
            Frame::Head(head, true) if hold > 0 && needs_length(session, &head) => {
                held = Some(Held {
                    head,
                    chunks: Vec::new(),
                    bytes: 0,
                });
            }
            Frame::Head(mut head, _) => {
                for_client(session, &mut head);
                write_head(session, head, false).await?
            }
            Frame::Body(chunk) => match held.as_mut() {
                Some(holding) if holding.bytes + chunk.len() <= hold => {
                    holding.bytes += chunk.len();
                    holding.chunks.push(chunk);
                }
                Some(_) => {
                    // Too large to hold: framed by the close from here.
                    let Held {
                        mut head, chunks, ..
                    } = held.take().expect("held");
                    for_client(session, &mut head);
                    write_head(session, head, false).await?;
                    for chunk in chunks.into_iter().chain([chunk]) {
                        write_body(session, Some(chunk), false).await?;
                    }
                }
                None => write_body(session, Some(chunk), false).await?,
            },
            Frame::End => {
                if let Some(Held {
                    mut head,
                    chunks,
                    bytes,
                }) = held.take()
                {
                    without_transfer_codings(&mut head);
                    head.insert_header(header::CONTENT_LENGTH, bytes)?;
                    write_head(session, head, false).await?;
                    for chunk in chunks {
                        write_body(session, Some(chunk), false).await?;
                    }
                }
                write_body(session, None, true).await?;
                return Ok(true);
            }
            Frame::Failed(response) => {
                session.set_keepalive(None);
                write_response(session, response).await?;
                return Ok(true);
            }
            Frame::Abort => break,
        }
    }
    match held {
        // Nothing was written: the connection is cut without an answer
        // (an error page here would tell an HTTP/1.0 client another story
        // than the key's stored outcome).
        Some(_) => Error::e_explain(
            ErrorType::ConnectionClosed,
            "the upstream broke off an answer held for an HTTP/1.0 client",
        )
        .map_err(|e| e.into_down()),
        None => Error::e_explain(ErrorType::ReadError, "the upstream broke off its response")
            .map_err(|e| e.into_up()),
    }
}

/// One request sent upstream by the proxy itself; its [`Exchange::run`]
/// goes on when the client goes away.
pub struct Exchange {
    pub engine: Engine,
    pub upstream: Arc<Upstream>,
    /// `None` once the client is gone; the exchange then goes on alone.
    pub frames: Option<ToClient>,
    pub _active: Active,
}

impl Exchange {
    /// Hands `frame` to the client side at once; `paced`, only when the
    /// client has taken all but [`ROOM`] of the chunks before it.
    async fn send(&mut self, frame: Frame, paced: bool) {
        let Some(to_client) = &mut self.frames else {
            return;
        };
        // Never closed; a client gone drops its queue, giving places back.
        let room = match paced {
            true => {
                let room = to_client
                    .room
                    .get_or_insert_with(|| Arc::new(Semaphore::new(ROOM)));
                room.clone().acquire_owned().await.ok()
            }
            false => None,
        };
        let relayed = Relayed { frame, _room: room };
        if to_client.frames.send(relayed).is_err() {
            tracing::info!("client went away; the upstream response is still recorded");
            self.frames = None;
        }
    }

    /// Sends the request, streams the answer to the client and hands it to
    /// the engine's recorder, which stores it before the client sees the
    /// end of the response (or frees the key when the upstream failed
    /// before answering, and keeps it as "executed, response incomplete"
    /// when it broke off after its head).
    ///
    /// While it holds a key, the wait for the answer ends at the route's
    /// `execution_timeout` from the start, as the layer's does (connecting
    /// and writing keep their own timeouts, so a request that never
    /// reached the upstream still frees its key): an upstream that keeps
    /// its connection busy (interim `102 Processing` answers, a body
    /// trickled a byte at a time) would otherwise hold the key in flight
    /// for as long as it likes, each read within `read_timeout`. Then the
    /// key keeps "executed, outcome unknown" (a 504 every retry replays),
    /// and a client that has the head already is cut.
    pub async fn run(
        mut self,
        request: RequestHeader,
        body: Bytes,
        reservation: Option<Reservation>,
    ) {
        let deadline = reservation.as_ref().map(|reservation| {
            tokio::time::Instant::now() + reservation.policy().policy().execution_timeout
        });
        // A key rides on a reserved request: its idle connection is asked
        // of the kernel too, since a failure after the write keeps the
        // key's outcome unknown.
        let check = match reservation.is_some() {
            true => crate::upstream::Check::Kernel,
            false => crate::upstream::Check::Seen,
        };
        // From here on the upstream may have the request; unless the key
        // may be another arrival's by now (the store was out for the
        // whole lease), which must not reach it.
        let reservation = match reservation {
            Some(reservation) if !reservation.acting() => {
                let problem = reservation.lost(&request.headers).await;
                self.send(Frame::Failed(problem), false).await;
                return;
            }
            reservation => reservation,
        };
        let mut session = match self.upstream.send(&request, &body, deadline, check).await {
            Ok(session) => session,
            Err(failure) => {
                tracing::warn!(error = %crate::logs::Redacted(&failure.error), timed_out = failure.timed_out, sent = failure.sent, "upstream failed");
                let (timed_out, headers) = (failure.timed_out, &request.headers);
                // The engine releases the key only if the upstream cannot
                // have acted; otherwise it keeps "outcome unknown".
                let problem = match reservation {
                    Some(reservation) => {
                        reservation
                            .upstream_failed(timed_out, failure.sent, headers)
                            .await
                    }
                    None => self.engine.upstream_failed(timed_out, headers),
                };
                self.send(Frame::Failed(problem), false).await;
                return;
            }
        };
        let answered = session.resp_header().expect("a response head was read");
        let mut recorder: Option<Recorder> = match reservation {
            Some(reservation) => Some(reservation.record(answered.status, &answered.headers).await),
            None => None,
        };
        let head = relayed_head(&request, answered);
        // Bytes that are not recorded move at the client's pace.
        let mut paced = !recorder.as_ref().is_some_and(Recorder::is_recording);
        self.send(Frame::Head(Box::new(head), !paced), false).await;
        // When the upstream finished its answer: its idle clock for the
        // connection starts then, not once the outcome is stored; and no
        // later than the body's end was read less the time spent waiting
        // for the client (the upstream may have written it all meanwhile).
        let mut finished = None;
        let mut waited = std::time::Duration::ZERO;
        // One timer for the whole body, made when a read first waits.
        let mut expired = pin!(async move {
            match deadline {
                Some(deadline) => tokio::time::sleep_until(deadline).await,
                None => std::future::pending().await,
            }
        });
        loop {
            let holding = recorder.as_ref().is_some_and(Recorder::is_recording);
            let read = match holding {
                true => tokio::select! {
                    biased;
                    read = session.read_body_bytes() => read,
                    () = &mut expired => {
                        tracing::warn!("upstream did not finish its answer within the route's execution_timeout");
                        if let Some(recording) = recorder.take() {
                            recording.execution_timed_out(&request.headers).await;
                        }
                        self.send(Frame::Abort, false).await;
                        return;
                    }
                },
                false => session.read_body_bytes().await,
            };
            match read {
                Ok(Some(chunk)) => {
                    if let Some(recording) = &mut recorder {
                        // Past the storage cap the recorder stores the
                        // marker itself; the chunk is relayed either way.
                        if let Flow::Pass { .. } = recording.chunk(&chunk).await {
                            paced = true;
                        }
                    }
                    // Store before the client sees the last byte.
                    if session.is_body_done() {
                        finished.get_or_insert_with(|| crate::upstream::idle_since(waited));
                        if let Some(recording) = recorder.take() {
                            if let Ended::Cut(_) = recording.end().await {
                                // Off the declared length (Pingora reads
                                // by it, so not expected): no clean end.
                                self.send(Frame::Abort, false).await;
                                return;
                            }
                        }
                    }
                    let sending = std::time::Instant::now();
                    self.send(Frame::Body(chunk), paced).await;
                    waited += sending.elapsed();
                }
                Ok(None) => break,
                Err(error) => {
                    // The upstream answered, so it acted: the recorder
                    // keeps the key as "executed, response incomplete".
                    tracing::warn!(error = %crate::logs::Redacted(&error), "upstream broke off its response");
                    if let Some(recording) = recorder {
                        recording.fail().await;
                    }
                    self.send(Frame::Abort, false).await;
                    return;
                }
            }
        }
        let finished = *finished.get_or_insert_with(|| crate::upstream::idle_since(waited));
        // A body framed by the connection's close ends here too: a clean
        // close cannot be told from a cut (a reset is an error above).
        if let Some(Ended::Cut(_)) = match recorder {
            Some(recording) => Some(recording.end().await),
            None => None,
        } {
            self.send(Frame::Abort, false).await;
            return;
        }
        // Back to the pool first: the client's end is the exchange's last
        // act, so the relay rarely outlives it.
        self.upstream.release(session, finished).await;
        self.send(Frame::End, false).await;
    }
}

/// The head relayed to the client for the upstream's answer `head` to
/// `request`: without the headers that are not relayed, and, for a body
/// that ends only where the upstream's connection closes, chunked (relayed
/// as is, the client could not tell a cut, a reset upstream, from the end
/// either) and labelled HTTP/1.1, the version chunks need (an HTTP/1.0
/// upstream's head would say 1.0), as Pingora's own proxy path does.
pub fn relayed_head(request: &RequestHeader, head: &ResponseHeader) -> ResponseHeader {
    let mut head = head.clone();
    for name in headers::not_relayed(&head.headers) {
        head.remove_header(&name);
    }
    // A 1xx or 204 has no body, nor (RFC 9110, 8.6 and 9112, 6.1) the
    // framing of one, and a 304 no `Transfer-Encoding`: relayed, they would
    // promise a body to a client or a front proxy that pools its
    // connection to this one.
    let status = head.status;
    if headers::bodiless(status) {
        head.remove_header(&http::header::TRANSFER_ENCODING);
        if status != http::StatusCode::NOT_MODIFIED {
            head.remove_header(&http::header::CONTENT_LENGTH);
        }
    }
    // Chunks need HTTP/1.1 (an HTTP/1.0 upstream that chunked anyway).
    if head.headers.contains_key(http::header::TRANSFER_ENCODING) {
        head.set_version(http::Version::HTTP_11);
    }
    if framed_by_close(request, &head) {
        head.set_version(http::Version::HTTP_11);
        let _ = head.append_header(http::header::TRANSFER_ENCODING, "chunked");
    }
    head
}

/// An answer [`relay`] holds for an HTTP/1.0 client until it ends.
struct Held {
    head: Box<ResponseHeader>,
    chunks: Vec<Bytes>,
    bytes: usize,
}

/// Whether `head` is chunked for an HTTP/1.0 client, with a body to come.
fn needs_length(session: &Session, head: &ResponseHeader) -> bool {
    let request = session.req_header();
    request.version == http::Version::HTTP_10
        && request.method != http::Method::HEAD
        && !headers::bodiless(head.status)
        && head.headers.contains_key(header::TRANSFER_ENCODING)
}

/// `head` as the session's client reads it: an HTTP/1.0 client knows no
/// `Transfer-Encoding` (RFC 9112, 6.1: a server must not send it chunks;
/// it would keep the chunk framing as the body), so a chunked body is sent
/// to it framed by the connection's close, and the connection is not kept
/// (Pingora would have said `keep-alive` first). *Limit* (README): such a
/// client cannot tell a cut from the end; [`relay`] holds recorded answers
/// to give them a length instead.
pub fn for_client(session: &mut Session, head: &mut ResponseHeader) {
    let version = session.req_header().version;
    if version == http::Version::HTTP_10 && head.headers.contains_key(header::TRANSFER_ENCODING) {
        match session.req_header().method == http::Method::HEAD {
            // No body follows to carry a coding: one named would relabel
            // the representation (a cache refreshing its GET from it).
            true => {
                head.remove_header(&header::TRANSFER_ENCODING);
            }
            false => without_transfer_codings(head),
        }
        // Beside a transfer coding a length frames nothing (RFC 9112, 6.3).
        head.remove_header(&header::CONTENT_LENGTH);
        session.set_keepalive(None);
    }
}

/// Removes `Transfer-Encoding` from a head for an HTTP/1.0 client. The
/// body relayed is decoded of its chunks only: a coding applied before
/// them (`gzip, chunked`) is still on its bytes, so it goes on as a
/// content coding, after any the head names already (the order they were
/// applied in), or the client would read the coded bytes as the body.
fn without_transfer_codings(head: &mut ResponseHeader) {
    let codings: Vec<&[u8]> = head
        .headers
        .get_all(header::TRANSFER_ENCODING)
        .iter()
        .flat_map(|value| value.as_bytes().split(|&byte| byte == b','))
        .map(<[u8]>::trim_ascii)
        .filter(|coding| !coding.is_empty() && !coding.eq_ignore_ascii_case(b"chunked"))
        .collect();
    let applied = (!codings.is_empty())
        .then(|| http::HeaderValue::from_bytes(&codings.join(&b", "[..])).ok())
        .flatten();
    head.remove_header(&header::TRANSFER_ENCODING);
    if let Some(applied) = applied {
        let _ = head.append_header(header::CONTENT_ENCODING, applied);
    }
}

/// Whether the upstream's response body ends only where its connection
/// closes (no `Content-Length`, not chunked), as the upstream session
/// frames it.
fn framed_by_close(request: &RequestHeader, head: &ResponseHeader) -> bool {
    let status = head.status;
    let no_body = request.method == http::Method::HEAD || headers::bodiless(status);
    if no_body {
        return false;
    }
    let chunked = head
        .headers
        .get_all(http::header::TRANSFER_ENCODING)
        .iter()
        .next_back()
        .is_some_and(|value| {
            let codings = value.as_bytes();
            let last = codings.rsplit(|&b| b == b',').next().unwrap_or(codings);
            last.trim_ascii().eq_ignore_ascii_case(b"chunked")
        });
    !chunked && !head.headers.contains_key(http::header::CONTENT_LENGTH)
}
