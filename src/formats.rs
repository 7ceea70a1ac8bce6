//! Request-body formats: media types, `application/x-www-form-urlencoded`,
//! `multipart/form-data` and JSON pointers — parsed once into a [`View`]
//! that key extraction and fingerprinting both read.
//!
//! This module depends on nothing else in the crate.
//!
//! Why the parsers here are not the usual crates':
//!
//! * `form_urlencoded` decodes names and values into UTF-8 *lossily*: two
//!   bodies that differ only in invalid bytes would decode alike and get
//!   one fingerprint, so a changed request could be answered with the first
//!   one's response. The decoder here keeps the bytes.
//! * `multer` parses a part's headers into a map; the fingerprint hashes
//!   them as sent (a changed header spelling is a changed request), and
//!   `multer` needs an async stream for a body that is already buffered.
//!   The parser here keeps them raw and searches in linear time
//!   (`memchr::memmem`), so a body full of near-matches of the boundary
//!   costs no more than any other body of its size.
//! * `mime` refuses content types with a loose parameter
//!   (`application/json; charset`), which clients do send; the essence
//!   match here reads only the part before `;`, as before.

use http::HeaderMap;
use memchr::memmem;

/// The request's (first) `Content-Type` as text: "" when absent, and up to
/// its first byte that is not UTF-8 when it holds one. Backends read the
/// media type from the raw bytes, so a byte such as Latin-1 `é` in a later
/// parameter does not hide a form's fields from the engine; such a body is
/// still fingerprinted raw ([`read_more_than_one_way`]), as a boundary may
/// be read up to the byte here and whole by the backend.
pub fn content_type(headers: &HeaderMap) -> &str {
    let Some(value) = headers.get(http::header::CONTENT_TYPE) else {
        return "";
    };
    let bytes = value.as_bytes();
    match std::str::from_utf8(bytes) {
        Ok(text) => text,
        Err(error) => std::str::from_utf8(&bytes[..error.valid_up_to()]).unwrap_or_default(),
    }
}

/// The header by which a `POST` names the method it is run as (Express,
/// Symfony): read by the engine's classification, always fingerprinted,
/// and always forwarded.
pub(crate) const METHOD_OVERRIDE: http::HeaderName =
    http::HeaderName::from_static("x-http-method-override");

/// Every header by which a request may name the method it is run as: the
/// common [`METHOD_OVERRIDE`], and the two other names Express's
/// `method-override` documents (`X-HTTP-Method`, which OData and
/// Microsoft's APIs use too, and `X-Method-Override`). Each is read like
/// it, fingerprinted and forwarded.
pub(crate) const METHOD_OVERRIDES: [http::HeaderName; 3] = [
    METHOD_OVERRIDE,
    http::HeaderName::from_static("x-http-method"),
    http::HeaderName::from_static("x-method-override"),
];

/// Whether header `name` is one of the [`METHOD_OVERRIDES`], with `-` or
/// `_` between its words: Puma hands Rack `X_HTTP_Method_Override` as
/// `HTTP_X_HTTP_METHOD_OVERRIDE`, the key `Rack::MethodOverride` reads
/// (and CGI-style servers map both spellings to one variable), so such a
/// name is read, fingerprinted and forwarded like the usual one.
pub(crate) fn method_override(name: &http::HeaderName) -> bool {
    let name = name.as_str().as_bytes();
    // Most names have none of these lengths: one comparison each.
    if !matches!(name.len(), 13 | 17 | 22) {
        return false;
    }
    METHOD_OVERRIDES
        .iter()
        .any(|expected| spelled_as(name, expected.as_str().as_bytes()))
}

/// Whether header name `name` is `expected` with `-` or `_` between its
/// words (CGI-style servers map both to one variable).
fn spelled_as(name: &[u8], expected: &[u8]) -> bool {
    name.len() == expected.len()
        && name
            .iter()
            .zip(expected)
            .all(|(&b, &e)| b == e || (b == b'_' && e == b'-'))
}

/// How a request header names the path a backend may route by instead
/// of the target ([`crate::engine::headers::path_readings`]).
#[derive(Clone, Copy)]
pub(crate) enum PathHeader {
    /// Its value is cut from the front of the path.
    Prefix,
    /// Its value is the path (and maybe a query).
    Whole,
}

/// How many names [`path_header`] knows (each in every spelling).
pub(crate) const PATH_HEADERS: usize = 6;

/// Whether, and how, header `name` names a path for the backend
/// (`SCRIPT_NAME`, `X-Original-Url`, …; `-` or `_` in the name), and which
/// of the [`PATH_HEADERS`] names it is, whatever its spelling. Such
/// headers are read by the classification and fingerprinted.
pub(crate) fn path_header(name: &http::HeaderName) -> Option<(PathHeader, usize)> {
    let name = name.as_str().as_bytes();
    // Most names have none of these lengths: one comparison each.
    if !matches!(name.len(), 9 | 11 | 13 | 14 | 18) {
        return None;
    }
    const NAMES: [(&[u8], PathHeader); PATH_HEADERS] = [
        (b"script-name", PathHeader::Prefix),
        (b"x-script-name", PathHeader::Prefix),
        (b"x-forwarded-prefix", PathHeader::Prefix),
        (b"path-info", PathHeader::Whole),
        (b"x-original-url", PathHeader::Whole),
        (b"x-rewrite-url", PathHeader::Whole),
    ];
    NAMES
        .iter()
        .position(|(expected, _)| spelled_as(name, expected))
        .map(|at| (NAMES[at].1, at))
}

/// Whether Rack or PHP read a body of `content_type` as a form: they cut
/// the media type at `;`, `,` or a space (PHP) and take an absent or empty
/// one for a form (Rack), so `application/x-www-form-urlencoded, text/plain`
/// is a form to them; Rack also parses `multipart/mixed` and
/// `multipart/related` (its `PARSEABLE_DATA_MEDIA_TYPES`), as urlencoded
/// when they carry no boundary (with one, by parts: see
/// [`rack_only_multipart`]).
pub(crate) fn rack_form(content_type: &str) -> bool {
    let media_type = media_type_as_rack_reads(content_type);
    media_type.is_empty()
        || media_type.eq_ignore_ascii_case(b"application/x-www-form-urlencoded")
        || media_type.eq_ignore_ascii_case(b"multipart/form-data")
        || (rack_multipart(media_type) && multipart_boundary(content_type).is_none())
}

/// The media type as Rack and PHP cut it: at `;`, `,` or a space.
fn media_type_as_rack_reads(content_type: &str) -> &[u8] {
    let media_type = content_type.trim_start().as_bytes();
    let end = media_type
        .iter()
        .position(|b| matches!(b, b';' | b',' | b' ' | b'\t'))
        .unwrap_or(media_type.len());
    &media_type[..end]
}

/// Whether a media type (cut as [`rack_form`] cuts it) is one of the
/// multipart types Rack parses as a form beside `multipart/form-data`.
fn rack_multipart(media_type: &[u8]) -> bool {
    media_type.eq_ignore_ascii_case(b"multipart/mixed")
        || media_type.eq_ignore_ascii_case(b"multipart/related")
}

/// Whether `content_type` is a multipart type Rack parses as a form whose
/// parts this reader does not read (`multipart/mixed`, `multipart/related`).
pub(crate) fn rack_only_multipart(content_type: &str) -> bool {
    rack_multipart(media_type_as_rack_reads(content_type))
}

/// Whether some `Content-Type` line holds `/json` or `+json`, in any case
/// and anywhere (`text/json`, `application/merge-patch+json`): Laravel
/// reads such a body as JSON (`isJson`), a server in front such as Apache
/// joining repeated lines first. A superset of Laravel's reading, which is
/// case-sensitive.
pub(crate) fn spells_json(headers: &HeaderMap) -> bool {
    headers
        .get_all(http::header::CONTENT_TYPE)
        .iter()
        .any(|value| {
            value.as_bytes().windows(5).any(|window| {
                matches!(window[0], b'/' | b'+') && window[1..].eq_ignore_ascii_case(b"json")
            })
        })
}

/// Whether backends read a request's body type more than one way, so its
/// fingerprint must not depend on any one reading (its raw bytes are
/// hashed instead, which no reading can make collide):
///
/// * repeated `Content-Type` lines (a server in front may join them:
///   Apache does, and Laravel then reads JSON where the first line says a
///   form);
/// * a line that is not UTF-8 (the media type and boundary are read up to
///   the bad byte here, from the raw bytes by PHP and Go);
/// * a media type holding `,` (PHP and Rack cut it there:
///   `application/x-www-form-urlencoded, application/vnd.api+json` is a
///   form to them and JSON by its ending);
/// * a type Laravel reads as JSON ([`spells_json`]) that is not JSON by
///   its media type (`multipart/form-data; boundary=+JSON`, a form with a
///   parameter `x=/json`);
/// * a multipart type whose boundary PHP or Rack reads otherwise than
///   [`multipart_boundary`] ([`boundary_read_one_way`]);
/// * a `charset` other than UTF-8 or US-ASCII ([`charset_is_utf8`]):
///   Django REST framework and Express decode the body by it before they
///   parse it, so under UTF-7 `+ACY-` is a `&` to them and text here, and
///   two bodies sorted alike here would read as different forms there.
pub fn read_more_than_one_way(headers: &HeaderMap) -> bool {
    let mut lines = headers.get_all(http::header::CONTENT_TYPE).iter();
    let Some(first) = lines.next() else {
        return false;
    };
    let Ok(text) = std::str::from_utf8(first.as_bytes()) else {
        return true;
    };
    let media_type = text.split(';').next().unwrap_or_default();
    lines.next().is_some()
        || media_type.contains(',')
        || (spells_json(headers) && !is_json(text))
        || (is_media_type(text, "multipart/form-data") && !boundary_read_one_way(text))
        || !charset_is_utf8(text)
}

/// Whether any `Content-Type` line names a `charset` other than UTF-8
/// ([`charset_is_utf8`]), read whole: a byte that is not UTF-8 before it
/// (`x="\xe9"; charset=utf-7`, which Express's parser takes in a quoted
/// string) hides it from [`content_type`], not from the backend.
pub fn names_other_charset(headers: &HeaderMap) -> bool {
    headers
        .get_all(http::header::CONTENT_TYPE)
        .iter()
        .any(|line| !charset_is_utf8(&String::from_utf8_lossy(line.as_bytes())))
}

/// Whether every `charset` parameter of `content_type` (none is UTF-8 by
/// default for JSON and forms alike) names UTF-8 or its subset US-ASCII,
/// the only text this crate's readers decode. A quoted value is read
/// unquoted; a name is matched without regard to case, as both are by
/// RFC 9110, and also as `charset*` (RFC 2231), which Django reads as
/// `charset`.
fn charset_is_utf8(content_type: &str) -> bool {
    content_type.split(';').skip(1).all(|parameter| {
        let Some((name, value)) = parameter.split_once('=') else {
            return true;
        };
        let name = name.trim();
        let name = name.strip_suffix('*').unwrap_or(name).trim_end();
        if !name.eq_ignore_ascii_case("charset") {
            return true;
        }
        let value = value.trim();
        let value = value
            .strip_prefix('"')
            .and_then(|quoted| quoted.strip_suffix('"'))
            .unwrap_or(value);
        ["utf-8", "utf8", "us-ascii"]
            .iter()
            .any(|utf8| value.eq_ignore_ascii_case(utf8))
    })
}

/// Whether PHP and Rack read the same boundary from a multipart content
/// type as [`multipart_boundary`] does. PHP takes the first substring
/// `boundary` (case-sensitive, else in any case) and the value after the
/// next `=`, up to a closing quote or the first `,` or `;`; Rack the last
/// `boundary=` in any case (its pattern is greedy), up to `"`, `;` or `,`.
/// With a second `boundary` parameter (`xboundary=A; boundary=B`) or a
/// space around the value they read another one, and each reads other
/// parts from the same body.
fn boundary_read_one_way(content_type: &str) -> bool {
    let Some(ours) = multipart_boundary(content_type) else {
        return true;
    };
    let lower = content_type.to_ascii_lowercase();
    let php = content_type
        .find("boundary")
        .or_else(|| lower.find("boundary"))
        .and_then(|at| content_type[at..].split_once('='))
        .and_then(|(_, value)| match value.strip_prefix('"') {
            Some(quoted) => quoted.split_once('"').map(|(value, _)| value),
            None => value.split([',', ';']).next(),
        });
    let rack = lower.rfind("boundary=").map(|at| {
        let value = &content_type[at + "boundary=".len()..];
        let value = value.strip_prefix('"').unwrap_or(value);
        value.split(['"', ';', ',']).next().unwrap_or_default()
    });
    php == Some(ours) && rack == Some(ours)
}

/// Whether `content_type` is `expected`, ignoring parameters and case.
pub fn is_media_type(content_type: &str, expected: &str) -> bool {
    content_type
        .split(';')
        .next()
        .is_some_and(|essence| essence.trim().eq_ignore_ascii_case(expected))
}

/// Whether `content_type` is JSON (`application/json` or any `+json`).
pub fn is_json(content_type: &str) -> bool {
    let essence = content_type.split(';').next().unwrap_or("").trim();
    let suffix = essence
        .len()
        .checked_sub(5)
        .and_then(|at| essence.get(at..));
    essence.eq_ignore_ascii_case("application/json")
        || suffix.is_some_and(|suffix| suffix.eq_ignore_ascii_case("+json"))
}

/// A request body as its content type says to read it, parsed once.
#[derive(Debug)]
pub struct View<'a> {
    /// The body as it came.
    pub bytes: &'a [u8],
    /// What it was parsed into.
    pub kind: Kind<'a>,
}

/// How a [`View`]'s body was read.
#[derive(Debug)]
pub enum Kind<'a> {
    /// JSON by its content type (read by the canonicaliser or a pointer).
    Json,
    /// A urlencoded form: (name, value) pairs, decoded, in order.
    Form(Vec<(Vec<u8>, Vec<u8>)>),
    /// A well-formed multipart form: its parts, in order.
    Multipart(Vec<Part<'a>>),
    /// A multipart content type whose body or boundary is malformed.
    BadMultipart,
    /// Anything else: opaque bytes.
    Opaque,
}

impl<'a> View<'a> {
    /// Reads `body` as `content_type` says.
    pub fn parse(content_type: &str, body: &'a [u8]) -> Self {
        let kind = if is_json(content_type) {
            Kind::Json
        } else if is_media_type(content_type, "application/x-www-form-urlencoded") {
            Kind::Form(form_pairs(body).collect())
        } else if is_media_type(content_type, "multipart/form-data") {
            multipart_boundary(content_type)
                .and_then(|boundary| multipart_parts(body, boundary))
                .map_or(Kind::BadMultipart, Kind::Multipart)
        } else {
            Kind::Opaque
        };
        View { bytes: body, kind }
    }

    /// The values of every form field (urlencoded or multipart) whose name
    /// PHP or Rack reads as `name` ([`read_as`]), in order; none for other
    /// bodies.
    pub fn fields_read_as(&self, name: &str) -> Vec<&[u8]> {
        self.values_where(|raw| read_as(raw, name)).collect()
    }

    /// The values of the form fields (urlencoded or multipart) whose raw
    /// names `named` accepts, in order; none for other bodies.
    fn values_where<'v, F>(&'v self, named: F) -> impl Iterator<Item = &'v [u8]> + use<'v, 'a, F>
    where
        F: Fn(&[u8]) -> bool,
    {
        let (pairs, parts): (&[_], &[Part<'a>]) = match &self.kind {
            Kind::Form(pairs) => (pairs, &[]),
            Kind::Multipart(parts) => (&[], parts),
            _ => (&[], &[]),
        };
        let pairs = pairs.iter().map(|(n, v)| (&n[..], &v[..]));
        let parts = parts.iter().map(|part| (part.name, part.data));
        pairs
            .chain(parts)
            .filter(move |(name, _)| named(name))
            .map(|(_, value)| value)
    }

    /// The values of every form field PHP or Rack reads as `name`, in
    /// order, wherever a framework reads the body as a form: parsed as its
    /// content type says (urlencoded or multipart), or as urlencoded where
    /// Rack reads it so although `content_type` makes it no form here (none,
    /// a form type cut at `,`, multipart without a boundary: [`rack_form`]).
    /// None for other bodies.
    pub(crate) fn framework_fields(&self, content_type: &str, name: &str) -> Vec<Vec<u8>> {
        match &self.kind {
            Kind::Form(_) | Kind::Multipart(_) => self
                .fields_read_as(name)
                .into_iter()
                .map(<[u8]>::to_vec)
                .collect(),
            _ if rack_form(content_type) => form_values_read_as(self.bytes, name).collect(),
            _ => Vec::new(),
        }
    }

    /// Whether the body is JSON by its content type.
    pub fn is_json(&self) -> bool {
        matches!(self.kind, Kind::Json)
    }

    /// The values of every form field (urlencoded or multipart) named
    /// `name`, in order; none for other bodies.
    pub fn fields(&self, name: &str) -> Vec<&[u8]> {
        self.values_where(|raw| raw == name.as_bytes()).collect()
    }

    /// The value of the first form field (urlencoded or multipart) named
    /// `name`; `None` for other bodies.
    pub fn field(&self, name: &str) -> Option<&[u8]> {
        self.values_where(|raw| raw == name.as_bytes()).next()
    }
}

/// The name PHP registers a form field under: leading spaces dropped, and
/// before the first `[`, spaces and dots read as `_`; a `[` without a
/// closing `]` reads as `_` too.
fn php_name(raw: &[u8]) -> Vec<u8> {
    let raw = &raw[raw.iter().take_while(|&&b| b == b' ').count()..];
    let mut name = raw.to_vec();
    let base = raw.iter().position(|&b| b == b'[').unwrap_or(raw.len());
    for byte in &mut name[..base] {
        if matches!(*byte, b' ' | b'.') {
            *byte = b'_';
        }
    }
    if base < raw.len() && !raw[base..].contains(&b']') {
        name[base] = b'_';
    }
    name
}

/// Whether PHP or Rack reads a form field named `raw` as `name`: PHP
/// through [`php_name`] (` _method` and `.method` are `_method`), Rack 2
/// by its parameter pattern `\A[\[\]]*([^\[\]]+)\]*` (`[_method]`,
/// `_method]`).
pub(crate) fn read_as(raw: &[u8], name: &str) -> bool {
    if raw == name.as_bytes() || php_name(raw) == name.as_bytes() {
        return true;
    }
    let start = raw.iter().position(|b| !matches!(b, b'[' | b']'));
    let Some(start) = start else { return false };
    let rest = &raw[start..];
    let end = rest
        .iter()
        .position(|b| matches!(b, b'[' | b']'))
        .unwrap_or(rest.len());
    rest[..end] == *name.as_bytes() && rest[end..].iter().all(|&b| b == b']')
}

/// The values of the urlencoded `input`'s fields PHP or Rack reads as
/// `name` ([`read_as`]), in order.
pub(crate) fn form_values_read_as<'i>(
    input: &'i [u8],
    name: &'i str,
) -> impl Iterator<Item = Vec<u8>> + 'i {
    form_pairs(input).filter_map(move |(raw, value)| read_as(&raw, name).then_some(value))
}

/// Decodes `application/x-www-form-urlencoded` into (name, value) pairs,
/// in order. `+` is a space; a bad `%` escape is kept literally.
pub fn form_pairs(body: &[u8]) -> impl Iterator<Item = (Vec<u8>, Vec<u8>)> + '_ {
    body.split(|&b| b == b'&')
        .filter(|pair| !pair.is_empty())
        .map(|pair| {
            let (name, value) = match pair.iter().position(|&b| b == b'=') {
                Some(i) => (&pair[..i], &pair[i + 1..]),
                None => (pair, &b""[..]),
            };
            (percent_decode(name), percent_decode(value))
        })
}

/// The value of the first pair named `name` in a urlencoded string (a
/// query or a form body).
pub fn form_value(body: &[u8], name: &str) -> Option<Vec<u8>> {
    form_pairs(body)
        .find(|(n, _)| n == name.as_bytes())
        .map(|(_, v)| v)
}

/// Whether every reader decodes the urlencoded `body` alike: each field
/// has an `=` (Rack reads `gift` as `nil`, `gift=` as `""`), each `%`
/// starts a valid escape (Go drops a field with a bad one; PHP and this
/// reader keep it literally, so `%zz` and `%25zz` decode alike), no byte
/// is a raw `;` (Go drops the field holding one, Python before 3.9.2 and
/// Perl's CGI split fields at it; this reader keeps it, so `x;y` and
/// `x%3By` decode alike), and the body does not open as JSON does (`curl
/// -d` labels a JSON body as a form, and a backend that parses its body
/// as JSON whatever the label reads `+`, `%31` and the order of
/// `&`-separated text as they are), and no field holds a raw `]=` past
/// its first `=` (`qs`, Express's extended parser, splits a field at `]=`
/// where there is one: `a[b=c]=d` is `a[b=c]` = `d` to it, `a[b` =
/// `c]=d` here, as `a[b=c]%3Dd` is to both).
pub(crate) fn form_read_one_way(body: &[u8]) -> bool {
    if opens_as_json(body) || memchr::memchr(b';', body).is_some() {
        return false;
    }
    let split_apart = body.split(|&b| b == b'&').any(|field| {
        let first = memchr::memchr(b'=', field);
        let bracketed = memchr::memmem::find(field, b"]=").map(|at| at + 1);
        bracketed.is_some_and(|at| Some(at) != first)
    });
    if split_apart {
        return false;
    }
    let escapes = memchr::memchr_iter(b'%', body).all(|at| {
        body.get(at + 1..at + 3)
            .is_some_and(|hex| hex.iter().all(u8::is_ascii_hexdigit))
    });
    escapes
        && body
            .split(|&b| b == b'&')
            .all(|field| field.is_empty() || field.contains(&b'='))
}

/// Whether `body`, past a UTF-8 byte order mark and JSON's whitespace,
/// starts an object, an array or a string: the bodies a JSON reader takes
/// in which a form reader finds fields to decode or to sort.
pub(crate) fn opens_as_json(body: &[u8]) -> bool {
    let body = body.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(body);
    body.iter()
        .find(|b| !matches!(b, b' ' | b'\t' | b'\r' | b'\n'))
        .is_some_and(|b| matches!(b, b'{' | b'[' | b'"'))
}

fn percent_decode(input: &[u8]) -> Vec<u8> {
    let hex = |b: u8| (b as char).to_digit(16).map(|d| d as u8);
    let mut out = Vec::with_capacity(input.len());
    let mut i = 0;
    while i < input.len() {
        match input[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < input.len() => match (hex(input[i + 1]), hex(input[i + 2])) {
                (Some(h), Some(l)) => {
                    out.push(h << 4 | l);
                    i += 2;
                }
                _ => out.push(b'%'),
            },
            b => out.push(b),
        }
        i += 1;
    }
    out
}

/// One part of a `multipart/form-data` body.
#[derive(Debug, PartialEq, Eq)]
pub struct Part<'a> {
    /// The `name` of its `Content-Disposition`.
    pub name: &'a [u8],
    /// Its headers, raw.
    pub headers: &'a [u8],
    /// Its content.
    pub data: &'a [u8],
}

/// The `boundary` parameter of a multipart content type.
pub fn multipart_boundary(content_type: &str) -> Option<&str> {
    content_type.split(';').skip(1).find_map(|param| {
        let (name, value) = param.split_once('=')?;
        name.trim()
            .eq_ignore_ascii_case("boundary")
            .then(|| value.trim().trim_matches('"'))
            .filter(|b| !b.is_empty() && b.len() <= 70)
    })
}

/// Splits a multipart body into its parts. `None` if it is malformed, or
/// if it holds bytes other readers may read as parts where this one reads
/// none: before its first delimiter (a preamble, which PHP searches line by
/// line) or after its closing one (an epilogue), line breaks aside, or the
/// delimiter `--boundary` inside a part (PHP ends a part at `\n--boundary`,
/// Django at `--boundary` anywhere, this reader only at `\r\n--boundary`).
/// Linear in the body's length: each byte is searched once per delimiter
/// search, with a substring search that does not backtrack.
pub fn multipart_parts<'a>(body: &'a [u8], boundary: &str) -> Option<Vec<Part<'a>>> {
    let delimiter = [b"--", boundary.as_bytes()].concat();
    let next_delimiter = [b"\r\n", &delimiter[..]].concat();
    let next = memmem::Finder::new(&next_delimiter);
    let inside = memmem::Finder::new(&delimiter);
    let header_end = memmem::Finder::new(b"\r\n\r\n");
    let mut parts = Vec::new();
    let start = body
        .iter()
        .take_while(|&&b| matches!(b, b'\r' | b'\n'))
        .count();
    let mut rest = body[start..].strip_prefix(&delimiter[..])?;
    loop {
        if let Some(epilogue) = rest.strip_prefix(b"--") {
            let ends = epilogue.iter().all(|b| matches!(b, b'\r' | b'\n'));
            return ends.then_some(parts);
        }
        rest = rest.strip_prefix(b"\r\n")?;
        let header_end = header_end.find(rest)?;
        let headers = &rest[..header_end];
        let content = &rest[header_end + 4..];
        let end = next.find(content)?;
        if inside.find(&rest[..header_end + 4 + end]).is_some() {
            return None;
        }
        parts.push(Part {
            name: disposition_name(headers)?,
            headers,
            data: &content[..end],
        });
        rest = &content[end + next_delimiter.len()..];
    }
}

/// Whether `b` may be part of a token (RFC 9110, 5.6.2): a header name.
fn is_tchar(b: &u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(b)
}

/// The longest `Content-Disposition` value Rack 3.1 reads
/// (`CONTENT_DISPOSITION_MAX_BYTES`).
const DISPOSITION_MAX_BYTES: usize = 1536;

/// The part's name: its `Content-Disposition`'s one `name` parameter, a
/// token or in double quotes. `None` (the body is malformed) where readers
/// differ on it:
///
/// * a header name that is not a token (Rack 2.1 to 3.0 read the
///   disposition's parameters on into the next header's name, `X;name=…`
///   or `name=…`), `Content-Disposition:` spelled anywhere but at the start
///   of the one disposition line (Rack's pattern finds it inside
///   `X-Content-Disposition:` too), a disposition over 1536 bytes (Rack
///   3.1 ignores it, and names the part by its `Content-ID`), or a `name`
///   that does not follow `;` (Rack's pattern does not read it);
/// * a header line continued on the next (starting with a space or tab) or
///   without `:`, which PHP joins to the line before, or two
///   `Content-Disposition` lines;
/// * `name` twice as a parameter after a space or `;` anywhere in the
///   line, quoted values included (PHP takes the last parameter, Rack's
///   pattern the last ` name=` of the line, so `filename="a; name=b"`
///   names `b`), counting `name =` (Django strips around `=`) and
///   `name*=` (RFC 5987's extended value, which Django and Go prefer), and
///   either of those as the one name;
/// * a name with whitespace or control bytes at either end, or control
///   bytes inside (Django strips the ends);
/// * a `Content-Transfer-Encoding` other than `7bit`, `8bit` or `binary`
///   (Go decodes quoted-printable data, Django base64);
/// * a quoted name holding `\` (an escape to some readers only) or
///   followed by anything but `;`, or an unquoted one that is not a plain
///   token (PHP cuts it at a space, Rack at `[`, and PHP strips `'`).
fn disposition_name(headers: &[u8]) -> Option<&[u8]> {
    const PREFIX: &[u8] = b"content-disposition:";
    let lines = headers
        .split(|&b| b == b'\n')
        .map(|line| line.strip_suffix(b"\r").unwrap_or(line));
    let mut disposition = None;
    for line in lines {
        if line.first().is_none_or(|b| matches!(b, b' ' | b'\t')) || !line.contains(&b':') {
            return None;
        }
        // Rack 2.1 to 3.0 find the name by a pattern over the whole part
        // head, `Content-Disposition:[^:]*;\s*name=…`, anchored nowhere
        // and reading on past the line up to the next `:`: a header named
        // `X;name=_method` (or `name=_method`, after a disposition ending
        // in `;`) names the part, and so does the text after an
        // `X-Content-Disposition:`. So every header name is a token, and
        // `Content-Disposition:` appears only where this reader reads it.
        let name = &line[..memchr::memchr(b':', line).unwrap_or(line.len())];
        if name.is_empty() || !name.iter().all(is_tchar) {
            return None;
        }
        // Go decodes a quoted-printable part (Django a base64 one): its
        // data is not what another reader reads. `7bit`, `8bit` and
        // `binary` (Apache HttpClient writes one on every part) are the
        // data as it is.
        const CODING: &[u8] = b"content-transfer-encoding:";
        let coding = line
            .get(..CODING.len())
            .filter(|name| name.eq_ignore_ascii_case(CODING))
            .map(|_| line[CODING.len()..].trim_ascii());
        if let Some(coding) = coding {
            let identity = [&b"7bit"[..], b"8bit", b"binary"];
            if !identity
                .iter()
                .any(|plain| coding.eq_ignore_ascii_case(plain))
            {
                return None;
            }
        }
        if line.len() > PREFIX.len()
            && line[..PREFIX.len()].eq_ignore_ascii_case(PREFIX)
            && disposition.replace(&line[PREFIX.len()..]).is_some()
        {
            return None;
        }
    }
    let line = disposition?;
    // Rack 3.1 ignores a longer disposition (its `Content-ID` then names
    // the part, or nothing does).
    if line.len() > DISPOSITION_MAX_BYTES {
        return None;
    }
    let spelled = headers
        .windows(PREFIX.len())
        .filter(|window| window.eq_ignore_ascii_case(PREFIX))
        .count();
    if spelled != 1 {
        return None;
    }
    // Every `name` parameter, however spelled: `name=`, `name =`, `name*=`
    // (the cheap tests first: trimming at every position of a disposition
    // of spaces cost the square of its length).
    let mut names = (1..line.len().saturating_sub(3)).filter(|&at| {
        matches!(line[at - 1], b' ' | b'\t' | b';')
            && line[at..at + 4].eq_ignore_ascii_case(b"name")
            && matches!(line[at + 4..].trim_ascii_start().first(), Some(b'=' | b'*'))
    });
    let (Some(at), None) = (names.next(), names.next()) else {
        return None;
    };
    // A parameter follows `;` (and whitespace): Rack's pattern reads no
    // `name` after a space alone (`x="…" name="a"` names nothing to it).
    if line[..at].trim_ascii_end().last() != Some(&b';') {
        return None;
    }
    let value = line[at + 4..].strip_prefix(b"=")?;
    let (name, rest) = match value.strip_prefix(b"\"") {
        Some(quoted) => {
            let end = memchr::memchr(b'"', quoted)?;
            (&quoted[..end], &quoted[end + 1..])
        }
        None => {
            let end = value
                .iter()
                .position(|&b| matches!(b, b';' | b' ' | b'\t'))
                .unwrap_or(value.len());
            let token = &value[..end];
            let plain = |b: &u8| b.is_ascii_alphanumeric() || b"!#$%&*+-.^_`|~".contains(b);
            if token.is_empty() || !token.iter().all(plain) {
                return None;
            }
            (token, &value[end..])
        }
    };
    let rest = rest.trim_ascii_start();
    let ends = rest.is_empty() || rest.starts_with(b";");
    let control = |b: &u8| b.is_ascii_control();
    let trimmed = name.trim_ascii() == name && !name.iter().any(control);
    (ends && trimmed && !name.contains(&b'\\')).then_some(name)
}

/// Splits a JSON pointer (RFC 6901, `/a/b~1c`) into unescaped tokens
/// (`["a", "b/c"]`).
pub fn parse_pointer(pointer: &str) -> Vec<String> {
    pointer
        .split('/')
        .skip(1)
        .map(|token| token.replace("~1", "/").replace("~0", "~"))
        .collect()
}

/// The array index a pointer token names: decimal, without sign or
/// leading zeros (RFC 6901, section 4).
pub(crate) fn array_index(token: &str) -> Option<usize> {
    if token.starts_with('+') || (token.starts_with('0') && token.len() != 1) {
        return None;
    }
    token.parse().ok()
}

/// The value `tokens` (from [`parse_pointer`]) points at in `value`.
pub fn pointer_get<'v>(
    value: &'v serde_json::Value,
    tokens: &[String],
) -> Option<&'v serde_json::Value> {
    tokens.iter().try_fold(value, |value, token| match value {
        serde_json::Value::Object(members) => members.get(token),
        serde_json::Value::Array(items) => items.get(array_index(token)?),
        _ => None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn boundaries_every_reader_agrees_on_are_read_one_way() {
        for content_type in [
            "multipart/form-data; boundary=----WebKitFormBoundary7MA4YWxkTrZu0gW",
            "multipart/form-data; boundary=---------------------------9051914041544843365972754266",
            "multipart/form-data; boundary=\"a quoted one\"",
            "Multipart/Form-Data; BOUNDARY=X",
            "multipart/form-data;boundary=X; charset=utf-8",
        ] {
            assert!(boundary_read_one_way(content_type), "{content_type}");
        }
        for content_type in [
            "multipart/form-data; xboundary=A; boundary=B",
            "multipart/form-data; boundary=A; boundary=B",
            "multipart/form-data; boundaryx=A; boundary=B",
            "multipart/form-data; boundary = B",
            "multipart/form-data; boundary=B ; x=y",
            "multipart/form-data; BOUNDARY=A; boundary=B",
            "multipart/form-data; boundary=\"a;b\"",
        ] {
            assert!(!boundary_read_one_way(content_type), "{content_type}");
        }
    }

    #[test]
    fn a_preamble_or_epilogue_makes_a_multipart_body_malformed() {
        let body = "--B\r\nContent-Disposition: form-data; name=\"a\"\r\n\r\n1\r\n--B--";
        assert!(multipart_parts(body.as_bytes(), "B").is_some());
        assert!(multipart_parts(format!("\r\n{body}\r\n").as_bytes(), "B").is_some());
        assert!(multipart_parts(format!("x\r\n{body}").as_bytes(), "B").is_none());
        assert!(multipart_parts(format!("{body}\r\nx").as_bytes(), "B").is_none());
    }

    #[test]
    fn json_media_types() {
        for json in [
            "application/json",
            "Application/JSON; charset=utf-8",
            "application/problem+json",
            "application/vnd.api+JSON ; q=1",
            "+json",
        ] {
            assert!(is_json(json), "{json}");
        }
        for other in [
            "",
            "json",
            "text/plain",
            "application/jsonx",
            "é+jso",
            "application/json-seq",
        ] {
            assert!(!is_json(other), "{other}");
        }
    }

    #[test]
    fn percent_decoding_edges() {
        assert_eq!(percent_decode(b"%41%4"), b"A%4");
        assert_eq!(percent_decode(b"%"), b"%");
        assert_eq!(percent_decode(b"%zz"), b"%zz");
    }

    #[test]
    fn multipart_parts_and_fields() {
        let body = b"--XyZ\r\nContent-Disposition: form-data; name=\"email\"\r\n\r\na@b.c\r\n--XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.txt\"\r\nContent-Type: text/plain\r\nContent-Transfer-Encoding: binary\r\n\r\nhello\r\n--XyZ--\r\n";
        let parts = multipart_parts(body, "XyZ").unwrap();
        assert_eq!(parts.len(), 2);
        assert_eq!(parts[1].name, b"file");
        assert_eq!(parts[1].data, b"hello");
        assert!(multipart_parts(b"--XyZ\r\ngarbage", "XyZ").is_none());
        let view = View::parse("multipart/form-data; boundary=XyZ", body);
        assert_eq!(view.field("email"), Some(&b"a@b.c"[..]));
        let view = View::parse("multipart/form-data; boundary=Other", body);
        assert!(matches!(view.kind, Kind::BadMultipart));
    }

    /// A body of near-matches of a 70-byte boundary is split as fast as
    /// any other: counted in comparisons, not time, with a search that
    /// would take ~70 per byte if it backtracked.
    #[test]
    fn near_matches_of_the_boundary_stay_linear() {
        let boundary = "b".repeat(70);
        let near = format!("\r\n--{}x", &boundary[..69]);
        let mut body =
            format!("--{boundary}\r\nContent-Disposition: form-data; name=\"f\"\r\n\r\n");
        while body.len() < 1 << 20 {
            body.push_str(&near);
        }
        body.push_str(&format!("\r\n--{boundary}--\r\n"));
        let parts = multipart_parts(body.as_bytes(), &boundary).unwrap();
        assert_eq!(parts.len(), 1);
        assert!(parts[0].data.len() > 1 << 19);
    }

    #[test]
    fn pointers_select_members_and_canonical_indexes() {
        let value: serde_json::Value =
            serde_json::from_str(r#"{"a/b":{"~k":[10,{"x":"y"}]}}"#).unwrap();
        let get = |pointer: &str| pointer_get(&value, &parse_pointer(pointer)).cloned();
        assert_eq!(get("/a~1b/~0k/1/x"), Some("y".into()));
        assert_eq!(get("/a~1b/~0k/0"), Some(10.into()));
        assert_eq!(get("/a~1b/~0k/01"), None);
        assert_eq!(get("/a~1b/~0k/+1"), None);
        assert_eq!(get("/missing"), None);
        let doc = serde_json::json!({"": 1, "x": [2, 3], "/": 4, "~": 5});
        for pointer in ["", "/", "/x", "/x/1", "/x/2", "/x/01", "/~1", "/~0", "/x/-"] {
            let tokens = parse_pointer(pointer);
            assert_eq!(
                doc.pointer(pointer),
                pointer_get(&doc, &tokens),
                "{pointer}"
            );
        }
    }
}
