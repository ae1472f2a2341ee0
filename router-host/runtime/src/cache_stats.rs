//! What a tokenizer cache did and holds: one shape for the segment cache (serve/segments.rs) and
//! the prefix cache (serve/prefixes.rs), read the same way for the metrics.

use std::hash::{BuildHasher, Hash};
use std::sync::atomic::{AtomicU64, Ordering};

use quick_cache::{Lifecycle, Weighter};

/// Lookups in a cache, and what the cache holds now.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Lookups answered from the cache.
    pub hits: u64,
    /// Lookups tokenized (and cached).
    pub misses: u64,
    pub entries: u64,
    pub bytes: u64,
}

/// A cache's hit and miss counters.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    hits: AtomicU64,
    misses: AtomicU64,
}

impl Counters {
    pub(crate) fn hit(&self, n: u64) {
        if n > 0 {
            self.hits.fetch_add(n, Ordering::Relaxed);
        }
    }

    pub(crate) fn miss(&self, n: u64) {
        if n > 0 {
            self.misses.fetch_add(n, Ordering::Relaxed);
        }
    }

    /// Zero both (after probes, so they count only requests).
    pub(crate) fn reset(&self) {
        self.hits.store(0, Ordering::Relaxed);
        self.misses.store(0, Ordering::Relaxed);
    }

    /// These counts, with what `cache` holds now.
    pub(crate) fn stats<K, V, W, B, L>(
        &self,
        cache: &quick_cache::sync::Cache<K, V, W, B, L>,
    ) -> CacheStats
    where
        K: Eq + Hash,
        V: Clone,
        W: Weighter<K, V> + Clone,
        B: BuildHasher + Clone,
        L: Lifecycle<K, V> + Clone,
    {
        CacheStats {
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            entries: cache.len() as u64,
            bytes: cache.weight(),
        }
    }
}
