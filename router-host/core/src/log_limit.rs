//! Log lines that can repeat per request, per connection or per probe (a policy failing on every
//! request, a flood of shed connections, an engine that answers too much at every probe): the
//! first occurrence is written, then at most one line per interval with the number left out.
//! The metrics count every occurrence; only the log is thinned.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// One kind of repeated log line: written or not, and how many were not.
#[derive(Debug, Default)]
pub struct LogThrottle {
    /// Nanoseconds since [`epoch`] before which nothing more is written.
    next_ns: AtomicU64,
    /// Occurrences not written since the last line.
    suppressed: AtomicU64,
}

impl LogThrottle {
    pub const fn new() -> LogThrottle {
        LogThrottle {
            next_ns: AtomicU64::new(0),
            suppressed: AtomicU64::new(0),
        }
    }

    /// Whether the occurrence at `now_ns` is written: `Some(n)` with `n` occurrences not written
    /// since the last line, or `None` (counted for the next line).
    pub fn admit(&self, now_ns: u64, interval_ns: u64) -> Option<u64> {
        let next = self.next_ns.load(Ordering::Relaxed);
        if now_ns >= next
            && self
                .next_ns
                .compare_exchange(
                    next,
                    now_ns.saturating_add(interval_ns),
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

    /// [`Self::admit`], except that the first occurrence is not written but counted: for a
    /// condition whose start was already logged (a transition out of service), so the first
    /// line comes one interval later, with the count.
    pub fn admit_after_first(&self, now_ns: u64, interval_ns: u64) -> Option<u64> {
        if self.next_ns.load(Ordering::Relaxed) == 0
            && self
                .next_ns
                .compare_exchange(
                    0,
                    now_ns.saturating_add(interval_ns).max(1),
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                )
                .is_ok()
        {
            self.suppressed.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        self.admit(now_ns, interval_ns)
    }

    /// [`Self::admit`] now.
    pub fn admit_now(&self, interval: Duration) -> Option<u64> {
        self.admit(now_ns(), nanos(interval))
    }

    /// [`Self::admit_after_first`] now.
    pub fn admit_after_first_now(&self, interval: Duration) -> Option<u64> {
        self.admit_after_first(now_ns(), nanos(interval))
    }
}

/// A call site's throttle with its interval: `static LOG: LogLimit = LogLimit::new(10_000);`.
#[derive(Debug)]
pub struct LogLimit {
    interval_ms: u64,
    throttle: LogThrottle,
}

impl LogLimit {
    pub const fn new(interval_ms: u64) -> LogLimit {
        LogLimit {
            interval_ms,
            throttle: LogThrottle::new(),
        }
    }

    /// `Some(n)`: write the line now (`n` lines were left out since the previous one); `None`:
    /// leave it out.
    pub fn check(&self) -> Option<u64> {
        self.throttle
            .admit_now(Duration::from_millis(self.interval_ms))
    }
}

/// Nanoseconds on the throttles' clock.
pub fn now_ns() -> u64 {
    nanos(epoch().elapsed())
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// The clock of every throttle.
fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = 1_000_000_000;

    #[test]
    fn the_first_line_then_one_per_interval_with_the_count() {
        let t = LogThrottle::new();
        assert_eq!(
            t.admit(5, 60 * S),
            Some(0),
            "the first occurrence is written"
        );
        for i in 0..99 {
            assert_eq!(t.admit(5 + i * S / 2, 60 * S), None);
        }
        // One interval later: one line saying how many were not written.
        assert_eq!(t.admit(61 * S, 60 * S), Some(99));
        assert_eq!(t.admit(62 * S, 60 * S), None);
        assert_eq!(t.admit(200 * S, 60 * S), Some(1));
        // A lone occurrence after a quiet interval is written as a fresh one.
        assert_eq!(t.admit(400 * S, 60 * S), Some(0));
    }

    #[test]
    fn after_a_logged_transition_the_first_line_comes_an_interval_later() {
        let t = LogThrottle::new();
        assert_eq!(t.admit_after_first(0, 60 * S), None);
        for i in 1..50 {
            assert_eq!(t.admit_after_first(i * S, 60 * S), None);
        }
        assert_eq!(t.admit_after_first(60 * S, 60 * S), Some(50));
        assert_eq!(t.admit_after_first(61 * S, 60 * S), None);
    }

    #[test]
    fn a_call_site_limit_writes_once_per_interval() {
        let limit = LogLimit::new(60_000);
        assert_eq!(limit.check(), Some(0));
        for _ in 0..5 {
            assert_eq!(limit.check(), None);
        }
    }
}
