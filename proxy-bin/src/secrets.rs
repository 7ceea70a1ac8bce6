//! The `[secrets]` table: where the key secret and the encryption keys are
//! read from — environment variables or files, never the configuration
//! file itself, never a flag.
//!
//! ```toml
//! [secrets]
//! key_secret = { env = "IDEMPOTENCY_KEY_SECRET" }   # or { file = "/run/secrets/…" }
//! current_key = "2"
//! keys = [
//!   { id = "1", file = "/run/secrets/idempotency-key-1" },
//!   { id = "2", env = "IDEMPOTENCY_KEY_2" },
//! ]
//! ```
//!
//! Values are hex or base64 (a file's surrounding whitespace is ignored).
//! Every problem is refused at start, naming the secret at fault and where
//! it was read from; a value is never printed.

use std::fmt;
use std::path::PathBuf;

use serde::Deserialize;
use tower_idempotency::engine::{EncryptionKey, KeySecret, Keyring};

/// The `[secrets]` table. Everything optional: without it nothing is keyed
/// or encrypted.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SecretsSettings {
    /// The server secret scope keys are HMAC-SHA-256 under (at least 32
    /// bytes).
    pub key_secret: Option<Source>,
    /// The id of the key new records are sealed with; required with `keys`.
    pub current_key: Option<String>,
    /// The encryption keys (32 bytes each), by id.
    #[serde(default)]
    pub keys: Vec<KeyEntry>,
    /// Records stored in the clear are answered 503 instead of replayed
    /// ([`Keyring::refusing_plain`]); needs `keys`.
    #[serde(default)]
    pub refuse_plain: bool,
}

/// Where one secret is read from: exactly one of `env` and `file`.
#[derive(Clone, PartialEq, Eq, Deserialize)]
#[serde(try_from = "toml::Value")]
pub enum Source {
    /// An environment variable, by name.
    Env(String),
    /// A file, by path.
    File(PathBuf),
}

impl fmt::Debug for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Source::Env(name) => write!(f, "environment variable {name}"),
            Source::File(path) => write!(f, "file {}", path.display()),
        }
    }
}

const SOURCE_HELP: &str = "a secret is never written in the configuration file: \
    write { env = \"VARIABLE\" } or { file = \"/path/to/file\" }";

impl TryFrom<toml::Value> for Source {
    type Error = String;

    fn try_from(value: toml::Value) -> Result<Self, String> {
        // Never echo the value: it may be a secret written inline.
        let toml::Value::Table(mut table) = value else {
            return Err(SOURCE_HELP.to_owned());
        };
        let source = Source::take(&mut table)?;
        // A misspelt second field (`fiel = "/x"` beside `env`) is refused,
        // never ignored: this table names a secret.
        if let Some(other) = table.keys().next() {
            return Err(format!("unknown field `{other}`: {SOURCE_HELP}"));
        }
        Ok(source)
    }
}

impl Source {
    /// The `env` or `file` of `table`, removed from it.
    fn take(table: &mut toml::Table) -> Result<Self, String> {
        let env = table.remove("env");
        let file = table.remove("file");
        match (env, file) {
            (Some(toml::Value::String(name)), None) if !name.is_empty() => Ok(Source::Env(name)),
            (None, Some(toml::Value::String(path))) if !path.is_empty() => {
                Ok(Source::File(path.into()))
            }
            (Some(_), Some(_)) => Err("give either `env` or `file`, not both".to_owned()),
            _ => Err(SOURCE_HELP.to_owned()),
        }
    }

    /// The secret's text, or what is wrong (naming the source).
    fn read(&self) -> Result<String, String> {
        match self {
            Source::Env(name) => match std::env::var(name) {
                Ok(text) => Ok(text),
                Err(std::env::VarError::NotPresent) => Err(format!("{self} is not set")),
                Err(std::env::VarError::NotUnicode(_)) => Err(format!("{self} is not UTF-8")),
            },
            Source::File(path) => {
                std::fs::read_to_string(path).map_err(|error| format!("{self}: {error}"))
            }
        }
    }
}

/// One encryption key: its id and where its 32 bytes are read from.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(try_from = "toml::Value")]
pub struct KeyEntry {
    /// The id stored with every record the key seals.
    pub id: String,
    /// Where the key is read from.
    pub source: Source,
}

impl TryFrom<toml::Value> for KeyEntry {
    type Error = String;

    fn try_from(value: toml::Value) -> Result<Self, String> {
        let help = "an encryption key is { id = \"1\", env = \"VARIABLE\" } or \
                    { id = \"1\", file = \"/path/to/file\" }";
        let toml::Value::Table(mut table) = value else {
            return Err(help.to_owned());
        };
        let id = match table.remove("id") {
            Some(toml::Value::String(id)) => id,
            _ => return Err(format!("a key without an `id` string: {help}")),
        };
        let source = Source::take(&mut table).map_err(|error| format!("key \"{id}\": {error}"))?;
        if let Some(other) = table.keys().next() {
            return Err(format!(
                "key \"{id}\": unknown field `{other}` (expected `id` and `env` or `file`; \
                 the key itself is never written here)"
            ));
        }
        Ok(KeyEntry { id, source })
    }
}

/// What [`SecretsSettings::load`] read.
#[derive(Debug, Default)]
pub struct Loaded {
    /// The key secret, if configured.
    pub key_secret: Option<KeySecret>,
    /// The keyring, if keys are configured.
    pub keyring: Option<Keyring>,
}

impl SecretsSettings {
    /// Reads every configured secret. Refused, naming the secret at fault:
    /// an unset variable or unreadable file, a value that is not hex or
    /// base64, a key secret under 32 bytes or an encryption key not of 32,
    /// two keys with one id, keys without `current_key` or a `current_key`
    /// that is not listed.
    pub fn load(&self) -> Result<Loaded, String> {
        let key_secret = match &self.key_secret {
            None => None,
            Some(source) => Some(
                source
                    .read()
                    .and_then(|text| KeySecret::parse(&text).map_err(|e| e.to_string()))
                    .map_err(|error| format!("[secrets] key_secret: {error}"))?,
            ),
        };
        if self.refuse_plain && self.keys.is_empty() {
            return Err(
                "[secrets] refuse_plain = true but no `keys` are listed: plain \
                 records are refused only where records are sealed"
                    .to_owned(),
            );
        }
        let keyring = match (&self.current_key, self.keys.is_empty()) {
            (None, true) => None,
            (None, false) => {
                return Err(
                    "[secrets] keys are listed but `current_key` is not set: name the key \
                     new records are sealed with, e.g. current_key = \"1\""
                        .to_owned(),
                )
            }
            (Some(current), true) => {
                return Err(format!(
                    "[secrets] current_key = \"{current}\" but no `keys` are listed"
                ))
            }
            (Some(current), false) => {
                let mut keys = Vec::with_capacity(self.keys.len());
                for entry in &self.keys {
                    let key = entry
                        .source
                        .read()
                        .and_then(|text| {
                            EncryptionKey::parse(&entry.id, &text).map_err(|e| e.to_string())
                        })
                        .map_err(|error| {
                            format!("[secrets] key \"{}\" ({}): {error}", entry.id, entry.source)
                        })?;
                    keys.push(key);
                }
                let keyring =
                    Keyring::new(keys, current).map_err(|error| format!("[secrets] {error}"))?;
                Some(match self.refuse_plain {
                    true => keyring.refusing_plain(),
                    false => keyring,
                })
            }
        };
        Ok(Loaded {
            key_secret,
            keyring,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<SecretsSettings, String> {
        toml::from_str(text).map_err(|error| error.message().to_owned())
    }

    #[test]
    fn sources_are_env_or_file_never_inline() {
        let settings = parse(
            "key_secret = { env = \"S\" }\ncurrent_key = \"2\"\nkeys = [\n  { id = \"1\", file = \"/k1\" },\n  { id = \"2\", env = \"K2\" },\n]\n",
        )
        .unwrap();
        assert_eq!(settings.key_secret, Some(Source::Env("S".into())));
        assert_eq!(settings.keys[0].source, Source::File("/k1".into()));
        assert_eq!(settings.keys[1].id, "2");
        let error = parse("key_secret = \"0123456789abcdef-inline\"").unwrap_err();
        assert!(error.contains("never written"), "{error}");
        assert!(!error.contains("inline"), "the value is echoed: {error}");
        let error = parse("key_secret = { env = \"A\", file = \"/b\" }").unwrap_err();
        assert!(error.contains("not both"), "{error}");
        // From a review: a misspelt field beside the source was ignored.
        let error = parse("key_secret = { env = \"X\", fiel = \"/x\" }").unwrap_err();
        assert!(error.contains("unknown field `fiel`"), "{error}");
        let error = parse("keys = [{ id = \"1\", key = \"c2VjcmV0\" }]").unwrap_err();
        assert!(error.contains("key \"1\""), "{error}");
        assert!(!error.contains("c2VjcmV0"), "{error}");
    }

    #[test]
    fn load_names_the_secret_at_fault() {
        let dir = std::env::temp_dir().join(format!("secrets-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = |name: &str, text: String| {
            let path = dir.join(name);
            std::fs::write(&path, text).unwrap();
            path.display().to_string()
        };
        let good = file("good", format!("{}\n", "ab".repeat(32)));
        let short = file("short", "ab".repeat(16));
        let load = |text: String| parse(&text).unwrap().load();

        let loaded = load(format!(
            "key_secret = {{ file = \"{good}\" }}\ncurrent_key = \"1\"\nkeys = [{{ id = \"1\", file = \"{good}\" }}]"
        ))
        .unwrap();
        assert!(loaded.key_secret.is_some());
        let keyring = loaded.keyring.unwrap();
        assert_eq!(keyring.current_id(), "1");
        assert!(!keyring.refuses_plain());
        let refusing = load(format!(
            "refuse_plain = true\ncurrent_key = \"1\"\nkeys = [{{ id = \"1\", file = \"{good}\" }}]"
        ))
        .unwrap();
        assert!(refusing.keyring.unwrap().refuses_plain());
        let error = load("refuse_plain = true".into()).unwrap_err();
        assert!(
            error.contains("refuse_plain") && error.contains("keys"),
            "{error}"
        );

        let error = load(format!(
            "current_key = \"1\"\nkeys = [{{ id = \"1\", file = \"{short}\" }}]"
        ))
        .unwrap_err();
        assert!(
            error.contains("key \"1\"") && error.contains("16 bytes"),
            "{error}"
        );
        assert!(!error.contains(&"ab".repeat(16)), "{error}");
        let error = load(format!(
            "current_key = \"1\"\nkeys = [{{ id = \"1\", file = \"{good}\" }}, {{ id = \"1\", file = \"{good}\" }}]"
        ))
        .unwrap_err();
        assert!(error.contains("\"1\" is listed twice"), "{error}");
        let error = load(format!(
            "current_key = \"3\"\nkeys = [{{ id = \"1\", file = \"{good}\" }}]"
        ))
        .unwrap_err();
        assert!(error.contains("\"3\" is not listed"), "{error}");
        let error = load(format!("keys = [{{ id = \"1\", file = \"{good}\" }}]")).unwrap_err();
        assert!(error.contains("current_key"), "{error}");
        let error = load(
            "current_key = \"1\"\nkeys = [{ id = \"1\", env = \"IDEMPOTENCY_TEST_UNSET_KEY\" }]"
                .into(),
        )
        .unwrap_err();
        assert!(
            error.contains("IDEMPOTENCY_TEST_UNSET_KEY is not set") && error.contains("key \"1\""),
            "{error}"
        );
        let error = load(format!("key_secret = {{ file = \"{short}\" }}")).unwrap_err();
        assert!(
            error.contains("key_secret") && error.contains("at least 32"),
            "{error}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
