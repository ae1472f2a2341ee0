//! The prompts of the tokenizer benches (`tokenize`, `prompt_cpu`), made as the live bench makes
//! them (`scripts/live_bench/overhead.py`): words of the rig's tiny model's vocabulary, one in 12
//! made up (so BPE splits it, and it is new to the word cache), a full stop every 6 to 20 words.

use std::path::{Path, PathBuf};

use super::Rng;

/// The rig's tiny model's trained byte-level BPE.
pub fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/bpe-tokenizer")
}

/// The vocabulary's whole words (`Ġword` entries), as the live bench picks them.
pub fn vocabulary_words() -> Vec<String> {
    let text = std::fs::read_to_string(dir().join("tokenizer.json")).expect("the fixture");
    let doc: serde_json::Value = serde_json::from_str(&text).expect("JSON");
    let vocab = doc["model"]["vocab"].as_object().expect("a BPE vocab");
    let mut words: Vec<String> = vocab
        .keys()
        .filter_map(|k| k.strip_prefix('Ġ'))
        .filter(|w| w.len() > 1 && w.chars().all(|c| c.is_ascii_alphabetic()))
        .map(str::to_owned)
        .collect();
    words.sort();
    words
}

/// How long a text is made.
#[derive(Debug, Clone, Copy)]
pub enum Length {
    /// Exactly this many words.
    Words(usize),
    /// Words until the text has at least this many bytes.
    Bytes(usize),
}

/// A text of `words` (see the module docs), drawn from `rng`.
pub fn text(words: &[String], length: Length, rng: &mut Rng) -> String {
    let mut text = String::new();
    let mut count = 0usize;
    let mut left = 0u64;
    while match length {
        Length::Words(n) => count < n,
        Length::Bytes(n) => text.len() < n,
    } {
        if count > 0 {
            text.push(' ');
        }
        count += 1;
        if rng.below(12) == 0 {
            for _ in 0..3 + rng.below(7) {
                text.push(char::from(b'a' + rng.below(26) as u8));
            }
        } else {
            text.push_str(&words[rng.below(words.len() as u64) as usize]);
        }
        if left == 0 {
            left = 6 + rng.below(15);
        }
        left -= 1;
        if left == 0 {
            text.push('.');
        }
    }
    text
}
