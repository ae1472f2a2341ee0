//! Routing quality settings: `booking.prefill`, `booking.decode`,
//! `default_selector.overlap_credit` and
//! `default_selector.tie_break`: how they parse, how bad values are refused, and what they do to
//! real bookings, admission, decisions and a replay.

mod common;

use std::sync::Arc;

use router_host::config::{DecodeBooking, PrefillBooking, RouterConfig, TieBreak};
use router_host::host::{Host, NoOverlap, Submitted};
use router_host::kv_index::{KvEventKind, Tier};
use router_host::loader::SearchPath;
use router_host::model::{Cluster, Request, RowId, RowLoad, Worker};
use router_host::policy_set::PolicySet;
use router_host::replay::{self, prepare_text, Setup, SynthParams, EXAMPLE_CONFIGS};
use router_host::sessions::ManualClock;

fn row(worker_id: u64) -> RowId {
    RowId {
        worker_id,
        dp_rank: 0,
    }
}

fn parse(text: &str) -> RouterConfig {
    RouterConfig::from_yaml_str(text, None).unwrap_or_else(|err| panic!("{text:?}: {err}"))
}

fn rejected(text: &str) -> String {
    match RouterConfig::from_yaml_str(text, None) {
        Ok(config) => panic!("expected {text:?} to be rejected, got {config:#?}"),
        Err(err) => err.to_string(),
    }
}

fn host(yaml: &str, workers: Vec<Worker>) -> Host {
    let config = parse(yaml);
    let router = PolicySet::from_config(&config, &SearchPath::default()).expect("router starts");
    Host::with_clock(
        router,
        Cluster::new(workers).unwrap(),
        &config,
        Arc::new(ManualClock::default()),
    )
}

/// A prompt of `blocks` full 16-token blocks, ids from `first`, and `extra` more tokens.
fn prompt(first: u64, blocks: u64, extra: u64) -> Request {
    let partial = u64::from(extra > 0);
    Request {
        isl_tokens: blocks * 16 + extra,
        blocks: (first..first + blocks + partial).collect(),
        ..Default::default()
    }
}

const UNCACHED: &str = "block_size: 16\nbooking:\n  prefill: uncached\n";

// ---- configuration --------------------------------------------------------------------------

/// Dynamo's weights and booking, the host's defaults before the measured-best ones: the tests
/// below that pin the old behaviour set them explicitly.
const DYNAMO_WEIGHTS: &str = "booking: {prefill: prompt}\ndefault_selector: {prefill_load_scale: 1.0, overlap_credit: 1.0, tie_break: lowest_row}\n";

#[test]
fn new_keys_parse_and_default_to_the_measured_best_settings() {
    let defaults = parse("{}");
    assert_eq!(defaults.booking.prefill, PrefillBooking::Uncached);
    assert_eq!(defaults.booking.decode, DecodeBooking::Prompt);
    assert_eq!(defaults.default_selector.prefill_load_scale, 20.0);
    assert_eq!(defaults.default_selector.overlap_credit, 1.5);
    assert_eq!(defaults.default_selector.tie_break, TieBreak::Spread);
    // The old behaviour is one explicit config away.
    let old = parse(DYNAMO_WEIGHTS);
    assert_eq!(old.booking.prefill, PrefillBooking::Prompt);
    assert_eq!(old.booking.decode, DecodeBooking::Prompt);
    assert_eq!(old.default_selector.prefill_load_scale, 1.0);
    assert_eq!(old.default_selector.decode_active_request_weight, 0.0);
    assert_eq!(old.default_selector.overlap_credit, 1.0);
    assert_eq!(old.default_selector.tie_break, TieBreak::LowestRow);
    for empty in [
        "booking:\n",
        "booking: {prefill: ~}\n",
        "booking: {prefill: ~, decode: ~}\n",
        "default_selector: {tie_break: ~, overlap_credit: ~}\n",
    ] {
        assert_eq!(parse(empty), defaults, "{empty}");
    }
    let set = parse(
        "booking:\n  prefill: uncached\ndefault_selector:\n  overlap_credit: 1.5\n  tie_break: spread\n",
    );
    assert_eq!(set.booking.prefill, PrefillBooking::Uncached);
    assert_eq!(set.default_selector.overlap_credit, 1.5);
    assert_eq!(set.default_selector.tie_break, TieBreak::Spread);
    assert_eq!(set.default_selector.prefill_load_scale, 20.0);
    assert_eq!(
        parse("booking: {prefill: prompt}\n").booking.prefill,
        PrefillBooking::Prompt
    );
    let decode = parse("booking:\n  decode: deduplicated\n").booking;
    assert_eq!(decode.decode, DecodeBooking::Deduplicated);
    assert_eq!(decode.prefill, PrefillBooking::Uncached);
    assert_eq!(
        parse("booking: {decode: prompt}\n").booking.decode,
        DecodeBooking::Prompt
    );
}

#[test]
fn bad_values_name_the_key_and_the_line() {
    for (text, expected) in [
        (
            "block_size: 16\nbooking:\n  prefill: full\n",
            "line 3 column 12: booking.prefill: unknown variant `full`, expected `prompt` or `uncached`",
        ),
        (
            "booking:\n  prefill: [uncached]\n",
            "line 2 column 12: booking.prefill: invalid type: sequence, expected `prompt` or `uncached`",
        ),
        (
            "booking:\n  prefil: uncached\n",
            "line 2 column 3: booking: unknown field `prefil`, expected `prefill` or `decode`",
        ),
        (
            "booking:\n  prefill: uncached\n  decode: distinct\n",
            "line 3 column 11: booking.decode: unknown variant `distinct`, expected `prompt` or `deduplicated`",
        ),
        (
            "booking:\n  decode: {deduplicated: true}\n",
            "line 2 column 11: booking.decode: invalid type: map, expected `prompt` or `deduplicated`",
        ),
        (
            "booking: uncached\n",
            "line 1 column 10: booking: invalid type: string \"uncached\", expected a `booking` mapping",
        ),
        (
            "default_selector:\n  tie_break: random\n",
            "line 2 column 14: default_selector.tie_break: unknown variant `random`, expected `lowest_row` or `spread`",
        ),
        (
            "default_selector:\n  overlap_credit: -1\n",
            "line 2 column 19: default_selector.overlap_credit: ",
        ),
        (
            "default_selector:\n  overlap_credit: .nan\n",
            "line 2 column 19: default_selector.overlap_credit: ",
        ),
    ] {
        let message = rejected(text);
        assert!(
            message.contains(expected),
            "{text:?}:\n  expected {expected:?}\n  in {message}"
        );
    }
    // The numeric errors say what is accepted, like every other weight.
    for text in [
        "default_selector:\n  overlap_credit: -1\n",
        "default_selector:\n  overlap_credit: .inf\n",
    ] {
        assert!(
            rejected(text).contains("expected a finite number >= 0"),
            "{}",
            rejected(text)
        );
    }
}

#[test]
fn instance_parameters_are_checked_at_startup_by_key() {
    for (parameters, expected) in [
        (
            "{tie_break: sometimes}",
            "parameter `tie_break`: unknown variant `sometimes`, expected `lowest_row` or `spread`",
        ),
        ("{overlap_credit: -2}", "parameter `overlap_credit`"),
    ] {
        let config = parse(&format!(
            "worker_selection:\n  aggregated: d\n  instances:\n    - {{name: d, type: default, parameters: {parameters}}}\n"
        ));
        let err = PolicySet::from_config(&config, &SearchPath::default())
            .expect_err("bad parameters fail at startup");
        let message = format!("{err:#}");
        assert!(
            message.contains("instance `d`") && message.contains(expected),
            "{message}"
        );
    }
}

// ---- booking --------------------------------------------------------------------------------

#[test]
fn uncached_booking_books_only_what_the_row_computes() {
    // Worker 1 holds the first 6 blocks of a 10-block prompt (plus 4 tokens in a partial block).
    let request = prompt(100, 10, 4);
    for (yaml, expected) in [
        ("block_size: 16\n", 164 - 6 * 16),
        ("block_size: 16\nbooking: {prefill: prompt}\n", 164),
        (UNCACHED, 164 - 6 * 16),
    ] {
        let host = host(yaml, vec![Worker::new(1)]);
        let core = host.core();
        core.apply_kv_events(
            row(1),
            (100..106).map(|b| (KvEventKind::Stored, Tier::Device, b)),
        );
        let routed = core.route_indexed(&request, false).unwrap();
        assert_eq!(
            core.booked(row(1)),
            RowLoad {
                available: true,
                active_requests: 1,
                active_prefill_tokens: expected,
                decode_blocks: 11,
            },
            "{yaml}"
        );
        // Prefill completion releases exactly what was booked, completion the rest.
        core.prefill_complete(routed.id);
        assert_eq!(core.booked(row(1)).active_prefill_tokens, 0);
        assert_eq!(core.booked(row(1)).decode_blocks, 11);
        assert!(core.complete(routed.id));
        assert_eq!(core.booked(row(1)), RowLoad::default());
    }
}

#[test]
fn deduplicated_decode_booking_counts_each_block_once_per_row() {
    let yaml = "block_size: 16\nbooking: {decode: deduplicated}\n";
    let host = host(yaml, vec![Worker::new(1).with_ranks(0, 2)]);
    let core = host.core();
    let rank = |dp_rank| RowId {
        worker_id: 1,
        dp_rank,
    };
    let decode = |r| core.booked(r).decode_blocks;
    // A 10-block prompt whose 11th block is partial: 11 ids.
    let first = Request {
        pinned_worker: Some(rank(0)),
        ..prompt(100, 10, 4)
    };
    let a = core.route_indexed(&first, false).unwrap().id;
    assert_eq!(decode(rank(0)), 11);
    // The same first 8 blocks, then 4 of its own: 4 more on the row.
    let shared = Request {
        pinned_worker: Some(rank(0)),
        blocks: (100..108).chain(500..504).collect(),
        isl_tokens: 12 * 16,
        ..Request::default()
    };
    let b = core.route_indexed(&shared, false).unwrap().id;
    assert_eq!(decode(rank(0)), 15);
    // Another rank holds its own copy.
    let elsewhere = Request {
        pinned_worker: Some(rank(1)),
        ..shared.clone()
    };
    let c = core.route_indexed(&elsewhere, false).unwrap().id;
    assert_eq!(decode(rank(1)), 12);
    // Without ids every block is its own (as in `prompt` mode); a request naming fewer blocks
    // than its prompt has books the rest as its own too.
    let anonymous = Request {
        pinned_worker: Some(rank(0)),
        isl_tokens: 5 * 16,
        ..Request::default()
    };
    let d = core.route_indexed(&anonymous, false).unwrap().id;
    assert_eq!(decode(rank(0)), 20);
    let partly = Request {
        pinned_worker: Some(rank(0)),
        blocks: vec![100, 101],
        isl_tokens: 6 * 16,
        ..Request::default()
    };
    let e = core.route_indexed(&partly, false).unwrap().id;
    assert_eq!(decode(rank(0)), 24);
    // Blocks held on the two ranks, and the requests holding them (d names none).
    assert_eq!(core.held_blocks(), (15 + 12, 4));
    // Releases: a block goes with the last request holding it, whatever the order.
    assert!(core.complete(a));
    assert_eq!(decode(rank(0)), 24 - 3, "blocks 108..111 were a's alone");
    assert!(core.complete(e));
    assert_eq!(
        decode(rank(0)),
        21 - 4,
        "e's own 4; 100 and 101 are still b's"
    );
    core.finish(d, plugin_api::abi::CompletionCode::FAILED);
    assert_eq!(decode(rank(0)), 12);
    assert!(core.complete(b));
    assert!(core.complete(c));
    assert_eq!(core.booked(rank(0)), RowLoad::default());
    assert_eq!(core.booked(rank(1)), RowLoad::default());
    assert_eq!(core.held_blocks(), (0, 0));
    // The default mode books every request's whole prompt.
    let host = self::host("block_size: 16\n", vec![Worker::new(1)]);
    let core = host.core();
    core.route_indexed(&prompt(100, 10, 4), false).unwrap();
    core.route_indexed(&prompt(100, 10, 4), false).unwrap();
    assert_eq!(core.booked(row(1)).decode_blocks, 22);
    assert_eq!(core.held_blocks(), (0, 0));
}

#[test]
fn a_removed_workers_held_blocks_go_with_it() {
    let yaml = "block_size: 16\nbooking: {decode: deduplicated}\n";
    let host = host(yaml, vec![Worker::new(1), Worker::new(2)]);
    let core = host.core();
    let on = |w: u64| Request {
        pinned_worker: Some(row(w)),
        ..prompt(0, 4, 0)
    };
    core.route_indexed(&on(1), false).unwrap();
    let kept = core.route_indexed(&on(2), false).unwrap().id;
    assert_eq!(core.held_blocks(), (8, 2));
    core.remove_worker(1).unwrap();
    assert_eq!(core.held_blocks(), (4, 1));
    // A worker joining later on the freed slot starts from nothing.
    core.add_worker(Worker::new(3)).unwrap();
    core.route_indexed(&on(3), false).unwrap();
    assert_eq!(core.booked(row(3)).decode_blocks, 4);
    assert!(core.complete(kept));
    assert_eq!(core.booked(row(2)), RowLoad::default());
}

#[test]
fn uncached_booking_reads_the_chosen_rows_overlap_not_the_best_one() {
    // Worker 2 holds the whole prompt, worker 1 two blocks; the request is pinned to worker 1.
    let host = host(UNCACHED, vec![Worker::new(1), Worker::new(2)]);
    let core = host.core();
    core.apply_kv_events(
        row(2),
        (0..8).map(|b| (KvEventKind::Stored, Tier::Device, b)),
    );
    core.apply_kv_events(
        row(1),
        (0..2).map(|b| (KvEventKind::Stored, Tier::Device, b)),
    );
    let pinned = Request {
        pinned_worker: Some(row(1)),
        ..prompt(0, 8, 0)
    };
    core.route_indexed(&pinned, false).unwrap();
    assert_eq!(core.booked(row(1)).active_prefill_tokens, 6 * 16);
    // Fully cached, including the partial last block: nothing to prefill is booked.
    let whole = prompt(0, 8, 0);
    let routed = core.route_indexed(&whole, false).unwrap();
    assert_eq!(routed.decision.row, row(2));
    assert_eq!(core.booked(row(2)).active_prefill_tokens, 0);
    assert_eq!(core.booked(row(2)).active_requests, 1);
    // A caller's overlap source that knows nothing: the whole prompt.
    core.route(&prompt(50, 3, 0), &NoOverlap, false).unwrap();
    assert_eq!(
        core.booked(row(1)).active_prefill_tokens + core.booked(row(2)).active_prefill_tokens,
        6 * 16 + 3 * 16
    );
}

#[test]
fn admission_busy_checks_see_the_uncached_backlog() {
    // One worker and a class that counts it busy past 100 pending prefill tokens. A long prompt
    // the worker caches entirely is not a backlog under uncached booking.
    let class = "policy_classes:\n  - {name: default, prefill_busy_threshold: 100}\n";
    for (booking, second_waits) in [
        ("booking: {prefill: prompt}\n", true),
        ("booking: {prefill: uncached}\n", false),
        ("", false),
    ] {
        let host = host(
            &format!("block_size: 16\n{booking}{class}"),
            vec![Worker::new(1)],
        );
        let core = host.core();
        core.apply_kv_events(
            row(1),
            (0..64).map(|b| (KvEventKind::Stored, Tier::Device, b)),
        );
        let first = core.submit_indexed(prompt(0, 64, 0), false).unwrap();
        assert!(matches!(first, Submitted::Dispatched(_)), "{booking}");
        let second = core.submit_indexed(prompt(1000, 2, 0), false).unwrap();
        assert_eq!(
            matches!(second, Submitted::Queued(_)),
            second_waits,
            "{booking:?}: {second:?}"
        );
    }
}

// ---- decisions ------------------------------------------------------------------------------

/// Workers 1 to 4, idle and cold; 80 requests of different lengths, each completed before the
/// next: requests per worker.
fn idle_spread(yaml: &str) -> [u32; 4] {
    let host = host(yaml, (1..=4).map(Worker::new).collect());
    let core = host.core();
    let mut per_worker = [0u32; 4];
    for n in 1..=80u64 {
        let routed = core.route(&prompt(n * 1000, n % 7 + 1, n % 5), &NoOverlap, false);
        let routed = routed.unwrap();
        per_worker[(routed.decision.row.worker_id - 1) as usize] += 1;
        core.complete(routed.id);
    }
    per_worker
}

#[test]
fn spread_shares_ties_between_idle_workers_where_lowest_row_takes_them_all() {
    assert_eq!(
        idle_spread("block_size: 16\ndefault_selector: {tie_break: lowest_row}\n"),
        [80, 0, 0, 0]
    );
    for yaml in [
        "block_size: 16\n",
        "block_size: 16\ndefault_selector: {tie_break: spread}\n",
        "block_size: 16\nworker_selection:\n  aggregated: d\n  instances:\n    - {name: d, type: default, parameters: {tie_break: spread}}\n",
    ] {
        let spread = idle_spread(yaml);
        assert!(spread.iter().all(|&n| (8..=32).contains(&n)), "{yaml}: {spread:?}");
        // Deterministic: the same requests break the same way.
        assert_eq!(idle_spread(yaml), spread);
    }
}

#[test]
fn overlap_credit_keeps_a_cached_prompt_on_its_worker_under_load() {
    // Worker 2 caches 8 of 10 blocks and has 9 blocks of prefill (and 9 decode blocks)
    // booked; worker 1 is cold and idle: 20 * 10 = 200. Credit 1.0: 20 * (9 + 2) + 9 = 229, the
    // cold worker; credit 1.5: 20 * (11 - 4) + 9 = 149, the cache.
    for (credit, expected) in [("1.0", 1), ("1.5", 2)] {
        let host = host(
            &format!(
                "{UNCACHED}default_selector: {{prefill_load_scale: 20, overlap_credit: {credit}}}\n"
            ),
            vec![Worker::new(1), Worker::new(2)],
        );
        let core = host.core();
        core.apply_kv_events(
            row(2),
            (0..8).map(|b| (KvEventKind::Stored, Tier::Device, b)),
        );
        // The backlog: a cold 9-block prompt pinned to worker 2.
        let backlog = Request {
            pinned_worker: Some(row(2)),
            ..prompt(500, 9, 0)
        };
        core.route_indexed(&backlog, false).unwrap();
        let routed = core.route_indexed(&prompt(0, 10, 0), true).unwrap();
        assert_eq!(routed.decision.row, row(expected), "credit {credit}");
    }
}

// ---- replay ---------------------------------------------------------------------------------

/// The shipped `examples/replay/default.yaml` is the host's defaults: a config that sets nothing
/// (what the README's `serve` configs amount to) replays exactly as its column does, and both
/// beat Dynamo's weights (the defaults before) on the built-in multi-turn workload: more reuse
/// and lower tail latency.
#[test]
fn shipped_default_config_is_the_host_defaults_and_beats_dynamos_weights() {
    let workload = replay::synth::generate(&SynthParams::default());
    let setup = Setup::new(4, 1);
    let (label, shipped) = EXAMPLE_CONFIGS[0];
    assert_eq!(label, "examples/replay/default.yaml");
    let configs = [
        prepare_text("dynamo-weights", DYNAMO_WEIGHTS, &setup, 512).unwrap(),
        prepare_text(label, shipped, &setup, 512).unwrap(),
        prepare_text("bare", "block_size: 16\n", &setup, 512).unwrap(),
    ];
    let report = replay::replay(&workload, setup.shape, &configs, &mut |_, _| {}).unwrap();
    let (old, new, bare) = (&report.configs[0], &report.configs[1], &report.configs[2]);
    assert_eq!(
        (bare.hit_rate, bare.ttft_ms.p99, &bare.requests_per_worker),
        (new.hit_rate, new.ttft_ms.p99, &new.requests_per_worker),
        "a bare config is the default column"
    );
    assert_eq!((old.errors, new.errors), (0, 0));
    assert!(
        new.hit_rate > old.hit_rate + 0.05,
        "hit rate {} vs {}",
        new.hit_rate,
        old.hit_rate
    );
    assert!(new.prefill_tokens < old.prefill_tokens);
    for (name, n, o) in [
        ("p90", new.ttft_ms.p90, old.ttft_ms.p90),
        ("p99", new.ttft_ms.p99, old.ttft_ms.p99),
    ] {
        assert!(n < o, "TTFT {name} {n} vs {o}");
    }
    // Spread ties keep the load even.
    assert!(new.load_imbalance < 1.1, "{}", new.load_imbalance);
}
