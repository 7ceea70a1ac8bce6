//! Header hygiene: which headers belong to one connection and never travel
//! further, which are never stored for a replay, and which name another
//! path for the backend. The engine (storing a response, routing a
//! request) and the proxy (forwarding a buffered request, relaying a
//! response head) both ask here, so the rules exist once.
//!
//! Depends on the crate's readings of requests (`formats`, `policy`) only.

use http::{header, HeaderMap, HeaderName, HeaderValue};

use crate::formats::{self, PathHeader};
use crate::policy::RoutePolicy;

/// The headers that describe one connection rather than the message
/// (RFC 9110, section 7.6.1): `Connection` and the legacy `Keep-Alive` and
/// `Proxy-Connection`. Never relayed, never stored.
const CONNECTION_SCOPED: [HeaderName; 3] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
];

/// Request headers that frame or extend one hop's message: a request whose
/// body was buffered is framed again (`Content-Length`) by whoever sends it
/// on, so these are never forwarded with it. `Expect` is answered by the hop
/// that buffered the body.
const HOP_FRAMING: [HeaderName; 5] = [
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
    header::EXPECT,
];

/// The header names listed in `Connection` (RFC 9110, section 7.6.1): they
/// belong to this connection only. Unparsable names are skipped.
pub fn connection_listed(headers: &HeaderMap) -> Vec<HeaderName> {
    headers
        .get_all(header::CONNECTION)
        .iter()
        // Read as bytes: a line with one byte that is not UTF-8 still names
        // the others (read as text, the whole line was skipped, and the
        // headers it listed were relayed and stored).
        .flat_map(|value| value.as_bytes().split(|&b| b == b','))
        .filter_map(|name| HeaderName::from_bytes(name.trim_ascii()).ok())
        .collect()
}

/// Whether a comma-separated coding header (`Transfer-Encoding`,
/// `Content-Encoding`) lists any coding other than `allowed`, in any case
/// and repetition of the header.
pub fn lists_coding_other_than(headers: &HeaderMap, name: &HeaderName, allowed: &[u8]) -> bool {
    headers
        .get_all(name)
        .iter()
        .flat_map(|value| value.as_bytes().split(|&b| b == b','))
        .map(<[u8]>::trim_ascii)
        .any(|coding| !coding.is_empty() && !coding.eq_ignore_ascii_case(allowed))
}

/// Whether a response with `status` has no body whatever its head says
/// (RFC 9110, 6.4.1): a 1xx, 204 or 304. Its `Content-Length`, if any,
/// never frames bytes (a 304's describes the resource).
pub fn bodiless(status: http::StatusCode) -> bool {
    status.is_informational()
        || status == http::StatusCode::NO_CONTENT
        || status == http::StatusCode::NOT_MODIFIED
}

/// The length a head's `Content-Length` declares: `None` without one,
/// when its lines and the items of a comma-separated line (`5, 5`, which
/// RFC 9110, 8.6, lets a recipient read as 5, as hyper and Pingora do) do
/// not all state the same number in digits, or beside a
/// `Transfer-Encoding`, which frames the body instead (RFC 9112, 6.3).
pub fn content_length(headers: &HeaderMap) -> Option<u64> {
    if headers.contains_key(header::TRANSFER_ENCODING) {
        return None;
    }
    let mut declared = None;
    for value in headers.get_all(header::CONTENT_LENGTH) {
        for item in value.as_bytes().split(|&byte| byte == b',') {
            let digits = item.trim_ascii();
            if digits.is_empty() || !digits.iter().all(u8::is_ascii_digit) {
                return None;
            }
            let length = std::str::from_utf8(digits).ok()?.parse::<u64>().ok()?;
            if declared.is_some_and(|known| known != length) {
                return None;
            }
            declared = Some(length);
        }
    }
    declared
}

/// The request headers not forwarded with a buffered body: the connection
/// headers, the framing headers (`TE`, `Trailer`, `Transfer-Encoding`,
/// `Upgrade`, `Expect`), and every header `Connection` lists except
/// `Host`, `Content-Type`, `Content-Encoding`, the method-override headers (`X-HTTP-Method-Override`, `X-HTTP-Method`, `X-Method-Override`) and the path headers ([`path_readings`]). The
/// caller removes them (and sets `Content-Length` for the body it sends).
///
/// Those say how to read the body and which method it is: the engine read
/// the key, the method a `POST` names and the fingerprint by them, so the
/// upstream must get them too (a client listing `Connection: content-type` would
/// otherwise have a form read as JSON here and as a form there, as Rack
/// reads a body without a type). nginx forwards them likewise.
pub fn not_forwarded(request: &HeaderMap) -> Vec<HeaderName> {
    not_forwarded_unless(request, |_| false)
}

/// [`not_forwarded`] for a request `policy` covers: the headers its route
/// reads requests by ([`RoutePolicy::reads_header`]: the key's, the
/// principal's, the scope and fingerprint headers) are forwarded too,
/// whatever `Connection` lists, so the upstream runs the request as the
/// identity the engine scoped it by (a client listing `Connection:
/// authorization` would otherwise have its order scoped as one user and
/// run with no credential).
pub fn not_forwarded_for(request: &HeaderMap, policy: &RoutePolicy) -> Vec<HeaderName> {
    not_forwarded_unless(request, |name| policy.reads_header(name))
}

fn not_forwarded_unless(
    request: &HeaderMap,
    read: impl Fn(&HeaderName) -> bool,
) -> Vec<HeaderName> {
    // `Host` too: the scope's host is read from it (RFC 9110, 7.6.1: a
    // proxy must not drop it for a `Connection` listing).
    const READ_BY_THE_ENGINE: [HeaderName; 3] =
        [header::CONTENT_TYPE, header::CONTENT_ENCODING, header::HOST];
    let mut names: Vec<HeaderName> = CONNECTION_SCOPED
        .iter()
        .chain(&HOP_FRAMING)
        .cloned()
        .collect();
    names.extend(
        connection_listed(request)
            .into_iter()
            .filter(|name| !READ_BY_THE_ENGINE.contains(name) && !read(name))
            .filter(|name| !formats::method_override(name))
            // Nor the path headers the engine routed by (`path_readings`).
            .filter(|name| formats::path_header(name).is_none())
            .filter(|name| !CONNECTION_SCOPED.contains(name) && !HOP_FRAMING.contains(name)),
    );
    names
}

/// The paths a backend may route a request by besides its target's
/// `path`, read from headers that servers and frameworks take from a
/// trusted proxy: `SCRIPT_NAME` (gunicorn sets WSGI's `SCRIPT_NAME` from a
/// header so named, trusting a proxy on `127.0.0.1` by default, and
/// Django and Flask route by the rest of the path), `X-Script-Name` (the
/// Flask `ReverseProxied` recipe) and `X-Forwarded-Prefix` each strip
/// their value from the front of the path; `PATH_INFO`, `X-Original-Url`
/// (Zend, older Symfony) and `X-Rewrite-Url` (Yii) name the path itself.
/// Names match with `-` or `_`. The engine covers a request when any
/// reading is covered (a mount behind a front proxy that sets them keeps
/// working: they are forwarded as they came). Empty, with no allocation,
/// for a request without such a header.
///
/// Each is read as backends read it: its first and its last line, and its
/// lines joined by `,` (as gunicorn joins them); a prefix cut from the path
/// as sent and as decoded (WSGI's `PATH_INFO` is decoded, and the Flask
/// recipe cuts from it), without regard to a `/` after it (gunicorn cuts
/// `/a` from `/acontact`, and Werkzeug routes the rest as `/contact`); a
/// named path with its `scheme://authority` dropped (zend-http drops it).
/// At most three values of each of the six names, whatever their
/// spellings, each read two ways at most: a request cannot ask for more
/// than 36 readings.
pub fn path_readings(request: &HeaderMap, path: &str) -> Vec<String> {
    let mut readings: Vec<String> = Vec::new();
    let mut add = |routed: String| {
        if routed != path && !readings.contains(&routed) {
            readings.push(routed);
        }
    };
    // Every line of each name, whatever its spelling (`script_name` and
    // `script-name` are one variable to a WSGI server), in order.
    let mut lines: [(Option<PathHeader>, Vec<&str>); formats::PATH_HEADERS] = Default::default();
    for (name, value) in request {
        let Some((kind, at)) = formats::path_header(name) else {
            continue;
        };
        if let Ok(value) = std::str::from_utf8(value.as_bytes()) {
            lines[at].0 = Some(kind);
            lines[at].1.push(value);
        }
    }
    // The path as decoded, once, for the prefix headers.
    let mut decoded = None;
    for (kind, lines) in &lines {
        let Some(kind) = kind else {
            continue;
        };
        let mut values: Vec<std::borrow::Cow<'_, str>> = Vec::new();
        if let (Some(first), Some(last)) = (lines.first(), lines.last()) {
            values.push((*first).into());
            if lines.len() > 1 {
                values.push((*last).into());
                values.push(lines.join(",").into());
            }
        }
        for value in &values {
            let value = value.trim();
            match kind {
                PathHeader::Prefix => {
                    let prefix = value.trim_end_matches('/');
                    if prefix.is_empty() {
                        continue;
                    }
                    let decoded =
                        decoded.get_or_insert_with(|| crate::policy::normalize_path(path, false));
                    for spelled in [path, &**decoded] {
                        if let Some(rest) = spelled.strip_prefix(prefix) {
                            add(format!("/{}", rest.trim_start_matches('/')));
                        }
                    }
                }
                PathHeader::Whole => {
                    let whole = without_authority(value);
                    let whole = whole.split(['?', '#']).next().unwrap_or_default();
                    if whole.starts_with('/') {
                        add(whole.to_owned());
                    }
                }
            }
        }
    }
    readings
}

/// `value` without a leading `scheme://authority` (`http://h/contact` is
/// `/contact`; `http://h` is `/`).
fn without_authority(value: &str) -> &str {
    let Some(at) = value.find("://") else {
        return value;
    };
    let scheme = &value[..at];
    if scheme.is_empty()
        || !scheme
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"+-.".contains(&b))
    {
        return value;
    }
    let rest = &value[at + 3..];
    rest.find('/').map_or("/", |i| &rest[i..])
}

/// The response headers not relayed to the client: the connection headers
/// and every header `Connection` lists. Framing (`Transfer-Encoding`,
/// `Content-Length`) is left to the server that writes the response.
pub fn not_relayed(response: &HeaderMap) -> Vec<HeaderName> {
    let mut names = CONNECTION_SCOPED.to_vec();
    names.extend(connection_listed(response));
    names
}

/// Whether a response header is never stored for a replay, whatever it
/// names: hop-by-hop headers, credentials, `Date` and `Content-Length`
/// (set again on replay), `Idempotent-Replayed` (added by the replay), and
/// `Set-Cookie` unless `replay_set_cookie`.
pub fn never_stored(name: &HeaderName, replay_set_cookie: bool) -> bool {
    matches!(
        name.as_str(),
        "connection"
            | "keep-alive"
            | "proxy-connection"
            | "transfer-encoding"
            | "te"
            | "trailer"
            | "upgrade"
            | "proxy-authenticate"
            | "proxy-authorization"
            | "authorization"
            | "cookie"
            | "date"
            | "content-length"
            | "idempotent-replayed"
    ) || (!replay_set_cookie && name == header::SET_COOKIE)
}

/// The response headers kept for a replay, in order: all but those
/// [`never_stored`] and those `Connection` lists.
pub fn stored(response: &HeaderMap, replay_set_cookie: bool) -> Vec<(HeaderName, HeaderValue)> {
    let listed = connection_listed(response);
    response
        .iter()
        .filter(|(name, _)| !never_stored(name, replay_set_cookie) && !listed.contains(name))
        .map(|(name, value)| (name.clone(), value.clone()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A `Connection` line with a byte that is not UTF-8 still names the
    /// headers it lists: they are neither relayed nor stored.
    #[test]
    fn a_connection_line_that_is_not_text_still_names_its_headers() {
        let mut response = HeaderMap::new();
        response.append(
            header::CONNECTION,
            HeaderValue::from_bytes(b"x-internal-token, \x80").unwrap(),
        );
        response.append("x-internal-token", HeaderValue::from_static("s3cret"));
        response.append("x-order", HeaderValue::from_static("7"));
        let internal = HeaderName::from_static("x-internal-token");
        assert!(not_relayed(&response).contains(&internal));
        let kept: Vec<_> = stored(&response, false)
            .into_iter()
            .map(|(n, _)| n)
            .collect();
        assert_eq!(kept, [HeaderName::from_static("x-order")]);
    }

    fn map(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut headers = HeaderMap::new();
        for (name, value) in pairs {
            headers.append(
                HeaderName::from_static(name),
                HeaderValue::from_static(value),
            );
        }
        headers
    }

    #[test]
    fn only_replayable_headers_are_stored() {
        for replay_set_cookie in [false, true] {
            let headers = map(&[
                ("content-type", "text/plain"),
                ("x-trace", "a"),
                ("connection", "keep-alive, x-hop"),
                ("x-hop", "per connection"),
                ("keep-alive", "timeout=5"),
                ("transfer-encoding", "chunked"),
                ("date", "Tue, 01 Jan 2030 00:00:00 GMT"),
                ("content-length", "5"),
                ("set-cookie", "session=1"),
                ("idempotent-replayed", "true"),
                ("x-trace", "b"),
            ]);
            let stored: Vec<_> = headers
                .iter()
                .filter(|(name, _)| !never_stored(name, replay_set_cookie))
                .map(|(name, _)| name.as_str())
                .collect();
            assert!(!stored.contains(&"date") && !stored.contains(&"content-length"));
            assert_eq!(stored.contains(&"set-cookie"), replay_set_cookie);
            assert!(stored.contains(&"content-type") && stored.contains(&"x-trace"));
            let kept: Vec<_> = super::stored(&headers, replay_set_cookie)
                .into_iter()
                .map(|(name, _)| name)
                .collect();
            assert!(
                !kept.iter().any(|name| name == "x-hop"),
                "Connection-listed"
            );
        }
    }

    #[test]
    fn headers_that_route_by_another_path_are_read_as_readings() {
        let readings =
            |pairs: &[(&'static str, &'static str)], path: &str| path_readings(&map(pairs), path);
        assert_eq!(
            readings(&[("script_name", "/x")], "/x/contact"),
            ["/contact"]
        );
        assert_eq!(
            readings(&[("x-script-name", "/x/")], "/x/contact"),
            ["/contact"]
        );
        assert_eq!(readings(&[("x-forwarded-prefix", "/app")], "/app"), ["/"]);
        // gunicorn cuts without a boundary, Werkzeug routes the rest.
        assert_eq!(
            readings(&[("script-name", "/x")], "/xy/contact"),
            ["/y/contact"]
        );
        assert_eq!(
            readings(&[("script-name", "/a")], "/acontact"),
            ["/contact"]
        );
        // Cut from the decoded path, as the Flask recipe cuts PATH_INFO.
        assert_eq!(
            readings(&[("x-script-name", "/a")], "/%61/contact"),
            ["/contact"]
        );
        // Repeated lines, joined as gunicorn joins them.
        assert_eq!(
            readings(
                &[("x-script-name", "/a"), ("x-script-name", "/b")],
                "/a,/b/contact"
            ),
            ["/,/b/contact", "/contact"]
        );
        assert_eq!(
            readings(&[("x-rewrite-url", "http://h/contact?x")], "/plain"),
            ["/contact"]
        );
        assert_eq!(readings(&[("script_name", "")], "/x/contact"), [""; 0]);
        assert_eq!(
            readings(&[("x-original-url", "/contact?a=1")], "/plain"),
            ["/contact"]
        );
        assert_eq!(
            readings(&[("x_rewrite_url", "/contact")], "/plain"),
            ["/contact"]
        );
        assert_eq!(
            readings(&[("path_info", "/contact")], "/plain"),
            ["/contact"]
        );
        assert_eq!(
            readings(&[("x-original-url", "contact")], "/plain"),
            [""; 0]
        );
        assert_eq!(
            readings(&[("x-script-names", "/x"), ("host", "a")], "/x/contact"),
            [""; 0]
        );
    }

    #[test]
    fn a_declared_length_is_one_number_and_never_beside_a_transfer_coding() {
        assert_eq!(content_length(&map(&[("content-length", "5")])), Some(5));
        let twice = map(&[("content-length", "5"), ("content-length", "5")]);
        assert_eq!(content_length(&twice), Some(5));
        let listed = map(&[("content-length", "5, 5"), ("content-length", " 5 ,5")]);
        assert_eq!(content_length(&listed), Some(5));
        for head in [
            map(&[("content-length", "5"), ("content-length", "6")]),
            map(&[("content-length", "5, 6")]),
            map(&[("content-length", "+5")]),
            map(&[("content-length", "5,")]),
            map(&[("content-length", "5x")]),
            map(&[("content-length", "5"), ("transfer-encoding", "chunked")]),
            map(&[]),
        ] {
            assert_eq!(content_length(&head), None, "{head:?}");
        }
    }

    #[test]
    fn forwarding_drops_connection_and_framing_headers() {
        let request = map(&[
            ("connection", "x-hop"),
            ("x-hop", "1"),
            ("transfer-encoding", "chunked"),
            ("expect", "100-continue"),
            ("content-type", "text/plain"),
        ]);
        let dropped = not_forwarded(&request);
        for name in ["connection", "x-hop", "transfer-encoding", "expect", "te"] {
            assert!(dropped.iter().any(|n| n == name), "{name}");
        }
        assert!(!dropped.iter().any(|n| n == "content-type"));
        // A path header the engine routed by reaches the upstream too.
        let listed = map(&[("connection", "script_name"), ("script_name", "/x")]);
        assert!(!not_forwarded(&listed).iter().any(|n| n == "script_name"));
        let relayed = not_relayed(&request);
        assert!(relayed.iter().any(|n| n == "x-hop"));
        assert!(!relayed.iter().any(|n| n == "transfer-encoding"));
    }
}
