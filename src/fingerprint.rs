//! The request fingerprint: "is this the same request as the first one?"
//!
//! SHA-256 over the method, the path and query, the selected headers and the
//! body in canonical form:
//!
//! * **JSON** (`application/json`, `*/*+json`): object members sorted by key,
//!   no insignificant whitespace. Strings and numbers are kept exactly as
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
//!   Malformed JSON, or JSON nested deeper than [`MAX_JSON_DEPTH`], is hashed
//!   as raw bytes — never an error, never unbounded recursion.
//! * **Forms** (`application/x-www-form-urlencoded`, `multipart/form-data`):
//!   fields decoded and sorted by name (repeated names keep their order);
//!   configured field names are left out.
//! * anything else: the raw bytes.
//!
//! Every part is length-prefixed, so no two different inputs can be made to
//! hash alike by moving bytes between parts.

use std::ops::Range;

use http::{HeaderMap, HeaderName, Method, Uri};
use sha2::{Digest, Sha256};

use crate::key::{
    content_type, form_pairs, is_json, is_media_type, multipart_boundary, multipart_parts,
};
use crate::store::Fingerprint;

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
    let mut hasher = Sha256::new();
    put(&mut hasher, method.as_str().as_bytes());
    put(
        &mut hasher,
        uri.path_and_query()
            .map_or("/", |pq| pq.as_str())
            .as_bytes(),
    );
    for name in fingerprint_headers {
        for value in headers.get_all(name) {
            put(&mut hasher, name.as_str().as_bytes());
            put(&mut hasher, value.as_bytes());
        }
    }
    let content_type = content_type(headers);
    if is_json(content_type) {
        match canonical_json(body, exclude.json) {
            Some(canonical) => {
                hasher.update(b"J");
                put(&mut hasher, &canonical);
            }
            None => raw(&mut hasher, body),
        }
    } else if is_media_type(content_type, "application/x-www-form-urlencoded") {
        let mut fields: Vec<_> = form_pairs(body)
            .filter(|(name, _)| !excluded(exclude.form, name))
            .collect();
        fields.sort_by(|a, b| a.0.cmp(&b.0));
        hasher.update(b"F");
        for (name, value) in &fields {
            put(&mut hasher, name);
            put(&mut hasher, value);
        }
    } else if let Some(parts) = is_media_type(content_type, "multipart/form-data")
        .then(|| multipart_boundary(content_type))
        .flatten()
        .and_then(|boundary| multipart_parts(body, boundary))
    {
        let mut parts: Vec<_> = parts
            .into_iter()
            .filter(|part| !excluded(exclude.form, part.name))
            .collect();
        parts.sort_by(|a, b| a.name.cmp(b.name));
        hasher.update(b"M");
        for part in &parts {
            put(&mut hasher, part.name);
            put(&mut hasher, part.headers);
            put(&mut hasher, part.data);
        }
    } else {
        raw(&mut hasher, body);
    }
    Fingerprint(hasher.finalize().into())
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

/// Splits a JSON pointer (`/a/b~1c`) into unescaped tokens (`["a", "b/c"]`).
pub fn parse_pointer(pointer: &str) -> Vec<String> {
    pointer
        .split('/')
        .skip(1)
        .map(|token| token.replace("~1", "/").replace("~0", "~"))
        .collect()
}

/// The canonical form of a JSON document: members sorted by key (bytewise,
/// stable), no insignificant whitespace, members at `exclude` pointers
/// removed. `None` when `input` is not JSON (which includes text that is
/// not UTF-8, RFC 8259 section 8.1) or nests deeper than [`MAX_JSON_DEPTH`].
pub fn canonical_json(input: &[u8], exclude: &[Vec<String>]) -> Option<Vec<u8>> {
    std::str::from_utf8(input).ok()?;
    let mut canonical = Canonicalizer {
        input,
        pos: 0,
        out: Vec::with_capacity(input.len()),
        members: Vec::new(),
        scratch: Vec::new(),
        exclude,
        path: Vec::new(),
    };
    canonical.value(0)?;
    canonical.skip_ws();
    (canonical.pos == input.len()).then_some(canonical.out)
}

/// One pass over the input that validates it and writes its canonical form
/// at the same time, without building a tree.
///
/// Object members are written in input order; an object whose keys were
/// not already sorted is then rearranged in place (its members' bytes are
/// moved, not parsed again). A value is so copied once per unsorted object
/// around it: at most [`MAX_JSON_DEPTH`] times.
struct Canonicalizer<'a, 'x> {
    input: &'a [u8],
    pos: usize,
    out: Vec<u8>,
    /// The members of the objects being written, innermost object last.
    members: Vec<Member>,
    /// Room for rearranging an object.
    scratch: Vec<u8>,
    exclude: &'x [Vec<String>],
    /// Where the value being read sits (tracked only when `exclude` is not
    /// empty).
    path: Vec<Segment<'a>>,
}

/// A member written to the output.
struct Member {
    /// Its raw key in the input (without quotes, escapes as written).
    key: Range<usize>,
    /// Its bytes in the output: `"key":value`, without a comma.
    out: Range<usize>,
}

/// One step of the path to the value being read.
enum Segment<'a> {
    Key(&'a [u8]),
    Index(usize),
}

impl<'a> Canonicalizer<'a, '_> {
    fn skip_ws(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.input.get(self.pos) {
            self.pos += 1;
        }
    }

    fn eat(&mut self, byte: u8) -> bool {
        self.skip_ws();
        if self.input.get(self.pos) == Some(&byte) {
            self.pos += 1;
            true
        } else {
            false
        }
    }

    /// Reads one value and writes its canonical form.
    fn value(&mut self, depth: usize) -> Option<()> {
        if depth >= MAX_JSON_DEPTH {
            return None;
        }
        self.skip_ws();
        let start = self.pos;
        match *self.input.get(self.pos)? {
            b'{' => return self.object(depth),
            b'[' => return self.array(depth),
            b'"' => self.string()?,
            b't' => self.literal(b"true")?,
            b'f' => self.literal(b"false")?,
            b'n' => self.literal(b"null")?,
            b'-' | b'0'..=b'9' => self.number()?,
            _ => return None,
        }
        // Strings, numbers and literals are kept exactly as written.
        self.out.extend_from_slice(&self.input[start..self.pos]);
        Some(())
    }

    fn array(&mut self, depth: usize) -> Option<()> {
        self.pos += 1;
        self.out.push(b'[');
        if !self.eat(b']') {
            let mut index = 0;
            loop {
                if index > 0 {
                    self.out.push(b',');
                }
                if self.exclude.is_empty() {
                    self.value(depth + 1)?;
                } else {
                    self.path.push(Segment::Index(index));
                    self.value(depth + 1)?;
                    self.path.pop();
                }
                index += 1;
                if self.eat(b',') {
                    continue;
                }
                if self.eat(b']') {
                    break;
                }
                return None;
            }
        }
        self.out.push(b']');
        Some(())
    }

    fn object(&mut self, depth: usize) -> Option<()> {
        let input = self.input;
        self.pos += 1;
        self.out.push(b'{');
        let start = self.out.len();
        let first = self.members.len();
        let mut sorted = true;
        if !self.eat(b'}') {
            loop {
                self.skip_ws();
                let quoted = self.pos;
                self.string()?;
                let key = quoted + 1..self.pos - 1;
                if !self.eat(b':') {
                    return None;
                }
                let before_comma = self.out.len();
                if self.members.len() > first {
                    self.out.push(b',');
                }
                let member = self.out.len();
                self.out.extend_from_slice(&input[quoted..key.end]);
                self.out.extend_from_slice(b"\":");
                let excluded = if self.exclude.is_empty() {
                    self.value(depth + 1)?;
                    false
                } else {
                    self.path.push(Segment::Key(&input[key.clone()]));
                    let excluded = is_excluded(self.exclude, &self.path);
                    self.value(depth + 1)?;
                    self.path.pop();
                    excluded
                };
                if excluded {
                    self.out.truncate(before_comma);
                } else {
                    if let Some(previous) = self.members[first..].last() {
                        sorted &= input[previous.key.clone()] <= input[key.clone()];
                    }
                    let out = member..self.out.len();
                    self.members.push(Member { key, out });
                }
                if self.eat(b',') {
                    continue;
                }
                if self.eat(b'}') {
                    break;
                }
                return None;
            }
        }
        if !sorted {
            self.sort_members(first, start);
        }
        self.members.truncate(first);
        self.out.push(b'}');
        Some(())
    }

    /// Rewrites the members from `first` on, which were written from
    /// `start`, in key order (stable: duplicate keys keep their order).
    fn sort_members(&mut self, first: usize, start: usize) {
        let input = self.input;
        let members = &mut self.members[first..];
        members.sort_by(|a, b| input[a.key.clone()].cmp(&input[b.key.clone()]));
        self.scratch.clear();
        self.scratch.extend_from_slice(&self.out[start..]);
        self.out.truncate(start);
        for (i, member) in members.iter().enumerate() {
            if i > 0 {
                self.out.push(b',');
            }
            self.out
                .extend_from_slice(&self.scratch[member.out.start - start..member.out.end - start]);
        }
    }

    /// Reads a string token, quotes included.
    fn string(&mut self) -> Option<()> {
        if self.input.get(self.pos) != Some(&b'"') {
            return None;
        }
        self.pos += 1;
        loop {
            // Jump to the next quote or backslash; control bytes are invalid.
            self.pos += find_special(&self.input[self.pos..])?;
            match self.input[self.pos] {
                b'"' => {
                    self.pos += 1;
                    return Some(());
                }
                b'\\' => {
                    let escape = *self.input.get(self.pos + 1)?;
                    match escape {
                        b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => self.pos += 2,
                        b'u' => {
                            let hex = self.input.get(self.pos + 2..self.pos + 6)?;
                            if !hex.iter().all(u8::is_ascii_hexdigit) {
                                return None;
                            }
                            self.pos += 6;
                        }
                        _ => return None,
                    }
                }
                _ => return None,
            }
        }
    }

    fn literal(&mut self, word: &'static [u8]) -> Option<()> {
        let end = self.pos + word.len();
        (self.input.get(self.pos..end)? == word).then(|| self.pos = end)
    }

    fn number(&mut self) -> Option<()> {
        let digits = |p: &mut Self| {
            let from = p.pos;
            while p.input.get(p.pos).is_some_and(u8::is_ascii_digit) {
                p.pos += 1;
            }
            p.pos > from
        };
        if self.input.get(self.pos) == Some(&b'-') {
            self.pos += 1;
        }
        if self.input.get(self.pos) == Some(&b'0') {
            self.pos += 1;
        } else if !digits(self) {
            return None;
        }
        if self.input.get(self.pos) == Some(&b'.') {
            self.pos += 1;
            if !digits(self) {
                return None;
            }
        }
        if let Some(b'e' | b'E') = self.input.get(self.pos) {
            self.pos += 1;
            if let Some(b'+' | b'-') = self.input.get(self.pos) {
                self.pos += 1;
            }
            if !digits(self) {
                return None;
            }
        }
        Some(())
    }
}

/// The offset of the first `"`, `\` or control byte (below 0x20) in
/// `bytes`, looking at eight bytes at a time.
fn find_special(bytes: &[u8]) -> Option<usize> {
    const ONES: u64 = u64::from_ne_bytes([0x01; 8]);
    const HIGHS: u64 = u64::from_ne_bytes([0x80; 8]);
    // The high bit of each byte of `word` that is below `n` (n <= 0x80). A
    // borrow can also flag a byte after a flagged one, never before it, so
    // the lowest flagged byte is always a true match.
    let below = |word: u64, n: u8| word.wrapping_sub(ONES * u64::from(n)) & !word & HIGHS;
    let mut chunks = bytes.chunks_exact(8);
    let mut offset = 0;
    for chunk in &mut chunks {
        let word = u64::from_le_bytes(chunk.try_into().expect("eight bytes"));
        let found = below(word ^ (ONES * u64::from(b'"')), 1)
            | below(word ^ (ONES * u64::from(b'\\')), 1)
            | below(word, 0x20);
        if found != 0 {
            return Some(offset + found.trailing_zeros() as usize / 8);
        }
        offset += 8;
    }
    chunks
        .remainder()
        .iter()
        .position(|&b| b == b'"' || b == b'\\' || b < 0x20)
        .map(|i| offset + i)
}

fn is_excluded(exclude: &[Vec<String>], path: &[Segment<'_>]) -> bool {
    exclude.iter().any(|pointer| {
        pointer.len() == path.len()
            && pointer
                .iter()
                .zip(path)
                .all(|(token, segment)| match segment {
                    Segment::Key(key) => token.as_bytes() == *key,
                    Segment::Index(i) => token.parse() == Ok(*i),
                })
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

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
