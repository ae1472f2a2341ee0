//! The two-tier policy's `kv_capacity_limit` live: `serve` learns each engine's KV capacity from
//! its `/metrics` (`vllm:cache_config_info` `num_gpu_blocks`), the capacity reaches the real
//! `.so` as the `kv_capacity_blocks` column, and new requests that share a cached prefix stop
//! following it to one engine once that engine's booked blocks would pass its capacity by more
//! than the cached blocks a move throws away. Without
//! the limit the same requests all go to the engine that cached the prefix. With soft session
//! affinity the same holds for a session bound to that engine: the limit releases its binding
//! once the engine is booked full. With `booking.decode: deduplicated` the shared prefix is
//! booked once per engine, so the same requests fit. The engines are the real
//! `router-host mock-engine` binary; the requests stay in flight (long streams) so that their
//! bookings add up.

mod common;

use common::engine::{client, eventually, header, post, TestRouter};
use common::mock::{Mock, WAIT};
use router_core::blocks::{BlockHasher, Tenant};
use serde_json::json;

const BLOCK: u32 = 4;
/// Each engine's KV capacity, in blocks.
const CAPACITY: u64 = 64;
/// The prefix every request shares: 8 blocks.
const SHARED: u32 = 32;

/// Engines slow enough that a stream of 20 tokens stays in flight for about 10 s. The engine
/// reserves a request's prompt and output blocks at admission (its shared prefix once): the
/// streams below (2 blocks of their own and 5 of output each) all fit in its 64.
fn mock() -> Mock {
    Mock::start(&[
        "--kv-events",
        "tcp://127.0.0.1:0",
        "--block-size",
        "4",
        "--kv-blocks",
        &CAPACITY.to_string(),
        "--step-overhead-ms",
        "500",
        "--decode-ms-per-seq",
        "0",
        "--prefill-ms-per-token",
        "0",
    ])
}

/// How the requests of [`route_in_turn`] relate.
#[derive(Clone, Copy)]
enum Sessions {
    /// Each request on its own.
    None,
    /// All of one session, with soft affinity respected: bound to where the first one went.
    One,
}

/// How the router books prompt blocks (`booking.decode`).
#[derive(Clone, Copy)]
enum Decode {
    Prompt,
    Deduplicated,
}

fn yaml(m1: &Mock, m2: &Mock, limit: Option<f64>, sessions: Sessions, decode: Decode) -> String {
    let limit = limit.map_or(String::new(), |l| format!(", kv_capacity_limit: {l}"));
    let (respect, affinity) = match sessions {
        Sessions::None => ("", ""),
        Sessions::One => (
            ", respect_soft_affinity: true",
            "session_affinity: {mode: soft, ttl_secs: 600}\n",
        ),
    };
    let decode = match decode {
        Decode::Prompt => "prompt",
        Decode::Deduplicated => "deduplicated",
    };
    let mut out = format!(
        "block_size: {BLOCK}\nbooking: {{decode: {decode}}}\nplugins:\n  - path: {}\nworker_selection:\n  aggregated: tt\n  \
         instances:\n    - name: tt\n      type: dynamo-two-tier-cost-fn\n      \
         parameters: {{load_signal: active_requests{limit}{respect}}}\n{affinity}\
         serve:\n  health:\n    interval_ms: 100\n  tokenizer: remote\nworkers:\n",
        common::plugin("two_tier_cost_fn").display()
    );
    for (id, m) in [(1, m1), (2, m2)] {
        out.push_str(&format!(
            "  - id: {id}\n    url: {}\n    kv_events:\n      endpoint: {}\n",
            m.url(""),
            m.kv_events[0]
        ));
    }
    out
}

/// The shared prefix, then `own` tokens of request `n`'s own.
fn prompt(n: u32, own: u32) -> Vec<u32> {
    (0..SHARED)
        .map(|i| 100 + i)
        .chain((0..own).map(|i| 1_000 + n * 64 + i))
        .collect()
}

/// What [`route_in_turn`] saw.
struct Routed {
    /// Per request: (worker, policy reason, session outcome).
    seen: Vec<(String, String, String)>,
    /// `router_booked_decode_blocks` per worker (1, 2) with every stream still open.
    booked: (f64, f64),
}

/// For each of `n` requests of 10 blocks (the shared 8 and 2 of their own), sent one after the
/// other while the earlier ones stream: (worker, policy reason, session outcome). The prefix is
/// cached on worker 1 first, and the router has learned both capacities.
async fn route_in_turn(
    test: &str,
    limit: Option<f64>,
    sessions: Sessions,
    decode: Decode,
    n: u32,
) -> Routed {
    let (m1, m2) = (mock(), mock());
    let router = TestRouter::start(test, &yaml(&m1, &m2, limit, sessions, decode)).await;
    m1.sync(&router, 1, 0).await;
    m2.sync(&router, 2, 0).await;
    let capacity = |id: u64| {
        router.metric(&format!(
            "router_worker_kv_capacity_blocks{{worker=\"{id}\"}}"
        ))
    };
    assert!(
        eventually(WAIT, || capacity(1) == CAPACITY as f64
            && capacity(2) == CAPACITY as f64)
        .await,
        "capacities learned: {} and {}",
        capacity(1),
        capacity(2)
    );

    // Cache the shared prefix on worker 1 alone (straight to its engine, as another router or
    // an earlier request would have), and wait until the router's index holds it.
    let http = client();
    let first = post(
        &http,
        &m1.url("/v1/completions"),
        &json!({"model": "tiny", "prompt": prompt(0, 0), "max_tokens": 1}),
    )
    .await;
    assert_eq!(first.status(), 200);
    let _ = first.bytes().await;
    let mut ids = Vec::new();
    BlockHasher::new(BLOCK, Tenant::default())
        .expect("hasher")
        .prompt_blocks(&prompt(0, 0), &mut ids);
    assert_eq!(ids.len(), (SHARED / BLOCK) as usize);
    assert!(
        eventually(WAIT, || common::engine::held_ids(&router, 1, &ids)
            == ids.len())
        .await,
        "the router's index holds the shared prefix on worker 1"
    );

    let mut seen = Vec::new();
    let mut streams = Vec::new();
    for i in 1..=n {
        let mut body = json!({"model": "tiny", "prompt": prompt(i, 2 * BLOCK), "max_tokens": 20,
                              "stream": true});
        if let Sessions::One = sessions {
            body["user"] = json!("conversation-1");
        }
        let response = post(&http, &router.url("/v1/completions"), &body).await;
        assert_eq!(response.status(), 200, "request {i}");
        seen.push((
            header(&response, "x-router-worker"),
            header(&response, "x-router-reason"),
            header(&response, "x-router-session"),
        ));
        // Kept open: its booking stays until the stream ends.
        streams.push(response);
    }
    let booked =
        |id: u64| router.metric(&format!("router_booked_decode_blocks{{worker=\"{id}\"}}"));
    let booked = (booked(1), booked(2));
    drop(streams);
    router.stop().await;
    Routed { seen, booked }
}

fn seen(worker: &str, reason: &str, session: &str) -> (String, String, String) {
    (worker.to_string(), reason.to_string(), session.to_string())
}

const CACHE: &str = "cache_tier_least_loaded_among_max_overlap";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_requests_stop_following_a_cached_prefix_onto_a_full_engine() {
    // 10 booked blocks each against 64: six fit on worker 1. The seventh would make 70, 6 over,
    // but moving it would re-prefill the 8 shared blocks worker 1 caches: it stays. The eighth
    // would be 16 over: it moves.
    let over = "cache_row_over_kv_capacity_least_loaded";
    let got = route_in_turn(
        "kv_capacity_limit",
        Some(1.0),
        Sessions::None,
        Decode::Prompt,
        8,
    )
    .await;
    let mut expected = vec![seen("1", CACHE, "-"); 7];
    expected.push(seen("2", over, "-"));
    assert_eq!(got.seen, expected);
    assert_eq!(got.booked, (70.0, 10.0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_deduplicated_booking_the_shared_prefix_counts_once_and_requests_fit() {
    // Worker 1 holds the shared 8 blocks once and 2 of each request's own: 8 + 2 x 7 = 22 of
    // 64 with all seven in flight (the engine reserves the prefix once too), so the cache tier
    // keeps every one of them there.
    let got = route_in_turn(
        "kv_capacity_dedup",
        Some(1.0),
        Sessions::None,
        Decode::Deduplicated,
        7,
    )
    .await;
    assert_eq!(got.seen, vec![seen("1", CACHE, "-"); 7]);
    assert_eq!(got.booked, (22.0, 0.0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_limit_every_request_follows_the_cached_prefix() {
    let got = route_in_turn(
        "kv_capacity_no_limit",
        None,
        Sessions::None,
        Decode::Prompt,
        7,
    )
    .await;
    assert_eq!(got.seen, vec![seen("1", CACHE, "-"); 7]);
    assert_eq!(got.booked, (70.0, 0.0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_bound_to_a_full_engine_is_released_to_one_with_room() {
    // The first request goes where the prefix is and binds the session there; the next six
    // keep the binding (the seventh is 6 blocks over worker 1's 64, fewer than the 8 cached
    // blocks a move throws away); the eighth would be 16 over, so the binding is released and
    // moves with it to worker 2.
    let got = route_in_turn(
        "kv_capacity_session",
        Some(1.0),
        Sessions::One,
        Decode::Prompt,
        8,
    )
    .await;
    let mut expected = vec![seen("1", CACHE, "created")];
    expected.extend(vec![seen("1", "soft_affinity_target", "kept"); 6]);
    expected.push(seen("2", "soft_affinity_released_kv_capacity", "moved"));
    assert_eq!(got.seen, expected);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_limit_a_bound_session_stays_on_its_full_engine() {
    let got = route_in_turn(
        "kv_capacity_session_no_limit",
        None,
        Sessions::One,
        Decode::Prompt,
        7,
    )
    .await;
    let mut expected = vec![seen("1", CACHE, "created")];
    expected.extend(vec![seen("1", "soft_affinity_target", "kept"); 6]);
    assert_eq!(got.seen, expected);
}
