//! A counter many threads bump on every decision without sharing a cache line or paying for a
//! locked instruction.
//!
//! The first [`OWNED`] threads that count each own a stripe on its own cache lines: a stripe with
//! one writer is bumped with a plain load and store (a locked read-modify-write costs about
//! 12 ns, see `docs/performance.md`). Threads after those share one more stripe, bumped
//! atomically. A read sums the stripes.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use crossbeam_utils::CachePadded;

/// Threads that get a stripe of their own (a routing pool is a thread or two per core).
pub const OWNED: usize = 16;

static NEXT_THREAD: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    static THREAD: usize = NEXT_THREAD.fetch_add(1, Ordering::Relaxed);
}

/// This thread's number: fixed for the thread's life, counted from 0 in order of first use
/// (`usize::MAX` while the thread is being torn down).
#[inline]
pub fn thread_index() -> usize {
    THREAD.try_with(|s| *s).unwrap_or(usize::MAX)
}

#[derive(Debug, Default)]
pub struct StripedCounter {
    stripes: [CachePadded<AtomicU64>; OWNED + 1],
}

impl StripedCounter {
    #[inline]
    pub fn add(&self, n: u64) {
        let thread = thread_index();
        if thread < OWNED {
            // Only this thread writes its stripe: no update is lost without a locked add.
            let own = &self.stripes[thread];
            own.store(
                own.load(Ordering::Relaxed).wrapping_add(n),
                Ordering::Relaxed,
            );
        } else {
            self.stripes[OWNED].fetch_add(n, Ordering::Relaxed);
        }
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
            // More threads than owned stripes: the late ones share the last stripe.
            for _ in 0..OWNED + 12 {
                s.spawn(|| (0..1000).for_each(|_| counter.add(1)));
            }
        });
        counter.add(5);
        assert_eq!(counter.get(), (OWNED as u64 + 12) * 1000 + 5);
    }
}
