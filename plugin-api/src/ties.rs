//! Telling apart rows a policy finds exactly equal, the way the host's built-in `default`
//! selector and the shipped two-tier plugin both do it, for any policy that wants the same.
//!
//! Plain functions over the safe types: nothing here crosses the ABI, so they may change in any
//! release without touching a plugin's compatibility.
//!
//! The order has two parts. First **room**: a row whose cache has more free blocks (its
//! [`Rows::kv_capacity_blocks`] minus its indexed device blocks, [`Rows::kv_indexed_blocks`])
//! comes first, so a prompt nobody caches goes where it evicts least; or, with
//! [`RoomColumns::not_recent`], its capacity minus the blocks requests used lately
//! ([`Rows::kv_recent_device_blocks`]), so it goes where it evicts the least live work. Then a
//! **spread** rank
//! drawn from the request and the row id: the same request always breaks the same way whatever
//! the row order, and different requests share the tied rows evenly.

use crate::abi::RowId;
use crate::policy::{Context, Rows};

/// splitmix64's output function.
#[inline]
pub fn mix(state: u64) -> u64 {
    let mut z = state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// splitmix64's increment.
pub const GOLDEN_GAMMA: u64 = 0x9e37_79b9_7f4a_7c15;

/// A 64-bit key of what the context says about the request: its prompt length, its block count
/// and its session id. Requests that agree on all three get the same key.
pub fn request_key(ctx: &Context<'_>) -> u64 {
    let mut h = mix(ctx.prompt_tokens() ^ ctx.request_blocks().rotate_left(40));
    if let Some(session) = ctx.session_id() {
        for chunk in session.as_bytes().chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            h = mix(h ^ u64::from_le_bytes(word));
        }
    }
    h
}

/// Row `row`'s rank for the request of key `request` ([`request_key`]); lower wins. The same row
/// and request always rank the same, whatever the order rows come in.
#[inline]
pub fn spread_rank(request: u64, row: RowId) -> u64 {
    let row = row.worker_id.rotate_left(32) ^ u64::from(row.dp_rank);
    mix(request ^ mix(row.wrapping_add(GOLDEN_GAMMA)))
}

/// The room part of the order for a row of KV capacity `capacity` and `indexed` device blocks
/// cached (from [`RoomColumns`]); lower wins: `indexed - capacity` in whole blocks, so the row
/// with the most free blocks ranks first. An unknown capacity (`NaN`) counts as 0 (the row
/// ranks by how much it caches) and an unknown count as nothing cached.
#[inline]
pub fn room_rank(capacity: f64, indexed: f64) -> i64 {
    let known = |x: f64| if x.is_nan() { 0.0 } else { x };
    // `as` saturates.
    (known(indexed) - known(capacity)) as i64
}

/// The two columns [`room_rank`] reads, when the host sends them (a 1.3 host with a KV index):
/// the capacity and either the indexed device blocks ([`RoomColumns::of`]) or the recently used
/// ones ([`RoomColumns::not_recent`]).
#[derive(Debug, Clone, Copy)]
pub struct RoomColumns<'a> {
    indexed: &'a [f64],
    capacity: Option<&'a [f64]>,
}

impl<'a> RoomColumns<'a> {
    /// The rows' indexed device blocks and, when known, capacities; `None` when the host sent no
    /// indexed blocks (then every row has the same room, and only the spread rank orders them).
    pub fn of(rows: &Rows<'a>) -> Option<Self> {
        Some(RoomColumns {
            indexed: rows.kv_indexed_blocks()?.device,
            capacity: rows.kv_capacity_blocks(),
        })
    }

    /// Room as `capacity - recent` ([`Rows::kv_recent_device_blocks`], a 1.5 host with its
    /// recent window on): a full cache that no request used lately ranks as roomy as an empty
    /// one, since the engine evicts its least recently used blocks first. Falls back to
    /// [`RoomColumns::of`] when the host sends no recent column.
    pub fn not_recent(rows: &Rows<'a>) -> Option<Self> {
        match rows.kv_recent_device_blocks() {
            Some(recent) => Some(RoomColumns {
                indexed: recent,
                capacity: rows.kv_capacity_blocks(),
            }),
            None => Self::of(rows),
        }
    }

    /// Row `i`'s [`room_rank`]; 0 for an index past the columns.
    #[inline]
    pub fn rank(&self, i: usize) -> i64 {
        let indexed = self.indexed.get(i).copied().unwrap_or(0.0);
        let capacity = self
            .capacity
            .and_then(|c| c.get(i).copied())
            .unwrap_or(f64::NAN);
        room_rank(capacity, indexed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn more_free_blocks_rank_first_and_unknowns_count_as_nothing() {
        assert!(room_rank(80.0, 10.0) < room_rank(80.0, 40.0));
        assert!(room_rank(160.0, 40.0) < room_rank(80.0, 40.0));
        assert_eq!(room_rank(f64::NAN, 7.0), 7);
        assert_eq!(room_rank(80.0, f64::NAN), -80);
        assert_eq!(room_rank(f64::INFINITY, 0.0), i64::MIN);
    }

    #[test]
    fn the_spread_rank_depends_on_the_request_and_the_row_only() {
        let a = RowId {
            worker_id: 1,
            dp_rank: 0,
        };
        let b = RowId {
            worker_id: 2,
            dp_rank: 0,
        };
        assert_eq!(spread_rank(7, a), spread_rank(7, a));
        assert_ne!(spread_rank(7, a), spread_rank(7, b));
        let first_a = (0..1000u64)
            .filter(|&r| spread_rank(mix(r), a) < spread_rank(mix(r), b))
            .count();
        assert!((400..600).contains(&first_a), "{first_a} of 1000");
    }
}
