//! vLLM KV-event messages → typed events.
//!
//! A live message has 3 frames, `[topic, seq (u64 big-endian, 8 bytes), payload (msgpack)]`. The
//! payload is an array `[ts, events, data_parallel_rank?]` (a map with those keys is accepted).
//! Each event is either a msgpack map tagged `"type"` (vLLM since mid-2026) or a positional
//! array whose first element is the type name (before). Unknown fields and unknown trailing
//! array elements are ignored. Block hashes are u64 integers or 32-byte binaries. Nothing here
//! panics on input: every malformed part is an error value the caller counts.
//!
//! The decoder streams: it walks the msgpack bytes with a cursor ([`rmp::Marker`] for the
//! markers), checks every declared length against the bytes left before reading it, skips
//! what it does not use (nulls, unknown fields) without allocating, and decodes the events one
//! at a time as the caller takes them ([`decode_batch`]), each within a budget proportional to
//! its wire size ([`EVENT_DECODE_FACTOR`]). A message therefore costs its own bytes plus one
//! decoded event, never a tree of the whole payload.
//!
//! Here: the typed events and the entry points ([`decode_payload`], [`decode_batch`], the
//! [`Events`] iterator); `reader.rs` is the bounded msgpack cursor, `event.rs` one event's
//! fields (map and legacy array forms) into an [`EngineEvent`].

mod event;
mod reader;
#[cfg(test)]
mod tests;

use event::decode_event;
use reader::{Budget, Reader, Tok};

/// Most bytes of payload decoded (a larger message is refused, not parsed). vLLM publishes one
/// batch per engine step; a step stores at most the step's batched tokens as blocks (16k tokens
/// are about 100 KB of events), so 16 MiB is two orders of magnitude over a real batch.
pub const MAX_PAYLOAD_BYTES: usize = 16 << 20;

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
    #[error("an event of {0} bytes would decode into more than its budget")]
    Budget(usize),
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

/// Decode a payload frame, every event at once (tests and tools; `serve` applies the events
/// of [`decode_batch`] one at a time).
pub fn decode_payload(payload: &[u8]) -> Result<EventBatch, DecodeError> {
    let batch = decode_batch(payload)?;
    Ok(EventBatch {
        ts: batch.ts,
        events: batch.events.collect(),
        dp_rank: batch.dp_rank,
    })
}

impl IntoIterator for EventBatch {
    type Item = Result<EngineEvent, DecodeError>;
    type IntoIter = std::vec::IntoIter<Self::Item>;

    fn into_iter(self) -> Self::IntoIter {
        self.events.into_iter()
    }
}

/// A payload whose envelope is decoded and whose events decode one by one as they are taken.
#[derive(Debug, Clone)]
pub struct LazyBatch<'a> {
    pub ts: Option<f64>,
    pub events: Events<'a>,
    pub dp_rank: Option<u64>,
}

/// Decode a payload's envelope `[ts, events, dp_rank?]` (or a map with those keys). The whole
/// payload is checked to be well-formed msgpack here, walking it without allocating; the events
/// are decoded when the iterator is advanced.
pub fn decode_batch(payload: &[u8]) -> Result<LazyBatch<'_>, DecodeError> {
    if payload.len() > MAX_PAYLOAD_BYTES {
        return Err(DecodeError::TooLarge(payload.len()));
    }
    let mut r = Reader::new(payload);
    let mut ts = None;
    let mut events = None;
    let mut dp_rank = None;
    match r.next()? {
        Tok::Array(n) => {
            for i in 0..n {
                let tok = r.next()?;
                match i {
                    0 => ts = tok.as_f64(),
                    1 => events = Some(events_of(tok, &r)),
                    2 => dp_rank = tok.as_u64(),
                    _ => {}
                }
                r.skip_children(tok)?;
            }
        }
        Tok::Map(n) => {
            let mut seen = [false; 3];
            for _ in 0..n {
                let key = r.next()?;
                let field = match key {
                    Tok::Str(b"ts") => Some(0),
                    Tok::Str(b"events") => Some(1),
                    Tok::Str(b"data_parallel_rank") => Some(2),
                    _ => None,
                };
                r.skip_children(key)?;
                let tok = r.next()?;
                if let Some(i) = field.filter(|&i| !std::mem::replace(&mut seen[i], true)) {
                    match i {
                        0 => ts = tok.as_f64(),
                        1 => events = Some(events_of(tok, &r)),
                        _ => dp_rank = tok.as_u64(),
                    }
                }
                r.skip_children(tok)?;
            }
        }
        _ => return Err(DecodeError::PayloadShape),
    }
    let events = events.flatten().ok_or(DecodeError::PayloadShape)?;
    Ok(LazyBatch {
        ts,
        events,
        dp_rank,
    })
}

/// The events of an `events` value (`None`: not an array); `r` is just after its token.
fn events_of<'a>(tok: Tok<'a>, r: &Reader<'a>) -> Option<Events<'a>> {
    match tok {
        Tok::Array(n) => Some(Events {
            reader: r.clone(),
            left: n,
        }),
        _ => None,
    }
}

/// Decoded bytes an event may take per byte it takes on the wire (a real vLLM event takes
/// about 5: a u64 hash is 9 bytes on the wire and 40 decoded, a token 1 to 5 and 4).
pub const EVENT_DECODE_FACTOR: usize = 8;
/// Decoded bytes any event may take on top of that.
pub const EVENT_DECODE_SLACK: usize = 4 << 10;

/// The events of a payload, decoded one at a time: at most one decoded event exists at once,
/// and it takes at most `EVENT_DECODE_FACTOR` x its wire bytes + `EVENT_DECODE_SLACK`
/// (an event that would take more is an error, [`DecodeError::Budget`]).
#[derive(Debug, Clone)]
pub struct Events<'a> {
    reader: Reader<'a>,
    left: usize,
}

impl Iterator for Events<'_> {
    type Item = Result<EngineEvent, DecodeError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.left == 0 {
            return None;
        }
        self.left -= 1;
        let start = self.reader.pos;
        let mut after = self.reader.clone();
        if let Err(err) = after.skip() {
            // Cannot happen after `decode_batch` walked the payload; stop, do not loop.
            self.left = 0;
            return Some(Err(err));
        }
        let wire = after.pos - start;
        let mut budget = Budget {
            left: wire
                .saturating_mul(EVENT_DECODE_FACTOR)
                .saturating_add(EVENT_DECODE_SLACK),
            wire,
        };
        let event = decode_event(&mut self.reader, &mut budget);
        self.reader = after;
        Some(event)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.left, Some(self.left))
    }
}
