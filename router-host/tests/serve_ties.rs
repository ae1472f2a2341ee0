//! Ties behind `serve`: two idle, equal engines (answers at once, nothing cached) share the
//! requests under the default `tie_break: spread`, for the built-in `default` and for the
//! two-tier plugin, and `lowest_row` sends every one to the lowest worker. What went where is
//! counted per row in `router_dispatches_total`, which an operator can alert on.

mod common;

use common::engine::{client, header, post, workers_yaml, Engine, TestRouter};
use serde_json::json;

const REQUESTS: usize = 60;

/// `REQUESTS` completions in a row, of different lengths, each answered before the next:
/// every one finds both engines idle. Returns the requests per worker (1, 2) from the decision
/// headers, checked against the router's per-row dispatch counter.
async fn split(test: &str, selection: &str) -> [usize; 2] {
    let (e1, e2) = (Engine::start(1).await, Engine::start(2).await);
    let yaml = format!("block_size: 4\n{selection}{}", workers_yaml(&[&e1, &e2]));
    let router = TestRouter::start(test, &yaml).await;
    let http = client();
    let mut split = [0, 0];
    for i in 0..REQUESTS {
        let prompt = "word ".repeat(i + 1);
        let response = post(
            &http,
            &router.url("/v1/completions"),
            &json!({"model": "tiny", "prompt": prompt, "max_tokens": 2}),
        )
        .await;
        assert_eq!(response.status(), 200, "request {i}");
        let worker = header(&response, "x-router-worker");
        let _ = response.bytes().await;
        match worker.as_str() {
            "1" => split[0] += 1,
            "2" => split[1] += 1,
            other => panic!("request {i} went to worker {other:?}"),
        }
    }
    for (w, n) in [(1, split[0]), (2, split[1])] {
        assert_eq!(
            router.metric(&format!(
                "router_dispatches_total{{worker=\"{w}\",dp_rank=\"0\"}}"
            )),
            n as f64,
            "{test}: worker {w}"
        );
    }
    router.stop().await;
    split
}

fn even(split: [usize; 2]) -> bool {
    // 30 expected on each; outside 15..=45 the draw would be broken, not unlucky.
    split.iter().all(|&n| (15..=45).contains(&n))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_default_spreads_idle_equal_engines_and_lowest_row_piles_on_the_first() {
    let spread = split("ties_default_spread", "").await;
    assert!(even(spread), "{spread:?}");
    let lowest = split(
        "ties_default_lowest",
        "default_selector: {tie_break: lowest_row}\n",
    )
    .await;
    assert_eq!(lowest, [REQUESTS, 0]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_tier_spreads_idle_equal_engines_and_lowest_row_piles_on_the_first() {
    let two_tier = |parameters: &str| {
        format!(
            "plugins:\n  - path: {}\nworker_selection:\n  aggregated: tt\n  instances:\n    \
             - {{name: tt, type: dynamo-two-tier-cost-fn, parameters: {parameters}}}\n",
            common::plugin("two_tier_cost_fn").display()
        )
    };
    let spread = split("ties_two_tier_spread", &two_tier("{}")).await;
    assert!(even(spread), "{spread:?}");
    let lowest = split("ties_two_tier_lowest", &two_tier("{tie_break: lowest_row}")).await;
    assert_eq!(lowest, [REQUESTS, 0]);
}
