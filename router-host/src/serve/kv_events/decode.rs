//! vLLM KV-event messages → typed events.
//!
//! A live message has 3 frames, `[topic, seq (u64 big-endian, 8 bytes), payload (msgpack)]`. The
//! payload is an array `[ts, events, data_parallel_rank?]` (a map with those keys is accepted). Each event is either a msgpack map
//! tagged `"type"` (vLLM since mid-2026) or a positional array whose first element is the type
//! name (before). Unknown fields and unknown trailing array elements are ignored. Block hashes
//! are u64 integers or 32-byte binaries. Nothing here panics on input: every malformed part is an
//! error value the caller counts.

use rmpv::Value;

/// Most bytes of payload decoded (a larger message is refused, not parsed).
pub const MAX_PAYLOAD_BYTES: usize = 64 << 20;

/// Why a message or an event could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("expected 3 frames [topic, seq, payload], got {0}")]
    Frames(usize),
    #[error("the sequence frame has {0} bytes, expected 8")]
    SeqSize(usize),
    #[error("payload of {0} bytes is over the limit")]
    TooLarge(usize),
    #[error("payload is not valid msgpack: {0}")]
    Msgpack(String),
    #[error("payload is not an array [ts, events, dp_rank?]")]
    PayloadShape,
    #[error("event is neither a map with `type` nor an array starting with a type name")]
    EventShape,
    #[error("`{0}` has the wrong type")]
    Field(&'static str),
    #[error("a block hash is {0} bytes, expected an integer or 32 bytes")]
    HashSize(usize),
    #[error("a token id is not an integer from 0 to 4294967295")]
    TokenId,
}

/// An engine's own block hash: vLLM sends u64 integers, or 32-byte digests with
/// `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EngineHash {
    Int(u64),
    Bytes([u8; 32]),
}

/// `BlockStored`: consecutive full blocks the engine cached.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct BlockStored {
    pub block_hashes: Vec<EngineHash>,
    pub parent_block_hash: Option<EngineHash>,
    pub token_ids: Vec<u32>,
    pub block_size: Option<u64>,
    pub lora_name: Option<String>,
    /// `"GPU"`, `"CPU"`, `"STORAGE"`, ...; `None` on engines that do not send it (device).
    pub medium: Option<String>,
    /// Per block, its `extra_keys` entry (empty when the field is absent or null).
    pub extra_keys: Vec<BlockKeys>,
    pub group_idx: Option<u64>,
}

impl BlockStored {
    /// No block has extra keys: plain token blocks.
    pub fn plain_keys(&self) -> bool {
        self.extra_keys.iter().all(|k| *k == BlockKeys::None)
    }
}

/// One block's `extra_keys` entry, as far as router ids can follow it. vLLM publishes a
/// block's keys untagged: a LoRA adapter's name, then on a prompt's first block its
/// `cache_salt`, as bare strings; multimodal inputs as `(identifier, offset)` pairs and prompt
/// embeddings as digests.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum BlockKeys {
    /// `null`: the block is its tokens alone.
    #[default]
    None,
    /// Only strings: LoRA names and cache salts.
    Strings(Vec<String>),
    /// Anything else (multimodal, prompt embeddings): ids from the tokens cannot match.
    Other,
}

/// One decoded event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EngineEvent {
    BlockStored(BlockStored),
    BlockRemoved {
        block_hashes: Vec<EngineHash>,
        medium: Option<String>,
        group_idx: Option<u64>,
    },
    AllBlocksCleared {
        medium: Option<String>,
    },
    /// A type this decoder does not know (ignored and counted).
    Unknown(String),
}

/// One decoded payload: each event decoded on its own, so one bad event does not lose the rest.
#[derive(Debug, Clone, PartialEq)]
pub struct EventBatch {
    pub ts: Option<f64>,
    pub events: Vec<Result<EngineEvent, DecodeError>>,
    pub dp_rank: Option<u64>,
}

/// The sequence number of a seq frame.
pub fn decode_seq(frame: &[u8]) -> Result<u64, DecodeError> {
    let bytes: [u8; 8] = frame
        .try_into()
        .map_err(|_| DecodeError::SeqSize(frame.len()))?;
    Ok(u64::from_be_bytes(bytes))
}

/// Decode a payload frame.
pub fn decode_payload(payload: &[u8]) -> Result<EventBatch, DecodeError> {
    if payload.len() > MAX_PAYLOAD_BYTES {
        return Err(DecodeError::TooLarge(payload.len()));
    }
    let mut reader = payload;
    let value = rmpv::decode::read_value_with_max_depth(&mut reader, 64)
        .map_err(|err| DecodeError::Msgpack(err.to_string()))?;
    // `[ts, events, dp_rank?]` (msgspec's array-like struct); a map with those field names is
    // accepted too (a struct encoded as an object).
    let mut fields = match value {
        Value::Array(items) => Fields::Array(items),
        Value::Map(pairs) => Fields::Map(pairs),
        _ => return Err(DecodeError::PayloadShape),
    };
    let ts = fields
        .take("ts", 0)
        .and_then(|v| v.as_f64().or_else(|| v.as_i64().map(|i| i as f64)));
    let Some(Value::Array(events)) = fields.take("events", 1) else {
        return Err(DecodeError::PayloadShape);
    };
    let dp_rank = fields
        .take("data_parallel_rank", 2)
        .and_then(|v| v.as_u64());
    Ok(EventBatch {
        ts,
        events: events.into_iter().map(decode_event).collect(),
        dp_rank,
    })
}

/// Fields of an event, by name (map form) or by position (array form).
enum Fields {
    Map(Vec<(Value, Value)>),
    Array(Vec<Value>),
}

impl Fields {
    fn take(&mut self, name: &str, position: usize) -> Option<Value> {
        let value = match self {
            Fields::Map(pairs) => pairs
                .iter_mut()
                .find(|(k, _)| k.as_str() == Some(name))
                .map(|(_, v)| std::mem::replace(v, Value::Nil)),
            Fields::Array(items) => items
                .get_mut(position)
                .map(|v| std::mem::replace(v, Value::Nil)),
        };
        value.filter(|v| !v.is_nil())
    }
}

fn decode_event(value: Value) -> Result<EngineEvent, DecodeError> {
    let (kind, fields) = match value {
        Value::Map(pairs) => {
            let kind = pairs
                .iter()
                .find(|(k, _)| k.as_str() == Some("type"))
                .and_then(|(_, v)| v.as_str())
                .ok_or(DecodeError::EventShape)?
                .to_owned();
            (kind, Fields::Map(pairs))
        }
        Value::Array(items) => {
            let kind = items
                .first()
                .and_then(Value::as_str)
                .ok_or(DecodeError::EventShape)?
                .to_owned();
            (kind, Fields::Array(items))
        }
        _ => return Err(DecodeError::EventShape),
    };
    let mut f = fields;
    match kind.as_str() {
        "BlockStored" => {
            // Legacy order: type, block_hashes, parent_block_hash, token_ids, block_size,
            // lora_id, medium, lora_name, extra_keys, group_idx, ...
            let block_hashes = hashes(f.take("block_hashes", 1), "block_hashes")?;
            let parent_block_hash = f.take("parent_block_hash", 2).map(hash).transpose()?;
            let token_ids = tokens(f.take("token_ids", 3))?;
            let block_size = uint(f.take("block_size", 4), "block_size")?;
            let medium = string(f.take("medium", 6), "medium")?;
            let lora_name = string(f.take("lora_name", 7), "lora_name")?;
            let extra_keys = match f.take("extra_keys", 8) {
                None | Some(Value::Nil) => Vec::new(),
                Some(Value::Array(keys)) => keys.into_iter().map(block_keys).collect(),
                Some(_) => vec![BlockKeys::Other],
            };
            let group_idx = uint(f.take("group_idx", 9), "group_idx")?;
            Ok(EngineEvent::BlockStored(BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                lora_name,
                medium,
                extra_keys,
                group_idx,
            }))
        }
        "BlockRemoved" => {
            // Legacy order: type, block_hashes, medium, group_idx.
            let block_hashes = hashes(f.take("block_hashes", 1), "block_hashes")?;
            let medium = string(f.take("medium", 2), "medium")?;
            let group_idx = uint(f.take("group_idx", 3), "group_idx")?;
            Ok(EngineEvent::BlockRemoved {
                block_hashes,
                medium,
                group_idx,
            })
        }
        "AllBlocksCleared" => {
            let medium = string(f.take("medium", 1), "medium").unwrap_or(None);
            Ok(EngineEvent::AllBlocksCleared { medium })
        }
        _ => Ok(EngineEvent::Unknown(kind)),
    }
}

fn hash(value: Value) -> Result<EngineHash, DecodeError> {
    match value {
        Value::Integer(i) => i
            .as_u64()
            // A signed encoding of a hash over i64::MAX: keep its bits.
            .or_else(|| i.as_i64().map(|v| v as u64))
            .map(EngineHash::Int)
            .ok_or(DecodeError::Field("block hash")),
        Value::Binary(bytes) => <[u8; 32]>::try_from(bytes.as_slice())
            .map(EngineHash::Bytes)
            .map_err(|_| DecodeError::HashSize(bytes.len())),
        _ => Err(DecodeError::Field("block hash")),
    }
}

fn hashes(value: Option<Value>, name: &'static str) -> Result<Vec<EngineHash>, DecodeError> {
    match value {
        Some(Value::Array(items)) => items.into_iter().map(hash).collect(),
        _ => Err(DecodeError::Field(name)),
    }
}

fn tokens(value: Option<Value>) -> Result<Vec<u32>, DecodeError> {
    match value {
        // Offloaded stores (CPU, disk) may carry no tokens.
        None => Ok(Vec::new()),
        Some(Value::Array(items)) => items
            .iter()
            .map(|v| {
                v.as_u64()
                    .and_then(|t| u32::try_from(t).ok())
                    .ok_or(DecodeError::TokenId)
            })
            .collect(),
        Some(_) => Err(DecodeError::Field("token_ids")),
    }
}

fn uint(value: Option<Value>, name: &'static str) -> Result<Option<u64>, DecodeError> {
    value
        .map(|v| v.as_u64().ok_or(DecodeError::Field(name)))
        .transpose()
}

fn block_keys(keys: Value) -> BlockKeys {
    match keys {
        Value::Nil => BlockKeys::None,
        Value::Array(items) => items
            .into_iter()
            .map(|item| match item {
                Value::String(s) => s.into_str(),
                _ => None,
            })
            .collect::<Option<Vec<String>>>()
            .map_or(BlockKeys::Other, BlockKeys::Strings),
        _ => BlockKeys::Other,
    }
}

fn string(value: Option<Value>, name: &'static str) -> Result<Option<String>, DecodeError> {
    match value {
        None => Ok(None),
        Some(Value::String(s)) => s.into_str().map(Some).ok_or(DecodeError::Field(name)),
        Some(_) => Err(DecodeError::Field(name)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn encode(value: &Value) -> Vec<u8> {
        let mut out = Vec::new();
        rmpv::encode::write_value(&mut out, value).expect("encode");
        out
    }

    fn s(v: &str) -> Value {
        Value::from(v)
    }

    fn stored_map(hashes: Vec<Value>, parent: Value, tokens: &[u32], extra: Value) -> Value {
        Value::Map(vec![
            (s("type"), s("BlockStored")),
            (s("block_hashes"), Value::Array(hashes)),
            (s("parent_block_hash"), parent),
            (
                s("token_ids"),
                Value::Array(tokens.iter().map(|&t| Value::from(t)).collect()),
            ),
            (s("block_size"), Value::from(4)),
            (s("lora_id"), Value::Nil),
            (s("medium"), s("GPU")),
            (s("lora_name"), Value::Nil),
            (s("extra_keys"), extra),
            (s("group_idx"), Value::from(0)),
            (s("kv_cache_spec_kind"), s("full_attention")),
            (s("a_field_from_the_future"), Value::from(7)),
        ])
    }

    fn payload(events: Vec<Value>) -> Vec<u8> {
        encode(&Value::Array(vec![
            Value::F64(1.5),
            Value::Array(events),
            Value::from(0),
        ]))
    }

    #[test]
    fn map_form_with_a_u64_hash_over_i64_max_and_unknown_fields() {
        let big = u64::MAX - 5;
        let bytes = payload(vec![stored_map(
            vec![Value::from(big)],
            Value::from(16798410040177476104u64),
            &[1, 2, 3, 4],
            Value::Array(vec![Value::Nil]),
        )]);
        let batch = decode_payload(&bytes).expect("decodes");
        assert_eq!(batch.ts, Some(1.5));
        assert_eq!(batch.dp_rank, Some(0));
        let Ok(EngineEvent::BlockStored(b)) = &batch.events[0] else {
            panic!("not a BlockStored: {:?}", batch.events)
        };
        assert_eq!(b.block_hashes, vec![EngineHash::Int(big)]);
        assert_eq!(
            b.parent_block_hash,
            Some(EngineHash::Int(16798410040177476104))
        );
        assert_eq!(b.token_ids, vec![1, 2, 3, 4]);
        assert_eq!(b.block_size, Some(4));
        assert_eq!(b.medium.as_deref(), Some("GPU"));
        assert!(b.plain_keys());
        assert_eq!(b.group_idx, Some(0));
    }

    #[test]
    fn legacy_array_forms() {
        let stored = Value::Array(vec![
            s("BlockStored"),
            Value::Array(vec![Value::Binary(vec![7; 32])]),
            Value::Nil,
            Value::Array((1..=4).map(Value::from).collect()),
            Value::from(4),
            Value::Nil,
            s("GPU"),
        ]);
        let removed = Value::Array(vec![
            s("BlockRemoved"),
            Value::Array(vec![Value::from(9)]),
            s("CPU"),
        ]);
        let cleared = Value::Array(vec![s("AllBlocksCleared")]);
        let batch = decode_payload(&payload(vec![stored, removed, cleared])).expect("decodes");
        assert_eq!(
            batch.events[0],
            Ok(EngineEvent::BlockStored(BlockStored {
                block_hashes: vec![EngineHash::Bytes([7; 32])],
                parent_block_hash: None,
                token_ids: vec![1, 2, 3, 4],
                block_size: Some(4),
                lora_name: None,
                medium: Some("GPU".into()),
                extra_keys: Vec::new(),
                group_idx: None,
            }))
        );
        assert_eq!(
            batch.events[1],
            Ok(EngineEvent::BlockRemoved {
                block_hashes: vec![EngineHash::Int(9)],
                medium: Some("CPU".into()),
                group_idx: None,
            })
        );
        assert_eq!(
            batch.events[2],
            Ok(EngineEvent::AllBlocksCleared { medium: None })
        );
        // A payload without the dp rank.
        let two = encode(&Value::Array(vec![Value::F64(0.0), Value::Array(vec![])]));
        assert_eq!(decode_payload(&two).expect("decodes").dp_rank, None);
        // The batch as a map.
        let map = encode(&Value::Map(vec![
            (s("ts"), Value::F64(2.0)),
            (
                s("events"),
                Value::Array(vec![Value::Array(vec![s("AllBlocksCleared")])]),
            ),
            (s("data_parallel_rank"), Value::from(3)),
        ]));
        let batch = decode_payload(&map).expect("decodes");
        assert_eq!(
            (batch.ts, batch.dp_rank, batch.events.len()),
            (Some(2.0), Some(3), 1)
        );
    }

    #[test]
    fn bad_input_is_an_error_never_a_panic() {
        assert!(matches!(
            decode_payload(&[0x92]),
            Err(DecodeError::Msgpack(_))
        ));
        let full = payload(vec![stored_map(
            vec![Value::from(1)],
            Value::Nil,
            &[1, 2, 3, 4],
            Value::Nil,
        )]);
        for cut in 0..full.len() {
            let _ = decode_payload(&full[..cut]);
        }
        assert_eq!(
            decode_payload(&encode(&Value::from(3))),
            Err(DecodeError::PayloadShape)
        );
        let batch = decode_payload(&payload(vec![
            Value::from(1),
            Value::Array(vec![
                s("BlockStored"),
                Value::Array(vec![Value::Binary(vec![1; 5])]),
            ]),
            Value::Map(vec![
                (s("type"), s("BlockStored")),
                (s("block_hashes"), s("x")),
            ]),
            stored_map(vec![Value::from(1)], Value::Nil, &[], Value::Nil)
                .as_map()
                .map(|m| {
                    let mut m = m.clone();
                    m[3].1 = Value::Array(vec![Value::from(-1)]);
                    Value::Map(m)
                })
                .unwrap_or(Value::Nil),
            Value::Map(vec![(s("type"), s("SomethingNew"))]),
        ]))
        .expect("the envelope decodes");
        assert_eq!(batch.events[0], Err(DecodeError::EventShape));
        assert_eq!(batch.events[1], Err(DecodeError::HashSize(5)));
        assert_eq!(batch.events[2], Err(DecodeError::Field("block_hashes")));
        assert_eq!(batch.events[3], Err(DecodeError::TokenId));
        assert_eq!(
            batch.events[4],
            Ok(EngineEvent::Unknown("SomethingNew".into()))
        );
        assert_eq!(decode_seq(&[0, 0, 0, 0, 0, 0, 1, 2]), Ok(258));
        assert_eq!(decode_seq(&[1, 2]), Err(DecodeError::SeqSize(2)));
    }

    #[test]
    fn non_null_extra_keys_are_flagged() {
        let bytes = payload(vec![stored_map(
            vec![Value::from(1)],
            Value::Nil,
            &[1, 2, 3, 4],
            Value::Array(vec![Value::Array(vec![s("salt")])]),
        )]);
        let batch = decode_payload(&bytes).expect("decodes");
        let Ok(EngineEvent::BlockStored(b)) = &batch.events[0] else {
            panic!("not a BlockStored")
        };
        assert!(!b.plain_keys());
        assert_eq!(b.extra_keys, vec![BlockKeys::Strings(vec!["salt".into()])]);
        // A multimodal `(identifier, offset)` pair is not a string key.
        let bytes = payload(vec![stored_map(
            vec![Value::from(1)],
            Value::Nil,
            &[1, 2, 3, 4],
            Value::Array(vec![Value::Array(vec![Value::Array(vec![
                s("img-hash"),
                Value::from(0),
            ])])]),
        )]);
        let batch = decode_payload(&bytes).expect("decodes");
        let Ok(EngineEvent::BlockStored(b)) = &batch.events[0] else {
            panic!("not a BlockStored")
        };
        assert_eq!(b.extra_keys, vec![BlockKeys::Other]);
    }
}
