//! Canonical JSON in one pass: members sorted by decoded key, no
//! insignificant whitespace, excluded members left out; validated as it is
//! read, without building a tree.

use std::ops::Range;

use sha2::{Digest, Sha256};

use super::{put, MAX_JSON_DEPTH};

/// The canonical form of a JSON document: members sorted by decoded key
/// (bytewise, i.e. by code point; stable), keys and scalars written as in
/// the input, no insignificant whitespace, members at `exclude` pointers
/// removed. `None` when `input` is not JSON (which includes text that is
/// not UTF-8, RFC 8259 section 8.1) or nests deeper than [`MAX_JSON_DEPTH`].
pub fn canonical_json(input: &[u8], exclude: &[Vec<String>]) -> Option<Vec<u8>> {
    canonicalize(input, exclude, false, Buffers::default()).map(|canonical| canonical.out)
}

/// The room a [`Canonicalizer`] writes into. The fingerprint keeps one set
/// per thread between requests ([`Buffers::take`], [`Buffers::keep`]), so
/// a request allocates none; what is kept is cleared before it is used
/// again, so no byte of one request reaches another's output.
#[derive(Default)]
pub(super) struct Buffers {
    out: Vec<u8>,
    members: Vec<Member>,
}

thread_local! {
    static SPARE: std::cell::Cell<Option<Buffers>> = const { std::cell::Cell::new(None) };
}

impl Buffers {
    /// Buffers larger than this are not kept (a large body's room is
    /// given back).
    const MAX_KEPT: usize = 64 * 1024;

    /// This thread's spare buffers, or new ones.
    pub(super) fn take() -> Self {
        SPARE.with(std::cell::Cell::take).unwrap_or_default()
    }

    /// Keeps these buffers for this thread's next fingerprint, unless they
    /// grew large.
    pub(super) fn keep(self) {
        if self.out.capacity() <= Self::MAX_KEPT
            && self.members.capacity() * std::mem::size_of::<Member>() <= Self::MAX_KEPT
        {
            SPARE.with(|spare| spare.set(Some(self)));
        }
    }
}

/// Reads `input` into its canonical form. With `defer_root`, an unsorted
/// top-level object is left in input order with its members listed in key
/// order: [`Canonicalizer::hash_into`] then hashes them in that order,
/// without writing them out again.
pub(super) fn canonicalize<'a, 'x>(
    input: &'a [u8],
    exclude: &'x [Vec<String>],
    defer_root: bool,
    buffers: Buffers,
) -> Option<Canonicalizer<'a, 'x>> {
    let Buffers {
        mut out,
        mut members,
    } = buffers;
    out.clear();
    members.clear();
    // The canonical form is never longer than the input read so far (it
    // only drops whitespace and excluded members), and an object being
    // rearranged is written again after it: this is all the room the
    // output needs, with `BLOCK` bytes for `append`.
    out.reserve(2 * input.len() + BLOCK);
    members.reserve(16);
    let mut canonical = Canonicalizer {
        input,
        pos: 0,
        out,
        members,
        decoded: Vec::new(),
        exclude,
        path: Vec::new(),
        defer_root,
        root_deferred: false,
    };
    canonical.value(0)?;
    // Only whitespace may follow the value.
    canonical.peek().is_none().then_some(canonical)
}

/// One pass over the input that validates it and writes its canonical form
/// at the same time, without building a tree.
///
/// Object members are written in input order; an object whose keys were
/// not already sorted is then rearranged (its members' bytes are copied in
/// key order after the output, then back, not parsed again). A value is so
/// copied twice per unsorted object around it: at most 2 ×
/// [`MAX_JSON_DEPTH`] times.
///
/// Outside strings, JSON is ASCII, so the input is UTF-8 exactly when the
/// contents of its strings are: only strings holding non-ASCII bytes are
/// checked, as they are read.
pub(super) struct Canonicalizer<'a, 'x> {
    input: &'a [u8],
    pos: usize,
    out: Vec<u8>,
    /// The members of the objects being written, innermost object last.
    members: Vec<Member>,
    /// The decoded keys of those members whose keys hold escapes.
    decoded: Vec<u8>,
    exclude: &'x [Vec<String>],
    /// Where the value being read sits (tracked only when `exclude` is not
    /// empty).
    path: Vec<Segment<'a>>,
    /// Whether an unsorted top-level object may be left unsorted in `out`.
    defer_root: bool,
    /// Whether it was: `out` then holds it in input order, and `members`
    /// its members in key order.
    root_deferred: bool,
}

/// A member written to the output.
struct Member {
    /// The first eight bytes of its decoded key as it sorts ([`Folded`]),
    /// big-endian, zero-padded: keys compare as their prefixes do, unless
    /// the prefixes are equal.
    prefix: u64,
    /// Its decoded key: the raw key in the input when it holds no escape
    /// (it is its own decoding then), else a range of `decoded`.
    key: Range<usize>,
    /// Whether `key` is a range of `decoded`.
    escaped: bool,
    /// Its bytes in the output: `"key":value`, without a comma.
    out: Range<usize>,
}

/// One step of the path to the value being read.
enum Segment<'a> {
    /// A key without escapes, as written.
    Key(&'a [u8]),
    /// A key with escapes, decoded.
    Decoded(Vec<u8>),
    Index(usize),
}

impl<'a> Canonicalizer<'a, '_> {
    /// Skips whitespace and returns the next byte, without consuming it
    /// (`None` at the end of the input).
    fn peek(&mut self) -> Option<u8> {
        loop {
            match *self.input.get(self.pos)? {
                b' ' | b'\t' | b'\n' | b'\r' => self.pos += 1,
                byte => return Some(byte),
            }
        }
    }

    /// value = object / array / string / number / true / false / null
    ///
    /// Inlined into the loops of [`Self::array`] and [`Self::object`], so
    /// only nested arrays and objects cost a call.
    #[inline(always)]
    fn value(&mut self, depth: usize) -> Option<()> {
        if depth >= MAX_JSON_DEPTH {
            return None;
        }
        let first = self.peek()?;
        let start = self.pos;
        match first {
            b'{' => return self.object(depth),
            b'[' => return self.array(depth),
            b'"' => {
                self.string()?;
            }
            b't' => self.literal(b"true")?,
            b'f' => self.literal(b"false")?,
            b'n' => self.literal(b"null")?,
            b'-' | b'0'..=b'9' => self.number()?,
            _ => return None,
        }
        // Strings, numbers and literals are kept exactly as written.
        append(&mut self.out, self.input, start..self.pos);
        Some(())
    }

    /// array = `[` [ value *( `,` value ) ] `]`
    #[inline(never)]
    fn array(&mut self, depth: usize) -> Option<()> {
        self.pos += 1;
        self.out.push(b'[');
        if self.peek()? == b']' {
            self.pos += 1;
        } else {
            let mut index = 0;
            loop {
                if self.exclude.is_empty() {
                    self.value(depth + 1)?;
                } else {
                    self.path.push(Segment::Index(index));
                    self.value(depth + 1)?;
                    self.path.pop();
                }
                index += 1;
                match self.peek()? {
                    b',' => self.out.push(b','),
                    b']' => break,
                    _ => return None,
                }
                self.pos += 1;
            }
            self.pos += 1;
        }
        self.out.push(b']');
        Some(())
    }

    /// object = `{` [ member *( `,` member ) ] `}`;
    /// member = string `:` value
    #[inline(never)]
    fn object(&mut self, depth: usize) -> Option<()> {
        let input = self.input;
        self.pos += 1;
        self.out.push(b'{');
        let start = self.out.len();
        let first = self.members.len();
        let decoded_start = self.decoded.len();
        let mut sorted = true;
        if self.peek()? == b'}' {
            self.pos += 1;
        } else {
            loop {
                if self.peek()? != b'"' {
                    return None;
                }
                let quoted = self.pos;
                let escaped = self.string()?;
                let key = quoted + 1..self.pos - 1;
                // Members are ordered by their decoded keys (escapes are
                // rare: only then is a key decoded).
                let sort_key = if escaped {
                    let from = self.decoded.len();
                    decode_key(&input[key.clone()], &mut self.decoded);
                    from..self.decoded.len()
                } else {
                    key.clone()
                };
                if self.peek()? != b':' {
                    return None;
                }
                self.pos += 1;
                let before_comma = self.out.len();
                if self.members.len() > first {
                    self.out.push(b',');
                }
                let member = self.out.len();
                append(&mut self.out, input, quoted..key.end + 1);
                self.out.push(b':');
                let excluded = if self.exclude.is_empty() {
                    self.value(depth + 1)?;
                    false
                } else {
                    self.path.push(if escaped {
                        Segment::Decoded(self.decoded[sort_key.clone()].to_vec())
                    } else {
                        Segment::Key(&input[key.clone()])
                    });
                    let excluded = is_excluded(self.exclude, &self.path);
                    self.value(depth + 1)?;
                    self.path.pop();
                    excluded
                };
                if excluded {
                    self.out.truncate(before_comma);
                } else {
                    let key_bytes = if escaped { &self.decoded[..] } else { input };
                    let prefix = key_prefix(&key_bytes[sort_key.clone()]);
                    if self.members.len() > first {
                        let previous = &self.members[self.members.len() - 1];
                        sorted &= previous
                            .prefix
                            .cmp(&prefix)
                            .then_with(|| {
                                fold_cmp(self.key_of(previous), &key_bytes[sort_key.clone()])
                            })
                            .is_le();
                    }
                    let out = member..self.out.len();
                    self.members.push(Member {
                        prefix,
                        key: sort_key,
                        escaped,
                        out,
                    });
                }
                match self.peek()? {
                    b',' => self.pos += 1,
                    b'}' => break,
                    _ => return None,
                }
            }
            self.pos += 1;
        }
        if !sorted {
            self.sort_members(first);
            if depth == 0 && self.defer_root {
                // Hashed in key order by `hash_into`, never rewritten.
                self.root_deferred = true;
                self.out.push(b'}');
                return Some(());
            }
            self.rewrite_members(first, start);
        }
        self.members.truncate(first);
        self.decoded.truncate(decoded_start);
        self.out.push(b'}');
        Some(())
    }

    /// Gives its buffers back (for [`Buffers::keep`]).
    pub(super) fn into_buffers(self) -> Buffers {
        Buffers {
            out: self.out,
            members: self.members,
        }
    }

    /// The decoded key of `member`.
    fn key_of(&self, member: &Member) -> &[u8] {
        if member.escaped {
            &self.decoded[member.key.clone()]
        } else {
            &self.input[member.key.clone()]
        }
    }

    /// Feeds the canonical form to `hasher` exactly as `put` does: its
    /// length, then its bytes (a deferred top-level object member by
    /// member, in key order; it has the same length in either order).
    pub(super) fn hash_into(&self, hasher: &mut Sha256) {
        if !self.root_deferred {
            put(hasher, &self.out);
            return;
        }
        hasher.update((self.out.len() as u64).to_be_bytes());
        hasher.update(b"{");
        for (i, member) in self.members.iter().enumerate() {
            if i > 0 {
                hasher.update(b",");
            }
            hasher.update(&self.out[member.out.clone()]);
        }
        hasher.update(b"}");
    }

    /// Puts the members from `first` on in key order (see [`Folded`];
    /// stable: keys equal but for case, and duplicates, keep their order).
    fn sort_members(&mut self, first: usize) {
        let (input, decoded) = (self.input, &self.decoded[..]);
        let key = |member: &Member| {
            if member.escaped {
                &decoded[member.key.clone()]
            } else {
                &input[member.key.clone()]
            }
        };
        let members = &mut self.members[first..];
        // Whole keys are compared only when their prefixes tie.
        members.sort_by(|a, b| {
            a.prefix
                .cmp(&b.prefix)
                .then_with(|| fold_cmp(key(a), key(b)))
        });
    }

    /// Rewrites the members from `first` on, which were written from
    /// `start` in input order and are now listed in key order.
    fn rewrite_members(&mut self, first: usize, start: usize) {
        let members = &self.members[first..];
        // Written again after the output, in key order (the same length),
        // then moved back over the original.
        let end = self.out.len();
        for (i, member) in members.iter().enumerate() {
            if i > 0 {
                self.out.push(b',');
            }
            self.out.extend_from_within(member.out.clone());
        }
        self.out.copy_within(end.., start);
        self.out.truncate(end);
    }

    /// string = `"` *( unescaped / `\` escape ) `"`, its contents UTF-8.
    /// Reads it, quotes included; its opening quote is at `pos`. Returns
    /// whether it holds an escape.
    #[inline(always)]
    fn string(&mut self) -> Option<bool> {
        let input = self.input;
        let contents = self.pos + 1;
        let mut pos = contents;
        let mut escaped = false;
        // ASCII text, the common case: eight bytes at a time to the next
        // quote, backslash, control byte or non-ASCII byte.
        loop {
            pos = skip_words(input, pos, special_or_high_bytes);
            // At a special byte, or among the last seven bytes.
            match *input.get(pos)? {
                b'"' => {
                    self.pos = pos + 1;
                    return Some(escaped);
                }
                b'\\' => {
                    escaped = true;
                    pos += escape_len(&input[pos..])?;
                }
                0..=0x1f => return None,
                0x80.. => break,
                _ => pos += 1,
            }
        }
        // Non-ASCII text: the rest of the string is scanned for quotes,
        // backslashes and control bytes only, then checked as UTF-8.
        loop {
            pos = skip_words(input, pos, special_bytes);
            match *input.get(pos)? {
                b'"' => break,
                b'\\' => {
                    escaped = true;
                    pos += escape_len(&input[pos..])?;
                }
                0..=0x1f => return None,
                _ => pos += 1,
            }
        }
        std::str::from_utf8(&input[contents..pos]).ok()?;
        self.pos = pos + 1;
        Some(escaped)
    }

    fn literal(&mut self, word: &'static [u8]) -> Option<()> {
        let end = self.pos + word.len();
        (self.input.get(self.pos..end)? == word).then(|| self.pos = end)
    }

    /// number = [ `-` ] ( `0` / [1-9] *digit ) [ `.` 1*digit ]
    /// [ ( `e` / `E` ) [ `+` / `-` ] 1*digit ]
    fn number(&mut self) -> Option<()> {
        let input = self.input;
        let mut pos = self.pos;
        if input[pos] == b'-' {
            pos += 1;
        }
        match input.get(pos) {
            Some(b'0') => pos += 1,
            Some(b'1'..=b'9') => pos = digits(input, pos + 1),
            _ => return None,
        }
        if input.get(pos) == Some(&b'.') {
            pos = some_digits(input, pos + 1)?;
        }
        if let Some(b'e' | b'E') = input.get(pos) {
            pos += 1;
            if let Some(b'+' | b'-') = input.get(pos) {
                pos += 1;
            }
            pos = some_digits(input, pos)?;
        }
        self.pos = pos;
        Some(())
    }
}

/// The most bytes [`append`] copies as one fixed-size block.
const BLOCK: usize = 16;

/// Appends `src[range]` to `dst`. A short range is copied as one
/// fixed-size block, then the bytes past its end are cut off again: no
/// `memcpy` call of a varying length. Never reallocates when `dst` has
/// room for `BLOCK` more bytes.
fn append(dst: &mut Vec<u8>, src: &[u8], range: Range<usize>) {
    let n = range.len();
    match src.get(range.start..range.start + BLOCK) {
        Some(block) if n <= BLOCK => {
            let block: &[u8; BLOCK] = block.try_into().expect("BLOCK bytes");
            dst.extend_from_slice(block);
            dst.truncate(dst.len() - (BLOCK - n));
        }
        _ => dst.extend_from_slice(&src[range]),
    }
}

/// The end of the run of digits starting at `from`.
fn digits(input: &[u8], from: usize) -> usize {
    let mut pos = from;
    while input.get(pos).is_some_and(u8::is_ascii_digit) {
        pos += 1;
    }
    pos
}

/// The end of the run of digits starting at `from`, which must not be
/// empty.
fn some_digits(input: &[u8], from: usize) -> Option<usize> {
    let end = digits(input, from);
    (end > from).then_some(end)
}

/// The length of the escape sequence at the start of `bytes` (which starts
/// with `\`): `\"`, `\\`, `\/`, `\b`, `\f`, `\n`, `\r`, `\t` or `\u` and
/// four hex digits.
pub(crate) fn escape_len(bytes: &[u8]) -> Option<usize> {
    match *bytes.get(1)? {
        b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => Some(2),
        b'u' => bytes
            .get(2..6)?
            .iter()
            .all(u8::is_ascii_hexdigit)
            .then_some(6),
        _ => None,
    }
}

const ONES: u64 = u64::from_ne_bytes([0x01; 8]);
const HIGHS: u64 = u64::from_ne_bytes([0x80; 8]);

/// Advances from `pos` eight bytes at a time to the first byte that
/// `flags` marks (the high bit of its byte in the little-endian word), or
/// to where fewer than eight bytes are left.
#[inline(always)]
fn skip_words(input: &[u8], mut pos: usize, flags: fn(u64) -> u64) -> usize {
    while let Some(chunk) = input.get(pos..pos + 8) {
        let word = u64::from_le_bytes(chunk.try_into().expect("eight bytes"));
        let flagged = flags(word);
        if flagged != 0 {
            return pos + (flagged.trailing_zeros() / 8) as usize;
        }
        pos += 8;
    }
    pos
}

/// The high bit of each byte of `word` (little-endian) that is a `"`, a
/// `\`, a control byte (below 0x20) or a non-ASCII byte (0x80 and up). A
/// borrow can also flag a byte after a flagged one, never before it, so
/// the lowest flagged byte is always a true match.
fn special_or_high_bytes(word: u64) -> u64 {
    // `x - 1` has its high bit set when the byte `x` is zero (a match) or
    // at least 0x81; `word - 0x20` when the byte is below 0x20. Bytes
    // whose XOR with `"` or `\` is 0x80 or more are non-ASCII, flagged by
    // `word` itself.
    ((word ^ (ONES * u64::from(b'"'))).wrapping_sub(ONES)
        | (word ^ (ONES * u64::from(b'\\'))).wrapping_sub(ONES)
        | word.wrapping_sub(ONES * 0x20)
        | word)
        & HIGHS
}

/// The high bit of each byte of `word` (little-endian) that is a `"`, a
/// `\` or a control byte (below 0x20). A borrow can also flag a byte after
/// a flagged one, never before it, so the lowest flagged byte is always a
/// true match.
fn special_bytes(word: u64) -> u64 {
    // The high bit of each byte of `word` that is below `n` (n <= 0x80).
    let below = |word: u64, n: u8| word.wrapping_sub(ONES * u64::from(n)) & !word & HIGHS;
    below(word ^ (ONES * u64::from(b'"')), 1)
        | below(word ^ (ONES * u64::from(b'\\')), 1)
        | below(word, 0x20)
}

/// Appends the decoding of a raw key that holds escapes (already checked
/// by [`Canonicalizer::string`]) to `out`: UTF-8, with `\u` escapes of
/// surrogate pairs joined and a lone surrogate written as its own
/// three-byte sequence (generalised UTF-8, as WTF-8 does). Bytewise order
/// of the result is code point order, and two keys decode alike exactly
/// when a parser reads them as the same text.
pub(crate) fn decode_key(raw: &[u8], out: &mut Vec<u8>) {
    let hex4 = |at: usize| {
        raw[at..at + 4].iter().fold(0u32, |n, &digit| {
            n * 16 + (digit as char).to_digit(16).unwrap_or(0)
        })
    };
    let mut i = 0;
    while i < raw.len() {
        if raw[i] != b'\\' {
            out.push(raw[i]);
            i += 1;
            continue;
        }
        let simple = match raw[i + 1] {
            b'b' => Some(0x08),
            b'f' => Some(0x0c),
            b'n' => Some(b'\n'),
            b'r' => Some(b'\r'),
            b't' => Some(b'\t'),
            b'u' => None,
            other => Some(other),
        };
        if let Some(byte) = simple {
            out.push(byte);
            i += 2;
            continue;
        }
        let mut code = hex4(i + 2);
        i += 6;
        if (0xd800..0xdc00).contains(&code) && raw[i..].starts_with(b"\\u") {
            let low = hex4(i + 2);
            if (0xdc00..0xe000).contains(&low) {
                code = 0x10000 + ((code - 0xd800) << 10) + (low - 0xdc00);
                i += 6;
            }
        }
        // An unpaired surrogate: most parsers (Go, Java, JavaScript's
        // `JSON.parse` then UTF-8) read it as U+FFFD, so two such keys may
        // be one key to the backend: sort them as that key, keeping their
        // order (the sort is stable), like any other duplicates.
        if (0xd800..0xe000).contains(&code) {
            code = 0xfffd;
        }
        push_code_point(code, out);
    }
}

/// Writes `code` (up to U+10FFFF, surrogates included) in generalised
/// UTF-8.
fn push_code_point(code: u32, out: &mut Vec<u8>) {
    if code < 0x80 {
        out.push(code as u8);
    } else if code < 0x800 {
        out.extend_from_slice(&[0xc0 | (code >> 6) as u8, 0x80 | (code & 0x3f) as u8]);
    } else if code < 0x10000 {
        out.extend_from_slice(&[
            0xe0 | (code >> 12) as u8,
            0x80 | ((code >> 6) & 0x3f) as u8,
            0x80 | (code & 0x3f) as u8,
        ]);
    } else {
        out.extend_from_slice(&[
            0xf0 | (code >> 18) as u8,
            0x80 | ((code >> 12) & 0x3f) as u8,
            0x80 | ((code >> 6) & 0x3f) as u8,
            0x80 | (code & 0x3f) as u8,
        ]);
    }
}

/// The first eight bytes of `key` as it sorts ([`Folded`]) as a
/// big-endian number, zero-padded. When two prefixes differ they order
/// their keys (a zero byte of padding sorts a key before the longer ones
/// it starts).
fn key_prefix(key: &[u8]) -> u64 {
    let mut bytes = [0u8; 8];
    let n = key.len().min(8);
    bytes[..n].copy_from_slice(&key[..n]);
    let word = u64::from_be_bytes(bytes);
    const HIGH: u64 = 0x8080_8080_8080_8080;
    const ONES: u64 = 0x0101_0101_0101_0101;
    if word & HIGH == 0 {
        // ASCII: each of `A`..=`Z` gains 0x20 (no byte carries into the
        // next: each is below 0x80 and gains less than 0x80).
        let at_least_a = word + ONES * (0x80 - u64::from(b'A'));
        let past_z = word + ONES * (0x80 - u64::from(b'Z') - 1);
        let upper = at_least_a & !past_z & HIGH;
        return word | (upper >> 2);
    }
    let mut bytes = [0u8; 8];
    for (slot, byte) in bytes.iter_mut().zip(Folded::new(key)) {
        *slot = byte;
    }
    u64::from_be_bytes(bytes)
}

/// Compares two keys as they sort: their [`Folded`] bytes.
fn fold_cmp(a: &[u8], b: &[u8]) -> std::cmp::Ordering {
    Folded::new(a).cmp(Folded::new(b))
}

/// A key's bytes as members are sorted by: each character folded as Go's
/// `encoding/json` matches member names to fields (`bytes.EqualFold`, last
/// one wins): `Amount` as `amount`, `ſku` as `sku`, `K` (Kelvin) as `k`.
/// Sorting by the folded key, stably, keeps members whose names differ
/// only in case in their order, so `{"amount":1000,"Amount":10}` and its
/// reordering, which Go reads as 10 and as 1000, never share a canonical
/// form. See [`fold_char`] for a character beyond ASCII: a looser fold
/// only keeps more orders apart, never fewer.
struct Folded<'a> {
    rest: &'a [u8],
    pending: [u8; 4],
    at: u8,
    len: u8,
}

impl<'a> Folded<'a> {
    fn new(key: &'a [u8]) -> Self {
        Folded {
            rest: key,
            pending: [0; 4],
            at: 0,
            len: 0,
        }
    }
}

/// `c` folded (see [`Folded`]): lowercase, uppercase, lowercase again,
/// each time the first character of the mapping. Go folds a name as
/// `ToUpper(ToLower(r))`; this joins every pair Go joins (`ẞ` and `ß`,
/// `İ` and `i`), and more where a mapping has several characters (`ß`
/// with `s`), which only keeps more orders apart.
fn fold_char(c: char) -> char {
    let lower = c.to_lowercase().next().unwrap_or(c);
    let upper = lower.to_uppercase().next().unwrap_or(lower);
    upper.to_lowercase().next().unwrap_or(upper)
}

impl Iterator for Folded<'_> {
    type Item = u8;

    fn next(&mut self) -> Option<u8> {
        if self.at < self.len {
            self.at += 1;
            return Some(self.pending[usize::from(self.at - 1)]);
        }
        let (&first, rest) = self.rest.split_first()?;
        if first.is_ascii() {
            self.rest = rest;
            return Some(first.to_ascii_lowercase());
        }
        let width = match first {
            0xf0.. => 4,
            0xe0.. => 3,
            _ => 2,
        };
        let character = self
            .rest
            .get(..width)
            .and_then(|bytes| std::str::from_utf8(bytes).ok())
            .and_then(|text| text.chars().next());
        let Some(character) = character else {
            // Not UTF-8 (never a key the canonicaliser accepts): as is.
            self.rest = rest;
            return Some(first);
        };
        self.rest = &self.rest[width..];
        self.len = fold_char(character).encode_utf8(&mut self.pending).len() as u8;
        self.at = 1;
        Some(self.pending[0])
    }
}

fn is_excluded(exclude: &[Vec<String>], path: &[Segment<'_>]) -> bool {
    exclude.iter().any(|pointer| {
        pointer.len() == path.len()
            && pointer
                .iter()
                .zip(path)
                .all(|(token, segment)| match segment {
                    Segment::Key(key) => token.as_bytes() == *key,
                    Segment::Decoded(key) => token.as_bytes() == key.as_slice(),
                    Segment::Index(i) => token.parse() == Ok(*i),
                })
    })
}
