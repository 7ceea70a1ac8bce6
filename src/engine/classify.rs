//! Covered or pass-through: the one question a front end asks before it
//! reads a request body.

use std::collections::HashMap;
use std::sync::Arc;

use http::{HeaderMap, Method, Uri};

use super::Engine;
use crate::formats::{self, View};
use crate::key;
use crate::metrics::Event;
use crate::policy::{KeySource, PathPattern, RoutePolicy, Routes};

/// What a front end needs to know of a request, borrowed from its own
/// request type.
#[derive(Clone, Copy, Debug)]
pub struct RequestHead<'a> {
    /// The method.
    pub method: &'a Method,
    /// The URI (path and query are used).
    pub uri: &'a Uri,
    /// The headers.
    pub headers: &'a HeaderMap,
    /// An authenticated principal set by the application (the tower layer
    /// reads it from a [`Principal`](crate::Principal) request extension).
    /// Hashed into the scope, never stored.
    pub principal: Option<&'a [u8]>,
}

/// The engine's answer to [`Engine::classify`].
#[derive(Debug)]
pub enum Coverage {
    /// Forward the request untouched, without reading or limiting its
    /// body: no route covers it, or its route takes an optional key from a
    /// header or the query and it carries none.
    PassThrough,
    /// The engine decides: buffer the body (up to
    /// [`Covered::max_body_bytes`]) and call [`Engine::begin`].
    Covered(Covered),
}

/// A covered request's route: its policy and its label for logs.
#[derive(Clone, Debug)]
pub struct Covered {
    policy: Arc<RoutePolicy>,
    label: Arc<str>,
    /// When the engine classified the request: its decision's log line
    /// counts its duration from here.
    arrived: std::time::Instant,
}

impl Covered {
    /// The route's policy.
    pub fn policy(&self) -> &Arc<RoutePolicy> {
        &self.policy
    }

    /// The route's path pattern as configured (for log lines).
    pub fn label(&self) -> &str {
        &self.label
    }

    /// The request body limit in bytes: a larger body is answered with
    /// [`Engine::body_too_large`].
    pub fn max_body_bytes(&self) -> usize {
        self.policy.max_body_bytes()
    }

    /// When the engine classified the request (its head had arrived).
    pub fn arrived(&self) -> std::time::Instant {
        self.arrived
    }
}

/// Each route's label, found by its policy's address (a route table is
/// fixed once the engine is built).
#[derive(Debug, Default)]
pub(super) struct Labels(HashMap<usize, Arc<str>>);

impl Labels {
    pub(super) fn new(routes: &Routes) -> Self {
        let labels = routes
            .iter()
            .filter_map(|route| {
                let policy = route.policy.as_ref()?;
                let pattern = match &route.path {
                    PathPattern::Prefix(pattern) | PathPattern::Glob(pattern) => pattern,
                };
                Some((Arc::as_ptr(policy) as usize, Arc::from(pattern.as_str())))
            })
            .collect();
        Labels(labels)
    }

    pub(super) fn get(&self, policy: &Arc<RoutePolicy>) -> Arc<str> {
        self.0
            .get(&(Arc::as_ptr(policy) as usize))
            .cloned()
            .unwrap_or_else(|| Arc::from(""))
    }
}

impl Engine {
    /// Whether the engine decides about this request. A pass-through is
    /// counted ([`Event::Passthrough`]); nothing else is recorded.
    pub fn classify(&self, head: &RequestHead<'_>) -> Coverage {
        let Some(policy) = self.route_of(head) else {
            self.inner.metrics.record(Event::Passthrough);
            return Coverage::PassThrough;
        };
        if passes_without_key(policy, head) {
            self.inner.metrics.record(Event::Passthrough);
            return Coverage::PassThrough;
        }
        Coverage::Covered(Covered {
            label: self.inner.labels.get(policy),
            policy: policy.clone(),
            arrived: std::time::Instant::now(),
        })
    }
}

impl Engine {
    /// The policy of the route that covers `head`'s method and path, if
    /// any: the one rule [`Engine::classify`] and the operator's lookups
    /// ([`Engine::scope_of`]) share. A `POST` that no route covers is
    /// also read as each method it may stand for ([`override_guesses`]):
    /// backends dispatch it as the method it names.
    pub(super) fn route_of(&self, head: &RequestHead<'_>) -> Option<&Arc<RoutePolicy>> {
        let routes = &self.inner.routes;
        let path = head.uri.path();
        routes.find(head.method, path).or_else(|| {
            override_guesses(head)
                .iter()
                .find_map(|method| routes.find(method, path))
        })
    }

    /// The method a covered request is dispatched as, and the route that
    /// covers it, now that its body is read: its own method when `policy`
    /// covers it (`None`); otherwise (a `POST` covered through
    /// [`Engine::route_of`]'s guesses) the first method it names, in
    /// [`overrides`]' order, that a route covers. `None` when none is:
    /// the request is not covered after all.
    pub(super) fn dispatched<'r>(
        &'r self,
        policy: &'r Arc<RoutePolicy>,
        head: &RequestHead<'_>,
        body: &View<'_>,
    ) -> Option<(Option<Method>, &'r Arc<RoutePolicy>)> {
        if policy.applies_to(head.method) {
            return Some((None, policy));
        }
        let path = head.uri.path();
        overrides(head, Some(body)).into_iter().find_map(|method| {
            let route = self.inner.routes.find(&method, path)?;
            Some((Some(method), route))
        })
    }
}

/// The `_method` field (form or JSON body, or query) and the header by
/// which a `POST` names the method backends dispatch it as: Laravel and
/// Symfony read the header, then the body's field (a JSON body's too, in
/// Laravel), then the query's; Rails (`Rack::MethodOverride`) the form's
/// field, then the header; Express's `method-override` the header's first
/// listed value.
const OVERRIDE_FIELD: &str = "_method";
const OVERRIDE_HEADER: &str = "x-http-method-override";

/// Every method a `POST` names ([`OVERRIDE_FIELD`], [`OVERRIDE_HEADER`]),
/// each upper-cased, in the order: the header's listed values, the body's
/// fields (when `body` is given), the query's. Every reading counts: each
/// value of a repeated field (PHP and Rack read the last, others the
/// first), fields PHP reads as `_method` (`.method`, ` _method`), a JSON
/// body's top-level member. Nothing for any other method.
fn overrides(head: &RequestHead<'_>, body: Option<&View<'_>>) -> Vec<Method> {
    if !is_post(head.method) {
        return Vec::new();
    }
    let mut named: Vec<Vec<u8>> = Vec::new();
    for value in head.headers.get_all(OVERRIDE_HEADER) {
        let listed = value.as_bytes().split(|&b| b == b',');
        named.extend(listed.map(|name| name.trim_ascii().to_vec()));
    }
    if let Some(body) = body {
        named.extend(
            body.fields_read_as(OVERRIDE_FIELD)
                .into_iter()
                .map(<[u8]>::to_vec),
        );
        if body.is_json() {
            let member = [OVERRIDE_FIELD.to_owned()];
            if let key::json::Found::String(name) = key::json::value_at(body.bytes, &member) {
                named.push(name);
            }
        }
    }
    if let Some(query) = head.uri.query() {
        let fields = formats::form_pairs(query.as_bytes());
        named.extend(fields.filter_map(|(name, value)| {
            (formats::php_name(&name) == OVERRIDE_FIELD.as_bytes()).then_some(value)
        }));
    }
    named
        .into_iter()
        .filter_map(|name| Method::from_bytes(&name.to_ascii_uppercase()).ok())
        .collect()
}

/// Whether `method` is `POST`, in any case (see [`RoutePolicy::applies_to`]).
fn is_post(method: &Method) -> bool {
    method.as_str().eq_ignore_ascii_case("POST")
}

/// The methods a `POST` may stand for, read before its body:
/// [`overrides`] without the body's, and, for a form or JSON body (whose
/// `_method` is read with it), `PUT`, `PATCH` and `DELETE`.
fn override_guesses(head: &RequestHead<'_>) -> Vec<Method> {
    let mut guesses = overrides(head, None);
    let content_type = formats::content_type(head.headers);
    let form = formats::is_media_type(content_type, "application/x-www-form-urlencoded")
        || formats::is_media_type(content_type, "multipart/form-data")
        || formats::is_json(content_type);
    if form && is_post(head.method) {
        guesses.extend([Method::PUT, Method::PATCH, Method::DELETE]);
    }
    guesses
}

/// Whether a covered request goes to the upstream untouched before its
/// body is read: its route takes an optional key from a header or the
/// query, and the request carries none. Such a request is not protected,
/// so its body is neither buffered nor limited (a large upload without a
/// key is not refused with 413).
fn passes_without_key(policy: &RoutePolicy, head: &RequestHead<'_>) -> bool {
    let settings = policy.policy();
    !settings.required
        && matches!(settings.key, KeySource::Header(_) | KeySource::Query(_))
        && matches!(
            key::extract(&settings.key, head.uri, head.headers, &[]),
            Ok(None)
        )
}
