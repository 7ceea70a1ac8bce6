//! The operator's questions, answered by the engine so that a key's scope
//! is computed exactly as for a live request: look a record up from what a
//! client sent, purge it, purge a caller's records, force-release a stuck
//! key, list old in-flight keys, count records by state.
//!
//! Every operation is logged (target `tower_idempotency::admin`) with the
//! scope's short hash, never the raw key or principal. The store must have
//! an [`Admin`] side ([`Store::admin`](crate::store::Store::admin)): the
//! built-in stores all do.

use std::sync::Arc;
use std::time::Duration;

use super::principal::principal_of;
use super::scope::{principal_hash, scope_key};
use super::{Engine, RequestHead};
use crate::key;
use crate::policy::principal::Resolved;
use crate::policy::Policy;
use crate::store::{
    Admin, Holder, KeyState, Outcome, RecordInfo, RecordState, ScopeKey, StateCounts, StoreError,
};

/// How many records one purge statement deletes at most (a principal's
/// purge repeats it until none is left).
const PURGE_BATCH: usize = 1000;

/// Why an operator's request was not carried out.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AdminError {
    /// No route covers this method and path: the engine never stores
    /// anything for such a request.
    #[error("no route covers {method} {path}: the engine stores no record for such a request (check the method and the path as the client sent it)")]
    NotCovered {
        /// The method given.
        method: String,
        /// The path given.
        path: String,
    },
    /// The raw key could never have been stored: it fails the route's key
    /// rules.
    #[error("invalid key: {0}")]
    InvalidKey(#[from] key::KeyError),
    /// The route scopes keys by a principal and none (or a bad one) was
    /// given.
    #[error("{0}")]
    Principal(String),
    /// The store offers no operator side.
    #[error("this store has no operator side: lookups, purges and releases are not supported")]
    Unsupported,
    /// The store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl AdminError {
    /// Whether the operator's input is at fault (not the store).
    pub fn is_input(&self) -> bool {
        matches!(
            self,
            AdminError::NotCovered { .. } | AdminError::InvalidKey(_) | AdminError::Principal(_)
        )
    }
}

/// The answer of [`Engine::lookup`].
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct Lookup {
    /// The scope hash the request's key is stored under.
    pub scope: ScopeKey,
    /// The route that covers it (its path pattern as configured).
    pub route: Arc<str>,
    /// The live record, or `None` (absent: the next request with the key
    /// runs).
    pub record: Option<RecordInfo>,
}

impl Engine {
    /// The store's operator side.
    fn admin(&self) -> Result<&dyn Admin, AdminError> {
        self.inner.store.admin().ok_or(AdminError::Unsupported)
    }

    /// The policy of the route that covers `head`'s method and path, as
    /// [`Engine::classify`] finds it (whether or not the request carries
    /// a key); `None` when no route covers it.
    pub fn route_policy(&self, head: &RequestHead<'_>) -> Option<&Policy> {
        self.route_of(head).map(|route| route.policy())
    }

    /// The scope hash a request with this head and raw key is stored
    /// under, and its route's label: the route is found and the method
    /// dispatched as for a live request without a body (a method named in
    /// the headers or the query counts; one named in a body cannot), the
    /// principal resolved as for a live request (the head's own
    /// `principal` first, else the route's configured source read from the
    /// head's headers; the other routes a reading reaches read theirs from
    /// the headers only), and the hash is the one [`Engine::begin`]
    /// computes for such a request. The key is checked against the route's
    /// rules (a key that fails them was never stored).
    pub fn scope_of(
        &self,
        head: &RequestHead<'_>,
        raw_key: &[u8],
    ) -> Result<(ScopeKey, Arc<str>), AdminError> {
        let Some(route) = self.route_of(head) else {
            return Err(AdminError::NotCovered {
                method: head.method.to_string(),
                path: head.uri.path().to_owned(),
            });
        };
        // Dispatched as the live request is, without a body: a method its
        // header or query names decides, and each candidate's route adds
        // its scope parts, as for the request itself.
        let no_body = crate::formats::View::parse("", &[]);
        let dispatched = self.dispatched(route, head, &no_body);
        let (policy, method, candidates, readings) = match dispatched {
            Some(dispatched) => (
                dispatched.policy,
                dispatched.method,
                dispatched.candidates,
                dispatched.readings,
            ),
            None => (route, None, Vec::new(), Vec::new()),
        };
        let head = &RequestHead {
            method: method.as_ref().unwrap_or(head.method),
            ..*head
        };
        key::validate(raw_key, policy.policy().uuid_only)?;
        let principal = match principal_of(policy, head) {
            Ok(principal) => principal,
            Err(Resolved::Invalid(reason)) => {
                return Err(AdminError::Principal(format!(
                    "the route's principal credential was refused ({reason}); give the \
                     principal itself instead"
                )))
            }
            Err(_) => {
                return Err(AdminError::Principal(
                    "the route scopes keys by a principal and requires one: give the \
                     principal (a trusted header's value, or a JWT's sub and iss)"
                        .to_owned(),
                ))
            }
        };
        let head = RequestHead {
            principal: principal.as_deref().or(head.principal),
            ..*head
        };
        let label = self.inner.labels.get(policy);
        // As for the live request; a principal given here stands for the
        // route's own source only (the others read theirs from `headers`).
        let also = self.also_reached(policy, &head, (&candidates, &readings));
        let key = scope_key(&self.inner.hasher, policy, &head, raw_key, (&also, false));
        Ok((key, label))
    }

    /// Looks up the record a request with this head and raw key would
    /// meet ([`Engine::scope_of`]): its state, age, retention, lease,
    /// stored status and size — never its body ([`Engine::stored_outcome`]
    /// reads that, when asked explicitly).
    pub async fn lookup(
        &self,
        head: &RequestHead<'_>,
        raw_key: &[u8],
    ) -> Result<Lookup, AdminError> {
        let (scope, route) = self.scope_of(head, raw_key)?;
        let record = self.inspect(&scope).await?;
        Ok(Lookup {
            scope,
            route,
            record,
        })
    }

    /// What an operator may see of the live record under `scope`.
    pub async fn inspect(&self, scope: &ScopeKey) -> Result<Option<RecordInfo>, AdminError> {
        let admin = self.admin()?;
        let mut found = self.store_call(admin.inspect(scope)).await?;
        if let Some(info) = found.as_mut().filter(|info| info.state == KeyState::Sealed) {
            // Only the engine holds the keys: open it to say what it is.
            if let Some(outcome) = self.stored_outcome_quietly(scope).await? {
                describe(info, &outcome);
            }
        }
        let state = found.as_ref().map_or("absent", |info| info.state.as_str());
        tracing::info!(target: "tower_idempotency::admin", key = %scope.short(), state, "idempotency key inspected");
        Ok(found)
    }

    /// The stored outcome (status, headers and body) under `scope`, for an
    /// operator who asked for the body explicitly; `None` unless the
    /// record is completed.
    pub async fn stored_outcome(&self, scope: &ScopeKey) -> Result<Option<Outcome>, AdminError> {
        self.admin()?;
        let outcome = self.stored_outcome_quietly(scope).await?;
        tracing::info!(target: "tower_idempotency::admin", key = %scope.short(), "idempotency stored response read");
        Ok(outcome)
    }

    /// The completed outcome under `scope`, opened if it is sealed (a
    /// record that cannot be opened is an error, as for a live request).
    async fn stored_outcome_quietly(
        &self,
        scope: &ScopeKey,
    ) -> Result<Option<Outcome>, AdminError> {
        let record = self.store_call(self.inner.store.get(scope)).await?;
        let Some(RecordState::Completed(outcome)) = record.map(|record| record.state) else {
            return Ok(None);
        };
        Ok(Some(self.open_outcome(scope, outcome)?))
    }

    /// Deletes the record under `scope`, in any state: the next request
    /// with its key runs again. An in-flight holder is fenced off (its
    /// response is not stored). Returns whether there was a record.
    pub async fn purge(&self, scope: &ScopeKey) -> Result<bool, AdminError> {
        let admin = self.admin()?;
        let purged = self.store_call(admin.purge(scope)).await?;
        tracing::info!(target: "tower_idempotency::admin", key = %scope.short(), purged, "idempotency key purged");
        Ok(purged)
    }

    /// Deletes every record stored for `principal` (as the route resolves
    /// it: a trusted header's value, the layer's
    /// [`Principal`](crate::Principal), or
    /// [`jwt_principal_in`](crate::policy::principal::jwt_principal_in)), in any
    /// state, in batches; returns how many. Records of routes without a
    /// principal, or written before the store kept principals, are not
    /// found.
    pub async fn purge_principal(&self, principal: &[u8]) -> Result<u64, AdminError> {
        let admin = self.admin()?;
        let hash = principal_hash(&self.inner.hasher, principal);
        let mut purged = 0u64;
        loop {
            let keys = self
                .store_call(admin.purge_principal(&hash, PURGE_BATCH))
                .await
                .inspect_err(|error| {
                    tracing::warn!(target: "tower_idempotency::admin", principal = %hash.short(), purged, %error, "idempotency principal purge failed");
                })?;
            for key in &keys {
                tracing::debug!(target: "tower_idempotency::admin", key = %key.short(), principal = %hash.short(), "idempotency key purged");
            }
            purged += keys.len() as u64;
            if keys.len() < PURGE_BATCH {
                break;
            }
        }
        tracing::info!(target: "tower_idempotency::admin", principal = %hash.short(), purged, "idempotency principal purged");
        Ok(purged)
    }

    /// Releases the in-flight key under `scope`, whoever holds it: the
    /// next request with the key runs, and the former holder is fenced off
    /// — its completion, renewal or release is refused, so its response is
    /// not stored (its own client still gets it). Returns whether the key
    /// was in flight (a completed record is left alone: purge it instead).
    pub async fn force_release(&self, scope: &ScopeKey) -> Result<bool, AdminError> {
        let admin = self.admin()?;
        let released = self.store_call(admin.force_release(scope)).await?;
        tracing::warn!(target: "tower_idempotency::admin", key = %scope.short(), released, "idempotency key force-released");
        Ok(released)
    }

    /// [`force_release`](Engine::force_release), only while `holder` (as
    /// [`inspect`](Engine::inspect) or [`in_flight_older_than`](Engine::in_flight_older_than)
    /// showed it) still holds the key: the release is the store's
    /// owner-checked one, so a retry that took the key over since the
    /// operator looked (its holder's lease had run out) keeps it, and
    /// never runs beside a third execution. Returns whether it was released:
    /// not when the key is absent, completed, or held by another holder
    /// now (or the store does not report holders).
    pub async fn force_release_held_by(
        &self,
        scope: &ScopeKey,
        holder: Holder,
    ) -> Result<bool, AdminError> {
        let admin = self.admin()?;
        let record = self.store_call(admin.inspect(scope)).await?;
        let owner = record.as_ref().and_then(RecordInfo::owner);
        let released = match owner {
            Some(owner) if Holder::of(owner) == holder => {
                self.store_call(self.inner.store.release(scope, owner))
                    .await?
            }
            _ => false,
        };
        tracing::warn!(target: "tower_idempotency::admin", key = %scope.short(), %holder, released, "idempotency key force-released");
        Ok(released)
    }

    /// Live in-flight records first reserved at least `age` ago, oldest
    /// first, at most `limit`.
    pub async fn in_flight_older_than(
        &self,
        age: Duration,
        limit: usize,
    ) -> Result<Vec<RecordInfo>, AdminError> {
        let admin = self.admin()?;
        let found = self
            .store_call(admin.in_flight_older_than(age, limit))
            .await?;
        for info in &found {
            tracing::info!(target: "tower_idempotency::admin", key = %info.key.short(), age_ms = info.age.as_millis() as u64, "idempotency key in flight");
        }
        Ok(found)
    }

    /// How many records the store holds, by state (reads every record).
    pub async fn counts(&self) -> Result<StateCounts, AdminError> {
        let admin = self.admin()?;
        let counts = self.store_call(admin.counts()).await?;
        tracing::info!(target: "tower_idempotency::admin", total = counts.total(), "idempotency records counted");
        Ok(counts)
    }
}

/// Fills in what a store could not read of a sealed record: its kind,
/// status and sizes, from the opened outcome.
fn describe(info: &mut RecordInfo, outcome: &Outcome) {
    info.status = outcome.status();
    info.state = match outcome {
        Outcome::Stored(response) => {
            info.body_bytes = Some(response.body.len() as u64);
            info.header_bytes = Some(response.encode_headers().len() as u64);
            KeyState::Completed
        }
        Outcome::TooLarge { .. } => KeyState::TooLarge,
        Outcome::Incomplete { .. } => KeyState::Incomplete,
        Outcome::Sealed(_) => KeyState::Sealed,
    };
}
