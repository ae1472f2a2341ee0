//! Selection through real plugin `.so` files: eligibility, soft targets, bounds checks.

mod common;

use router_host::config::RouterConfig;
use router_host::host::{Host, InjectedRows, NoOverlap, Submitted};
use router_host::kv_index::KvEventKind;
use router_host::loader::SearchPath;
use router_host::model::NoSignals;
use router_host::model::{AffinityTarget, Cluster, Request, RowId, RowLoad, TierOverlap, Worker};
use router_host::policy_set::{Decision, PolicySet, Scratch, Selection};

/// A router whose aggregated role uses `instance_yaml` (one instance named `p`).
fn policy_set(plugins: &[&str], instance_yaml: &str) -> PolicySet {
    let mut yaml = String::from("plugins:\n");
    for p in plugins {
        yaml.push_str(&format!("  - path: {}\n", common::plugin(p).display()));
    }
    yaml.push_str("worker_selection:\n  aggregated: p\n  instances:\n");
    yaml.push_str(instance_yaml);
    let config = RouterConfig::from_yaml_str(&yaml, None).expect("valid config");
    PolicySet::from_config(&config, &SearchPath::default()).expect("router starts")
}

fn probe(parameters: &str) -> PolicySet {
    probe_config("", parameters).1
}

/// A config of `head` (top-level keys, one a line) whose aggregated role is the probe plugin
/// with `parameters`, and its router.
fn probe_config(head: &str, parameters: &str) -> (RouterConfig, PolicySet) {
    let yaml = format!(
        "{head}plugins:\n  - path: {}\nworker_selection:\n  aggregated: p\n  instances:\n    - name: p\n      type: probe\n      parameters: {parameters}\n",
        common::plugin("fixture_probe").display()
    );
    let config = RouterConfig::from_yaml_str(&yaml, None).expect("valid config");
    let router = PolicySet::from_config(&config, &SearchPath::default()).expect("router starts");
    (config, router)
}

fn row(worker_id: u64, dp_rank: u32) -> RowId {
    RowId { worker_id, dp_rank }
}

/// Workers 1 (ranks 0-1), 2, 3 overloaded, 4 unavailable, 5.
fn cluster() -> Cluster {
    let mut overloaded = Worker::new(3);
    overloaded.overloaded = true;
    let mut down = Worker::new(4);
    down.available = false;
    Cluster::new(vec![
        Worker::new(1).with_ranks(0, 2),
        Worker::new(2),
        overloaded,
        down,
        Worker::new(5),
    ])
    .unwrap()
}

/// `router`'s explained decision for `request` over [`cluster`].
fn explained(router: &PolicySet, request: &Request) -> Decision {
    router
        .select(
            &cluster(),
            Selection::of(request).explained(),
            &NoSignals,
            &mut Scratch::default(),
        )
        .expect("routed")
}

/// The rows the probe reported receiving, and its target label.
fn probe_saw(router: &PolicySet, request: &Request) -> (Vec<String>, String) {
    let d = explained(router, request);
    let e = d.explanation.expect("probe explains");
    let rows = e
        .get_label("row_list")
        .unwrap()
        .split(',')
        .map(str::to_string)
        .collect();
    (rows, e.get_label("target").unwrap().to_string())
}

#[test]
fn custom_picker_receives_affinity_target_without_narrowing_candidates() {
    let router = probe("{}");
    let request = Request {
        isl_tokens: 160,
        affinity_target: Some(AffinityTarget {
            worker_id: 2,
            dp_rank: None,
        }),
        ..Default::default()
    };
    let (rows, target) = probe_saw(&router, &request);
    assert_eq!(
        rows,
        ["1:0", "1:1", "2:0", "5:0"],
        "every eligible row, not just the target's"
    );
    assert_eq!(target, "2:*");
    // A target that is not eligible is still passed on, and the rows are still complete.
    let request = Request {
        affinity_target: Some(AffinityTarget {
            worker_id: 3,
            dp_rank: Some(0),
        }),
        ..request
    };
    let (rows, target) = probe_saw(&router, &request);
    assert_eq!(rows.len(), 4);
    assert_eq!(target, "3:0");
}

/// A decision over every row of a cluster whose workers are all routable is lent the cluster's
/// own id columns; any other decision gets ids written for its rows. One scratch serves both,
/// in either order, and the plugin sees exactly its rows each time.
#[test]
fn a_decision_over_every_row_sees_the_same_ids_lent_as_written() {
    let router = probe("{}");
    let fleet = Cluster::new(vec![
        Worker::new(7).with_ranks(2, 3),
        Worker::new(1),
        Worker::new(4).with_ranks(0, 2),
    ])
    .unwrap();
    let every = ["1:0", "4:0", "4:1", "7:2", "7:3", "7:4"];
    let mut scratch = Scratch::default();
    let mut saw = |request: &Request| {
        let d = router
            .select(
                &fleet,
                Selection::of(request).explained(),
                &NoSignals,
                &mut scratch,
            )
            .expect("routed");
        let e = d.explanation.expect("probe explains");
        let rows: Vec<String> = e
            .get_label("row_list")
            .unwrap()
            .split(',')
            .map(str::to_string)
            .collect();
        rows
    };
    let whole = Request::default();
    let allowed = Request {
        allowed_worker_ids: Some(vec![7, 4]),
        ..Default::default()
    };
    let pinned = Request {
        pinned_worker: Some(row(7, 3)),
        ..Default::default()
    };
    assert!(
        fleet.id_columns_of(fleet.rows()).is_some(),
        "the whole fleet's ids are lent"
    );
    let copy: Vec<RowId> = fleet.rows().to_vec();
    assert!(fleet.id_columns_of(&copy).is_none(), "a copy's are not");
    for _ in 0..2 {
        assert_eq!(saw(&whole), every);
        assert_eq!(saw(&allowed), ["4:0", "4:1", "7:2", "7:3", "7:4"]);
        assert_eq!(saw(&whole), every);
        assert_eq!(saw(&pinned), ["7:3"]);
    }
}

#[test]
fn eligibility_allow_list_pin_and_dp_ranks_reach_the_plugin() {
    let router = probe("{}");
    let allowed = Request {
        allowed_worker_ids: Some(vec![1, 3, 4]),
        ..Default::default()
    };
    assert_eq!(probe_saw(&router, &allowed).0, ["1:0", "1:1"]);
    let pinned = Request {
        pinned_worker: Some(row(1, 1)),
        ..Default::default()
    };
    assert_eq!(probe_saw(&router, &pinned).0, ["1:1"]);

    let fails = |request: Request| {
        router
            .select(
                &cluster(),
                Selection::of(&request),
                &NoSignals,
                &mut Scratch::default(),
            )
            .unwrap_err()
            .to_string()
    };
    assert!(fails(Request {
        pinned_worker: Some(row(2, 0)),
        allowed_worker_ids: Some(vec![1]),
        ..Default::default()
    })
    .contains("pinned worker not allowed"));
    assert!(fails(Request {
        pinned_worker: Some(row(3, 0)),
        ..Default::default()
    })
    .contains("pinned worker overloaded"));
    for gone in [row(4, 0), row(1, 2), row(99, 0)] {
        assert!(fails(Request {
            pinned_worker: Some(gone),
            ..Default::default()
        })
        .contains("no endpoints"));
    }
    assert!(fails(Request {
        allowed_worker_ids: Some(vec![3]),
        ..Default::default()
    })
    .contains("all eligible workers overloaded"));
    assert!(fails(Request {
        allowed_worker_ids: Some(vec![4, 42]),
        ..Default::default()
    })
    .contains("no endpoints"));
}

#[test]
fn plugin_sees_only_the_columns_it_declared() {
    for (inputs, cache, load) in [
        ("[]", "false", "false"),
        ("[cache]", "true", "false"),
        ("[load]", "false", "true"),
        ("[cache, load]", "true", "true"),
    ] {
        let router = probe(&format!("{{inputs: {inputs}}}"));
        let d = explained(&router, &Request::default());
        let e = d.explanation.unwrap();
        assert_eq!(e.get_label("cache"), Some(cache), "inputs {inputs}");
        assert_eq!(e.get_label("load"), Some(load), "inputs {inputs}");
    }
}

/// Decide with the built-in default, injecting rows.
fn default_picks(target: Option<AffinityTarget>, injected: &InjectedRows) -> RowId {
    let config = RouterConfig::from_yaml_str("{}", None).unwrap();
    let router = PolicySet::from_config(&config, &SearchPath::default()).unwrap();
    let host = Host::new(router, cluster(), &config);
    let request = Request {
        isl_tokens: 160,
        affinity_target: target,
        ..Default::default()
    };
    host.route(&request, injected, false).unwrap().decision.row
}

#[test]
fn default_selector_narrows_to_an_eligible_soft_target_and_ignores_an_ineligible_one() {
    // Worker 5 holds the whole prompt: without a target the default picks it.
    let mut injected = InjectedRows::new();
    injected.insert(
        row(5, 0),
        (
            TierOverlap {
                device: 10.0,
                ..Default::default()
            },
            RowLoad::default(),
        ),
    );
    assert_eq!(default_picks(None, &injected), row(5, 0));
    // An eligible worker-level target: only worker 1's ranks are considered; rank 1 is idler.
    injected.insert(
        row(1, 0),
        (
            TierOverlap::default(),
            RowLoad {
                active_prefill_tokens: 64,
                ..Default::default()
            },
        ),
    );
    let target = |worker_id, dp_rank| Some(AffinityTarget { worker_id, dp_rank });
    assert_eq!(default_picks(target(1, None), &injected), row(1, 1));
    // A rank target: that rank, even though it costs more.
    assert_eq!(default_picks(target(1, Some(0)), &injected), row(1, 0));
    // Ineligible targets (overloaded, unavailable, unknown, absent rank) are ignored.
    for t in [
        target(3, None),
        target(4, None),
        target(42, None),
        target(1, Some(7)),
    ] {
        assert_eq!(default_picks(t, &injected), row(5, 0));
    }
}

#[test]
fn out_of_range_index_is_rejected_and_books_nothing() {
    let config = RouterConfig::from_yaml_str(
        &format!(
            "plugins: [{{path: {}}}]\nworker_selection:\n  aggregated: p\n  instances:\n    - {{name: p, type: probe, parameters: {{return_index: 99}}, on_error: fail}}\n",
            common::plugin("fixture_probe").display()
        ),
        None,
    )
    .unwrap();
    let router = PolicySet::from_config(&config, &SearchPath::default()).unwrap();
    let host = Host::new(router, cluster(), &config);
    let err = host
        .route(&Request::default(), &NoOverlap, false)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("returned row index 99, but only 4 rows were given"),
        "{err}"
    );
    assert_eq!(host.in_flight(), 0);
    for r in cluster()
        .workers()
        .iter()
        .flat_map(|w| w.rows().collect::<Vec<_>>())
    {
        assert_eq!(
            host.load().get(r),
            RowLoad::default(),
            "row {r:?} was booked"
        );
    }
    let stats = host.policy_set().instance(1).stats.snapshot();
    assert_eq!(
        (stats.picks, stats.out_of_range, stats.fallbacks),
        (1, 1, 0)
    );
}

#[test]
fn out_of_range_index_with_fallback_routes_through_the_default_selector() {
    let router = probe("{return_index: 4}");
    let d = router
        .select(
            &cluster(),
            Selection::of(&Request::default()),
            &NoSignals,
            &mut Scratch::default(),
        )
        .unwrap();
    assert_eq!(
        d.row,
        row(1, 0),
        "default picks the lowest row on a cold idle cluster"
    );
    assert!(d.fallback.unwrap().to_string().contains("row index 4"));
    let stats = router.instance(1).stats.snapshot();
    assert_eq!((stats.out_of_range, stats.fallbacks), (1, 1));
}

#[test]
fn two_plugin_files_in_one_process_keep_their_own_policies() {
    let router = policy_set(
        &["fixture_probe", "two_tier_cost_fn"],
        "    - {name: p, type: probe, parameters: {return_index: 1}}\n    - {name: t, type: dynamo-two-tier-cost-fn}\n",
    );
    let types: Vec<(String, String)> = router
        .catalog()
        .types()
        .map(|(name, origin, _)| (name.to_string(), router.catalog().origin_name(origin)))
        .collect();
    let origin_of = |t: &str| types.iter().find(|(n, _)| n == t).unwrap().1.clone();
    assert!(origin_of("probe").ends_with("libfixture_probe.so"));
    assert!(origin_of("dynamo-two-tier-cost-fn").ends_with("libtwo_tier_cost_fn.so"));
    let libraries: Vec<&str> = router
        .catalog()
        .libraries()
        .iter()
        .map(|l| l.plugin_name.as_str())
        .collect();
    assert_eq!(libraries, ["fixture-probe", "two-tier-cost-fn"]);
    // Each instance runs its own library's code.
    let probe_instance = router.instances().iter().find(|i| i.name == "p").unwrap();
    let tier_instance = router.instances().iter().find(|i| i.name == "t").unwrap();
    assert_eq!(probe_instance.type_name, "probe");
    assert_eq!(tier_instance.type_name, "dynamo-two-tier-cost-fn");
    let d = explained(&router, &Request::default());
    assert_eq!(d.row, row(1, 1), "probe returned index 1");
    assert_eq!(d.explanation.unwrap().reason, "probe");
}

#[test]
fn the_same_file_listed_twice_or_through_a_symlink_is_loaded_once() {
    let dir = common::temp_dir("dedupe");
    let real = common::plugin("fixture_probe");
    let link = dir.join("libalias.so");
    std::os::unix::fs::symlink(&real, &link).unwrap();
    let yaml = format!(
        "plugins:\n  - path: {}\n  - path: {}\n  - path: {}\n",
        real.display(),
        real.display(),
        link.display()
    );
    let config = RouterConfig::from_yaml_str(&yaml, None).unwrap();
    let router = PolicySet::from_config(&config, &SearchPath::default()).unwrap();
    assert_eq!(router.catalog().libraries().len(), 1);
}

/// The probe's `label` (a column it received, or `none` for every row when it got none) by row
/// (its `row_list`), from the explanation of `decision`.
fn by_row(decision: Decision, label: &str) -> Vec<(String, String)> {
    let e = decision.explanation.expect("probe explains");
    let rows: Vec<&str> = e
        .get_label("row_list")
        .expect("row_list")
        .split(',')
        .collect();
    let values = e.get_label(label).expect("label");
    let values: Vec<&str> = if values == "none" {
        vec!["none"; rows.len()]
    } else {
        values.split(',').collect()
    };
    assert_eq!(values.len(), rows.len(), "one {label} per row: {values:?}");
    rows.iter()
        .zip(values)
        .map(|(r, v)| (r.to_string(), v.to_string()))
        .collect()
}

/// One explained decision through the core's KV index for a prompt of `blocks` (16 tokens
/// each), completed at once.
fn indexed_decision(host: &Host, blocks: &[u64]) -> Decision {
    let request = Request {
        isl_tokens: 16 * blocks.len() as u64,
        blocks: blocks.to_vec(),
        ..Default::default()
    };
    let routed = match host.core().submit_indexed(request, true) {
        Ok(Submitted::Dispatched(routed)) => routed,
        other => panic!("not dispatched: {other:?}"),
    };
    assert!(host.complete(routed.id));
    routed.decision
}

/// The probe's `kv_capacity` label (the `kv_capacity_blocks` column it received, or `none`)
/// by row, from one decision of a core over `workers`.
fn capacity_seen(host: &Host) -> Vec<(String, String)> {
    let routed = host
        .route(&Request::default(), &NoOverlap, true)
        .expect("routed");
    assert!(host.complete(routed.id));
    by_row(routed.decision, "kv_capacity")
}

fn sorted(mut v: Vec<(String, String)>) -> Vec<(String, String)> {
    v.sort();
    v
}

fn pairs(items: &[(&str, &str)]) -> Vec<(String, String)> {
    items
        .iter()
        .map(|(r, v)| (r.to_string(), v.to_string()))
        .collect()
}

#[test]
fn the_kv_capacity_column_reaches_a_plugin_with_load_aligned_with_its_rows() {
    let (config, router) = probe_config("", "{}");
    let mut sized = Worker::new(1).with_ranks(0, 2);
    sized.total_kv_blocks = Some(256);
    let cluster = Cluster::new(vec![sized, Worker::new(2)]).unwrap();
    let host = Host::new(router, cluster, &config);

    // A worker of unknown capacity is NaN; every rank of a worker has its capacity.
    assert_eq!(
        sorted(capacity_seen(&host)),
        pairs(&[("1:0", "256"), ("1:1", "256"), ("2:0", "NaN")])
    );
    // Learned (or changed) at run time: from the next decision on.
    host.core().set_kv_capacity(2, Some(64)).unwrap();
    assert_eq!(
        sorted(capacity_seen(&host)),
        pairs(&[("1:0", "256"), ("1:1", "256"), ("2:0", "64")])
    );
    // No worker's capacity known: no column at all.
    host.core().set_kv_capacity(1, None).unwrap();
    host.core().set_kv_capacity(2, None).unwrap();
    assert_eq!(
        sorted(capacity_seen(&host)),
        pairs(&[("1:0", "none"), ("1:1", "none"), ("2:0", "none")])
    );
    assert!(
        host.core().set_kv_capacity(9, Some(1)).is_err(),
        "unknown worker"
    );
}

#[test]
fn the_kv_capacity_column_comes_only_with_the_load_columns() {
    let mut sized = Worker::new(1);
    sized.total_kv_blocks = Some(256);
    for (inputs, expected) in [("[cache]", "none"), ("[load]", "256"), ("[]", "none")] {
        let (config, router) = probe_config("", &format!("{{inputs: {inputs}}}"));
        let host = Host::new(router, Cluster::new(vec![sized.clone()]).unwrap(), &config);
        assert_eq!(
            capacity_seen(&host),
            pairs(&[("1:0", expected)]),
            "inputs {inputs}"
        );
    }
}

/// The probe's `kv_indexed_device` label by row, from one decision through the core's KV index.
fn indexed_seen(host: &Host) -> Vec<(String, String)> {
    by_row(indexed_decision(host, &[1, 2, 3, 4]), "kv_indexed_device")
}

#[test]
fn the_indexed_blocks_columns_count_what_each_row_holds_from_kv_events() {
    let router = probe("{inputs: [load]}");
    let cluster = Cluster::new(vec![Worker::new(1).with_ranks(0, 2), Worker::new(2)]).unwrap();
    let config = RouterConfig::default();
    let host = Host::new(router, cluster, &config);
    let row = |worker_id, dp_rank| RowId { worker_id, dp_rank };
    assert_eq!(
        sorted(indexed_seen(&host)),
        pairs(&[("1:0", "0"), ("1:1", "0"), ("2:0", "0")])
    );
    let stored =
        |r: RowId, blocks: std::ops::Range<u64>| blocks.map(move |b| (r, KvEventKind::Stored, b));
    host.core().apply_kv_batch(
        stored(row(1, 1), 0..5)
            .chain(stored(row(2, 0), 3..10))
            // A block stored twice counts once.
            .chain(stored(row(2, 0), 3..4)),
    );
    host.core()
        .apply_kv_batch([(row(2, 0), KvEventKind::Evicted, 9)]);
    assert_eq!(
        sorted(indexed_seen(&host)),
        pairs(&[("1:0", "0"), ("1:1", "5"), ("2:0", "6")])
    );
    // Only with the load columns, as the capacity column.
    let host = Host::new(
        probe("{inputs: [cache]}"),
        Cluster::new(vec![Worker::new(1)]).unwrap(),
        &config,
    );
    assert_eq!(indexed_seen(&host), pairs(&[("1:0", "none")]));
}

/// The probe's `kv_recent_device` label by row, and the row chosen, from one decision through
/// the core's KV index for a prompt of blocks `blocks`.
fn recent_seen(host: &Host, blocks: &[u64]) -> (Vec<(String, String)>, String) {
    let decision = indexed_decision(host, blocks);
    let chosen = format!("{}:{}", decision.row.worker_id, decision.row.dp_rank);
    (sorted(by_row(decision, "kv_recent_device")), chosen)
}

#[test]
fn the_recent_blocks_column_counts_what_routed_requests_used_capped_at_what_is_indexed() {
    // An hour's window: nothing expires while the test runs, however slow the machine.
    let host_with = |window_ms: u64| {
        let (config, router) = probe_config(
            &format!("kv_recent_window_ms: {window_ms}\n"),
            "{inputs: [load]}",
        );
        let cluster = Cluster::new(vec![Worker::new(1), Worker::new(2)]).unwrap();
        Host::new(router, cluster, &config)
    };
    let host = host_with(3_600_000);
    let row = |worker_id| RowId {
        worker_id,
        dp_rank: 0,
    };
    let stored =
        |r: RowId, blocks: std::ops::Range<u64>| blocks.map(move |b| (r, KvEventKind::Stored, b));
    host.core()
        .apply_kv_batch(stored(row(1), 0..8).chain(stored(row(2), 100..103)));
    // Nothing routed yet: nothing recent.
    let (seen, first) = recent_seen(&host, &[0, 1, 2, 3, 4]);
    assert_eq!(seen, pairs(&[("1:0", "0"), ("2:0", "0")]));
    // The probe picks the first row; its 5-block prompt is now recent there.
    assert_eq!(first, "1:0");
    let (seen, _) = recent_seen(&host, &[0, 1]);
    assert_eq!(seen, pairs(&[("1:0", "5"), ("2:0", "0")]));
    // Row 1 evicts all but 2 blocks: the column never says more than the row holds.
    host.core()
        .apply_kv_batch((2..8).map(|b| (row(1), KvEventKind::Evicted, b)));
    let (seen, _) = recent_seen(&host, &[0, 1]);
    assert_eq!(seen, pairs(&[("1:0", "2"), ("2:0", "0")]));
    // `kv_recent_window_ms: 0` turns it off: no column.
    let host = host_with(0);
    host.core().apply_kv_batch(stored(row(1), 0..8));
    for _ in 0..2 {
        let (seen, _) = recent_seen(&host, &[0, 1, 2]);
        assert_eq!(seen, pairs(&[("1:0", "none"), ("2:0", "none")]));
    }
}

/// The probe's `kv_index_state` label by row, from one decision through the core's KV index.
fn states_seen(host: &Host) -> Vec<(String, String)> {
    by_row(indexed_decision(host, &[1, 2, 3, 4]), "kv_index_state")
}

#[test]
fn the_index_state_column_reaches_a_plugin_with_the_cache_columns_aligned_with_its_rows() {
    use plugin_api::KvIndexState;
    let cluster = || Cluster::new(vec![Worker::new(1).with_ranks(0, 2), Worker::new(2)]).unwrap();
    let config = RouterConfig::default();
    let host = Host::new(probe("{inputs: [cache]}"), cluster(), &config);
    // Rows nobody feeds are current.
    assert_eq!(
        sorted(states_seen(&host)),
        pairs(&[("1:0", "current"), ("1:1", "current"), ("2:0", "current")])
    );
    let core = host.core();
    assert_eq!(
        core.set_kv_index_state(row(1, 1), KvIndexState::Stale),
        Some(KvIndexState::Current)
    );
    core.set_kv_index_state(row(2, 0), KvIndexState::Lagging);
    assert_eq!(
        core.set_kv_index_state(row(9, 0), KvIndexState::Stale),
        None
    );
    assert_eq!(core.kv_index_state(row(1, 1)), Some(KvIndexState::Stale));
    assert_eq!(
        sorted(states_seen(&host)),
        pairs(&[("1:0", "current"), ("1:1", "stale"), ("2:0", "lagging")])
    );
    // A removed worker's slot is current again for whoever gets it next.
    core.remove_worker(2).unwrap();
    core.add_worker(Worker::new(3)).unwrap();
    assert_eq!(core.kv_index_state(row(3, 0)), Some(KvIndexState::Current));
    // The column follows every change, back to all current and away from it again (the core
    // keeps a count of rows not current, and writes the column without reading rows at 0).
    core.set_kv_index_state(row(1, 1), KvIndexState::Current);
    assert!(states_seen(&host).iter().all(|(_, s)| s == "current"));
    core.set_kv_index_state(row(3, 0), KvIndexState::Unknown);
    assert_eq!(
        sorted(states_seen(&host)),
        pairs(&[("1:0", "current"), ("1:1", "current"), ("3:0", "unknown")])
    );
    // Only with the overlap columns: a load-only policy reads no overlap to distrust.
    let host = Host::new(probe("{inputs: [load]}"), cluster(), &config);
    host.core()
        .set_kv_index_state(row(2, 0), KvIndexState::Stale);
    assert!(states_seen(&host).iter().all(|(_, s)| s == "none"));
}

/// The row each policy picks for a prompt worker 2 holds, through the core's KV index, and
/// the reason, with worker 2's index in `state`.
fn picked_with_index_state(router: PolicySet, state: plugin_api::KvIndexState) -> (u64, String) {
    let cluster = Cluster::new(vec![Worker::new(1), Worker::new(2)]).unwrap();
    let host = Host::new(router, cluster, &RouterConfig::default());
    let core = host.core();
    core.apply_kv_batch((1..=4).map(|b| (row(2, 0), KvEventKind::Stored, b)));
    core.set_kv_index_state(row(2, 0), state);
    // Worker 2 already runs a request: without its overlap, worker 1 is the better row.
    let busy = Request {
        isl_tokens: 16,
        pinned_worker: Some(row(2, 0)),
        ..Default::default()
    };
    let Ok(Submitted::Dispatched(_held)) = core.submit_indexed(busy, false) else {
        panic!("the pinned request was not dispatched");
    };
    let request = Request {
        isl_tokens: 64,
        blocks: vec![1, 2, 3, 4],
        ..Default::default()
    };
    let routed = match core.submit_indexed(request, true) {
        Ok(Submitted::Dispatched(routed)) => routed,
        other => panic!("not dispatched: {other:?}"),
    };
    let reason = routed.decision.explanation.expect("explained").reason;
    (routed.decision.row.worker_id, reason)
}

#[test]
fn the_built_in_default_and_two_tier_route_load_only_on_a_row_whose_index_is_not_current() {
    use plugin_api::KvIndexState;
    let builtin = || {
        let config = RouterConfig::default();
        PolicySet::from_config(&config, &SearchPath::default()).expect("router starts")
    };
    let two_tier = || {
        policy_set(
            &["two_tier_cost_fn"],
            "    - {name: p, type: dynamo-two-tier-cost-fn}\n",
        )
    };
    assert_eq!(
        picked_with_index_state(builtin(), KvIndexState::Current),
        (2, "lowest_cost".to_string())
    );
    assert_eq!(
        picked_with_index_state(two_tier(), KvIndexState::Current),
        (2, "cache_tier_least_loaded_among_max_overlap".to_string())
    );
    for state in [
        KvIndexState::Unknown,
        KvIndexState::Stale,
        KvIndexState::Lagging,
    ] {
        assert_eq!(
            picked_with_index_state(builtin(), state),
            (1, "lowest_cost_kv_load_only".to_string()),
            "{state}"
        );
        assert_eq!(
            picked_with_index_state(two_tier(), state),
            (1, "least_loaded_no_cache_winner_kv_load_only".to_string()),
            "{state}"
        );
    }
}

#[test]
fn uncached_prefill_booking_books_the_whole_prompt_on_a_row_whose_index_is_not_current() {
    use plugin_api::KvIndexState;
    // booking.prefill: uncached (the default); block size 16; worker 1 holds 4 of the 5 blocks.
    let config = RouterConfig::default();
    let router = PolicySet::from_config(&config, &SearchPath::default()).expect("router starts");
    let host = Host::new(router, Cluster::new(vec![Worker::new(1)]).unwrap(), &config);
    let core = host.core();
    core.apply_kv_batch((1..=4).map(|b| (row(1, 0), KvEventKind::Stored, b)));
    let booked = |state| {
        core.set_kv_index_state(row(1, 0), state);
        let request = Request {
            isl_tokens: 80,
            blocks: vec![1, 2, 3, 4, 5],
            ..Default::default()
        };
        let Ok(Submitted::Dispatched(routed)) = core.submit_indexed(request, false) else {
            panic!("not dispatched");
        };
        let prefill = core.booked(row(1, 0)).active_prefill_tokens;
        assert!(host.complete(routed.id));
        prefill
    };
    assert_eq!(booked(KvIndexState::Current), 80 - 4 * 16);
    for state in [
        KvIndexState::Unknown,
        KvIndexState::Stale,
        KvIndexState::Lagging,
    ] {
        assert_eq!(booked(state), 80, "{state}");
    }
}
