//! Shared by the benches: deterministic, realistic JSON request bodies.

#![allow(dead_code)]

/// A tiny deterministic generator (xorshift64*), so every run hashes the
/// same bytes.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed.max(1))
    }

    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    fn word(&mut self, out: &mut String) {
        const WORDS: [&str; 12] = [
            "alpha", "bravo", "delta", "échelon", "harbour", "kilo", "lima", "oscar", "quartz",
            "sierra", "tango", "zulu",
        ];
        out.push_str(WORDS[self.below(WORDS.len() as u64) as usize]);
    }
}

/// One order as an API client would send it: members deliberately not in
/// sorted order, nested objects and arrays, strings (one with escapes),
/// integers and decimals, pretty-printed like many clients do.
fn order(rng: &mut Rng, out: &mut String) {
    use std::fmt::Write;
    let id = rng.next();
    write!(
        out,
        "{{\n  \"order_id\": \"ord_{id:016x}\",\n  \"customer\": {{\n    \"name\": \""
    )
    .unwrap();
    rng.word(out);
    out.push(' ');
    rng.word(out);
    write!(
        out,
        "\",\n    \"email\": \"user{}@example.com\",\n    \"address\": {{\"street\": \"{} ",
        rng.below(100_000),
        rng.below(999) + 1
    )
    .unwrap();
    rng.word(out);
    out.push_str(" Road\", \"city\": \"");
    rng.word(out);
    out.push_str("\", \"zip\": \"");
    write!(
        out,
        "{:05}\", \"country\": \"DE\"}}\n  }},\n  \"items\": [",
        rng.below(100_000)
    )
    .unwrap();
    let items = 1 + rng.below(4);
    for i in 0..items {
        if i > 0 {
            out.push_str(", ");
        }
        write!(
            out,
            "{{\"sku\": \"SKU-{:06}\", \"quantity\": {}, \"unit_price\": {}.{:02}, \"tags\": [\"",
            rng.below(1_000_000),
            1 + rng.below(9),
            rng.below(500),
            rng.below(100)
        )
        .unwrap();
        rng.word(out);
        out.push_str("\", \"");
        rng.word(out);
        out.push_str("\"]}");
    }
    write!(
        out,
        "],\n  \"total\": {}.{:02},\n  \"currency\": \"EUR\",\n  \"gift\": {},\n  \"coupon\": null,\n  \"note\": \"please ring \\\"twice\\\"\\n\"\n}}",
        rng.below(5_000),
        rng.below(100),
        rng.below(2) == 1
    )
    .unwrap();
}

/// A JSON document of at most `target` bytes (and close to it): an object
/// with metadata and an array of orders.
pub fn json_body(target: usize, seed: u64) -> Vec<u8> {
    let mut rng = Rng::new(seed);
    let head = "{\"source\": \"bench\", \"orders\": [";
    let tail = "], \"memo\": \"\", \"sent_at\": \"2026-11-29T18:00:00Z\", \"version\": 3}";
    let mut body = String::from(head);
    let mut next = String::new();
    let mut first = true;
    loop {
        next.clear();
        if !first {
            next.push_str(", ");
        }
        order(&mut rng, &mut next);
        if body.len() + next.len() + tail.len() > target {
            break;
        }
        body.push_str(&next);
        first = false;
    }
    // Fill the memo so the document is exactly `target` bytes.
    let (before, after) = tail.split_at(tail.find("\"\"").unwrap() + 1);
    body.push_str(before);
    let memo = "thanks for the quick delivery last time ";
    let mut filler = memo.bytes().cycle();
    while body.len() + after.len() < target {
        body.push(char::from(filler.next().unwrap()));
    }
    body.push_str(after);
    body.into_bytes()
}

/// The CPU time this thread has used. Other processes competing for the
/// cores (a loaded CI machine, parallel builds) do not inflate it, unlike
/// wall time.
pub fn thread_cpu_time() -> std::time::Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; the clock id is a
    // constant every Linux kernel supports.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime(CLOCK_THREAD_CPUTIME_ID) failed");
    std::time::Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// A criterion measurement of the bench thread's CPU time (see
/// [`thread_cpu_time`]), shown and analysed exactly like wall time.
pub struct CpuTime;

impl criterion::measurement::Measurement for CpuTime {
    type Intermediate = std::time::Duration;
    type Value = std::time::Duration;

    fn start(&self) -> Self::Intermediate {
        thread_cpu_time()
    }
    fn end(&self, started: Self::Intermediate) -> Self::Value {
        thread_cpu_time() - started
    }
    fn add(&self, a: &Self::Value, b: &Self::Value) -> Self::Value {
        *a + *b
    }
    fn zero(&self) -> Self::Value {
        std::time::Duration::ZERO
    }
    fn to_f64(&self, value: &Self::Value) -> f64 {
        value.as_nanos() as f64
    }
    fn formatter(&self) -> &dyn criterion::measurement::ValueFormatter {
        static WALL: criterion::measurement::WallTime = criterion::measurement::WallTime;
        criterion::measurement::Measurement::formatter(&WALL)
    }
}

/// Criterion measuring [`CpuTime`].
pub fn criterion() -> criterion::Criterion<CpuTime> {
    criterion::Criterion::default().with_measurement(CpuTime)
}
