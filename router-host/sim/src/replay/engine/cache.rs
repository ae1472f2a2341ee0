//! The prefix cache of an engine: block id -> slot with a reference count; unreferenced slots on
//! an LRU list, evicted oldest first.

use router_core::fast_hash::FastMap;

const NIL: u32 = u32::MAX;

#[derive(Debug, Clone)]
pub(super) struct Slot {
    block: u64,
    pub(super) refs: u32,
    prev: u32,
    next: u32,
}

/// Prefix cache: block id -> slot with a reference count; unreferenced slots on an LRU list.
#[derive(Debug, Default)]
pub(super) struct BlockCache {
    pub(super) map: FastMap<u64, u32>,
    pub(super) slots: Vec<Slot>,
    free_slots: Vec<u32>,
    /// Oldest unreferenced.
    head: u32,
    tail: u32,
    pub(super) lru_len: u64,
}

impl BlockCache {
    pub(super) fn new() -> Self {
        BlockCache {
            head: NIL,
            tail: NIL,
            ..BlockCache::default()
        }
    }

    pub(super) fn len(&self) -> u64 {
        self.map.len() as u64
    }

    pub(super) fn get(&self, block: u64) -> Option<u32> {
        self.map.get(&block).copied()
    }

    fn unlink(&mut self, s: u32) {
        let (prev, next) = (self.slots[s as usize].prev, self.slots[s as usize].next);
        if prev == NIL {
            self.head = next;
        } else {
            self.slots[prev as usize].next = next;
        }
        if next == NIL {
            self.tail = prev;
        } else {
            self.slots[next as usize].prev = prev;
        }
        self.lru_len -= 1;
    }

    fn push_newest(&mut self, s: u32) {
        self.slots[s as usize].prev = self.tail;
        self.slots[s as usize].next = NIL;
        if self.tail == NIL {
            self.head = s;
        } else {
            self.slots[self.tail as usize].next = s;
        }
        self.tail = s;
        self.lru_len += 1;
    }

    pub(super) fn acquire(&mut self, s: u32) {
        if self.slots[s as usize].refs == 0 {
            self.unlink(s);
        }
        self.slots[s as usize].refs += 1;
    }

    pub(super) fn release(&mut self, s: u32) {
        let slot = &mut self.slots[s as usize];
        slot.refs -= 1;
        if slot.refs == 0 {
            self.push_newest(s);
        }
    }

    /// A new entry referenced once.
    pub(super) fn insert(&mut self, block: u64) {
        let slot = Slot {
            block,
            refs: 1,
            prev: NIL,
            next: NIL,
        };
        let s = match self.free_slots.pop() {
            Some(s) => {
                self.slots[s as usize] = slot;
                s
            }
            None => {
                self.slots.push(slot);
                (self.slots.len() - 1) as u32
            }
        };
        self.map.insert(block, s);
    }

    pub(super) fn evict_oldest(&mut self) -> Option<u64> {
        let s = self.head;
        if s == NIL {
            return None;
        }
        self.unlink(s);
        let block = self.slots[s as usize].block;
        self.map.remove(&block);
        self.free_slots.push(s);
        Some(block)
    }
}
