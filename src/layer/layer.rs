use tower_layer::Layer;

use super::Idempotency;
use crate::Engine;

/// Applies the idempotency [`Engine`] to a service. See the
/// [module docs](crate::layer).
#[derive(Clone, Debug)]
pub struct IdempotencyLayer {
    engine: Engine,
}

impl IdempotencyLayer {
    /// A layer driving `engine`. Every service it wraps shares the engine's
    /// store and routes.
    pub fn new(engine: Engine) -> Self {
        IdempotencyLayer { engine }
    }
}

impl<S> Layer<S> for IdempotencyLayer {
    type Service = Idempotency<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Idempotency::new(inner, self.engine.clone())
    }
}
