//! The operator API's bearer token.

use std::fmt;
use std::path::Path;

use http::HeaderValue;
use sha2::{Digest, Sha256};

/// The environment variable the admin token is read from.
pub const TOKEN_ENV: &str = "IDEMPOTENCY_ADMIN_TOKEN";

/// The shortest token accepted: a guessable token is refused at start.
const MIN_LEN: usize = 16;

/// A bearer token for the operator API. Only its SHA-256 is kept, and a
/// presented token is compared digest to digest, so the comparison's time
/// says nothing about the token.
#[derive(Clone)]
pub struct AdminToken {
    digest: [u8; 32],
}

impl fmt::Debug for AdminToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("AdminToken(…)")
    }
}

impl AdminToken {
    /// The token from `IDEMPOTENCY_ADMIN_TOKEN`, else from `file`, else
    /// none. Surrounding whitespace (a file's trailing newline) is not part
    /// of it; a token shorter than 16 characters is refused.
    pub fn load(file: Option<&Path>) -> Result<Option<Self>, String> {
        let (text, origin) = match std::env::var(TOKEN_ENV) {
            Ok(text) => (text, TOKEN_ENV.to_owned()),
            Err(std::env::VarError::NotUnicode(_)) => {
                return Err(format!("{TOKEN_ENV} is not valid UTF-8"))
            }
            Err(std::env::VarError::NotPresent) => match file {
                None => return Ok(None),
                Some(path) => (
                    std::fs::read_to_string(path)
                        .map_err(|error| format!("admin_token_file {}: {error}", path.display()))?,
                    format!("admin_token_file {}", path.display()),
                ),
            },
        };
        Self::new(text.trim())
            .map(Some)
            .map_err(|error| format!("{origin}: {error}"))
    }

    /// A token from its text.
    pub fn new(text: &str) -> Result<Self, String> {
        if text.chars().count() < MIN_LEN {
            return Err(format!(
                "the admin token must be at least {MIN_LEN} characters (try `openssl rand -hex 32`)"
            ));
        }
        Ok(AdminToken {
            digest: Sha256::digest(text.as_bytes()).into(),
        })
    }

    /// Whether an `Authorization` header carries this token as `Bearer`.
    pub fn admits(&self, authorization: Option<&HeaderValue>) -> bool {
        let Some(value) = authorization.and_then(|value| value.to_str().ok()) else {
            return false;
        };
        let Some((scheme, presented)) = value.split_once(' ') else {
            return false;
        };
        if !scheme.eq_ignore_ascii_case("bearer") {
            return false;
        }
        let presented: [u8; 32] = Sha256::digest(presented.trim().as_bytes()).into();
        // Equal digests of unequal tokens do not happen; comparing digests
        // leaks nothing useful about the token through timing.
        presented == self.digest
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admits_only_the_bearer_token() {
        let token = AdminToken::new("0123456789abcdef-secret").unwrap();
        let header = |text: &str| HeaderValue::from_str(text).unwrap();
        assert!(token.admits(Some(&header("Bearer 0123456789abcdef-secret"))));
        assert!(token.admits(Some(&header("bearer 0123456789abcdef-secret"))));
        assert!(!token.admits(Some(&header("Bearer 0123456789abcdef-secreT"))));
        assert!(!token.admits(Some(&header("Basic 0123456789abcdef-secret"))));
        assert!(!token.admits(Some(&header("0123456789abcdef-secret"))));
        assert!(!token.admits(None));
    }

    #[test]
    fn a_short_token_is_refused() {
        let error = AdminToken::new("short").unwrap_err();
        assert!(error.contains("at least 16"), "{error}");
    }
}
