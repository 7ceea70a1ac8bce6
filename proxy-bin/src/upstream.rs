//! The backend: its address, a pool of kept-alive connections, and the one
//! exchange the proxy makes itself for covered requests.

use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::header::{self, HeaderName};
use http::{HeaderValue, Method, Uri};
use pingora_core::connectors::TransportConnector;
use pingora_core::protocols::http::v1::client::{http_req_header_to_wire, HttpSession};
use pingora_core::protocols::Stream;
use pingora_core::upstreams::peer::HttpPeer;
use pingora_error::{Error, ErrorType};
use pingora_http::{RequestHeader, ResponseHeader};
use tower_idempotency::engine::headers;

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
    connector: TransportConnector,
    idle: Arc<Pool>,
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
        // Credentials are refused before any message repeats the URL: it
        // would be logged at start and sent as `Host`.
        let before_path = url.split_once("://").map_or(url, |(_, rest)| rest);
        let authority_part = before_path
            .split(['/', '?', '#'])
            .next()
            .unwrap_or_default();
        if authority_part.contains('@') {
            return Err(
                "`--upstream` must not carry credentials (user:password@): the proxy sends no upstream authentication"
                    .into(),
            );
        }
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
        let idle = Arc::new(Pool::default());
        Pool::sweep_every(Arc::downgrade(&idle), timeouts.idle);
        Ok(Upstream {
            peer,
            authority: HeaderValue::from_str(authority.as_str())
                .map_err(|_| format!("bad upstream authority in `{url}`"))?,
            connector: TransportConnector::new(None),
            idle,
            timeouts,
        })
    }

    /// The peer for Pingora's own proxy path (uncovered requests).
    pub fn peer(&self) -> Box<HttpPeer> {
        Box::new(self.peer.clone())
    }

    /// Sends a whole buffered request and reads the response head.
    ///
    /// A pooled connection that failed before the request head was written
    /// whole (the upstream closed it while idle) is retried once on another
    /// connection (pooled or new): a partial head is nothing the upstream
    /// can act on. Once the
    /// head was written, the upstream may have acted on it: it is never
    /// sent twice, and the caller's 502 or 504 is kept as the key's
    /// outcome. Pooled connections are not kept past the idle time the
    /// upstream announces (`Keep-Alive: timeout=N`), so that race is rare.
    ///
    /// An idle connection is checked as `check` says before it is used.
    ///
    /// With a `deadline`, waiting for the answer's head ends there (the
    /// request was sent: a timeout, never released); connecting and
    /// writing keep their own timeouts, so a request that never reached
    /// the upstream is not mistaken for one it may have acted on.
    pub async fn send(
        &self,
        request: &RequestHeader,
        body: &Bytes,
        deadline: Option<tokio::time::Instant>,
        check: Check,
    ) -> Result<Sent, ExchangeError> {
        let closing;
        let request = if closes_connection(&request.method, !body.is_empty()) {
            let mut copy = request.clone();
            let _ = copy.insert_header(header::CONNECTION, "close");
            closing = copy;
            &closing
        } else {
            request
        };
        let mut attempt = 0;
        loop {
            attempt += 1;
            let (stream, reused, after_bodiless) = match self.idle.take(check) {
                Some((stream, after_bodiless)) => (stream, true, after_bodiless),
                None => {
                    let stream = self
                        .connector
                        .new_stream(&self.peer)
                        .await
                        .map_err(|error| {
                            ExchangeError {
                                // A connect timeout is an unreachable upstream: 502.
                                timed_out: false,
                                sent: false,
                                error,
                            }
                        })?;
                    (stream, false, false)
                }
            };
            match self.exchange_head(stream, request, body, deadline).await {
                Ok(mut sent) => {
                    sent.after_bodiless = after_bodiless;
                    return Ok(sent);
                }
                Err((sent, error)) => {
                    // Once the request head is written, the upstream may
                    // have acted on it: never send it a second time.
                    if reused && !sent && attempt == 1 {
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

    /// Returns a connection whose response was read to the end to the
    /// pool, unless its request was not written whole (see [`Sent`]); it is
    /// idle since `finished`, when the upstream ended its answer (its own
    /// idle clock starts there).
    pub async fn release(&self, sent: Sent, finished: Instant) {
        let Sent {
            mut session,
            reusable,
            after_bodiless,
        } = sent;
        if !reusable {
            // Closed: the upstream may still read the rest of the old
            // request from it, or the next request as the old one's body.
            session.shutdown().await;
            return;
        }
        session.respect_keepalive();
        let kept = kept_idle(session.resp_header(), self.timeouts.idle);
        if finished.elapsed() >= kept {
            session.shutdown().await;
            return;
        }
        let bodiless = session
            .resp_header()
            .is_some_and(|head| headers::bodiless(head.status));
        if let Some(stream) = session.reuse().await {
            self.idle
                .put(stream, finished, kept, after_bodiless || bodiless);
        }
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

/// How long a connection whose answer had `head` may wait idle in the
/// pool: `pool`, or less when the upstream announces it closes idle
/// connections sooner (`Keep-Alive: timeout=N`, as Node.js sends with
/// its 5 s default): a second under that, since the upstream may close it
/// just as the next request is written. Zero: not kept.
fn kept_idle(head: Option<&ResponseHeader>, pool: Duration) -> Duration {
    let announced = head
        .and_then(|head| head.headers.get("keep-alive"))
        .and_then(|value| value.to_str().ok())
        .and_then(|value| {
            value.split(',').find_map(|param| {
                let (name, seconds) = param.split_once('=')?;
                name.trim()
                    .eq_ignore_ascii_case("timeout")
                    .then(|| seconds.trim().parse::<u64>().ok())?
            })
        });
    match announced {
        Some(seconds) => pool.min(Duration::from_secs(seconds.saturating_sub(1))),
        None => pool,
    }
}

/// When the upstream's idle clock for a connection started, at the latest:
/// now, less the time the relay of its answer spent waiting for the client
/// (`waited`), during which the upstream may have written all of it. A
/// slow client's answer so never makes its connection look younger than
/// the upstream sees it ([`KEYED_MAX_IDLE`]).
pub fn idle_since(waited: Duration) -> Instant {
    let now = Instant::now();
    now.checked_sub(waited).unwrap_or(now)
}

/// The most idle connections kept (Pingora's own pool keeps 128).
const POOL_SIZE: usize = 128;

/// The most idle connections marked [`Idle::after_bodiless`] kept.
const MARKED_KEPT: usize = 16;

/// The longest a pooled connection may have been idle to carry a request a
/// key rides on ([`Check::Kernel`]); an older one is left to others, and
/// the key's request opens a new connection. An upstream that closes idle
/// connections without announcing when (uvicorn and hypercorn after 5 s,
/// gunicorn after 2 s, Node after 5 s) may close one just as a request is
/// written on it: the request was never read, but the failure after the
/// write keeps the key's outcome unknown (502) for good. Below the
/// shortest such timeout in common use (a second: uvicorn or gunicorn set
/// to `1`), with room for the latency by which the proxy's idle clock
/// starts later than the upstream's, that close never crosses a keyed
/// request; busy connections are reused within it anyway.
const KEYED_MAX_IDLE: Duration = Duration::from_millis(500);

/// Idle upstream connections, the most recently used first out.
///
/// Pingora's pool watches each idle connection with a task of its own and
/// hands it over through that task (a spawn, a channel, a lock and two task
/// wake-ups per request); this one is a list under a lock held for a push
/// or a pop. An idle connection is checked when it is taken instead: one
/// older than the idle timeout is closed, and one the upstream closed (or
/// that has unexpected bytes waiting) is dropped and the next one tried.
#[derive(Default)]
struct Pool {
    idle: Mutex<IdleList>,
}

/// The idle connections, oldest first, and how many of them are marked
/// [`Idle::after_bodiless`] (kept beside the list, so that neither a take
/// nor a put scans it while none is).
#[derive(Default)]
struct IdleList {
    entries: Vec<Idle>,
    marked: usize,
}

impl IdleList {
    fn push(&mut self, entry: Idle) {
        self.marked += usize::from(entry.after_bodiless);
        self.entries.push(entry);
    }

    fn remove(&mut self, at: usize) -> Idle {
        let entry = self.entries.remove(at);
        self.marked -= usize::from(entry.after_bodiless);
        entry
    }

    /// Where the newest unmarked connection idle for less than `young`
    /// is (entries are in the order they were put back, which is not
    /// always the order they went idle in: each is looked at).
    fn newest_unmarked_within(&self, young: Duration) -> Option<usize> {
        self.entries
            .iter()
            .rposition(|entry| !entry.after_bodiless && entry.since.elapsed() < young)
    }

    /// Where the newest marked connection is, else the newest.
    fn newest_marked_first(&self) -> Option<usize> {
        match self.marked {
            0 => None,
            _ => self.entries.iter().rposition(|entry| entry.after_bodiless),
        }
        .or_else(|| self.entries.len().checked_sub(1))
    }

    /// Where the oldest marked connection is, else the oldest.
    fn oldest_marked_first(&self) -> usize {
        match self.marked {
            0 => 0,
            _ => self
                .entries
                .iter()
                .position(|entry| entry.after_bodiless)
                .unwrap_or(0),
        }
    }
}

/// A pooled connection: since when it is idle, for how long it may be,
/// and whether its last answer was a 204 or 304.
struct Idle {
    stream: Stream,
    since: Instant,
    max_idle: Duration,
    /// A 204 or 304 ends at its head, so a body its upstream writes after
    /// it anyway, later than the check when the connection is taken, is
    /// read as the answer to the next request on it: that of another
    /// client. Such a connection never carries a request a key rides on
    /// ([`Check::Kernel`]): there the stray bytes would be stored as that
    /// key's outcome and replayed for its TTL. Uncovered requests still
    /// take it, and the mark stays for good: once stray bytes were read as
    /// an answer, that answer's own bytes may wait on it for the next.
    after_bodiless: bool,
}

impl Idle {
    fn expired(&self) -> bool {
        self.since.elapsed() > self.max_idle
    }
}

impl Pool {
    /// The newest idle connection still open and within its idle time,
    /// if there is one, and whether it is marked
    /// [`after_bodiless`](Idle::after_bodiless). A request a key rides on
    /// ([`Check::Kernel`]) skips the marked ones and leaves them to
    /// others, which take the newest marked one first (so the unmarked stay
    /// for keyed requests, and the marked do not sit idle).
    ///
    /// A keyed request takes none idle for [`KEYED_MAX_IDLE`] or longer.
    fn take(&self, check: Check) -> Option<(Stream, bool)> {
        loop {
            let mut idle = {
                let mut idle = self.lock();
                let at = match check {
                    Check::Kernel => idle.newest_unmarked_within(KEYED_MAX_IDLE)?,
                    Check::Seen => idle.newest_marked_first()?,
                };
                idle.remove(at)
            };
            if !idle.expired() && still_open(&mut idle.stream, check) {
                return Some((idle.stream, idle.after_bodiless));
            }
        }
    }

    /// Keeps a connection whose exchange ended cleanly, idle since
    /// `since`, for up to `max_idle` (`after_bodiless`: see [`Idle`]);
    /// past [`POOL_SIZE`], or past [`MARKED_KEPT`] marked ones, the oldest
    /// marked one is closed (else the oldest): a keyed API answering 204
    /// does not fill the pool with connections only others may use.
    fn put(&self, stream: Stream, since: Instant, max_idle: Duration, after_bodiless: bool) {
        let closed = {
            let mut idle = self.lock();
            idle.push(Idle {
                stream,
                since,
                max_idle,
                after_bodiless,
            });
            (idle.entries.len() > POOL_SIZE || idle.marked > MARKED_KEPT).then(|| {
                let at = idle.oldest_marked_first();
                idle.remove(at)
            })
        };
        drop(closed);
    }

    /// Closes, from a thread of its own, the idle connections past their
    /// idle time or closed by the upstream, so that a quiet proxy holds
    /// none for long; the thread ends with the pool. It looks every half
    /// of `max_idle` (the pool's own idle timeout).
    fn sweep_every(pool: std::sync::Weak<Pool>, max_idle: Duration) {
        let interval = (max_idle / 2).clamp(Duration::from_millis(100), Duration::from_secs(5));
        let sweeper = std::thread::Builder::new()
            .name("upstream-idle".into())
            .spawn(move || loop {
                std::thread::sleep(interval);
                let Some(pool) = pool.upgrade() else { return };
                let mut closed = Vec::new();
                {
                    let mut idle = pool.lock();
                    let mut index = 0;
                    while index < idle.entries.len() {
                        let entry = &mut idle.entries[index];
                        if entry.expired() || !still_open(&mut entry.stream, Check::Kernel) {
                            closed.push(idle.remove(index));
                        } else {
                            index += 1;
                        }
                    }
                }
                drop(closed);
            });
        if let Err(error) = sweeper {
            tracing::warn!(%error, "no idle upstream connection sweeper");
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, IdleList> {
        self.idle.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// How an idle connection is checked before it carries a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Check {
    /// What the runtime has seen of the socket, without a system call: a
    /// close that reached the kernel but not yet the runtime's I/O driver
    /// (a busy runtime turns it between tasks) goes unseen, and the
    /// request then fails as on a connection the upstream closed just as
    /// it was written. For requests no key rides on.
    Seen,
    /// The kernel asked too (`recv` with `MSG_PEEK`, one system call):
    /// for a request whose key a failure after the write would keep as
    /// "outcome unknown", although the upstream closed the connection
    /// before the request reached it.
    Kernel,
}

/// Whether an idle connection can carry a request: nothing to read yet
/// (a read would block). End of stream means the upstream closed it; bytes
/// waiting on an idle connection are not an answer to anything.
fn still_open(stream: &mut Stream, check: Check) -> bool {
    use std::future::Future;
    use std::task::{Context, Waker};
    use tokio::io::AsyncReadExt;
    let mut byte = [0u8; 1];
    // Outside tokio's cooperative budget: a ready read must never look
    // pending because the task used up its budget. This also sees bytes
    // the stream holds itself, which the kernel no longer has.
    let mut read = std::pin::pin!(tokio::task::unconstrained(stream.read(&mut byte)));
    let pending = read
        .as_mut()
        .poll(&mut Context::from_waker(Waker::noop()))
        .is_pending();
    pending && (check == Check::Seen || !kernel_readable(stream))
}

/// Whether the kernel has anything for a read of `stream` (bytes, its
/// peer's close, an error) right now, without waiting or consuming it.
#[allow(unsafe_code)]
fn kernel_readable(stream: &Stream) -> bool {
    // Pingora's streams are identified by their socket's descriptor.
    let fd = pingora_core::protocols::UniqueID::id(&**stream);
    if fd <= 0 {
        // No socket of its own (Pingora's virtual streams say -1, its mocks
        // 0, which is stdin): what the runtime saw is all there is to know.
        return false;
    }
    let mut byte = 0u8;
    // SAFETY: `fd` is the open socket `stream` owns, borrowed for the
    // whole call; the buffer is one writable byte; `MSG_PEEK` leaves what
    // is read in the socket and `MSG_DONTWAIT` makes the call return at
    // once.
    let read = unsafe {
        libc::recv(
            fd,
            std::ptr::from_mut(&mut byte).cast(),
            1,
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    };
    read >= 0 || std::io::Error::last_os_error().kind() != std::io::ErrorKind::WouldBlock
}

const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");

impl Upstream {
    /// Sends the request on `stream` and reads the response head. An error
    /// says whether the request head had been written whole (`true`) when
    /// it happened.
    ///
    /// Head and body go out in one write (two system calls and two
    /// wake-ups of the upstream became one); a HEAD request is written by
    /// Pingora's session, which must know the method to read an answer
    /// without a body.
    async fn exchange_head(
        &self,
        mut stream: Stream,
        request: &RequestHeader,
        body: &Bytes,
        deadline: Option<tokio::time::Instant>,
    ) -> Result<Sent, (bool, Box<Error>)> {
        let session = |stream| {
            let mut session = HttpSession::new_with_options(stream, &self.peer);
            session.read_timeout = Some(self.timeouts.read);
            session.write_timeout = Some(self.timeouts.write);
            session
        };
        if request.method == Method::HEAD {
            let mut session = session(stream);
            session
                .write_request_header(Box::new(request.clone()))
                .await
                .map_err(|error| (false, error))?;
            // A HEAD may carry a body (its head says how long): it is
            // written too, or the upstream would read the next request as
            // its rest. The connection is never reused after a HEAD: an
            // answer is read as bodiless whatever the upstream sends after
            // its head, and bytes it sends late would be read as the next
            // request's answer.
            let written = match body.is_empty() {
                true => Ok(None),
                false => session.write_body(body).await,
            };
            let finished = written.and(session.finish_body().await);
            return match read_head(&mut session, deadline).await {
                Ok(()) => Ok(Sent {
                    session,
                    reusable: false,
                    after_bodiless: false,
                }),
                Err(error) => Err((true, finished.err().unwrap_or(error))),
            };
        }
        let mut wire = http_req_header_to_wire(request).ok_or_else(|| {
            (
                false,
                Error::explain(
                    ErrorType::InvalidHTTPHeader,
                    "the request line has a forbidden byte",
                ),
            )
        })?;
        let head_length = wire.len();
        // A large body is written after the head rather than copied.
        let rest: &[u8] = if body.len() <= COPIED_BODY_BYTES {
            wire.extend_from_slice(body);
            &[]
        } else {
            body
        };
        let mut written = 0;
        let write = write_request(&mut stream, &wire, rest, &mut written);
        let result = match tokio::time::timeout(self.timeouts.write, write).await {
            Ok(result) => result,
            Err(_) => Err(Error::explain(
                ErrorType::WriteTimedout,
                "while writing the request (timeout)",
            )),
        };
        // The head is on the wire: the upstream may act on it alone (a
        // handler that ignores the body answers and closes the connection,
        // unread body and all), so from here on the request counts as sent.
        let sent = written >= head_length;
        let mut session = session(stream);
        match result {
            Ok(()) => read_head(&mut session, deadline)
                .await
                .map(|()| {
                    let reusable = framed_cleanly(&session, &request.method, !body.is_empty());
                    Sent {
                        session,
                        reusable,
                        after_bodiless: false,
                    }
                })
                .map_err(|error| (true, error)),
            Err(error) if !sent => Err((false, error)),
            // An upstream that answered before reading the body: its
            // answer, if it reached us, is the response; the connection,
            // with part of the body unwritten, is never reused.
            Err(error) => match read_head(&mut session, deadline).await {
                Ok(()) => Ok(Sent {
                    session,
                    reusable: false,
                    after_bodiless: false,
                }),
                Err(_) => Err((true, error)),
            },
        }
    }
}

/// A request on its way: the upstream session with the response head read,
/// and whether the connection may carry another request once the response
/// is read to the end. It may not when the request was not written whole
/// (the upstream answered first): the upstream could read the next request
/// as the rest of this one's body.
pub struct Sent {
    session: HttpSession,
    reusable: bool,
    /// The connection came from the pool marked [`Idle::after_bodiless`]:
    /// the mark stays with it (stray bytes read as this answer may leave
    /// the next answer's bytes on it).
    after_bodiless: bool,
}

impl std::ops::Deref for Sent {
    type Target = HttpSession;

    fn deref(&self) -> &HttpSession {
        &self.session
    }
}

impl std::ops::DerefMut for Sent {
    fn deref_mut(&mut self) -> &mut HttpSession {
        &mut self.session
    }
}

/// Bodies up to this size are copied behind the request head and written
/// with it.
const COPIED_BODY_BYTES: usize = 64 * 1024;

/// Writes `wire` then `rest`, counting in `written` the bytes of `wire`
/// that went out.
async fn write_request(
    stream: &mut Stream,
    wire: &[u8],
    rest: &[u8],
    written: &mut usize,
) -> Result<(), Box<Error>> {
    use tokio::io::AsyncWriteExt;
    let failed = |e| Error::because(ErrorType::WriteError, "while writing the request", e);
    while *written < wire.len() {
        match stream.write(&wire[*written..]).await {
            Ok(0) => {
                return Err(Error::explain(
                    ErrorType::WriteError,
                    "the upstream connection closed while writing the request",
                ))
            }
            Ok(n) => *written += n,
            Err(e) => return Err(failed(e)),
        }
    }
    if !rest.is_empty() {
        stream.write_all(rest).await.map_err(failed)?;
    }
    stream.flush().await.map_err(failed)
}

/// Whether the answer just read leaves the connection at a clean request
/// boundary once its body is read, so the next request's answer cannot
/// begin with bytes of this one. Not when a bodiless status (204, 304)
/// declares a body anyway (a `Content-Length` other than 0, even on a 304,
/// where it may describe the representation; or `Transfer-Encoding`): it
/// is read as bodiless, and the body the upstream may still send would be
/// read as the next answer. Not after an
/// error status to a request with a body: an upstream that refused early
/// (401, 413) may not have read the body, and would read it as the next
/// request. Nor after a request that said `close` ([`closes_connection`]:
/// a body the upstream may have ignored, its answer to a request smuggled
/// in it waiting for the next client on the connection). Nor after an
/// answer with both `Transfer-Encoding` and `Content-Length`: read as
/// chunked here, it may have been framed by its length on the way (an
/// intermediary in front of the upstream), and RFC 9112 (6.3) says such a
/// connection must not be reused.
fn framed_cleanly(session: &HttpSession, method: &http::Method, had_body: bool) -> bool {
    let Some(head) = session.resp_header() else {
        return false;
    };
    // Pingora drops the `Content-Length` from such a head: read the raw one.
    if head.headers.contains_key(header::TRANSFER_ENCODING) {
        let raw = session.get_headers_raw_bytes();
        // `Content-Length :` too: Pingora reads names with spaces after.
        let lengths = raw.split(|&b| b == b'\n').any(|line| {
            let name = line.split(|&b| b == b':').next().unwrap_or_default();
            line.contains(&b':') && name.trim_ascii().eq_ignore_ascii_case(b"content-length")
        });
        if lengths {
            return false;
        }
    }
    let status = head.status;
    if had_body && (status.is_client_error() || status.is_server_error()) {
        return false;
    }
    if closes_connection(method, had_body) {
        return false;
    }
    !(headers::bodiless(status) && declares_body(head))
}

/// Whether a request leaves its connection unusable whatever the answer:
/// a `HEAD` (see [`Upstream::exchange_head`]), or a body sent with a method
/// whose requests rarely carry one (`GET`, `DELETE`, …: anything but
/// `POST`, `PUT` and `PATCH`), which handlers ignore. Such a request is
/// sent saying `Connection: close`: not pooling the connection afterwards
/// is not enough, for a server that does not skip what it did not read
/// (Python's `http.server`) has the body in its buffer already and would
/// run it as a request of the client's making, past every rule of the
/// proxy (a covered `POST` under a key already stored, executed again).
/// `close` tells it to read no further request on the connection.
fn closes_connection(method: &Method, has_body: bool) -> bool {
    *method == Method::HEAD
        || (has_body && ![Method::POST, Method::PUT, Method::PATCH].contains(method))
}

/// Whether a head's framing announces bytes after it: `Transfer-Encoding`,
/// or a `Content-Length` other than 0.
fn declares_body(head: &ResponseHeader) -> bool {
    head.headers.contains_key(header::TRANSFER_ENCODING)
        || head
            .headers
            .get(header::CONTENT_LENGTH)
            .is_some_and(|length| length.as_bytes() != b"0")
}

/// Reads the response head, skipping interim responses (100 Continue, 103
/// Early Hints, 102 Processing), until `deadline`: an upstream that sends
/// interim answers for good passes every `read_timeout`. An interim answer
/// that declares a body is an error: what follows it is no answer to
/// trust. So is a 101: these requests never ask for an upgrade (RFC 9110,
/// 15.2.2, forbids it then), and taken as the final answer it would have
/// released the key of a request the upstream received, to run again.
async fn read_head(
    session: &mut HttpSession,
    deadline: Option<tokio::time::Instant>,
) -> Result<(), Box<Error>> {
    let read = async {
        loop {
            session.read_response().await?;
            let Some(head) = session.resp_header() else {
                return Ok(());
            };
            if head.status == http::StatusCode::SWITCHING_PROTOCOLS {
                return Error::e_explain(
                    ErrorType::InvalidHTTPHeader,
                    "the upstream switched protocols (101) for a request that asked for no upgrade",
                );
            }
            if !head.status.is_informational() {
                return Ok(());
            }
            // A 1xx has no content (RFC 9110, 15.2): bytes it announces
            // would be read here as the final answer.
            if declares_body(head) {
                return Error::e_explain(
                    ErrorType::InvalidHTTPHeader,
                    "the upstream's interim (1xx) answer declares a body",
                );
            }
        }
    };
    let Some(deadline) = deadline else {
        return read.await;
    };
    match tokio::time::timeout_at(deadline, read).await {
        Ok(read) => read,
        Err(_) => Error::e_explain(
            ErrorType::ReadTimedout,
            "no answer within the route's execution_timeout",
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn timeouts() -> Timeouts {
        let second = Duration::from_secs(1);
        Timeouts {
            connect: second,
            read: second,
            write: second,
            idle: second,
        }
    }

    /// An idle upstream connection the upstream closed (uvicorn after 5 s
    /// idle, Go's `IdleTimeout`) while the runtime's I/O driver has not
    /// turned since: the runtime has not seen the close, and a request
    /// sent on it fails after its write, which keeps a reserved key's
    /// outcome unknown (502 replayed for good) although the upstream never
    /// read it. The kernel knows: a reserved request's check asks it. So
    /// does it for bytes waiting on the connection, which are no answer.
    #[test]
    fn a_close_the_runtime_has_not_seen_yet_is_found_by_asking_the_kernel() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        for stray in [None, Some(&b"HTTP/1.1 200 OK\r\n"[..])] {
            let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            let client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
            let (mut server, _) = listener.accept().unwrap();
            client.set_nonblocking(true).unwrap();
            let mut stream = runtime.block_on(async { l4(client) });
            // The driver last turned before the close: nothing awaited since.
            match stray {
                None => drop(server),
                Some(bytes) => std::io::Write::write_all(&mut server, bytes).unwrap(),
            }
            std::thread::sleep(Duration::from_millis(50));
            let _entered = runtime.enter();
            assert!(
                !still_open(&mut stream, Check::Kernel),
                "{stray:?}: the kernel's answer was not asked for"
            );
        }
    }

    /// `client` as the proxy's upstream streams are (in a runtime).
    fn l4(client: std::net::TcpStream) -> Stream {
        let tcp = tokio::net::TcpStream::from_std(client).unwrap();
        Box::new(pingora_core::protocols::l4::stream::Stream::from(tcp))
    }

    /// Open loopback connections as the pool holds them (in a runtime),
    /// their server ends kept open while this lives.
    struct Connections {
        listener: std::net::TcpListener,
        servers: Vec<std::net::TcpStream>,
    }

    impl Connections {
        fn new() -> Self {
            Connections {
                listener: std::net::TcpListener::bind("127.0.0.1:0").unwrap(),
                servers: Vec::new(),
            }
        }

        fn open(&mut self) -> Stream {
            let client = std::net::TcpStream::connect(self.listener.local_addr().unwrap()).unwrap();
            self.servers.push(self.listener.accept().unwrap().0);
            client.set_nonblocking(true).unwrap();
            l4(client)
        }
    }

    /// The pool's count of marked connections stays the count of its
    /// marked entries through puts past both caps and takes of both kinds,
    /// and each take picks as the rules say: a keyed request never a
    /// marked connection, another the newest marked one while there is one.
    #[test]
    fn the_marked_count_follows_the_list_through_puts_and_takes() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let _entered = runtime.enter();
        let mut connections = Connections::new();
        let pool = Pool::default();
        let recount = |pool: &Pool| {
            let idle = pool.lock();
            let marked = idle.entries.iter().filter(|e| e.after_bodiless).count();
            (idle.marked, marked, idle.entries.len())
        };
        // A deterministic mix: runs of marked and unmarked puts, with takes.
        for step in 0u32..160 {
            let mark = (step / 7) % 3 == 0;
            let minute = Duration::from_secs(60);
            pool.put(connections.open(), Instant::now(), minute, mark);
            if step % 5 == 4 {
                let (kept, _, _) = recount(&pool);
                let had_unmarked = recount(&pool).2 > kept;
                match pool.take(Check::Kernel) {
                    Some((_, marked)) => {
                        assert!(!marked, "step {step}: a keyed take got a marked one")
                    }
                    None => assert!(!had_unmarked, "step {step}: an unmarked one was left"),
                }
            }
            if step % 6 == 5 {
                let had_marked = recount(&pool).0 > 0;
                let (_, marked) = pool.take(Check::Seen).expect("the pool is not empty");
                assert_eq!(
                    marked, had_marked,
                    "step {step}: the newest marked one first"
                );
            }
            let (kept, counted, len) = recount(&pool);
            assert_eq!(
                kept, counted,
                "step {step}: the count drifted from the list"
            );
            assert!(
                len <= POOL_SIZE && counted <= MARKED_KEPT,
                "step {step}: {len}, {counted}"
            );
        }
    }

    /// A keyed take skips a connection idle for [`KEYED_MAX_IDLE`] or
    /// longer wherever it sits (put back after a younger one: put-back
    /// order is not idle order), takes the younger one, and with only old
    /// ones left opens a new connection (`None`); an unkeyed take still
    /// uses the old one.
    #[test]
    fn a_keyed_take_skips_connections_idle_too_long_wherever_they_sit() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let _entered = runtime.enter();
        let mut connections = Connections::new();
        let pool = Pool::default();
        let minute = Duration::from_secs(60);
        let old = Instant::now() - KEYED_MAX_IDLE - Duration::from_millis(100);
        pool.put(connections.open(), Instant::now(), minute, false);
        pool.put(connections.open(), old, minute, false);
        assert!(
            pool.take(Check::Kernel).is_some(),
            "the younger one is taken"
        );
        assert_eq!(pool.lock().entries.len(), 1, "the old one is left");
        assert!(
            pool.take(Check::Kernel).is_none(),
            "only an old one: a new connection"
        );
        assert!(
            pool.take(Check::Seen).is_some(),
            "unkeyed requests still use it"
        );
    }

    /// An open idle connection with nothing on it passes either check.
    #[test]
    fn an_open_idle_connection_passes_both_checks() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (_server, _) = listener.accept().unwrap();
        client.set_nonblocking(true).unwrap();
        let _entered = runtime.enter();
        let mut stream = l4(client);
        assert!(still_open(&mut stream, Check::Seen));
        assert!(still_open(&mut stream, Check::Kernel));
    }

    /// A bad `--upstream` is refused with what to change; credentials in
    /// it (which would be logged and sent as `Host`) are refused too.
    #[test]
    fn a_bad_upstream_url_is_refused_saying_why() {
        for (url, expected) in [
            ("http://user:secret@127.0.0.1:8081", "credentials"),
            ("http://user:secret@127.0.0.1:8081/app", "credentials"),
            ("https://127.0.0.1:8081", "plain http://"),
            ("http://127.0.0.1:8081/app", "must not have a path"),
            ("127.0.0.1:8081", "must start with http://"),
        ] {
            let error = Upstream::new(url, timeouts()).err().expect(url);
            assert!(error.contains(expected), "{url}: {error}");
            assert!(
                !error.contains("secret"),
                "{url}: the password is repeated: {error}"
            );
        }
        assert!(Upstream::new("http://127.0.0.1:8081", timeouts()).is_ok());
    }

    /// `Keep-Alive: timeout=N` shortens how long a connection is pooled,
    /// to a second under N; malformed values leave the pool's own.
    #[test]
    fn an_announced_keep_alive_timeout_shortens_the_pool_time() {
        let pool = Duration::from_secs(60);
        let head = |value: &str| {
            let mut head = ResponseHeader::build(200, None).unwrap();
            head.insert_header("keep-alive", value).unwrap();
            head
        };
        assert_eq!(kept_idle(None, pool), pool);
        assert_eq!(
            kept_idle(Some(&head("timeout=5")), pool),
            Duration::from_secs(4)
        );
        assert_eq!(
            kept_idle(Some(&head("max=100, timeout=5")), pool),
            Duration::from_secs(4)
        );
        assert_eq!(kept_idle(Some(&head("timeout=1")), pool), Duration::ZERO);
        assert_eq!(kept_idle(Some(&head("timeout=600")), pool), pool);
        assert_eq!(kept_idle(Some(&head("timeout=soon")), pool), pool);
    }
}
