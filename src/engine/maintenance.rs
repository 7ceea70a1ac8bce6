//! Running the engine beside the requests: health checks, the sweeper
//! that deletes expired records, and the metrics text.

use std::time::Duration;

use super::Engine;
use crate::store::StoreError;

impl Engine {
    /// Renders the engine's and the store's metrics in Prometheus text.
    pub fn render_metrics(&self) -> String {
        let mut out = String::new();
        let extra = self
            .inner
            .store
            .maintenance()
            .map(|store| store.counters())
            .unwrap_or_default();
        self.inner.metrics.render_prometheus(&extra, &mut out);
        out
    }

    /// Whether the store answers (for health checks).
    pub async fn health(&self) -> Result<(), StoreError> {
        self.store_call(self.inner.store.ping()).await
    }

    /// Deletes expired records every `every`, at most `batch` per call,
    /// until the returned handle is aborted. A store without a
    /// [`Maintenance`](crate::store::Maintenance) side has nothing to sweep:
    /// the task ends at once.
    pub fn spawn_sweeper(&self, every: Duration, batch: usize) -> tokio::task::JoinHandle<()> {
        let engine = self.clone();
        tokio::spawn(async move {
            let mut ticker = tokio::time::interval(every);
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                ticker.tick().await;
                // Keep sweeping while full batches come back.
                loop {
                    let Some(store) = engine.inner.store.maintenance() else {
                        return;
                    };
                    match engine.store_call(store.sweep(batch)).await {
                        Ok(n) if n as usize >= batch => continue,
                        Ok(n) => {
                            tracing::debug!(swept = n, "idempotency sweep");
                            break;
                        }
                        Err(error) => {
                            tracing::warn!(%error, "idempotency sweep failed");
                            break;
                        }
                    }
                }
            }
        })
    }
}
