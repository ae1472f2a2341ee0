//! Exact token ids for prompts that repeat their earlier parts, as multi-turn chat does: the ids
//! of each closed segment (the text between two added tokens) are cached.
//!
//! HF `tokenizers` splits a text at its added tokens (`<|user|>`, `<|im_end|>`, ...) before
//! anything else, then normalizes, pre-tokenizes and tokenizes every piece on its own. So the
//! ids of a whole text are the pieces' ids in order, with the added tokens' ids between them and
//! the post-processor's tokens around them. A chat prompt is its system prompt and history
//! (pieces seen in the previous turn) plus one new message; with the pieces cached only the new
//! message is tokenized. The last piece of a text (what follows its last added token: the open
//! end of a prompt, and all of a completion prompt without added tokens) is never cached whole;
//! when it is long, its leading chunks are (serve/prefixes.rs, byte-level BPEs only), so a
//! repeated preamble is not tokenized again.
//!
//! Exact only for tokenizers whose pieces really are independent; [`SegmentCache::new`]
//! refuses the others (the caller then tokenizes whole texts, as before):
//! - an added token that strips the whitespace around it, must be a single word, or is matched
//!   after normalization (its match then depends on its neighbours);
//! - a pre-tokenizer that depends on a piece's position in the text (`Metaspace` adds its `▁`
//!   to the text's first piece only), or one this file does not know;
//! - truncation or padding (applied to the whole text), `encode_special_tokens` (added tokens
//!   then are not split out);
//! - a post-processor that does not just put fixed tokens before and after the text;
//! - any probe text (added tokens between texts with and without whitespace, digits, accents)
//!   whose ids differ from the whole text's.

use std::sync::Arc;

use aho_corasick::{AhoCorasick, MatchKind};
use tokenizers::Tokenizer;

use super::cache_stats::{CacheStats, Counters};
use super::prefixes::{Prefixes, CHUNK_BYTES};
use super::words::{WordStats, Words};

/// Pieces shorter than this are tokenized every time (cheaper than hashing and storing them).
const MIN_CACHED_BYTES: usize = 64;

/// The share of the cache's bytes that goes to single words (serve/words.rs): 1/8.
const WORD_SHARE_SHIFT: u32 = 3;

/// The share that goes to the chunks of open ends (serve/prefixes.rs): 3/8 (the segments keep
/// the other half).
fn prefix_share(capacity_bytes: u64) -> u64 {
    capacity_bytes / 8 * 3
}

/// What an entry costs beyond its text and ids (key and value headers, the cache's own slot).
const ENTRY_OVERHEAD: u64 = 64;

#[derive(Clone)]
struct ByteWeight;

impl quick_cache::Weighter<Box<str>, Arc<[u32]>> for ByteWeight {
    fn weight(&self, key: &Box<str>, ids: &Arc<[u32]>) -> u64 {
        key.len() as u64 + 4 * ids.len() as u64 + ENTRY_OVERHEAD
    }
}

/// A tokenizer's added tokens and what its post-processor adds, with the closed pieces' ids.
pub struct SegmentCache {
    /// How pieces are tokenized: split into words here (serve/words.rs) when that is exact for
    /// this tokenizer, else by `tokenizers` itself.
    words: Option<Words>,
    /// Why `words` is `None`.
    words_off: Option<String>,
    /// The chunks of long open ends, when `words` is on and allows cuts.
    prefixes: Option<Prefixes>,
    /// Why `prefixes` is `None`.
    prefixes_off: Option<String>,
    /// The added tokens' texts, leftmost-longest as `tokenizers` matches them.
    added: AhoCorasick,
    /// Pattern index → token id.
    added_ids: Vec<u32>,
    /// What the post-processor puts before and after a single text's ids.
    before: Vec<u32>,
    after: Vec<u32>,
    cache: quick_cache::sync::Cache<Box<str>, Arc<[u32]>, ByteWeight>,
    counters: Counters,
}

impl std::fmt::Debug for SegmentCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SegmentCache")
            .field("added_tokens", &self.added_ids.len())
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

/// Pre-tokenizers that treat every piece alike, wherever it is in the text.
const POSITION_FREE_PRE_TOKENIZERS: &[&str] = &[
    "ByteLevel",
    "Split",
    "Digits",
    "Punctuation",
    "Whitespace",
    "WhitespaceSplit",
    "BertPreTokenizer",
    "UnicodeScripts",
    "CharDelimiterSplit",
];

/// Why `pre_tokenizer` (as `tokenizer.json` spells it) may depend on a piece's position.
fn position_dependent(pre_tokenizer: &serde_json::Value) -> Option<String> {
    let kind = pre_tokenizer
        .get("type")
        .and_then(serde_json::Value::as_str)
        .unwrap_or("?");
    if kind == "Sequence" {
        let inner = pre_tokenizer
            .get("pretokenizers")
            .and_then(serde_json::Value::as_array);
        return match inner {
            Some(inner) => inner.iter().find_map(position_dependent),
            None => Some("a pre-tokenizer Sequence without its list".to_owned()),
        };
    }
    (!POSITION_FREE_PRE_TOKENIZERS.contains(&kind))
        .then(|| format!("pre-tokenizer `{kind}` may treat the first piece of a text differently"))
}

fn ids(tokenizer: &Tokenizer, text: &str, special: bool) -> Result<Vec<u32>, String> {
    tokenizer
        .encode_fast(text, special)
        .map(|e| e.get_ids().to_vec())
        .map_err(|err| format!("cannot tokenize a probe: {err}"))
}

impl SegmentCache {
    /// A cache of at most `capacity_bytes` for `tokenizer`, or why its pieces are not
    /// independent (then nothing may be cached: see the module docs).
    pub fn new(tokenizer: &Tokenizer, capacity_bytes: u64) -> Result<SegmentCache, String> {
        if tokenizer.get_truncation().is_some() || tokenizer.get_padding().is_some() {
            return Err("tokenizer.json sets truncation or padding".to_owned());
        }
        if tokenizer.get_encode_special_tokens() {
            return Err("tokenizer.json encodes special tokens as text".to_owned());
        }
        if let Some(pre) = tokenizer.get_pre_tokenizer() {
            let json = serde_json::to_value(pre)
                .map_err(|err| format!("cannot read the pre-tokenizer: {err}"))?;
            if let Some(why) = position_dependent(&json) {
                return Err(why);
            }
        }
        let has_normalizer = tokenizer.get_normalizer().is_some();
        let mut added: Vec<(u32, String)> = Vec::new();
        for (id, token) in tokenizer.get_added_tokens_decoder() {
            if token.lstrip || token.rstrip || token.single_word {
                return Err(format!(
                    "added token {:?} strips whitespace or must be a single word",
                    token.content
                ));
            }
            if token.normalized && has_normalizer {
                return Err(format!(
                    "added token {:?} is matched after normalization",
                    token.content
                ));
            }
            if !token.content.is_empty() {
                added.push((id, token.content));
            }
        }
        added.sort();
        let matcher = AhoCorasick::builder()
            .match_kind(MatchKind::LeftmostLongest)
            .build(added.iter().map(|(_, text)| text.as_str()))
            .map_err(|err| format!("cannot index the added tokens: {err}"))?;
        // What the post-processor adds: the ids of a probe with and without special tokens.
        let probe = "segment probe 1";
        let bare = ids(tokenizer, probe, false)?;
        let full = ids(tokenizer, probe, true)?;
        let at = (0..=full.len().saturating_sub(bare.len()))
            .find(|&i| full[i..].starts_with(&bare))
            .ok_or("the post-processor changes a text's own ids")?;
        let word_bytes = capacity_bytes >> WORD_SHARE_SHIFT;
        let prefix_bytes = prefix_share(capacity_bytes);
        let (words, words_off) = match Words::new(tokenizer, word_bytes) {
            Ok(words) => (Some(words), None),
            Err(why) => (None, Some(why)),
        };
        let (prefixes, prefixes_off) = match &words {
            Some(words) if words.cut_safe() => (Some(Prefixes::new(prefix_bytes)), None),
            Some(_) => (
                None,
                Some(
                    "the split pattern is not one known to allow cuts at a space after a letter"
                        .to_owned(),
                ),
            ),
            None => (None, Some("the word split is off".to_owned())),
        };
        let cache = SegmentCache {
            words,
            words_off,
            prefixes,
            prefixes_off,
            added: matcher,
            added_ids: added.iter().map(|(id, _)| *id).collect(),
            before: full[..at].to_vec(),
            after: full[at + bare.len()..].to_vec(),
            cache: quick_cache::sync::Cache::with_weighter(
                1024,
                (capacity_bytes - word_bytes - prefix_bytes).max(1),
                ByteWeight,
            ),
            counters: Counters::default(),
        };
        cache.self_check(tokenizer, &added)?;
        cache.cache.clear();
        if let Some(words) = &cache.words {
            words.reset();
        }
        if let Some(prefixes) = &cache.prefixes {
            prefixes.reset();
        }
        cache.counters.reset();
        Ok(cache)
    }

    /// Probes with added tokens between texts: pieced ids must be the whole text's.
    fn self_check(&self, tokenizer: &Tokenizer, added: &[(u32, String)]) -> Result<(), String> {
        let texts = [
            "You are a helpful assistant. Answer in full sentences, please, and cite 3 sources.",
            " leading space and trailing space ",
            "\nnew line first, then digits 1234567 and accents: déjà vu, naïve, Ærøskøbing.\n",
            "no-space-at-all,punctuation!?;:()[]{}",
        ];
        let mut probes: Vec<String> = texts.iter().map(|t| (*t).to_owned()).collect();
        // Long enough for the open end's chunks (serve/prefixes.rs).
        probes.push(
            texts
                .concat()
                .repeat(3 * CHUNK_BYTES / texts.concat().len() + 1),
        );
        for (_, token) in added.iter().take(8) {
            for (i, a) in texts.iter().enumerate() {
                let b = texts[(i + 1) % texts.len()];
                probes.push(format!("{a}{token}{b}{token}{a}"));
                probes.push(format!("{token}{a}{token}\n{token}{b}"));
            }
        }
        for probe in &probes {
            for special in [true, false] {
                // Twice: the second time from the cache.
                for _ in 0..2 {
                    let pieced = self
                        .encode(tokenizer, probe, special)
                        .map_err(|err| format!("cannot tokenize a probe: {err}"))?;
                    if pieced != ids(tokenizer, probe, special)? {
                        return Err(format!(
                            "the ids of {probe:?} tokenized in pieces differ from the whole text's"
                        ));
                    }
                }
            }
        }
        Ok(())
    }

    /// The ids of `text`, as `tokenizer.encode_fast(text, special)` gives them.
    pub fn encode(
        &self,
        tokenizer: &Tokenizer,
        text: &str,
        special: bool,
    ) -> tokenizers::Result<Vec<u32>> {
        let mut out = Vec::with_capacity(text.len() / 3 + 8);
        if special {
            out.extend_from_slice(&self.before);
        }
        let mut start = 0;
        for m in self.added.find_iter(text) {
            self.piece(tokenizer, &text[start..m.start()], true, &mut out)?;
            out.push(self.added_ids[m.pattern().as_usize()]);
            start = m.end();
        }
        self.piece(tokenizer, &text[start..], false, &mut out)?;
        if special {
            out.extend_from_slice(&self.after);
        }
        Ok(out)
    }

    /// One piece's ids, from the cache when `closed` (an added token follows it) and long enough.
    fn piece(
        &self,
        tokenizer: &Tokenizer,
        piece: &str,
        closed: bool,
        out: &mut Vec<u32>,
    ) -> tokenizers::Result<()> {
        if piece.is_empty() {
            return Ok(());
        }
        if !closed || piece.len() < MIN_CACHED_BYTES {
            if let (false, Some(prefixes), Some(words)) = (closed, &self.prefixes, &self.words) {
                if piece.len() > CHUNK_BYTES {
                    return prefixes.encode(words, tokenizer, piece, out);
                }
            }
            return self.tokenize(tokenizer, piece, out);
        }
        if let Some(ids) = self.cache.get(piece) {
            self.counters.hit(1);
            out.extend_from_slice(&ids);
            return Ok(());
        }
        self.counters.miss(1);
        let start = out.len();
        self.tokenize(tokenizer, piece, out)?;
        self.cache.insert(piece.into(), out[start..].into());
        Ok(())
    }

    /// Append a piece's ids, tokenized now.
    fn tokenize(
        &self,
        tokenizer: &Tokenizer,
        piece: &str,
        out: &mut Vec<u32>,
    ) -> tokenizers::Result<()> {
        match &self.words {
            Some(words) => words.encode(tokenizer, piece, out),
            None => {
                out.extend_from_slice(tokenizer.encode_fast(piece, false)?.get_ids());
                Ok(())
            }
        }
    }

    /// Why pieces are tokenized by `tokenizers` itself, not split into words here.
    pub fn words_off(&self) -> Option<&str> {
        self.words_off.as_deref()
    }

    /// What the word split did, when it is on.
    pub fn word_stats(&self) -> Option<WordStats> {
        self.words.as_ref().map(Words::stats)
    }

    /// Why the open ends' chunks are not cached (serve/prefixes.rs).
    pub fn prefixes_off(&self) -> Option<&str> {
        self.prefixes_off.as_deref()
    }

    /// What the chunks of open ends did, when they are cached.
    pub fn prefix_stats(&self) -> Option<CacheStats> {
        self.prefixes.as_ref().map(Prefixes::stats)
    }

    /// Closed pieces looked up, and what the cache holds now.
    pub fn stats(&self) -> CacheStats {
        self.counters.stats(&self.cache)
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_tokenizers::{
        byte_level_bpe, gpt2_pre_tokenizer, metaspace_pre_tokenizer,
    };
    use super::*;

    fn fixture() -> Tokenizer {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/data/tokenizer");
        Tokenizer::from_file(dir.join("tokenizer.json")).expect("fixture tokenizer")
    }

    #[test]
    fn the_fixture_tokenizer_is_pieced_exactly_and_history_hits_the_cache() {
        let tok = fixture();
        let cache = SegmentCache::new(&tok, 1 << 20).expect("the fixture's pieces are independent");
        let added: Vec<String> = tok
            .get_added_tokens_decoder()
            .into_values()
            .map(|t| t.content)
            .collect();
        assert!(!added.is_empty(), "the fixture has added tokens");
        let sep = &added[0];
        let system = "You are a router test. ".repeat(8);
        let mut prompt = format!("{system}{sep}");
        let mut rng = 7u64;
        for turn in 0..6 {
            let mut message = String::new();
            for _ in 0..40 {
                rng = rng
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let words = ["alpha", "beta", " gamma", "δέλτα", "42", "\n", "e,f", "  "];
                message.push_str(words[(rng >> 33) as usize % words.len()]);
            }
            prompt.push_str(&format!("turn {turn}: {message}{sep}"));
            let open = format!("{prompt}answer:");
            for special in [true, false] {
                assert_eq!(
                    cache.encode(&tok, &open, special).unwrap(),
                    tok.encode_fast(open.as_str(), special).unwrap().get_ids(),
                    "turn {turn}, special {special}"
                );
            }
        }
        let stats = cache.stats();
        assert!(
            stats.hits >= 5 * 2,
            "earlier turns come from the cache: {stats:?}"
        );
        assert!(stats.entries >= 6 && stats.bytes > 0, "{stats:?}");
    }

    #[test]
    fn a_byte_level_bpe_chat_prompt_is_pieced_exactly() {
        let tok = byte_level_bpe(gpt2_pre_tokenizer());
        let cache = SegmentCache::new(&tok, 1 << 20).expect("byte-level pieces are independent");
        let mut prompt = String::from("<|im_start|>system\nYou are the router's test. ");
        prompt.push_str(&"Say the other thing, then stop. ".repeat(4));
        prompt.push_str("<|im_end|>\n");
        for turn in 0..5 {
            prompt.push_str(&format!(
                "<|im_start|>user\n  Turn {turn}: the weather in Zürich, 12°C, \t tabs, and the rest<|im_end|>\n"
            ));
            let open = format!("{prompt}<|im_start|>assistant\n");
            for special in [true, false] {
                let whole = tok.encode_fast(open.as_str(), special).unwrap();
                assert_eq!(
                    cache.encode(&tok, &open, special).unwrap(),
                    whole.get_ids(),
                    "turn {turn}, special {special}"
                );
            }
        }
        assert!(cache.stats().hits > 0, "{:?}", cache.stats());
    }

    #[test]
    fn a_long_open_end_repeats_its_preamble_from_the_prefix_cache() {
        let tok = byte_level_bpe(gpt2_pre_tokenizer());
        let cache = SegmentCache::new(&tok, 1 << 20).expect("byte-level pieces are independent");
        assert_eq!(cache.prefixes_off(), None);
        let preamble = "Read the document below, then answer. ".repeat(100);
        for question in ["What is it about?", "Who wrote it", " and when? \t 2026"] {
            let prompt = format!("<|im_start|>user\n{preamble}{question}");
            for special in [true, false] {
                assert_eq!(
                    cache.encode(&tok, &prompt, special).unwrap(),
                    tok.encode_fast(prompt.as_str(), special).unwrap().get_ids(),
                    "{question:?}, special {special}"
                );
            }
        }
        let stats = cache.prefix_stats().expect("on");
        assert!(
            stats.hits >= 12,
            "the preamble's chunks come back: {stats:?}"
        );
        // The WordLevel fixture has no word split, so no prefix cache either, and says why.
        let fixture = SegmentCache::new(&fixture(), 1 << 20).unwrap();
        assert_eq!(fixture.prefix_stats(), None);
        assert!(fixture
            .prefixes_off()
            .is_some_and(|why| why.contains("word split")));
    }

    #[test]
    fn a_metaspace_tokenizer_gets_no_cache_and_says_why() {
        let why = SegmentCache::new(&byte_level_bpe(metaspace_pre_tokenizer()), 1 << 20)
            .expect_err("refused");
        assert!(why.contains("Metaspace"), "{why}");
    }

    #[test]
    fn the_open_end_of_a_prompt_is_not_cached() {
        let tok = fixture();
        let cache = SegmentCache::new(&tok, 1 << 20).unwrap();
        let completion = "a completion prompt without any added token in it, long enough to cache";
        for _ in 0..3 {
            cache.encode(&tok, completion, true).unwrap();
        }
        assert_eq!(cache.stats().entries, 0);
        assert_eq!(cache.stats().hits, 0);
    }

    #[test]
    fn position_dependent_pre_tokenizers_are_refused_with_the_reason() {
        let metaspace = serde_json::json!({"type": "Sequence", "pretokenizers": [
            {"type": "Split"}, {"type": "Metaspace", "prepend_scheme": "first"}]});
        let why = position_dependent(&metaspace).expect("refused");
        assert!(why.contains("Metaspace"), "{why}");
        assert_eq!(
            position_dependent(&serde_json::json!({"type": "ByteLevel"})),
            None
        );
    }

    #[test]
    fn a_small_capacity_evicts_instead_of_growing() {
        let tok = fixture();
        let cache = SegmentCache::new(&tok, 4096).unwrap();
        let sep = tok
            .get_added_tokens_decoder()
            .into_values()
            .next()
            .unwrap()
            .content;
        for i in 0..200 {
            let text = format!(
                "{} {i}{sep}tail",
                "a distinct closed piece of text ".repeat(4)
            );
            cache.encode(&tok, &text, false).unwrap();
        }
        assert!(cache.stats().bytes <= 4096, "{:?}", cache.stats());
    }
}
