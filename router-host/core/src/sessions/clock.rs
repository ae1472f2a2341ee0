//! Time source for session TTLs and queue waits: the [`Clock`] trait, the wall clock and a
//! manually driven clock for tests and replay.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Time since the Unix epoch.
///
/// Session TTLs and queue waits are measured on it. Wall time, so that the instant a binding was
/// last used means the same thing to every router process sharing the binding (see
/// `docs/routing-contract.md`, "Sessions"). Injected so that tests and the replay simulator can
/// drive expiry with simulated time instead of sleeping.
pub trait Clock: Send + Sync {
    /// Time elapsed since the Unix epoch (or, for a simulated clock, since its own start).
    fn now(&self) -> Duration;
}

/// The system's wall clock. A step backwards (NTP) only makes bindings look younger: expiry uses
/// saturating differences, so nothing breaks, a binding just lives a little longer.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl SystemClock {
    pub fn new() -> Self {
        SystemClock
    }
}

impl Clock for SystemClock {
    fn now(&self) -> Duration {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or(Duration::ZERO)
    }
}

/// A clock that only moves when told to, for tests and the replay simulator.
///
/// Shareable via `Arc` (the table holds one handle, the driver another); atomics make `set` and
/// `advance` usable through `&self` from any thread. Resolution is one nanosecond; values beyond
/// `u64::MAX` nanoseconds (about 584 years) saturate.
#[derive(Debug, Default)]
pub struct ManualClock {
    nanos: AtomicU64,
}

impl ManualClock {
    /// A clock reading `start`.
    pub fn new(start: Duration) -> Self {
        Self {
            nanos: AtomicU64::new(duration_to_nanos(start)),
        }
    }

    /// Jump to `t` (may move backwards; that is the caller's business in a simulation).
    pub fn set(&self, t: Duration) {
        self.nanos.store(duration_to_nanos(t), Ordering::SeqCst);
    }

    /// Move forward by `d`, saturating instead of wrapping.
    pub fn advance(&self, d: Duration) {
        let step = duration_to_nanos(d);
        // The closure always returns `Some`, so `fetch_update` cannot fail.
        let _ = self
            .nanos
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                Some(n.saturating_add(step))
            });
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Duration {
        Duration::from_nanos(self.nanos.load(Ordering::SeqCst))
    }
}

fn duration_to_nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}
