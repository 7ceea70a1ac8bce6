//! Property tests for the parsers every request goes through: canonical
//! JSON, the key parser, the form and multipart parsers. Case counts are
//! modest so the whole file runs in seconds.

use std::collections::BTreeMap;

use http::{header, HeaderMap, HeaderName, HeaderValue, Method, Uri};
use proptest::prelude::*;
use tower_idempotency::fingerprint::{canonical_json, fingerprint, Exclusions};
use tower_idempotency::key::{extract, validate};
use tower_idempotency::store::Fingerprint;
use tower_idempotency::KeySource;

/// A JSON value with unique object keys, serialized by hand so key order
/// and whitespace can vary.
#[derive(Clone, Debug)]
enum Json {
    Null,
    Bool(bool),
    /// A number, as written.
    Number(String),
    String(String),
    Array(Vec<Json>),
    Object(BTreeMap<String, Json>),
}

fn number() -> impl Strategy<Value = String> {
    prop_oneof![
        any::<i64>().prop_map(|n| n.to_string()),
        any::<f64>()
            .prop_filter("finite", |f| f.is_finite())
            .prop_map(|f| f.to_string()),
        (any::<i32>(), 0u32..1000, -300i32..300).prop_map(|(i, f, e)| format!("{i}.{f}e{e}")),
        "[1-9][0-9]{20,40}",
    ]
}

fn json() -> impl Strategy<Value = Json> {
    let leaf = prop_oneof![
        Just(Json::Null),
        any::<bool>().prop_map(Json::Bool),
        number().prop_map(Json::Number),
        any::<String>().prop_map(Json::String),
    ];
    leaf.prop_recursive(4, 48, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Json::Array),
            prop::collection::btree_map(any::<String>(), inner, 0..6)
                .prop_map(|members| Json::Object(without_folded_twins(members))),
        ]
    })
}

/// Case-insensitive readers (Go's `encoding/json`, .NET's
/// `OrdinalIgnoreCase`) read keys equal but for case as one field, the
/// last winning, so README keeps such keys in the order sent: `members`
/// without a key that folds like an earlier one (an independent fold,
/// coarser than any reader's: upper-cased, then lower-cased), so that
/// any order of what is left means the same to every reader.
fn without_folded_twins(members: BTreeMap<String, Json>) -> BTreeMap<String, Json> {
    let mut seen = std::collections::HashSet::new();
    members
        .into_iter()
        .filter(|(key, _)| seen.insert(fold(key)))
        .collect()
}

/// The members of the JSON object `text` in the order sent, as serde's
/// streaming reader meets them (its `Value` would sort them).
fn members_in_order(text: &str) -> Vec<(String, serde_json::Value)> {
    struct Members;
    impl<'de> serde::de::Visitor<'de> for Members {
        type Value = Vec<(String, serde_json::Value)>;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("an object")
        }
        fn visit_map<M: serde::de::MapAccess<'de>>(
            self,
            mut map: M,
        ) -> Result<Self::Value, M::Error> {
            let mut members = Vec::new();
            while let Some(member) = map.next_entry()? {
                members.push(member);
            }
            Ok(members)
        }
    }
    let mut reader = serde_json::Deserializer::from_str(text);
    serde::Deserializer::deserialize_map(&mut reader, Members).unwrap()
}

fn fold(key: &str) -> String {
    key.chars()
        .flat_map(char::to_uppercase)
        .flat_map(char::to_lowercase)
        .collect()
}

/// A tiny deterministic generator driving key order and whitespace.
struct Tape(u64);

impl Tape {
    fn next(&mut self) -> u64 {
        // xorshift64*
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn space(&mut self) -> &'static str {
        ["", "", " ", "\n", "\t", "\r\n  "][(self.next() % 6) as usize]
    }
}

fn quoted(s: &str) -> String {
    serde_json::to_string(s).unwrap()
}

/// Writes `value` with object members in a tape-chosen order and
/// tape-chosen whitespace between tokens.
fn write(value: &Json, tape: &mut Tape, out: &mut String) {
    out.push_str(tape.space());
    match value {
        Json::Null => out.push_str("null"),
        Json::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Json::Number(n) => out.push_str(n),
        Json::String(s) => out.push_str(&quoted(s)),
        Json::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write(item, tape, out);
            }
            out.push_str(tape.space());
            out.push(']');
        }
        Json::Object(members) => {
            let mut members: Vec<_> = members.iter().collect();
            // Fisher-Yates with the tape.
            for i in (1..members.len()).rev() {
                members.swap(i, (tape.next() % (i as u64 + 1)) as usize);
            }
            out.push('{');
            for (i, (key, value)) in members.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(tape.space());
                out.push_str(&quoted(key));
                out.push_str(tape.space());
                out.push(':');
                write(value, tape, out);
            }
            out.push_str(tape.space());
            out.push('}');
        }
    }
    out.push_str(tape.space());
}

fn serialize(value: &Json, seed: u64) -> String {
    let mut out = String::new();
    write(value, &mut Tape(seed | 1), &mut out);
    out
}

/// How many leaves (scalars and empty containers) `value` has.
fn leaves(value: &Json) -> usize {
    match value {
        Json::Array(items) if !items.is_empty() => items.iter().map(leaves).sum(),
        Json::Object(members) if !members.is_empty() => members.values().map(leaves).sum(),
        _ => 1,
    }
}

/// Replaces leaf number `n` (depth first) with a different value.
fn change_leaf(value: &mut Json, n: &mut usize) -> bool {
    let children: Vec<&mut Json> = match value {
        Json::Array(items) if !items.is_empty() => items.iter_mut().collect(),
        Json::Object(members) if !members.is_empty() => members.values_mut().collect(),
        _ => {
            if *n > 0 {
                *n -= 1;
                return false;
            }
            *value = match value {
                Json::Null => Json::Bool(false),
                Json::Bool(b) => Json::Bool(!*b),
                Json::Number(_) => Json::Null,
                Json::String(s) => Json::String(format!("{s}x")),
                Json::Array(_) => Json::Array(vec![Json::Null]),
                Json::Object(_) => Json::Object(BTreeMap::from([("k".into(), Json::Null)])),
            };
            return true;
        }
    };
    children.into_iter().any(|child| change_leaf(child, n))
}

fn fingerprint_as(content_type: &str, body: &[u8]) -> Fingerprint {
    let mut headers = HeaderMap::new();
    headers.insert(header::CONTENT_TYPE, content_type.parse().unwrap());
    fingerprint(
        &Method::POST,
        &Uri::from_static("/orders"),
        &headers,
        &[header::CONTENT_TYPE],
        body,
        Exclusions::default(),
    )
}

fn json_fp(body: &str) -> Fingerprint {
    fingerprint_as("application/json", body.as_bytes())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn key_order_and_whitespace_never_change_the_fingerprint(
        value in json(), a in any::<u64>(), b in any::<u64>()
    ) {
        let (first, second) = (serialize(&value, a), serialize(&value, b));
        prop_assert_eq!(
            canonical_json(first.as_bytes(), &[]),
            canonical_json(second.as_bytes(), &[])
        );
        prop_assert_eq!(json_fp(&first), json_fp(&second));
    }

    /// Two members whose keys fold alike (`amount`/`Amount`, `sku`/`ſku`,
    /// `kind`/`Kind` with Kelvin's `K`) are one field to a last-wins
    /// case-insensitive reader, so swapping them changes what it reads:
    /// the two orders are two requests, never one fingerprint.
    #[test]
    fn keys_that_fold_alike_in_another_order_are_another_request(
        base in "[a-z]{1,6}", twist in any::<u64>(), first in any::<i32>(), second in any::<i32>(),
        a in any::<u64>(), b in any::<u64>()
    ) {
        prop_assume!(first != second);
        let mut tape = Tape(twist | 1);
        let twin: String = base
            .chars()
            .enumerate()
            .map(|(at, c)| match (at, c, tape.next() % 3) {
                (_, 's', 0) => 'ſ',
                (_, 'k', 0) => '\u{212a}',
                (0, c, _) | (_, c, 1) => c.to_ascii_uppercase(),
                (_, c, _) => c,
            })
            .collect();
        prop_assert_ne!(&twin, &base);
        prop_assert_eq!(fold(&twin), fold(&base));
        let body = |order: [(&str, i32); 2], seed: u64| {
            let mut tape = Tape(seed | 1);
            let members: Vec<String> = order
                .iter()
                .map(|(key, value)| format!("{}{}:{}{value}", quoted(key), tape.space(), tape.space()))
                .collect();
            format!("{{\"other\":1,{}}}", members.join(","))
        };
        let one = body([(&base, first), (&twin, second)], a);
        let other = body([(&twin, second), (&base, first)], b);
        // The oracle: a last-wins reader folding keys reads `second`, then
        // `first`.
        let read = |text: &str| {
            members_in_order(text)
                .into_iter()
                .rfind(|(key, _)| fold(key) == fold(&base))
                .and_then(|(_, value)| value.as_i64())
        };
        prop_assert_eq!(read(&one), Some(i64::from(second)));
        prop_assert_eq!(read(&other), Some(i64::from(first)));
        prop_assert_ne!(json_fp(&one), json_fp(&other));
    }

    #[test]
    fn any_changed_leaf_changes_the_fingerprint(
        value in json(), pick in any::<usize>(), a in any::<u64>(), b in any::<u64>()
    ) {
        let mut changed = value.clone();
        let mut n = pick % leaves(&value);
        prop_assert!(change_leaf(&mut changed, &mut n));
        prop_assert_ne!(json_fp(&serialize(&value, a)), json_fp(&serialize(&changed, b)));
    }

    #[test]
    fn canonical_json_means_the_same_as_its_input(value in json(), seed in any::<u64>()) {
        let text = serialize(&value, seed);
        let canonical = canonical_json(text.as_bytes(), &[]).expect("valid JSON is canonicalised");
        let parsed: Result<serde_json::Value, _> = serde_json::from_slice(&canonical);
        match serde_json::from_str::<serde_json::Value>(&text) {
            Ok(input) => prop_assert_eq!(parsed.unwrap(), input),
            // serde_json refuses numbers out of f64 range; we keep them as written.
            Err(error) => prop_assert!(error.to_string().contains("out of range"), "{}", error),
        }
        // Canonical output is a fixed point.
        prop_assert_eq!(canonical_json(&canonical, &[]), Some(canonical.clone()));
    }

    #[test]
    fn arbitrary_bytes_never_panic_the_json_canonicaliser(body in prop::collection::vec(any::<u8>(), 0..512)) {
        if let Some(canonical) = canonical_json(&body, &[]) {
            prop_assert!(std::str::from_utf8(&canonical).is_ok());
            prop_assert_eq!(canonical_json(&canonical, &[]), Some(canonical.clone()));
        }
        let _ = fingerprint_as("application/json", &body);
    }
}

fn header_key(value: &[u8]) -> Option<Result<Vec<u8>, ()>> {
    let value = HeaderValue::from_bytes(value).ok()?;
    let mut headers = HeaderMap::new();
    headers.insert(HeaderName::from_static("idempotency-key"), value);
    let key = extract(&KeySource::default(), &Uri::from_static("/"), &headers, b"")
        .map_err(drop)
        .and_then(|key| {
            let key = key.ok_or(())?;
            validate(&key, false).map_err(drop)?;
            Ok(key)
        });
    Some(key)
}

/// The IETF draft's sf-string form of `key`.
fn sf_string(key: &[u8]) -> Vec<u8> {
    let mut out = vec![b'"'];
    for &b in key {
        if b == b'"' || b == b'\\' {
            out.push(b'\\');
        }
        out.push(b);
    }
    out.push(b'"');
    out
}

fn is_bare_key(bytes: &[u8]) -> bool {
    (1..=255).contains(&bytes.len())
        && bytes
            .iter()
            .all(|b| (0x21..=0x7e).contains(b) && !b",;\"".contains(b))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(500))]

    #[test]
    fn valid_keys_round_trip_bare_and_quoted(key in "[!-~]{1,255}") {
        let key = key.into_bytes();
        prop_assert_eq!(header_key(&sf_string(&key)), Some(Ok(key.clone())));
        let bare = header_key(&key);
        if is_bare_key(&key) {
            prop_assert_eq!(bare, Some(Ok(key)));
        } else if let Some(Ok(other)) = bare {
            // Refused bare, unless it is itself a quoted form (`"\""`).
            prop_assert_eq!(sf_string(&other), key);
        }
    }

    #[test]
    fn anything_else_is_refused(value in prop::collection::vec(any::<u8>(), 0..300)) {
        match header_key(&value) {
            None => {} // not even a header value
            Some(Ok(key)) => prop_assert!(
                key == value || sf_string(&key) == value,
                "accepted {:?} as {:?}", value, key
            ),
            Some(Err(())) => prop_assert!(!is_bare_key(&value)),
        }
    }

    #[test]
    fn every_key_source_survives_arbitrary_input(
        body in prop::collection::vec(any::<u8>(), 0..512),
        query in "[ -~]{0,64}",
        boundary in "[a-zA-Z0-9]{1,12}",
    ) {
        let uri: Uri = format!("/x?{}", query.replace([' ', '#'], "")).parse().unwrap_or_default();
        let sources = [
            KeySource::FormField("token".into()),
            KeySource::JsonPointer("/token".into()),
            KeySource::Query("token".into()),
        ];
        for content_type in [
            "application/x-www-form-urlencoded".to_owned(),
            format!("multipart/form-data; boundary={boundary}"),
            "application/json".to_owned(),
        ] {
            let mut headers = HeaderMap::new();
            headers.insert(header::CONTENT_TYPE, content_type.parse().unwrap());
            for source in &sources {
                if let Ok(Some(key)) = extract(source, &uri, &headers, &body) {
                    let _ = validate(&key, true);
                }
            }
            let _ = fingerprint_as(&content_type, &body);
        }
    }
}

/// Percent-encodes `bytes`, each byte literal or escaped as the tape says.
fn form_encode(bytes: &[u8], tape: &mut Tape) -> String {
    let mut out = String::new();
    for &b in bytes {
        match b {
            b' ' if tape.next() % 2 == 0 => out.push('+'),
            b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~'
                if tape.next() % 2 == 0 =>
            {
                out.push(b as char)
            }
            _ => out.push_str(&format!("%{b:02X}")),
        }
    }
    out
}

fn form(fields: &BTreeMap<Vec<u8>, Vec<u8>>, seed: u64) -> String {
    let mut tape = Tape(seed | 1);
    let mut pairs: Vec<String> = fields
        .iter()
        .map(|(name, value)| {
            format!(
                "{}={}",
                form_encode(name, &mut tape),
                form_encode(value, &mut tape)
            )
        })
        .collect();
    for i in (1..pairs.len()).rev() {
        pairs.swap(i, (tape.next() % (i as u64 + 1)) as usize);
    }
    pairs.join("&")
}

fn multipart(parts: &[(String, Vec<u8>)], boundary: &str) -> Vec<u8> {
    let mut out = Vec::new();
    for (name, data) in parts {
        out.extend_from_slice(format!("--{boundary}\r\n").as_bytes());
        out.extend_from_slice(
            format!("Content-Disposition: form-data; name=\"{name}\"\r\n\r\n").as_bytes(),
        );
        out.extend_from_slice(data);
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(format!("--{boundary}--\r\n").as_bytes());
    out
}

const FORM: &str = "application/x-www-form-urlencoded";

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn form_field_order_and_encoding_do_not_matter(
        fields in prop::collection::btree_map(
            "[A-Za-z0-9_-]{1,12}".prop_map(String::into_bytes),
            prop::collection::vec(any::<u8>(), 0..24),
            0..8,
        ),
        a in any::<u64>(),
        b in any::<u64>(),
    ) {
        // Names every backend reads as distinct fields: letters, digits,
        // `_` and `-` only (readers merge names holding a space, `.`,
        // brackets, NUL or a byte outside ASCII, whose case ASP.NET folds,
        // and a lenient JSON parser reads other punctuation as JSON), and
        // none another's spelling but for case; the order of any other
        // form is kept instead.
        let mut seen = std::collections::HashSet::new();
        let fields: BTreeMap<Vec<u8>, Vec<u8>> = fields
            .into_iter()
            .filter(|(name, _)| name.iter().all(|b| b.is_ascii_alphanumeric() || b"_-".contains(b)))
            .filter(|(name, _)| seen.insert(name.to_ascii_lowercase()))
            .collect();
        let (first, second) = (form(&fields, a), form(&fields, b));
        prop_assert_eq!(
            fingerprint_as(FORM, first.as_bytes()),
            fingerprint_as(FORM, second.as_bytes())
        );
        if let Some((name, value)) = fields.iter().next() {
            let mut changed = fields.clone();
            changed.insert(name.clone(), [value.as_slice(), b"!"].concat());
            prop_assert_ne!(
                fingerprint_as(FORM, first.as_bytes()),
                fingerprint_as(FORM, form(&changed, a).as_bytes())
            );
        }
    }

    #[test]
    fn multipart_part_order_does_not_matter_and_data_does(
        fields in prop::collection::btree_map("[a-z_]{1,10}", prop::collection::vec(any::<u8>(), 0..64), 1..6),
        seed in any::<u64>(),
    ) {
        let boundary = "bNd-7f3a9c";
        let content_type = format!("multipart/form-data; boundary={boundary}");
        let mut parts: Vec<_> = fields.into_iter().collect();
        // Data that contains the delimiter would end the part early.
        prop_assume!(parts.iter().all(|(_, d)| !d.windows(boundary.len()).any(|w| w == boundary.as_bytes())));
        let original = fingerprint_as(&content_type, &multipart(&parts, boundary));
        let mut tape = Tape(seed | 1);
        for i in (1..parts.len()).rev() {
            parts.swap(i, (tape.next() % (i as u64 + 1)) as usize);
        }
        prop_assert_eq!(original, fingerprint_as(&content_type, &multipart(&parts, boundary)));
        parts[0].1.push(b'!');
        prop_assert_ne!(original, fingerprint_as(&content_type, &multipart(&parts, boundary)));
    }

    #[test]
    fn multipart_parser_survives_arbitrary_bytes(
        prefix in prop::collection::vec(any::<u8>(), 0..64),
        body in prop::collection::vec(any::<u8>(), 0..512),
        boundary in "[ -~]{0,80}",
    ) {
        // Arbitrary bytes, and arbitrary bytes after a real delimiter.
        let content_type = format!("multipart/form-data; boundary=\"{}\"", boundary.replace('"', ""));
        let Ok(content_type_value) = HeaderValue::from_str(&content_type) else { return Ok(()) };
        let mut headers = HeaderMap::new();
        headers.insert(header::CONTENT_TYPE, content_type_value);
        let framed = [&prefix[..], b"--", boundary.as_bytes(), b"\r\n", &body].concat();
        for body in [&body[..], &framed] {
            let _ = extract(&KeySource::FormField("token".into()), &Uri::from_static("/"), &headers, body);
            let _ = fingerprint_as(&content_type, body);
        }
    }
}
