//! Where `serve`'s CPU goes on a 16 KB completion prompt, stage by stage, as the pipeline runs
//! them (docs/performance.md, "Long prompts: the CPU split"): `parse` (the body into its
//! fields, `request::parse`), `tokenize` (the local tokenizer, `LocalTokenizer::tokenize_all`),
//! `hash` (token ids to block ids, the core's `BlockHasher`), `decide` (the routing core's
//! decision on its KV index, then the release: the built-in `default` policy, which reads
//! cache overlap and load as two-tier does, on two engines) and `forward` (the body rewritten
//! with the ids, `serve.forward_token_ids`). The relay itself (HTTP in and out) is the `serve`
//! bench's: `ROUTER_BENCH_SERVE_PROMPT_BYTES=16384` there.
//!
//! Tokenizer: the rig's tiny model's trained byte-level BPE (`tests/data/bpe-tokenizer`).
//! Prompts as the live bench makes them (the vocabulary's words, one in 12 made up, full stops):
//! 64 prompts of 16 KiB in turn, each a 4 KiB preamble they share and 12 KiB of their own.
//! `tokenize` runs three ways: `shared-preamble` (the 64 prompts: the preamble from the prefix
//! cache, the rest through the word cache), `repeated` (one prompt again and again: all but
//! its last chunk from the prefix cache) and `uncached` (`cache_mib: 0`: `tokenizers` on the
//! whole text, what serve did for every prompt before the word split).
//!
//! `cargo bench -p router-host --bench prompt_cpu`; `-- --test` runs each once.

mod common;

use std::hint::black_box;

use common::prose::{self, dir, vocabulary_words, Length};
use criterion::Throughput;
use router_core::blocks::{BlockHasher, Tenant};
use router_host::config::RouterConfig;
use router_host::host::Host;
use router_host::kv_index::{KvEventKind, Tier};
use router_host::loader::SearchPath;
use router_host::model::{Cluster, Request, RowId, Worker};
use router_host::policy_set::PolicySet;
use router_host::serve::pipeline::with_token_ids;
use router_host::serve::request::{parse, Endpoint};
use router_host::serve::tokenize::LocalTokenizer;

const PROMPTS: usize = 64;
const PROMPT_BYTES: usize = 16 << 10;
const PREAMBLE_BYTES: usize = 4 << 10;
const BLOCK_SIZE: u32 = 16;

/// About `bytes` of text (`common::prose`).
fn text(words: &[String], bytes: usize, rng: &mut common::Rng) -> String {
    prose::text(words, Length::Bytes(bytes), rng)
}

/// 64 completion bodies: the shared preamble, then text of their own, not streamed.
fn bodies(words: &[String]) -> Vec<Vec<u8>> {
    let mut rng = common::Rng::new(16);
    let preamble = text(words, PREAMBLE_BYTES, &mut rng);
    (0..PROMPTS)
        .map(|_| {
            let own = text(words, PROMPT_BYTES - PREAMBLE_BYTES, &mut rng);
            serde_json::json!({"model": "tiny", "prompt": format!("{preamble} {own}"),
                "max_tokens": 4})
            .to_string()
            .into_bytes()
        })
        .collect()
}

/// A host on two engines with the built-in `default` policy (cache overlap and load), its index
/// holding the shared preamble's blocks on the first engine.
fn host(preamble_blocks: &[u64]) -> Host {
    let yaml = format!(
        "block_size: {BLOCK_SIZE}\nworkers:\n  - {{id: 1, url: \"http://127.0.0.1:9\"}}\n  \
         - {{id: 2, url: \"http://127.0.0.1:9\"}}\n"
    );
    let config = RouterConfig::from_yaml_str(&yaml, None).expect("config");
    let policies = PolicySet::from_config(&config, &SearchPath::default()).expect("policies");
    let cluster = Cluster::new(vec![Worker::new(1), Worker::new(2)]).expect("cluster");
    let host = Host::new(policies, cluster, &config);
    let stored = preamble_blocks
        .iter()
        .map(|&b| (KvEventKind::Stored, Tier::Device, b));
    let row = RowId {
        worker_id: 1,
        dp_rank: 0,
    };
    assert!(host.core().apply_kv_events(row, stored));
    host
}

fn main() {
    let words = vocabulary_words();
    let bodies = bodies(&words);
    let cached = LocalTokenizer::load(&dir())
        .expect("fixture")
        .with_segment_cache(64 << 20);
    let uncached = LocalTokenizer::load(&dir()).expect("fixture");
    assert!(
        cached.prefix_stats().is_some(),
        "the prefix cache is on for this tokenizer"
    );
    let parsed: Vec<_> = bodies
        .iter()
        .map(|b| parse(Endpoint::Completions, b).expect("a completion"))
        .collect();
    let ids: Vec<Vec<Vec<u32>>> = parsed
        .iter()
        .map(|p| {
            let want: Vec<Vec<u32>> = uncached
                .tokenize_all(p)
                .expect("ids")
                .into_iter()
                .map(|t| t.ids)
                .collect();
            let got: Vec<Vec<u32>> = cached
                .tokenize_all(p)
                .expect("ids")
                .into_iter()
                .map(|t| t.ids)
                .collect();
            assert_eq!(got, want, "the caches give tokenizers' ids");
            want
        })
        .collect();
    let hasher = BlockHasher::new(BLOCK_SIZE, Tenant::default()).expect("hasher");
    let blocks: Vec<Vec<u64>> = ids
        .iter()
        .map(|ids| {
            let mut out = Vec::new();
            hasher.prompt_blocks(&ids[0], &mut out);
            out
        })
        .collect();
    // The preamble's whole blocks: those every prompt starts with.
    let shared = blocks[0]
        .iter()
        .zip(&blocks[1])
        .take_while(|(a, b)| a == b)
        .count();
    let host = host(&blocks[0][..shared]);
    let requests: Vec<Request> = ids
        .iter()
        .zip(&blocks)
        .map(|(ids, blocks)| Request {
            isl_tokens: ids[0].len() as u64,
            blocks: blocks.clone(),
            ..Request::default()
        })
        .collect();
    let tokens = ids.iter().map(|i| i[0].len()).sum::<usize>() / PROMPTS;
    println!(
        "16 KiB prompts: {} bytes of body, {tokens} tokens, {} blocks, {shared} shared",
        bodies[0].len(),
        blocks[0].len()
    );

    let mut c = common::criterion();
    let mut group = c.benchmark_group("prompt_cpu");
    group.throughput(Throughput::Bytes(bodies[0].len() as u64));
    let mut next = 0;
    let mut turn = || {
        next = (next + 1) % PROMPTS;
        next
    };
    group.bench_function("parse", |b| {
        b.iter(|| parse(Endpoint::Completions, black_box(&bodies[turn()])))
    });
    group.bench_function("tokenize/shared-preamble", |b| {
        b.iter(|| cached.tokenize_all(black_box(&parsed[turn()])))
    });
    group.bench_function("tokenize/repeated", |b| {
        b.iter(|| cached.tokenize_all(black_box(&parsed[0])))
    });
    group.bench_function("tokenize/uncached", |b| {
        b.iter(|| uncached.tokenize_all(black_box(&parsed[turn()])))
    });
    let mut out = Vec::new();
    group.bench_function("hash", |b| {
        b.iter(|| {
            out.clear();
            hasher.prompt_blocks(black_box(&ids[turn()][0]), &mut out);
        })
    });
    group.bench_function("decide", |b| {
        b.iter(|| {
            let core = host.core();
            let routed = core
                .route_indexed(black_box(&requests[turn()]), false)
                .expect("routed");
            core.complete(routed.id);
        })
    });
    group.bench_function("forward", |b| {
        b.iter(|| {
            let i = turn();
            with_token_ids(Endpoint::Completions, &parsed[i], black_box(&ids[i]))
        })
    });
    group.finish();
    c.final_summary();
    if let Some(stats) = cached.prefix_stats() {
        println!("prefix cache: {stats:?}");
    }
    if common::quick_mode() {
        return;
    }
    // Above, the 64 prompts come back every 64 iterations, so from the second round on the
    // prefix cache holds all of each but its tail. Here every prompt is new: the preamble's
    // chunks come from the cache, the rest is split into words (one in 12 made up, new to the
    // word cache).
    let mut rng = common::Rng::new(17);
    let preamble = match parsed[0].body.get("prompt") {
        Some(serde_json::Value::String(p)) => p[..PREAMBLE_BYTES].to_owned(),
        _ => unreachable!("a text prompt"),
    };
    let fresh: Vec<_> = (0..256)
        .map(|_| {
            let own = text(&words, PROMPT_BYTES - PREAMBLE_BYTES, &mut rng);
            let body = serde_json::json!({"model": "tiny", "prompt": format!("{preamble} {own}"),
                "max_tokens": 4});
            parse(Endpoint::Completions, body.to_string().as_bytes()).expect("a completion")
        })
        .collect();
    let start = std::time::Instant::now();
    for p in &fresh {
        black_box(cached.tokenize_all(p).expect("ids"));
    }
    println!(
        "tokenize, 16 KiB prompts never seen before but for the preamble (mean of {}): {:?}",
        fresh.len(),
        start.elapsed() / fresh.len() as u32
    );
}
