//! Decoding stored records (as a store or Redis hands them back, possibly
//! corrupt): never a panic, and whatever decodes re-encodes to the same
//! value.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tower_idempotency::store::{Outcome, StoredResponse};

fuzz_target!(|data: &[u8]| {
    if let Ok(outcome) = Outcome::decode(data) {
        assert_eq!(Outcome::decode(&outcome.encode()).unwrap(), outcome);
    }
    if let Ok(headers) = StoredResponse::decode_headers(data) {
        let response = StoredResponse {
            status: http::StatusCode::OK,
            headers,
            body: Default::default(),
        };
        let again = StoredResponse::decode_headers(&response.encode_headers()).unwrap();
        assert_eq!(again, response.headers);
    }
});
