//! The canonical-JSON implementation as it was before the speed-up
//! (commit 7f994e1), kept as the reference for the differential tests:
//! stored fingerprints survive upgrades only if the output of
//! [`super::canonical_json`] stays byte-identical to this one.
//!
//! One change since: members are ordered by their *decoded* keys, here
//! decoded into code points in the most direct way (independently of the
//! fast path's byte-level decoder), because sorting raw escaped keys let
//! `{"a":1,"\u0061":2}` and `{"\u0061":2,"a":1}` share a fingerprint
//! although a last-wins parser reads them differently.

use std::ops::Range;

use super::MAX_JSON_DEPTH;

/// The canonical form of a JSON document: members sorted by decoded key
/// (by code point, stable), no insignificant whitespace, members at `exclude` pointers
/// removed. `None` when `input` is not JSON (which includes text that is
/// not UTF-8, RFC 8259 section 8.1) or nests deeper than [`MAX_JSON_DEPTH`].
pub(super) fn canonical_json(input: &[u8], exclude: &[Vec<String>]) -> Option<Vec<u8>> {
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
    path: Vec<Segment>,
}

/// A member written to the output.
struct Member {
    /// Its key as a parser reads it: code points, surrogate pairs joined,
    /// lone surrogates read as U+FFFD.
    key: Vec<u32>,
    /// Its bytes in the output: `"key":value`, without a comma.
    out: Range<usize>,
}

/// One step of the path to the value being read.
enum Segment {
    Key(Vec<u32>),
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
                let raw_key = quoted + 1..self.pos - 1;
                let key = decode(&input[raw_key.clone()]);
                if !self.eat(b':') {
                    return None;
                }
                let before_comma = self.out.len();
                if self.members.len() > first {
                    self.out.push(b',');
                }
                let member = self.out.len();
                self.out.extend_from_slice(&input[quoted..raw_key.end]);
                self.out.extend_from_slice(b"\":");
                let excluded = if self.exclude.is_empty() {
                    self.value(depth + 1)?;
                    false
                } else {
                    self.path.push(Segment::Key(key.clone()));
                    let excluded = is_excluded(self.exclude, &self.path);
                    self.value(depth + 1)?;
                    self.path.pop();
                    excluded
                };
                if excluded {
                    self.out.truncate(before_comma);
                } else {
                    if let Some(previous) = self.members[first..].last() {
                        sorted &= folded(&previous.key) <= folded(&key);
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
        let members = &mut self.members[first..];
        members.sort_by_key(|member| folded(&member.key));
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

/// The code points of a raw key (escapes checked already).
fn decode(raw: &[u8]) -> Vec<u32> {
    let text = std::str::from_utf8(raw).expect("checked as UTF-8");
    let mut units = Vec::new();
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            units.push(u32::from(c));
            continue;
        }
        let unit = match chars.next().expect("checked escape") {
            'b' => 8,
            'f' => 12,
            'n' => 10,
            'r' => 13,
            't' => 9,
            'u' => {
                let hex: String = chars.by_ref().take(4).collect();
                u32::from_str_radix(&hex, 16).expect("checked hex")
            }
            other => u32::from(other),
        };
        units.push(unit);
    }
    // Join each high surrogate followed by a low one.
    let mut points = Vec::with_capacity(units.len());
    let mut i = 0;
    while i < units.len() {
        let unit = units[i];
        match units.get(i + 1) {
            Some(&low) if (0xd800..0xdc00).contains(&unit) && (0xdc00..0xe000).contains(&low) => {
                points.push(0x10000 + ((unit - 0xd800) << 10) + (low - 0xdc00));
                i += 2;
            }
            // A lone surrogate is U+FFFD to most parsers.
            _ if (0xd800..0xe000).contains(&unit) => {
                points.push(0xfffd);
                i += 1;
            }
            _ => {
                points.push(unit);
                i += 1;
            }
        }
    }
    points
}

fn is_excluded(exclude: &[Vec<String>], path: &[Segment]) -> bool {
    exclude.iter().any(|pointer| {
        pointer.len() == path.len()
            && pointer
                .iter()
                .zip(path)
                .all(|(token, segment)| match segment {
                    Segment::Key(key) => token.chars().map(u32::from).eq(key.iter().copied()),
                    Segment::Index(i) => token.parse() == Ok(*i),
                })
    })
}

/// Differential tests: the current [`super::super::canonical_json`]
/// against the reference above, on valid JSON with varied whitespace, member order,
/// duplicate keys, escapes and numbers, on nesting around
/// [`MAX_JSON_DEPTH`], and on mutated, truncated and non-UTF-8 variants.
/// `key` as members sort by: each character lowercased, uppercased and
/// lowercased again (the first character of each mapping), as Go's
/// `encoding/json` matches names to fields whatever their case
/// (`ToUpper(ToLower(r))`: `Amount` is `amount`, `ſ` is `s`, Kelvin's `K`
/// is `k`, `ẞ` is `ß`).
fn folded(key: &[u32]) -> Vec<u32> {
    let first = |mapped: &mut dyn Iterator<Item = char>, c: char| mapped.next().unwrap_or(c);
    key.iter()
        .map(|&code| match char::from_u32(code) {
            Some(c) => {
                let lower = first(&mut c.to_lowercase(), c);
                let upper = first(&mut lower.to_uppercase(), lower);
                u32::from(first(&mut upper.to_lowercase(), upper))
            }
            None => code,
        })
        .collect()
}

#[cfg(test)]
mod differential {
    use proptest::prelude::*;

    use super::super::MAX_JSON_DEPTH;

    /// A JSON value whose scalars are already tokens as written.
    #[derive(Clone, Debug)]
    enum Json {
        /// A number or literal, as written.
        Token(String),
        /// A string token's contents, escapes as written.
        Str(String),
        Array(Vec<Json>),
        /// Members in the order generated (duplicates allowed).
        Object(Vec<(String, Json)>),
    }

    fn number() -> impl Strategy<Value = String> {
        prop_oneof![
            "-?(0|[1-9][0-9]{0,3})",
            "-?(0|[1-9][0-9]{0,30})(\\.[0-9]{1,12})?([eE][+-]?[0-9]{1,4})?",
            any::<f64>().prop_map(|f| format!("{f:e}").replace("inf", "1e999")),
            any::<i64>().prop_map(|n| n.to_string()),
        ]
    }

    /// String contents: plain text (any Unicode), every escape form.
    fn string_contents() -> impl Strategy<Value = String> {
        prop_oneof![
            "[a-z]{0,12}",
            "([a-zé ]|\\\\[\"\\\\/bfnrt]|\\\\u[0-9a-fA-F]{4})*",
            "[^\"\\\\\\x00-\\x1f]{0,40}",
            "(\\\\u[dD][89abAB][0-9a-f]{2}\\\\u[dD][c-fC-F][0-9a-f]{2}|[😀é€x]){0,6}",
        ]
    }

    /// Keys from a small pool, so duplicates, prefixes and escapes of the
    /// same text are common; sometimes anything.
    fn key() -> impl Strategy<Value = String> {
        prop_oneof![
            4 => prop::sample::select(vec![
                "", "a", "b", "ab", "aa", "a\\u0062", "é", "\\u00e9", "0", "1", "a/b", "m~n",
                "z", "B", "a ", "a\\/b",
            ])
            .prop_map(str::to_owned),
            1 => string_contents(),
        ]
    }

    fn json() -> impl Strategy<Value = Json> {
        let leaf = prop_oneof![
            prop::sample::select(vec!["null", "true", "false"]).prop_map(|t| Json::Token(t.into())),
            number().prop_map(Json::Token),
            string_contents().prop_map(Json::Str),
        ];
        leaf.prop_recursive(6, 96, 8, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..8).prop_map(Json::Array),
                prop::collection::vec((key(), inner), 0..10).prop_map(Json::Object),
            ]
        })
    }

    /// A small deterministic generator driving whitespace and order.
    struct Tape(u64);

    impl Tape {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
        }

        fn ws(&mut self, out: &mut Vec<u8>) {
            const WS: [&str; 8] = ["", "", "", " ", "\n  ", "\t", "\r\n", "   \n\n    "];
            out.extend_from_slice(WS[(self.next() % 8) as usize].as_bytes());
        }
    }

    fn write(value: &Json, tape: &mut Tape, out: &mut Vec<u8>) {
        tape.ws(out);
        match value {
            Json::Token(token) => out.extend_from_slice(token.as_bytes()),
            Json::Str(s) => {
                out.push(b'"');
                out.extend_from_slice(s.as_bytes());
                out.push(b'"');
            }
            Json::Array(items) => {
                out.push(b'[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        tape.ws(out);
                        out.push(b',');
                    }
                    write(item, tape, out);
                }
                tape.ws(out);
                out.push(b']');
            }
            Json::Object(members) => {
                let mut members: Vec<_> = members.iter().collect();
                // Half the objects arrive already sorted (stable, as the
                // canonical form wants), the others as generated.
                if tape.next() % 2 == 0 {
                    members.sort_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
                }
                out.push(b'{');
                for (i, (key, value)) in members.iter().enumerate() {
                    if i > 0 {
                        tape.ws(out);
                        out.push(b',');
                    }
                    tape.ws(out);
                    out.push(b'"');
                    out.extend_from_slice(key.as_bytes());
                    out.push(b'"');
                    tape.ws(out);
                    out.push(b':');
                    write(value, tape, out);
                }
                tape.ws(out);
                out.push(b'}');
            }
        }
        tape.ws(out);
    }

    /// `value` inside `depth` levels of arrays and objects.
    fn nested(depth: usize, value: &[u8], tape: &mut Tape) -> Vec<u8> {
        let mut out = Vec::new();
        let mut closers = Vec::new();
        for _ in 0..depth {
            tape.ws(&mut out);
            if tape.next() % 2 == 0 {
                out.push(b'[');
                closers.push(b']');
            } else {
                out.extend_from_slice(if tape.next() % 2 == 0 {
                    b"{\"k\":"
                } else {
                    b"{\"b\":1,\"a\":"
                });
                closers.push(b'}');
            }
        }
        out.extend_from_slice(value);
        while let Some(closer) = closers.pop() {
            tape.ws(&mut out);
            out.push(closer);
        }
        out
    }

    /// Bytes that break or bend JSON when inserted or substituted.
    const NOISE: &[u8] = b"\"\\{}[],: \t\n\r0123456789-+.eEatfnul/\x00\x01\x0b\x1f\x7f\x80\xbf\xc3\xe9\xed\xf0\xf4\xff";

    #[derive(Clone, Debug)]
    enum Mutation {
        Truncate(prop::sample::Index),
        Delete(prop::sample::Index),
        Insert(prop::sample::Index, prop::sample::Index),
        Replace(prop::sample::Index, prop::sample::Index),
    }

    fn mutation() -> impl Strategy<Value = Mutation> {
        use prop::sample::Index;
        prop_oneof![
            any::<Index>().prop_map(Mutation::Truncate),
            any::<Index>().prop_map(Mutation::Delete),
            (any::<Index>(), any::<Index>()).prop_map(|(at, b)| Mutation::Insert(at, b)),
            (any::<Index>(), any::<Index>()).prop_map(|(at, b)| Mutation::Replace(at, b)),
        ]
    }

    fn mutate(bytes: &mut Vec<u8>, mutation: &Mutation) {
        let len = bytes.len();
        match mutation {
            Mutation::Truncate(at) => bytes.truncate(at.index(len + 1)),
            Mutation::Delete(at) if len > 0 => {
                bytes.remove(at.index(len));
            }
            Mutation::Insert(at, b) => bytes.insert(at.index(len + 1), *b.get(NOISE)),
            Mutation::Replace(at, b) if len > 0 => bytes[at.index(len)] = *b.get(NOISE),
            _ => {}
        }
    }

    /// Pointers into the key pool and small indices (`01` and `+1` parse
    /// as index 1, as the reference has it).
    fn pointers() -> impl Strategy<Value = Vec<Vec<String>>> {
        let token = prop::sample::select(vec![
            "", "a", "b", "ab", "a\\u0062", "é", "0", "1", "2", "01", "+1", "k", "z",
        ])
        .prop_map(str::to_owned);
        prop::collection::vec(prop::collection::vec(token, 1..4), 0..4)
    }

    #[track_caller]
    fn same(input: &[u8], exclude: &[Vec<String>]) {
        let new = super::super::canonical_json(input, exclude);
        let reference = super::canonical_json(input, exclude);
        assert!(
            new == reference,
            "input {:?} exclude {exclude:?}: new {:?}, reference {:?}",
            String::from_utf8_lossy(input),
            new.as_deref().map(String::from_utf8_lossy),
            reference.as_deref().map(String::from_utf8_lossy),
        );
        // The fingerprint's hashing (an unsorted top-level object hashed
        // member by member) feeds the same bytes as hashing the reference.
        use sha2::{Digest, Sha256};
        // With this thread's kept buffers (holding an earlier input's
        // bytes and members) and with fresh ones: the same hash.
        let hash = |buffers| {
            super::super::canonicalize(input, exclude, true, buffers).map(|canonical| {
                let mut hasher = Sha256::new();
                canonical.hash_into(&mut hasher);
                let digest = hasher.finalize();
                canonical.into_buffers().keep();
                digest
            })
        };
        let hashed = hash(super::super::Buffers::take());
        assert_eq!(hashed, hash(super::super::Buffers::default()));
        let expected = reference.map(|reference| {
            let mut hasher = Sha256::new();
            super::super::put(&mut hasher, &reference);
            hasher.finalize()
        });
        assert_eq!(
            hashed,
            expected,
            "input {:?} exclude {exclude:?}: hashed differently",
            String::from_utf8_lossy(input),
        );
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        #[test]
        fn valid_json_matches_reference(value in json(), seed: u64, exclude in pointers()) {
            let mut text = Vec::new();
            write(&value, &mut Tape(seed | 1), &mut text);
            prop_assert!(super::canonical_json(&text, &[]).is_some(), "generated valid JSON");
            same(&text, &[]);
            same(&text, &exclude);
        }

        #[test]
        fn mutated_json_matches_reference(
            value in json(),
            seed: u64,
            mutations in prop::collection::vec(mutation(), 1..4),
            exclude in pointers(),
        ) {
            let mut text = Vec::new();
            write(&value, &mut Tape(seed | 1), &mut text);
            for mutation in &mutations {
                mutate(&mut text, mutation);
            }
            same(&text, &[]);
            same(&text, &exclude);
        }

        #[test]
        fn nesting_around_the_limit_matches_reference(
            depth in MAX_JSON_DEPTH - 4..MAX_JSON_DEPTH + 4,
            value in json(),
            seed: u64,
            exclude in pointers(),
        ) {
            let mut tape = Tape(seed | 1);
            let mut inner = Vec::new();
            write(&value, &mut tape, &mut inner);
            let text = nested(depth, &inner, &mut tape);
            same(&text, &[]);
            same(&text, &exclude);
            let scalar = nested(depth, b"1", &mut tape);
            same(&scalar, &[]);
        }

        /// Objects wider than the small-sort cutoffs of the standard
        /// library, with many duplicate keys whose values tell them apart:
        /// the order of duplicates must be kept whatever the sort does.
        #[test]
        fn wide_objects_with_duplicates_match_reference(
            keys in prop::collection::vec(prop::sample::select(vec!["a", "b", "ab", "c", "a\\u0062"]), 16..120),
            seed: u64,
            exclude in pointers(),
        ) {
            let members = keys
                .iter()
                .enumerate()
                .map(|(i, key)| ((*key).to_owned(), Json::Token(i.to_string())))
                .collect();
            let mut text = Vec::new();
            write(&Json::Array(vec![Json::Object(members)]), &mut Tape(seed | 1), &mut text);
            same(&text, &[]);
            same(&text, &exclude);
        }

        #[test]
        fn noise_matches_reference(bytes in prop::collection::vec(prop::sample::select(NOISE), 0..40)) {
            same(&bytes, &[]);
        }
    }

    /// Every input of up to three bytes over the noise alphabet, and every
    /// prefix of a document exercising each token kind.
    #[test]
    fn short_inputs_and_prefixes_match_reference() {
        for a in NOISE {
            same(&[*a], &[]);
            for b in NOISE {
                same(&[*a, *b], &[]);
                for c in NOISE {
                    same(&[*a, *b, *c], &[]);
                }
            }
        }
        let document = "{ \"z\" : [1, -0.5e+10, 2E3, true, false, null, \"x\\u00e9\\n\\\"y\\\" é😀\"],\n\t\"a\": {\"b\": {}, \"a\": [], \"a\": [[]]}, \"\": \"0123456789abcdef0123\" }";
        let exclude = [
            vec!["a".to_owned(), "a".to_owned()],
            vec!["z".to_owned(), "1".to_owned()],
        ];
        for end in 0..=document.len() {
            same(&document.as_bytes()[..end], &[]);
            same(&document.as_bytes()[..end], &exclude);
        }
    }
}
