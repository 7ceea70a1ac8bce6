//! Stored responses encrypted at rest: a [`Keyring`] of AES-256-GCM keys,
//! each with an id, and the engine's sealing of every outcome it stores and
//! opening of every sealed outcome it reads.
//!
//! The stores never see a key: the engine hands them an
//! [`Outcome::Sealed`] (an opaque byte string) and gets it back. The
//! layout of those bytes:
//!
//! ```text
//! 0x01 | id length (1 byte) | key id | nonce (12 bytes) | ciphertext | tag (16 bytes)
//! ```
//!
//! The plaintext is [`Outcome::encode`] — status, headers and body, or the
//! "not stored"/"incomplete" markers — so a sealed record shows none of
//! them. The associated data is the header (version and key id) followed by
//! the record's [`ScopeKey`]: a ciphertext copied into another key's record,
//! or relabelled with another key id, fails to open.

use std::fmt;
use std::sync::Arc;

use aes_gcm::aead::{AeadInPlace, KeyInit};
use aes_gcm::{Aes256Gcm, Nonce};
use bytes::Bytes;

use super::secrets::{decode_key_material, SecretError};
use super::Engine;
use crate::store::{Outcome, ScopeKey, SealedOutcome, StoreError};

/// The first byte of a sealed outcome: the layout above.
const VERSION: u8 = 1;
/// AES-GCM's nonce: 96 bits, drawn at random for every record.
const NONCE_LEN: usize = 12;
/// AES-GCM's authentication tag.
const TAG_LEN: usize = 16;
/// The longest key id.
pub const MAX_KEY_ID_LEN: usize = 64;

/// One AES-256-GCM key and the id stored with every record it seals.
///
/// The key bytes are never printed (`Debug` shows the id only).
#[derive(Clone)]
pub struct EncryptionKey {
    id: Arc<str>,
    cipher: Aes256Gcm,
}

impl fmt::Debug for EncryptionKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EncryptionKey")
            .field("id", &self.id)
            .finish_non_exhaustive()
    }
}

impl EncryptionKey {
    /// A key named `id` (1 to 64 characters of `A-Z a-z 0-9 . _ -`) from
    /// exactly 32 bytes.
    pub fn new(id: &str, key: &[u8]) -> Result<Self, SecretError> {
        check_id(id)?;
        let cipher = Aes256Gcm::new_from_slice(key).map_err(|_| {
            SecretError::new(format!(
                "encryption key \"{id}\" has {} bytes; an AES-256 key is exactly 32 \
                 (generate one with `openssl rand -base64 32`)",
                key.len()
            ))
        })?;
        Ok(EncryptionKey {
            id: id.into(),
            cipher,
        })
    }

    /// A key named `id` from 32 bytes written as hex (64 digits) or base64
    /// (44 characters).
    pub fn parse(id: &str, text: &str) -> Result<Self, SecretError> {
        check_id(id)?;
        let bytes = decode_key_material(text)
            .map_err(|error| error.context(format_args!("encryption key \"{id}\"")))?;
        Self::new(id, &bytes)
    }

    /// The key's id.
    pub fn id(&self) -> &str {
        &self.id
    }
}

fn check_id(id: &str) -> Result<(), SecretError> {
    let allowed = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-');
    if id.is_empty() || id.len() > MAX_KEY_ID_LEN || !id.chars().all(allowed) {
        return Err(SecretError::new(format!(
            "encryption key id {id:?} is not valid: use 1 to {MAX_KEY_ID_LEN} characters \
             of A-Z a-z 0-9 . _ - (e.g. \"2026-11\")"
        )));
    }
    Ok(())
}

/// The keys stored responses are sealed and opened with: new records are
/// sealed with the current key; a record opens with the key whose id it
/// carries, as long as that key is listed.
///
/// To rotate: add the new key and make it current, keeping the old one
/// listed until the records it sealed have expired (the longest route
/// `ttl`); then remove it. A record whose key is no longer listed cannot be
/// replayed: the engine answers 503 for it, never a second execution.
///
/// Cheap to clone.
#[derive(Clone)]
pub struct Keyring {
    keys: Arc<[EncryptionKey]>,
    current: usize,
    refuse_plain: bool,
}

impl fmt::Debug for Keyring {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Keyring")
            .field("current", &self.current_id())
            .field("ids", &self.keys.iter().map(|k| k.id()).collect::<Vec<_>>())
            .field("refuse_plain", &self.refuse_plain)
            .finish()
    }
}

impl Keyring {
    /// A keyring of `keys` sealing with the one named `current`. Refused
    /// when it is empty, two keys share an id, or `current` is not among
    /// them.
    pub fn new(keys: Vec<EncryptionKey>, current: &str) -> Result<Self, SecretError> {
        if keys.is_empty() {
            return Err(SecretError::new(
                "the keyring has no encryption key; list at least the current one",
            ));
        }
        for (i, key) in keys.iter().enumerate() {
            if keys[..i].iter().any(|other| other.id() == key.id()) {
                return Err(SecretError::new(format!(
                    "encryption key id \"{}\" is listed twice; every key needs its own id",
                    key.id()
                )));
            }
        }
        let current = keys
            .iter()
            .position(|key| key.id() == current)
            .ok_or_else(|| {
                SecretError::new(format!(
                    "the current encryption key \"{current}\" is not listed (listed: {})",
                    keys.iter()
                        .map(|key| format!("\"{}\"", key.id()))
                        .collect::<Vec<_>>()
                        .join(", ")
                ))
            })?;
        Ok(Keyring {
            keys: keys.into(),
            current,
            refuse_plain: false,
        })
    }

    /// This keyring, refusing records stored in the clear: without it, an
    /// outcome that is not sealed (stored before encryption was
    /// configured) is replayed as it is, so anyone who can write to the
    /// store can plant a plain response any retry is replayed; with it,
    /// such a record is [`StoreError::Unreadable`] (503, never executed
    /// again), as one that fails authentication is. Turn it on once the
    /// longest `ttl` has passed since encryption was configured.
    pub fn refusing_plain(mut self) -> Self {
        self.refuse_plain = true;
        self
    }

    /// Whether records stored in the clear are refused
    /// ([`refusing_plain`](Keyring::refusing_plain)).
    pub fn refuses_plain(&self) -> bool {
        self.refuse_plain
    }

    /// The id new records are sealed with.
    pub fn current_id(&self) -> &str {
        self.keys[self.current].id()
    }

    /// Seals `outcome` for the record of `key` with the current key and a
    /// fresh random nonce. An outcome already sealed is returned as it is.
    pub fn seal(&self, key: &ScopeKey, outcome: &Outcome) -> Result<SealedOutcome, StoreError> {
        if let Outcome::Sealed(sealed) = outcome {
            return Ok(sealed.clone());
        }
        let current = &self.keys[self.current];
        let id = current.id().as_bytes();
        let mut out = Vec::with_capacity(2 + id.len() + NONCE_LEN + 64 + TAG_LEN);
        out.push(VERSION);
        out.push(id.len() as u8);
        out.extend_from_slice(id);
        let aad = associated_data(&out, key);
        let nonce: [u8; NONCE_LEN] = rand::random();
        out.extend_from_slice(&nonce);
        let start = out.len();
        outcome.encode_into(&mut out);
        let tag = current
            .cipher
            .encrypt_in_place_detached(Nonce::from_slice(&nonce), &aad, &mut out[start..])
            .map_err(|_| StoreError::Unreadable("the outcome is too large to seal".into()))?;
        out.extend_from_slice(&tag);
        Ok(SealedOutcome::from_bytes(Bytes::from(out)))
    }

    /// Opens what [`seal`](Keyring::seal) made for the record of `key`.
    /// [`StoreError::Unreadable`] when the key id is not listed, the bytes
    /// do not authenticate (a wrong key, altered bytes, another record's
    /// ciphertext) or are not a sealed outcome at all. The error names the
    /// key id, never key material.
    pub fn open(&self, key: &ScopeKey, sealed: &SealedOutcome) -> Result<Outcome, StoreError> {
        let (id, header_len) = parse_header(sealed.as_bytes())?;
        let bytes = sealed.as_bytes();
        let rest = &bytes[header_len..];
        if rest.len() < NONCE_LEN + TAG_LEN {
            return Err(StoreError::Unreadable("a truncated sealed outcome".into()));
        }
        let Some(entry) = self.keys.iter().find(|k| k.id() == id) else {
            return Err(StoreError::Unreadable(format!(
                "the record is sealed with encryption key \"{id}\", which is not configured"
            )));
        };
        let aad = associated_data(&bytes[..header_len], key);
        let (nonce, sealed_text) = rest.split_at(NONCE_LEN);
        let (ciphertext, tag) = sealed_text.split_at(sealed_text.len() - TAG_LEN);
        let mut plain = ciphertext.to_vec();
        entry
            .cipher
            .decrypt_in_place_detached(
                Nonce::from_slice(nonce),
                &aad,
                &mut plain,
                aes_gcm::Tag::from_slice(tag),
            )
            .map_err(|_| {
                StoreError::Unreadable(format!(
                    "the record does not open with encryption key \"{id}\" (a different key \
                     under the same id, altered bytes, or another record's ciphertext)"
                ))
            })?;
        Outcome::decode(&plain)
    }
}

/// The key id a sealed outcome names, without opening it (for operators:
/// which key must stay listed).
pub fn sealed_key_id(sealed: &SealedOutcome) -> Result<&str, StoreError> {
    parse_header(sealed.as_bytes()).map(|(id, _)| id)
}

/// The key id and the header's length.
fn parse_header(bytes: &[u8]) -> Result<(&str, usize), StoreError> {
    let unreadable = || StoreError::Unreadable("not a sealed outcome this version writes".into());
    match bytes {
        [VERSION, len, rest @ ..] if rest.len() >= usize::from(*len) => {
            let len = usize::from(*len);
            // Only ids the keyring accepts (so an altered id never reaches
            // a log line as anything but a plain id).
            let id = std::str::from_utf8(&rest[..len]).map_err(|_| unreadable())?;
            check_id(id).map_err(|_| unreadable())?;
            Ok((id, 2 + len))
        }
        _ => Err(unreadable()),
    }
}

/// The header (version and key id), then the record's scope key.
fn associated_data(header: &[u8], key: &ScopeKey) -> Vec<u8> {
    let mut aad = Vec::with_capacity(header.len() + 32);
    aad.extend_from_slice(header);
    aad.extend_from_slice(key.as_bytes());
    aad
}

impl Engine {
    /// `outcome` as the store keeps it for `key`: sealed with the current
    /// key when a keyring is configured, as it is otherwise. Sealing fails
    /// only for an outcome too large for AES-GCM (64 GiB); the "not
    /// stored" marker is sealed instead, which still keeps the request from
    /// running twice.
    pub(super) fn seal(&self, key: &ScopeKey, outcome: Outcome) -> Outcome {
        let Some(keyring) = &self.inner.config.encryption else {
            return outcome;
        };
        match keyring.seal(key, &outcome) {
            Ok(sealed) => Outcome::Sealed(sealed),
            Err(_) => {
                let status = outcome.status().unwrap_or(http::StatusCode::OK);
                let marker = Outcome::TooLarge { status };
                keyring.seal(key, &marker).map_or(marker, Outcome::Sealed)
            }
        }
    }

    /// `outcome` as read from the record of `key`, opened when sealed.
    /// A plain outcome (stored before encryption was configured) is
    /// returned as it is, unless the keyring
    /// [refuses plain records](Keyring::refusing_plain). A sealed one that
    /// cannot be opened — its key is not configured, or it fails
    /// authentication — is [`StoreError::Unreadable`].
    pub fn open_outcome(&self, key: &ScopeKey, outcome: Outcome) -> Result<Outcome, StoreError> {
        match (outcome, &self.inner.config.encryption) {
            (Outcome::Sealed(sealed), Some(keyring)) => keyring.open(key, &sealed),
            (Outcome::Sealed(sealed), None) => Err(StoreError::Unreadable(format!(
                "the record is sealed with encryption key \"{}\" and no encryption keys \
                 are configured",
                sealed_key_id(&sealed).unwrap_or("?")
            ))),
            (_, Some(keyring)) if keyring.refuse_plain => Err(StoreError::Unreadable(
                "the record is stored in the clear and the keyring refuses plain records".into(),
            )),
            (plain, _) => Ok(plain),
        }
    }
}

#[cfg(test)]
mod tests {
    use http::{HeaderName, HeaderValue, StatusCode};

    use super::*;
    use crate::store::StoredResponse;

    fn key(id: &str, byte: u8) -> EncryptionKey {
        EncryptionKey::new(id, &[byte; 32]).unwrap()
    }

    fn response() -> Outcome {
        Outcome::Stored(StoredResponse {
            status: StatusCode::CREATED,
            headers: vec![(
                HeaderName::from_static("x-secret"),
                HeaderValue::from_static("header-marker"),
            )],
            body: Bytes::from_static(b"body-marker"),
        })
    }

    fn contains(haystack: &[u8], needle: &[u8]) -> bool {
        haystack.windows(needle.len()).any(|w| w == needle)
    }

    #[test]
    fn seals_and_opens_every_outcome() {
        let ring = Keyring::new(vec![key("1", 1)], "1").unwrap();
        let scope = ScopeKey([3; 32]);
        for outcome in [
            response(),
            Outcome::TooLarge {
                status: StatusCode::CREATED,
            },
            Outcome::Incomplete {
                status: StatusCode::ACCEPTED,
            },
        ] {
            let sealed = ring.seal(&scope, &outcome).unwrap();
            assert_eq!(sealed_key_id(&sealed).unwrap(), "1");
            assert_eq!(ring.open(&scope, &sealed).unwrap(), outcome);
        }
        let sealed = ring.seal(&scope, &response()).unwrap();
        assert!(!contains(sealed.as_bytes(), b"body-marker"));
        assert!(!contains(sealed.as_bytes(), b"header-marker"));
        // A fresh nonce every time.
        assert_ne!(sealed, ring.seal(&scope, &response()).unwrap());
    }

    #[test]
    fn another_record_a_wrong_key_or_altered_bytes_do_not_open() {
        let ring = Keyring::new(vec![key("1", 1)], "1").unwrap();
        let scope = ScopeKey([3; 32]);
        let sealed = ring.seal(&scope, &response()).unwrap();
        let unreadable =
            |result: Result<Outcome, StoreError>| matches!(result, Err(StoreError::Unreadable(_)));
        assert!(unreadable(ring.open(&ScopeKey([4; 32]), &sealed)));
        let wrong = Keyring::new(vec![key("1", 2)], "1").unwrap();
        assert!(unreadable(wrong.open(&scope, &sealed)));
        let missing = Keyring::new(vec![key("2", 1)], "2").unwrap();
        let error = missing.open(&scope, &sealed).unwrap_err().to_string();
        assert!(
            error.contains("\"1\"") && error.contains("not configured"),
            "{error}"
        );
        for at in [0, 1, 2, 3, 10, sealed.as_bytes().len() - 1] {
            let mut bytes = sealed.as_bytes().to_vec();
            bytes[at] ^= 1;
            let altered = SealedOutcome::from_bytes(Bytes::from(bytes));
            assert!(unreadable(ring.open(&scope, &altered)), "byte {at}");
        }
        let truncated = SealedOutcome::from_bytes(sealed.as_bytes().slice(..20));
        assert!(unreadable(ring.open(&scope, &truncated)));
        assert!(unreadable(
            ring.open(&scope, &SealedOutcome::from_bytes(Bytes::new()))
        ));
    }

    #[test]
    fn rotation_opens_old_records_and_seals_with_the_current_key() {
        let scope = ScopeKey([5; 32]);
        let old = Keyring::new(vec![key("1", 1)], "1").unwrap();
        let sealed = old.seal(&scope, &response()).unwrap();
        let rotated = Keyring::new(vec![key("1", 1), key("2", 2)], "2").unwrap();
        assert_eq!(rotated.open(&scope, &sealed).unwrap(), response());
        let new = rotated.seal(&scope, &response()).unwrap();
        assert_eq!(sealed_key_id(&new).unwrap(), "2");
    }

    #[test]
    fn bad_keyrings_are_refused_by_name() {
        let error = |result: Result<Keyring, SecretError>| result.unwrap_err().to_string();
        let message = error(Keyring::new(vec![key("1", 1), key("1", 2)], "1"));
        assert!(message.contains("\"1\" is listed twice"), "{message}");
        let message = error(Keyring::new(vec![key("1", 1)], "2"));
        assert!(message.contains("\"2\" is not listed"), "{message}");
        assert!(Keyring::new(Vec::new(), "1").is_err());
        let message = EncryptionKey::new("k", &[0; 16]).unwrap_err().to_string();
        assert!(message.contains("\"k\" has 16 bytes"), "{message}");
        let message = EncryptionKey::parse("k", "!!").unwrap_err().to_string();
        assert!(message.contains("\"k\""), "{message}");
        assert!(EncryptionKey::new("a b", &[0; 32]).is_err());
        assert!(EncryptionKey::new("", &[0; 32]).is_err());
        let ring = Keyring::new(vec![key("1", 1)], "1").unwrap();
        assert!(!format!("{ring:?} {:?}", key("1", 0x41)).contains("AAAA"));
    }
}
