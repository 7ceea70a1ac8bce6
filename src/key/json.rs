//! A JSON value read the way the backends behind us read it, for the one
//! thing the engine takes from a JSON body on its own: the key at a JSON
//! pointer.
//!
//! `serde_json` refuses documents that JavaScript's `JSON.parse` (Express)
//! and Python's `json.loads` (Django) accept: a byte order mark before the
//! document, a lone surrogate escape (`"\ud83c"`, what `JSON.stringify`
//! writes for a string cut inside an emoji), nesting deeper than 128. A key
//! the engine cannot see in a body the backend reads would let every retry
//! run unprotected, so such documents are read here instead: without
//! recursion (any depth, bounded memory), lone surrogates as U+FFFD, and,
//! as those parsers do, the last of duplicate members.

use std::borrow::Cow;

use crate::fingerprint::json::{decode_key, escape_len};
use crate::formats::array_index;

/// What a document holds at a pointer.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Found {
    /// Nothing, or `null`, or the document is not JSON even to a lenient
    /// reader.
    Absent,
    /// A string, decoded (UTF-8 bytes).
    String(Vec<u8>),
    /// Some other value (a number, an object, …).
    Other,
}

/// One open container on the way down.
enum Frame<'a> {
    /// An object and the decoded key of the member being read (borrowed
    /// from the input unless it holds an escape).
    Object(Cow<'a, [u8]>),
    /// An array and the index of the element being read.
    Array(usize),
}

/// The value at `tokens` (a parsed JSON pointer) in `input`, read leniently
/// (see the module documentation). Allocates only for the open containers,
/// keys holding escapes, and the string found.
pub(crate) fn value_at<T: AsRef<str>>(input: &[u8], tokens: &[T]) -> Found {
    let input = input.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(input);
    let mut reader = Reader { input, pos: 0 };
    walk(&mut reader, tokens).unwrap_or(Found::Absent)
}

fn walk<T: AsRef<str>>(reader: &mut Reader<'_>, tokens: &[T]) -> Option<Found> {
    let mut stack: Vec<Frame> = Vec::new();
    let mut found = Found::Absent;
    loop {
        // A value starts here.
        let here = stack.len() == tokens.len() && on_path(&stack, tokens);
        match reader.peek()? {
            b'{' => {
                reader.pos += 1;
                if here {
                    found = Found::Other;
                }
                if reader.peek()? == b'}' {
                    reader.pos += 1;
                } else {
                    let key = reader.member_key()?;
                    stack.push(Frame::Object(key));
                    continue;
                }
            }
            b'[' => {
                reader.pos += 1;
                if here {
                    found = Found::Other;
                }
                if reader.peek()? == b']' {
                    reader.pos += 1;
                } else {
                    stack.push(Frame::Array(0));
                    continue;
                }
            }
            b'"' => {
                let text = reader.string()?;
                if here {
                    found = Found::String(text.into_owned());
                }
            }
            _ => {
                let token = reader.scalar()?;
                if here {
                    found = if token == b"null" {
                        Found::Absent
                    } else {
                        Found::Other
                    };
                }
            }
        }
        // The value ended: close containers until one goes on.
        loop {
            let Some(frame) = stack.last_mut() else {
                // Only whitespace may follow the document.
                return reader.peek().is_none().then_some(found);
            };
            match (reader.peek()?, frame) {
                (b',', Frame::Object(key)) => {
                    reader.pos += 1;
                    *key = reader.member_key()?;
                    break;
                }
                (b',', Frame::Array(index)) => {
                    reader.pos += 1;
                    *index += 1;
                    break;
                }
                (b'}', Frame::Object(_)) | (b']', Frame::Array(_)) => {
                    reader.pos += 1;
                    stack.pop();
                }
                _ => return None,
            }
        }
    }
}

/// Whether the open containers are exactly the pointer's path.
fn on_path<T: AsRef<str>>(stack: &[Frame<'_>], tokens: &[T]) -> bool {
    stack.iter().zip(tokens).all(|(frame, token)| match frame {
        Frame::Object(key) => **key == *token.as_ref().as_bytes(),
        Frame::Array(index) => array_index(token.as_ref()) == Some(*index),
    })
}

struct Reader<'a> {
    input: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    /// The next byte after whitespace, not consumed.
    fn peek(&mut self) -> Option<u8> {
        loop {
            match *self.input.get(self.pos)? {
                b' ' | b'\t' | b'\n' | b'\r' => self.pos += 1,
                byte => return Some(byte),
            }
        }
    }

    /// `"key" :`, decoded.
    fn member_key(&mut self) -> Option<Cow<'a, [u8]>> {
        if self.peek()? != b'"' {
            return None;
        }
        let key = self.string()?;
        (self.peek()? == b':').then(|| self.pos += 1)?;
        Some(key)
    }

    /// A number, `true`, `false` or `null`, as written; also `NaN` and
    /// `Infinity` (`-Infinity` reads as a number), which Python's
    /// `json.dumps` writes for such floats by default and `json.loads`
    /// reads back.
    fn scalar(&mut self) -> Option<&[u8]> {
        let start = self.pos;
        while let Some(&byte) = self.input.get(self.pos) {
            if !(byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'+' | b'.')) {
                break;
            }
            self.pos += 1;
        }
        let token = &self.input[start..self.pos];
        let number = token
            .first()
            .is_some_and(|b| b.is_ascii_digit() || *b == b'-');
        let word = matches!(token, b"true" | b"false" | b"null" | b"NaN" | b"Infinity");
        (number || word).then_some(token)
    }

    /// A string at `"`, decoded as the fingerprint decodes keys (surrogate
    /// pairs joined, a lone surrogate as U+FFFD), borrowed when it holds no
    /// escape; `None` for a bad escape, a control character or no closing
    /// quote.
    fn string(&mut self) -> Option<Cow<'a, [u8]>> {
        let input: &'a [u8] = self.input;
        let start = self.pos + 1;
        // Most strings hold neither escapes nor control characters: found
        // whole by the closing quote, checked in one pass.
        if let Some(len) = memchr::memchr(b'"', input.get(start..)?) {
            let raw = &input[start..start + len];
            if !raw.iter().any(|&b| b < 0x20 || b == b'\\') {
                self.pos = start + len + 1;
                return Some(Cow::Borrowed(raw));
            }
        }
        let mut end = start;
        let mut escaped = false;
        loop {
            match *input.get(end)? {
                b'"' => break,
                b'\\' => {
                    escaped = true;
                    end += escape_len(&input[end..])?;
                }
                byte if byte < 0x20 => return None,
                _ => end += 1,
            }
        }
        self.pos = end + 1;
        let raw = &input[start..end];
        if !escaped {
            return Some(Cow::Borrowed(raw));
        }
        let mut out = Vec::with_capacity(raw.len());
        decode_key(raw, &mut out);
        Some(Cow::Owned(out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::formats::parse_pointer;

    fn at(input: &str, pointer: &str) -> Found {
        value_at(input.as_bytes(), &parse_pointer(pointer))
    }

    #[test]
    fn reads_what_backends_read() {
        let key = |s: &str| Found::String(s.as_bytes().to_vec());
        assert_eq!(at(r#"{"k":"a","x":"\ud83c"}"#, "/k"), key("a"));
        assert_eq!(at("\u{feff}{\"k\":\"a\"}", "/k"), key("a"));
        let deep = format!(
            r#"{{"k":"a","d":{}1{}}}"#,
            "[".repeat(5000),
            "]".repeat(5000)
        );
        assert_eq!(at(&deep, "/k"), key("a"));
        // The last of duplicate members, as JSON.parse and json.loads.
        assert_eq!(at(r#"{"k":"a","k":"b"}"#, "/k"), key("b"));
        assert_eq!(at(r#"{"\u006b":"a"}"#, "/k"), key("a"));
        assert_eq!(at(r#"{"m":{"k":"a"},"k":"b"}"#, "/m/k"), key("a"));
        assert_eq!(at(r#"{"a":[{"k":"x"},{"k":"y"}]}"#, "/a/1/k"), key("y"));
        assert_eq!(at(r#"{"k":"\ud83c\udf89"}"#, "/k"), key("\u{1f389}"));
        assert_eq!(at(r#"{"k":"\udf89"}"#, "/k"), key("\u{fffd}"));
        // Python's floats that are not numbers, as json.loads reads them.
        assert_eq!(at(r#"{"k":"a","n":NaN}"#, "/k"), key("a"));
        assert_eq!(at(r#"{"n":[Infinity,-Infinity],"k":"a"}"#, "/k"), key("a"));
    }

    #[test]
    fn absent_null_other_and_broken() {
        assert_eq!(at(r#"{"k":null}"#, "/k"), Found::Absent);
        assert_eq!(at(r#"{"j":"a"}"#, "/k"), Found::Absent);
        assert_eq!(at(r#"{"k":1}"#, "/k"), Found::Other);
        assert_eq!(at(r#"{"k":{"a":1}}"#, "/k"), Found::Other);
        assert_eq!(at(r#"{"k":"a""#, "/k"), Found::Absent);
        assert_eq!(at(r#"{"k":"a"} x"#, "/k"), Found::Absent);
        assert_eq!(at(r#"{"k" "a"}"#, "/k"), Found::Absent);
        assert_eq!(at("[", "/0"), Found::Absent);
    }

    /// Strings without escapes are read in place, others decoded: both
    /// readings agree, and a control character or a bad escape breaks the
    /// document either way.
    #[test]
    fn strings_read_in_place_or_decoded_alike() {
        let key = |s: &str| Found::String(s.as_bytes().to_vec());
        assert_eq!(at(r#"{"k":"plain"}"#, "/k"), key("plain"));
        assert_eq!(at(r#"{"k":"say \"hi\""}"#, "/k"), key("say \"hi\""));
        assert_eq!(at(r#"{"k\u0031":"a","k1":"b"}"#, "/k1"), key("b"));
        assert_eq!(at(r#"{"k1":"a","k\u0031":"b"}"#, "/k1"), key("b"));
        assert_eq!(at(r#"{"x":"a\"b","k":"c\/d"}"#, "/k"), key("c/d"));
        assert_eq!(at("{\"x\":\"a\nb\",\"k\":\"c\"}", "/k"), Found::Absent);
        assert_eq!(at("{\"k\":\"a\tb\"}", "/k"), Found::Absent);
        assert_eq!(at(r#"{"x":"\q","k":"c"}"#, "/k"), Found::Absent);
    }
}
