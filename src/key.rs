//! Finding and validating the idempotency key of a request.
//!
//! The key is read from exactly one place per route (see
//! [`KeySource`]) and must be 1..=255 visible ASCII
//! characters (`!`..=`~`). In a header, a key holding `"`, `,` or `;` must
//! be sent as the IETF draft's quoted sf-string; bare, it is ambiguous (see
//! [`KeyError::Ambiguous`]). Anything else is a [`KeyError`], which the
//! engine answers with 400 before anything is reserved.

pub(crate) mod json;

use http::{HeaderMap, Uri};

use crate::formats::{self, View};
use crate::policy::KeySource;

/// The longest key accepted, in bytes.
pub const MAX_KEY_LEN: usize = 255;

/// Why a key was refused. The messages never contain the key itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    /// The key is empty.
    #[error("the idempotency key is empty")]
    Empty,
    /// The key is longer than 255 bytes.
    #[error("the idempotency key is longer than 255 characters")]
    TooLong,
    /// The key contains a byte outside visible ASCII.
    #[error("the idempotency key may only contain visible ASCII characters")]
    InvalidCharacter,
    /// The route requires a UUID and the key is not one.
    #[error("the idempotency key must be a UUID")]
    NotUuid,
    /// The key header appears more than once.
    #[error("the idempotency key header appears more than once")]
    Repeated,
    /// A quoted sf-string is not closed or has a bad escape.
    #[error("the idempotency key is a malformed quoted string")]
    BadQuoting,
    /// A bare (unquoted) header key contains `"`, `,` or `;`, which would
    /// make it ambiguous: a quoted string, two header lines an intermediary
    /// merged into one list, or structured-field parameters.
    #[error("a bare idempotency key header may not contain '\"', ',' or ';' (send it as a quoted string)")]
    Ambiguous,
    /// The key field of a JSON body is not a string.
    #[error("the idempotency key field is not a string")]
    NotAString,
    /// The key field is given more than once (in the body, in the query,
    /// or under spellings a framework reads as its name) with different
    /// values: backends differ on which one they read (PHP, Rack and
    /// Django the last, others the first; Rails' `params` the query's,
    /// Laravel's `input()` the body's).
    #[error("the idempotency key field is given more than once with different values")]
    Conflicting,
}

/// Reads the raw key from where `source` says, without validating it.
///
/// `Ok(None)` means the request carries no key at all. Form and JSON
/// sources read `body` where backends read them: a form field as the
/// request's `Content-Type` says, and also from a JSON member, under a name
/// PHP or Rack reads as it, or from a body Rack reads as a form; a JSON
/// pointer whatever the type says, and also from its form field.
pub fn extract(
    source: &KeySource,
    uri: &Uri,
    headers: &HeaderMap,
    body: &[u8],
) -> Result<Option<Vec<u8>>, KeyError> {
    let view = View::parse(formats::content_type(headers), body);
    extract_from(source, uri, headers, &view)
}

/// [`extract`] from a body already parsed into a [`View`] (the engine
/// parses a body once for the key and the fingerprint).
pub fn extract_from(
    source: &KeySource,
    uri: &Uri,
    headers: &HeaderMap,
    body: &View<'_>,
) -> Result<Option<Vec<u8>>, KeyError> {
    match source {
        KeySource::Header(name) => {
            let mut values = headers.get_all(name.as_str()).iter();
            let Some(value) = values.next() else {
                return Ok(None);
            };
            if values.next().is_some() {
                return Err(KeyError::Repeated);
            }
            unquote(value.as_bytes()).map(Some)
        }
        KeySource::Query(name) => {
            // Also under the names PHP and Rack read as it; given more
            // than once with different values (`?key=T&key=U`: PHP and
            // Rack read the last), refused, as a repeated header is.
            let mut readings = Readings::default();
            readings.query(name, uri, true);
            readings.settle()
        }
        KeySource::FormField(name) => form_field_key(name, uri, headers, body),
        KeySource::JsonPointer(pointer) => {
            // Read whatever the content type says, as a client may not
            // label its JSON.
            let tokens = formats::parse_pointer(pointer);
            let parsed = serde_json::from_slice::<serde_json::Value>(body.bytes);
            // The query is read beside a form only: beside JSON (labelled,
            // parsed, or opening as JSON does), an empty body or any other,
            // a JSON API's `?key=…` is as often its API key.
            let form = match &body.kind {
                formats::Kind::Form(_) | formats::Kind::Multipart(_) => true,
                _ => {
                    let content_type = formats::content_type(headers);
                    !body.bytes.is_empty() && formats::rack_form(content_type)
                }
            };
            let json_body = parsed.is_ok() || body.is_json() || formats::opens_as_json(body.bytes);
            let form = form && !json_body;
            let in_json = match parsed {
                Ok(value) => match formats::pointer_get(&value, &tokens) {
                    None | Some(serde_json::Value::Null) => None,
                    Some(serde_json::Value::String(s)) => Some(s.clone().into_bytes()),
                    Some(_) => return Err(KeyError::NotAString),
                },
                // What serde_json refuses but backends read (a BOM, a lone
                // surrogate, deep nesting) must not hide the key.
                Err(_) => match json::value_at(body.bytes, &tokens) {
                    json::Found::Absent => None,
                    json::Found::String(key) => Some(key),
                    json::Found::Other => return Err(KeyError::NotAString),
                },
            };
            // The same data sent as a form, or in the query: read where
            // backends read it (see `form_name`).
            let Some(name) = form_name(&tokens) else {
                return Ok(in_json);
            };
            let mut readings = Readings::default();
            readings.exact.extend(in_json);
            readings.fields(&name, headers, body);
            // Express's `req.body` never merges the query either.
            if form {
                readings.query(&name, uri, false);
            }
            readings.settle()
        }
    }
}

/// Every value a body-keyed route's key is read as, by the readings
/// backends make of the request, to settle on one.
#[derive(Default)]
struct Readings {
    /// The field itself, each time it is given (malformed or not).
    exact: Vec<Vec<u8>>,
    /// The values of the other readings, in order.
    others: Vec<Vec<u8>>,
}

impl Readings {
    /// The form fields `name` is read as ([`View::framework_fields`]: the
    /// field itself, names PHP or Rack read as it, a body Rack reads as a
    /// form although its type says otherwise).
    fn fields(&mut self, name: &str, headers: &HeaderMap, body: &View<'_>) {
        self.exact
            .extend(body.fields(name).into_iter().map(<[u8]>::to_vec));
        let content_type = formats::content_type(headers);
        self.others
            .extend(body.framework_fields(content_type, name));
    }

    /// The query's fields read as `name` ([`formats::read_as`]; fields
    /// split at `;` too, as Rack 2 splits a query), as the key's own
    /// field (`exact`: a query route) or as another reading (a body-keyed
    /// route: Laravel's `input()` and Rails' `params` merge the query into
    /// the body's fields).
    fn query(&mut self, name: &str, uri: &Uri, exact: bool) {
        let Some(query) = uri.query() else { return };
        for (field, value) in formats::form_pairs(query.as_bytes()) {
            if exact && field == name.as_bytes() {
                self.exact.push(value);
            } else if formats::read_as(&field, name) {
                self.others.push(value);
            }
        }
        // Rack 2's reading beside it: a `;` inside the key (`key=a;b`)
        // cuts it there, so that key conflicts rather than shrinks.
        if query.contains(';') {
            let split = query.replace(';', "&");
            for (field, value) in formats::form_pairs(split.as_bytes()) {
                if formats::read_as(&field, name) {
                    self.others.push(value);
                }
            }
        }
    }

    /// The key: the field itself where it is given, else the first
    /// well-formed other reading (a malformed value there is no key, as
    /// before these readings, rather than a 400 for a request that never
    /// meant it as one); [`KeyError::Conflicting`] when a reading says
    /// otherwise: once the field itself is given, any other non-empty
    /// value (PHP reads the last `submission.token=U%20V` as the key,
    /// malformed or not); without it, another well-formed one.
    fn settle(self) -> Result<Option<Vec<u8>>, KeyError> {
        let Readings { exact, others } = self;
        let (key, rest): (Vec<u8>, Vec<Vec<u8>>) = match exact.split_first() {
            Some((key, more)) => {
                let others = others.into_iter().filter(|value| !value.is_empty());
                (key.clone(), more.iter().cloned().chain(others).collect())
            }
            None => {
                let mut well_formed = others
                    .into_iter()
                    .filter(|key| validate(key, false).is_ok());
                let Some(key) = well_formed.next() else {
                    return Ok(None);
                };
                (key, well_formed.collect())
            }
        };
        match rest.iter().any(|other| *other != key) {
            true => Err(KeyError::Conflicting),
            false => Ok(Some(key)),
        }
    }
}

/// A form-field key wherever the backends' frameworks read the field
/// ([`Readings`]): the field itself (each time it is given); a field PHP
/// or Rack reads under that name (`submission.token`,
/// `[submission_token]`, see [`formats::read_as`]); a body Rack reads as a
/// form although its type says otherwise (none, a form type cut at a comma,
/// multipart without a boundary); the same data sent as JSON, whose
/// top-level member Laravel's `input()`, Rails' `params` and Express's
/// `req.body` read (whatever the content type); the query's field, which
/// Laravel's `input()` and Rails' `params` merge in. Given more than once
/// with different values, the key is [`KeyError::Conflicting`]: a backend
/// may read another one than this reader (PHP, Rack and Django the last
/// of a repeated field).
fn form_field_key(
    name: &str,
    uri: &Uri,
    headers: &HeaderMap,
    body: &View<'_>,
) -> Result<Option<Vec<u8>>, KeyError> {
    let mut readings = Readings::default();
    readings.fields(name, headers, body);
    if let json::Found::String(key) = json::value_at(body.bytes, &[name]) {
        readings.others.push(key);
    }
    readings.query(name, uri, false);
    readings.settle()
}

/// The form field that holds a JSON pointer's value when the same data
/// arrives as a form (urlencoded or multipart): Laravel's `input()`,
/// Rails' `params` and Express's `req.body` read `/order/key` from the
/// field `order[key]`. `None` for the empty pointer.
fn form_name(tokens: &[String]) -> Option<String> {
    let (first, rest) = tokens.split_first()?;
    Some(
        rest.iter()
            .fold(first.clone(), |name, token| format!("{name}[{token}]")),
    )
}

/// Checks a raw key: 1..=255 visible ASCII characters, and a hyphenated
/// UUID when `uuid_only`.
pub fn validate(key: &[u8], uuid_only: bool) -> Result<(), KeyError> {
    if key.is_empty() {
        return Err(KeyError::Empty);
    }
    if key.len() > MAX_KEY_LEN {
        return Err(KeyError::TooLong);
    }
    if !key.iter().all(|b| (0x21..=0x7e).contains(b)) {
        return Err(KeyError::InvalidCharacter);
    }
    if uuid_only && !is_uuid(key) {
        return Err(KeyError::NotUuid);
    }
    Ok(())
}

fn is_uuid(key: &[u8]) -> bool {
    key.len() == 36
        && key.iter().enumerate().all(|(i, b)| match i {
            8 | 13 | 18 | 23 => *b == b'-',
            _ => b.is_ascii_hexdigit(),
        })
}

/// Whether `key` is a key every reader of the `Idempotency-Key` header
/// takes as it is, sent bare: a valid key ([`validate`]) holding none of the
/// delimiters `"`, `,` and `;`, which [`extract`] refuses in a bare key or
/// reads as quoting. The outbox's delivery keys are held to it.
pub fn is_bare_token(key: &[u8]) -> bool {
    validate(key, false).is_ok() && !key.iter().any(|b| is_delimiter(*b))
}

fn is_delimiter(b: u8) -> bool {
    matches!(b, b'"' | b',' | b';')
}

/// Strips the IETF draft's sf-string quoting (`"abc"`, with `\"` and `\\`
/// escapes); a bare token is returned as it is, unless it holds one of the
/// delimiters `"`, `,` or `;` ([`KeyError::Ambiguous`]): an intermediary may
/// merge two key header lines into `a,b` (RFC 9110, section 5.3), and
/// `a;x=1` is a structured-field item with a parameter, so neither may be
/// read as one key.
fn unquote(value: &[u8]) -> Result<Vec<u8>, KeyError> {
    let Some(inner) = value.strip_prefix(b"\"") else {
        if value.iter().any(|b| is_delimiter(*b)) {
            return Err(KeyError::Ambiguous);
        }
        return Ok(value.to_vec());
    };
    let Some(inner) = inner.strip_suffix(b"\"") else {
        return Err(KeyError::BadQuoting);
    };
    let mut out = Vec::with_capacity(inner.len());
    let mut bytes = inner.iter();
    while let Some(&b) = bytes.next() {
        match b {
            b'\\' => match bytes.next() {
                Some(&escaped @ (b'"' | b'\\')) => out.push(escaped),
                _ => return Err(KeyError::BadQuoting),
            },
            b'"' => return Err(KeyError::BadQuoting),
            _ => out.push(b),
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.append(
                http::HeaderName::from_bytes(name.as_bytes()).unwrap(),
                HeaderValue::from_str(value).unwrap(),
            );
        }
        map
    }

    #[test]
    fn a_json_pointer_reads_the_form_field_backends_read() {
        let pointer = |p: &str| KeySource::JsonPointer(p.into());
        let form = headers(&[("content-type", "application/x-www-form-urlencoded")]);
        let body = b"order%5Bkey%5D=k-1&key=k-2";
        let read = |source: &KeySource| {
            let view = View::parse(formats::content_type(&form), body);
            extract_from(source, &Uri::from_static("/"), &form, &view).unwrap()
        };
        assert_eq!(read(&pointer("/order/key")), Some(b"k-1".to_vec()));
        assert_eq!(read(&pointer("/key")), Some(b"k-2".to_vec()));
        assert_eq!(read(&pointer("/other")), None);
        assert_eq!(form_name(&[]), None);
    }

    fn header_key(value: &str) -> Result<Option<Vec<u8>>, KeyError> {
        extract(
            &KeySource::default(),
            &Uri::from_static("/"),
            &headers(&[("idempotency-key", value)]),
            b"",
        )
    }

    #[test]
    fn bare_and_quoted_header_keys() {
        assert_eq!(header_key("abc-123").unwrap().unwrap(), b"abc-123");
        assert_eq!(header_key("\"abc-123\"").unwrap().unwrap(), b"abc-123");
        assert_eq!(header_key(r#""a\"b""#).unwrap().unwrap(), b"a\"b");
        assert_eq!(header_key("\"abc").unwrap_err(), KeyError::BadQuoting);
        assert_eq!(header_key(r#""a\x""#).unwrap_err(), KeyError::BadQuoting);
        assert_eq!(header_key(r#""a", "b""#).unwrap_err(), KeyError::BadQuoting);
        assert_eq!(header_key(r#""a";x=1"#).unwrap_err(), KeyError::BadQuoting);
        assert_eq!(header_key(r#""a,b;c""#).unwrap().unwrap(), b"a,b;c");
        for ambiguous in ["a,b", "a;x=1", "a\"b", "abc\""] {
            assert_eq!(header_key(ambiguous).unwrap_err(), KeyError::Ambiguous);
        }
    }

    #[test]
    fn repeated_header_is_refused() {
        let map = headers(&[("idempotency-key", "a"), ("idempotency-key", "b")]);
        let err = extract(&KeySource::default(), &Uri::from_static("/"), &map, b"");
        assert_eq!(err.unwrap_err(), KeyError::Repeated);
    }

    #[test]
    fn validation() {
        assert_eq!(validate(b"", false), Err(KeyError::Empty));
        assert_eq!(validate(&[b'a'; 256], false), Err(KeyError::TooLong));
        assert!(validate(&[b'a'; 255], false).is_ok());
        assert_eq!(validate(b"a b", false), Err(KeyError::InvalidCharacter));
        assert_eq!(validate(b"a\x01", false), Err(KeyError::InvalidCharacter));
        assert_eq!(
            validate("ä".as_bytes(), false),
            Err(KeyError::InvalidCharacter)
        );
        assert_eq!(validate(b"abc", true), Err(KeyError::NotUuid));
        assert!(validate(b"6f1c7bd2-3e0e-4d49-9a39-4d2c1a4f0b6e", true).is_ok());
        assert_eq!(
            validate(b"6f1c7bd2x3e0e-4d49-9a39-4d2c1a4f0b6e", true),
            Err(KeyError::NotUuid)
        );
    }

    #[test]
    fn form_and_query_keys() {
        let map = headers(&[("content-type", "application/x-www-form-urlencoded")]);
        let source = KeySource::FormField("submission_token".into());
        let body = b"email=a%40b.c&submission_token=t%2D1&message=hi+there";
        let key = extract(&source, &Uri::from_static("/"), &map, body).unwrap();
        assert_eq!(key.unwrap(), b"t-1");
        let uri = Uri::from_static("/pay?x=1&key=q%21");
        let key = extract(&KeySource::Query("key".into()), &uri, &map, b"").unwrap();
        assert_eq!(key.unwrap(), b"q!");
    }

    #[test]
    fn multipart_keys() {
        let body = b"--XyZ\r\nContent-Disposition: form-data; name=\"email\"\r\n\r\na@b.c\r\n--XyZ\r\nContent-Disposition: form-data; name=\"submission_token\"\r\n\r\ntok-1\r\n--XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.txt\"\r\nContent-Type: text/plain\r\n\r\nhello\r\n--XyZ--\r\n";
        let map = headers(&[("content-type", "multipart/form-data; boundary=XyZ")]);
        let source = KeySource::FormField("submission_token".into());
        let key = extract(&source, &Uri::from_static("/"), &map, body).unwrap();
        assert_eq!(key.unwrap(), b"tok-1");
        let parts = formats::multipart_parts(body, "XyZ").unwrap();
        assert_eq!(parts.len(), 3);
        assert_eq!(parts[2].name, b"file");
        assert_eq!(parts[2].data, b"hello");
        assert!(formats::multipart_parts(b"--XyZ\r\ngarbage", "XyZ").is_none());
    }

    #[test]
    fn json_pointer_keys() {
        let source = KeySource::JsonPointer("/meta/key".into());
        let uri = Uri::from_static("/");
        let map = HeaderMap::new();
        let key = extract(&source, &uri, &map, br#"{"meta":{"key":"k1"}}"#).unwrap();
        assert_eq!(key.unwrap(), b"k1");
        assert_eq!(extract(&source, &uri, &map, b"{}").unwrap(), None);
        assert_eq!(extract(&source, &uri, &map, b"not json").unwrap(), None);
        let err = extract(&source, &uri, &map, br#"{"meta":{"key":7}}"#);
        assert_eq!(err.unwrap_err(), KeyError::NotAString);
    }
}
