//! `default_selector` settings that are more than a number.

use serde::Deserialize;

router_core::spelled_enum! {
    /// How the built-in `default` breaks an exact tie between rows of equal cost.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
    pub enum TieBreak {
        /// The lowest `(worker_id, dp_rank)`: deterministic, but with idle rows every request
        /// lands on the lowest ids.
        LowestRow = "lowest_row",
        /// The tied row that ranks first in an order drawn from the request (its prompt length,
        /// block count and session id) and each row's id: the same request always breaks the
        /// same way, whatever the row order, and different requests spread over the tied rows.
        /// The host's default (`DEFAULT_TIE_BREAK`).
        #[default]
        Spread = "spread",
    }
}

router_core::spelled_enum! {
    /// What the `spread` tie-break counts as a row's room for a prompt nobody caches
    /// (`default_selector.room`, and the built-in `default`'s and two-tier's `room` parameter).
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
    pub enum Room {
        /// Capacity minus the indexed device blocks: free blocks. The host's default
        /// (`DEFAULT_ROOM`).
        #[default]
        Free = "free",
        /// Capacity minus the blocks requests used lately (`kv_recent_device_blocks`, within
        /// `kv_recent_window_ms`): a full cache nobody used lately counts as room, since the
        /// engine evicts its least recently used blocks first. Free blocks when the host sends
        /// no recent column.
        NotRecent = "not_recent",
    }
}

impl<'de> Deserialize<'de> for Room {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        const NAMES: &[&str] = &[Room::Free.as_str(), Room::NotRecent.as_str()];
        let name = String::deserialize(d)?;
        Room::from_name(&name).ok_or_else(|| serde::de::Error::unknown_variant(&name, NAMES))
    }
}

impl<'de> Deserialize<'de> for TieBreak {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        const NAMES: &[&str] = &[TieBreak::LowestRow.as_str(), TieBreak::Spread.as_str()];
        let name = String::deserialize(d)?;
        TieBreak::from_name(&name).ok_or_else(|| serde::de::Error::unknown_variant(&name, NAMES))
    }
}
