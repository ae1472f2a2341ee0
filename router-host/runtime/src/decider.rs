//! Where serve runs a routing decision, which can block its thread: a policy's `pick` may hang,
//! and a shared session store answers over the network.
//!
//! Under `block_in_place` a stuck call cannot stop the server: the async worker hands its other
//! tasks to a new thread first. But that hand-off wakes a blocking-pool thread on every call; at
//! 3,200 short requests a second it was about a sixth of serve's CPU (docs/serve.md, "Where
//! decisions run"). So a decision runs on the async worker itself when
//!
//! - no shared session store is configured (its round trip is I/O: always handed off),
//! - fewer than `workers - 1` decisions are running that way. A call that never returns keeps
//!   its permit, so hung calls hold at most all but one worker, the last one keeps serving, and
//!   every later decision is handed off;
//! - and it is the first thing its task does in this poll. A worker runs next the task that the
//!   running one woke (tokio's "LIFO slot"), and no other worker can take that task: behind a
//!   call that never returns it would never run. That slot is empty when a poll starts, so
//!   [`Decider::decide`] lets its task be polled once more first.
//!
//! A runtime with one worker has no permit: every decision is handed off there, as before.
//!
//! What a release owes (the policy's `on_complete`, a queue drain) goes through
//! [`Decider::decide`] too, from a task of its own (`lifecycle.rs`, `after_release`).

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};

use super::state::LoadedConfig;

/// The inline permits of one server's runtime.
#[derive(Debug)]
pub struct Decider {
    inline_free: AtomicUsize,
}

impl Decider {
    /// `workers - 1` permits for the runtime this is called on (none off a runtime, and none on
    /// a current-thread runtime, which has one worker).
    pub fn for_current_runtime() -> Decider {
        let workers = tokio::runtime::Handle::try_current()
            .map(|handle| handle.metrics().num_workers())
            .unwrap_or(1);
        Decider::with_permits(workers.saturating_sub(1))
    }

    pub fn with_permits(permits: usize) -> Decider {
        Decider {
            inline_free: AtomicUsize::new(permits),
        }
    }

    /// Run the decision `f`: inline when the rules above allow, else under
    /// [`crate::session_store::blocking`].
    pub async fn decide<T>(&self, loaded: &LoadedConfig, f: impl FnOnce() -> T) -> T {
        self.run(loaded.shared_sessions.is_none(), f).await
    }

    async fn run<T>(&self, io_free: bool, f: impl FnOnce() -> T) -> T {
        if io_free && self.inline_free() > 0 {
            NextPoll(false).await;
            // Nothing between here and `f` may wake another task (see the module's rules).
            if let Some(_permit) = self.try_inline() {
                return f();
            }
        }
        crate::session_store::blocking(f)
    }

    /// Permits free right now.
    pub fn inline_free(&self) -> usize {
        self.inline_free.load(Ordering::Relaxed)
    }

    fn try_inline(&self) -> Option<Permit<'_>> {
        self.inline_free
            .fetch_update(Ordering::Acquire, Ordering::Relaxed, |n| n.checked_sub(1))
            .ok()
            .map(|_| Permit(self))
    }
}

/// Given back when the call returns (or unwinds); never, when it hangs.
struct Permit<'a>(&'a Decider);

impl Drop for Permit<'_> {
    fn drop(&mut self) {
        self.0.inline_free.fetch_add(1, Ordering::Release);
    }
}

/// Ready at the second poll: its task wakes itself, and tokio runs a task that woke itself from
/// its run queue, not from the LIFO slot (so whatever the slot holds runs first).
struct NextPoll(bool);

impl Future for NextPoll {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if std::mem::replace(&mut self.0, true) {
            return Poll::Ready(());
        }
        cx.waker().wake_by_ref();
        Poll::Pending
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block_on<T>(f: impl Future<Output = T>) -> T {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap()
            .block_on(f)
    }

    #[test]
    fn a_permit_is_taken_for_the_call_and_given_back_after_it() {
        let decider = Decider::with_permits(1);
        let inner = block_on(decider.run(true, || {
            assert_eq!(decider.inline_free(), 0, "the call holds the only permit");
            decider.inline_free()
        }));
        assert_eq!(inner, 0);
        assert_eq!(decider.inline_free(), 1);
    }

    #[test]
    fn a_call_with_io_takes_no_permit() {
        let decider = Decider::with_permits(1);
        assert_eq!(block_on(decider.run(false, || decider.inline_free())), 1);
    }

    #[test]
    fn a_call_that_unwinds_gives_its_permit_back() {
        let decider = Decider::with_permits(1);
        let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            block_on(decider.run(true, || panic!("policy bug")))
        }));
        assert!(caught.is_err());
        assert_eq!(decider.inline_free(), 1);
    }

    #[test]
    fn permits_are_all_workers_but_one() {
        for (workers, permits) in [(1, 0), (2, 1), (4, 3)] {
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(workers)
                .build()
                .unwrap();
            let found = runtime.block_on(async { Decider::for_current_runtime().inline_free() });
            assert_eq!(found, permits, "{workers} workers");
        }
        assert_eq!(
            block_on(async { Decider::for_current_runtime().inline_free() }),
            0,
            "current-thread runtime"
        );
        assert_eq!(
            Decider::for_current_runtime().inline_free(),
            0,
            "no runtime"
        );
    }
}
