//! One replay run: a workload through the real host (policies, sessions, admission, load
//! booking) onto simulated engines, in simulated time.
//!
//! Event order at equal times: engine step ends (lowest row first) before arrivals, so
//! completions free load and their cache events reach the index before the next decision.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use router_config::RouterConfig;
use router_core::model::{Cluster, Request, Worker};
use router_core::sessions::{DispatchOutcome, ManualClock};
use router_policies::host::{Host, RouteError, Routed, SessionOutcome, Submitted, TicketId};
use router_policies::loader::SearchPath;
use router_policies::policy_set::{PolicySet, PolicySetOptions};

use super::engine::{Engine, EngineParams, EngineStats, Job, Outbox};
use super::trace::Workload;
use super::ReplayError;
use router_core::fast_hash::FastMap;
use router_core::kv_index::RowMap;

/// Load samples kept per run before the interval doubles.
const MAX_SAMPLES: usize = 2048;
/// Target number of load samples over the arrival span.
const TARGET_SAMPLES: u64 = 240;

/// The cluster the replay simulates: `workers` workers (ids 0..workers) of `dp_size` ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    pub workers: u32,
    pub dp_size: u32,
}

impl Shape {
    pub fn rows(&self) -> RowMap {
        RowMap {
            workers: self.workers,
            dp_size: self.dp_size,
        }
    }
}

/// One config to run.
#[derive(Debug)]
pub struct RunConfig {
    /// The config as the user named it.
    pub label: String,
    /// Where it comes from, as a user would name it again: `builtin:NAME` or the file.
    pub source: String,
    /// Parsed config, `block_size` already set to the workload's.
    pub router: RouterConfig,
    pub search: SearchPath,
    pub engine: EngineParams,
    /// The config's own `block_size`, when it differed from the workload's.
    pub block_size_replaced: Option<u32>,
    pub router_options: PolicySetOptions,
}

/// Session binding outcomes of dispatched requests (the report prints them as they are).
pub use super::report::SessionReport as SessionCounts;

/// Active requests per worker over simulated time.
#[derive(Debug, Clone, PartialEq)]
pub struct Timeline {
    pub interval_ns: u64,
    /// `samples[k][w]` = requests on worker w (all ranks) at `k * interval_ns`.
    pub samples: Vec<Vec<u32>>,
}

/// Everything one run measured.
#[derive(Debug)]
pub struct RunOutput {
    /// One per workload request; `host_id` unset and `finish_ns` `None` for requests that never
    /// reached an engine.
    pub jobs: Vec<Job>,
    pub reached_engine: Vec<bool>,
    /// Wall-clock nanoseconds per routing decision.
    pub decision_ns: Vec<u64>,
    /// Error message -> count.
    pub errors: BTreeMap<String, u64>,
    pub sessions: SessionCounts,
    pub fallbacks: u64,
    /// Requests that waited in a host admission queue, and how long (ns) each waited.
    pub queue_waits_ns: Vec<u64>,
    pub requests_per_row: Vec<u64>,
    pub engine_stats: Vec<EngineStats>,
    pub timeline: Timeline,
    /// Simulated time of the last event.
    pub end_ns: u64,
    pub kv_events: u64,
    /// `instance (type)` serving the aggregated role.
    pub policy: String,
    /// Where the config comes from and what it resolved to.
    pub settings: super::ColumnSettings,
}

struct Sim<'w> {
    workload: &'w Workload,
    rows: RowMap,
    host: Host,
    clock: Arc<ManualClock>,
    engines: Vec<Engine>,
    jobs: Vec<Job>,
    reached: Vec<bool>,
    out: Outbox,
    heap: BinaryHeap<Reverse<(u64, u32, u64)>>,
    /// Requests due to arrive: `(time, index)`. In a closed loop a request is added when the
    /// one it follows ends.
    arrivals: BinaryHeap<Reverse<(u64, u32)>>,
    /// `followers[i]`: the requests that arrive after request `i` ends.
    followers: Vec<Vec<u32>>,
    /// Dispatched requests on their way to the engine (`api_overhead_ms`): `(time, job)`.
    to_engine: BinaryHeap<Reverse<(u64, u32)>>,
    arrived: usize,
    scheduled: Vec<Option<u64>>,
    versions: Vec<u64>,
    tickets: FastMap<TicketId, u32>,
    decision_ns: Vec<u64>,
    errors: BTreeMap<String, u64>,
    sessions: SessionCounts,
    fallbacks: u64,
    queue_waits_ns: Vec<u64>,
    requests_per_row: Vec<u64>,
    timeline: Timeline,
    next_sample_ns: u64,
    now: u64,
    api_overhead_ns: u64,
}

/// Run `workload` through one config.
pub fn run(
    workload: &Workload,
    shape: Shape,
    config: &RunConfig,
    progress: &mut dyn FnMut(usize),
) -> Result<RunOutput, ReplayError> {
    let router = PolicySet::from_config_with(&config.router, &config.search, config.router_options)
        .map_err(|source| ReplayError::Startup {
            label: config.label.clone(),
            source: Box::new(source),
        })?;
    let policy = {
        let instance =
            router.instance(router.instance_for(router_core::model::RequestRole::Aggregated));
        format!("{} ({})", instance.name, instance.type_name)
    };
    let settings =
        super::ColumnSettings::new(&config.source, &config.router, &router, config.engine);
    let workers = (0..shape.workers)
        .map(|w| Worker {
            max_num_batched_tokens: Some(config.engine.max_num_batched_tokens),
            total_kv_blocks: config.engine.capacity(),
            ..Worker::new(u64::from(w)).with_ranks(0, shape.dp_size)
        })
        .collect();
    let cluster = Cluster::new(workers).map_err(|reason| ReplayError::Cluster {
        label: config.label.clone(),
        reason,
    })?;
    let clock = Arc::new(ManualClock::new(Duration::ZERO));
    let host = Host::with_clock(router, cluster, &config.router, clock.clone());
    let rows = shape.rows();
    let n = rows.rows();
    let span = match (workload.requests.first(), workload.requests.last()) {
        (Some(a), Some(b)) => b.arrival_ns - a.arrival_ns,
        _ => 0,
    };
    let mut sim = Sim {
        workload,
        rows,
        host,
        clock,
        engines: (0..n)
            .map(|r| Engine::new(r as u32, config.engine, workload.block_size))
            .collect(),
        jobs: Vec::with_capacity(workload.requests.len()),
        reached: vec![false; workload.requests.len()],
        out: Outbox::default(),
        heap: BinaryHeap::new(),
        scheduled: vec![None; n],
        versions: vec![0; n],
        tickets: FastMap::default(),
        decision_ns: Vec::with_capacity(workload.requests.len()),
        errors: BTreeMap::new(),
        sessions: SessionCounts::default(),
        fallbacks: 0,
        queue_waits_ns: Vec::new(),
        requests_per_row: vec![0; n],
        timeline: Timeline {
            interval_ns: (span / TARGET_SAMPLES).max(1_000_000),
            samples: Vec::new(),
        },
        next_sample_ns: workload.requests.first().map_or(0, |r| r.arrival_ns),
        now: 0,
        arrivals: BinaryHeap::with_capacity(workload.requests.len()),
        followers: Vec::new(),
        to_engine: BinaryHeap::new(),
        arrived: 0,
        api_overhead_ns: config.engine.api_overhead_ns(),
    };
    if workload.is_closed_loop() {
        sim.followers = vec![Vec::new(); workload.requests.len()];
    }
    for (i, r) in workload.requests.iter().enumerate() {
        let links = workload.links(i);
        let output_ids = links.map_or(&[][..], |l| &l.output_hash_ids[..]);
        sim.jobs.push(
            Job::new(i as u32, r, workload.block_size, r.arrival_ns, r.arrival_ns)
                .with_output_hash_ids(output_ids),
        );
        match links.and_then(|l| l.after) {
            Some((earlier, _)) if (earlier as usize) < i => {
                sim.followers[earlier as usize].push(i as u32);
            }
            _ => sim.arrivals.push(Reverse((r.arrival_ns, i as u32))),
        }
    }
    loop {
        while let Some(&Reverse((_, e, v))) = sim.heap.peek() {
            if sim.versions[e as usize] == v {
                break;
            }
            sim.heap.pop();
        }
        let engine_at = sim.heap.peek().map(|Reverse((t, e, _))| (*t, *e));
        let to_engine_at = sim.to_engine.peek().map(|Reverse((t, j))| (*t, *j));
        let arrival_at = sim.arrivals.peek().map(|Reverse((t, i))| (*t, *i));
        // At equal times: step ends, then requests reaching their engine, then arrivals.
        let first = [
            engine_at.map(|(t, _)| (t, 0u8)),
            to_engine_at.map(|(t, _)| (t, 1u8)),
            arrival_at.map(|(t, _)| (t, 2u8)),
        ]
        .into_iter()
        .flatten()
        .min();
        match (first, engine_at, to_engine_at, arrival_at) {
            (None, ..) => break,
            (Some((t, 0)), Some((_, e)), _, _) => {
                sim.heap.pop();
                sim.scheduled[e as usize] = None;
                sim.advance(t);
                sim.engine_event(e as usize);
            }
            (Some((t, 1)), _, Some((_, job)), _) => {
                sim.to_engine.pop();
                sim.advance(t);
                sim.join_engine(job);
                sim.deliver();
            }
            (Some((t, _)), _, _, Some((_, i))) => {
                sim.arrivals.pop();
                sim.advance(t);
                sim.arrival(i as usize);
                sim.arrived += 1;
                progress(sim.arrived);
            }
            // Unreachable: `first` comes from one of the three.
            (Some(_), ..) => break,
        }
    }
    let never_arrived = workload.requests.len() - sim.arrived;
    if never_arrived > 0 {
        *sim.errors
            .entry(
                "never arrived: the request it follows in the closed loop never ended".to_string(),
            )
            .or_default() += never_arrived as u64;
    }
    debug_assert!(
        sim.consistent(),
        "index, engines and host disagree at the end"
    );
    let waiting = sim.host.admission_stats().waiting;
    if waiting > 0 {
        *sim.errors
            .entry("still queued when the replay ended".to_string())
            .or_default() += waiting;
    }
    let kv_events = sim.host.core().kv_index().events();
    Ok(RunOutput {
        kv_events,
        jobs: sim.jobs,
        reached_engine: sim.reached,
        decision_ns: sim.decision_ns,
        errors: sim.errors,
        sessions: sim.sessions,
        fallbacks: sim.fallbacks,
        queue_waits_ns: sim.queue_waits_ns,
        requests_per_row: sim.requests_per_row,
        engine_stats: sim.engines.iter().map(Engine::stats).collect(),
        timeline: sim.timeline,
        end_ns: sim.now,
        policy,
        settings,
    })
}

impl Sim<'_> {
    /// The host's index holds exactly the engines' cached blocks, every engine is idle and the
    /// host has nothing in flight.
    fn consistent(&self) -> bool {
        let core = self.host.core();
        let topology = core.topology();
        let index = core.kv_index();
        let mut total = 0u64;
        for (e, engine) in self.engines.iter().enumerate() {
            if !engine.is_idle() {
                return false;
            }
            let Some(slot) = topology.slot(self.rows.row(e)) else {
                return false;
            };
            for block in engine.cached() {
                total += 1;
                if !index.holds(slot, block) {
                    return false;
                }
            }
        }
        total == index.holdings() && self.host.in_flight() == 0
    }

    /// The engines' cache events, to the core's KV index (engine `e` is row `rows.row(e)`).
    fn apply_events(&mut self) {
        let rows = self.rows;
        self.host.core().apply_kv_batch(
            self.out
                .events
                .iter()
                .map(|ev| (rows.row(ev.row as usize), ev.kind, ev.block)),
        );
    }

    /// Move simulated time to `t`, taking load samples on the way.
    fn advance(&mut self, t: u64) {
        while self.next_sample_ns <= t {
            let mut per_worker = vec![0u32; self.rows.workers as usize];
            for (r, engine) in self.engines.iter().enumerate() {
                per_worker[r / self.rows.dp_size as usize] += engine.active() as u32;
            }
            self.timeline.samples.push(per_worker);
            if self.timeline.samples.len() >= MAX_SAMPLES {
                // Keep every other sample and double the interval.
                let kept: Vec<Vec<u32>> =
                    self.timeline.samples.iter().step_by(2).cloned().collect();
                self.timeline.samples = kept;
                self.timeline.interval_ns *= 2;
                let origin = self.workload.requests.first().map_or(0, |r| r.arrival_ns);
                self.next_sample_ns =
                    origin + self.timeline.samples.len() as u64 * self.timeline.interval_ns;
            } else {
                self.next_sample_ns += self.timeline.interval_ns;
            }
        }
        self.now = t;
        self.clock.set(Duration::from_nanos(t));
    }

    fn reschedule(&mut self, e: usize) {
        let wake = self.engines[e].wake();
        if wake != self.scheduled[e] {
            self.versions[e] += 1;
            self.scheduled[e] = wake;
            if let Some(t) = wake {
                self.heap.push(Reverse((t, e as u32, self.versions[e])));
            }
        }
    }

    fn engine_event(&mut self, e: usize) {
        let now = self.now;
        self.engines[e].on_wake(now, &mut self.jobs, &self.workload.requests, &mut self.out);
        self.reschedule(e);
        self.deliver();
    }

    /// Hand the engines' reports to the host side: cache events to the index, prefill and
    /// request completions to the host; then let queued requests in.
    fn deliver(&mut self) {
        loop {
            self.apply_events();
            let freed = !self.out.first_tokens.is_empty() || !self.out.finished.is_empty();
            for &j in &self.out.first_tokens {
                self.host.prefill_complete(self.jobs[j as usize].host_id);
            }
            for i in 0..self.out.finished.len() {
                let j = self.out.finished[i];
                self.host.complete(self.jobs[j as usize].host_id);
                self.ended(j);
            }
            self.out.clear();
            if !freed || self.host.admission_stats().waiting == 0 {
                return;
            }
            self.drain();
            if self.out.events.is_empty() {
                return;
            }
        }
    }

    fn drain(&mut self) {
        let started = Instant::now();
        // Queued requests carry their blocks: the core walks its own index for them.
        let drained = self.host.core().drain(false);
        if drained.is_empty() {
            return;
        }
        let each = elapsed_ns(started) / drained.len() as u64;
        for d in drained {
            self.decision_ns.push(each);
            let Some(job) = self.tickets.remove(&d.ticket) else {
                continue;
            };
            match d.result {
                Ok(routed) => self.dispatched(job, routed),
                Err(err) => self.failed(job, &err),
            }
        }
    }

    fn arrival(&mut self, i: usize) {
        let w = &self.workload.requests[i];
        let request = Request {
            isl_tokens: w.input_length,
            session_id: w.session_id.clone(),
            blocks: w.hash_ids.clone(),
            ..Request::default()
        };
        let started = Instant::now();
        let outcome = self.host.core().submit_indexed(request, false);
        self.decision_ns.push(elapsed_ns(started));
        match outcome {
            Ok(Submitted::Dispatched(routed)) => self.dispatched(i as u32, routed),
            Ok(Submitted::Queued(ticket)) => {
                self.tickets.insert(ticket.id(), i as u32);
            }
            Err(err) => self.failed(i as u32, &err),
        }
        self.deliver_events();
    }

    /// Cache events from admissions (evictions) reach the index before the next decision.
    fn deliver_events(&mut self) {
        self.apply_events();
        self.out.events.clear();
    }

    fn failed(&mut self, job: u32, err: &RouteError) {
        *self.errors.entry(err.to_string()).or_default() += 1;
        self.ended(job);
    }

    /// Request `job` ended (finished or failed) now: the requests that follow it in a closed
    /// loop arrive their client's gap later.
    fn ended(&mut self, job: u32) {
        let Some(followers) = self.followers.get_mut(job as usize) else {
            return;
        };
        for f in std::mem::take(followers) {
            let gap = self
                .workload
                .links(f as usize)
                .and_then(|l| l.after)
                .map_or(0, |(_, gap)| gap);
            let at = self.now.saturating_add(gap);
            let j = &mut self.jobs[f as usize];
            j.arrival_ns = at;
            j.dispatched_ns = at;
            self.arrivals.push(Reverse((at, f)));
        }
    }

    fn dispatched(&mut self, job: u32, routed: Routed) {
        match &routed.session {
            None => {}
            Some(SessionOutcome::Dispatched(o)) => match o {
                DispatchOutcome::Created => self.sessions.new += 1,
                DispatchOutcome::Kept => self.sessions.kept += 1,
                DispatchOutcome::Moved { .. } => self.sessions.moved += 1,
                DispatchOutcome::Stale => self.sessions.stale += 1,
            },
            Some(SessionOutcome::HardBindingGone) => self.sessions.hard_binding_gone += 1,
            Some(SessionOutcome::NotRecorded(_)) => self.sessions.not_recorded += 1,
        }
        if routed.decision.fallback.is_some() {
            self.fallbacks += 1;
        }
        if !routed.queued_for.is_zero() {
            self.queue_waits_ns
                .push(u64::try_from(routed.queued_for.as_nanos()).unwrap_or(u64::MAX));
        }
        let Some(e) = self.rows.index(routed.decision.row) else {
            // Cannot happen: the cluster has exactly the mapped rows.
            self.host.complete(routed.id);
            *self
                .errors
                .entry(format!("routed to unknown row {:?}", routed.decision.row))
                .or_default() += 1;
            self.ended(job);
            return;
        };
        self.requests_per_row[e] += 1;
        let j = &mut self.jobs[job as usize];
        j.engine = Some(e as u32);
        j.host_id = routed.id;
        j.dispatched_ns = self.now;
        if self.api_overhead_ns > 0 {
            let at = self.now.saturating_add(self.api_overhead_ns);
            self.to_engine.push(Reverse((at, job)));
        } else {
            self.join_engine(job);
        }
    }

    /// A dispatched request joins its engine's queue.
    fn join_engine(&mut self, job: u32) {
        let Some(e) = self.jobs[job as usize].engine.map(|e| e as usize) else {
            return;
        };
        let host_id = self.jobs[job as usize].host_id;
        let now = self.now;
        match self.engines[e].enqueue(
            job,
            now,
            &mut self.jobs,
            &self.workload.requests,
            &mut self.out,
        ) {
            Ok(()) => {
                self.reached[job as usize] = true;
                self.reschedule(e);
            }
            Err(too_large) => {
                self.host.complete(host_id);
                *self
                    .errors
                    .entry(format!(
                        "request needs more KV blocks (prompt + output) than an engine holds ({})",
                        too_large.capacity
                    ))
                    .or_default() += 1;
                self.ended(job);
            }
        }
    }
}

fn elapsed_ns(started: Instant) -> u64 {
    u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::replay::{prepare_text, EngineSpec, Setup};

    const CONFIG: &str = "block_size: 4\nworker_selection:\n  aggregated: default\n";

    fn config(spec: EngineSpec) -> RunConfig {
        let mut setup = Setup::new(1, 1);
        setup.engine = EngineSpec {
            max_num_batched_tokens: Some(8),
            max_num_seqs: Some(4),
            step_overhead_ms: Some(1.0),
            decode_ms_per_seq: Some(0.5),
            prefill_ms_per_token: Some(0.25),
            ..spec
        };
        prepare_text("t.yaml", CONFIG, &setup, 4).unwrap()
    }

    fn workload(text: &str) -> Workload {
        Workload::from_jsonl_reader(text.as_bytes(), "t.jsonl", 4).unwrap()
    }

    fn run_one(w: &Workload, spec: EngineSpec) -> RunOutput {
        let shape = Shape {
            workers: 1,
            dp_size: 1,
        };
        run(w, shape, &config(spec), &mut |_| {}).unwrap()
    }

    /// A session of two turns, the second 250 ms (the client's gap) after the first ends; its
    /// timestamp says 1 ms, where the recorded engines had answered the first.
    const SESSION: &str = "\
        {\"timestamp\": 0, \"input_length\": 8, \"output_length\": 3, \"hash_ids\": [1, 2], \"id\": \"a\"}\n\
        {\"timestamp\": 1, \"input_length\": 12, \"output_length\": 1, \"hash_ids\": [1, 2, 3], \"after\": \"a\", \"gap_ms\": 250}\n";

    #[test]
    fn a_closed_loop_turn_arrives_its_gap_after_the_previous_one_ended() {
        let w = workload(SESSION);
        assert!(w.is_closed_loop());
        let out = run_one(&w, EngineSpec::default());
        assert!(out.errors.is_empty(), "{:?}", out.errors);
        let first_end = out.jobs[0].finish_ns.unwrap();
        // 8 prompt tokens in one 3 ms step, then two 1.5 ms decode steps.
        assert_eq!(first_end, 6_000_000);
        assert_eq!(out.jobs[1].arrival_ns, first_end + 250_000_000);
        assert_eq!(out.jobs[1].hit_blocks, 2);
        // Open loop: the timestamp, while the first turn still runs (its blocks are not free
        // yet, but they are cached: the prefill stored them).
        let mut open = w.clone();
        open.open_loop();
        let out = run_one(&open, EngineSpec::default());
        assert_eq!(out.jobs[1].arrival_ns, 1_000_000);
    }

    #[test]
    fn a_refused_request_still_lets_the_one_after_it_arrive() {
        // The first request needs 5 blocks of an engine's 3: refused at once, which ends it, so
        // the one after it arrives its gap after the refusal.
        let w = workload(
            "{\"timestamp\": 0, \"input_length\": 16, \"output_length\": 1, \"hash_ids\": [1, 2, 3, 4], \"id\": 7}\n\
             {\"timestamp\": 0, \"input_length\": 4, \"output_length\": 1, \"hash_ids\": [5], \"after\": 7, \"gap_ms\": 250}\n",
        );
        let out = run_one(
            &w,
            EngineSpec {
                kv_blocks: Some(crate::replay::KvCapacity::Blocks(3)),
                ..EngineSpec::default()
            },
        );
        assert_eq!(out.errors.values().sum::<u64>(), 1, "{:?}", out.errors);
        assert_eq!(out.jobs[1].arrival_ns, 250_000_000);
        assert!(out.jobs[1].finish_ns.is_some());
    }

    #[test]
    fn the_api_overhead_delays_every_request_on_its_way_to_the_engine() {
        let w = workload(
            "{\"timestamp\": 0, \"input_length\": 8, \"output_length\": 1, \"hash_ids\": [1, 2]}\n",
        );
        let plain = run_one(&w, EngineSpec::default());
        let slow = run_one(
            &w,
            EngineSpec {
                api_overhead_ms: Some(65.0),
                ..EngineSpec::default()
            },
        );
        let ttft = |o: &RunOutput| o.jobs[0].first_token_ns.unwrap() - o.jobs[0].arrival_ns;
        assert_eq!(ttft(&slow), ttft(&plain) + 65_000_000);
        assert_eq!(slow.jobs[0].admitted_ns, Some(65_000_000));
        assert_eq!(slow.jobs[0].dispatched_ns, 0);
    }
}
