//! A counter many threads bump on every decision without sharing a cache line.
//!
//! One atomic per stripe, each on its own cache lines; a thread always bumps the same stripe
//! (assigned round-robin when it first counts), and a read sums the stripes. A single shared
//! atomic would move its line between cores on every increment.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use crossbeam_utils::CachePadded;

const STRIPES: usize = 8;

static NEXT_STRIPE: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    static STRIPE: usize = NEXT_STRIPE.fetch_add(1, Ordering::Relaxed);
}

/// This thread's stripe: a small number fixed for the thread's life, assigned round-robin.
#[inline]
pub fn thread_stripe() -> usize {
    STRIPE.try_with(|s| *s).unwrap_or(0)
}

#[derive(Debug, Default)]
pub struct StripedCounter {
    stripes: [CachePadded<AtomicU64>; STRIPES],
}

impl StripedCounter {
    #[inline]
    pub fn add(&self, n: u64) {
        self.stripes[thread_stripe() % STRIPES].fetch_add(n, Ordering::Relaxed);
    }

    /// The sum over every stripe (increments racing with the read may or may not be in it).
    pub fn get(&self) -> u64 {
        self.stripes
            .iter()
            .fold(0u64, |sum, s| sum.wrapping_add(s.load(Ordering::Relaxed)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_what_every_thread_added() {
        let counter = StripedCounter::default();
        std::thread::scope(|s| {
            for _ in 0..12 {
                s.spawn(|| (0..1000).for_each(|_| counter.add(1)));
            }
        });
        counter.add(5);
        assert_eq!(counter.get(), 12_005);
    }
}
