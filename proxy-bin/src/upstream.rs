//! The backend: its address, a pool of kept-alive connections, and the one
//! exchange the proxy makes itself for covered requests.

use std::net::{SocketAddr, ToSocketAddrs};
use std::time::Duration;

use bytes::Bytes;
use http::header::{self, HeaderName};
use http::{HeaderValue, Uri};
use pingora_core::connectors::http::v1::Connector;
use pingora_core::protocols::http::v1::client::HttpSession;
use pingora_core::upstreams::peer::HttpPeer;
use pingora_error::{Error, ErrorType, RetryType};
use pingora_http::RequestHeader;

/// Timeouts for talking to the upstream.
#[derive(Clone, Copy, Debug)]
pub struct Timeouts {
    /// Connecting (a failure is a 502).
    pub connect: Duration,
    /// The longest silence while reading the answer (a 504).
    pub read: Duration,
    /// The longest a write may stall.
    pub write: Duration,
    /// How long an idle connection stays in the pool.
    pub idle: Duration,
}

/// The upstream: one HTTP/1.1 origin, reached through a keep-alive pool
/// shared by every request.
pub struct Upstream {
    peer: HttpPeer,
    authority: HeaderValue,
    connector: Connector,
    timeouts: Timeouts,
}

/// Why an exchange failed before the upstream's response head arrived; the
/// client gets 502 or 504, and the engine decides from `sent` whether the
/// key may be released.
#[derive(Debug)]
pub struct ExchangeError {
    /// The upstream did not answer in time (504) rather than being
    /// unreachable or breaking the connection (502).
    pub timed_out: bool,
    /// The request head had been written: the upstream may have acted on
    /// it (some answer without reading the body), so its key must never be
    /// released.
    pub sent: bool,
    /// Pingora's error, for the log.
    pub error: Box<Error>,
}

impl Upstream {
    /// Parses `url` (`http://host:port`, no path) and resolves its host once.
    pub fn new(url: &str, timeouts: Timeouts) -> Result<Self, String> {
        let uri: Uri = url
            .parse()
            .map_err(|e| format!("`--upstream {url}` is not a URL: {e}"))?;
        match uri.scheme_str() {
            Some("http") => {}
            Some("https") => {
                return Err(
                    "`--upstream` must be plain http:// (TLS to the upstream is not supported)"
                        .into(),
                )
            }
            _ => return Err(format!("`--upstream {url}` must start with http://")),
        }
        if !matches!(uri.path(), "" | "/") || uri.query().is_some() {
            return Err(format!(
                "`--upstream {url}` must not have a path; requests keep their own path"
            ));
        }
        let authority = uri
            .authority()
            .ok_or_else(|| format!("`--upstream {url}` has no host"))?;
        let port = authority.port_u16().unwrap_or(80);
        let address: SocketAddr = (authority.host().trim_matches(['[', ']']), port)
            .to_socket_addrs()
            .ok()
            .and_then(|mut addrs| addrs.next())
            .ok_or_else(|| format!("cannot resolve the upstream host `{}`", authority.host()))?;
        let mut peer = HttpPeer::new(address, false, String::new());
        peer.options.connection_timeout = Some(timeouts.connect);
        peer.options.read_timeout = Some(timeouts.read);
        peer.options.write_timeout = Some(timeouts.write);
        peer.options.idle_timeout = Some(timeouts.idle);
        Ok(Upstream {
            peer,
            authority: HeaderValue::from_str(authority.as_str())
                .map_err(|_| format!("bad upstream authority in `{url}`"))?,
            connector: Connector::new(None),
            timeouts,
        })
    }

    /// The peer for Pingora's own proxy path (uncovered requests).
    pub fn peer(&self) -> Box<HttpPeer> {
        Box::new(self.peer.clone())
    }

    /// Sends a whole buffered request and reads the response head.
    ///
    /// A pooled connection the upstream closed while idle is retried once
    /// on a fresh one, but only when writing the request failed (and
    /// Pingora classifies the failure `ReusedOnly`). Once the request was
    /// written whole, the upstream may have acted on it: it is never sent
    /// twice, the caller answers 502 and releases the key.
    pub async fn send(
        &self,
        request: &RequestHeader,
        body: &Bytes,
    ) -> Result<HttpSession, ExchangeError> {
        let mut attempt = 0;
        loop {
            attempt += 1;
            let (mut session, reused) =
                self.connector
                    .get_http_session(&self.peer)
                    .await
                    .map_err(|error| ExchangeError {
                        // A connect timeout is an unreachable upstream: 502.
                        timed_out: false,
                        sent: false,
                        error,
                    })?;
            session.read_timeout = Some(self.timeouts.read);
            session.write_timeout = Some(self.timeouts.write);
            match exchange_head(&mut session, request, body).await {
                Ok(()) => return Ok(session),
                Err((sent, error)) => {
                    // Once the request head is written, the upstream may
                    // have acted on it: never send it a second time.
                    let stale = reused && !sent && matches!(error.retry, RetryType::ReusedOnly);
                    if stale && attempt == 1 {
                        tracing::debug!(%error, "stale pooled upstream connection; retrying");
                        continue;
                    }
                    let timed_out = matches!(
                        error.etype,
                        ErrorType::ReadTimedout | ErrorType::WriteTimedout
                    );
                    return Err(ExchangeError {
                        timed_out,
                        sent,
                        error,
                    });
                }
            }
        }
    }

    /// Returns a connection whose response was read to the end to the pool.
    pub async fn release(&self, session: HttpSession) {
        self.connector
            .release_http_session(session, &self.peer, Some(self.timeouts.idle))
            .await;
    }

    /// Adds the forwarding headers every request to the upstream carries:
    /// `X-Forwarded-For` (the client appended to any earlier hops),
    /// `X-Forwarded-Proto` (kept when a front proxy set it, else `http`),
    /// and `Host` (the client's is kept; the upstream's when it sent none).
    pub fn add_forwarding_headers(&self, request: &mut RequestHeader, client: Option<SocketAddr>) {
        if let Some(client) = client {
            let ip = client.ip().to_string();
            let value = match request
                .headers
                .get(X_FORWARDED_FOR)
                .map(HeaderValue::to_str)
            {
                Some(Ok(earlier)) if !earlier.trim().is_empty() => format!("{earlier}, {ip}"),
                _ => ip,
            };
            let _ = request.insert_header(X_FORWARDED_FOR, value);
        }
        if !request.headers.contains_key(X_FORWARDED_PROTO) {
            let _ = request.insert_header(X_FORWARDED_PROTO, "http");
        }
        if !request.headers.contains_key(header::HOST) {
            let _ = request.insert_header(header::HOST, self.authority.clone());
        }
    }
}

const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");

/// Sends the request and reads the response head. An error says whether
/// the request had been written whole (`true`) when it happened.
async fn exchange_head(
    session: &mut HttpSession,
    request: &RequestHeader,
    body: &Bytes,
) -> Result<(), (bool, Box<Error>)> {
    session
        .write_request_header(Box::new(request.clone()))
        .await
        .map_err(|error| (false, error))?;
    // The head is on the wire: the upstream may act on it alone (a handler
    // that ignores the body answers and closes the connection, unread body
    // and all), so from here on the request counts as sent.
    let written = async {
        if !body.is_empty() {
            session.write_body(body).await?;
        }
        session.finish_body().await
    }
    .await;
    if let Err(error) = written {
        // An upstream that answered before reading the body: its answer,
        // if it reached us, is the response.
        return match read_head(session).await {
            Ok(()) => Ok(()),
            Err(_) => Err((true, error)),
        };
    }
    read_head(session).await.map_err(|error| (true, error))
}

/// Reads the response head, skipping interim responses (100 Continue, 103
/// Early Hints; 101 cannot happen without an Upgrade header).
async fn read_head(session: &mut HttpSession) -> Result<(), Box<Error>> {
    loop {
        session.read_response().await?;
        match session.get_status() {
            Some(status) if status.is_informational() && status.as_u16() != 101 => continue,
            _ => return Ok(()),
        }
    }
}
