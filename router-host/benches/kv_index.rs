//! The replay's KV-overlap index (`replay::kv_index::KvIndex`).
//!
//! Contents: 16 workers x 8 ranks (128 rows); every worker caches 1,000 prompts' worth of blocks
//! (125 prompts of 256 blocks on each rank), prompts drawn from a pool of 4,000 that share 8
//! tenants' 32-block system prompts. About 0.9 M distinct blocks, 3.6 M (row, block) pairs.
//!
//! * `lookup/cached_prompt`: overlap of a pool prompt for every row; the rows caching it keep
//!   matching to the end, so the walk covers all 256 blocks (the expensive case).
//! * `lookup/cached_prompt_rotating`: the same over 1,024 different cached prompts in turn, so
//!   the index entries are not left in the CPU caches by the previous lookup (the realistic case).
//! * `lookup/churned_prompt_rotating`: as `cached_prompt_rotating`, over 1,024 prompts cached
//!   after a churn (below) had every row replace all 125 of its prompts and 35 more, so their
//!   blocks sit in reused slots, as in an index that has run for a while.
//! * `lookup/new_prompt`: a prompt no row has seen beyond its tenant's system prompt: the walk
//!   stops after 33 blocks (the common case for a first turn).
//! * `events/churn`: one rank drops its oldest prompt (224 `Evicted` events: the system prompt
//!   stays) and caches a new one (224 `Stored` events for blocks no row holds yet). Over a run,
//!   as the shared pool prompts age out everywhere the index grows from 0.9 M to 3.6 M distinct
//!   blocks (every new prompt is unique), while the (row, block) pairs stay about the same.
//!
//! Throughput is reported per lookup (one request, all rows) and per event.

mod common;

use std::collections::VecDeque;
use std::hint::black_box;

use criterion::Throughput;

use common::{CacheFixture, Rng, PREFIX_BLOCKS, RANKS, WORKERS};

/// The churn: ranks in turn drop their oldest prompt and cache a fresh one.
struct Churn {
    next_row: usize,
    rng: Rng,
    /// Fresh prompts each row cached during the churn, oldest first (evicted after the row's
    /// pool prompts are gone).
    fresh: Vec<VecDeque<Vec<u64>>>,
}

impl Churn {
    fn new(rows: usize) -> Self {
        Churn {
            next_row: 0,
            rng: Rng::new(5),
            fresh: vec![VecDeque::new(); rows],
        }
    }

    /// One eviction and one new prompt on the next row; returns the events applied.
    fn step(&mut self, f: &mut CacheFixture) -> u64 {
        let row = self.next_row;
        self.next_row = (self.next_row + 1) % f.held.len();
        let mut events = 0;
        let mut evict = |blocks: &[u64]| {
            for &block in &blocks[PREFIX_BLOCKS..] {
                f.index.apply(&common::evicted(row as u32, block));
                events += 1;
            }
        };
        let mut buffer = match f.held[row].pop_front() {
            Some(old) => {
                evict(&f.prompts[old]);
                Vec::with_capacity(common::PROMPT_BLOCKS)
            }
            None => {
                let old = self.fresh[row]
                    .pop_front()
                    .expect("every row holds prompts");
                evict(&old);
                old
            }
        };
        buffer.clear();
        buffer.extend_from_slice(&CacheFixture::prompt(&mut self.rng, common::TENANTS));
        for &block in &buffer[PREFIX_BLOCKS..] {
            f.index.apply(&common::stored(row as u32, block));
            events += 1;
        }
        self.fresh[row].push_back(buffer);
        events
    }
}

fn main() {
    let rows = (WORKERS * RANKS) as usize;
    let mut f = CacheFixture::new(rows, 4_000, 125, 7);
    println!(
        "KV index: {} distinct blocks, {} (row, block) pairs over {rows} rows",
        f.index.len(),
        f.holdings()
    );
    let cached = f.prompts[f.held[3][0]].clone();
    // Prompts some row caches whole, one per row and rank position: a lookup per iteration
    // through different parts of the index, as consecutive requests would.
    let rotation: Vec<Vec<u64>> = (0..1024)
        .map(|i| f.prompts[f.held[i % rows][i / rows]].clone())
        .collect();
    let mut next = 0;
    let mut rng = Rng::new(99);
    let mut fresh = CacheFixture::prompt(&mut rng, common::TENANTS);
    for b in &mut fresh[PREFIX_BLOCKS + 1..] {
        *b = common::fresh_block(&mut rng);
    }
    let (mut out, mut alive) = (Vec::new(), Vec::new());
    f.index.overlaps(&cached, &mut out, &mut alive);
    let holders = out.iter().filter(|&&d| d as usize == cached.len()).count();
    assert!(holders >= 1, "the cached prompt is held by some row");
    f.index.overlaps(&fresh, &mut out, &mut alive);
    assert!(out.iter().all(|&d| d as usize <= PREFIX_BLOCKS));
    let mut churn = Churn::new(rows);
    // An index that has run for a while (a second one, so the lookups above keep theirs): every
    // row replaced all of its prompts and then some, so the later ones reuse the slots of
    // earlier churned prompts. The rotation holds the last prompt each row stored, and so on back.
    let mut aged = CacheFixture::new(rows, 4_000, 125, 7);
    let mut aging = Churn::new(rows);
    for _ in 0..160 * rows {
        aging.step(&mut aged);
    }
    let churned: Vec<Vec<u64>> = (0..1024)
        .map(|i| aging.fresh[i % rows][124 - i / rows].clone())
        .collect();
    aged.index.overlaps(&churned[0], &mut out, &mut alive);
    assert!(
        out.iter().any(|&d| d as usize == churned[0].len()),
        "a churned prompt is held whole by its row"
    );
    let mut next_churned = 0;

    if let Some((name, _)) = common::profile_request() {
        let iters = common::profile_iters(20_000);
        match name.as_str() {
            "lookup_cached" => common::profile_loop(iters, &mut || {
                f.index.overlaps(black_box(&cached), &mut out, &mut alive)
            }),
            "lookup_new" => common::profile_loop(iters, &mut || {
                f.index.overlaps(black_box(&fresh), &mut out, &mut alive)
            }),
            "churn" => common::profile_loop(iters, &mut || {
                black_box(churn.step(&mut f));
            }),
            other => panic!(
                "ROUTER_BENCH_PROFILE: unknown benchmark `{other}` (lookup_cached, lookup_new, churn)"
            ),
        }
        eprintln!("profiled {name}: {iters} iterations");
        return;
    }

    let mut c = common::criterion();
    {
        let mut group = c.benchmark_group("kv_index");
        group.throughput(Throughput::Elements(1));
        group.bench_function("lookup/cached_prompt", |b| {
            b.iter(|| f.index.overlaps(black_box(&cached), &mut out, &mut alive))
        });
        group.bench_function("lookup/cached_prompt_rotating", |b| {
            b.iter(|| {
                next = (next + 1) % rotation.len();
                f.index
                    .overlaps(black_box(&rotation[next]), &mut out, &mut alive)
            })
        });
        group.bench_function("lookup/churned_prompt_rotating", |b| {
            b.iter(|| {
                next_churned = (next_churned + 1) % churned.len();
                aged.index
                    .overlaps(black_box(&churned[next_churned]), &mut out, &mut alive)
            })
        });
        group.bench_function("lookup/new_prompt", |b| {
            b.iter(|| f.index.overlaps(black_box(&fresh), &mut out, &mut alive))
        });
        let per_step = 2 * (common::PROMPT_BLOCKS - PREFIX_BLOCKS) as u64;
        group.throughput(Throughput::Elements(per_step));
        group.bench_function("events/churn", |b| b.iter(|| black_box(churn.step(&mut f))));
        group.finish();
    }
    c.final_summary();
    println!(
        "after churn: {} distinct blocks, {} pairs",
        f.index.len(),
        f.holdings()
    );
}
