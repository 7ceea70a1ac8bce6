//! The engine-wide budget for buffered covered request bodies: each
//! waiting duplicate holds its body (up to its route's `max_body_bytes`)
//! for up to `wait_timeout`, so without a cap a burst of them could take
//! any amount of memory.

use bytes::Bytes;
use http::{header, HeaderMap, Response};

use super::{Covered, Engine};
use crate::problem::{Problem, ProblemKind};

/// Room for one covered request's body in the engine-wide budget
/// ([`EngineConfig::max_buffered_bytes`](super::EngineConfig)). Hold it
/// while the body is read and [`Engine::begin`] decides; the room is given
/// back when it is dropped.
#[derive(Debug)]
#[must_use = "the room is given back when the permit is dropped"]
pub struct BodyPermit {
    engine: Engine,
    bytes: u64,
}

impl BodyPermit {
    /// The bytes this permit holds.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Gives back what the body read did not use: a body of unknown length
    /// was counted at its route's limit, and a duplicate holds its permit
    /// while it waits, so its room shrinks to the `bytes` it holds (never
    /// grows).
    pub fn shrink_to(&mut self, bytes: u64) {
        if bytes < self.bytes {
            self.engine.inner.metrics.unbuffer(self.bytes - bytes);
            self.bytes = bytes;
        }
    }
}

impl Drop for BodyPermit {
    fn drop(&mut self) {
        self.engine.inner.metrics.unbuffer(self.bytes);
    }
}

impl Engine {
    /// Takes room for a covered request's body before it is read: its
    /// `Content-Length` (the HTTP framing bounds the body to it; ignored
    /// beside a `Transfer-Encoding` or when repeated), or, for a body of
    /// unknown length, [`Covered::max_body_bytes`] (the route's limit, at
    /// most the whole budget; a declared length over it is counted at it,
    /// and the body is refused with 413 anyway). When the bytes already held by other requests leave no
    /// room, the answer is 503 `overloaded` with `Retry-After`: send it
    /// without reading the body; nothing is reserved. The total held never
    /// exceeds `max_buffered_bytes`.
    // The refusal is the answer itself, like the engine's other answers;
    // it is the rare path, so it is not boxed.
    #[allow(clippy::result_large_err)]
    pub fn body_permit(
        &self,
        covered: &Covered,
        request: &HeaderMap,
    ) -> Result<BodyPermit, Response<Bytes>> {
        let limit = covered.max_body_bytes() as u64;
        // A length is trusted only where it frames the body: alone (with a
        // `Transfer-Encoding` it is ignored, so `chunked` + `Content-Length:
        // 0` must not buffer a body at no cost) and given once.
        let mut lengths = request.get_all(header::CONTENT_LENGTH).iter();
        let declared = match (lengths.next(), lengths.next()) {
            (Some(value), None) if !request.contains_key(header::TRANSFER_ENCODING) => value
                .to_str()
                .ok()
                .and_then(|value| value.trim().parse::<u64>().ok()),
            _ => None,
        };
        let bytes = declared.map_or(limit, |length| length.min(limit));
        let max = self.inner.config.max_buffered_bytes;
        if self.inner.metrics.try_buffer(bytes, max) {
            return Ok(BodyPermit {
                engine: self.clone(),
                bytes,
            });
        }
        let response = Problem::new(
            ProblemKind::Overloaded,
            "Too many requests are in progress; the request was not executed.",
        )
        .retry_after(self.inner.config.store_retry_after)
        .into_response_for(request);
        // The decision line (no key hash: the key was not read), with what
        // did not fit.
        tracing::info!(
            outcome = "overloaded",
            status = response.status().as_u16(),
            duration_us = covered.arrived().elapsed().as_micros() as u64,
            bytes,
            max_buffered_bytes = max,
            "idempotency"
        );
        Err(response)
    }
}
