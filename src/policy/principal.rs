//! A route's principal: the caller's stable identity, hashed into the
//! key's scope ([`Policy::principal`](crate::Policy::principal)).
//!
//! Scoping by a raw credential (`scope_headers = ["Authorization"]`) never
//! leaks a response, but a refreshed token is a new scope: a client that
//! times out, refreshes its OAuth token and retries with the same key
//! executes again. A principal names the caller instead of its credential:
//!
//! * `principal = { header = "x-user-id" }`: a header set by a trusted
//!   gateway. Trusted **only** when the gateway strips (or overwrites) that
//!   header on every client request; otherwise any client picks its scope
//!   by sending the header itself, and reads another user's stored
//!   responses.
//! * `principal = { jwt = { … } }`: the `sub` (with `iss`) of a JWT whose
//!   signature, `exp`, `nbf` and, when configured, `iss` and `aud` were
//!   verified here (HS256 with a secret, RS256 or ES256 with public keys;
//!   keys come from environment variables or files, never from the
//!   configuration text). A token that fails any check never picks a
//!   scope: the request is refused with 401 `principal-invalid`, nothing
//!   is reserved and the upstream is not called.
//!
//! A covered request that carries a key and no principal gets 401
//! `principal-missing` when the principal is `required` (the default), or
//! is scoped as "no principal" (shared by every anonymous caller of the
//! route) when it is not. A credential that is present but fails its checks
//! is refused either way. Requests the engine does not cover, or that
//! carry no key on a route where it is optional, are forwarded unchecked:
//! the engine is not an authenticator.

use std::collections::BTreeMap;
use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use http::{HeaderMap, HeaderName};
use jsonwebtoken::{Algorithm, DecodingKey, Validation};
use serde::{Deserialize, Deserializer, Serialize};

use super::PolicyError;

/// Where a route reads its caller's stable identity. Exactly one of
/// `header` and `jwt` is set.
///
/// In TOML: `principal = { header = "x-user-id" }` or
/// `principal = { jwt = { hs256_secret_env = "JWT_SECRET" }, required = false }`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PrincipalPolicy {
    /// A request header set by a trusted gateway (e.g. `x-user-id`); its
    /// value is the principal. Trust it only when the gateway strips or
    /// overwrites it on every client request. More than one such header,
    /// or an empty one, is refused as invalid.
    pub header: Option<String>,
    /// A verified JWT's `sub` (with its `iss`).
    pub jwt: Option<JwtPolicy>,
    /// A covered request with a key but without a principal gets 401
    /// `principal-missing` (`true`, the default), or is scoped as "no
    /// principal", shared by every anonymous caller (`false`).
    pub required: bool,
}

impl Default for PrincipalPolicy {
    fn default() -> Self {
        PrincipalPolicy {
            header: None,
            jwt: None,
            required: true,
        }
    }
}

impl PrincipalPolicy {
    /// A trusted gateway's header, required.
    pub fn header(name: impl Into<String>) -> Self {
        PrincipalPolicy {
            header: Some(name.into()),
            ..PrincipalPolicy::default()
        }
    }

    /// A verified JWT, required.
    pub fn jwt(jwt: JwtPolicy) -> Self {
        PrincipalPolicy {
            jwt: Some(jwt),
            ..PrincipalPolicy::default()
        }
    }

    /// Builder-style: whether the principal is required.
    pub fn required(mut self, required: bool) -> Self {
        self.required = required;
        self
    }
}

/// How a JWT is found and verified. At least one key must be configured;
/// a token is checked only against the keys of the algorithm its header
/// names (so an HS256 token is never checked with an RSA public key used
/// as an HMAC secret), and `alg: none` is always refused.
///
/// Key settings take one value or a list (for key rotation: every key of
/// the token's algorithm is tried).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct JwtPolicy {
    /// The header carrying the token, `Bearer <token>` or the bare token.
    /// Default `authorization`.
    pub header: String,
    /// Environment variables holding HS256 secrets (the raw bytes of the
    /// variable, at least 32 of them).
    #[serde(deserialize_with = "one_or_many")]
    pub hs256_secret_env: Vec<String>,
    /// Files holding HS256 secrets (raw bytes, at least 32; trailing
    /// whitespace such as a final newline is not part of the secret).
    #[serde(deserialize_with = "one_or_many")]
    pub hs256_secret_file: Vec<PathBuf>,
    /// PEM files holding RS256 public keys (`PUBLIC KEY` or
    /// `RSA PUBLIC KEY`). A private key is refused.
    #[serde(deserialize_with = "one_or_many")]
    pub rs256_public_key_file: Vec<PathBuf>,
    /// PEM files holding ES256 (P-256) public keys (`PUBLIC KEY`). A
    /// private key is refused.
    #[serde(deserialize_with = "one_or_many")]
    pub es256_public_key_file: Vec<PathBuf>,
    /// Accepted `iss` values; when set, `iss` is required and must be one
    /// of them. Default: any issuer (the key alone vouches for the token).
    #[serde(deserialize_with = "one_or_many")]
    pub issuer: Vec<String>,
    /// Accepted `aud` values; when set, `aud` is required and must contain
    /// one of them. Default: `aud` is not checked.
    #[serde(deserialize_with = "one_or_many")]
    pub audience: Vec<String>,
    /// The clock skew allowed on `exp` and `nbf`. Default 30 s, at most
    /// 5 min.
    #[serde(with = "humantime_serde")]
    pub leeway: Duration,
    /// Claims naming the tenant a token acts for (`org_id`: Auth0
    /// Organizations and Clerk keep one `sub` across a user's
    /// organisations, and the backend picks the tenant from this claim).
    /// Their values are part of the principal ([`jwt_principal_in`]), so
    /// one user's keys in two organisations never share a scope; a claim
    /// the token lacks counts as `null`. Default none: `(iss, sub)` alone.
    #[serde(deserialize_with = "one_or_many")]
    pub tenant_claims: Vec<String>,
}

impl Default for JwtPolicy {
    fn default() -> Self {
        JwtPolicy {
            header: "authorization".to_owned(),
            hs256_secret_env: Vec::new(),
            hs256_secret_file: Vec::new(),
            rs256_public_key_file: Vec::new(),
            es256_public_key_file: Vec::new(),
            issuer: Vec::new(),
            audience: Vec::new(),
            leeway: Duration::from_secs(30),
            tenant_claims: Vec::new(),
        }
    }
}

/// A string or a list of strings.
fn one_or_many<'de, D, T>(deserializer: D) -> Result<Vec<T>, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de>,
{
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum OneOrMany<T> {
        One(T),
        Many(Vec<T>),
    }
    Ok(match OneOrMany::deserialize(deserializer)? {
        OneOrMany::One(one) => vec![one],
        OneOrMany::Many(many) => many,
    })
}

/// The shortest HS256 secret accepted: the hash's size (RFC 7518, 3.2).
const MIN_SECRET_BYTES: usize = 32;

/// The largest `leeway` accepted.
const MAX_LEEWAY: Duration = Duration::from_secs(300);

fn invalid(reason: impl Into<String>) -> PolicyError {
    PolicyError {
        field: "principal",
        reason: reason.into(),
    }
}

/// A [`PrincipalPolicy`] with its keys loaded, ready for requests.
pub(crate) struct PrincipalSource {
    kind: SourceKind,
    required: bool,
}

enum SourceKind {
    Header(HeaderName),
    Jwt(JwtVerifier),
}

struct JwtVerifier {
    header: HeaderName,
    /// Per algorithm: its validation rules and keys (never empty).
    by_algorithm: Vec<(Validation, Vec<DecodingKey>)>,
    /// [`JwtPolicy::tenant_claims`].
    tenant_claims: Vec<String>,
}

/// Secrets and keys are never printed.
impl PrincipalSource {
    /// The request header the principal is read from.
    pub(crate) fn header(&self) -> &HeaderName {
        match &self.kind {
            SourceKind::Header(name) => name,
            SourceKind::Jwt(verifier) => &verifier.header,
        }
    }
}

impl fmt::Debug for PrincipalSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut debug = f.debug_struct("PrincipalSource");
        match &self.kind {
            SourceKind::Header(name) => debug.field("header", name),
            SourceKind::Jwt(jwt) => debug.field("jwt_header", &jwt.header).field(
                "algorithms",
                &jwt.by_algorithm
                    .iter()
                    .map(|(validation, keys)| (validation.algorithms[0], keys.len()))
                    .collect::<Vec<_>>(),
            ),
        };
        debug.field("required", &self.required).finish()
    }
}

/// What a request says about its principal.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Resolved {
    /// A verified or trusted principal, as hashed into the scope.
    Found(Vec<u8>),
    /// None given.
    Missing,
    /// A credential that failed its checks (the reason, for the log only).
    Invalid(&'static str),
}

impl PrincipalPolicy {
    /// Checks the settings and loads the keys: an unset variable, an
    /// unreadable file, a short secret or a key that is not a public key
    /// of its algorithm is refused here, at start. `scope_headers` are the
    /// route's: listing the JWT's own header there would scope by the raw
    /// token again, so it is refused.
    pub(crate) fn load(
        &self,
        scope_headers: &[HeaderName],
    ) -> Result<PrincipalSource, PolicyError> {
        let kind = match (&self.header, &self.jwt) {
            (Some(_), Some(_)) | (None, None) => {
                return Err(invalid("set exactly one of `header` and `jwt`"))
            }
            (Some(name), None) => SourceKind::Header(header_name(name)?),
            (None, Some(jwt)) => SourceKind::Jwt(jwt.load()?),
        };
        let header = match &kind {
            SourceKind::Header(name) => name,
            SourceKind::Jwt(jwt) => &jwt.header,
        };
        if scope_headers.contains(header) {
            return Err(invalid(format!(
                "`{header}` is also in `scope_headers`: the raw credential would split the \
                 scope again; remove it from `scope_headers`"
            )));
        }
        Ok(PrincipalSource {
            kind,
            required: self.required,
        })
    }
}

fn header_name(name: &str) -> Result<HeaderName, PolicyError> {
    HeaderName::from_bytes(name.as_bytes())
        .map_err(|_| invalid(format!("`{name}` is not a header name")))
}

impl JwtPolicy {
    fn load(&self) -> Result<JwtVerifier, PolicyError> {
        if self.leeway > MAX_LEEWAY {
            return Err(invalid("`leeway` is at most 5m"));
        }
        let mut hs256 = Vec::new();
        for name in &self.hs256_secret_env {
            let value = std::env::var_os(name).ok_or_else(|| {
                invalid(format!(
                    "the environment variable `{name}` (hs256_secret_env) is not set"
                ))
            })?;
            hs256.push(secret(value.as_encoded_bytes(), &format!("`${name}`"))?);
        }
        for path in &self.hs256_secret_file {
            let bytes = read(path, "hs256_secret_file")?;
            hs256.push(secret(bytes.trim_ascii_end(), &path.display().to_string())?);
        }
        let mut rs256 = Vec::new();
        for path in &self.rs256_public_key_file {
            let pem = public_pem(path, "rs256_public_key_file")?;
            rs256.push(DecodingKey::from_rsa_pem(&pem).map_err(|error| {
                invalid(format!(
                    "{} (rs256_public_key_file) is not an RSA public key in PEM: {error}",
                    path.display()
                ))
            })?);
        }
        let mut es256 = Vec::new();
        for path in &self.es256_public_key_file {
            let pem = public_pem(path, "es256_public_key_file")?;
            es256.push(DecodingKey::from_ec_pem(&pem).map_err(|error| {
                invalid(format!(
                    "{} (es256_public_key_file) is not an EC public key in PEM: {error}",
                    path.display()
                ))
            })?);
        }
        let by_algorithm: Vec<_> = [
            (Algorithm::HS256, hs256),
            (Algorithm::RS256, rs256),
            (Algorithm::ES256, es256),
        ]
        .into_iter()
        .filter(|(_, keys)| !keys.is_empty())
        .map(|(algorithm, keys)| (self.validation(algorithm), keys))
        .collect();
        if by_algorithm.is_empty() {
            return Err(invalid(
                "the JWT has no key: set `hs256_secret_env`, `hs256_secret_file`, \
                 `rs256_public_key_file` or `es256_public_key_file`",
            ));
        }
        if self
            .issuer
            .iter()
            .chain(&self.audience)
            .any(String::is_empty)
        {
            return Err(invalid("an empty `issuer` or `audience`"));
        }
        let repeated = |i: usize, claim: &String| self.tenant_claims[..i].contains(claim);
        if let Some((_, claim)) = self.tenant_claims.iter().enumerate().find(|(i, claim)| {
            // `exp`, `iat`, `nbf` and `jti` change with every token: a
            // retry with a refreshed one would be another caller.
            let volatile = matches!(claim.as_str(), "exp" | "iat" | "nbf" | "jti");
            claim.is_empty()
                || matches!(claim.as_str(), "sub" | "iss")
                || volatile
                || repeated(*i, claim)
        }) {
            return Err(invalid(format!(
                "`tenant_claims` names `{claim}` (empty, `iss`, `sub`, a claim each token \
                 changes, or twice): name each claim beside `iss` and `sub` that picks the \
                 tenant once (such as `org_id`)"
            )));
        }
        Ok(JwtVerifier {
            header: header_name(&self.header)?,
            by_algorithm,
            tenant_claims: self.tenant_claims.clone(),
        })
    }

    /// The checks for a token signed with `algorithm`: `exp` and `sub`
    /// required, `nbf` checked when present, `iss` and `aud` required and
    /// checked when configured.
    fn validation(&self, algorithm: Algorithm) -> Validation {
        let mut validation = Validation::new(algorithm);
        validation.leeway = self.leeway.as_secs();
        validation.validate_exp = true;
        validation.validate_nbf = true;
        let mut required = vec!["exp", "sub"];
        if !self.issuer.is_empty() {
            validation.set_issuer(&self.issuer);
            required.push("iss");
        }
        if self.audience.is_empty() {
            validation.validate_aud = false;
        } else {
            validation.set_audience(&self.audience);
            required.push("aud");
        }
        validation.set_required_spec_claims(&required);
        validation
    }
}

fn read(path: &std::path::Path, setting: &str) -> Result<Vec<u8>, PolicyError> {
    std::fs::read(path).map_err(|error| {
        invalid(format!(
            "cannot read {} ({setting}): {error}",
            path.display()
        ))
    })
}

fn secret(bytes: &[u8], what: &str) -> Result<DecodingKey, PolicyError> {
    if bytes.len() < MIN_SECRET_BYTES {
        return Err(invalid(format!(
            "the HS256 secret in {what} has {} bytes; at least {MIN_SECRET_BYTES} are required",
            bytes.len()
        )));
    }
    Ok(DecodingKey::from_secret(bytes))
}

/// A PEM file that holds no private key (a verifier needs only the public
/// one, and a private key on the proxy's host could mint tokens).
fn public_pem(path: &std::path::Path, setting: &str) -> Result<Vec<u8>, PolicyError> {
    let pem = read(path, setting)?;
    let text = String::from_utf8_lossy(&pem);
    if text
        .lines()
        .any(|line| line.starts_with("-----BEGIN") && line.contains("PRIVATE"))
    {
        return Err(invalid(format!(
            "{} ({setting}) holds a private key; give the public key only",
            path.display()
        )));
    }
    Ok(pem)
}

/// The principal a verified JWT names, as its route scopes keys by it: its
/// `iss` (or none) and `sub`. An operator looking up or purging a JWT
/// caller's records gives these two, never the token.
///
/// The bytes begin with a NUL-framed tag, which no header value can hold,
/// so a gateway header spelled like a JWT principal (`[null,"alice"]`) is
/// never the same caller, neither for a scope nor for a purge.
pub fn jwt_principal(iss: Option<&str>, sub: &str) -> Vec<u8> {
    jwt_principal_in(iss, sub, &BTreeMap::new())
}

/// [`jwt_principal`] for a route with [`JwtPolicy::tenant_claims`]: the
/// tenant claims' values (`null` for one the token lacks), by name, follow
/// `(iss, sub)`. An operator purging such a caller gives them too. With no
/// tenant claims, the same bytes as [`jwt_principal`].
pub fn jwt_principal_in(
    iss: Option<&str>,
    sub: &str,
    tenant: &BTreeMap<String, serde_json::Value>,
) -> Vec<u8> {
    let mut principal = b"\0jwt\0".to_vec();
    principal.extend(serde_json::to_vec(&(iss, sub)).unwrap_or_default());
    if !tenant.is_empty() {
        principal.extend(serde_json::to_vec(tenant).unwrap_or_default());
    }
    principal
}

/// The claims a principal is made of.
#[derive(Deserialize)]
struct Claims {
    sub: String,
    #[serde(default)]
    iss: Option<String>,
}

/// [`Claims`] and the others, read only for a route with
/// [`JwtPolicy::tenant_claims`] (collecting them costs every token).
#[derive(Deserialize)]
struct TenantClaims {
    #[serde(flatten)]
    claims: Claims,
    #[serde(flatten)]
    others: BTreeMap<String, serde_json::Value>,
}

impl PrincipalSource {
    /// Whether a request without a principal is refused.
    pub(crate) fn required(&self) -> bool {
        self.required
    }

    /// Whether it reads a JWT (its 401 answers carry a `Bearer` challenge).
    pub(crate) fn is_jwt(&self) -> bool {
        matches!(self.kind, SourceKind::Jwt(_))
    }

    /// The principal a request names, checked.
    pub(crate) fn resolve(&self, headers: &HeaderMap) -> Resolved {
        self.resolve_as(headers, None)
    }

    /// [`PrincipalSource::resolve`], a token's `exp` and `nbf` checked
    /// only within `window` beyond its leeway (its signature, `iss` and
    /// `aud` as ever): who a token names while a record made under it may
    /// still be met (`window`: the route's `ttl`), so a retry sent as it
    /// expires, or with a refreshed token, names the same caller, and a
    /// token long expired names nobody.
    pub(crate) fn resolve_within(&self, headers: &HeaderMap, window: Duration) -> Resolved {
        self.resolve_as(headers, Some(window))
    }

    fn resolve_as(&self, headers: &HeaderMap, window: Option<Duration>) -> Resolved {
        let mut values = headers.get_all(self.header()).iter();
        let Some(value) = values.next() else {
            return Resolved::Missing;
        };
        if values.next().is_some() {
            return Resolved::Invalid("more than one principal header");
        }
        match &self.kind {
            SourceKind::Header(_) if value.is_empty() => Resolved::Invalid("empty header"),
            SourceKind::Header(_) => Resolved::Found(value.as_bytes().to_vec()),
            SourceKind::Jwt(jwt) => jwt.verify(value.as_bytes(), window),
        }
    }
}

impl JwtVerifier {
    fn verify(&self, value: &[u8], window: Option<Duration>) -> Resolved {
        let Ok(value) = std::str::from_utf8(value) else {
            return Resolved::Invalid("not text");
        };
        let value = value.trim();
        let token = match value.split_once(' ') {
            Some((scheme, token)) if scheme.eq_ignore_ascii_case("bearer") => token.trim(),
            Some(_) => return Resolved::Invalid("not a bearer token"),
            None => value,
        };
        // The header only picks the keys to try; every check is
        // `decode`'s, with this algorithm alone allowed.
        let Ok(header) = jsonwebtoken::decode_header(token) else {
            return Resolved::Invalid("malformed token or unknown algorithm");
        };
        let Some((validation, keys)) = self
            .by_algorithm
            .iter()
            .find(|(validation, _)| validation.algorithms[0] == header.alg)
        else {
            return Resolved::Invalid("algorithm not configured");
        };
        let widened;
        let validation = match window {
            None => validation,
            Some(window) => {
                let mut relaxed = validation.clone();
                relaxed.leeway = relaxed.leeway.saturating_add(window.as_secs());
                widened = relaxed;
                &widened
            }
        };
        let mut reason = "signature";
        for key in keys {
            let decoded = match self.tenant_claims.is_empty() {
                true => jsonwebtoken::decode::<Claims>(token, key, validation)
                    .map(|data| (data.claims, BTreeMap::new())),
                false => jsonwebtoken::decode::<TenantClaims>(token, key, validation).map(|data| {
                    let TenantClaims { claims, others } = data.claims;
                    let tenant = self
                        .tenant_claims
                        .iter()
                        .map(|name| (name.clone(), others.get(name).cloned().unwrap_or_default()))
                        .collect();
                    (claims, tenant)
                }),
            };
            match decoded {
                Ok((claims, _)) if claims.sub.is_empty() => return Resolved::Invalid("empty sub"),
                Ok((claims, tenant)) => {
                    let principal = jwt_principal_in(claims.iss.as_deref(), &claims.sub, &tenant);
                    return Resolved::Found(principal);
                }
                Err(error) => {
                    use jsonwebtoken::errors::ErrorKind;
                    reason = match error.kind() {
                        ErrorKind::InvalidSignature => continue,
                        ErrorKind::ExpiredSignature => "expired",
                        ErrorKind::ImmatureSignature => "not yet valid",
                        ErrorKind::InvalidIssuer => "issuer",
                        ErrorKind::InvalidAudience => "audience",
                        ErrorKind::MissingRequiredClaim(_) => "missing claim",
                        _ => "malformed",
                    };
                    // Claims are checked after the signature: this key
                    // signed it, no other key will decide otherwise.
                    break;
                }
            }
        }
        Resolved::Invalid(reason)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secret_file(name: &str, content: &[u8]) -> PathBuf {
        let path = std::env::temp_dir().join(format!(
            "tower-idempotency-principal-{}-{name}",
            std::process::id()
        ));
        std::fs::write(&path, content).unwrap();
        path
    }

    fn hs256(path: PathBuf) -> PrincipalPolicy {
        PrincipalPolicy::jwt(JwtPolicy {
            hs256_secret_file: vec![path],
            ..JwtPolicy::default()
        })
    }

    #[test]
    fn bad_settings_are_refused_at_start() {
        let both = PrincipalPolicy {
            header: Some("x-user-id".into()),
            ..hs256(secret_file("both", &[7; 32]))
        };
        assert!(both.load(&[]).is_err());
        assert!(PrincipalPolicy::default().load(&[]).is_err());
        let short = hs256(secret_file("short", b"0123456789\n"));
        let error = short.load(&[]).unwrap_err();
        assert!(error.reason.contains("at least 32"), "{error}");
        let missing = hs256(PathBuf::from("/nonexistent/jwt-secret"));
        assert!(missing
            .load(&[])
            .unwrap_err()
            .reason
            .contains("cannot read"));
        let unset = PrincipalPolicy::jwt(JwtPolicy {
            hs256_secret_env: vec!["TOWER_IDEMPOTENCY_UNSET_SECRET".into()],
            ..JwtPolicy::default()
        });
        assert!(unset.load(&[]).unwrap_err().reason.contains("not set"));
        let garbage = PrincipalPolicy::jwt(JwtPolicy {
            rs256_public_key_file: vec![secret_file("garbage.pem", b"not a key")],
            ..JwtPolicy::default()
        });
        assert!(garbage.load(&[]).unwrap_err().reason.contains("PEM"));
        let private = PrincipalPolicy::jwt(JwtPolicy {
            es256_public_key_file: vec![secret_file(
                "private.pem",
                b"-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n",
            )],
            ..JwtPolicy::default()
        });
        assert!(private.load(&[]).unwrap_err().reason.contains("private"));
        let no_key = PrincipalPolicy::jwt(JwtPolicy::default());
        assert!(no_key.load(&[]).unwrap_err().reason.contains("no key"));
        let scoped = hs256(secret_file("scoped", &[7; 32]));
        let error = scoped
            .load(&[HeaderName::from_static("authorization")])
            .unwrap_err();
        assert!(error.reason.contains("scope_headers"), "{error}");
        // A tenant claim named twice scoped every tenant as `null`.
        for claims in [
            &["org_id", "org_id"][..],
            &["sub"],
            &[""],
            &["jti"],
            &["exp"],
        ] {
            let tenant = PrincipalPolicy::jwt(JwtPolicy {
                hs256_secret_file: vec![secret_file("tenant", &[7; 32])],
                tenant_claims: claims.iter().map(|c| c.to_string()).collect(),
                ..JwtPolicy::default()
            });
            let error = tenant.load(&[]).unwrap_err();
            assert!(
                error.reason.contains("tenant_claims"),
                "{claims:?}: {error}"
            );
        }
    }

    #[test]
    fn a_gateway_header_is_one_non_empty_value() {
        let source = PrincipalPolicy::header("x-user-id").load(&[]).unwrap();
        let mut headers = HeaderMap::new();
        assert_eq!(source.resolve(&headers), Resolved::Missing);
        headers.insert("x-user-id", "".parse().unwrap());
        assert!(matches!(source.resolve(&headers), Resolved::Invalid(_)));
        headers.insert("x-user-id", "alice".parse().unwrap());
        assert_eq!(source.resolve(&headers), Resolved::Found(b"alice".to_vec()));
        headers.append("x-user-id", "bob".parse().unwrap());
        assert!(matches!(source.resolve(&headers), Resolved::Invalid(_)));
    }

    #[test]
    fn toml_takes_one_value_or_a_list() {
        #[derive(Deserialize)]
        struct Wrapper {
            principal: PrincipalPolicy,
        }
        let one: Wrapper =
            serde_json::from_str(r#"{"principal":{"jwt":{"issuer":"https://id","leeway":"5s"}}}"#)
                .unwrap();
        let jwt = one.principal.jwt.unwrap();
        assert_eq!(jwt.issuer, vec!["https://id".to_owned()]);
        assert_eq!(jwt.leeway, Duration::from_secs(5));
        assert!(one.principal.required);
        let many: Wrapper = serde_json::from_str(
            r#"{"principal":{"jwt":{"audience":["a","b"]},"required":false}}"#,
        )
        .unwrap();
        assert_eq!(many.principal.jwt.unwrap().audience.len(), 2);
        assert!(!many.principal.required);
        assert!(serde_json::from_str::<Wrapper>(
            r#"{"principal":{"jwt":{"hs256_secret":"inline"}}}"#
        )
        .is_err());
    }
}
