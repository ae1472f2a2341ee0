//! One event's fields, from the tagged map form or a legacy positional array, into an
//! [`EngineEvent`] within its budget.

use super::reader::{Budget, Reader, Tok};
use super::{BlockKeys, BlockStored, DecodeError, EngineEvent, EngineHash};

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

pub(super) fn decode_event(
    r: &mut Reader<'_>,
    budget: &mut Budget,
) -> Result<EngineEvent, DecodeError> {
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
                if let Some(token) = r.next_u32() {
                    out.push(token);
                    continue;
                }
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
