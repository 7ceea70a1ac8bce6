//! Executions whose outcome cannot be known: one that outlived its route's
//! `execution_timeout` (the handler may still be running and may still
//! act), and a request the upstream received but never answered. The key
//! keeps an "executed, outcome unknown" outcome, so it never runs twice.

use bytes::Bytes;
use http::{header, HeaderMap, HeaderName, HeaderValue, Response};

use super::Reservation;
use crate::problem::{Problem, ProblemKind};
use crate::store::{Outcome, StoredResponse};

impl Reservation {
    /// The execution passed the route's
    /// [`execution_timeout`](crate::Policy::execution_timeout): returns the
    /// 504 `upstream-timeout` answer for the caller and stores it as the
    /// key's outcome, so every retry replays it and none executes again
    /// (releasing the key would let a retry run while the first execution
    /// may still commit). The handler may have taken effect or not; a new
    /// attempt needs a new key.
    pub async fn execution_timed_out(self, request: &HeaderMap) -> Response<Bytes> {
        self.outcome_unknown(
            ProblemKind::UpstreamTimeout,
            "The request did not finish within the time allowed",
            request,
        )
        .await
    }

    /// The upstream failed before its response head: it `timed_out` (504
    /// `upstream-timeout`) or could not be reached or broke the connection
    /// (502 `upstream-unavailable`). Returns the answer for the caller.
    ///
    /// Before any of the request reached the upstream (`sent` is `false`:
    /// connecting or writing the request head failed), the upstream cannot
    /// have acted on it: the key is released and a retry executes. Once it
    /// was `sent` (a request head is enough for a handler that ignores the
    /// body), the upstream may have acted (it may have committed and then
    /// crashed, or still be working): the answer is stored as the key's outcome
    /// ("executed, outcome unknown"), like [`execution_timed_out`], so no
    /// retry with this key ever executes it a second time.
    ///
    /// [`execution_timed_out`]: Reservation::execution_timed_out
    pub async fn upstream_failed(
        self,
        timed_out: bool,
        sent: bool,
        request: &HeaderMap,
    ) -> Response<Bytes> {
        if !sent {
            return self.release_upstream_failed(timed_out, request).await;
        }
        let (kind, what) = match timed_out {
            true => (
                ProblemKind::UpstreamTimeout,
                "The upstream did not answer in time",
            ),
            false => (
                ProblemKind::UpstreamUnavailable,
                "The upstream closed the connection without answering",
            ),
        };
        self.outcome_unknown(kind, what, request).await
    }

    /// Stores a `kind` problem as the key's outcome and returns it for the
    /// caller: the operation may have taken effect, so it never runs again
    /// with this key.
    async fn outcome_unknown(
        self,
        kind: ProblemKind,
        what: &str,
        request: &HeaderMap,
    ) -> Response<Bytes> {
        let detail = format!(
            "{what}; the request may or may not have taken effect, and it will not be \
             executed again with this key."
        );
        tracing::warn!(key = %self.key_hash(), problem = kind.type_uri(), "idempotency outcome unknown; stored so that no retry executes again");
        self.store(unknown(kind, &detail)).await;
        Problem::new(kind, detail)
            .outcome_kept()
            .into_response_for(request)
    }
}

/// The outcome "executed, outcome unknown": a `kind` problem saying `detail`,
/// as JSON (what retries replay, whatever the first caller preferred).
pub(super) fn unknown(kind: ProblemKind, detail: &str) -> Outcome {
    let marker = Problem::new(kind, detail.to_owned()).into_response_for(&HeaderMap::new());
    let (parts, body) = marker.into_parts();
    let headers: Vec<(HeaderName, HeaderValue)> = parts
        .headers
        .iter()
        .filter(|(name, _)| *name != header::CONTENT_LENGTH)
        .map(|(name, value)| (name.clone(), value.clone()))
        .collect();
    Outcome::Stored(StoredResponse {
        status: parts.status,
        headers,
        body,
    })
}
