//! Covered or pass-through: the one question a front end asks before it
//! reads a request body.

use std::collections::HashMap;
use std::sync::Arc;

use http::{HeaderMap, Method, Uri};

use super::{headers, Engine};
use crate::formats::{self, View};
use crate::key;
use crate::metrics::Event;
use crate::policy::{KeySource, PathPattern, Reached, RoutePolicy, Routes};

/// What a front end needs to know of a request, borrowed from its own
/// request type.
#[derive(Clone, Copy, Debug)]
pub struct RequestHead<'a> {
    /// The method.
    pub method: &'a Method,
    /// The URI the request arrived with (path and query are used; the
    /// scope and the fingerprint are taken from it).
    pub uri: &'a Uri,
    /// The URI routes are matched on, when it differs from `uri`: behind
    /// axum's `Router::nest`, the path the layer sees (`/orders`), where
    /// `uri` is the original one (`/shop-a/orders`). `None`: `uri`.
    pub routed: Option<&'a Uri>,
    /// The headers.
    pub headers: &'a HeaderMap,
    /// An authenticated principal set by the application (the tower layer
    /// reads it from a [`Principal`](crate::Principal) request extension).
    /// Hashed into the scope, never stored.
    pub principal: Option<&'a [u8]>,
}

impl RequestHead<'_> {
    /// The path routes are matched on: [`routed`](RequestHead::routed)'s,
    /// else [`uri`](RequestHead::uri)'s. Classifying a request and
    /// deciding it match the same route by it.
    pub fn route_path(&self) -> &str {
        self.routed.unwrap_or(self.uri).path()
    }
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
    /// The engine's whole buffer budget (`max_buffered_bytes`).
    budget: u64,
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
    /// [`Engine::body_too_large`]. The route's `max_body_bytes`, or the
    /// engine's whole buffer budget (`max_buffered_bytes`) when that is
    /// smaller: a body larger than the budget could never be buffered, and
    /// is refused for good (413) rather than as overload (503, which
    /// invites retries that cannot succeed).
    pub fn max_body_bytes(&self) -> usize {
        let budget = usize::try_from(self.budget).unwrap_or(usize::MAX);
        self.policy.max_body_bytes().min(budget)
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
        let candidates = self.routes_of(head);
        // Every route the request may be dispatched under must let it pass
        // before its body is read.
        let policy = match candidates.first() {
            Some(&policy) if !candidates.iter().all(|p| passes_without_key(p, head)) => policy,
            _ => {
                self.inner.metrics.record(Event::Passthrough);
                return Coverage::PassThrough;
            }
        };
        Coverage::Covered(Covered {
            label: self.inner.labels.get(policy),
            policy: policy.clone(),
            arrived: std::time::Instant::now(),
            budget: self.inner.config.max_buffered_bytes,
        })
    }
}

impl Engine {
    /// The policy of the route that covers `head`'s own method and path,
    /// if any, its header readings included; an operator's lookup
    /// ([`Engine::scope_of`]) starts from it and dispatches as the live
    /// request does.
    pub(super) fn route_of(&self, head: &RequestHead<'_>) -> Option<&Arc<RoutePolicy>> {
        let readings = headers::path_readings(head.headers, head.route_path());
        self.find(head.method, head, &readings)
    }

    /// The route of `method` on the request's path, or on a path a header
    /// names for the backend ([`headers::path_readings`], given as
    /// `readings`): of those, the first `required` route, else the first.
    fn find(
        &self,
        method: &Method,
        head: &RequestHead<'_>,
        readings: &[String],
    ) -> Option<&Arc<RoutePolicy>> {
        self.find_reaching(method, head, readings, None)
    }

    /// [`Engine::find`], noting in `reached` (when given) every covered
    /// route a reading of the target or of a header reaches.
    fn find_reaching(
        &self,
        method: &Method,
        head: &RequestHead<'_>,
        readings: &[String],
        reached: Option<&Reached>,
    ) -> Option<&Arc<RoutePolicy>> {
        let routes = &self.inner.routes;
        let mut found = routes.find_reaching(method, head.route_path(), reached);
        for path in readings {
            let other = || routes.find_reaching(method, path, reached);
            found = crate::policy::prefer(found, other, reached);
        }
        found
    }

    /// Every covered route other than `chosen`, and scoped otherwise,
    /// that a reading of `head`'s path (or of a header naming one) reaches
    /// for its method: routes a backend reading the path another way runs
    /// it under. Empty for a path with one reading (almost every path)
    /// whose candidate methods' routes are scoped alike.
    /// With `candidates`, the methods (and their routes) a backend may
    /// dispatch the request as ([`Dispatched::candidates`]): their routes
    /// too, and what their readings reach.
    /// `readings` are the header readings ([`Dispatched::readings`]).
    pub(super) fn also_reached(
        &self,
        chosen: &Arc<RoutePolicy>,
        head: &RequestHead<'_>,
        (candidates, readings): (&[(Method, &Arc<RoutePolicy>)], &[String]),
    ) -> Vec<Arc<RoutePolicy>> {
        let path = head.route_path();
        let one_reading = readings.is_empty() && !crate::policy::has_other_readings(path);
        // Almost every request: its own route alone, one reading.
        if one_reading
            && candidates
                .iter()
                .all(|(_, route)| chosen.scoped_alike(route))
        {
            return Vec::new();
        }
        let reached = Reached::default();
        let mut methods: Vec<&Method> = vec![head.method];
        for (method, route) in candidates {
            reached.borrow_mut().push(Arc::clone(route));
            if !methods.contains(&method) {
                methods.push(method);
            }
        }
        if !one_reading {
            for method in methods {
                self.find_reaching(method, head, readings, Some(&reached));
            }
        }
        let mut others: Vec<Arc<RoutePolicy>> = Vec::new();
        for route in reached.into_inner() {
            let known = std::iter::once(chosen).chain(others.iter());
            if !known.into_iter().any(|known| known.scoped_alike(&route)) {
                others.push(route);
            }
        }
        others
    }

    /// Every route a request may be dispatched under, read before its
    /// body, in the order [`Engine::dispatched`] prefers them: for a
    /// `POST`, the routes of the methods its header or query names, its
    /// own, then (a form or JSON body may name one) those of every method
    /// a route lists; for any other method, its own.
    fn routes_of(&self, head: &RequestHead<'_>) -> Vec<&Arc<RoutePolicy>> {
        let routes = &self.inner.routes;
        let readings = headers::path_readings(head.headers, head.route_path());
        let mut methods = overrides(head, None);
        let mut add = |method: &Method| {
            if !methods.contains(method) {
                methods.push(method.clone());
            }
        };
        add(head.method);
        if may_name_in_body(head) {
            routes.methods().iter().for_each(add);
        }
        let mut found: Vec<&Arc<RoutePolicy>> = Vec::new();
        for method in &methods {
            if let Some(route) = self.find(method, head, &readings) {
                if !found.iter().any(|known| Arc::ptr_eq(known, route)) {
                    found.push(route);
                }
            }
        }
        found
    }

    /// The method a covered request is dispatched as, and the route that
    /// covers it, now that its body is read. The candidates: for a `POST`,
    /// each method it names ([`overrides`]) that a route covers, in order;
    /// then its own method (`None`) under its own method's route, else
    /// under `covered` (the route it was classified under) when that
    /// covers it; then, for a body that may name a method unreadably
    /// ([`names_unreadably`]), every method a route covers. Backends
    /// disagree on which spelling wins, so the first candidate whose route
    /// is `required` decides, else the first. `None` when there is none:
    /// the request is not covered after all.
    pub(super) fn dispatched<'r>(
        &'r self,
        covered: &'r Arc<RoutePolicy>,
        head: &RequestHead<'_>,
        body: &View<'_>,
    ) -> Option<Dispatched<'r>> {
        let readings = headers::path_readings(head.headers, head.route_path());
        let find = |method: Method| {
            let route = self.find(&method, head, &readings)?;
            Some((Some(method), route))
        };
        let named = overrides(head, Some(body)).into_iter().filter_map(find);
        let own = self
            .find(head.method, head, &readings)
            .or_else(|| covered.applies_to(head.method).then_some(covered))
            .map(|route| (None, route));
        // A body that may name a method no reading here can see: every
        // method a route covers, after its own route, so the same body
        // compressed and plain share a scope wherever it has one, and a
        // required route still asks for its key.
        let unreadable = match names_unreadably(head, body) {
            true => self.inner.routes.methods(),
            false => &[],
        };
        let guessed = unreadable.iter().cloned().filter_map(find);
        let mut first = None;
        let mut required = None;
        let mut max_body_bytes = usize::MAX;
        let mut candidates = Vec::new();
        for (method, route) in named.chain(own).chain(guessed) {
            max_body_bytes = max_body_bytes.min(route.max_body_bytes());
            candidates.push((method.clone().unwrap_or_else(|| head.method.clone()), route));
            if required.is_none() && route.policy().required {
                required = Some((method.clone(), route));
            }
            first.get_or_insert((method, route));
        }
        let (method, policy) = required.or(first)?;
        Some(Dispatched {
            method,
            policy,
            max_body_bytes,
            candidates,
            readings,
        })
    }
}

/// What [`Engine::dispatched`] found for a covered request.
pub(super) struct Dispatched<'r> {
    /// The method it names for itself (a `POST`'s `_method`), if it is
    /// covered as that one; `None`: its own.
    pub method: Option<Method>,
    /// The route that decides.
    pub policy: &'r Arc<RoutePolicy>,
    /// The smallest `max_body_bytes` of the routes it may be dispatched
    /// under: whichever way a backend reads the method, the body keeps
    /// that route's limit.
    pub max_body_bytes: usize,
    /// Every route it may be dispatched under, with the method it would be
    /// dispatched as there (the deciding one among them): whichever way
    /// a backend reads the method, the scope holds what each scopes by.
    pub candidates: Vec<(Method, &'r Arc<RoutePolicy>)>,
    /// The paths its headers name for the backend
    /// ([`headers::path_readings`]).
    pub readings: Vec<String>,
}

/// The `_method` field (form or JSON body, or query) and the header by
/// which a `POST` names the method backends dispatch it as: Laravel and
/// Symfony read the header, then the body's field (a JSON body's too, in
/// Laravel), then the query's; Rails (`Rack::MethodOverride`) the form's
/// field, then the header; Express's `method-override` the header's first
/// listed value.
const OVERRIDE_FIELD: &str = "_method";

/// The body field Slim's `MethodOverrideMiddleware` reads instead
/// (`_METHOD`, a form's or a parsed JSON body's).
const SLIM_OVERRIDE_FIELD: &str = "_METHOD";

/// Every method a `POST` names ([`OVERRIDE_FIELD`], [`formats::METHOD_OVERRIDES`]),
/// upper-cased and distinct, in the order: the headers' values (see below),
/// the body's field (when `body` is given), the query's. Each
/// backend's reading counts: the first and the last of a repeated field
/// (PHP and Rack read the last, others the first), fields PHP reads as
/// `_method` (`.method`, ` _method`), a JSON body's top-level member
/// (whenever a `Content-Type` line spells JSON), a body Rack reads as a
/// form although its type says otherwise ([`formats::rack_form`]: none, a
/// form type cut at `,`, multipart without a boundary). For any other
/// method, only the header's (Slim 4 honours it on every method).
fn overrides(head: &RequestHead<'_>, body: Option<&View<'_>>) -> Vec<Method> {
    let mut named = Named(Vec::new());
    // Express reads the first listed value (of the header's lines, joined
    // as Node joins them); Symfony and Rack the whole value, which names a
    // method only when it lists one: of the first line, or of the last
    // (nginx before 1.23 hands PHP-FPM every line, and PHP keeps the
    // last). The first and the last listed value of the first and the last
    // line cover them all, whatever the length of the list.
    // Found by one pass over the names (most requests carry none: three
    // lookups, each hashing a name, cost more).
    let present = head
        .headers
        .keys()
        .filter(|name| formats::method_override(name));
    for name in present {
        let lines = head.headers.get_all(name);
        let ends = lines
            .iter()
            .next()
            .into_iter()
            .chain(lines.iter().next_back());
        for line in ends {
            let mut listed = line.as_bytes().split(|&b| b == b',');
            let first = listed.next().unwrap_or_default();
            named.add(trim_as_javascript(first));
            if let Some(last) = listed.next_back() {
                named.add(trim_as_javascript(last));
            }
        }
    }
    if !is_post(head.method) {
        return named.0;
    }
    if let Some(body) = body {
        // A form's field, wherever a framework reads the body as a form,
        // and, whatever else reads it as a form, the member Laravel reads
        // when it takes the body for JSON.
        let content_type = formats::content_type(head.headers);
        let fields = body.framework_fields(content_type, OVERRIDE_FIELD);
        named.first_and_last(fields.into_iter());
        let slim = body.framework_fields(content_type, SLIM_OVERRIDE_FIELD);
        named.first_and_last(slim.into_iter());
        for value in array_overrides(body, content_type) {
            named.add(&value);
        }
        if formats::spells_json(head.headers) {
            let spelled = override_spellings(body.bytes);
            for field in [OVERRIDE_FIELD, SLIM_OVERRIDE_FIELD] {
                if !spelled.may_name(field) {
                    continue;
                }
                if let Some(name) = json_override(body.bytes, field) {
                    named.add(&name);
                }
            }
        }
    }
    if let Some(query) = head.uri.query() {
        named.first_and_last(formats::form_values_read_as(
            query.as_bytes(),
            OVERRIDE_FIELD,
        ));
    }
    named.0
}

/// The values of a form's array `_method`, whose first element Express's
/// `method-override` takes from an extended (`qs`) form: fields named
/// `_method[]` or `_method[i]` (`i` up to 20, which `qs` reads as an array
/// index, compacting the array, so `_method[1]` alone is its first). Each
/// is named: of the methods named, a required route's decides.
fn array_overrides(body: &View<'_>, content_type: &str) -> Vec<Vec<u8>> {
    fn is_array(name: &[u8]) -> bool {
        let index = name
            .strip_prefix(b"_method[")
            .and_then(|rest| rest.strip_suffix(b"]"));
        match index {
            Some([]) => true,
            Some(digits) if digits.len() <= 2 && digits.iter().all(u8::is_ascii_digit) => {
                digits.iter().fold(0, |n, d| n * 10 + u32::from(d - b'0')) <= 20
            }
            _ => false,
        }
    }
    // The first and the last value of each such name (of 22), as for a
    // repeated field: a body naming thousands of methods costs at most 44
    // route lookups, not one per field.
    /// A name, its first value and its last.
    type Values = (Vec<u8>, Vec<u8>, Option<Vec<u8>>);
    let mut named: Vec<Values> = Vec::new();
    let mut take = |name: &[u8], value: &[u8]| {
        if !is_array(name) {
            return;
        }
        match named
            .iter_mut()
            .find(|(known, _, _)| known.as_slice() == name)
        {
            Some((_, _, last)) => *last = Some(value.to_vec()),
            None => named.push((name.to_vec(), value.to_vec(), None)),
        }
    };
    match &body.kind {
        formats::Kind::Form(pairs) => pairs.iter().for_each(|(name, value)| take(name, value)),
        formats::Kind::Multipart(parts) => parts.iter().for_each(|part| take(part.name, part.data)),
        _ if formats::rack_form(content_type) => {
            formats::form_pairs(body.bytes).for_each(|(name, value)| take(&name, &value))
        }
        _ => {}
    }
    let values = named
        .into_iter()
        .flat_map(|(_, first, last)| [Some(first), last]);
    values.flatten().collect()
}

/// Which override members a JSON body may hold, from one pass over it: a
/// member's name can only be spelled as is (`_method`, `_METHOD`) or with
/// a `\u` escape of a letter or `_` (`\u0040` to `\u007F`); the other
/// escapes (`\"`, `\n`, `\u00e9`, …) stand for no letter and no `_`, so
/// a body whose only escapes are such (text in any language, as Python's
/// `json.dumps` writes it) is not walked.
struct Spellings {
    escaped: bool,
    lower: bool,
    upper: bool,
}

impl Spellings {
    /// Whether the body may hold the member `field` (so it must be walked).
    fn may_name(&self, field: &str) -> bool {
        self.escaped
            || match field == OVERRIDE_FIELD {
                true => self.lower,
                false => self.upper,
            }
    }
}

fn override_spellings(body: &[u8]) -> Spellings {
    let mut found = Spellings {
        escaped: false,
        lower: false,
        upper: false,
    };
    for at in memchr::memchr2_iter(b'_', b'\\', body) {
        let next = &body[at + 1..];
        if body[at] == b'\\' {
            found.escaped |= spells_ascii_letter(next);
        } else if next.starts_with(b"method") {
            found.lower = true;
        } else if next.starts_with(b"METHOD") {
            found.upper = true;
        }
        if found.escaped {
            break;
        }
    }
    found
}

/// Whether `escape` (what follows a `\` in a JSON string) is a `\u`
/// escape that may stand for an ASCII letter or `_`: `\u0040` to
/// `\u007F`, in either case of hex digit. A malformed one counts as one,
/// to be safe.
fn spells_ascii_letter(escape: &[u8]) -> bool {
    match escape {
        [b'u', hex @ ..] if hex.len() >= 4 && hex[..4].iter().all(u8::is_ascii_hexdigit) => {
            hex[..2] == *b"00" && matches!(hex[2], b'4'..=b'7')
        }
        [b'u', ..] => true,
        _ => false,
    }
}

/// The top-level `field` member of a JSON body, as Laravel (`_method`)
/// and Slim (`_METHOD`) read it (walked only where [`override_spellings`]
/// says it may be there).
fn json_override(body: &[u8], field: &str) -> Option<Vec<u8>> {
    match key::json::value_at(body, &[field]) {
        key::json::Found::String(name) => Some(name),
        // Express's `method-override` takes an array's first element.
        key::json::Found::Other => match key::json::value_at(body, &[field, "0"]) {
            key::json::Found::String(name) => Some(name),
            _ => None,
        },
        key::json::Found::Absent => None,
    }
}

/// The distinct methods a request names, in order.
/// `value` trimmed as JavaScript's `trim` does, which also drops NBSP, VT
/// and FF (Node reads header bytes as Latin-1).
fn trim_as_javascript(value: &[u8]) -> &[u8] {
    let blank = |b: &u8| b.is_ascii_whitespace() || matches!(b, 0x0b | 0x0c | 0xa0);
    let start = value.iter().position(|b| !blank(b)).unwrap_or(value.len());
    let end = value
        .iter()
        .rposition(|b| !blank(b))
        .map_or(start, |i| i + 1);
    &value[start..end]
}

struct Named(Vec<Method>);

impl Named {
    fn add(&mut self, name: &[u8]) {
        // Rack drops one trailing NUL from a form body (Safari's).
        let name = name.strip_suffix(b"\0").unwrap_or(name);
        let Ok(method) = Method::from_bytes(&name.to_ascii_uppercase()) else {
            return;
        };
        if !self.0.contains(&method) {
            self.0.push(method);
        }
    }

    /// Of a repeated field, the first value (what most readers take) and
    /// the last (PHP and Rack): a list of thousands costs two lookups.
    fn first_and_last(&mut self, values: impl Iterator<Item = Vec<u8>>) {
        let mut values = values;
        let Some(first) = values.next() else { return };
        self.add(&first);
        if let Some(last) = values.last() {
            self.add(&last);
        }
    }
}

/// Whether a `POST`'s body may name a method where no reading here can
/// see it: a form or JSON body with a `Content-Encoding` (Express inflates
/// it before `method-override` reads `_method`) or a `charset` other than
/// UTF-8 (Express decodes a UTF-7 body, where `+AF8-method` is
/// `_method`), or a multipart body
/// malformed to this reader, or under a boundary PHP or Rack read
/// otherwise, or of a type only Rack reads as a form (`multipart/mixed`,
/// `multipart/related`), that spells `method` or `METHOD` somewhere (a part PHP reads
/// as `_method` by its last `name`, say) or holds an extended parameter
/// (`name*=UTF-8''%5F%6D…`, which Go decodes). It is taken to name every
/// method a required route covers, so that route's key is asked for.
fn names_unreadably(head: &RequestHead<'_>, body: &View<'_>) -> bool {
    let encoded = || {
        super::headers::lists_coding_other_than(
            head.headers,
            &http::header::CONTENT_ENCODING,
            b"identity",
        )
    };
    let multipart = || {
        let content_type = formats::content_type(head.headers);
        let unread = formats::is_media_type(content_type, "multipart/form-data")
            && (matches!(body.kind, formats::Kind::BadMultipart)
                || formats::read_more_than_one_way(head.headers));
        // Rack parses these as forms too; their parts are not read here.
        (unread || formats::rack_only_multipart(content_type))
            && [&b"method"[..], b"METHOD", b"*="]
                .iter()
                .any(|spelled| memchr::memmem::find(body.bytes, spelled).is_some())
    };
    let decoded = || encoded() || formats::names_other_charset(head.headers);
    is_post(head.method) && ((decoded() && may_name_in_body(head)) || multipart())
}

/// Whether `method` is `POST`, in any case (see [`RoutePolicy::applies_to`]).
fn is_post(method: &Method) -> bool {
    method.as_str().eq_ignore_ascii_case("POST")
}

/// Whether a `POST`'s body may name its method: a form (as the content
/// type reads to us, or to Rack and PHP: see [`formats::rack_form`]) or JSON as
/// Laravel reads it.
fn may_name_in_body(head: &RequestHead<'_>) -> bool {
    let content_type = formats::content_type(head.headers);
    is_post(head.method)
        && (formats::rack_form(content_type)
            || formats::rack_only_multipart(content_type)
            || formats::is_media_type(content_type, "application/x-www-form-urlencoded")
            || formats::is_media_type(content_type, "multipart/form-data")
            || formats::spells_json(head.headers))
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Only a `\u` escape that may stand for a letter or `_` makes a body
    /// worth walking for `_method`: text escaped as Python writes it
    /// (`\u00e9`, `\u4e2d`) does not, an escaped name does, and so does a
    /// malformed escape.
    #[test]
    fn only_escapes_of_letters_may_spell_an_override() {
        let walks = |body: &str| override_spellings(body.as_bytes()).may_name(OVERRIDE_FIELD);
        for body in [
            r#"{"note":"\u00e9t\u00E9","city":"\u4e2d","q":"\"x\"\n"}"#,
            r#"{"a":"\u0020\u003F"}"#,
        ] {
            assert!(!walks(body), "{body}");
        }
        for body in [
            r#"{"\u005fmethod":"PUT"}"#,
            r#"{"_\u006Dethod":"PUT"}"#,
            r#"{"_method":"PUT"}"#,
            r#"{"x":"\u00"}"#,
            r#"{"x":"\uzzzz"}"#,
        ] {
            assert!(walks(body), "{body}");
        }
    }
}
