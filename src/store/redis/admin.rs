//! The Redis cache's [`Admin`] side: the inner store's, with Redis kept in
//! step (purged records' copies overwritten with tombstones).

use std::time::Duration;

use async_trait::async_trait;

use super::RedisCache;
use crate::store::{
    Admin, Claim, Fingerprint, OwnerToken, PrincipalHash, RecordInfo, ScopeKey, StateCounts, Store,
    StoreError,
};

impl<S: Store> RedisCache<S> {
    /// The inner store's [`Admin`] side (the cache offers one only when
    /// the inner store does).
    fn inner_admin(&self) -> Result<&dyn Admin, StoreError> {
        self.inner.admin().ok_or_else(|| {
            StoreError::Unavailable("the store behind the Redis cache has no admin side".into())
        })
    }

    /// Overwrites the cached copies of `keys` with tombstones (see
    /// [`RedisCache`]); `done` says what already happened in the inner
    /// store, for the error.
    async fn invalidate(&self, keys: &[ScopeKey], done: &str) -> Result<(), StoreError> {
        if keys.is_empty() {
            return Ok(());
        }
        let result = if self.named().await {
            self.redis.invalidate(keys).await
        } else {
            Err("the store's identity is unknown".to_owned())
        };
        result.map_err(|error| {
            StoreError::Unavailable(
                format!(
                    "the Redis cache could not be invalidated ({error}); {done}: \
                     its copy may still be replayed, so purge again"
                )
                .into(),
            )
        })
    }

    /// Purges with Redis kept in step: the copies are overwritten before
    /// the inner records are deleted (so a failure deletes nothing), and
    /// again after, a timeout later, with tombstones that live from then
    /// on: a copy read before the delete and still on its way lands before
    /// they expire (so it never replaces them), and a record that appeared
    /// meanwhile is overwritten too. The second pass is tried three times
    /// (a cooldown apart): once the records are deleted, a purge run again
    /// (of a principal) no longer finds their keys.
    async fn purge_through<F, Fut>(
        &self,
        before: &[ScopeKey],
        delete: F,
    ) -> Result<Vec<ScopeKey>, StoreError>
    where
        F: FnOnce() -> Fut,
        Fut: std::future::Future<Output = Result<Vec<ScopeKey>, StoreError>>,
    {
        self.invalidate(before, "nothing was deleted").await?;
        let deleted = delete().await?;
        if !deleted.is_empty() {
            tokio::time::sleep(self.redis.config.timeout).await;
        }
        let done = "the records were deleted from the store of record, after their copies \
                    were overwritten once";
        let mut second = self.invalidate(&deleted, done).await;
        for _ in 1..3 {
            if second.is_ok() {
                break;
            }
            tokio::time::sleep(self.redis.config.cooldown).await;
            second = self.invalidate(&deleted, done).await;
        }
        second?;
        Ok(deleted)
    }
}

/// The inner store's [`Admin`] side, with Redis kept in step: a purge
/// overwrites the cached copies with tombstones (see
/// [`RedisCache`]'s guarantees), and fails when Redis could not be told.
#[async_trait]
impl<S: Store> Admin for RedisCache<S> {
    async fn reserve_for(
        &self,
        key: &ScopeKey,
        fingerprint: &Fingerprint,
        owner: &OwnerToken,
        lease: Duration,
        ttl: Duration,
        principal: Option<&PrincipalHash>,
    ) -> Result<Claim, StoreError> {
        self.reserve_with(key, fingerprint, owner, lease, ttl, principal)
            .await
    }

    async fn inspect(&self, key: &ScopeKey) -> Result<Option<RecordInfo>, StoreError> {
        self.inner_admin()?.inspect(key).await
    }

    /// Redis's copy is overwritten whether or not the inner store still
    /// had the record, so purging again after a Redis failure finishes the
    /// job.
    async fn purge(&self, key: &ScopeKey) -> Result<bool, StoreError> {
        let admin = self.inner_admin()?;
        let deleted = self
            .purge_through(&[*key], || async move {
                Ok(if admin.purge(key).await? {
                    vec![*key]
                } else {
                    Vec::new()
                })
            })
            .await?;
        Ok(!deleted.is_empty())
    }

    async fn principal_keys(
        &self,
        principal: &PrincipalHash,
        limit: usize,
    ) -> Result<Vec<ScopeKey>, StoreError> {
        self.inner_admin()?.principal_keys(principal, limit).await
    }

    /// Deletes exactly the records whose copies were overwritten first
    /// (one by one): a second query could pick others (a
    /// caller with more than `limit` records, or one stored in between),
    /// deleted with their copies still in Redis, and a purge run again
    /// would find nothing left to overwrite. Returns every listed key, a
    /// record that went meanwhile (swept, released) included: the caller
    /// goes on while a batch comes back full.
    async fn purge_principal(
        &self,
        principal: &PrincipalHash,
        limit: usize,
    ) -> Result<Vec<ScopeKey>, StoreError> {
        let admin = self.inner_admin()?;
        let before = admin.principal_keys(principal, limit).await?;
        let delete = || async {
            for key in &before {
                admin.purge(key).await?;
            }
            Ok(before.clone())
        };
        self.purge_through(&before, delete).await
    }

    /// Only in-flight records are released, and those are never cached.
    async fn force_release(&self, key: &ScopeKey) -> Result<bool, StoreError> {
        self.inner_admin()?.force_release(key).await
    }

    async fn in_flight_older_than(
        &self,
        age: Duration,
        limit: usize,
    ) -> Result<Vec<RecordInfo>, StoreError> {
        self.inner_admin()?.in_flight_older_than(age, limit).await
    }

    async fn counts(&self) -> Result<StateCounts, StoreError> {
        self.inner_admin()?.counts().await
    }
}
