//! The scope identity a key is stored under: two requests share a record
//! only when every part of it is equal.

use super::{IdentityHasher, RequestHead};
use crate::policy::principal::Resolved;
use crate::policy::RoutePolicy;
use crate::store::{PrincipalHash, ScopeKey};

/// SHA-256 (or HMAC-SHA-256 under the engine's key secret) over (principal
/// or its absence, scope headers, method, authority, normalised path, key),
/// each length-prefixed; then, for each route of `also` (other routes a
/// reading of the path reaches, scoped otherwise: see
/// [`Engine::also_reached`](super::Engine::also_reached)), what that route
/// scopes by: its principal as its source reads it, a token's `exp` and
/// `nbf` checked only within the record's `ttl` beyond their leeway, so a
/// retry sent as the token expires, or with a refreshed one, stays in its
/// scope (a credential that fails, by its lines as sent: never alike
/// another caller's), unless the principal was `given`, the layer's
/// extension, which stands for every route; its scope headers; the host.
/// A backend reading the path as one of those routes runs the request as
/// that route's caller, so two callers that route keeps apart never share
/// this scope either. Nothing is added for a request without
/// such routes: its hash is the one it always had.
pub(super) fn scope_key(
    hasher: &IdentityHasher,
    policy: &RoutePolicy,
    head: &RequestHead<'_>,
    raw_key: &[u8],
    (also, given): (&[std::sync::Arc<RoutePolicy>], bool),
) -> ScopeKey {
    let mut hasher = hasher.start();
    let mut put = |bytes: &[u8]| {
        hasher.update((bytes.len() as u64).to_be_bytes());
        hasher.update(bytes);
    };
    // "No principal" and an empty one are different callers.
    match head.principal {
        None => put(b"-"),
        Some(principal) => {
            put(b"+");
            put(principal);
        }
    }
    put_scope_headers(&policy.scope_headers, head.headers, &mut put);
    put(crate::policy::method_name(head.method).as_bytes());
    policy.scope_target(head.uri, head.headers, &mut put);
    put(raw_key);
    for route in also {
        put(b"also");
        match (&route.principal, given) {
            (Some(source), false) => match source.resolve_within(head.headers, policy.policy.ttl) {
                Resolved::Found(principal) => {
                    put(b"+");
                    put(&principal);
                }
                Resolved::Missing => put(b"-"),
                Resolved::Invalid(_) => {
                    put(b"!");
                    // Each invalid credential its own, never alike, unless
                    // the deciding route verified that very header: its
                    // principal keeps callers apart already, and a
                    // refreshed token must not move the retry.
                    let verified = head.principal.is_some()
                        && policy
                            .principal
                            .as_ref()
                            .is_some_and(|own| own.header() == source.header());
                    if !verified {
                        let header = std::slice::from_ref(source.header());
                        put_scope_headers(header, head.headers, &mut put);
                    }
                }
            },
            _ => put(b"="),
        }
        put_scope_headers(&route.scope_headers, head.headers, &mut put);
        route.scope_target(head.uri, head.headers, &mut put);
    }
    ScopeKey(hasher.finalize())
}

/// Every line of each of `names`, with its name.
fn put_scope_headers(
    names: &[http::HeaderName],
    headers: &http::HeaderMap,
    put: &mut impl FnMut(&[u8]),
) {
    for name in names {
        let lines = headers.get_all(name);
        if name == http::header::COOKIE && lines.iter().nth(1).is_some() {
            // HTTP/2 may split one `Cookie` into a line per cookie (RFC
            // 9113, 8.2.3), which an HTTP/1.1 retry sends as one: scoped
            // as the one line they are joined into with `; `.
            let joined: Vec<&[u8]> = lines.iter().map(|line| line.as_bytes()).collect();
            put(name.as_str().as_bytes());
            put(&joined.join(&b"; "[..]));
            continue;
        }
        for value in lines {
            put(name.as_str().as_bytes());
            put(value.as_bytes());
        }
    }
}

/// The hash a record keeps of the principal its key is scoped by, so an
/// operator can delete everything stored for one caller
/// ([`Engine::purge_principal`](super::Engine::purge_principal)). The one
/// place a principal is hashed for storage: it must be derived exactly as
/// the scope hash is (keyed the same way, should the scope hash be keyed),
/// or a purge would miss records. SHA-256 over a label (so it never equals
/// a scope hash) and the principal, keyed by the engine's key secret like
/// the scope hash.
pub(super) fn principal_hash(hasher: &IdentityHasher, principal: &[u8]) -> PrincipalHash {
    let mut hasher = hasher.start();
    hasher.update(b"tower-idempotency principal\0");
    hasher.update(principal);
    PrincipalHash(hasher.finalize())
}

/// The first 8 hex digits of a scope hash for log lines and spans, written
/// only when a subscriber formats it (the same text as
/// [`ScopeKey::short`], without a `String` per request).
#[derive(Clone, Copy)]
pub(super) struct Short(pub(super) [u8; 4]);

impl Short {
    pub(super) fn of(key: &ScopeKey) -> Self {
        let bytes = key.as_bytes();
        Short([bytes[0], bytes[1], bytes[2], bytes[3]])
    }
}

impl std::fmt::Display for Short {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for byte in self.0 {
            write!(f, "{byte:02x}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_is_written_as_scope_key_short() {
        let key = ScopeKey(std::array::from_fn(|i| (i * 37 + 5) as u8));
        assert_eq!(Short::of(&key).to_string(), key.short());
        assert_eq!(Short::of(&ScopeKey([0xab; 32])).to_string(), "abababab");
    }
}
