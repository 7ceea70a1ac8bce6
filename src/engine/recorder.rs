//! The upstream's answer, recorded while it streams to the client.
//!
//! Every rule about what is stored lives here and in
//! [`Reservation`](super::Reservation): a status the route does not store
//! frees the key at once; each chunk is kept up to the storage cap; past
//! the cap only a marker is stored; a stream that breaks off after the head
//! stores the marker "executed, response incomplete" (the upstream acted,
//! so the request must not run again); the end of the stream stores the
//! response. A front end moves bytes and calls
//! [`Recorder::chunk`], then [`Recorder::end`] or [`Recorder::fail`].

use bytes::{Bytes, BytesMut};
use http::{HeaderName, HeaderValue, StatusCode};

use super::Reservation;
use crate::store::{Outcome, StoredResponse};

/// What a front end does after handing a chunk to [`Recorder::chunk`].
#[derive(Debug, PartialEq, Eq)]
pub enum Flow {
    /// The chunk was recorded: keep feeding chunks, then call
    /// [`Recorder::end`] (or [`Recorder::fail`]).
    Record,
    /// Nothing is recorded any more: pass the rest on as it comes. On the
    /// chunk that passed the storage cap (whose marker is now stored),
    /// `recorded` holds the bytes recorded before that chunk, which the
    /// recorder no longer holds; otherwise it is empty.
    Pass {
        /// The body recorded before the chunk that stopped recording.
        recorded: Bytes,
    },
}

/// How a recorded body ended, as [`Recorder::end`] found it.
#[derive(Debug, PartialEq, Eq)]
#[must_use = "a cut body must not be sent as whole"]
pub enum Ended {
    /// At the length its head declared (or without a declared length):
    /// the bytes stored, which the caller may be given as the whole body.
    Whole(Bytes),
    /// Short of, or past, the length its head declared: the bytes received,
    /// stored as "executed, response incomplete". The caller must see the
    /// cut (the layer declares one byte more than it sends; the proxy
    /// aborts), never these bytes framed as a complete answer.
    Cut(Bytes),
}

/// Records one upstream answer for its reservation. Made by
/// [`Reservation::record`].
///
/// Dropped before [`end`](Recorder::end) or [`fail`](Recorder::fail) while
/// still recording (a body that panicked, a task cancelled, even while the
/// outcome was being stored), its reservation stores the marker "executed,
/// response incomplete" in the background, as `fail` does: a head came, so
/// the upstream acted, and the key is never freed for a second execution.
#[derive(Debug)]
pub struct Recorder {
    /// `None` once the outcome is settled (stored, marked or released).
    reservation: Option<Reservation>,
    status: StatusCode,
    /// The headers a replay will carry.
    pub(super) headers: Vec<(HeaderName, HeaderValue)>,
    body: Buffer,
    limit: usize,
    /// The body length the head declared (`Content-Length`), when the
    /// status carries a body.
    declared: Option<u64>,
}

impl Recorder {
    /// A recorder for `reservation`'s answer with `status` and the headers
    /// kept for a replay; the body may be up to `limit` bytes.
    pub(super) fn new(
        reservation: Reservation,
        status: StatusCode,
        headers: Vec<(HeaderName, HeaderValue)>,
        limit: usize,
        declared: Option<u64>,
    ) -> Self {
        let bodiless = super::headers::bodiless(status);
        Recorder {
            reservation: Some(reservation),
            status,
            headers,
            body: Buffer::default(),
            limit,
            declared: declared.filter(|_| !bodiless),
        }
    }

    /// A recorder with nothing to record: the key was already settled.
    pub(super) fn settled(status: StatusCode) -> Self {
        Recorder {
            reservation: None,
            status,
            headers: Vec::new(),
            body: Buffer::default(),
            limit: 0,
            declared: None,
        }
    }

    /// Whether body chunks are still recorded. `false` from the start when
    /// the route does not store this status (the key is already free).
    pub fn is_recording(&self) -> bool {
        self.reservation.is_some()
    }

    /// The status being recorded.
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// Records a body chunk (the first one without a copy). A chunk that
    /// takes the body past the route's storage cap stops the recording:
    /// the marker "executed, response too large" is stored at once, and
    /// the retry gets a `response-not-stored` problem.
    pub async fn chunk(&mut self, chunk: &Bytes) -> Flow {
        let Some(reservation) = self.reservation.take() else {
            return Flow::Pass {
                recorded: Bytes::new(),
            };
        };
        if self.body.len() + chunk.len() <= self.limit {
            self.body.push(chunk);
            self.reservation = Some(reservation);
            return Flow::Record;
        }
        let recorded = std::mem::take(&mut self.body).into_bytes();
        reservation
            .store(Outcome::TooLarge {
                status: self.status,
            })
            .await;
        Flow::Pass { recorded }
    }

    /// The body ended: stores the response (from now on it is replayed).
    /// Returns the recorded body, the very bytes stored (empty when nothing
    /// was recorded), as [`Ended::Whole`]. A body that ended cleanly but not
    /// at the length its head declared (`Content-Length`: a producer that
    /// stopped early, or one that sent more) reached the client cut, so it
    /// is stored as [`fail`](Recorder::fail) stores a break, never as
    /// complete, and comes back as [`Ended::Cut`]: the front end must not
    /// present those bytes as the whole answer.
    ///
    /// A recorder no longer recording (past the storage cap, or a status
    /// not stored) holds no body to measure: its end is [`Ended::Whole`]
    /// with no bytes.
    pub async fn end(mut self) -> Ended {
        let off_length = self
            .declared
            .is_some_and(|declared| declared != self.body.len() as u64);
        if off_length && self.is_recording() {
            return Ended::Cut(self.fail().await);
        }
        let body = std::mem::take(&mut self.body).into_bytes();
        if let Some(reservation) = self.reservation.take() {
            reservation
                .store(Outcome::Stored(StoredResponse {
                    status: self.status,
                    headers: std::mem::take(&mut self.headers),
                    body: body.clone(),
                }))
                .await;
        }
        Ended::Whole(body)
    }

    /// The body broke off. The upstream sent a head, so
    /// it acted: the key is not released, the marker "executed, response
    /// incomplete" is stored instead, and retries get a
    /// `response-incomplete` problem, never a second execution. Returns
    /// what was recorded before the break.
    pub async fn fail(mut self) -> Bytes {
        if let Some(reservation) = self.reservation.take() {
            reservation
                .store(Outcome::Incomplete {
                    status: self.status,
                })
                .await;
        }
        std::mem::take(&mut self.body).into_bytes()
    }
}

impl Recorder {
    /// The body did not end within the route's `execution_timeout`: like
    /// [`Reservation::execution_timed_out`] (504, stored as the outcome).
    pub async fn execution_timed_out(mut self, request: &http::HeaderMap) -> http::Response<Bytes> {
        match self.reservation.take() {
            Some(reservation) => reservation.execution_timed_out(request).await,
            None => crate::problem::Problem::new(
                crate::problem::ProblemKind::UpstreamTimeout,
                "The request did not finish within the time allowed.",
            )
            .into_response_for(request),
        }
    }
}

/// A body collected chunk by chunk: one chunk is kept as it came, several
/// are joined.
#[derive(Debug, Default)]
struct Buffer {
    /// The body when it came in one chunk; `joined` is empty while this is
    /// set.
    first: Option<Bytes>,
    joined: BytesMut,
}

impl Buffer {
    fn len(&self) -> usize {
        self.first.as_ref().map_or(0, Bytes::len) + self.joined.len()
    }

    fn push(&mut self, chunk: &Bytes) {
        if self.first.is_none() && self.joined.is_empty() {
            self.first = Some(chunk.clone());
            return;
        }
        if let Some(first) = self.first.take() {
            self.joined.extend_from_slice(&first);
        }
        self.joined.extend_from_slice(chunk);
    }

    fn into_bytes(self) -> Bytes {
        self.first.unwrap_or_else(|| self.joined.freeze())
    }
}
