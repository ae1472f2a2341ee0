//! Exact token ids for a byte-level BPE tokenizer's text, about ten times faster than HF
//! `tokenizers` on new text: the text is split into words with `regex-automata`, and each
//! word's ids are cached.
//!
//! With no normalizer, HF `tokenizers` turns a piece of text (the part between two added tokens)
//! into ids in two steps: the pre-tokenizer's regex splits it into words, and the model tokenizes
//! each word (its bytes mapped to the byte-level alphabet) on its own. What costs is the
//! bookkeeping around that: per word a `NormalizedString` with byte alignments, a `Token` with
//! its own `String` and offsets per id (profile: 40 % of the time in the allocator). Here the
//! words are found with the same regex and given to the tokenizer's own model, so only the
//! bookkeeping is left out; each word's ids are kept, so a word seen before costs one lookup.
//!
//! The one thing `regex-automata` cannot run is the patterns' look-ahead `\s+(?!\S)`: "a run of
//! whitespace, less its last character when a non-space follows" (so that the space goes with
//! the next word). Every byte-level pattern in use ends with `\s+(?!\S)|\s+`; the split runs
//! the pattern with that tail as `\s+` and gives the last character back where the look-ahead
//! would have, which is exact when the run came from that tail (checked: the rest of the
//! pattern does not match there).
//!
//! [`Words::new`] takes only tokenizers of the shapes below (else the caller tokenizes with
//! `tokenizers`, as before), and checks its ids against `tokenizers`' on probe texts:
//! - no normalizer;
//! - pre-tokenizer `ByteLevel` with its GPT-2 regex, or `Split` by a regex (isolated, not
//!   inverted) followed by `ByteLevel` without its regex (Llama 3, Qwen 2), never with
//!   `add_prefix_space`;
//! - a model without dropout (BPE dropout is random).

use std::sync::atomic::{AtomicU64, Ordering};

use regex_automata::meta::Regex;
use regex_automata::{Anchored, Input};
use tokenizers::{Model, Tokenizer};

/// The pre-tokenizer `ByteLevel` splits with when `use_regex` is on (GPT-2's pattern, as
/// `tokenizers` spells it).
const GPT2_PATTERN: &str =
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";

/// Llama 3's split pattern (its tokenizer.json).
pub(crate) const LLAMA3_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Qwen 2's split pattern (its tokenizer.json).
pub(crate) const QWEN2_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Split patterns in which no alternative matches a letter followed by whitespace, so a text
/// cut at a space after a letter splits into the same words as the whole (serve/prefixes.rs).
const CUT_SAFE_PATTERNS: [&str; 3] = [GPT2_PATTERN, LLAMA3_PATTERN, QWEN2_PATTERN];

/// The tail every byte-level pattern ends with; see the module docs.
const LOOKAHEAD_TAIL: &str = r"|\s+(?!\S)|\s+";

/// Words longer than this are tokenized every time (rare, and not worth their memory).
const MAX_CACHED_BYTES: usize = 128;

/// What an entry costs beyond its text (key and value, the cache's own slot).
const ENTRY_OVERHEAD: u64 = 48;

/// A word's ids: inline for the usual one to four, shared beyond.
#[derive(Clone)]
enum WordIds {
    Inline { len: u8, ids: [u32; 4] },
    Shared(std::sync::Arc<[u32]>),
}

impl WordIds {
    fn new(ids: &[u32]) -> WordIds {
        match ids.len() {
            len @ 0..=4 => {
                let mut inline = [0; 4];
                inline[..len].copy_from_slice(ids);
                WordIds::Inline {
                    len: len as u8,
                    ids: inline,
                }
            }
            _ => WordIds::Shared(ids.into()),
        }
    }

    fn as_slice(&self) -> &[u32] {
        match self {
            WordIds::Inline { len, ids } => &ids[..usize::from(*len)],
            WordIds::Shared(ids) => ids,
        }
    }
}

#[derive(Clone)]
struct WordWeight;

impl quick_cache::Weighter<Box<str>, WordIds> for WordWeight {
    fn weight(&self, key: &Box<str>, ids: &WordIds) -> u64 {
        let heap = match ids {
            WordIds::Inline { .. } => 0,
            WordIds::Shared(ids) => 4 * ids.len() as u64,
        };
        key.len() as u64 + heap + ENTRY_OVERHEAD
    }
}

/// Words looked up, and what the cache holds now.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WordStats {
    pub hits: u64,
    pub misses: u64,
    /// Pieces handed back to `tokenizers` (the pattern matched an empty word in them).
    pub fallbacks: u64,
    pub entries: u64,
    pub bytes: u64,
}

/// A byte-level tokenizer's word split and its words' ids.
pub struct Words {
    /// The pattern without its look-ahead tail, then `\s+`.
    split: Regex,
    /// The pattern's other alternatives alone (`None`: it has none), run anchored to tell
    /// which part matched a run of whitespace.
    head: Option<Regex>,
    /// Byte → the byte-level alphabet's character.
    alphabet: [char; 256],
    /// The pattern is one of [`CUT_SAFE_PATTERNS`].
    cut_safe: bool,
    cache: quick_cache::sync::Cache<Box<str>, WordIds, WordWeight>,
    hits: AtomicU64,
    misses: AtomicU64,
    fallbacks: AtomicU64,
}

impl std::fmt::Debug for Words {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Words")
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

/// GPT-2's byte → character table: printable bytes stand for themselves, the rest take the
/// characters from U+0100 on, in byte order.
fn byte_alphabet() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut next = 0x100u32;
    for (byte, slot) in table.iter_mut().enumerate() {
        let printable = matches!(byte, 0x21..=0x7e | 0xa1..=0xac | 0xae..=0xff);
        let code = if printable {
            byte as u32
        } else {
            next += 1;
            next - 1
        };
        *slot = char::from_u32(code).unwrap_or(char::REPLACEMENT_CHARACTER);
    }
    table
}

/// A `ByteLevel` pre-tokenizer's settings as `tokenizer.json` spells them, or why not.
fn byte_level(json: &serde_json::Value, use_regex: bool) -> Result<(), String> {
    let flag = |key: &str| json.get(key).and_then(serde_json::Value::as_bool);
    if json.get("type").and_then(serde_json::Value::as_str) != Some("ByteLevel") {
        return Err("the pre-tokenizer is not byte-level".to_owned());
    }
    if flag("add_prefix_space") != Some(false) {
        return Err("the byte-level pre-tokenizer adds a prefix space".to_owned());
    }
    if flag("use_regex").unwrap_or(true) != use_regex {
        return Err(format!(
            "a byte-level pre-tokenizer with use_regex {} here",
            !use_regex
        ));
    }
    Ok(())
}

/// The split pattern of a pre-tokenizer this module runs, or why it does not.
fn split_pattern(pre: &serde_json::Value) -> Result<String, String> {
    let kind = pre.get("type").and_then(serde_json::Value::as_str);
    if kind == Some("ByteLevel") {
        byte_level(pre, true)?;
        return Ok(GPT2_PATTERN.to_owned());
    }
    let steps = pre
        .get("pretokenizers")
        .and_then(serde_json::Value::as_array)
        .filter(|_| kind == Some("Sequence"))
        .ok_or_else(|| format!("pre-tokenizer `{}`", kind.unwrap_or("?")))?;
    let [split, level] = steps.as_slice() else {
        return Err("a pre-tokenizer Sequence of other than Split + ByteLevel".to_owned());
    };
    byte_level(level, false)?;
    let field = |key: &str| split.get(key).and_then(serde_json::Value::as_str);
    if field("type") != Some("Split")
        || field("behavior") != Some("Isolated")
        || split.get("invert").and_then(serde_json::Value::as_bool) != Some(false)
    {
        return Err("a Split that is not isolated and uninverted".to_owned());
    }
    split
        .get("pattern")
        .and_then(|p| p.get("Regex"))
        .and_then(serde_json::Value::as_str)
        .map(str::to_owned)
        .ok_or_else(|| "a Split by a string, not a regex".to_owned())
}

impl Words {
    /// The word split for `tokenizer`, with a cache of at most `capacity_bytes`, or why this
    /// tokenizer is not one it can split exactly (see the module docs).
    pub fn new(tokenizer: &Tokenizer, capacity_bytes: u64) -> Result<Words, String> {
        if tokenizer.get_normalizer().is_some() {
            return Err("the tokenizer has a normalizer".to_owned());
        }
        let pre = tokenizer
            .get_pre_tokenizer()
            .ok_or("the tokenizer has no pre-tokenizer")?;
        let pre = serde_json::to_value(pre)
            .map_err(|err| format!("cannot read the pre-tokenizer: {err}"))?;
        let pattern = split_pattern(&pre)?;
        if let tokenizers::ModelWrapper::BPE(bpe) = tokenizer.get_model() {
            if bpe.dropout.is_some() {
                return Err("the BPE model has dropout".to_owned());
            }
        }
        let head = pattern
            .strip_suffix(LOOKAHEAD_TAIL)
            .ok_or("the split pattern does not end with `\\s+(?!\\S)|\\s+`")?;
        let compile = |p: &str| {
            Regex::new(p).map_err(|err| format!("cannot compile the split pattern: {err}"))
        };
        let words = Words {
            split: compile(&format!("{head}|\\s+"))?,
            head: (!head.is_empty()).then(|| compile(head)).transpose()?,
            alphabet: byte_alphabet(),
            cut_safe: CUT_SAFE_PATTERNS.contains(&pattern.as_str()),
            cache: quick_cache::sync::Cache::with_weighter(4096, capacity_bytes.max(1), WordWeight),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            fallbacks: AtomicU64::new(0),
        };
        words.self_check(tokenizer)?;
        words.reset();
        Ok(words)
    }

    /// Whether a text may be cut at a space after a letter and its parts tokenized on their
    /// own (serve/prefixes.rs): the split pattern is one of the patterns known to allow it.
    pub fn cut_safe(&self) -> bool {
        self.cut_safe
    }

    /// Empty the cache and zero the counters (after probes, so they count only requests).
    pub fn reset(&self) {
        self.cache.clear();
        for counter in [&self.hits, &self.misses, &self.fallbacks] {
            counter.store(0, Ordering::Relaxed);
        }
    }

    /// Probe texts, each twice (the second time from the cache): the ids must be
    /// `tokenizers`' own.
    fn self_check(&self, tokenizer: &Tokenizer) -> Result<(), String> {
        let probes = [
            "You are a helpful assistant. Answer in full sentences, please, and cite 3 sources.",
            "  two spaces, three   spaces,\ttab\t\tand tabs, then\n\nblank lines\n  \n indented",
            "trailing whitespace   ",
            "\u{3000}ideographic\u{3000}\u{3000}space, no-break\u{a0}space, 東京と大阪 😀👍🏽",
            "digits 1234567 3.14159 2026-12-01, accents déjà vu, naïve, Ærøskøbing",
            "contractions: it's, I'm, we've, they're, you'll, he'd, 'quoted', DON'T",
            "punctuation!?;:()[]{}<>/\\|@#$%^&*_-+=~`\"... ,,, ---",
            "\r\nwindows\r\nline\r\n\r\nendings \r\n",
            "   ",
            "x",
        ];
        for probe in probes {
            let want = tokenizer
                .encode_fast(probe, false)
                .map_err(|err| format!("cannot tokenize a probe: {err}"))?;
            for _ in 0..2 {
                let mut got = Vec::new();
                self.encode(tokenizer, probe, &mut got)
                    .map_err(|err| format!("cannot tokenize a probe: {err}"))?;
                if got != want.get_ids() {
                    return Err(format!(
                        "the ids of {probe:?} split into words differ from tokenizers'"
                    ));
                }
            }
        }
        Ok(())
    }

    /// Append the ids of `piece` (text without added tokens, no special tokens around it), as
    /// `tokenizer.encode_fast(piece, false)` gives them.
    pub fn encode(
        &self,
        tokenizer: &Tokenizer,
        piece: &str,
        out: &mut Vec<u32>,
    ) -> tokenizers::Result<()> {
        let start = out.len();
        if self.split_and_encode(tokenizer, piece, out)? {
            return Ok(());
        }
        // An empty word: `tokenizers` has its own rule for those; let it do the whole piece.
        self.fallbacks.fetch_add(1, Ordering::Relaxed);
        out.truncate(start);
        out.extend_from_slice(tokenizer.encode_fast(piece, false)?.get_ids());
        Ok(())
    }

    /// `false` when the pattern matched an empty word (nothing is then final in `out`).
    fn split_and_encode(
        &self,
        tokenizer: &Tokenizer,
        text: &str,
        out: &mut Vec<u32>,
    ) -> tokenizers::Result<bool> {
        let model = tokenizer.get_model();
        self.split(text, |word| self.word(model, word, out))
    }

    /// Call `each` with the words of `text` in order, as the pre-tokenizer splits it; `false`
    /// when the pattern matched an empty word there (the words given so far are then void).
    fn split<'t, E>(
        &self,
        text: &'t str,
        mut each: impl FnMut(&'t str) -> Result<(), E>,
    ) -> Result<bool, E> {
        let mut at = 0;
        while at < text.len() {
            let Some(found) = self.split.find(Input::new(text).range(at..)) else {
                // No word in the rest: `Isolated` keeps it as one piece.
                each(&text[at..])?;
                break;
            };
            if found.start() > at {
                each(&text[at..found.start()])?;
            }
            if found.is_empty() {
                return Ok(false);
            }
            let end = self.lookahead_end(text, found.start(), found.end());
            each(&text[found.start()..end])?;
            at = end;
        }
        Ok(true)
    }

    /// Where `\s+(?!\S)|\s+` would have ended the match `start..end`.
    fn lookahead_end(&self, text: &str, start: usize, end: usize) -> usize {
        let run = &text[start..end];
        let followed_by_word = text[end..]
            .chars()
            .next()
            .is_some_and(|c| !c.is_whitespace());
        if !followed_by_word || !run.chars().all(char::is_whitespace) {
            return end;
        }
        let Some((last, _)) = run.char_indices().next_back().filter(|&(i, _)| i > 0) else {
            return end; // one character: the look-ahead fails, `\s+` takes it
        };
        // Only the tail gives the character back: the rest of the pattern may match whitespace
        // itself (Llama 3's `\s*[\r\n]+`), and comes first.
        let head_matches = self.head.as_ref().is_some_and(|head| {
            head.find(Input::new(text).range(start..).anchored(Anchored::Yes))
                .is_some()
        });
        if head_matches {
            end
        } else {
            start + last
        }
    }

    fn word(
        &self,
        model: &tokenizers::ModelWrapper,
        word: &str,
        out: &mut Vec<u32>,
    ) -> tokenizers::Result<()> {
        let cacheable = word.len() <= MAX_CACHED_BYTES;
        if cacheable {
            if let Some(ids) = self.cache.get(word) {
                self.hits.fetch_add(1, Ordering::Relaxed);
                out.extend_from_slice(ids.as_slice());
                return Ok(());
            }
            self.misses.fetch_add(1, Ordering::Relaxed);
        }
        let mapped: String = word
            .bytes()
            .map(|b| self.alphabet[usize::from(b)])
            .collect();
        let start = out.len();
        out.extend(model.tokenize(&mapped)?.iter().map(|token| token.id));
        if cacheable {
            self.cache.insert(word.into(), WordIds::new(&out[start..]));
        }
        Ok(())
    }

    pub fn stats(&self) -> WordStats {
        WordStats {
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            fallbacks: self.fallbacks.load(Ordering::Relaxed),
            entries: self.cache.len() as u64,
            bytes: self.cache.weight(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_tokenizers::*;
    use super::*;

    /// Random texts of the pieces that make word splits differ: whitespace runs of every kind
    /// before and after words, digits, contractions, CJK, emoji, punctuation, line endings.
    fn random_texts(seed: u64, count: usize) -> Vec<String> {
        let parts = [
            "a", "bZ", "word", "é", "東京", "😀", "1", "23", "4567", " ", "  ", "   ", "\t", "\n",
            "\n\n", "\r\n", "\u{3000}", "\u{a0}", "'", "'s", "'LL", "'ve", ".", ",", "!?", "-",
            "_", " .", "\t ", " \n", "x'", "ß", "\u{200b}",
        ];
        let mut rng = seed;
        let mut next = move || {
            rng = rng
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (rng >> 33) as usize
        };
        (0..count)
            .map(|_| {
                let len = 1 + next() % 40;
                (0..len).map(|_| parts[next() % parts.len()]).collect()
            })
            .collect()
    }

    /// The words' byte ranges, as `tokenizers`' own pre-tokenizer gives them.
    fn reference_words(tok: &Tokenizer, text: &str) -> Vec<(usize, usize)> {
        use tokenizers::PreTokenizer;
        let mut pre = tokenizers::PreTokenizedString::from(text);
        tok.get_pre_tokenizer()
            .expect("a pre-tokenizer")
            .pre_tokenize(&mut pre)
            .expect("pre-tokenized");
        pre.get_splits(
            tokenizers::OffsetReferential::Original,
            tokenizers::OffsetType::Byte,
        )
        .into_iter()
        .map(|(_, offsets, _)| offsets)
        .collect()
    }

    fn our_words(words: &Words, text: &str) -> Vec<(usize, usize)> {
        let mut out = Vec::new();
        let base = text.as_ptr() as usize;
        let whole = words
            .split(text, |w| {
                let start = w.as_ptr() as usize - base;
                out.push((start, start + w.len()));
                Ok::<(), ()>(())
            })
            .expect("no error");
        assert!(whole, "no empty word in {text:?}");
        out
    }

    #[test]
    fn words_and_ids_are_tokenizers_own_for_every_byte_level_shape() {
        let shapes = [
            ("gpt2", gpt2_pre_tokenizer()),
            ("llama3", split_pre_tokenizer(LLAMA3_PATTERN)),
            ("qwen2", split_pre_tokenizer(QWEN2_PATTERN)),
        ];
        for (name, pre) in shapes {
            let tok = byte_level_bpe(pre);
            let words = Words::new(&tok, 1 << 20).unwrap_or_else(|why| panic!("{name}: {why}"));
            for (i, text) in random_texts(11, 3000).iter().enumerate() {
                assert_eq!(
                    our_words(&words, text),
                    reference_words(&tok, text),
                    "{name}, text {i}: {text:?}"
                );
                let want = tok.encode_fast(text.as_str(), false).unwrap();
                for round in 0..2 {
                    let mut got = Vec::new();
                    words.encode(&tok, text, &mut got).unwrap();
                    assert_eq!(
                        got,
                        want.get_ids(),
                        "{name}, text {i}, round {round}: {text:?}"
                    );
                }
            }
            let stats = words.stats();
            assert!(stats.hits > stats.misses, "{name}: words repeat: {stats:?}");
            assert_eq!(stats.fallbacks, 0, "{name}");
        }
    }

    #[test]
    fn a_trained_byte_level_bpe_gives_tokenizers_ids() {
        // The rig's tiny model's tokenizer: real merges over real words (tests/data/bpe-tokenizer).
        let file = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../tests/data/bpe-tokenizer/tokenizer.json");
        let tok = Tokenizer::from_file(file).expect("the fixture");
        let words = Words::new(&tok, 1 << 20).expect("a GPT-2 byte-level BPE");
        let vocabulary = [
            "the",
            "router",
            "engine",
            "cache",
            "prefix",
            "session",
            "harbour",
            "quietly",
            "unheard-of",
            "Zürich",
            "x9",
            "2026",
            "don't",
            "QUEUE",
            "e.g.",
            "naïve",
        ];
        let mut texts = random_texts(5, 500);
        let mut rng = 99u64;
        for _ in 0..200 {
            let mut text = String::new();
            for _ in 0..300 {
                rng = rng
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let r = (rng >> 33) as usize;
                text.push_str(vocabulary[r % vocabulary.len()]);
                text.push_str([" ", " ", " ", "  ", ", ", ".\n", "\n\n", "\t"][(r >> 8) % 8]);
            }
            texts.push(text);
        }
        for (i, text) in texts.iter().enumerate() {
            let mut got = Vec::new();
            words.encode(&tok, text, &mut got).unwrap();
            assert_eq!(
                got,
                tok.encode_fast(text.as_str(), false).unwrap().get_ids(),
                "text {i}: {text:?}"
            );
        }
    }

    #[test]
    fn a_wrong_split_would_change_the_ids() {
        // The check above is only as strong as the merges: " a" and "a " are both tokens, so
        // a space put on the wrong side of a word changes the ids.
        let tok = byte_level_bpe(gpt2_pre_tokenizer());
        let right = tok.encode_fast("x a b", false).unwrap().get_ids().to_vec();
        let wrong: Vec<u32> = ["x ", "a ", "b"]
            .iter()
            .flat_map(|w| tok.encode_fast(*w, false).unwrap().get_ids().to_vec())
            .collect();
        assert_ne!(right, wrong);
    }

    #[test]
    fn the_lookahead_gives_back_only_what_the_tail_matched() {
        let tok = byte_level_bpe(split_pre_tokenizer(LLAMA3_PATTERN));
        let words = Words::new(&tok, 1 << 20).unwrap();
        // `\s*[\r\n]+` takes "  \n" whole; `\s+(?!\S)` leaves the space before "b" to it.
        let text = "a  \nb   c";
        let got: Vec<&str> = our_words(&words, text)
            .into_iter()
            .map(|(s, e)| &text[s..e])
            .collect();
        assert_eq!(got, ["a", "  \n", "b", "  ", " c"]);
    }

    #[test]
    fn other_tokenizers_are_refused_with_the_reason() {
        let cases = [
            (metaspace_pre_tokenizer(), "Metaspace"),
            (
                serde_json::json!({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true}),
                "prefix space",
            ),
            (split_pre_tokenizer(r"\p{L}+|\s+"), "does not end with"),
            (
                split_pre_tokenizer(r"(?=x)a|\s+(?!\S)|\s+"),
                "cannot compile",
            ),
        ];
        for (pre, reason) in cases {
            let why = Words::new(&byte_level_bpe(pre.clone()), 1 << 20).expect_err("refused");
            assert!(why.contains(reason), "{pre}: {why}");
        }
        let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../tests/data/tokenizer/tokenizer.json");
        let why =
            Words::new(&Tokenizer::from_file(fixture).unwrap(), 1 << 20).expect_err("refused");
        assert!(why.contains("normalizer"), "{why}");
    }

    #[test]
    fn the_cache_stays_within_its_bytes() {
        let tok = byte_level_bpe(gpt2_pre_tokenizer());
        let words = Words::new(&tok, 8192).unwrap();
        for text in random_texts(3, 2000) {
            let mut out = Vec::new();
            words
                .encode(&tok, &format!("{text} w{}", text.len()), &mut out)
                .unwrap();
        }
        assert!(words.stats().bytes <= 8192, "{:?}", words.stats());
    }

    #[test]
    fn the_known_patterns_are_cut_safe_and_others_are_not() {
        for pre in [
            gpt2_pre_tokenizer(),
            split_pre_tokenizer(LLAMA3_PATTERN),
            split_pre_tokenizer(QWEN2_PATTERN),
        ] {
            assert!(Words::new(&byte_level_bpe(pre), 1 << 10)
                .unwrap()
                .cut_safe());
        }
        // Words may run on across a space here (`[\p{L} ]+`): no cut is safe.
        let other = split_pre_tokenizer(r"[\p{L} ]+|\p{N}+|[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+");
        let words = Words::new(&byte_level_bpe(other), 1 << 10).unwrap();
        assert!(!words.cut_safe());
    }

    #[test]
    fn the_byte_alphabet_is_tokenizers_own() {
        let mut ours: Vec<char> = byte_alphabet().to_vec();
        ours.sort();
        let mut theirs: Vec<char> = tokenizers::pre_tokenizers::byte_level::ByteLevel::alphabet()
            .into_iter()
            .collect();
        theirs.sort();
        assert_eq!(ours, theirs);
    }
}
