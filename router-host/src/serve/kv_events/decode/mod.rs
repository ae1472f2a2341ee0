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

/// What an event may still allocate.
struct Budget {
    left: usize,
    wire: usize,
}

impl Budget {
    fn charge(&mut self, items: usize, each: usize) -> Result<(), DecodeError> {
        let cost = items.saturating_mul(each);
        self.left = self
            .left
            .checked_sub(cost)
            .ok_or(DecodeError::Budget(self.wire))?;
        Ok(())
    }
}

/// One msgpack token: a scalar, or the header of an array or a map whose elements follow.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Tok<'a> {
    Nil,
    Bool,
    Uint(u64),
    Int(i64),
    Float(f64),
    Str(&'a [u8]),
    Bin(&'a [u8]),
    /// Elements that follow.
    Array(usize),
    /// Key-value pairs that follow.
    Map(usize),
    Ext,
}

impl Tok<'_> {
    fn as_f64(&self) -> Option<f64> {
        match *self {
            Tok::Float(f) => Some(f),
            Tok::Uint(u) => i64::try_from(u).ok().map(|i| i as f64),
            Tok::Int(i) => Some(i as f64),
            _ => None,
        }
    }

    fn as_u64(&self) -> Option<u64> {
        match *self {
            Tok::Uint(u) => Some(u),
            Tok::Int(i) => u64::try_from(i).ok(),
            _ => None,
        }
    }
}

/// A cursor over msgpack bytes. Every declared length is checked against the bytes left before
/// anything is read (an array or map element takes at least one byte), and nothing is
/// allocated: strings and binaries are borrowed.
#[derive(Debug, Clone)]
struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

fn truncated(pos: usize) -> DecodeError {
    DecodeError::Msgpack(format!("truncated at byte {pos}"))
}

impl<'a> Reader<'a> {
    fn new(buf: &'a [u8]) -> Self {
        Reader { buf, pos: 0 }
    }

    fn left(&self) -> usize {
        self.buf.len() - self.pos
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&end| end <= self.buf.len())
            .ok_or_else(|| truncated(self.pos))?;
        let bytes = &self.buf[self.pos..end];
        self.pos = end;
        Ok(bytes)
    }

    fn be<const N: usize>(&mut self) -> Result<[u8; N], DecodeError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    fn len8(&mut self) -> Result<usize, DecodeError> {
        Ok(usize::from(self.be::<1>()?[0]))
    }

    fn len16(&mut self) -> Result<usize, DecodeError> {
        Ok(usize::from(u16::from_be_bytes(self.be()?)))
    }

    fn len32(&mut self) -> Result<usize, DecodeError> {
        usize::try_from(u32::from_be_bytes(self.be()?)).map_err(|_| truncated(self.pos))
    }

    /// `count` elements of at least one byte each must fit in what is left.
    fn elements(&self, count: usize, per: usize) -> Result<usize, DecodeError> {
        if count.saturating_mul(per) > self.left() {
            return Err(DecodeError::Msgpack(format!(
                "a length of {count} at byte {} is over the {} bytes left",
                self.pos,
                self.left()
            )));
        }
        Ok(count)
    }

    fn next(&mut self) -> Result<Tok<'a>, DecodeError> {
        use rmp::Marker as M;
        let marker = M::from_u8(self.be::<1>()?[0]);
        Ok(match marker {
            M::FixPos(v) => Tok::Uint(u64::from(v)),
            M::FixNeg(v) => Tok::Int(i64::from(v)),
            M::Null => Tok::Nil,
            M::True | M::False => Tok::Bool,
            M::U8 => Tok::Uint(u64::from(u8::from_be_bytes(self.be()?))),
            M::U16 => Tok::Uint(u64::from(u16::from_be_bytes(self.be()?))),
            M::U32 => Tok::Uint(u64::from(u32::from_be_bytes(self.be()?))),
            M::U64 => Tok::Uint(u64::from_be_bytes(self.be()?)),
            M::I8 => Tok::Int(i64::from(i8::from_be_bytes(self.be()?))),
            M::I16 => Tok::Int(i64::from(i16::from_be_bytes(self.be()?))),
            M::I32 => Tok::Int(i64::from(i32::from_be_bytes(self.be()?))),
            M::I64 => Tok::Int(i64::from_be_bytes(self.be()?)),
            M::F32 => Tok::Float(f64::from(f32::from_be_bytes(self.be()?))),
            M::F64 => Tok::Float(f64::from_be_bytes(self.be()?)),
            M::FixStr(n) => Tok::Str(self.take(usize::from(n))?),
            M::Str8 => {
                let n = self.len8()?;
                Tok::Str(self.take(n)?)
            }
            M::Str16 => {
                let n = self.len16()?;
                Tok::Str(self.take(n)?)
            }
            M::Str32 => {
                let n = self.len32()?;
                Tok::Str(self.take(n)?)
            }
            M::Bin8 => {
                let n = self.len8()?;
                Tok::Bin(self.take(n)?)
            }
            M::Bin16 => {
                let n = self.len16()?;
                Tok::Bin(self.take(n)?)
            }
            M::Bin32 => {
                let n = self.len32()?;
                Tok::Bin(self.take(n)?)
            }
            M::FixArray(n) => Tok::Array(self.elements(usize::from(n), 1)?),
            M::Array16 => {
                let n = self.len16()?;
                Tok::Array(self.elements(n, 1)?)
            }
            M::Array32 => {
                let n = self.len32()?;
                Tok::Array(self.elements(n, 1)?)
            }
            M::FixMap(n) => Tok::Map(self.elements(usize::from(n), 2)?),
            M::Map16 => {
                let n = self.len16()?;
                Tok::Map(self.elements(n, 2)?)
            }
            M::Map32 => {
                let n = self.len32()?;
                Tok::Map(self.elements(n, 2)?)
            }
            M::FixExt1 | M::FixExt2 | M::FixExt4 | M::FixExt8 | M::FixExt16 => {
                let n = match marker {
                    M::FixExt1 => 1,
                    M::FixExt2 => 2,
                    M::FixExt4 => 4,
                    M::FixExt8 => 8,
                    _ => 16,
                };
                self.take(1 + n)?;
                Tok::Ext
            }
            M::Ext8 | M::Ext16 | M::Ext32 => {
                let n = match marker {
                    M::Ext8 => self.len8()?,
                    M::Ext16 => self.len16()?,
                    _ => self.len32()?,
                };
                self.take(1 + n)?;
                Tok::Ext
            }
            M::Reserved => {
                return Err(DecodeError::Msgpack(format!(
                    "reserved marker 0xc1 at byte {}",
                    self.pos - 1
                )))
            }
        })
    }

    /// Skip what follows `tok` (the elements of an array or a map; nothing for a scalar),
    /// without recursion or allocation.
    fn skip_children(&mut self, tok: Tok<'_>) -> Result<(), DecodeError> {
        let mut pending: usize = match tok {
            Tok::Array(n) => n,
            Tok::Map(n) => n * 2,
            _ => 0,
        };
        while pending > 0 {
            pending -= 1;
            match self.next()? {
                Tok::Array(n) => pending += n,
                Tok::Map(n) => pending += n * 2,
                _ => {}
            }
        }
        Ok(())
    }

    /// Skip one whole value.
    fn skip(&mut self) -> Result<(), DecodeError> {
        let tok = self.next()?;
        self.skip_children(tok)
    }
}

/// Field names an event may carry, by index into [`Fields`]'s slots.
const TYPE: usize = 0;
const BLOCK_HASHES: usize = 1;
const PARENT: usize = 2;
const TOKEN_IDS: usize = 3;
const BLOCK_SIZE: usize = 4;
const MEDIUM: usize = 5;
const LORA_NAME: usize = 6;
const EXTRA_KEYS: usize = 7;
const GROUP_IDX: usize = 8;
const NAMES: [&[u8]; 9] = [
    b"type",
    b"block_hashes",
    b"parent_block_hash",
    b"token_ids",
    b"block_size",
    b"medium",
    b"lora_name",
    b"extra_keys",
    b"group_idx",
];
/// Positions of those fields in the legacy array forms (`None`: not in that form).
/// BlockStored: type, block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
/// lora_name, extra_keys, group_idx, ...
const STORED_AT: [Option<usize>; 9] = [
    Some(0),
    Some(1),
    Some(2),
    Some(3),
    Some(4),
    Some(6),
    Some(7),
    Some(8),
    Some(9),
];
/// BlockRemoved: type, block_hashes, medium, group_idx.
const REMOVED_AT: [Option<usize>; 9] = [
    Some(0),
    Some(1),
    None,
    None,
    None,
    Some(2),
    None,
    None,
    Some(3),
];
/// AllBlocksCleared: type, medium.
const CLEARED_AT: [Option<usize>; 9] = [Some(0), None, None, None, None, Some(1), None, None, None];
/// Array elements worth remembering (the longest form's fields).
const POSITIONS: usize = 10;

/// Where each known field's value starts (non-null values only, as absent ones).
struct Fields<'a> {
    slots: [Option<Reader<'a>>; 9],
}

impl<'a> Fields<'a> {
    /// Read the value of `slot` (if present and not null).
    fn take(&mut self, slot: usize) -> Option<(Tok<'a>, Reader<'a>)> {
        let mut r = self.slots[slot].take()?;
        match r.next() {
            Ok(Tok::Nil) | Err(_) => None,
            Ok(tok) => Some((tok, r)),
        }
    }
}

fn decode_event(r: &mut Reader<'_>, budget: &mut Budget) -> Result<EngineEvent, DecodeError> {
    let (kind, mut f) = match r.next()? {
        Tok::Map(n) => {
            let mut slots: [Option<Reader<'_>>; 9] = Default::default();
            for _ in 0..n {
                let key = r.next()?;
                let slot = match key {
                    Tok::Str(name) => NAMES.iter().position(|n| *n == name),
                    _ => None,
                };
                r.skip_children(key)?;
                if let Some(slot) = slot {
                    if slots[slot].is_none() {
                        slots[slot] = Some(r.clone());
                    }
                }
                r.skip()?;
            }
            let mut f = Fields { slots };
            let kind = match f.take(TYPE) {
                Some((Tok::Str(kind), _)) => kind,
                _ => return Err(DecodeError::EventShape),
            };
            (kind, f)
        }
        Tok::Array(n) => {
            let mut at: [Option<Reader<'_>>; POSITIONS] = Default::default();
            for slot in at.iter_mut().take(n) {
                *slot = Some(r.clone());
                r.skip()?;
            }
            let kind = match at[0].clone().map(|mut r| r.next()) {
                Some(Ok(Tok::Str(kind))) => kind,
                _ => return Err(DecodeError::EventShape),
            };
            let table = match kind {
                b"BlockStored" => STORED_AT,
                b"BlockRemoved" => REMOVED_AT,
                b"AllBlocksCleared" => CLEARED_AT,
                _ => [None; 9],
            };
            let slots = table.map(|p| p.and_then(|p| at[p].clone()));
            (kind, Fields { slots })
        }
        _ => return Err(DecodeError::EventShape),
    };
    match kind {
        b"BlockStored" => {
            let block_hashes = hashes(f.take(BLOCK_HASHES), budget)?;
            let parent_block_hash = f.take(PARENT).map(|(tok, _)| hash(tok)).transpose()?;
            let token_ids = tokens(f.take(TOKEN_IDS), budget)?;
            let block_size = uint(f.take(BLOCK_SIZE), "block_size")?;
            let medium = string(f.take(MEDIUM), "medium", budget)?;
            let lora_name = string(f.take(LORA_NAME), "lora_name", budget)?;
            let extra_keys = match f.take(EXTRA_KEYS) {
                None => Vec::new(),
                Some((Tok::Array(n), mut r)) => {
                    budget.charge(n, std::mem::size_of::<BlockKeys>())?;
                    let mut keys = Vec::with_capacity(n);
                    for _ in 0..n {
                        keys.push(block_keys(&mut r, budget)?);
                    }
                    keys
                }
                Some(_) => vec![BlockKeys::Other],
            };
            let group_idx = uint(f.take(GROUP_IDX), "group_idx")?;
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
        b"BlockRemoved" => {
            let block_hashes = hashes(f.take(BLOCK_HASHES), budget)?;
            let medium = string(f.take(MEDIUM), "medium", budget)?;
            let group_idx = uint(f.take(GROUP_IDX), "group_idx")?;
            Ok(EngineEvent::BlockRemoved {
                block_hashes,
                medium,
                group_idx,
            })
        }
        b"AllBlocksCleared" => {
            let medium = string(f.take(MEDIUM), "medium", budget).unwrap_or(None);
            Ok(EngineEvent::AllBlocksCleared { medium })
        }
        other => {
            budget.charge(other.len(), 1)?;
            Ok(EngineEvent::Unknown(
                String::from_utf8_lossy(other).into_owned(),
            ))
        }
    }
}

fn hash(tok: Tok<'_>) -> Result<EngineHash, DecodeError> {
    match tok {
        Tok::Uint(u) => Ok(EngineHash::Int(u)),
        // A signed encoding of a hash over i64::MAX: keep its bits.
        Tok::Int(i) => Ok(EngineHash::Int(i as u64)),
        Tok::Bin(bytes) => <[u8; 32]>::try_from(bytes)
            .map(EngineHash::Bytes)
            .map_err(|_| DecodeError::HashSize(bytes.len())),
        _ => Err(DecodeError::Field("block hash")),
    }
}

fn hashes(
    value: Option<(Tok<'_>, Reader<'_>)>,
    budget: &mut Budget,
) -> Result<Vec<EngineHash>, DecodeError> {
    let Some((Tok::Array(n), mut r)) = value else {
        return Err(DecodeError::Field("block_hashes"));
    };
    budget.charge(n, std::mem::size_of::<EngineHash>())?;
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        out.push(hash(r.next()?)?);
    }
    Ok(out)
}

fn tokens(
    value: Option<(Tok<'_>, Reader<'_>)>,
    budget: &mut Budget,
) -> Result<Vec<u32>, DecodeError> {
    match value {
        // Offloaded stores (CPU, disk) may carry no tokens.
        None => Ok(Vec::new()),
        Some((Tok::Array(n), mut r)) => {
            budget.charge(n, std::mem::size_of::<u32>())?;
            let mut out = Vec::with_capacity(n);
            for _ in 0..n {
                let token = r
                    .next()?
                    .as_u64()
                    .and_then(|t| u32::try_from(t).ok())
                    .ok_or(DecodeError::TokenId)?;
                out.push(token);
            }
            Ok(out)
        }
        Some(_) => Err(DecodeError::Field("token_ids")),
    }
}

fn uint(
    value: Option<(Tok<'_>, Reader<'_>)>,
    name: &'static str,
) -> Result<Option<u64>, DecodeError> {
    value
        .map(|(tok, _)| tok.as_u64().ok_or(DecodeError::Field(name)))
        .transpose()
}

/// One block's `extra_keys` entry, the reader just before it.
fn block_keys(r: &mut Reader<'_>, budget: &mut Budget) -> Result<BlockKeys, DecodeError> {
    let tok = r.next()?;
    let Tok::Array(n) = tok else {
        r.skip_children(tok)?;
        return Ok(match tok {
            Tok::Nil => BlockKeys::None,
            _ => BlockKeys::Other,
        });
    };
    let mut strings = Vec::new();
    for i in 0..n {
        match r.next()? {
            Tok::Str(s) => match std::str::from_utf8(s) {
                Ok(s) => {
                    budget.charge(1, std::mem::size_of::<String>() + s.len())?;
                    strings.push(s.to_owned());
                }
                Err(_) => return other_keys(r, Tok::Nil, n - i - 1),
            },
            item => return other_keys(r, item, n - i - 1),
        }
    }
    Ok(BlockKeys::Strings(strings))
}

/// Skip the rest of an `extra_keys` entry that is not all strings.
fn other_keys(r: &mut Reader<'_>, item: Tok<'_>, rest: usize) -> Result<BlockKeys, DecodeError> {
    r.skip_children(item)?;
    for _ in 0..rest {
        r.skip()?;
    }
    Ok(BlockKeys::Other)
}

fn string(
    value: Option<(Tok<'_>, Reader<'_>)>,
    name: &'static str,
    budget: &mut Budget,
) -> Result<Option<String>, DecodeError> {
    match value {
        None => Ok(None),
        Some((Tok::Str(s), _)) => {
            budget.charge(s.len(), 1)?;
            std::str::from_utf8(s)
                .map(|s| Some(s.to_owned()))
                .map_err(|_| DecodeError::Field(name))
        }
        Some(_) => Err(DecodeError::Field(name)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rmpv::Value;

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

    #[test]
    fn declared_lengths_are_checked_before_anything_is_read() {
        // An array32 declaring 2^32-1 events, a map32 declaring as many pairs, a str32 of
        // 4 GiB, on a few bytes: errors, nothing reserved.
        let cases: [&[u8]; 4] = [
            &[
                0x92, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0xdd, 0xff, 0xff, 0xff, 0xff, 0xc0,
            ],
            &[0xdf, 0xff, 0xff, 0xff, 0xff, 0xc0, 0xc0],
            &[0x92, 0xdb, 0xff, 0xff, 0xff, 0xff, b'x'],
            &[0x92, 0xc0, 0x91, 0xc7, 0xff, 0x01],
        ];
        for bytes in cases {
            assert!(
                matches!(decode_payload(bytes), Err(DecodeError::Msgpack(_))),
                "{bytes:x?}: {:?}",
                decode_payload(bytes)
            );
        }
    }

    #[test]
    fn nils_and_unknown_fields_cost_nothing_and_events_come_one_at_a_time() {
        // `[ts, [nil x N]]`: the envelope walks N bytes without allocating; each event is an
        // error taken and dropped in turn.
        let n = 100_000;
        let mut bytes = vec![0x92, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0xdd];
        bytes.extend_from_slice(&(n as u32).to_be_bytes());
        bytes.resize(bytes.len() + n, 0xc0);
        let batch = decode_batch(&bytes).expect("the envelope decodes");
        assert_eq!(batch.events.size_hint(), (n, Some(n)));
        let mut count = 0;
        for event in batch.events {
            assert_eq!(event, Err(DecodeError::EventShape));
            count += 1;
        }
        assert_eq!(count, n);
        // A payload over the limit is refused unread.
        assert_eq!(
            decode_batch(&vec![0xc0; MAX_PAYLOAD_BYTES + 1]).err(),
            Some(DecodeError::TooLarge(MAX_PAYLOAD_BYTES + 1))
        );
    }

    #[test]
    fn an_event_decodes_within_its_budget_or_not_at_all() {
        let tokens =
            |blocks: usize| -> Vec<u32> { (0..blocks as u32 * 4).map(|t| 1000 + t).collect() };
        // Real hashes (u64 over 2^32: 9 bytes each) with their tokens decode.
        let real: Vec<Value> = (0..20_000u64).map(|i| Value::from(u64::MAX - i)).collect();
        let bytes = payload(vec![stored_map(
            real,
            Value::Nil,
            &tokens(20_000),
            Value::Nil,
        )]);
        let batch = decode_payload(&bytes).expect("decodes");
        assert!(
            matches!(&batch.events[0], Ok(EngineEvent::BlockStored(b)) if b.block_hashes.len() == 20_000)
        );
        // 1-byte hashes would expand 40x: refused, counted as an event that did not decode.
        let tiny: Vec<Value> = (0..20_000).map(|_| Value::from(1)).collect();
        let bytes = payload(vec![Value::Array(vec![
            s("BlockRemoved"),
            Value::Array(tiny),
        ])]);
        let batch = decode_payload(&bytes).expect("the envelope decodes");
        assert!(
            matches!(batch.events[0], Err(DecodeError::Budget(_))),
            "{:?}",
            batch.events[0]
        );
        // The nils of a map's `extra_keys` without tokens: 32x, refused.
        let bytes = payload(vec![Value::Map(vec![
            (s("type"), s("BlockStored")),
            (s("block_hashes"), Value::Array(vec![])),
            (s("extra_keys"), Value::Array(vec![Value::Nil; 50_000])),
        ])]);
        let batch = decode_payload(&bytes).expect("the envelope decodes");
        assert!(matches!(batch.events[0], Err(DecodeError::Budget(_))));
    }
}
