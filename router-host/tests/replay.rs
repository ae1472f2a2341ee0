//! `router-host replay`: real outcomes through the real host, the real `.so` policies and the
//! simulated engines.

mod common;

use std::path::{Path, PathBuf};

use common::{plugin, plugin_dir, run_cli, temp_dir, write};
use router_host::replay::{
    self, prepare_file, KvCapacity, Report, RunConfig, Setup, SynthParams, Workload,
};

/// A config file using the two-tier plugin by path.
fn two_tier(dir: &Path, name: &str, extra: &str) -> PathBuf {
    write(
        dir,
        name,
        &format!(
            "plugins:\n  - path: {}\nworker_selection:\n  aggregated: t\n  instances:\n    - name: t\n      type: dynamo-two-tier-cost-fn\n{extra}",
            plugin("two_tier_cost_fn").display()
        ),
    )
}

fn round_robin(dir: &Path) -> PathBuf {
    write(
        dir,
        "round-robin.yaml",
        "worker_selection:\n  aggregated: rr\n  instances:\n    - {name: rr, type: round-robin}\n",
    )
}

fn run(workload: &Workload, setup: &Setup, configs: &[PathBuf]) -> Report {
    let prepared: Vec<RunConfig> = configs
        .iter()
        .map(|c| prepare_file(c, setup, workload.block_size).unwrap())
        .collect();
    replay::replay(workload, setup.shape, &prepared, &mut |_, _| {}).unwrap()
}

fn unlimited_one_worker() -> Setup {
    let mut setup = Setup::new(1, 1);
    setup.engine.kv_blocks = Some(KvCapacity::Unlimited);
    setup
}

/// Every request arrives an hour after the previous one: long after it finished.
fn spread_out(workload: &mut Workload) {
    for (i, r) in workload.requests.iter_mut().enumerate() {
        r.arrival_ns = i as u64 * 3_600_000_000_000;
    }
}

fn shared_trace() -> Option<PathBuf> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../shared/traces/mooncake_conversation/conversation_trace.jsonl");
    if path.is_file() {
        Some(path)
    } else {
        println!(
            "note: {} is absent; skipping the shared-trace part of this test",
            path.display()
        );
        None
    }
}

fn first_lines(path: &Path, n: usize) -> Workload {
    let text = std::fs::read_to_string(path).unwrap();
    let head: String = text.lines().take(n).flat_map(|l| [l, "\n"]).collect();
    Workload::from_jsonl_reader(head.as_bytes(), "head", 512).unwrap()
}

#[test]
fn one_worker_unlimited_kv_reuses_exactly_the_ideal_bound_when_requests_do_not_overlap() {
    let dir = temp_dir("replay-ideal");
    let config = two_tier(&dir, "two-tier.yaml", "");
    // Block size 4. Shared prefixes, a partial last block, an exact repeat, a non-leading repeat
    // (block 7 seen before but behind a new block: not reusable), a request reusing nothing.
    let trace = write(
        &dir,
        "hand.jsonl",
        r#"{"timestamp": 0, "input_length": 10, "output_length": 3, "hash_ids": [1, 2, 3]}
{"timestamp": 1, "input_length": 16, "output_length": 2, "hash_ids": [1, 2, 4, 5]}
{"timestamp": 2, "input_length": 10, "output_length": 1, "hash_ids": [1, 2, 3]}
{"timestamp": 3, "input_length": 8, "output_length": 5, "hash_ids": [6, 7]}
{"timestamp": 4, "input_length": 12, "output_length": 1, "hash_ids": [8, 7, 3]}
{"timestamp": 5, "input_length": 20, "output_length": 4, "hash_ids": [1, 2, 4, 5, 9]}
{"timestamp": 6, "input_length": 4, "output_length": 1, "hash_ids": [10]}
"#,
    );
    let mut workload = Workload::from_jsonl_file(&trace, 4).unwrap();
    spread_out(&mut workload);
    let stats = workload.stats();
    // 0 + 2 + 3 + 0 + 0 + 4 + 0 of 3 + 4 + 3 + 2 + 3 + 5 + 1.
    assert_eq!((stats.reusable_blocks, stats.prompt_blocks), (9, 21));
    let report = run(
        &workload,
        &unlimited_one_worker(),
        std::slice::from_ref(&config),
    );
    let c = &report.configs[0];
    assert_eq!(c.errors, 0);
    assert_eq!(c.requests_completed, 7);
    assert_eq!((c.hit_blocks, c.prompt_blocks), (9, 21));
    assert_eq!(c.hit_rate, report.workload.ideal_hit_rate);
    // Dispatch/complete accounting: every request booked on the one worker.
    assert_eq!(c.requests_per_worker, vec![7]);
    // One engine serving one request at a time is what the pooled-LRU reference assumes.
    assert_eq!(c.pooled_lru_reference.hit_rate, c.hit_rate);
    assert_eq!(c.pooled_lru_reference.ttft_ms, c.ttft_ms);

    let Some(path) = shared_trace() else {
        return;
    };
    let mut workload = first_lines(&path, 2000);
    spread_out(&mut workload);
    let stats = workload.stats();
    let report = run(&workload, &unlimited_one_worker(), &[config]);
    let c = &report.configs[0];
    assert_eq!(c.requests_completed, 2000);
    assert_eq!(
        (c.hit_blocks, c.prompt_blocks),
        (stats.reusable_blocks, stats.prompt_blocks)
    );
    assert_eq!(c.hit_rate, report.workload.ideal_hit_rate);
    assert_eq!(c.pooled_lru_reference.ttft_ms, c.ttft_ms);
}

#[test]
fn one_worker_unlimited_kv_comes_within_two_percent_of_the_bound_on_the_trace_as_recorded() {
    let Some(path) = shared_trace() else {
        return;
    };
    let dir = temp_dir("replay-recorded");
    let config = two_tier(&dir, "two-tier.yaml", "");
    let workload = Workload::from_jsonl_file(&path, 512).unwrap();
    assert_eq!(workload.requests.len(), 12_031);
    let report = run(&workload, &unlimited_one_worker(), &[config]);
    let ideal = report.workload.ideal_hit_rate;
    assert!((ideal - 0.3664).abs() < 5e-5, "{ideal}");
    let c = &report.configs[0];
    assert_eq!(c.errors, 0);
    assert!(
        (c.hit_rate - ideal).abs() <= 0.02 * ideal,
        "hit rate {} vs ideal {ideal}",
        c.hit_rate
    );
}

fn repeated_prefixes(seed: u64) -> Workload {
    replay::synth::generate(&SynthParams {
        sessions: 80,
        turns: 4,
        rate: 8.0,
        seed,
        ..SynthParams::default()
    })
}

#[test]
fn round_robin_reuses_less_than_two_tier_on_repeated_prefixes() {
    let dir = temp_dir("replay-rr");
    let workload = repeated_prefixes(3);
    assert!(workload.stats().ideal_hit_rate > 0.6);
    let setup = Setup::new(4, 1);
    let report = run(
        &workload,
        &setup,
        &[two_tier(&dir, "two-tier.yaml", ""), round_robin(&dir)],
    );
    let (tt, rr) = (&report.configs[0], &report.configs[1]);
    assert_eq!((tt.errors, rr.errors), (0, 0));
    assert!(
        rr.hit_rate + 0.05 < tt.hit_rate,
        "round-robin {} vs two-tier {}",
        rr.hit_rate,
        tt.hit_rate
    );
    assert!(rr.prefill_tokens > tt.prefill_tokens);
    // Round-robin spreads requests evenly.
    assert!(rr.load_imbalance < 1.01, "{}", rr.load_imbalance);
}

#[test]
fn same_seed_gives_the_same_report_except_decision_cost() {
    let dir = temp_dir("replay-determinism");
    let configs = [
        two_tier(
            &dir,
            "sticky.yaml",
            "      parameters: {respect_soft_affinity: true}\nsession_affinity: {mode: soft}\n",
        ),
        write(
            &dir,
            "random.yaml",
            "worker_selection:\n  aggregated: r\n  instances:\n    - {name: r, type: random, parameters: {seed: 5}}\n",
        ),
    ];
    let setup = Setup::new(3, 2);
    let strip = |report: &Report| {
        let mut json = report.to_json();
        for c in json["configs"].as_array_mut().unwrap() {
            c.as_object_mut().unwrap().remove("decision_ns");
        }
        json
    };
    let a = run(&repeated_prefixes(11), &setup, &configs);
    let b = run(&repeated_prefixes(11), &setup, &configs);
    assert_eq!(strip(&a), strip(&b));
    let c = run(&repeated_prefixes(12), &setup, &configs);
    assert_ne!(strip(&a), strip(&c));
    // The per-request outcomes too; their (worker, rank) add up to the per-worker counts.
    for (x, y) in a.configs.iter().zip(&b.configs) {
        assert_eq!(x.requests, y.requests);
        for (w, &n) in x.requests_per_worker.iter().enumerate() {
            let here = x.requests.iter().filter(|r| r.worker == Some(w as u32));
            assert_eq!(here.clone().count() as u64, n, "{}", x.config);
            assert!(here.clone().all(|r| r.rank.is_some_and(|k| k < 2)));
        }
    }
    assert!(a.configs[0].requests.iter().any(|r| r.rank == Some(1)));
    // Sessions were bound: most later turns kept their worker.
    let s = &a.configs[0].sessions;
    assert_eq!(s.new, 80);
    assert!(s.kept > s.moved, "{s:?}");
}

#[test]
fn malformed_trace_lines_are_errors_naming_line_and_field() {
    let dir = temp_dir("replay-malformed");
    let good = r#"{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, 2]}"#;
    for (bad, field) in [
        (
            r#"{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1]}"#,
            Some("hash_ids"),
        ),
        (
            r#"{"timestamp": 0, "input_length": "600", "output_length": 1, "hash_ids": [1, 2]}"#,
            Some("input_length"),
        ),
        (
            r#"{"timestamp": 0, "input_length": 600, "hash_ids": [1, 2]}"#,
            Some("output_length"),
        ),
        (r#"{"timestamp": 0, "input_length": 600,"#, None),
    ] {
        let trace = write(&dir, "bad.jsonl", &format!("{good}\n{good}\n{bad}\n"));
        let err = Workload::from_jsonl_file(&trace, 512).unwrap_err();
        assert_eq!(err.line, Some(3), "{err}");
        assert_eq!(err.field.as_deref(), field, "{err}");
        let (code, out, stderr) = run_cli(&["replay", "--trace", trace.to_str().unwrap()]);
        assert_eq!(code, 1, "{stderr}");
        assert!(out.is_empty(), "{out}");
        assert!(
            stderr.contains(&format!("{}: line 3: ", trace.display())),
            "{stderr}"
        );
        if let Some(field) = field {
            assert!(stderr.contains(&format!("field `{field}`")), "{stderr}");
        }
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
}

#[test]
fn cli_writes_table_json_contract_svg_and_a_replayable_workload() {
    let dir = temp_dir("replay-cli");
    let plugins = plugin_dir().to_str().unwrap().to_string();
    let json = dir.join("report.json");
    let svg = dir.join("plot.svg");
    let jsonl = dir.join("workload.jsonl");
    let per_request = dir.join("requests.csv");
    // The embedded example configs, plugins found with --plugin-dir.
    let (code, out, err) = run_cli(&[
        "replay",
        "--plugin-dir",
        &plugins,
        "--sessions",
        "40",
        "--rate",
        "6",
        "--workers",
        "3",
        "--json",
        json.to_str().unwrap(),
        "--plot",
        svg.to_str().unwrap(),
        "--write-workload",
        jsonl.to_str().unwrap(),
        "--requests",
        per_request.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{err}");
    for needle in [
        "ideal prefix-cache hit rate",
        "default",
        "two-tier",
        "two-tier-sticky",
        "round-robin",
        "TTFT p99 ms",
        "decision ns p50",
        "requests per worker:",
        "pooled-LRU reference (6144 blocks as one LRU cache",
    ] {
        assert!(out.contains(needle), "{needle}: {out}");
    }
    // Not a terminal: no progress bar, only the closing summary line on stderr.
    assert!(!err.contains('\r'), "{err}");
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let requests = report["workload"]["requests"].as_u64().unwrap();
    assert!(requests > 40);
    let ideal = report["workload"]["ideal_hit_rate"].as_f64().unwrap();
    assert!(ideal > 0.0 && ideal < 1.0);
    let configs = report["configs"].as_array().unwrap();
    assert_eq!(configs.len(), 4);
    assert_eq!(configs[0]["config"], "examples/replay/default.yaml");
    for c in configs {
        assert!(c["hit_rate"].as_f64().is_some());
        for p in ["p50", "p90", "p99"] {
            assert!(c["ttft_ms"][p].as_f64().is_some(), "{c}");
        }
        for p in ["p50", "p99"] {
            assert!(c["decision_ns"][p].as_f64().is_some(), "{c}");
        }
        assert_eq!(c["requests_routed"].as_u64(), Some(requests));
        assert_eq!(c["errors"].as_u64(), Some(0));
        let reference = &c["pooled_lru_reference"];
        assert_eq!(reference["kv_blocks"].as_u64(), Some(3 * 2048), "{c}");
        assert_eq!(reference, &configs[0]["pooled_lru_reference"]);
        let hit = reference["hit_rate"].as_f64().unwrap();
        assert!(hit > 0.0 && hit <= ideal, "{hit} {ideal}");
        for p in ["p50", "p90", "p99"] {
            assert!(reference["ttft_ms"][p].as_f64().unwrap() > 0.0, "{c}");
        }
    }
    // The per-request CSV: the rows behind each config's figures.
    let mut csv = csv::Reader::from_path(&per_request).unwrap();
    let header: Vec<String> = csv.headers().unwrap().iter().map(String::from).collect();
    assert_eq!(header, router_host::replay::report::REQUEST_COLUMNS);
    let records: Vec<csv::StringRecord> = csv.records().map(Result::unwrap).collect();
    assert_eq!(records.len() as u64, 4 * requests);
    for (c, rows) in configs.iter().zip(records.chunks(requests as usize)) {
        let field = |r: &csv::StringRecord, name: &str| -> Option<f64> {
            let i = header.iter().position(|h| h == name).unwrap();
            (!r[i].is_empty()).then(|| r[i].parse().unwrap())
        };
        for (i, r) in rows.iter().enumerate() {
            assert_eq!(&r[0], c["config"].as_str().unwrap());
            assert_eq!(field(r, "request"), Some(i as f64));
            assert!(field(r, "worker").unwrap() < 3.0, "{r:?}");
        }
        let hits: f64 = rows.iter().filter_map(|r| field(r, "hit_blocks")).sum();
        assert_eq!(Some(hits), c["hit_blocks"].as_f64(), "{c}");
        let mut ttft: Vec<f64> = rows.iter().filter_map(|r| field(r, "ttft_ms")).collect();
        assert_eq!(ttft.len() as u64, requests);
        ttft.sort_by(f64::total_cmp);
        let at = 0.99 * (ttft.len() - 1) as f64;
        let (lo, hi) = (ttft[at.floor() as usize], ttft[at.ceil() as usize]);
        let p99 = lo + (hi - lo) * (at - at.floor());
        let reported = c["ttft_ms"]["p99"].as_f64().unwrap();
        assert!((p99 - reported).abs() < 1e-3, "{p99} {reported}");
    }
    let text = std::fs::read_to_string(&svg).unwrap();
    assert!(text.starts_with("<svg") && text.trim_end().ends_with("</svg>"));
    assert!(text.contains("dotted: pooled-LRU reference"), "{text}");
    // The written workload replays to the same ideal bound.
    let again = Workload::from_jsonl_file(&jsonl, 512).unwrap();
    assert_eq!(again.requests.len() as u64, requests);
    assert_eq!(again.stats().ideal_hit_rate, ideal);
}

#[test]
fn engine_block_and_flags_configure_the_engines_with_clear_errors() {
    let dir = temp_dir("replay-engine");
    let bad = write(
        &dir,
        "bad.yaml",
        "engine:\n  kv_blocks: 100\n  prefil_ms_per_token: 1\n",
    );
    let (code, _, err) = run_cli(&["replay", "--sessions", "5", "-c", bad.to_str().unwrap()]);
    assert_eq!(code, 1);
    assert!(err.contains("bad.yaml"), "{err}");
    assert!(err.contains("engine"), "{err}");
    assert!(
        err.contains("engine: unknown key `prefil_ms_per_token`"),
        "{err}"
    );

    // The YAML block applies; a flag beats it.
    let small = write(
        &dir,
        "small.yaml",
        "engine:\n  kv_blocks: 64\n  max_num_batched_tokens: 2048\n",
    );
    let workload = repeated_prefixes(5);
    let setup = Setup::new(2, 1);
    let from_yaml = prepare_file(&small, &setup, 512).unwrap();
    assert_eq!(from_yaml.engine.kv_blocks, KvCapacity::Blocks(64));
    assert_eq!(from_yaml.engine.max_num_batched_tokens, 2048);
    let mut flagged = setup.clone();
    flagged.engine.kv_blocks = Some(KvCapacity::Unlimited);
    let from_flag = prepare_file(&small, &flagged, 512).unwrap();
    assert_eq!(from_flag.engine.kv_blocks, KvCapacity::Unlimited);
    // A small cache evicts and reuses less than an unlimited one on the same policy.
    let report = replay::replay(
        &workload,
        setup.shape,
        &[from_yaml, from_flag],
        &mut |_, _| {},
    )
    .unwrap();
    let (small, unlimited) = (&report.configs[0], &report.configs[1]);
    assert!(small.evicted_blocks > 0);
    assert_eq!(unlimited.evicted_blocks, 0);
    assert!(small.hit_rate < unlimited.hit_rate);
}

#[test]
fn queue_admission_holds_requests_in_the_host_until_capacity_frees() {
    let dir = temp_dir("replay-admission");
    let config = two_tier(
        &dir,
        "admission.yaml",
        "policy_classes:\n  - {name: default, prefill_busy_threshold: 4096}\n",
    );
    // A burst: everything arrives within a second on two workers.
    let workload = replay::synth::generate(&SynthParams {
        sessions: 60,
        turns: 1,
        rate: 200.0,
        seed: 9,
        ..SynthParams::default()
    });
    let report = run(&workload, &Setup::new(2, 1), &[config]);
    let c = &report.configs[0];
    assert_eq!(c.errors, 0, "{:?}", c.error_kinds);
    assert_eq!(c.requests_completed, 60);
    assert!(c.queue.queued > 0);
    assert!(c.queue.wait_ms.p99 > 0.0);
}
