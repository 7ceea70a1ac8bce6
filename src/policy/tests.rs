//! Unit tests of policies, status sets, paths and the route table.

use super::paths::normalize;
use super::routes::{glob_match, glob_match_counting, glob_tokens};
use super::*;

#[test]
fn status_sets_parse_and_match() {
    let set: StatusSet = "2xx, 303,400-401".parse().unwrap();
    assert!(set.contains(StatusCode::CREATED));
    assert!(set.contains(StatusCode::SEE_OTHER));
    assert!(set.contains(StatusCode::UNAUTHORIZED));
    assert!(!set.contains(StatusCode::FOUND));
    assert!("6xx".parse::<StatusSet>().is_err());
    assert!("300-200".parse::<StatusSet>().is_err());
    assert_eq!(set.to_string(), "2xx,303,400-401");
    let default = StatusSet::default();
    assert!(default.contains(StatusCode::SEE_OTHER));
    assert!(!default.contains(StatusCode::UNPROCESSABLE_ENTITY));
}

/// From a review: a pattern holding what no request path can (a query,
/// a fragment, a space, a character requests carry percent-encoded) was
/// accepted, and its route never matched: `required = true` on
/// `/orders?type=refund` protected nothing. Refused, naming the character;
/// every character a path may hold is still accepted.
#[test]
fn a_pattern_no_request_path_can_match_is_refused() {
    for pattern in [
        "/orders?type=refund",
        "/orders#x",
        "/orders ",
        "/api/*/pay\t",
        "/a\u{0}",
        "/a\nb",
        "/orders\u{a0}",
    ] {
        let error = PathPattern::parse(pattern).expect_err(pattern).to_string();
        assert!(error.contains("holds"), "{pattern}: {error}");
    }
    assert!(PathPattern::parse("/orders?x")
        .unwrap_err()
        .to_string()
        .contains("drop the query"));
    for pattern in [
        "/a-b._~!$&'()+,;=:@/c",
        "/api/*/pay",
        "/forms/**",
        "/bestellung/bestätigen",
        "/files/my report",
    ] {
        assert!(PathPattern::parse(pattern).is_ok(), "{pattern}");
    }
}

#[test]
fn prefixes_respect_segments() {
    let p = PathPattern::parse("/orders").unwrap();
    assert!(p.matches("/orders"));
    assert!(p.matches("/orders/7"));
    assert!(!p.matches("/orders-archive"));
    assert!(PathPattern::parse("/").unwrap().matches("/anything"));
    assert!(PathPattern::parse("orders").is_err());
}

#[test]
fn globs() {
    let p = PathPattern::parse("/api/*/submit").unwrap();
    assert!(p.matches("/api/forms/submit"));
    assert!(!p.matches("/api/a/b/submit"));
    let p = PathPattern::parse("/forms/**").unwrap();
    assert!(p.matches("/forms/a/b/c"));
    assert!(!p.matches("/other/a"));
}

#[test]
fn first_matching_route_decides() {
    let routes = Routes::new()
        .exclude("/health")
        .unwrap()
        .route("/", Policy::default())
        .unwrap();
    assert!(routes.find(&Method::POST, "/health").is_none());
    assert!(routes.find(&Method::POST, "/orders").is_some());
    assert!(routes.find(&Method::GET, "/orders").is_none());
    assert!(routes.find(&Method::PUT, "/orders").is_none());
}

/// The old backtracking matcher: obviously right on short inputs, and
/// the reference for the automaton.
fn reference_glob(pattern: &[u8], path: &[u8]) -> bool {
    match pattern.split_first() {
        None => path.is_empty(),
        Some((b'*', rest)) => {
            if let Some(rest) = rest.strip_prefix(b"*") {
                (0..=path.len()).any(|i| reference_glob(rest, &path[i..]))
            } else {
                let segment_end = path.iter().position(|&b| b == b'/').unwrap_or(path.len());
                (0..=segment_end).any(|i| reference_glob(rest, &path[i..]))
            }
        }
        Some((&c, rest)) => path.first() == Some(&c) && reference_glob(rest, &path[1..]),
    }
}

/// A 40 KB path of near-matches against `/a/**/b/**/c` (2.3 s of CPU
/// with the backtracking matcher) takes one step per path byte and
/// pattern token, and still matches right.
#[test]
fn a_long_path_costs_linear_steps() {
    let pattern = b"/a/**/b/**/c";
    let tokens = glob_tokens(pattern).len() as u64;
    let long = format!("/a/{}", "b/".repeat(20_000));
    let mut steps = 0;
    assert!(!glob_match_counting(pattern, long.as_bytes(), &mut steps));
    assert!(steps <= long.len() as u64 * tokens, "{steps} steps");
    let matching = format!("{long}c");
    let mut steps = 0;
    assert!(glob_match_counting(
        pattern,
        matching.as_bytes(),
        &mut steps
    ));
    assert!(steps <= matching.len() as u64 * tokens, "{steps} steps");
    assert!(PathPattern::parse("/a/**/b/**/c")
        .unwrap()
        .matches(&matching));
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(4000))]

    /// The automaton agrees with the backtracking reference.
    #[test]
    fn globs_agree_with_the_reference(
        pattern in "[ab/*]{0,8}",
        path in "[ab/]{0,10}",
    ) {
        proptest::prop_assert_eq!(
            glob_match(pattern.as_bytes(), path.as_bytes()),
            reference_glob(pattern.as_bytes(), path.as_bytes()),
            "pattern {:?} path {:?}", pattern, path
        );
    }
}

#[test]
fn paths_are_normalised() {
    for (raw, normal) in [
        ("/api/pay", "/api/pay"),
        ("//api/pay", "/api/pay"),
        ("/./api/pay", "/api/pay"),
        ("/%61pi/pay", "/api/pay"),
        ("/api/pay/", "/api/pay"),
        ("/api//pay//", "/api/pay"),
        ("/x/../api/pay", "/api/pay"),
        ("/../../api/pay", "/api/pay"),
        ("/%2e%2E/api/./pay", "/api/pay"),
        ("/a%2fb", "/a%2Fb"),
        ("/a%2Fb", "/a%2Fb"),
        ("/%7euser", "/~user"),
        ("/", "/"),
        ("", "/"),
        ("//", "/"),
        ("/.well-known/x", "/.well-known/x"),
        ("/é/%zz", "/é/%zz"),
    ] {
        assert_eq!(normalize_path(raw, false), normal, "{raw}");
    }
    assert_eq!(normalize_path("/API/Pay/", true), "/api/pay");
    assert_eq!(normalize_path("/API/Pay", false), "/API/Pay");
}

#[test]
fn the_first_route_matching_path_and_method_decides() {
    let routes = Routes::new()
        .route("/api/payments", Policy::default())
        .unwrap()
        .route(
            "/api/**",
            Policy {
                methods: vec!["PUT".into(), "DELETE".into()],
                ..Policy::default()
            },
        )
        .unwrap();
    assert!(routes.find(&Method::PUT, "/api/payments/7").is_some());
    assert!(routes.find(&Method::POST, "/api/payments/7").is_some());
    assert!(routes.find(&Method::PATCH, "/api/other").is_none());
    // An exclusion decides for every method.
    let routes = Routes::new()
        .exclude("/health")
        .unwrap()
        .route("/", Policy::default())
        .unwrap();
    assert!(routes.find(&Method::POST, "/health").is_none());
    assert!(routes.find(&Method::POST, "//health/").is_none());
}

/// `%2e%2e` is a `..` segment to some backends and text to others: a
/// path is covered when either reading is.
#[test]
fn encoded_dots_are_covered_either_way() {
    let routes = Routes::new().route("/api/pay", Policy::default()).unwrap();
    // Read as text: `/api/pay/%2E%2E` is under `/api/pay`.
    assert!(routes.find(&Method::POST, "/api/pay/%2e%2e").is_some());
    // Read as a dot segment: `/api/x/../pay` is `/api/pay`.
    assert!(routes.find(&Method::POST, "/api/x/%2e%2e/pay").is_some());
    assert!(routes.find(&Method::POST, "/api/x/%2E./pay").is_some());
    assert!(routes.find(&Method::POST, "/api/other/%2e").is_none());
    assert_eq!(normalize("/a/%2e%2e/b", false, false), "/a/%2E%2E/b");
}

/// Rails routes `/contacts.json` as `/contacts`: a path is also read
/// without the format suffix of its last segment, once.
#[test]
fn a_format_suffix_is_read_both_ways() {
    let routes = Routes::new().route("/contacts", Policy::default()).unwrap();
    for covered in [
        "/contacts.html",
        "/contacts.json",
        "/contacts.turbo_stream",
        "/contacts%2Ejs",
    ] {
        assert!(routes.find(&Method::POST, covered).is_some(), "{covered}");
    }
    for not in [
        "/contacts.",
        "/contacts.tar.gz",
        "/contactsjson",
        "/other.json",
        "/.contacts",
    ] {
        assert!(routes.find(&Method::POST, not).is_none(), "{not}");
    }
}

/// A route for the full path decides before the reading without a format
/// suffix: an exclusion leaves `/upload.php` alone beside `/upload`.
#[test]
fn an_exclusion_of_the_full_path_wins_over_its_format_suffix() {
    let routes = Routes::new()
        .exclude("/upload.php")
        .unwrap()
        .route("/upload", Policy::default())
        .unwrap();
    assert!(routes.find(&Method::POST, "/upload.php").is_none());
    assert!(routes.find(&Method::POST, "/upload.json").is_some());
    assert!(routes.find(&Method::POST, "/upload").is_some());
    // A broader exclusion that also matches the path without its suffix
    // does not hide the route that matches that path first.
    let routes = Routes::new()
        .route("/v1/charges", Policy::default())
        .unwrap()
        .exclude("/v1")
        .unwrap();
    assert!(routes.find(&Method::POST, "/v1/charges.json").is_some());
    assert!(routes.find(&Method::POST, "/v1/other.json").is_none());
}

/// Laravel and Symfony behind nginx or Apache route `/index.php/contact`
/// as `/contact` (the script's `PATH_INFO`): a path is also read as the
/// PHP front controller in it routes it, in any spelling of the script's
/// name, so a `required` route is never reached around.
#[test]
fn a_php_front_controller_path_is_read_as_it_routes() {
    let required = Policy {
        required: true,
        ..Policy::default()
    };
    let routes = Routes::new()
        .route("/contact", required)
        .unwrap()
        .route("/", Policy::default())
        .unwrap();
    for covered in [
        "/index.php/contact",
        "/ind%65x.php/contact",
        "/index%2Ephp/contact",
        "/INDEX.PHP/contact",
        "/public/index.php/contact",
        "/index.php/app.php/contact",
        "/index.php/contact;x=1",
        "/index.php//contact/",
    ] {
        let found = routes.find(&Method::POST, covered);
        assert!(found.is_some_and(|p| p.policy().required), "{covered}");
    }
    for other in [
        "/index.php",
        "/index.php/other",
        "/.php/contact",
        "/indexphp/contact",
    ] {
        let found = routes.find(&Method::POST, other);
        assert!(found.is_some_and(|p| !p.policy().required), "{other}");
    }
    // An exclusion of the full path leaves it alone.
    let routes = Routes::new()
        .exclude("/legacy.php/**")
        .unwrap()
        .route("/contact", Policy::default())
        .unwrap();
    assert!(routes.find(&Method::POST, "/legacy.php/contact").is_none());
    assert!(routes.find(&Method::POST, "/index.php/contact").is_some());
    // A catch-all exclusion after the routes leaves the routed path alone
    // too: the route it reaches first decides (as for a format suffix).
    let required = Policy {
        required: true,
        ..Policy::default()
    };
    let routes = Routes::new()
        .route("/contact", required)
        .unwrap()
        .exclude("/")
        .unwrap();
    let found = routes.find(&Method::POST, "/index.php/contact");
    assert!(found.is_some_and(|p| p.policy().required));
    assert!(routes.find(&Method::POST, "/index.php/other").is_none());
}

#[test]
fn silent_gaps_are_refused_at_start() {
    let empty = Policy {
        methods: Vec::new(),
        ..Policy::default()
    };
    assert_eq!(empty.validate().unwrap_err().field, "methods");
    for pattern in [
        "/orders/", "/api/*/", "//orders", "/a/./b", "/a/../b", "/%61pi",
    ] {
        assert_eq!(
            Routes::new()
                .route(pattern, Policy::default())
                .unwrap_err()
                .field,
            "path",
            "{pattern}"
        );
    }
    assert!(Routes::new().route("/", Policy::default()).is_ok());
}

#[test]
fn case_insensitive_routing() {
    let routes = Routes::new()
        .route("/Api/Pay", Policy::default().required(true))
        .unwrap();
    assert!(routes.find(&Method::POST, "/api/pay").is_none());
    let routes = routes.case_insensitive(true);
    assert!(routes.find(&Method::POST, "/API/pay").is_some());
    let later = Routes::new()
        .case_insensitive(true)
        .route("/Api/**", Policy::default())
        .unwrap();
    assert!(later.find(&Method::POST, "/aPI/x").is_some());
}

#[test]
fn validation_names_the_field() {
    let bad = Policy {
        mismatch_status: 400,
        ..Policy::default()
    };
    assert_eq!(bad.validate().unwrap_err().field, "mismatch_status");
    let bad = Policy {
        methods: vec!["GET".into()],
        ..Policy::default()
    };
    assert_eq!(bad.validate().unwrap_err().field, "methods");
    let bad = Policy {
        scope_headers: vec!["bad header".into()],
        ..Policy::default()
    };
    assert_eq!(bad.validate().unwrap_err().field, "scope_headers");
    let bad = Policy::default().key(KeySource::JsonPointer("key".into()));
    assert_eq!(bad.validate().unwrap_err().field, "key");
    // "Everything" as the parser's bounds write it still starts, and a
    // 1xx in it (a 101 protocol switch) is still never stored.
    let everything = Policy {
        store_statuses: "100-599".parse().unwrap(),
        ..Policy::default()
    };
    let everything = everything.validate().unwrap();
    let target = RequestTarget {
        host: "shop.example",
        path: "/orders",
        query: None,
        mount: "",
    };
    let headers = http::HeaderMap::new();
    for (code, stored) in [(101, false), (103, false), (201, true), (500, true)] {
        let status = http::StatusCode::from_u16(code).unwrap();
        assert_eq!(
            everything.consumes(status, &headers, &target),
            stored,
            "{code}"
        );
    }
}

#[test]
fn redirect_targets_resolve_as_rfc_3986_says() {
    let path =
        |location: &str| super::paths::location_path(location.as_bytes(), "/contact").unwrap();
    // A query- or fragment-only reference is the request's own path.
    assert_eq!(path("?error=email"), "/contact");
    assert_eq!(path("#top"), "/contact");
    assert_eq!(path(""), "/contact");
    // Relative references resolve against its directory.
    assert_eq!(path("thanks"), "/thanks");
    assert_eq!(path("./contact/thanks?x=1"), "/contact/thanks");
    // Servlet containers' segment parameters are not part of the target.
    assert_eq!(path("/contact/thanks;jsessionid=A1B2"), "/contact/thanks");
    assert_eq!(
        path("http://shop.test/contact/thanks;jsessionid=A1"),
        "/contact/thanks"
    );
    assert_eq!(path("//shop.test/a/../contact/thanks"), "/contact/thanks");
}

/// The recipes' patterns (docs/frameworks.md): a success target matched
/// without reaching the form's own page, and a Rails path without its
/// member routes.
#[test]
fn recipe_globs_stop_at_the_segment() {
    let posts = super::PathPattern::parse("/posts*").unwrap();
    assert!(posts.matches("/posts"));
    assert!(posts.matches("/posts.json"));
    assert!(!posts.matches("/posts/create"));
    assert!(!posts.matches("/posts/1"));
    let prefix = super::PathPattern::parse("/posts").unwrap();
    assert!(
        prefix.matches("/posts/create"),
        "a plain pattern is a prefix"
    );
}

/// A broader optional route (a catch-all `/` with a header key) matching
/// one reading of a path never hides the `required` route another reading
/// reaches: Rails runs `/orders.json` as `/orders`, Tomcat `/api/pay;x=1`
/// as `/api/pay`, Django `/api%2Fpay` as `/api/pay`, so a keyless request
/// spelled that way must still be refused, not passed through.
#[test]
fn a_required_route_wins_over_a_broader_optional_one_in_every_reading() {
    let routes = Routes::new()
        .route("/orders", Policy::default().required(true))
        .unwrap()
        .route("/api/pay", Policy::default().required(true))
        .unwrap()
        .route("/", Policy::default())
        .unwrap();
    for path in [
        "/orders",
        "/orders.json",
        "/api/pay;x=1",
        "/api%2Fpay",
        "/api%2fpay.json",
        "/api/pay/%2e%2e/pay",
    ] {
        let found = routes.find(&Method::POST, path).expect(path);
        assert!(found.policy().required, "{path} escaped its required route");
    }
    // Paths no required route reaches keep the catch-all.
    for path in ["/other", "/orders-archive", "/other.json"] {
        let found = routes.find(&Method::POST, path).expect(path);
        assert!(!found.policy().required, "{path}");
    }
}

/// Escapes other than unreserved characters (`%3A`, UTF-8 bytes) are
/// read decoded too, as Laravel, Django and Go route them: a required
/// route written `/v1/orders:cancel` or `/bestellung/bestätigen` covers
/// the spellings real clients send.
#[test]
fn escaped_reserved_and_non_ascii_characters_reach_their_route() {
    let routes = Routes::new()
        .route("/v1/orders:cancel", Policy::default().required(true))
        .unwrap()
        .route("/bestellung/bestätigen", Policy::default().required(true))
        .unwrap()
        .route("/", Policy::default())
        .unwrap();
    for path in [
        "/v1/orders%3Acancel",
        "/v1/orders%3acancel",
        "/bestellung/best%C3%A4tigen",
        "/bestellung/bestätigen",
    ] {
        let found = routes.find(&Method::POST, path).expect(path);
        assert!(found.policy().required, "{path} escaped its required route");
    }
    // An escape that decodes to bytes that are not UTF-8 is no reading.
    let found = routes
        .find(&Method::POST, "/bestellung/best%E4tigen")
        .unwrap();
    assert!(!found.policy().required);
}

/// A "forever" (`Duration::MAX`) would overflow the clocks each duration
/// is added to (the Redis cache's expiry panicked after the inner store
/// had committed): it is refused at start, naming its field.
#[test]
fn durations_that_would_overflow_a_clock_are_refused() {
    for (field, policy) in [
        (
            "ttl",
            Policy {
                ttl: Duration::MAX,
                ..Policy::default()
            },
        ),
        (
            "wait_timeout",
            Policy {
                wait_timeout: Duration::MAX,
                ..Policy::default()
            },
        ),
        (
            "execution_timeout",
            Policy {
                execution_timeout: Duration::MAX,
                ..Policy::default()
            },
        ),
    ] {
        assert_eq!(policy.validate().unwrap_err().field, field);
    }
    let long = Policy {
        ttl: Duration::from_secs(10 * 365 * 24 * 3600),
        ..Policy::default()
    };
    assert!(long.validate().is_ok(), "ten years is fine");
}

/// From a review: a 10 ms lease (renewed every 3 ms) swamped SQLite's
/// writer under 100 keys in flight until leases lapsed under running
/// requests (55 keys ran twice), and a `ttl` shorter than a waiting
/// duplicate's look at the store let the record expire between two looks
/// (a key run four times). Both floors are refused naming their field;
/// the floors themselves pass.
#[test]
fn leases_and_retentions_too_short_to_protect_are_refused() {
    let ms = Duration::from_millis;
    for (field, lease, ttl) in [
        ("lease", ms(10), ms(10_000)),
        ("lease", ms(99), ms(10_000)),
        ("ttl", ms(100), ms(100)),
        ("ttl", ms(500), ms(999)),
    ] {
        let policy = Policy {
            lease,
            ttl,
            ..Policy::default()
        };
        let error = policy.validate().unwrap_err();
        assert_eq!(error.field, field, "{lease:?} {ttl:?}: {error}");
        assert!(error.to_string().contains("at least"), "{error}");
    }
    let floors = Policy {
        lease: crate::policy::MIN_LEASE,
        ttl: crate::policy::MIN_TTL,
        ..Policy::default()
    };
    assert!(floors.validate().is_ok());
}

/// Patterns of 64 tokens or more take the general automaton; shorter ones
/// the one-word one: both agree with the reference.
#[test]
fn long_and_short_globs_match_alike() {
    for repeat in [10, 31, 32, 40] {
        let pattern = format!("/{}*/**", "ab/".repeat(repeat));
        let hit = format!("/{}x/y/z", "ab/".repeat(repeat));
        let miss = format!("/{}x", "ab/".repeat(repeat));
        for path in [&hit, &miss] {
            assert_eq!(
                glob_match(pattern.as_bytes(), path.as_bytes()),
                reference_glob(pattern.as_bytes(), path.as_bytes()),
                "{pattern} {path}"
            );
        }
        assert!(glob_match(pattern.as_bytes(), hit.as_bytes()));
    }
}

/// Two hosts are joined with a space, which no host name holds: a `Host`
/// value that is no authority and holds a space is escaped, so it never
/// reads as a target's host and another `Host`.
#[test]
fn a_host_value_with_a_space_never_reads_as_two_hosts() {
    let headers = |host: &'static str| {
        let mut headers = http::HeaderMap::new();
        headers.insert(http::header::HOST, http::HeaderValue::from_static(host));
        headers
    };
    let two = scope_host(
        &http::Uri::from_static("http://a.com/orders"),
        &headers("b.com"),
    );
    let one = scope_host(&http::Uri::from_static("/orders"), &headers("a.com b.com"));
    assert_eq!(two, "a.com b.com");
    assert_ne!(one, two);
    let escaped = scope_host(
        &http::Uri::from_static("/orders"),
        &headers("a.com%20b.com"),
    );
    assert_ne!(one, escaped);
}

/// Two `Host` lines (RFC 9112 forbids them; a server may read either):
/// scoped by both, apart from either tenant alone.
#[test]
fn several_host_lines_scope_by_every_one() {
    let mut headers = http::HeaderMap::new();
    headers.append(http::header::HOST, http::HeaderValue::from_static("a.com"));
    headers.append(
        http::header::HOST,
        http::HeaderValue::from_static("B.com:8080"),
    );
    let uri = http::Uri::from_static("/orders");
    let both = scope_host(&uri, &headers);
    assert_eq!(both, "a.com b.com");
    let mut one = http::HeaderMap::new();
    one.insert(http::header::HOST, http::HeaderValue::from_static("a.com"));
    assert_ne!(scope_host(&uri, &one), both);
    let mut same = one.clone();
    same.append(http::header::HOST, http::HeaderValue::from_static("A.com."));
    assert_eq!(scope_host(&uri, &same), "a.com", "one host, spelled twice");
}

/// Readings combine: a segment parameter beside an escape
/// (`/best%C3%A4tigen;jsessionid=…`, which a servlet's `encodeURL` writes
/// into a form's action), a `;` read as the start of a query
/// (find-my-way before 8: `/orders;/..` is `/orders`), and under
/// case-insensitive routing a decoded capital beyond ASCII (ASP.NET's
/// `OrdinalIgnoreCase` reads `Ä` as `ä`): none escapes its required route.
#[test]
fn readings_combined_still_reach_their_required_route() {
    let routes = |case_insensitive: bool| {
        let routes = Routes::new().case_insensitive(case_insensitive);
        routes
            .route("/bestellung/bestätigen", Policy::default().required(true))
            .unwrap()
            .route("/v1/orders/*:cancel", Policy::default().required(true))
            .unwrap()
            .route("/orders", Policy::default().required(true))
            .unwrap()
            .route("/Übersicht/Zahlen", Policy::default().required(true))
            .unwrap()
            .route("/λόγος", Policy::default().required(true))
            .unwrap()
    };
    for path in [
        "/bestellung/best%C3%A4tigen;jsessionid=AB12",
        "/v1/orders/7%3Acancel;x=1",
        "/orders;/..",
        "/orders;x/../..",
    ] {
        for case_insensitive in [false, true] {
            let routes = routes(case_insensitive);
            let found = routes.find(&Method::POST, path);
            assert!(
                found.is_some_and(|found| found.policy().required),
                "{path} escaped its required route"
            );
        }
    }
    for path in [
        "/orders%5C",
        "/x%5C..%5Corders",
        "/bestellung/best%C3%84tigen",
        "/BESTELLUNG/BEST%C3%84TIGEN",
        "/%C3%BCbersicht/zahlen",
        // σ for the route's ς (one letter to .NET: both Σ), anywhere.
        "/%CE%BB%CF%8C%CE%B3%CE%BF%CF%83",
        "/%CE%9B%CE%8C%CE%93%CE%9F%CE%A3",
    ] {
        let (folded, exact) = (routes(true), routes(false));
        let found = folded.find(&Method::POST, path);
        assert!(
            found.is_some_and(|found| found.policy().required),
            "{path} escaped its required route"
        );
        assert!(exact.find(&Method::POST, path).is_none(), "{path}");
    }
}

/// A `Host` with userinfo (no `Host` may hold one, and hyper lets it
/// through to the layer) is not the host after the `@`: an application
/// that reads the header whole sees another tenant than `shop-b.example`.
#[test]
fn a_host_with_userinfo_is_not_the_host_after_it() {
    let uri = http::Uri::from_static("/orders");
    let scoped = |host: &'static str| {
        let mut headers = http::HeaderMap::new();
        headers.insert(http::header::HOST, http::HeaderValue::from_static(host));
        scope_host(&uri, &headers)
    };
    assert_ne!(scoped("evil@shop-b.example"), scoped("shop-b.example"));
    assert_ne!(
        scoped("evil@shop-b.example"),
        scoped("other@shop-b.example")
    );
    let absolute = http::Uri::from_static("http://evil@shop-b.example/orders");
    assert_ne!(
        scope_host(&absolute, &http::HeaderMap::new()),
        scoped("shop-b.example")
    );
}

/// Case folding for routes is .NET's, one letter at a time: `ß` is not
/// `ss` (an exclusion of `/strasse` leaves `/straße` covered), nor `İ` an
/// `i`; and a path of many front controllers is read in linear time,
/// without deep recursion.
#[test]
fn case_folding_is_per_letter_and_front_controllers_are_bounded() {
    let routes = Routes::new()
        .case_insensitive(true)
        .exclude("/strasse")
        .unwrap()
        .route("/", Policy::default().required(true))
        .unwrap();
    let found = routes.find(&Method::POST, "/stra%C3%9Fe");
    assert!(found.is_some_and(|found| found.policy().required));
    assert!(routes.find(&Method::POST, "/STRASSE").is_none());
    // Kelvin's K is not k to .NET: an exclusion of `/kiosk` leaves it covered.
    let routes = Routes::new()
        .case_insensitive(true)
        .exclude("/tenants/kiosk")
        .unwrap()
        .route("/tenants/*", Policy::default().required(true))
        .unwrap();
    let found = routes.find(&Method::POST, "/tenants/\u{212a}iosk");
    assert!(found.is_some_and(|found| found.policy().required));

    let routes = Routes::new()
        .route("/pay", Policy::default().required(true))
        .unwrap();
    let deep = format!("{}/pay", "/x.php".repeat(20_000));
    let found = routes.find(&Method::POST, &deep);
    assert!(
        found.is_some_and(|found| found.policy().required),
        "the last controller's rest"
    );
    let shallow = format!("{}/pay", "/x.php".repeat(3));
    assert!(routes.find(&Method::POST, &shallow).is_some());
}

/// Escapes are decoded once, as backends decode them: a target of nested
/// escapes (`%%35C` decodes to `%5C`, which a second pass would decode to
/// `\`), each level holding `;` and `%5C`, is read through a bounded
/// number of readings, not once per reading per level (exponential: a few
/// hundred bytes tied a worker up for good).
#[test]
fn nested_escapes_are_decoded_once() {
    // The first digit of each escape `%HH` of `s` becomes an escape of
    // itself: `%5C` is `%%35C`, which decodes to `%5C`.
    fn nest(s: &str) -> String {
        let bytes = s.as_bytes();
        let mut out = String::new();
        let mut i = 0;
        while i < bytes.len() {
            let escape = bytes[i] == b'%'
                && i + 2 < bytes.len() + 1
                && bytes.get(i + 1).is_some_and(u8::is_ascii_hexdigit)
                && bytes.get(i + 2).is_some_and(u8::is_ascii_hexdigit);
            if escape {
                out.push_str(&format!("%%{:02X}{}", bytes[i + 1], bytes[i + 2] as char));
                i += 3;
            } else {
                out.push(bytes[i] as char);
                i += 1;
            }
        }
        out
    }
    let nested = |levels: usize| {
        let mut target = String::new();
        for _ in 0..levels {
            target = nest(&target) + "%5C%3B";
        }
        format!("/x/{target}")
    };
    assert_eq!(nested(3), "/x/%%%335C%%%333B%%35C%%33B%5C%3B");
    let target = nested(20);
    for case_insensitive in [false, true] {
        let routes = Routes::new()
            .case_insensitive(case_insensitive)
            .route("/pay", Policy::default().required(true))
            .unwrap();
        assert!(routes.find(&Method::POST, &target).is_none());
    }
}

/// The rest after a PHP front controller is read as it is, already in
/// normal form, not normalised again: each pass decoded one more level of
/// nested escapes, so a target could make one more `.php/` segment per
/// pass (`/a.ph%70/a.ph%%370/…`), work growing with the square of its
/// length, per reading and per method named.
#[test]
fn the_rest_after_a_front_controller_is_not_normalised_again() {
    let routes = Routes::new()
        .route("/pay", Policy::default().required(true))
        .unwrap();
    assert!(routes.find(&Method::POST, "/a.php/pay").is_some());
    assert!(routes.find(&Method::POST, "/a.php/b.php/pay").is_some());
    let mut target = String::from("/a.php");
    for level in 1..120 {
        // `a.ph` and an escape of `p` nested `level` times.
        target.push_str("/a.ph");
        target.push_str(&"%".repeat(level));
        target.push_str(&"3".repeat(level - 1));
        target.push_str("70");
    }
    target.push_str("/x%2F;");
    assert!(routes.find(&Method::POST, &target).is_none());
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(3000))]

    /// The engine's quick path ([`has_other_readings`]) skips the search
    /// for other routes a path's readings reach; it restates the triggers
    /// of [`Routes::find_reaching`], so the two must never drift apart. A
    /// path it calls single-read reaches, over a table where every other
    /// reading lands on a different route (the catch-all `/` behind a route
    /// of the path itself), that one route alone.
    #[test]
    fn a_path_the_quick_path_reads_once_reaches_one_route(
        // `;`, `%` and `\` are always called other readings: the delicate
        // part is dots, format suffixes and front controllers.
        path in "(/([a-c]|\\.|=|php|json|index\\.php|X\\.PHP){0,4}){1,4}/?",
    ) {
        if has_other_readings(&path) {
            return Ok(());
        }
        // The route is written as patterns are (no `//`, no trailing
        // `/`), by hand rather than by the normaliser under test.
        let mut pattern = path.clone();
        while pattern.contains("//") {
            pattern = pattern.replace("//", "/");
        }
        let pattern = match pattern.trim_end_matches('/') {
            "" => "/",
            trimmed => trimmed,
        };
        let routes = Routes::new()
            .route(pattern, Policy::default().required(true))
            .and_then(|routes| routes.route("/", Policy::default()));
        let Ok(routes) = routes else {
            // Only a table whose own route hides the catch-all.
            proptest::prop_assert_eq!(pattern, "/");
            return Ok(());
        };
        let reached = Reached::default();
        routes.find_reaching(&Method::POST, &path, Some(&reached));
        let reached = reached.into_inner();
        proptest::prop_assert_eq!(reached.len(), 1, "{:?} reached {} routes", path, reached.len());
        proptest::prop_assert!(reached[0].policy().required, "{:?} missed its own route", path);
    }
}
