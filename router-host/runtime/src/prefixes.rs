//! Exact token ids for long prompts that repeat a preamble (a system prompt, few-shot examples,
//! a document asked about again): the ids of a prompt's leading chunks are cached, keyed by
//! the whole text before them, so a preamble seen before is not tokenized again.
//!
//! Used for the open end of a prompt (the text after its last added token, which the segment
//! cache never holds: all of a completion prompt without added tokens), and only for byte-level
//! BPE tokenizers whose words serve/words.rs splits itself with one of the split patterns named
//! in [`super::words`]'s `CUT_SAFE_PATTERNS` (GPT-2's, Llama 3's, Qwen 2's); for any other
//! tokenizer the log says why at start-up (`prefix cache off`) and nothing is cached.
//!
//! **Where a text is cut.** A byte-level BPE merges only inside a word, and the words are
//! what the pre-tokenizer's regex matches, scanning left to right, each match starting where
//! the one before ended. A cut goes at a space right after an ASCII letter: position `c` with
//! `text[c - 1]` a letter and `text[c]` `' '`. In every pattern of `CUT_SAFE_PATTERNS` no
//! alternative can match a letter followed by whitespace (letter runs hold only letters after
//! an optional first character, contractions end with their letter, the other alternatives hold
//! no letter), so the word holding `text[c - 1]` ends at `c` and the next starts there, for any
//! text that has those same bytes before `c` and a space at `c`: the words before the cut, and
//! so their ids, do not depend on what follows it, and the words after it are those of
//! `text[c..]` on its own. The chunks' ids in order, then the tail's, are the whole text's ids;
//! the tests compare them with `tokenizers` on random prompts.
//!
//! **Where the cuts are.** The first cut at least [`CHUNK_BYTES`] after the previous one (the
//! text's start for the first): it depends only on the bytes before it and the space at it, so
//! two prompts that share a preamble have the same cuts in it. The part after the last cut is
//! tokenized every time and never cached.
//!
//! **Keys.** A chunk's entry is keyed by its parent entry's number (0 for a text's first chunk)
//! and its own text, compared in full; numbers are never reused, so a hit means the whole text
//! before the chunk is the one it was cached after. An evicted parent leaves its children
//! unreachable until they are evicted in turn. The cache is bounded by bytes (texts, ids and
//! overhead).

use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use quick_cache::Equivalent;
use tokenizers::Tokenizer;

use super::cache_stats::{CacheStats, Counters};
use super::words::Words;

/// The least text between two cuts.
pub const CHUNK_BYTES: usize = 1024;

/// What an entry costs beyond its text and ids (key, value and the cache's own slot).
const ENTRY_OVERHEAD: u64 = 96;

#[derive(PartialEq, Eq)]
struct ChunkKey {
    parent: u64,
    text: Box<str>,
}

impl Hash for ChunkKey {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.parent.hash(state);
        (*self.text).hash(state);
    }
}

/// A lookup's key, borrowing the prompt's text: hashes and compares as [`ChunkKey`].
struct ChunkRef<'a> {
    parent: u64,
    text: &'a str,
}

impl Hash for ChunkRef<'_> {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.parent.hash(state);
        self.text.hash(state);
    }
}

impl Equivalent<ChunkKey> for ChunkRef<'_> {
    fn equivalent(&self, key: &ChunkKey) -> bool {
        self.parent == key.parent && self.text == &*key.text
    }
}

/// A cached chunk: its number (the parent of the next chunk) and its ids.
struct Chunk {
    number: u64,
    ids: Box<[u32]>,
}

#[derive(Clone)]
struct ChunkWeight;

impl quick_cache::Weighter<ChunkKey, Arc<Chunk>> for ChunkWeight {
    fn weight(&self, key: &ChunkKey, chunk: &Arc<Chunk>) -> u64 {
        key.text.len() as u64 + 4 * chunk.ids.len() as u64 + ENTRY_OVERHEAD
    }
}

/// The cached chunks of prompts' open ends.
pub struct Prefixes {
    cache: quick_cache::sync::Cache<ChunkKey, Arc<Chunk>, ChunkWeight>,
    /// The last chunk number given out (0 is the root: no chunk).
    numbers: AtomicU64,
    counters: Counters,
}

impl std::fmt::Debug for Prefixes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Prefixes")
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

/// The first cut at or after `from`: a space right after an ASCII letter (see the module docs).
/// Always a character boundary (both bytes are ASCII), and never the text's last byte's end.
pub fn next_cut(text: &[u8], from: usize) -> Option<usize> {
    let from = from.max(1);
    (from..text.len()).find(|&c| text[c] == b' ' && text[c - 1].is_ascii_alphabetic())
}

impl Prefixes {
    /// A cache of at most `capacity_bytes`.
    pub fn new(capacity_bytes: u64) -> Prefixes {
        let per_entry = (2 * CHUNK_BYTES) as u64 + ENTRY_OVERHEAD;
        Prefixes {
            cache: quick_cache::sync::Cache::with_weighter(
                (capacity_bytes / per_entry).clamp(16, 1 << 20) as usize,
                capacity_bytes.max(1),
                ChunkWeight,
            ),
            numbers: AtomicU64::new(0),
            counters: Counters::default(),
        }
    }

    /// Empty the cache and zero the counters (after probes, so they count only requests).
    pub fn reset(&self) {
        self.cache.clear();
        self.counters.reset();
    }

    /// Append the ids of `text` (a piece without added tokens, no special tokens around it), as
    /// `words.encode` gives them for the whole text: its leading chunks from the cache while
    /// they are there, the rest tokenized by `words` chunk by chunk (each new chunk cached).
    pub fn encode(
        &self,
        words: &Words,
        tokenizer: &Tokenizer,
        text: &str,
        out: &mut Vec<u32>,
    ) -> tokenizers::Result<()> {
        let bytes = text.as_bytes();
        let mut parent = 0u64;
        let mut start = 0usize;
        // Whether the chunks so far came from the cache: after a miss every later chunk's
        // parent is new, so it is not looked up.
        let mut cached = true;
        let (mut hits, mut misses) = (0u64, 0u64);
        while let Some(cut) = next_cut(bytes, start + CHUNK_BYTES) {
            let chunk = &text[start..cut];
            if cached {
                if let Some(found) = self.cache.get(&ChunkRef {
                    parent,
                    text: chunk,
                }) {
                    hits += 1;
                    out.extend_from_slice(&found.ids);
                    parent = found.number;
                    start = cut;
                    continue;
                }
                cached = false;
            }
            misses += 1;
            let from = out.len();
            words.encode(tokenizer, chunk, out)?;
            let number = self.numbers.fetch_add(1, Ordering::Relaxed) + 1;
            self.cache.insert(
                ChunkKey {
                    parent,
                    text: chunk.into(),
                },
                Arc::new(Chunk {
                    number,
                    ids: out[from..].into(),
                }),
            );
            parent = number;
            start = cut;
        }
        self.counters.hit(hits);
        self.counters.miss(misses);
        words.encode(tokenizer, &text[start..], out)
    }

    /// Chunks looked up (hits: ids from the cache; misses: tokenized and cached), and what the
    /// cache holds now.
    pub fn stats(&self) -> CacheStats {
        self.counters.stats(&self.cache)
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_tokenizers::*;
    use super::*;

    /// Deterministic pseudo-random numbers.
    struct Rng(u64);

    impl Rng {
        fn below(&mut self, n: usize) -> usize {
            self.0 = self
                .0
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (self.0 >> 33) as usize % n
        }
    }

    /// Text made of the pieces that make splits and merges differ around a cut: words, spaces
    /// before and after them, runs of whitespace, line ends, digits, contractions, punctuation,
    /// accents, CJK and emoji.
    fn random_text(rng: &mut Rng, bytes: usize) -> String {
        let parts = [
            "the", " the", "a", " a", "bZ", " word", "router", "é", " naïve", "東京", "😀", "1",
            " 23", "4567", " ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", "\u{3000}", "\u{a0}", "'",
            "'s", "'LL", " don't", ".", ",", "!?", "-", "_", " .", "\t ", " \n", "x'", "ß",
            "\u{200b}", " x", "y ", "z  ",
        ];
        let mut text = String::new();
        while text.len() < bytes {
            text.push_str(parts[rng.below(parts.len())]);
        }
        text
    }

    fn cut_safe_shapes() -> Vec<(&'static str, Tokenizer)> {
        let trained = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../tests/data/bpe-tokenizer/tokenizer.json");
        vec![
            ("gpt2", byte_level_bpe(gpt2_pre_tokenizer())),
            (
                "llama3",
                byte_level_bpe(split_pre_tokenizer(LLAMA3_PATTERN)),
            ),
            ("qwen2", byte_level_bpe(split_pre_tokenizer(QWEN2_PATTERN))),
            (
                "bpe-tokenizer fixture",
                Tokenizer::from_file(trained).expect("the fixture"),
            ),
        ]
    }

    #[test]
    fn cuts_are_spaces_after_letters_at_least_a_chunk_apart() {
        let text = format!("{}ab c{}", "x".repeat(CHUNK_BYTES - 2), "y".repeat(10));
        assert_eq!(next_cut(text.as_bytes(), CHUNK_BYTES), Some(CHUNK_BYTES));
        assert_eq!(next_cut(b"a1 b", 0), None, "a digit before the space");
        assert_eq!(next_cut(b"ab", 0), None);
        assert_eq!(next_cut(b" a b", 0), Some(2), "never at 0");
        assert_eq!(next_cut("é b".as_bytes(), 0), None, "only ASCII letters");
    }

    #[test]
    fn ids_with_the_cache_are_the_tokenizers_own_for_shared_preambles() {
        for (name, tok) in cut_safe_shapes() {
            let words = Words::new(&tok, 1 << 20).unwrap_or_else(|why| panic!("{name}: {why}"));
            assert!(words.cut_safe(), "{name}");
            let prefixes = Prefixes::new(4 << 20);
            let mut rng = Rng(17);
            let preambles: Vec<String> = (0..3)
                .map(|i| random_text(&mut rng, [CHUNK_BYTES / 2, 2500, 4500][i]))
                .collect();
            for round in 0..40 {
                let preamble = &preambles[rng.below(preambles.len())];
                // The same preamble, then text of its own, sometimes cut inside the preamble.
                let mut text = preamble.clone();
                if rng.below(5) == 0 {
                    let mut end = rng.below(text.len());
                    while !text.is_char_boundary(end) {
                        end -= 1;
                    }
                    text.truncate(end);
                }
                let own = rng.below(2000);
                text.push_str(&random_text(&mut rng, own));
                let want = tok.encode_fast(text.as_str(), false).unwrap();
                let mut got = Vec::new();
                prefixes.encode(&words, &tok, &text, &mut got).unwrap();
                assert_eq!(got, want.get_ids(), "{name}, round {round}");
            }
            let stats = prefixes.stats();
            assert!(
                stats.hits > 30,
                "{name}: preambles come from the cache: {stats:?}"
            );
        }
    }

    #[test]
    fn a_cut_never_joins_what_the_tokenizer_merges() {
        // The fixture's merges join a space to the letter before it as well as after it: only
        // the words' own split keeps " a" together; here every chunk ends with "a" and the
        // next starts with " a".
        let tok = byte_level_bpe(gpt2_pre_tokenizer());
        let words = Words::new(&tok, 1 << 20).unwrap();
        let prefixes = Prefixes::new(1 << 20);
        let text = "a ".repeat(3 * CHUNK_BYTES);
        for _ in 0..2 {
            let mut got = Vec::new();
            prefixes.encode(&words, &tok, &text, &mut got).unwrap();
            assert_eq!(
                got,
                tok.encode_fast(text.as_str(), false).unwrap().get_ids()
            );
        }
        assert!(prefixes.stats().hits >= 2, "{:?}", prefixes.stats());
    }

    #[test]
    fn the_cache_stays_within_its_bytes() {
        let tok = byte_level_bpe(gpt2_pre_tokenizer());
        let words = Words::new(&tok, 1 << 20).unwrap();
        let prefixes = Prefixes::new(64 << 10);
        let mut rng = Rng(5);
        for _ in 0..100 {
            let text = random_text(&mut rng, 8 * CHUNK_BYTES);
            let mut out = Vec::new();
            prefixes.encode(&words, &tok, &text, &mut out).unwrap();
        }
        let stats = prefixes.stats();
        assert!(stats.misses > 200, "{stats:?}");
        assert!(stats.bytes <= 64 << 10, "{stats:?}");
    }
}
