//! serve's local tokenizer on a trained byte-level BPE (`tests/data/bpe-tokenizer`, the rig's
//! tiny model's), against HF `tokenizers` tokenizing the same text whole (docs/performance.md,
//! "Local tokenization").
//!
//! The prompts are made as the live bench's are (`scripts/live_bench/overhead.py`): words of the
//! tokenizer's vocabulary, one in 12 made up (so BPE splits it, and it is new to the word cache),
//! a full stop every 6 to 20 words. 64 different prompts are tokenized in turn, each with
//! special tokens (as a completion prompt is), so the segment cache never holds one.
//!
//! * `whole/*`: `Tokenizer::encode_fast` on the whole text (serve without its caches,
//!   `tokenizer: {path, cache_mib: 0}`).
//! * `serve/*`: `LocalTokenizer::encode` as serve runs it (`cache_mib` 64): the text split
//!   into words by serve/words.rs, each word's ids cached.
//!
//! The `serve` figures repeat the 64 prompts' made-up words; after criterion the bench prints
//! the mean over 256 prompts never seen before (every made-up word new to the cache).
//!
//! Sizes: `4k` (about 4,096 tokens, the live bench's long prompts) and `50` (its short ones).
//! Throughput is in tokens. `cargo bench -p router-host --bench tokenize`.

mod common;

use std::hint::black_box;

use common::prose::{self, dir, vocabulary_words, Length};
use criterion::Throughput;
use router_host::serve::tokenize::LocalTokenizer;

const PROMPTS: usize = 64;

fn prompts(words: &[String], count: usize, words_each: usize, seed: u64) -> Vec<String> {
    let mut rng = common::Rng::new(seed);
    (0..count)
        .map(|_| prose::text(words, Length::Words(words_each), &mut rng))
        .collect()
}

fn main() {
    let words = vocabulary_words();
    let whole = tokenizers::Tokenizer::from_file(dir().join("tokenizer.json")).expect("fixture");
    let serve = LocalTokenizer::load(&dir())
        .expect("fixture")
        .with_segment_cache(64 << 20);
    assert!(
        serve.word_stats().is_some(),
        "the word split is on for this tokenizer"
    );
    let mut c = common::criterion();
    for (size, words_each) in [("4k", 2_900), ("50", 36)] {
        let texts = prompts(&words, PROMPTS, words_each, 7);
        let tokens: usize = texts
            .iter()
            .map(|t| whole.encode_fast(t.as_str(), true).expect("ids").len())
            .sum();
        for t in &texts {
            let want = whole.encode_fast(t.as_str(), true).expect("ids");
            assert_eq!(serve.encode(t, true).expect("ids"), want.get_ids());
        }
        let mut group = c.benchmark_group("tokenize");
        group.throughput(Throughput::Elements((tokens / PROMPTS) as u64));
        let mut next = 0;
        group.bench_function(format!("whole/{size}"), |b| {
            b.iter(|| {
                next = (next + 1) % PROMPTS;
                whole.encode_fast(black_box(texts[next].as_str()), true)
            })
        });
        group.bench_function(format!("serve/{size}"), |b| {
            b.iter(|| {
                next = (next + 1) % PROMPTS;
                serve.encode(black_box(&texts[next]), true)
            })
        });
        group.finish();
    }
    c.final_summary();
    if let Some(stats) = serve.word_stats() {
        println!("word cache: {stats:?}");
    }
    if common::quick_mode() {
        return;
    }
    // Above, the 64 prompts' made-up words come back every 64 iterations and hit the cache
    // from the second round on. Here every prompt is new (new made-up words: one word in 12
    // misses the cache), as text never seen before is; the vocabulary's words are cached.
    let fresh = prompts(&words, 256, 2_900, 8);
    let start = std::time::Instant::now();
    for t in &fresh {
        black_box(serve.encode(t, true).expect("ids"));
    }
    let serve_new = start.elapsed() / fresh.len() as u32;
    let start = std::time::Instant::now();
    for t in &fresh {
        black_box(whole.encode_fast(t.as_str(), true).expect("ids"));
    }
    let whole_new = start.elapsed() / fresh.len() as u32;
    println!(
        "4k prompts never seen before (mean of {}): serve {serve_new:?}, whole {whole_new:?}",
        fresh.len()
    );
}
