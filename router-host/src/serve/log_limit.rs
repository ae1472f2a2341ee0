//! Log lines that can repeat per request or per connection (a flood of shed connections, an
//! engine that answers too much at every probe): at most one per interval per call site, with
//! the number left out since the last one.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::LazyLock;
use std::time::Instant;

static START: LazyLock<Instant> = LazyLock::new(Instant::now);

/// One call site's limit: `static LIMIT: LogLimit = LogLimit::new(10_000);`.
#[derive(Debug)]
pub struct LogLimit {
    interval_ms: u64,
    /// Milliseconds since [`START`] from which the next line may be written.
    next_ms: AtomicU64,
    suppressed: AtomicU64,
}

impl LogLimit {
    pub const fn new(interval_ms: u64) -> LogLimit {
        LogLimit {
            interval_ms,
            next_ms: AtomicU64::new(0),
            suppressed: AtomicU64::new(0),
        }
    }

    /// `Some(n)`: write the line now (`n` lines were left out since the previous one); `None`:
    /// leave it out.
    pub fn check(&self) -> Option<u64> {
        let now = u64::try_from(START.elapsed().as_millis()).unwrap_or(u64::MAX);
        let next = self.next_ms.load(Ordering::Relaxed);
        if now >= next
            && self
                .next_ms
                .compare_exchange(
                    next,
                    now.saturating_add(self.interval_ms),
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                )
                .is_ok()
        {
            return Some(self.suppressed.swap(0, Ordering::Relaxed));
        }
        self.suppressed.fetch_add(1, Ordering::Relaxed);
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_line_per_interval_and_the_count_left_out() {
        let limit = LogLimit::new(60_000);
        assert_eq!(limit.check(), Some(0));
        for _ in 0..5 {
            assert_eq!(limit.check(), None);
        }
        // The next one is due only after the interval: force it.
        limit.next_ms.store(0, Ordering::Relaxed);
        assert_eq!(limit.check(), Some(5));
    }
}
