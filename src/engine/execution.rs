//! An execution that outlived its route's `execution_timeout`: the front
//! end stops waiting, and the key keeps an "executed, outcome unknown"
//! outcome, since the handler may still be running and may still act.

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
        let problem = || {
            Problem::new(
                ProblemKind::UpstreamTimeout,
                "The request did not finish within the time allowed; it may or may not \
                 have taken effect, and it will not be executed again with this key.",
            )
        };
        tracing::warn!(key = %self.key_hash(), "idempotency execution timed out; its outcome is stored as unknown");
        // What retries replay: the JSON problem, whatever the first caller
        // preferred.
        let marker = problem().into_response_for(&HeaderMap::new());
        let (parts, body) = marker.into_parts();
        let headers: Vec<(HeaderName, HeaderValue)> = parts
            .headers
            .iter()
            .filter(|(name, _)| *name != header::CONTENT_LENGTH)
            .map(|(name, value)| (name.clone(), value.clone()))
            .collect();
        self.store(Outcome::Stored(StoredResponse {
            status: parts.status,
            headers,
            body,
        }))
        .await;
        problem().into_response_for(request)
    }
}
