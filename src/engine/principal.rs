//! The principal a covered request is scoped by: the front end's own (the
//! layer's `Principal` extension), else the route's configured source
//! (a trusted gateway header or a verified JWT), checked here before
//! anything is reserved.

use bytes::Bytes;
use http::{header, HeaderValue, Response};

use super::{Engine, RequestHead};
use crate::metrics::Event;
use crate::policy::principal::Resolved;
use crate::policy::RoutePolicy;
use crate::problem::{Problem, ProblemKind};

/// What [`Engine::resolve_principal`] found.
pub(super) enum PrincipalRead {
    /// Scope by this principal; `None`: by the front end's, or by none.
    Scope(Option<Vec<u8>>),
    /// The 401 to answer.
    Refused(Response<Bytes>),
}

impl Engine {
    /// The principal the request's key is scoped by, when the route
    /// configures one and the front end set none (a principal the front
    /// end set wins: it comes from the application's own authentication).
    /// `Scope(None)`: scope by the front end's principal or by none.
    /// `Refused`: the 401 to answer — the credential failed its checks, or the route
    /// requires a principal and there is none. A credential that failed
    /// never picks a scope, whatever `required` says.
    pub(super) fn resolve_principal(
        &self,
        policy: &RoutePolicy,
        head: &RequestHead<'_>,
    ) -> PrincipalRead {
        let Some(source) = &policy.principal else {
            return PrincipalRead::Scope(None);
        };
        let (kind, detail, challenge) = match principal_of(policy, head) {
            Ok(principal) => return PrincipalRead::Scope(principal),
            Err(Resolved::Missing | Resolved::Found(_)) => (
                ProblemKind::PrincipalMissing,
                "This endpoint requires an authenticated caller for its idempotency key; \
                 the request was not executed.",
                "Bearer",
            ),
            Err(Resolved::Invalid(reason)) => {
                tracing::debug!(reason, "idempotency principal refused");
                (
                    ProblemKind::PrincipalInvalid,
                    "The caller's credential could not be verified; the request was not \
                     executed.",
                    "Bearer error=\"invalid_token\"",
                )
            }
        };
        self.inner.metrics.record(Event::PrincipalRefused);
        let mut response = Problem::new(kind, detail).into_response_for(head.headers);
        response
            .extensions_mut()
            .insert(super::responses::Answered(Event::PrincipalRefused.as_str()));
        if source.is_jwt() {
            response.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static(challenge),
            );
        }
        PrincipalRead::Refused(response)
    }
}

/// The rule of [`Engine::resolve_principal`] without its answer: `Ok` with
/// the principal to scope by (`None`: the front end's, or none), or `Err`
/// with what is wrong — [`Resolved::Missing`] where the route requires one,
/// [`Resolved::Invalid`] for a credential that failed its checks.
pub(super) fn principal_of(
    policy: &RoutePolicy,
    head: &RequestHead<'_>,
) -> Result<Option<Vec<u8>>, Resolved> {
    let Some(source) = &policy.principal else {
        return Ok(None);
    };
    if head.principal.is_some() {
        return Ok(None);
    }
    match source.resolve(head.headers) {
        Resolved::Found(principal) => Ok(Some(principal)),
        Resolved::Missing if !source.required() => Ok(None),
        other => Err(other),
    }
}
