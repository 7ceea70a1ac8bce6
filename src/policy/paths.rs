//! The path a request is routed and scoped by, the host its key is scoped
//! by, and the path a redirect points to: each in one normal form, so that
//! no spelling bypasses a route or splits a scope.

/// A `Location` (its query and fragment cut off) by its form.
enum Reference<'a> {
    /// With an authority, `//host/x` or `http://host/x`: the authority and
    /// the path (`/` when none).
    Elsewhere { authority: &'a str, path: &'a str },
    /// An absolute path, `/x`.
    Path(&'a str),
    /// A relative path, `thanks`, resolved against the request's directory.
    Relative(&'a str),
    /// Empty (`?error=1`, `#top`): the request's own path (RFC 3986,
    /// 5.2.2), not its directory.
    Empty,
}

impl<'a> Reference<'a> {
    fn of(reference: &'a str) -> Self {
        let elsewhere = |rest: &'a str| {
            let (authority, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
            let path = if path.is_empty() { "/" } else { path };
            Reference::Elsewhere { authority, path }
        };
        if let Some(rest) = reference.strip_prefix("//") {
            elsewhere(rest)
        } else if reference.starts_with('/') {
            Reference::Path(reference)
        } else if let Some(scheme) = reference.find("://").filter(|&i| {
            reference[..i]
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'+' | b'-' | b'.'))
        }) {
            elsewhere(&reference[scheme + 3..])
        } else if reference.is_empty() {
            Reference::Empty
        } else {
            Reference::Relative(reference)
        }
    }

    /// The path it points to from a request for `base`.
    fn resolve(&self, base: &str) -> String {
        match self {
            Reference::Elsewhere { path, .. } | Reference::Path(path) => (*path).to_owned(),
            Reference::Empty => base.to_owned(),
            Reference::Relative(relative) => {
                let directory = base.rfind('/').map_or("/", |i| &base[..=i]);
                format!("{directory}{relative}")
            }
        }
    }
}

/// The path a `Location` points to: the path of an absolute URL
/// (`http://host/contact/thanks`), of a network-path reference
/// (`//host/x`), an absolute path (`/x?y`), or a relative reference
/// resolved against `base` (`thanks` from `/contact` is `/thanks`; a
/// query- or fragment-only reference is `base` itself), without segment
/// parameters (`;jsessionid=…`), normalised as request paths are (see
/// [`normalize_path`]). `None` for a value that is not UTF-8.
pub(super) fn location_path(location: &[u8], base: &str) -> Option<String> {
    let location = std::str::from_utf8(location).ok()?.trim();
    let location = location.split(['?', '#']).next().unwrap_or_default();
    let path = Reference::of(location).resolve(base);
    Some(normalize_path(&strip_segment_parameters(&path), false).into_owned())
}

/// Whether a redirect to `location` asks for the request `target` again
/// under another spelling of its path: on the same host (a relative
/// reference, or an absolute one naming `target.host`), with the same
/// query, at a path spelled otherwise that reads as the request's
/// (normalised as routes are, segment parameters dropped). What a
/// framework's canonicaliser answers before any handler runs (Django's
/// `APPEND_SLASH`, Starlette's `redirect_slashes`, Go's path cleaning, a
/// servlet's `;jsessionid`); never a handler's answer to the identical
/// spelling, to another query (`/orders?created=1`) or to another host,
/// which may come after it ran.
pub(super) fn respelled(location: &[u8], target: &RequestTarget<'_>, ci: bool) -> bool {
    let Ok(location) = std::str::from_utf8(location) else {
        return false;
    };
    let location = location.trim();
    let location = location.split('#').next().unwrap_or_default();
    let (reference, query) = match location.split_once('?') {
        Some((reference, query)) => (reference, Some(query)),
        None => (location, None),
    };
    if query != target.query {
        return false;
    }
    let reference = Reference::of(reference);
    match reference {
        // The request's own spelling.
        Reference::Empty => return false,
        Reference::Elsewhere { authority, .. } => {
            let host = http::uri::Authority::try_from(authority)
                .map(|authority| authority.host().trim_end_matches('.').to_ascii_lowercase());
            if target.host.is_empty() || !host.is_ok_and(|host| host == target.host) {
                return false;
            }
        }
        Reference::Path(_) | Reference::Relative(_) => {}
    }
    let path = reference.resolve(target.path);
    let read = |path: &str| normalize_path(&strip_segment_parameters(path), ci).into_owned();
    path != target.path && read(&path) == read(target.path)
}

/// A request as a redirect's `Location` is judged against: its host (as
/// [`scope_host`] reads it), and its path and query as the client sent
/// them.
#[derive(Clone, Copy, Debug)]
pub struct RequestTarget<'a> {
    /// The request's host, lower-cased (empty when it named none).
    pub host: &'a str,
    /// The path the client sent (before a router stripped a mount).
    pub path: &'a str,
    /// The query the client sent, if any.
    pub query: Option<&'a str>,
    /// The prefix a router mounted the routes under (axum's `nest`), or
    /// empty: a `Location` under it also matches `success_redirects` as
    /// they are written, without it.
    pub mount: &'a str,
}

/// `path` without the parameters of its segments (`/thanks;jsessionid=1`
/// is `/thanks`): servlet containers append them to paths and redirects,
/// and route by the path without them.
pub(super) fn strip_segment_parameters(path: &str) -> std::borrow::Cow<'_, str> {
    if !path.contains(';') {
        return std::borrow::Cow::Borrowed(path);
    }
    let stripped: Vec<&str> = path
        .split('/')
        .map(|segment| segment.split(';').next().unwrap_or_default())
        .collect();
    std::borrow::Cow::Owned(stripped.join("/"))
}

/// Whether `path` may be read more than one way ([`Routes::find`](super::Routes::find)):
/// it holds `;`, `%` or `\`, a dot segment, a format suffix or a PHP
/// front controller. False for almost every path.
pub(crate) fn has_other_readings(path: &str) -> bool {
    path.contains([';', '%', '\\'])
        || path.contains("/.")
        // Normalised, `/orders.json/` routes as `/orders.json`.
        || strip_format_suffix(path.trim_end_matches('/')).is_some()
        || front_controller_path(path).is_some()
}

/// `path` without the format suffix of its last segment (`/contacts.json`
/// is `/contacts`), which Rails routes as the same action
/// (`/contacts(.:format)`); `None` when the last segment has none. A
/// suffix is a `.` after at least one character, followed by anything
/// but `/` and `.` (Rails' `[^/.?]+`).
pub(super) fn strip_format_suffix(path: &str) -> Option<&str> {
    let segment = path.rfind('/').map_or(0, |i| i + 1);
    let dot = segment + path[segment..].rfind('.')?;
    let suffix = &path[dot + 1..];
    (dot > segment && !suffix.is_empty()).then(|| &path[..dot])
}

/// The path a PHP front controller routes `path` by, when a segment of
/// `path` ends in `.php` and more follows it (`/index.php/contact` is
/// `/contact`): the server hands the rest to the script as `PATH_INFO`
/// (nginx's `fastcgi_split_path_info`, Apache's `AcceptPathInfo`), and
/// Laravel and Symfony route by it. The first such segment; a caller that
/// reads the result again finds the later ones (nginx splits at the last).
/// The suffix is matched in any case, which covers more than a
/// case-sensitive server reads.
pub(super) fn front_controller_path(path: &str) -> Option<&str> {
    let bytes = path.as_bytes();
    // Most paths hold no dot: found at once.
    memchr::memchr(b'.', bytes)?;
    let mut segment = 0;
    for (i, &b) in bytes.iter().enumerate() {
        if b != b'/' {
            continue;
        }
        let name = &bytes[segment..i];
        if name.len() > 4 && name[name.len() - 4..].eq_ignore_ascii_case(b".php") {
            return Some(&path[i..]);
        }
        segment = i + 1;
    }
    None
}

/// The host a request's key is scoped by: the URI's authority and the
/// `Host` header, each without port or trailing dot, lowercased — one of
/// them when the other is missing or names the same host, both (joined by
/// a space, which no host name holds) when they differ; empty when there
/// is neither. Frameworks pick the tenant from either (axum's `Host`
/// extractor prefers the header, the engine used to prefer the URI), and
/// HTTP/1.1 absolute-form requests and HTTP/2 `:authority` with a `host`
/// line can carry two: scoped by both, no reading shares a scope with
/// another tenant's; so do several `Host` lines. Host names select
/// tenants; the port does not
/// (instances of one deployment listen on different ports, and
/// `example.com` and `example.com:443` are one target).
pub fn scope_host(uri: &http::Uri, headers: &http::HeaderMap) -> String {
    let normal = |host: &str| {
        let host = host.strip_suffix('.').unwrap_or(host);
        host.to_ascii_lowercase()
    };
    // Not a host (no valid authority, or one with userinfo, which no
    // `Host` may hold and an application reading the header sees whole:
    // `evil@shop-b.example` is not `shop-b.example` to it): the value
    // itself, with its spaces (and so its `%`) escaped, so that no value
    // reads as the two hosts below.
    let verbatim = |value: &[u8]| {
        normal(&String::from_utf8_lossy(value))
            .replace('%', "%25")
            .replace(' ', "%20")
    };
    let host_of = |authority: &http::uri::Authority| match authority.as_str().contains('@') {
        true => verbatim(authority.as_str().as_bytes()),
        false => normal(authority.host()),
    };
    let from_uri = uri.authority().map(host_of);
    let mut hosts: Vec<String> = from_uri.into_iter().collect();
    for value in headers.get_all(http::header::HOST) {
        let host = match http::uri::Authority::try_from(value.as_bytes()) {
            Ok(authority) => host_of(&authority),
            Err(_) => verbatim(value.as_bytes()),
        };
        // Several `Host` lines (RFC 9112 forbids them; a server may read
        // the first or the last): scoped by every one, so no reading
        // shares a scope with another tenant's.
        if !hosts.contains(&host) {
            hosts.push(host);
        }
    }
    hosts.join(" ")
}

/// The form a path is routed and scoped by; the request itself is
/// forwarded unchanged.
///
/// * percent-encoded unreserved characters (`A-Z a-z 0-9 - . _ ~`) are
///   decoded (`/%61pi` is `/api`); other escapes keep their meaning and get
///   upper-case hex digits (`%2f` is `%2F`, never `/`);
/// * repeated slashes are merged (`//api` is `/api`);
/// * `.` and `..` segments are removed (`/./api`, `/x/../api` are `/api`;
///   `..` never climbs above the root);
/// * a trailing slash is dropped (`/api/pay/` is `/api/pay`); `/` stays;
/// * with `case_insensitive`, ASCII letters are lowercased.
///
/// An empty path is `/`.
pub fn normalize_path(path: &str, case_insensitive: bool) -> std::borrow::Cow<'_, str> {
    normalize(path, case_insensitive, true)
}

/// Whether `path` holds a percent-encoded dot (`%2e`): backends disagree
/// on whether `/%2e%2e/` is a `..` segment.
pub(super) fn has_encoded_dot(path: &str) -> bool {
    has_escape_2x(path, b'e')
}

/// Whether `path` holds a percent-encoded slash (`%2F`): some backends
/// decode it before routing.
pub(super) fn has_encoded_slash(path: &str) -> bool {
    has_escape_2x(path, b'f')
}

/// Whether `path` holds the escape `%2` + `digit` (in either case).
fn has_escape_2x(path: &str, digit: u8) -> bool {
    path.as_bytes()
        .windows(3)
        .any(|w| w[0] == b'%' && w[1] == b'2' && w[2].eq_ignore_ascii_case(&digit))
}

/// `path` with its percent-escapes decoded, but for `%2F` and `%2E` (read
/// by readings of their own) and `%25` (decoding it would make new
/// escapes), when it holds such an escape and the result is UTF-8.
/// Laravel, Django and Go route by the decoded path: `/v1/orders%3Acancel`
/// is `/v1/orders:cancel` to them, `/best%C3%A4tigen` is `/bestätigen`.
pub(super) fn decode_escapes(path: &str) -> Option<String> {
    let bytes = path.as_bytes();
    let hex = |b: u8| (b as char).to_digit(16);
    let mut decoded = Vec::with_capacity(bytes.len());
    let mut changed = false;
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' && i + 2 < bytes.len() {
            if let (Some(hi), Some(lo)) = (hex(bytes[i + 1]), hex(bytes[i + 2])) {
                let byte = (hi * 16 + lo) as u8;
                if !matches!(byte, b'/' | b'.' | b'%') {
                    decoded.push(byte);
                    changed = true;
                    i += 3;
                    continue;
                }
            }
        }
        decoded.push(bytes[i]);
        i += 1;
    }
    changed.then(|| String::from_utf8(decoded).ok()).flatten()
}

/// `path` with every `%2F` read as `/`.
pub(super) fn decode_slashes(path: &str) -> String {
    path.replace("%2F", "/").replace("%2f", "/")
}

/// [`normalize_path`]; with `decode_dots` off, `%2e` stays encoded (as
/// `%2E`), so it never makes a dot segment.
pub(super) fn normalize(
    path: &str,
    case_insensitive: bool,
    decode_dots: bool,
) -> std::borrow::Cow<'_, str> {
    let bytes = path.as_bytes();
    let simple = bytes.first() == Some(&b'/')
        && !bytes.contains(&b'%')
        && !bytes.windows(2).any(|w| w == b"//" || w == b"/.")
        && (bytes.len() == 1 || bytes.last() != Some(&b'/'))
        && !(case_insensitive && bytes.iter().any(u8::is_ascii_uppercase));
    if simple {
        return std::borrow::Cow::Borrowed(path);
    }
    // Percent-decoding of unreserved characters first (RFC 3986 6.2.2.2),
    // then dot segments (6.2.2.3), so `/%2e%2e/` is a `..` segment too.
    let mut decoded = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let byte = bytes[i];
        if byte == b'%' && i + 2 < bytes.len() {
            let hex = |b: u8| (b as char).to_digit(16);
            if let (Some(hi), Some(lo)) = (hex(bytes[i + 1]), hex(bytes[i + 2])) {
                let value = (hi * 16 + lo) as u8;
                let unreserved = value.is_ascii_alphanumeric()
                    || matches!(value, b'-' | b'_' | b'~')
                    || (value == b'.' && decode_dots);
                if unreserved {
                    decoded.push(value);
                } else {
                    decoded.push(b'%');
                    decoded.push(bytes[i + 1].to_ascii_uppercase());
                    decoded.push(bytes[i + 2].to_ascii_uppercase());
                }
                i += 3;
                continue;
            }
        }
        decoded.push(byte);
        i += 1;
    }
    if case_insensitive {
        decoded.make_ascii_lowercase();
    }
    let mut segments: Vec<&[u8]> = Vec::new();
    for segment in decoded.split(|&b| b == b'/') {
        match segment {
            b"" | b"." => {}
            b".." => {
                segments.pop();
            }
            segment => segments.push(segment),
        }
    }
    let mut out = String::with_capacity(decoded.len());
    for segment in &segments {
        out.push('/');
        // Only ASCII bytes were decoded; the rest is the input's own text.
        out.push_str(&String::from_utf8_lossy(segment));
    }
    if out.is_empty() {
        out.push('/');
    }
    std::borrow::Cow::Owned(out)
}
