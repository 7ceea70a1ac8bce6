//! The upstream exchange of a covered request: sent by the proxy itself,
//! detached from the client, its answer relayed to the client and handed
//! to the engine's [`Recorder`].

use std::sync::Arc;

use bytes::Bytes;
use http::Response;
use pingora_error::{Error, ErrorType, Result};
use pingora_http::{RequestHeader, ResponseHeader};
use pingora_proxy::Session;
use tokio::sync::mpsc;
use tower_idempotency::engine::{headers, Recorder, Reservation};
use tower_idempotency::Engine;

use crate::proxy::write_response;
use crate::shutdown::Active;
use crate::upstream::Upstream;

/// What the upstream exchange hands to the client side.
pub enum Frame {
    /// The upstream's response head.
    Head(Box<ResponseHeader>),
    /// A body chunk.
    Body(Bytes),
    /// The response is complete.
    End,
    /// The upstream failed before answering: this problem replaces it.
    Failed(Response<Bytes>),
    /// The upstream broke off mid-response: cut the client's connection.
    Abort,
}

/// Writes the frames of one exchange to the client.
pub async fn relay(session: &mut Session, frames: &mut mpsc::Receiver<Frame>) -> Result<bool> {
    while let Some(frame) = frames.recv().await {
        match frame {
            Frame::Head(head) => session.write_response_header(head, false).await?,
            Frame::Body(chunk) => session.write_response_body(Some(chunk), false).await?,
            Frame::End => {
                session.write_response_body(None, true).await?;
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
    Error::e_explain(ErrorType::ReadError, "the upstream broke off its response")
        .map_err(|e| e.into_up())
}

/// One request sent upstream by the proxy itself, detached from the client.
pub struct Exchange {
    pub engine: Engine,
    pub upstream: Arc<Upstream>,
    /// `None` once the client is gone; the exchange then goes on alone.
    pub frames: Option<mpsc::Sender<Frame>>,
    pub _active: Active,
}

impl Exchange {
    async fn send(&mut self, frame: Frame) {
        if let Some(frames) = &self.frames {
            if frames.send(frame).await.is_err() {
                tracing::info!("client went away; the upstream response is still recorded");
                self.frames = None;
            }
        }
    }

    /// Sends the request, streams the answer to the client and hands it to
    /// the engine's recorder, which stores it before the client sees the
    /// end of the response (or frees the key when the upstream failed).
    pub async fn run(
        mut self,
        request: RequestHeader,
        body: Bytes,
        reservation: Option<Reservation>,
    ) {
        let mut session = match self.upstream.send(&request, &body).await {
            Ok(session) => session,
            Err(failure) => {
                tracing::warn!(error = %failure.error, timed_out = failure.timed_out, "upstream failed");
                if let Some(reservation) = reservation {
                    reservation.release().await;
                }
                let problem = self
                    .engine
                    .upstream_failed(failure.timed_out, &request.headers);
                self.send(Frame::Failed(problem)).await;
                return;
            }
        };
        let mut head = session
            .resp_header()
            .expect("a response head was read")
            .clone();
        let mut recorder: Option<Recorder> = match reservation {
            Some(reservation) => Some(reservation.record(head.status, &head.headers).await),
            None => None,
        };
        for name in headers::not_relayed(&head.headers) {
            head.remove_header(&name);
        }
        self.send(Frame::Head(Box::new(head))).await;
        loop {
            match session.read_body_bytes().await {
                Ok(Some(chunk)) => {
                    if let Some(recording) = &mut recorder {
                        // Past the storage cap the recorder stores the
                        // marker itself; the chunk is relayed either way.
                        let _ = recording.chunk(&chunk).await;
                    }
                    // Store before the client sees the last byte.
                    if session.is_body_done() {
                        if let Some(recording) = recorder.take() {
                            recording.end().await;
                        }
                    }
                    self.send(Frame::Body(chunk)).await;
                }
                Ok(None) => break,
                Err(error) => {
                    tracing::warn!(%error, "upstream broke off its response");
                    if let Some(recording) = recorder {
                        recording.fail().await;
                    }
                    self.send(Frame::Abort).await;
                    return;
                }
            }
        }
        if let Some(recording) = recorder {
            recording.end().await;
        }
        self.send(Frame::End).await;
        self.upstream.release(session).await;
    }
}
