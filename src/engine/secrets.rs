//! The server secret that keys every stored hash ([`KeySecret`]), the one
//! hasher that applies it ([`IdentityHasher`]), and the parsing of key
//! material written as hex or base64 ([`decode_key_material`]).
//!
//! Keys are often low-entropy (`order-1001`): a plain SHA-256 of a scope
//! lets anyone holding a copy of the store confirm a guess. Under a
//! [`KeySecret`] every stored identity hash is HMAC-SHA-256 instead, which
//! nobody without the secret can compute.

use std::fmt;
use std::sync::Arc;

use base64::Engine as _;
use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};
use zeroize::Zeroizing;

/// The fewest bytes a [`KeySecret`] may have (HMAC-SHA-256's output size).
pub const MIN_SECRET_BYTES: usize = 32;

/// A server secret for keyed hashes (HMAC-SHA-256).
///
/// Its bytes are never printed (`Debug` shows `KeySecret(…)`) and are wiped
/// from memory when the last clone is dropped.
#[derive(Clone)]
pub struct KeySecret {
    bytes: Arc<Zeroizing<Vec<u8>>>,
}

impl fmt::Debug for KeySecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("KeySecret(…)")
    }
}

impl KeySecret {
    /// A secret of at least [`MIN_SECRET_BYTES`] bytes (e.g. 32 random
    /// bytes: `openssl rand -hex 32`).
    pub fn new(bytes: impl Into<Vec<u8>>) -> Result<Self, SecretError> {
        let bytes = Zeroizing::new(bytes.into());
        if bytes.len() < MIN_SECRET_BYTES {
            return Err(SecretError::new(format!(
                "the key secret has {} bytes; at least {MIN_SECRET_BYTES} are required \
                 (generate one with `openssl rand -hex 32`)",
                bytes.len()
            )));
        }
        Ok(KeySecret {
            bytes: Arc::new(bytes),
        })
    }

    /// A secret written as hex or base64 (see [`decode_key_material`]).
    pub fn parse(text: &str) -> Result<Self, SecretError> {
        Self::new(decode_key_material(text)?.to_vec())
    }
}

/// Hashes an identity for storage: SHA-256 without a [`KeySecret`],
/// HMAC-SHA-256 under it.
///
/// This is the one way the engine turns something that identifies a caller
/// or an operation (the scope of a key, a principal) into the hash a store
/// keeps: every stored identity hash must come from the engine's hasher
/// ([`Engine::identity_hasher`](crate::Engine::identity_hasher)), so a
/// configured secret keys all of them alike. Without a secret the result is
/// exactly the plain SHA-256 of the same bytes, so records written before a
/// secret existed keep their hashes.
///
/// Cheap to clone (the secret is shared).
#[derive(Clone, Debug, Default)]
pub struct IdentityHasher {
    secret: Option<KeySecret>,
}

impl IdentityHasher {
    /// A hasher keyed by `secret`, or plain SHA-256 without one.
    pub fn new(secret: Option<KeySecret>) -> Self {
        IdentityHasher { secret }
    }

    /// Whether hashes are keyed (a secret is configured).
    pub fn is_keyed(&self) -> bool {
        self.secret.is_some()
    }

    /// An incremental digest: feed it with [`IdentityDigest::update`].
    pub fn start(&self) -> IdentityDigest {
        match &self.secret {
            None => IdentityDigest::Plain(Sha256::new()),
            Some(secret) => IdentityDigest::Keyed(
                // HMAC takes keys of any length.
                Hmac::<Sha256>::new_from_slice(&secret.bytes).expect("HMAC accepts any key length"),
            ),
        }
    }

    /// The hash of `bytes`: `SHA-256(bytes)`, or `HMAC-SHA-256(secret,
    /// bytes)`.
    pub fn digest(&self, bytes: &[u8]) -> [u8; 32] {
        let mut digest = self.start();
        digest.update(bytes);
        digest.finalize()
    }
}

/// A digest in progress, made by [`IdentityHasher::start`].
pub enum IdentityDigest {
    /// Unkeyed: SHA-256.
    Plain(Sha256),
    /// Keyed: HMAC-SHA-256.
    Keyed(Hmac<Sha256>),
}

impl fmt::Debug for IdentityDigest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            IdentityDigest::Plain(_) => f.write_str("IdentityDigest::Plain"),
            IdentityDigest::Keyed(_) => f.write_str("IdentityDigest::Keyed"),
        }
    }
}

impl IdentityDigest {
    /// Feeds `bytes`.
    pub fn update(&mut self, bytes: impl AsRef<[u8]>) {
        let bytes = bytes.as_ref();
        match self {
            IdentityDigest::Plain(hasher) => Digest::update(hasher, bytes),
            IdentityDigest::Keyed(mac) => mac.update(bytes),
        }
    }

    /// The 32-byte hash.
    pub fn finalize(self) -> [u8; 32] {
        match self {
            IdentityDigest::Plain(hasher) => hasher.finalize().into(),
            IdentityDigest::Keyed(mac) => mac.finalize().into_bytes().into(),
        }
    }
}

/// Decodes key material written as text: hex when the text (surrounding
/// whitespace removed) is only hex digits, else base64 (standard or
/// URL-safe alphabet, padding optional). The bytes are wiped when dropped.
pub fn decode_key_material(text: &str) -> Result<Zeroizing<Vec<u8>>, SecretError> {
    let text = text.trim();
    if text.is_empty() {
        return Err(SecretError::new(
            "it is empty; expected hex or base64 of random bytes",
        ));
    }
    if text.len() % 2 == 0 && text.bytes().all(|b| b.is_ascii_hexdigit()) {
        return hex::decode(text)
            .map(Zeroizing::new)
            .map_err(|_| SecretError::new("it is not valid hex"));
    }
    let unpadded = text.trim_end_matches('=');
    let engine = if unpadded.contains(['-', '_']) {
        &base64::engine::general_purpose::URL_SAFE_NO_PAD
    } else {
        &base64::engine::general_purpose::STANDARD_NO_PAD
    };
    engine.decode(unpadded).map(Zeroizing::new).map_err(|_| {
        SecretError::new("it is neither hex nor base64 (e.g. `openssl rand -base64 32`)")
    })
}

/// A secret or key that was refused: what is wrong and what is expected.
/// The message never contains key material.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct SecretError {
    message: String,
}

impl SecretError {
    pub(crate) fn new(message: impl Into<String>) -> Self {
        SecretError {
            message: message.into(),
        }
    }

    /// The same error, prefixed with where the secret came from (`key
    /// "2"`, an environment variable's name).
    pub fn context(self, origin: impl fmt::Display) -> Self {
        SecretError::new(format!("{origin}: {}", self.message))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unkeyed_is_plain_sha256_and_keyed_differs() {
        let plain = IdentityHasher::default();
        assert!(!plain.is_keyed());
        assert_eq!(
            plain.digest(b"abc"),
            <[u8; 32]>::from(Sha256::digest(b"abc"))
        );
        let keyed = IdentityHasher::new(Some(KeySecret::new([7u8; 32]).unwrap()));
        let other = IdentityHasher::new(Some(KeySecret::new([8u8; 32]).unwrap()));
        assert!(keyed.is_keyed());
        assert_ne!(keyed.digest(b"abc"), plain.digest(b"abc"));
        assert_ne!(keyed.digest(b"abc"), other.digest(b"abc"));
        // Incremental and one-shot agree.
        let mut digest = keyed.start();
        digest.update(b"a");
        digest.update(b"bc");
        assert_eq!(digest.finalize(), keyed.digest(b"abc"));
        // RFC 4231 test case 2 (a short key is accepted by HMAC itself).
        let mut mac = Hmac::<Sha256>::new_from_slice(b"Jefe").unwrap();
        mac.update(b"what do ya want for nothing?");
        assert_eq!(
            hex::encode(mac.finalize().into_bytes()),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
    }

    #[test]
    fn key_material_is_hex_or_base64() {
        let bytes: Vec<u8> = (0..32).collect();
        let hex_text = hex::encode(&bytes);
        assert_eq!(*decode_key_material(&hex_text).unwrap(), bytes);
        assert_eq!(
            *decode_key_material(&format!(" {}\n", hex_text.to_uppercase())).unwrap(),
            bytes
        );
        let b64 = base64::engine::general_purpose::STANDARD.encode(&bytes);
        assert_eq!(*decode_key_material(&b64).unwrap(), bytes);
        let url = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode([0xfb_u8; 32]);
        assert_eq!(*decode_key_material(&url).unwrap(), vec![0xfb; 32]);
        assert!(decode_key_material("").is_err());
        assert!(decode_key_material("not base64!").is_err());
    }

    #[test]
    fn a_short_secret_is_refused_and_never_printed() {
        let error = KeySecret::parse(&hex::encode([1u8; 16])).unwrap_err();
        assert!(error.to_string().contains("16 bytes"), "{error}");
        assert!(error.to_string().contains("at least 32"), "{error}");
        let secret = KeySecret::new(vec![0xab; 32]).unwrap();
        assert_eq!(format!("{secret:?}"), "KeySecret(…)");
    }
}
