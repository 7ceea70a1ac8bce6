//! The route table: path patterns (prefixes and globs, matched in linear
//! time) and the first route matching path and method.

use std::sync::Arc;

use http::Method;

use super::paths::{
    decode_escapes, decode_slashes, front_controller_path, has_encoded_dot, has_encoded_slash,
    normalize, strip_format_suffix, strip_segment_parameters,
};
use super::{invalid, Policy, PolicyError, RoutePolicy};

/// How a route matches request paths. Paths are matched in their
/// normalised form (see [`normalize_path`](super::normalize_path)), and patterns must be written
/// in that form.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PathPattern {
    /// `/orders` matches `/orders` and `/orders/…`, not `/orders-archive`.
    /// `/` matches every path.
    Prefix(String),
    /// A glob: `*` matches within one segment, `**` matches anything,
    /// e.g. `/api/*/submit` or `/forms/**`. Matched in time linear in the
    /// path's length (times the pattern's), whatever the pattern.
    Glob(String),
}

impl PathPattern {
    /// Parses `pattern`: a glob when it contains `*`, a prefix otherwise.
    ///
    /// Refused: a pattern that does not start with `/`; one that ends with
    /// `/` (other than `/` itself: paths are matched without their
    /// trailing slash, so `/orders/` would never match `/orders`); and one
    /// that is not in normal form (`//`, `.` or `..` segments, `%`
    /// escapes), which no normalised path could match; and one holding a
    /// `?` or `#` (a query or fragment: routes match the path alone), a
    /// control character, or ending in white space, which no request path
    /// could match either.
    pub fn parse(pattern: &str) -> Result<Self, PolicyError> {
        if !pattern.starts_with('/') {
            return Err(invalid(
                "path",
                format!("`{pattern}` does not start with `/`"),
            ));
        }
        if pattern.len() > 1 && pattern.ends_with('/') {
            return Err(invalid(
                "path",
                format!(
                    "`{pattern}` ends with `/`; write `{}`, which covers that path with or \
                     without the slash and everything under it",
                    pattern.trim_end_matches('/')
                ),
            ));
        }
        // A query or a fragment (`/orders?type=refund`: routes match the
        // path alone), a control character, or white space at either end
        // (a typo): such a pattern's route would never match a request,
        // and protect nothing without a word. (Other characters a request
        // sends percent-encoded, a space or `ä` inside, match its decoded
        // reading.)
        let edge = |c: char| c.is_whitespace();
        let never = pattern
            .chars()
            .find(|&c| c == '?' || c == '#' || c.is_control())
            .or_else(|| pattern.chars().next_back().filter(|&c| edge(c)));
        if let Some(c) = never {
            let hint = match c {
                '?' => ": routes match the path alone; drop the query",
                '#' => ": a fragment never reaches the server",
                c if c.is_control() => ": no request path holds a control character",
                _ => ": a path never ends in white space",
            };
            return Err(invalid(
                "path",
                format!("`{}` holds {c:?}{hint}", pattern.escape_debug()),
            ));
        }
        if pattern.contains('%')
            || pattern.contains("//")
            || pattern
                .split('/')
                .any(|segment| segment == "." || segment == "..")
        {
            return Err(invalid(
                "path",
                format!(
                    "`{pattern}` is not a normalised path (no `//`, `.` or `..` segments, or \
                     `%` escapes): requests are matched in that form"
                ),
            ));
        }
        Ok(if pattern.contains('*') {
            PathPattern::Glob(pattern.to_owned())
        } else {
            PathPattern::Prefix(pattern.to_owned())
        })
    }

    /// The pattern as written.
    pub fn as_str(&self) -> &str {
        match self {
            PathPattern::Prefix(pattern) | PathPattern::Glob(pattern) => pattern,
        }
    }

    /// Whether `path` (without query, already normalised) matches.
    pub fn matches(&self, path: &str) -> bool {
        match self {
            PathPattern::Prefix(prefix) => match path.strip_prefix(prefix.as_str()) {
                Some(rest) => rest.is_empty() || prefix.ends_with('/') || rest.starts_with('/'),
                None => false,
            },
            PathPattern::Glob(glob) => glob_match(glob.as_bytes(), path.as_bytes()),
        }
    }

    /// Folded for case-insensitive matching, beyond ASCII too
    /// ([`fold_case`]).
    fn make_lowercase(&mut self) {
        match self {
            PathPattern::Prefix(p) | PathPattern::Glob(p) => *p = fold_case(p),
        }
    }
}

/// How many PHP front controllers in a row a path is read through one by
/// one ([`Routes::find`]); past them, straight to the rest after the last.
const FRONT_CONTROLLER_HOPS: usize = 8;

/// `text` folded one character at a time as .NET's `OrdinalIgnoreCase`
/// compares, by its simple upper case (ASCII then lower-cased, as the
/// ASCII routes are): `ς`, `σ` and `Σ` are one letter, as are `µ` and
/// `μ`, with no regard to where a letter stands; Kelvin's `K` and Ohm's
/// `Ω` are upper case already and stay apart from `k` and `ω`; a letter
/// whose upper case is longer (`ß` is `SS`) stays itself, as .NET keeps it.
fn fold_case(text: &str) -> String {
    text.chars()
        .map(|c| {
            let mut upper = c.to_uppercase();
            let upper = match (upper.next(), upper.next()) {
                (Some(single), None) => single,
                _ => c,
            };
            upper.to_ascii_lowercase()
        })
        .collect()
}

/// One step of a glob.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum GlobToken {
    Byte(u8),
    /// `*`: any bytes but `/`.
    Star,
    /// `**`: any bytes.
    AnyStar,
}

pub(super) fn glob_tokens(pattern: &[u8]) -> Vec<GlobToken> {
    let mut tokens = Vec::with_capacity(pattern.len());
    let mut i = 0;
    while i < pattern.len() {
        if pattern[i] == b'*' {
            if pattern.get(i + 1) == Some(&b'*') {
                tokens.push(GlobToken::AnyStar);
                i += 2;
            } else {
                tokens.push(GlobToken::Star);
                i += 1;
            }
        } else {
            tokens.push(GlobToken::Byte(pattern[i]));
            i += 1;
        }
    }
    tokens
}

/// Glob matching as a simulation of the pattern's automaton: the set of
/// pattern positions the path read so far can be at is carried along the
/// path, one byte at a time. Each byte costs at most one step per pattern
/// token, so a match costs O(path × pattern) steps whatever the input: no
/// backtracking, however many `*` and `**` the pattern has.
pub(super) fn glob_match(pattern: &[u8], path: &[u8]) -> bool {
    // The bytes before the first `*` must open the path: most paths a
    // route table sees are told apart there, without the automaton.
    let literal = pattern
        .iter()
        .position(|&b| b == b'*')
        .unwrap_or(pattern.len());
    if !path.starts_with(&pattern[..literal]) {
        return false;
    }
    match glob_match_small(pattern, path) {
        Some(matched) => matched,
        None => glob_match_counting(pattern, path, &mut 0),
    }
}

/// [`glob_match_counting`]'s automaton without allocating, for a pattern
/// of fewer than 64 tokens: its positions are the bits of one word, and
/// each byte visits only the positions set. `None` for a longer pattern.
fn glob_match_small(pattern: &[u8], path: &[u8]) -> Option<bool> {
    let mut tokens = [GlobToken::AnyStar; 63];
    let mut m = 0;
    let mut i = 0;
    while i < pattern.len() {
        let token = match pattern[i] {
            b'*' if pattern.get(i + 1) == Some(&b'*') => {
                i += 1;
                GlobToken::AnyStar
            }
            b'*' => GlobToken::Star,
            byte => GlobToken::Byte(byte),
        };
        *tokens.get_mut(m)? = token;
        m += 1;
        i += 1;
    }
    let tokens = &tokens[..m];
    // Past any `*` or `**` without reading (they may match nothing); in
    // order, so a run of stars closes in one pass.
    let close = |mut states: u64| {
        for (i, token) in tokens.iter().enumerate() {
            if states & (1 << i) != 0 && !matches!(token, GlobToken::Byte(_)) {
                states |= 1 << (i + 1);
            }
        }
        states
    };
    let mut now = close(1);
    for &byte in path {
        let mut next = 0u64;
        let mut live = now & !(1 << m);
        while live != 0 {
            let i = live.trailing_zeros() as usize;
            live &= live - 1;
            match tokens[i] {
                GlobToken::Byte(expected) if expected == byte => next |= 1 << (i + 1),
                GlobToken::Star if byte != b'/' => next |= 1 << i,
                GlobToken::AnyStar => next |= 1 << i,
                _ => {}
            }
        }
        if next == 0 {
            return Some(false);
        }
        now = close(next);
    }
    Some(now & (1 << m) != 0)
}

/// [`glob_match`], adding the steps it takes to `steps`.
pub(super) fn glob_match_counting(pattern: &[u8], path: &[u8], steps: &mut u64) -> bool {
    let tokens = glob_tokens(pattern);
    let m = tokens.len();
    // `now[i]`: the path read so far can end before token `i`.
    let mut now = vec![false; m + 1];
    let mut next = vec![false; m + 1];
    now[0] = true;
    close(&tokens, &mut now);
    for &byte in path {
        next.iter_mut().for_each(|state| *state = false);
        let mut any = false;
        for (i, token) in tokens.iter().enumerate() {
            *steps += 1;
            if !now[i] {
                continue;
            }
            match *token {
                GlobToken::Byte(expected) if expected == byte => next[i + 1] = true,
                GlobToken::Star if byte != b'/' => next[i] = true,
                GlobToken::AnyStar => next[i] = true,
                _ => continue,
            }
            any = true;
        }
        if !any {
            return false;
        }
        close(&tokens, &mut next);
        std::mem::swap(&mut now, &mut next);
    }
    now[m]
}

/// Adds the positions reachable without reading: past any `*` or `**`
/// (they may match nothing).
fn close(tokens: &[GlobToken], states: &mut [bool]) {
    for (i, token) in tokens.iter().enumerate() {
        if states[i] && !matches!(token, GlobToken::Byte(_)) {
            states[i + 1] = true;
        }
    }
}

/// One route: a path pattern and its policy, or `None` to leave matching
/// paths alone entirely.
#[derive(Clone, Debug)]
pub struct Route {
    /// Which paths it covers.
    pub path: PathPattern,
    /// The policy, or `None` for "no idempotency here".
    pub policy: Option<Arc<RoutePolicy>>,
}

/// An ordered route table. A request is decided by the first route whose
/// pattern matches its normalised path (see [`normalize_path`](super::normalize_path)) **and**
/// that covers its method: an exclusion (any method), or a route whose
/// policy lists the method. A route whose pattern matches but whose
/// methods do not is skipped, so a later route can still cover the
/// request. A request no route decides is left alone.
#[derive(Clone, Debug, Default)]
pub struct Routes {
    routes: Vec<Route>,
    case_insensitive: bool,
    /// Every method some route covers, once each (ASCII case ignored), in
    /// the order the routes list them.
    methods: Vec<Method>,
}

impl Routes {
    /// An empty table: nothing is covered.
    pub fn new() -> Self {
        Self::default()
    }

    /// One policy for every path.
    pub fn all(policy: Policy) -> Result<Self, PolicyError> {
        Routes::new().route("/", policy)
    }

    /// Routes paths without regard to ASCII case (`/API/Pay` is `/api/pay`),
    /// for backends that do the same (ASP.NET, IIS): the scope then uses
    /// the lowercased path too, so both spellings share one key space.
    /// Applies to every route, added before or after this call (their
    /// patterns are kept lowercased from then on, so turning it off again
    /// needs a new table). Default off.
    pub fn case_insensitive(mut self, on: bool) -> Self {
        self.case_insensitive = on;
        for route in &mut self.routes {
            if on {
                route.path.make_lowercase();
            }
            if let Some(policy) = &mut route.policy {
                Arc::make_mut(policy).case_insensitive_paths = on;
            }
        }
        self
    }

    /// Appends a route covering `pattern` with `policy`.
    pub fn route(mut self, pattern: &str, policy: Policy) -> Result<Self, PolicyError> {
        let mut policy = policy.validate()?;
        Arc::make_mut(&mut policy).case_insensitive_paths = self.case_insensitive;
        let path = self.pattern(pattern)?;
        for method in &policy.methods {
            if !self
                .methods
                .iter()
                .any(|known| known.as_str().eq_ignore_ascii_case(method.as_str()))
            {
                self.methods.push(method.clone());
            }
        }
        self.routes.push(Route {
            path,
            policy: Some(policy),
        });
        Ok(self)
    }

    fn pattern(&self, pattern: &str) -> Result<PathPattern, PolicyError> {
        let mut path = PathPattern::parse(pattern)?;
        if self.case_insensitive {
            path.make_lowercase();
        }
        Ok(path)
    }

    /// Appends a route that leaves `pattern` alone (no idempotency), for
    /// every method.
    pub fn exclude(mut self, pattern: &str) -> Result<Self, PolicyError> {
        let path = self.pattern(pattern)?;
        self.routes.push(Route { path, policy: None });
        Ok(self)
    }

    /// The policy that applies to `method` on `path` (raw, as in the
    /// request; it is normalised here), if any.
    ///
    /// A path with an encoded dot (`/api/pay/%2e%2e`) is read both ways, as
    /// backends differ on it (some decode `%2e` and then remove dot
    /// segments, others take it as text): it is covered when either reading
    /// is, so neither kind of backend can be reached around a route. The
    /// first reading (dots decoded) wins when both are covered (but see
    /// below for `required`).
    ///
    /// Likewise, a path with segment parameters (`/api/pay;x=1`, which
    /// servlet containers route as `/api/pay`) is also read without them,
    /// and with case-insensitive routing (IIS, ASP.NET) a backslash is also
    /// read as `/`, and an encoded slash (`/api%2Fpay`, which WSGI and ASGI
    /// servers hand to Django decoded, and Laravel matches decoded) is also
    /// read as `/`. A last segment with a format suffix (`/contacts.json`,
    /// which Rails routes as `/contacts`) is also read without it. A path
    /// with other escapes (`/v1/orders%3Acancel`, `/best%C3%A4tigen`) is
    /// also read decoded, as Laravel, Django and Go route it.
    ///
    /// Of the readings, the first whose route is `required` decides, else
    /// the first covered: a broader optional route (a catch-all `/`) that
    /// matches one reading never hides the `required` route another
    /// reading reaches, whichever reading the backend takes.
    pub fn find(&self, method: &Method, path: &str) -> Option<&Arc<RoutePolicy>> {
        self.find_reaching(method, path, None)
    }

    /// [`Routes::find`], noting in `reached` (when given) every covered
    /// route any reading reaches, each once, every reading read: the
    /// routes a backend may run the request under.
    pub(crate) fn find_reaching(
        &self,
        method: &Method,
        path: &str,
        reached: Option<&Reached>,
    ) -> Option<&Arc<RoutePolicy>> {
        let mut found = self.find_spelled(method, path, reached);
        if let Some(at) = path.find(';') {
            // Without the parameters, read every other way too (Tomcat and
            // Spring strip them before they decode the rest:
            // `/best%C3%A4tigen;jsessionid=1` is `/bestätigen`); and cut at
            // the first `;`, as find-my-way before 8 (Fastify, Restify)
            // reads it, a query (`/orders;/..` is `/orders`).
            let stripped = strip_segment_parameters(path);
            found = prefer(
                found,
                || self.find_reaching(method, &stripped, reached),
                reached,
            );
            let cut = match &path[..at] {
                "" => "/",
                cut => cut,
            };
            // Most often the same path (`/orders;jsessionid=1`): read once.
            if cut != stripped {
                found = prefer(found, || self.find_reaching(method, cut, reached), reached);
            }
        }
        if path.contains('%') {
            // Decoded once, as backends decode (an escape the decoding
            // makes, `%%35C`, stays text), and never read again through
            // every reading, which a target of nested escapes would make
            // exponential. Under case-insensitive routing a decoded `%5C`
            // is also read as `/`, as IIS reads a `\`.
            let decoded = || {
                let decoded = decode_escapes(path)?;
                let slashed = || {
                    let backslash = self.case_insensitive && decoded.contains('\\');
                    backslash
                        .then(|| self.find_spelled(method, &decoded.replace('\\', "/"), reached))
                        .flatten()
                };
                prefer(
                    self.find_spelled(method, &decoded, reached),
                    slashed,
                    reached,
                )
            };
            found = prefer(found, decoded, reached);
        }
        if self.case_insensitive && path.contains('\\') {
            found = prefer(
                found,
                || self.find_reaching(method, &path.replace('\\', "/"), reached),
                reached,
            );
        }
        if has_encoded_slash(path) {
            found = prefer(
                found,
                || self.find_reaching(method, &decode_slashes(path), reached),
                reached,
            );
        }
        found
    }

    /// [`Routes::find`] for one spelling: dots decoded, and kept; each
    /// also without a format suffix, and as the PHP front controller in it
    /// routes it (`/index.php/contact` as `/contact`).
    ///
    /// A route that leaves the full path alone (`enabled = false` for
    /// `/legacy.php/**`) decides for it, as for a format suffix, unless it
    /// leaves the routed path alone too (a trailing `/` exclusion).
    ///
    /// Under case-insensitive routing a path beyond ASCII (decoded from
    /// `/best%C3%84tigen`) is matched folded letter by letter, as ASP.NET
    /// compares paths (`OrdinalIgnoreCase`: `Ä` is `ä`; [`fold_case`]); its scope keeps
    /// the ASCII folding of [`normalize`].
    ///
    /// A path through more than [`FRONT_CONTROLLER_HOPS`] front
    /// controllers (`/a.php/b.php/…`, which no application routes) is read
    /// through the first ones and then as the rest after its last, as nginx
    /// splits it: the work per request stays linear in the path, and a
    /// target of thousands of such segments cannot exhaust the stack.
    fn find_spelled(
        &self,
        method: &Method,
        path: &str,
        reached: Option<&Reached>,
    ) -> Option<&Arc<RoutePolicy>> {
        let normal = self.matched_form(path, true);
        let mut found = self.decide_formatted(method, &normal, reached);
        if has_encoded_dot(path) {
            let kept = || self.decide_formatted(method, &self.matched_form(path, false), reached);
            found = prefer(found, kept, reached);
        }
        self.through_front_controllers(method, &normal, found, reached)
    }

    /// `found` for `normal` (in [`Routes::matched_form`] already), and the
    /// paths the PHP front controllers in it route by, each read as it is:
    /// normalising a rest again would decode escapes a second time, which
    /// no backend does (and which let each pass make one more `.php/`
    /// segment out of nested escapes: work growing with the square of the
    /// target).
    fn through_front_controllers<'r>(
        &'r self,
        method: &Method,
        normal: &str,
        mut found: Option<&'r Arc<RoutePolicy>>,
        reached: Option<&Reached>,
    ) -> Option<&'r Arc<RoutePolicy>> {
        let mut current = normal;
        for hop in 1..=FRONT_CONTROLLER_HOPS {
            let Some(mut routed) = front_controller_path(current) else {
                return found;
            };
            if hop == FRONT_CONTROLLER_HOPS {
                while let Some(further) = front_controller_path(routed) {
                    routed = further;
                }
            }
            // A route leaving the full path alone decides for it, unless
            // it also leaves the routed path alone (a catch-all `/`
            // exclusion after the routes): broader than the route the
            // routed path reaches first.
            if let Decision::LeftAlone(route) = self.decide(method, current) {
                if !route.path.matches(routed) {
                    return found;
                }
            }
            found = prefer(
                found,
                || self.decide_formatted(method, routed, reached),
                reached,
            );
            current = routed;
        }
        found
    }

    /// `path` normalised ([`normalize`]) and, under case-insensitive
    /// routing, beyond ASCII folded too ([`fold_case`]).
    fn matched_form<'p>(&self, path: &'p str, decode_dots: bool) -> std::borrow::Cow<'p, str> {
        let normal = normalize(path, self.case_insensitive, decode_dots);
        match self.case_insensitive && !normal.is_ascii() {
            true => std::borrow::Cow::Owned(fold_case(&normal)),
            false => normal,
        }
    }

    /// [`Routes::decide`] for normalised `path`, and when no route matches
    /// it, for `path` without its format suffix (`/contacts.html`, which
    /// Rails routes as `/contacts`). A route that leaves the full path
    /// alone (`exclude`, `enabled = false`) decides for it: that is how a
    /// path such as `/upload.php` beside a covered `/upload` is left alone.
    fn decide_formatted(
        &self,
        method: &Method,
        path: &str,
        reached: Option<&Reached>,
    ) -> Option<&Arc<RoutePolicy>> {
        let stripped = || self.decide(method, strip_format_suffix(path)?).covered();
        match self.decide(method, path) {
            Decision::Covered(policy) => prefer(Some(policy), stripped, reached),
            // A route leaving the suffixed path alone but also matching it
            // without the suffix (`/v1` beside `/v1/charges`) is broader
            // than the route that matches first without it.
            Decision::LeftAlone(route) => match route.path.matches(strip_format_suffix(path)?) {
                true => stripped(),
                false => None,
            },
            Decision::Unmatched => stripped(),
        }
    }

    /// The first route matching normalised `path` and `method` decides.
    fn decide(&self, method: &Method, path: &str) -> Decision<'_> {
        for route in &self.routes {
            if !route.path.matches(path) {
                continue;
            }
            match &route.policy {
                None => return Decision::LeftAlone(route),
                Some(policy) if policy.applies_to(method) => return Decision::Covered(policy),
                Some(_) => {}
            }
        }
        Decision::Unmatched
    }

    /// The routes, in order.
    pub fn iter(&self) -> impl Iterator<Item = &Route> {
        self.routes.iter()
    }

    /// Every method some route covers, once each, in the order the routes
    /// list them: the methods a request may name for itself (a `POST`'s
    /// `_method`) and be covered as.
    pub fn methods(&self) -> &[Method] {
        &self.methods
    }
}

/// The covered routes a request's readings reach, each once
/// ([`Routes::find_reaching`]).
pub(crate) type Reached = std::cell::RefCell<Vec<Arc<RoutePolicy>>>;

/// Of two readings' routes, `found` unless it is not `required` and
/// `other` is; else whichever is covered, `found` first. `other` is asked
/// only then, unless every reached route is wanted (`reached`, where both
/// are noted).
pub(crate) fn prefer<'a>(
    found: Option<&'a Arc<RoutePolicy>>,
    other: impl FnOnce() -> Option<&'a Arc<RoutePolicy>>,
    reached: Option<&Reached>,
) -> Option<&'a Arc<RoutePolicy>> {
    let required = |policy: &&Arc<RoutePolicy>| policy.policy().required;
    if reached.is_none() && found.is_some_and(|policy| required(&policy)) {
        return found;
    }
    let other = other();
    if let Some(reached) = reached {
        let mut reached = reached.borrow_mut();
        for route in [found, other].into_iter().flatten() {
            if !reached.iter().any(|known| Arc::ptr_eq(known, route)) {
                reached.push(route.clone());
            }
        }
    }
    match (found, other) {
        (Some(found), _) if required(&found) => Some(found),
        (_, Some(other)) if required(&other) => Some(other),
        (found, other) => found.or(other),
    }
}

/// What the route table says about one normalised path and method.
enum Decision<'a> {
    /// The first matching route covers the method.
    Covered(&'a Arc<RoutePolicy>),
    /// The first matching route leaves the path alone.
    LeftAlone(&'a Route),
    /// No route matches (or none covers the method).
    Unmatched,
}

impl<'a> Decision<'a> {
    fn covered(self) -> Option<&'a Arc<RoutePolicy>> {
        match self {
            Decision::Covered(policy) => Some(policy),
            _ => None,
        }
    }
}
