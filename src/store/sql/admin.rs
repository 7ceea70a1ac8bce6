//! The SQL stores' [`Admin`](crate::store::Admin) side: the statements each
//! dialect gives, the rows they return, and the implementation written
//! once for both ([`sql_admin!`]).

use std::time::Duration;

use http::StatusCode;

use super::INCOMPLETE_MARKER;
use crate::store::{
    Fingerprint, KeyState, OwnerToken, RecordInfo, ScopeKey, StateCounts, StoreError,
};

/// The operator's statements of one SQL dialect. Every field must be
/// given, so a dialect that lacks one is a compile error naming it.
///
/// | statement | parameters |
/// |---|---|
/// | `inspect` | key → [`InfoRow`] |
/// | `purge` | key |
/// | `principal_keys`, `purge_principal` | principal hash, limit → keys |
/// | `force_release` | key |
/// | `in_flight_older_than` | age µs, limit → [`InfoRow`]s |
/// | `counts` | → [`CountsRow`] |
pub(in crate::store) struct AdminStatements {
    /// A live record's [`InfoRow`].
    pub(in crate::store) inspect: &'static str,
    /// Deletes a key's record, whatever its state and retention.
    pub(in crate::store) purge: &'static str,
    /// At most `limit` keys of a principal's records.
    pub(in crate::store) principal_keys: &'static str,
    /// Deletes at most `limit` records of a principal, returning their keys.
    pub(in crate::store) purge_principal: &'static str,
    /// Deletes a key's in-flight record, whoever holds it.
    pub(in crate::store) force_release: &'static str,
    /// Live in-flight records reserved at least `age` ago, oldest first.
    pub(in crate::store) in_flight_older_than: &'static str,
    /// Records by state.
    pub(in crate::store) counts: &'static str,
}

/// What both dialects select for [`RecordInfo`].
#[derive(sqlx::FromRow)]
pub(in crate::store) struct InfoRow {
    key: Vec<u8>,
    fingerprint: Vec<u8>,
    state: String,
    /// A `too_large` row's `headers` (the incomplete marker, or NULL).
    marker: Option<Vec<u8>>,
    status: Option<i16>,
    body_bytes: Option<i64>,
    header_bytes: Option<i64>,
    age_us: i64,
    expires_in_us: i64,
    lease_remaining_us: Option<i64>,
    has_principal: bool,
    /// An in-flight row's owner token.
    owner: Option<Vec<u8>>,
}

fn micros(us: i64) -> Duration {
    Duration::from_micros(us.max(0) as u64)
}

impl InfoRow {
    /// Decodes the row; a state the stores never write is
    /// [`StoreError::Corrupt`].
    pub(in crate::store) fn into_info(self) -> Result<RecordInfo, StoreError> {
        let state = match self.state.as_str() {
            super::IN_FLIGHT => KeyState::InFlight,
            // A sealed outcome keeps no status in the clear.
            "completed" if self.status.is_none() => KeyState::Sealed,
            "completed" => KeyState::Completed,
            "too_large" if self.marker.as_deref() == Some(INCOMPLETE_MARKER) => {
                KeyState::Incomplete
            }
            "too_large" => KeyState::TooLarge,
            other => return Err(StoreError::Corrupt(format!("record state `{other}`"))),
        };
        let mut info = RecordInfo::new(
            ScopeKey::from_slice(&self.key)?,
            state,
            Fingerprint::from_slice(&self.fingerprint)?,
        );
        info.age = micros(self.age_us);
        info.expires_in = micros(self.expires_in_us);
        info.lease_remaining =
            (state == KeyState::InFlight).then(|| micros(self.lease_remaining_us.unwrap_or(0)));
        info.status = self
            .status
            .and_then(|code| u16::try_from(code).ok())
            .and_then(|code| StatusCode::from_u16(code).ok());
        if state == KeyState::Completed {
            info.body_bytes = self.body_bytes.map(|n| n.max(0) as u64);
            info.header_bytes = self.header_bytes.map(|n| n.max(0) as u64);
        }
        info.has_principal = self.has_principal;
        if let (KeyState::InFlight, Some(owner)) = (state, &self.owner) {
            info = info.held_by(OwnerToken::from_slice(owner)?);
        }
        Ok(info)
    }
}

/// What both dialects select for [`StateCounts`].
#[derive(sqlx::FromRow)]
pub(in crate::store) struct CountsRow {
    in_flight: i64,
    lease_expired: i64,
    completed: i64,
    too_large: i64,
    incomplete: i64,
    expired: i64,
}

impl From<CountsRow> for StateCounts {
    fn from(row: CountsRow) -> Self {
        let n = |count: i64| count.max(0) as u64;
        StateCounts {
            in_flight: n(row.in_flight),
            lease_expired: n(row.lease_expired),
            completed: n(row.completed),
            too_large: n(row.too_large),
            incomplete: n(row.incomplete),
            expired: n(row.expired),
        }
    }
}

/// Implements [`Admin`](crate::store::Admin) for a SQL store made by
/// `sql_store!`, given its dialect's [`AdminStatements`].
macro_rules! sql_admin {
    ($store:ty, $statements:expr) => {
        impl $store {
            const ADMIN: $crate::store::sql::AdminStatements = $statements;

            async fn delete_one(
                &self,
                statement: &'static str,
                key: &$crate::store::ScopeKey,
            ) -> Result<bool, $crate::store::StoreError> {
                let done = $crate::store::sql::on_connection!(self, |executor| {
                    sqlx::query(statement)
                        .bind(key.as_bytes().as_slice())
                        .execute(executor)
                })
                .await
                .map_err($crate::store::sql::store_error)?;
                Ok(done.rows_affected() > 0)
            }

            async fn principal_statement(
                &self,
                statement: &'static str,
                principal: &$crate::store::PrincipalHash,
                limit: usize,
            ) -> Result<Vec<$crate::store::ScopeKey>, $crate::store::StoreError> {
                let keys: Vec<Vec<u8>> = $crate::store::sql::on_connection!(self, |executor| {
                    sqlx::query_scalar(statement)
                        .bind(principal.as_bytes().as_slice())
                        .bind(i64::try_from(limit).unwrap_or(i64::MAX))
                        .fetch_all(executor)
                })
                .await
                .map_err($crate::store::sql::store_error)?;
                keys.iter()
                    .map(|key| $crate::store::ScopeKey::from_slice(key))
                    .collect()
            }
        }

        #[async_trait::async_trait]
        impl $crate::store::Admin for $store {
            async fn reserve_for(
                &self,
                key: &$crate::store::ScopeKey,
                fingerprint: &$crate::store::Fingerprint,
                owner: &$crate::store::OwnerToken,
                lease: std::time::Duration,
                ttl: std::time::Duration,
                principal: Option<&$crate::store::PrincipalHash>,
            ) -> Result<$crate::store::Claim, $crate::store::StoreError> {
                self.reserve_with(key, fingerprint, owner, lease, ttl, principal)
                    .await
            }

            async fn inspect(
                &self,
                key: &$crate::store::ScopeKey,
            ) -> Result<Option<$crate::store::RecordInfo>, $crate::store::StoreError> {
                $crate::store::sql::on_connection!(self, |executor| {
                    sqlx::query_as::<_, $crate::store::sql::admin::InfoRow>(Self::ADMIN.inspect)
                        .bind(key.as_bytes().as_slice())
                        .fetch_optional(executor)
                })
                .await
                .map_err($crate::store::sql::store_error)?
                .map($crate::store::sql::admin::InfoRow::into_info)
                .transpose()
            }

            async fn purge(
                &self,
                key: &$crate::store::ScopeKey,
            ) -> Result<bool, $crate::store::StoreError> {
                self.delete_one(Self::ADMIN.purge, key).await
            }

            async fn principal_keys(
                &self,
                principal: &$crate::store::PrincipalHash,
                limit: usize,
            ) -> Result<Vec<$crate::store::ScopeKey>, $crate::store::StoreError> {
                self.principal_statement(Self::ADMIN.principal_keys, principal, limit)
                    .await
            }

            async fn purge_principal(
                &self,
                principal: &$crate::store::PrincipalHash,
                limit: usize,
            ) -> Result<Vec<$crate::store::ScopeKey>, $crate::store::StoreError> {
                self.principal_statement(Self::ADMIN.purge_principal, principal, limit)
                    .await
            }

            async fn force_release(
                &self,
                key: &$crate::store::ScopeKey,
            ) -> Result<bool, $crate::store::StoreError> {
                self.delete_one(Self::ADMIN.force_release, key).await
            }

            async fn in_flight_older_than(
                &self,
                age: std::time::Duration,
                limit: usize,
            ) -> Result<Vec<$crate::store::RecordInfo>, $crate::store::StoreError> {
                let rows: Vec<$crate::store::sql::admin::InfoRow> =
                    $crate::store::sql::on_connection!(self, |executor| {
                        sqlx::query_as(Self::ADMIN.in_flight_older_than)
                            .bind($crate::store::sql::micros(age))
                            .bind(i64::try_from(limit).unwrap_or(i64::MAX))
                            .fetch_all(executor)
                    })
                    .await
                    .map_err($crate::store::sql::store_error)?;
                rows.into_iter()
                    .map($crate::store::sql::admin::InfoRow::into_info)
                    .collect()
            }

            async fn counts(
                &self,
            ) -> Result<$crate::store::StateCounts, $crate::store::StoreError> {
                let row: $crate::store::sql::admin::CountsRow =
                    $crate::store::sql::on_connection!(self, |executor| {
                        sqlx::query_as(Self::ADMIN.counts).fetch_one(executor)
                    })
                    .await
                    .map_err($crate::store::sql::store_error)?;
                Ok(row.into())
            }
        }
    };
}
pub(in crate::store) use sql_admin;
