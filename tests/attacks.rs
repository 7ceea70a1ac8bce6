//! The guarantee under attack, through the tower layer: request sequences
//! that once broke "executes once" or isolation (issue "Guarantee holes"),
//! each answered here the way a user of the layer would notice it.

mod support;

use http::{Method, StatusCode};
use tower_idempotency::fingerprint::{fingerprint, Exclusions};
use tower_idempotency::Policy;

use support::{post_json, Harness};

// ---------------------------------------------------------------------------
// Hole 1: escaped duplicate JSON keys

/// `{"amount":10,"\u0061mount":1000}` charges 1000 with a last-wins parser,
/// the reordered body 10: the second must never get the first's answer.
#[tokio::test]
async fn escaped_duplicate_keys_are_a_different_request() {
    let h = Harness::new(Policy::default());
    let first = h
        .send(post_json(b"pay-1", r#"{"amount":10,"\u0061mount":1000}"#))
        .await;
    assert_eq!(first.status, StatusCode::CREATED);
    let second = h
        .send(post_json(b"pay-1", r#"{"\u0061mount":1000,"amount":10}"#))
        .await;
    second.assert_problem(StatusCode::UNPROCESSABLE_ENTITY, "key-mismatch");
    assert_eq!(h.calls(), 1);
    // The same body again is still a replay.
    let again = h
        .send(post_json(b"pay-1", r#"{"amount":10,"\u0061mount":1000}"#))
        .await;
    assert!(again.replayed());
    assert_eq!(again.body, first.body);
}

mod oracle {
    //! The fingerprint against serde_json, not against another copy of the
    //! canonicaliser: two bodies a last-wins parser reads differently never
    //! share a fingerprint.
    use super::*;
    use proptest::prelude::*;

    /// Keys whose spellings collide once decoded.
    fn key() -> impl Strategy<Value = &'static str> {
        prop::sample::select(vec![
            "a",
            "\\u0061",
            "\\u0041",
            "A",
            "ab",
            "a\\u0062",
            "\\u0061b",
            "é",
            "\\u00e9",
            "\\u00E9",
            "\\ud83d\\ude00",
            "😀",
            "\\/",
            "/",
            "\\\\",
            "",
        ])
    }

    fn value() -> impl Strategy<Value = String> {
        let leaf = prop_oneof![
            (0..3u8).prop_map(|n| n.to_string()),
            Just("\"x\"".to_owned()),
            Just("null".to_owned()),
        ];
        leaf.prop_recursive(3, 24, 4, |inner| {
            prop::collection::vec((key(), inner), 0..5).prop_map(|members| {
                let members: Vec<String> = members
                    .iter()
                    .map(|(k, v)| format!("\"{k}\":{v}"))
                    .collect();
                format!("{{{}}}", members.join(","))
            })
        })
    }

    /// An object and a reordering of its members (`order` picks which
    /// member goes next).
    fn object_and_shuffle() -> impl Strategy<Value = (String, String)> {
        (
            prop::collection::vec((key(), value()), 0..6),
            prop::collection::vec(any::<prop::sample::Index>(), 6),
        )
            .prop_map(|(members, order)| {
                let write = |members: &[(&str, String)]| {
                    let members: Vec<String> = members
                        .iter()
                        .map(|(k, v)| format!("\"{k}\":{v}"))
                        .collect();
                    format!("{{{}}}", members.join(","))
                };
                let mut rest = members.clone();
                let mut shuffled = Vec::new();
                for index in &order {
                    if rest.is_empty() {
                        break;
                    }
                    shuffled.push(rest.remove(index.index(rest.len())));
                }
                (write(&members), write(&shuffled))
            })
    }

    fn fp(body: &str) -> tower_idempotency::store::Fingerprint {
        let mut headers = http::HeaderMap::new();
        headers.insert(
            http::header::CONTENT_TYPE,
            "application/json".parse().unwrap(),
        );
        fingerprint(
            &Method::POST,
            &"/pay".parse().unwrap(),
            &headers,
            &[],
            body.as_bytes(),
            Exclusions::default(),
        )
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(3000))]

        #[test]
        fn bodies_read_differently_never_share_a_fingerprint(
            (a, b) in object_and_shuffle()
        ) {
            let parsed_a: serde_json::Value = serde_json::from_str(&a).unwrap();
            let parsed_b: serde_json::Value = serde_json::from_str(&b).unwrap();
            if parsed_a != parsed_b {
                prop_assert_ne!(fp(&a), fp(&b), "{} / {}", a, b);
            }
        }
    }

    /// Reordering members with different keys keeps the fingerprint (the
    /// canonical form still sorts), escaped or not.
    #[test]
    fn reordering_distinct_keys_keeps_the_fingerprint() {
        assert_eq!(fp(r#"{"b":1,"\u0061":2}"#), fp(r#"{"\u0061":2,"b":1}"#));
        assert_eq!(fp(r#"{"b":1,"a":2}"#), fp(r#"{"a":2,"b":1}"#));
    }
}
