//! Small byte-level BPE tokenizers for unit tests, built in memory (no files).

use tokenizers::Tokenizer;

/// GPT-2's pre-tokenizer, as Llama 2-era byte-level BPEs and the rig's tiny model use it.
pub fn gpt2_pre_tokenizer() -> serde_json::Value {
    serde_json::json!({"type": "ByteLevel", "add_prefix_space": false,
        "trim_offsets": true, "use_regex": true})
}

/// A `Split` by `pattern` and then `ByteLevel` without its own regex, as Llama 3 and Qwen 2 do.
pub fn split_pre_tokenizer(pattern: &str) -> serde_json::Value {
    serde_json::json!({"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": false},
        {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false}]})
}

/// Llama 3's and Qwen 2's split patterns (their tokenizer.json files), as serve/words.rs knows
/// them.
pub(crate) use super::words::{LLAMA3_PATTERN, QWEN2_PATTERN};

/// A byte-level BPE with chat markers as added tokens and a BOS post-processor, pre-tokenized
/// by `pre` (for example a `Metaspace` one, to test refusals). Its merges join a space to the
/// letter after it and also to the letter before it, and whitespace to whitespace, so that a
/// word split in the wrong place gives other ids.
pub fn byte_level_bpe(pre: serde_json::Value) -> Tokenizer {
    let mut alphabet: Vec<char> = tokenizers::pre_tokenizers::byte_level::ByteLevel::alphabet()
        .into_iter()
        .collect();
    alphabet.sort();
    let mut vocab: Vec<String> = alphabet.iter().map(char::to_string).collect();
    vocab.push("\u{2581}".to_owned());
    let mut merges: Vec<(String, String)> = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("e", "r")]
        .iter()
        .map(|(a, b)| ((*a).to_owned(), (*b).to_owned()))
        .collect();
    for c in ['a', 'b', 'Z', '1', '2', '.', ',', 'Ċ', 'ĉ', 'Ġ'] {
        merges.push(("Ġ".to_owned(), c.to_string()));
        merges.push((c.to_string(), "Ġ".to_owned()));
        merges.push(("Ċ".to_owned(), c.to_string()));
    }
    merges.sort();
    merges.dedup();
    for (a, b) in &merges {
        let joined = format!("{a}{b}");
        if !vocab.contains(&joined) {
            vocab.push(joined);
        }
    }
    let specials = ["<|bos|>", "<|im_start|>", "<|im_end|>"];
    let added: Vec<serde_json::Value> = specials
        .iter()
        .enumerate()
        .map(|(i, t)| {
            serde_json::json!({"id": vocab.len() + i, "content": t, "single_word": false,
                "lstrip": false, "rstrip": false, "normalized": false, "special": true})
        })
        .collect();
    let mut vocab_map = serde_json::Map::new();
    for (i, t) in vocab.iter().enumerate() {
        vocab_map.insert(t.clone(), serde_json::json!(i));
    }
    for (i, t) in specials.iter().enumerate() {
        vocab_map.insert((*t).to_owned(), serde_json::json!(vocab.len() + i));
    }
    let doc = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": added, "normalizer": null, "pre_tokenizer": pre,
        "post_processor": {"type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<|bos|>", "type_id": 0}},
                       {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<|bos|>": {"id": "<|bos|>",
                "ids": [vocab.len()], "tokens": ["<|bos|>"]}}},
        "decoder": null,
        "model": {"type": "BPE", "dropout": null, "unk_token": null,
            "continuing_subword_prefix": null, "end_of_word_suffix": null,
            "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
            "vocab": vocab_map,
            "merges": merges.iter().map(|(a, b)| format!("{a} {b}")).collect::<Vec<_>>()}
    });
    doc.to_string().parse().expect("the test tokenizer")
}

/// The Metaspace pre-tokenizer SentencePiece-style tokenizers use (position-dependent).
pub fn metaspace_pre_tokenizer() -> serde_json::Value {
    serde_json::json!({"type": "Metaspace", "replacement": "\u{2581}",
        "prepend_scheme": "first", "split": true})
}
