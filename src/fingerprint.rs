//! The request fingerprint: "is this the same request as the first one?"
//!
//! SHA-256 over the method, the path (normalised, see
//! [`normalize_path`](crate::policy::normalize_path)) and query, the
//! selected headers (a multipart `Content-Type` without its `boundary`),
//! the headers naming a method or a path for the backend, and the body in
//! canonical form:
//!
//! * **JSON** (`application/json`, `*/*+json`): object members sorted by
//!   their decoded key (`"\u0061"` sorts as `"a"`), no insignificant
//!   whitespace. Strings and numbers are kept exactly as
//!   written, so `1.0` and `1`, or `"é"` and `"\u00e9"`, count as different
//!   requests (a mismatch is answered, never a wrong replay). Configured
//!   JSON pointers are left out.
//! * **Duplicate JSON keys** are all kept, and members with the same key
//!   keep their relative order (the sort is stable). RFC 8259 leaves their
//!   meaning to the receiver, and most backends (serde_json, JavaScript)
//!   take the last one, some the first: `{"a":1,"a":2}` and `{"a":2,"a":1}`
//!   may mean different things, so they are **different requests** (the
//!   second one with the same key gets a mismatch, never the first one's
//!   response). Moving a duplicated member past *other* keys does not
//!   change the fingerprint: `{"a":1,"b":0,"a":2}` equals `{"b":0,"a":1,"a":2}`.
//!   Keys are compared as a parser reads them, so differently escaped
//!   spellings of one key are duplicates too: `{"amount":10,"\u0061mount":1000}`
//!   and `{"\u0061mount":1000,"amount":10}` are different requests. So are
//!   keys equal but for case, which Go's `encoding/json` matches to one
//!   field (last wins): members are sorted by their keys folded, stably,
//!   so `{"amount":1000,"Amount":10}` and `{"Amount":10,"amount":1000}`
//!   differ too.
//!   Malformed JSON, or JSON nested deeper than [`MAX_JSON_DEPTH`], is hashed
//!   as raw bytes — never an error, never unbounded recursion.
//! * **Forms** (`application/x-www-form-urlencoded`, `multipart/form-data`):
//!   fields decoded and sorted by name (repeated names keep their order,
//!   and so do names PHP reads as one, such as `a.b` and `a_b`);
//!   configured field names are left out. Kept in the order sent: a form
//!   with a name holding a space, `.`, `[`, `]`, NUL or a byte outside
//!   ASCII, one of more than 1000 fields sent or more than 20 file parts
//!   (PHP's input limits). Hashed raw: a form read more than one way (see
//!   [`formats`]), one that opens as JSON does (`curl -d`).
//! * anything else: the raw bytes.
//!
//! The engine hashes this fingerprint once more with a route's
//! `fingerprint_version` when one is set
//! ([`Fingerprint::versioned`](crate::store::Fingerprint::versioned)).
//!
//! Every part is length-prefixed, so no two different inputs can be made to
//! hash alike by moving bytes between parts.

use http::{header, HeaderMap, HeaderName, Method, Uri};
use sha2::{Digest, Sha256};

use crate::formats::{self, Kind, View};
use crate::store::Fingerprint;

pub use crate::formats::parse_pointer;

pub(crate) mod json;
#[cfg(test)]
mod reference;

pub use json::canonical_json;
use json::{canonicalize, Buffers};

/// JSON nested deeper than this is hashed as raw bytes.
pub const MAX_JSON_DEPTH: usize = 128;

/// What to leave out of a fingerprint.
#[derive(Clone, Copy, Debug, Default)]
pub struct Exclusions<'a> {
    /// Parsed JSON pointers (see [`parse_pointer`]).
    pub json: &'a [Vec<String>],
    /// Form field names.
    pub form: &'a [String],
}

/// Fingerprints a request.
pub fn fingerprint(
    method: &Method,
    uri: &Uri,
    headers: &HeaderMap,
    fingerprint_headers: &[HeaderName],
    body: &[u8],
    exclude: Exclusions<'_>,
) -> Fingerprint {
    let view = View::parse(formats::content_type(headers), body);
    fingerprint_view(method, uri, headers, fingerprint_headers, &view, exclude)
}

/// [`fingerprint`] of a body already parsed into a [`View`] (the engine
/// parses a body once for the key and the fingerprint).
pub fn fingerprint_view(
    method: &Method,
    uri: &Uri,
    headers: &HeaderMap,
    fingerprint_headers: &[HeaderName],
    body: &View<'_>,
    exclude: Exclusions<'_>,
) -> Fingerprint {
    let mut hasher = Sha256::new();
    put(&mut hasher, crate::policy::method_name(method).as_bytes());
    // The path in the form it is routed and scoped by: two spellings of
    // one path are the same request.
    let path = crate::policy::normalize_path(uri.path(), false);
    match uri.query() {
        Some(query) => put(&mut hasher, format!("{path}?{query}").as_bytes()),
        None => put(&mut hasher, path.as_bytes()),
    }
    // A body whose type backends read more than one way is hashed raw; so
    // is a form whose fields they decode differently, and a body sent
    // encoded (its bytes are not the fields or document a backend reads
    // once it inflates them).
    let encoded = crate::engine::headers::lists_coding_other_than(
        headers,
        &header::CONTENT_ENCODING,
        b"identity",
    );
    let kind = match &body.kind {
        _ if encoded || formats::read_more_than_one_way(headers) => &Kind::Opaque,
        Kind::Form(_) if !formats::form_read_one_way(body.bytes) => &Kind::Opaque,
        kind => kind,
    };
    for name in fingerprint_headers {
        for value in headers.get_all(name) {
            put(&mut hasher, name.as_str().as_bytes());
            match kind {
                // Hashed by its parts, a multipart body is the same request
                // whatever boundary framed it: browsers, curl and Python's
                // `requests` draw a new one for every submission.
                Kind::Multipart(_) if name == header::CONTENT_TYPE => {
                    put(&mut hasher, &without_boundary(value.as_bytes()))
                }
                _ => put(&mut hasher, value.as_bytes()),
            }
        }
    }
    // The method a `POST` names in an override header is the one backends
    // run, whichever method the engine covers it as, and the path a header
    // names for the backend (`SCRIPT_NAME`, `X-Original-Url`) picks its
    // handler: a retry naming another (or none) is another request. Both
    // kinds found in one pass over the headers.
    for (name, value) in headers {
        let names = formats::method_override(name) || formats::path_header(name).is_some();
        if names && !fingerprint_headers.contains(name) {
            put(&mut hasher, name.as_str().as_bytes());
            put(&mut hasher, value.as_bytes());
        }
    }
    // A body sent encoded is another request than its bytes sent as they
    // are: a backend that inflates it reads other content.
    if !fingerprint_headers.contains(&header::CONTENT_ENCODING) {
        for value in headers.get_all(header::CONTENT_ENCODING) {
            put(&mut hasher, header::CONTENT_ENCODING.as_str().as_bytes());
            put(&mut hasher, value.as_bytes());
        }
    }
    match kind {
        Kind::Json => match canonicalize(body.bytes, exclude.json, true, Buffers::take()) {
            Some(canonical) => {
                hasher.update(b"J");
                canonical.hash_into(&mut hasher);
                canonical.into_buffers().keep();
            }
            None => raw(&mut hasher, body.bytes),
        },
        Kind::Form(pairs) => {
            let mut fields: Vec<_> = pairs
                .iter()
                .filter(|(name, _)| !excluded(exclude.form, name))
                .collect();
            // PHP counts every `&`-separated segment sent, empty and
            // excluded ones too.
            let sent = memchr::memchr_iter(b'&', body.bytes).count() + 1;
            if sent <= MAX_SORTED_FIELDS {
                sort_as_backends_read(&mut fields, |field| &field.0);
            }
            hasher.update(b"F");
            for (name, value) in fields {
                put(&mut hasher, name);
                put(&mut hasher, value);
            }
        }
        Kind::Multipart(sent) => {
            let mut parts: Vec<_> = sent
                .iter()
                .filter(|part| !excluded(exclude.form, part.name))
                .collect();
            // PHP takes the first `max_file_uploads` (20) files and skips
            // the rest: which ones it skips depends on the order sent. It
            // counts the parts sent, excluded ones too, and reads
            // parameter names without regard to case (`FILENAME=`).
            let files = sent
                .iter()
                .filter(|part| {
                    part.headers
                        .windows(b"filename".len())
                        .any(|w| w.eq_ignore_ascii_case(b"filename"))
                })
                .count();
            if files <= MAX_SORTED_FILES && sent.len() <= MAX_SORTED_FIELDS {
                sort_as_backends_read(&mut parts, |part| part.name);
            }
            hasher.update(b"M");
            for part in &parts {
                put(&mut hasher, part.name);
                put(&mut hasher, part.headers);
                put(&mut hasher, part.data);
            }
        }
        Kind::BadMultipart | Kind::Opaque => raw(&mut hasher, body.bytes),
    }
    Fingerprint(hasher.finalize().into())
}

/// The most fields a form may have and still be sorted: PHP registers the
/// first `max_input_vars` (default 1000) and drops the rest, so past that
/// the order sent decides which fields the backend reads.
const MAX_SORTED_FIELDS: usize = 1000;

/// The most file parts a multipart body may have and still be sorted: PHP
/// takes the first `max_file_uploads` (default 20) and skips the rest.
const MAX_SORTED_FILES: usize = 20;

/// Sorts form fields by name (ASCII case ignored, stably: ASP.NET reads
/// `Amount` and `amount` as one field), or keeps them in the order sent
/// when any name holds anything but ASCII letters, digits, `_` and `-`
/// (its callers keep forms of more than [`MAX_SORTED_FIELDS`] in
/// order too): a space, `.`, `[`, `]`, NUL or a byte outside ASCII, and
/// the `/*`, `:` or `"` of a JSON body a lenient parser reads past a
/// comment (`/*x=*/{"amount":10,…}` under a form label). Such names
/// are read as one field, or as parts of one value, in ways that differ
/// between backends (PHP reads `a.b`, `a b` and `a_b` as one, and cuts a
/// name at NUL; Rack reads `[a]`, `a]` and `a` as one; PHP, Rack and `qs`
/// build one array from `items[][sku]` and `items[][qty]`; ASP.NET reads
/// `étage` and `ÉTAGE` as one, folding case beyond ASCII), and there the
/// order of the fields decides what the backend reads (the first or the
/// last one wins, or the array's shape): any reordering is another
/// request. The raw names are what is hashed.
fn sort_as_backends_read<T>(fields: &mut [T], name: impl Fn(&T) -> &[u8]) {
    let plain = |b: &u8| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-');
    let mangled = fields.iter().any(|field| !name(field).iter().all(plain));
    if !mangled {
        fields.sort_by(|a, b| {
            let folded = |field| name(field).iter().map(u8::to_ascii_lowercase);
            folded(a).cmp(folded(b))
        });
    }
}

/// A multipart content type without its `boundary` parameter (in any
/// case), its other parameters as sent.
fn without_boundary(content_type: &[u8]) -> Vec<u8> {
    let mut kept = Vec::with_capacity(content_type.len());
    for (i, piece) in content_type.split(|&b| b == b';').enumerate() {
        let name = piece.split(|&b| b == b'=').next().unwrap_or_default();
        if i > 0 && name.trim_ascii().eq_ignore_ascii_case(b"boundary") {
            continue;
        }
        if i > 0 {
            kept.push(b';');
        }
        kept.extend_from_slice(piece);
    }
    kept
}

fn excluded(names: &[String], name: &[u8]) -> bool {
    names.iter().any(|n| n.as_bytes() == name)
}

fn raw(hasher: &mut Sha256, body: &[u8]) {
    hasher.update(b"R");
    put(hasher, body);
}

fn put(hasher: &mut Sha256, bytes: &[u8]) {
    hasher.update((bytes.len() as u64).to_be_bytes());
    hasher.update(bytes);
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    /// A fingerprint is a stored format: a change to its bytes would make
    /// every retry after an upgrade a mismatch (422). Built here by hand
    /// from the module's description (each part length-prefixed,
    /// big-endian u64; the body tagged `R`, `F` or `J`), with SHA-256
    /// directly, not by the code under test.
    #[test]
    fn the_fingerprint_is_the_documented_hash_of_its_parts() {
        let part = |bytes: &[u8]| {
            let mut out = (bytes.len() as u64).to_be_bytes().to_vec();
            out.extend_from_slice(bytes);
            out
        };
        let digest = |pieces: &[Vec<u8>]| -> [u8; 32] { Sha256::digest(pieces.concat()).into() };
        let typed = |content_type: &'static str| {
            let mut headers = HeaderMap::new();
            headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
            headers
        };
        let of = |headers: &HeaderMap, names: &[HeaderName], path: &'static str, body: &str| {
            fingerprint(
                &Method::POST,
                &Uri::from_static(path),
                headers,
                names,
                body.as_bytes(),
                Exclusions::default(),
            )
            .0
        };
        // Raw bytes, the path normalised, the query kept.
        let raw = typed("application/octet-stream");
        assert_eq!(
            of(&raw, &[], "/upload//x/?v=2", "abc"),
            digest(&[
                part(b"POST"),
                part(b"/upload/x?v=2"),
                b"R".to_vec(),
                part(b"abc")
            ])
        );
        // A form: fields sorted by name; a fingerprinted header first.
        let form = typed("application/x-www-form-urlencoded");
        assert_eq!(
            of(&form, &[header::CONTENT_TYPE], "/contact", "b=2&a=%31"),
            digest(&[
                part(b"POST"),
                part(b"/contact"),
                part(b"content-type"),
                part(b"application/x-www-form-urlencoded"),
                b"F".to_vec(),
                part(b"a"),
                part(b"1"),
                part(b"b"),
                part(b"2"),
            ])
        );
        // JSON: members sorted, whitespace gone, the canonical text
        // length-prefixed.
        let json = typed("application/json");
        assert_eq!(
            of(&json, &[], "/orders", r#"{ "b": [1, 2], "a": "x" }"#),
            digest(&[
                part(b"POST"),
                part(b"/orders"),
                b"J".to_vec(),
                part(br#"{"a":"x","b":[1,2]}"#),
            ])
        );
    }

    fn canonical(input: &str) -> Option<String> {
        canonical_json(input.as_bytes(), &[]).map(|v| String::from_utf8(v).unwrap())
    }

    fn json_fp(body: &str, exclude: &[&str]) -> Fingerprint {
        let mut headers = HeaderMap::new();
        headers.insert(
            http::header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        let pointers: Vec<_> = exclude.iter().map(|p| parse_pointer(p)).collect();
        fingerprint(
            &Method::POST,
            &Uri::from_static("/orders"),
            &headers,
            &[http::header::CONTENT_TYPE],
            body.as_bytes(),
            Exclusions {
                json: &pointers,
                form: &[],
            },
        )
    }

    fn multipart_fp(boundary: &str, parts: &[(&str, &str)], extra: &str) -> Fingerprint {
        let mut headers = HeaderMap::new();
        let content_type = format!("multipart/form-data; boundary={boundary}{extra}");
        headers.insert(
            http::header::CONTENT_TYPE,
            HeaderValue::from_str(&content_type).unwrap(),
        );
        let mut body = String::new();
        for (name, data) in parts {
            body.push_str(&format!(
                "--{boundary}\r\nContent-Disposition: form-data; name=\"{name}\"\r\n\r\n{data}\r\n"
            ));
        }
        body.push_str(&format!("--{boundary}--\r\n"));
        fingerprint(
            &Method::POST,
            &Uri::from_static("/uploads"),
            &headers,
            &[http::header::CONTENT_TYPE],
            body.as_bytes(),
            Exclusions::default(),
        )
    }

    /// Browsers draw a new boundary for every submission of a multipart
    /// form: a double click sent the same parts under two boundaries, and
    /// the second got 422 (a changed request). The boundary is no part of
    /// the fingerprint; the parts and the other parameters are.
    #[test]
    fn a_multipart_body_is_the_same_request_under_any_boundary() {
        let parts = [("title", "Report"), ("amount", "12")];
        let first = multipart_fp("----WebKitFormBoundaryAAA", &parts, "");
        assert_eq!(first, multipart_fp("----WebKitFormBoundaryBBB", &parts, ""));
        let changed = [("title", "Report"), ("amount", "13")];
        assert_ne!(
            first,
            multipart_fp("----WebKitFormBoundaryBBB", &changed, "")
        );
        assert_ne!(first, multipart_fp("b", &parts, "; charset=utf-8"));
        assert_eq!(
            multipart_fp("a", &parts, "; charset=utf-8"),
            multipart_fp("b", &parts, "; charset=utf-8")
        );
        // Under another charset (which Django decodes values by) the body
        // is compared as sent: its boundary is part of it then.
        assert_ne!(
            multipart_fp("a", &parts, "; charset=latin1"),
            multipart_fp("b", &parts, "; charset=latin1")
        );
    }

    /// PHP's `max_input_vars` counts every field sent: a form of 1001
    /// fields, one of them excluded from the fingerprint (a CSRF token),
    /// is past it, and its order decides which field PHP drops.
    #[test]
    fn a_form_past_phps_limit_counting_excluded_fields_keeps_its_order() {
        let mut headers = HeaderMap::new();
        headers.insert(
            http::header::CONTENT_TYPE,
            HeaderValue::from_static("application/x-www-form-urlencoded"),
        );
        let exclude = ["_token".to_owned()];
        let fp = |body: String| {
            fingerprint(
                &Method::POST,
                &Uri::from_static("/contact"),
                &headers,
                &[http::header::CONTENT_TYPE],
                body.as_bytes(),
                Exclusions {
                    json: &[],
                    form: &exclude,
                },
            )
        };
        let many: Vec<String> = (0..999).map(|n| format!("f{n:04}=1")).collect();
        let many = many.join("&");
        assert_ne!(
            fp(format!("_token=t&{many}&note=gift")),
            fp(format!("_token=t&note=gift&{many}"))
        );
        // PHP counts empty segments too: 998 fields, two empty, the note.
        let fewer: Vec<String> = (0..998).map(|n| format!("f{n:04}=1")).collect();
        let fewer = fewer.join("&");
        assert_ne!(
            fp(format!("{fewer}&&&note=gift")),
            fp(format!("note=gift&&&{fewer}"))
        );
        // Within the limit, the order does not matter.
        let few = "_token=t&b=2&a=1".to_owned();
        assert_eq!(fp(few), fp("a=1&_token=t&b=2".to_owned()));
    }

    #[test]
    fn canonical_json_sorts_and_strips_whitespace() {
        assert_eq!(
            canonical(r#" { "b" : [ 1 , {"z":true,"a":null} ], "a":"x y" } "#).unwrap(),
            r#"{"a":"x y","b":[1,{"a":null,"z":true}]}"#
        );
        assert_eq!(
            canonical("12345678901234567890123").unwrap(),
            "12345678901234567890123"
        );
        assert_eq!(canonical(r#"{"a":1,"a":2}"#).unwrap(), r#"{"a":1,"a":2}"#);
    }

    #[test]
    fn members_sort_by_their_decoded_keys() {
        // Sorted as "a" < "b", written as they came.
        assert_eq!(
            canonical(r#"{"b":1,"\u0061":2}"#).unwrap(),
            r#"{"\u0061":2,"b":1}"#
        );
        // Spellings of one key are duplicates: their order is kept.
        assert_eq!(
            canonical(r#"{"\u0061mount":1000,"amount":10}"#).unwrap(),
            r#"{"\u0061mount":1000,"amount":10}"#
        );
        assert_ne!(
            json_fp(r#"{"amount":10,"\u0061mount":1000}"#, &[]),
            json_fp(r#"{"\u0061mount":1000,"amount":10}"#, &[])
        );
        // Code point order: U+E000 before U+1F600 (UTF-16 order would
        // differ); a lone surrogate sorts as U+FFFD, as parsers read it.
        assert_eq!(
            canonical(r#"{"\ud83d\ude00":1,"\ue000":2,"\ud800":3}"#).unwrap(),
            r#"{"\ue000":2,"\ud800":3,"\ud83d\ude00":1}"#
        );
        // An excluded field is excluded however its key is spelled.
        assert_eq!(
            json_fp(r#"{"a":1,"\u006deta":{"sent_at":"1"}}"#, &["/meta/sent_at"]),
            json_fp(r#"{"a":1,"\u006deta":{"sent_at":"2"}}"#, &["/meta/sent_at"])
        );
    }

    #[test]
    fn malformed_json_is_refused() {
        for bad in [
            "",
            "{",
            r#"{"a"}"#,
            "[1,]",
            "01",
            "1.",
            "tru",
            "\"\u{1}\"",
            r#""\x""#,
            "{} x",
        ] {
            assert!(canonical(bad).is_none(), "{bad:?} should not parse");
        }
        assert!(canonical_json(b"\"\xff\"", &[]).is_none(), "not UTF-8");
    }

    #[test]
    fn deep_nesting_is_bounded() {
        let deep = "[".repeat(100_000) + &"]".repeat(100_000);
        assert!(canonical(&deep).is_none());
        let ok = "[".repeat(MAX_JSON_DEPTH - 1) + &"]".repeat(MAX_JSON_DEPTH - 1);
        assert!(canonical(&ok).is_some());
        // It still fingerprints (as raw bytes), without overflowing the stack.
        assert_ne!(json_fp(&deep, &[]), json_fp(&ok, &[]));
    }

    #[test]
    fn key_order_and_whitespace_do_not_matter() {
        assert_eq!(
            json_fp(r#"{"amount":10,"currency":"EUR"}"#, &[]),
            json_fp("{\n  \"currency\": \"EUR\",\n  \"amount\": 10\n}", &[])
        );
        assert_ne!(
            json_fp(r#"{"amount":10,"currency":"EUR"}"#, &[]),
            json_fp(r#"{"amount":11,"currency":"EUR"}"#, &[])
        );
        // Huge numbers that are equal as f64 still differ here.
        assert_ne!(
            json_fp(r#"{"n":12345678901234567890123}"#, &[]),
            json_fp(r#"{"n":12345678901234567890124}"#, &[])
        );
    }

    #[test]
    fn excluded_fields_are_ignored() {
        let exclude = ["/meta/sent_at", "/items/0/trace"];
        assert_eq!(
            json_fp(
                r#"{"a":1,"meta":{"sent_at":"10:00"},"items":[{"trace":"x","q":1}]}"#,
                &exclude
            ),
            json_fp(
                r#"{"a":1,"meta":{"sent_at":"10:05"},"items":[{"trace":"y","q":1}]}"#,
                &exclude
            )
        );
        assert_ne!(
            json_fp(r#"{"a":1,"meta":{"sent_at":"10:00"}}"#, &exclude),
            json_fp(r#"{"a":2,"meta":{"sent_at":"10:05"}}"#, &exclude)
        );
    }

    #[test]
    fn forms_are_sorted_and_filtered() {
        let mut headers = HeaderMap::new();
        headers.insert(
            http::header::CONTENT_TYPE,
            HeaderValue::from_static("application/x-www-form-urlencoded"),
        );
        let exclude = vec!["_token".to_owned()];
        let fp = |body: &str| {
            fingerprint(
                &Method::POST,
                &Uri::from_static("/contact"),
                &headers,
                &[],
                body.as_bytes(),
                Exclusions {
                    json: &[],
                    form: &exclude,
                },
            )
        };
        assert_eq!(fp("a=1&b=2&_token=x"), fp("_token=y&b=2&a=1"));
        assert_ne!(fp("a=1&b=2"), fp("a=1&b=3"));
        assert_ne!(fp("t=1&t=2"), fp("t=2&t=1"));
        // Names PHP or Rack read as one keep their order, whatever their
        // spelling; so does every field of a form that holds such a name.
        assert_ne!(fp("a.b=1&a_b=2"), fp("a_b=2&a.b=1"));
        assert_ne!(fp("a%20b=1&a_b=2"), fp("a_b=2&a%20b=1"));
        assert_ne!(fp("a[b=1&a_b=2"), fp("a_b=2&a[b=1"));
        assert_ne!(fp("a]=1&a=2"), fp("a=2&a]=1"));
        assert_ne!(fp("[a]=1&a=2"), fp("a=2&[a]=1"));
        assert_ne!(fp("a%00x=1&a=2"), fp("a=2&a%00x=1"));
        assert_ne!(fp("x[]=1&a=2"), fp("a=2&x[]=1"));
        // Names equal but for case keep their order; other names sort.
        assert_ne!(fp("Amount=1&amount=2"), fp("amount=2&Amount=1"));
        assert_eq!(fp("b=1&Amount=2&c=3"), fp("c=3&b=1&Amount=2"));
    }

    #[test]
    fn method_path_and_body_kind_matter() {
        let headers = HeaderMap::new();
        let fp = |method: &Method, uri: &'static str, body: &[u8]| {
            fingerprint(
                method,
                &Uri::from_static(uri),
                &headers,
                &[],
                body,
                Exclusions::default(),
            )
        };
        assert_ne!(
            fp(&Method::POST, "/a", b"x"),
            fp(&Method::PATCH, "/a", b"x")
        );
        assert_ne!(
            fp(&Method::POST, "/a", b"x"),
            fp(&Method::POST, "/a?q=1", b"x")
        );
        assert_eq!(fp(&Method::POST, "/a", b"x"), fp(&Method::POST, "/a", b"x"));
    }
}
