//! Hang detection: a policy call that never returns.
//!
//! A `create`, `pick`, `explain`, `on_dispatch` or `on_complete` that never returns cannot be
//! interrupted: Rust has no way to stop a thread, and the plugin's code owns it. What the host can
//! do is notice, stop sending that instance work, and keep serving on its other threads. This
//! module does the noticing.
//!
//! **Per call (the hot path).** Every thread that calls a policy owns one cache-padded `Slot`,
//! registered once per thread in a process-wide list the watchdog scans. Before a call the thread
//! stores the call's tag (instance id and call kind), a per-thread sequence number, the start
//! time (nanoseconds since the watchdog's epoch, or 0 when the caller took no clock reading) and
//! the request id into its own slot, the tag last with `Release`; after the call it stores "idle".
//! That is five plain stores to a line only this thread writes: no read-modify-write, no shared
//! line written per call. `pick` passes the `Instant` the router already takes to time it.
//!
//! **The watchdog thread** is started when the first instance is registered (the first
//! [`PolicySet`](crate::policy_set::PolicySet) is built). It sleeps on an interval of a quarter of the
//! smallest registered `hang_after`, clamped to 10 ms..1 s, and waits without a timeout while no
//! instance is registered, so it never spins. Each tick it reads every slot. A call seen busy with
//! the same tag and sequence number on two ticks, and running (since its start time, or since it
//! was first seen when no start time was stored) for longer than its instance's `hang_after`, is a
//! hang: the instance is marked hung once, with a `tracing::error!` naming it, and from then on
//! refuses every call (its requests go to its fallback, its hooks are no longer called). Then
//! [`OnHang`] says whether the process keeps serving or ends.
//!
//! A thread stuck in a plugin is lost: it stays blocked, and its slot stays busy (and reported
//! once). Slots of threads that exit are reused by later threads.

use std::cell::Cell;
use std::collections::HashMap;
use std::io::Write;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use crossbeam_utils::CachePadded;
use router_core::select::PolicyFailure;

/// What happens after the watchdog marked an instance hung. Chosen by whoever builds the
/// [`PolicySet`](crate::policy_set::PolicySet) ([`PolicySetOptions`](crate::policy_set::PolicySetOptions)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OnHang {
    /// Mark the instance hung and keep serving: its requests go to its fallback from then on.
    /// For hosts that route on several threads (a server): the stuck thread is lost, the service
    /// is not.
    #[default]
    KeepServing,
    /// Mark it hung, print one error line to stderr naming the instance, the call and the request
    /// (when known), and end the process at once with exit status `code`. For single-threaded
    /// tools (`router-host select`), whose only thread is the one that is stuck: without this
    /// they would hang forever. The process ends with `_exit`: no destructors, `atexit` handlers
    /// or plugin finalisers run (they could wait on the stuck thread); stdout and stderr are not
    /// buffered by this crate's tools at that point, so nothing already printed is lost.
    Exit { code: i32 },
}

/// Which policy callback a call is in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Call {
    Create,
    Pick,
    Explain,
    OnDispatch,
    OnComplete,
}

/// Bits of a slot's tag that hold the [`Call`] (the rest is the instance's watch id).
const CALL_BITS: u32 = 3;
const CALL_MASK: u64 = (1 << CALL_BITS) - 1;
/// A slot's tag when its thread is not in a policy call.
const IDLE: u64 = 0;

impl Call {
    /// The callback's name: `create`, `pick`, `explain`, `on_dispatch`, `on_complete`.
    pub fn as_str(self) -> &'static str {
        match self {
            Call::Create => "create",
            Call::Pick => "pick",
            Call::Explain => "explain",
            Call::OnDispatch => "on_dispatch",
            Call::OnComplete => "on_complete",
        }
    }

    fn code(self) -> u64 {
        match self {
            Call::Create => 1,
            Call::Pick => 2,
            Call::Explain => 3,
            Call::OnDispatch => 4,
            Call::OnComplete => 5,
        }
    }

    fn from_code(code: u64) -> Option<Call> {
        Some(match code {
            1 => Call::Create,
            2 => Call::Pick,
            3 => Call::Explain,
            4 => Call::OnDispatch,
            5 => Call::OnComplete,
            _ => return None,
        })
    }
}

impl std::fmt::Display for Call {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A call the watchdog found running past its instance's `hang_after`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hang {
    pub call: Call,
    /// How long it had run when the watchdog noticed.
    pub ran: Duration,
    /// The request it was for, when known: the hooks' request id, or the caller's id of a
    /// request that had one when `pick` or `explain` was called.
    pub request: Option<u64>,
}

/// The shared part of one watched instance: the watchdog marks it, the routing threads read it.
struct Watched {
    id: u64,
    /// The watchdog's epoch: start times are nanoseconds since it.
    epoch: Instant,
    hang_after: Duration,
    hang_after_ns: u64,
    on_hang: OnHang,
    /// Read by every call (`callable`), written once, by the watchdog.
    hung: AtomicBool,
    /// The first hang found, set before `hung`.
    hang: OnceLock<Hang>,
    /// Calls found hung (the instance's `hangs` counter).
    hangs: Arc<AtomicU64>,
    name: String,
    type_name: String,
    origin: String,
}

/// Who an instance is, for the watchdog's messages, and its limits.
pub(crate) struct WatchSpec<'a> {
    pub name: &'a str,
    pub type_name: &'a str,
    pub origin: &'a str,
    pub hang_after: Duration,
    pub on_hang: OnHang,
    /// Counts the calls found hung.
    pub hangs: Arc<AtomicU64>,
}

/// One instance registered with the watchdog; unregistered when dropped.
pub(crate) struct Watch(Arc<Watched>);

impl Watch {
    /// Register an instance (starting the watchdog thread if this is the first one).
    pub(crate) fn register(spec: WatchSpec<'_>) -> Watch {
        let dog = watchdog();
        let mut state = lock(&dog.state);
        state.next_id += 1;
        let watched = Arc::new(Watched {
            id: state.next_id,
            epoch: dog.epoch,
            hang_after: spec.hang_after,
            hang_after_ns: nanos(spec.hang_after),
            on_hang: spec.on_hang,
            hung: AtomicBool::new(false),
            hang: OnceLock::new(),
            hangs: spec.hangs,
            name: spec.name.to_owned(),
            type_name: spec.type_name.to_owned(),
            origin: spec.origin.to_owned(),
        });
        state.instances.insert(watched.id, watched.clone());
        state.interval = interval(&state.instances);
        if !state.thread_started {
            let spawned = std::thread::Builder::new()
                .name("router-watchdog".into())
                .spawn(move || run(dog));
            match spawned {
                Ok(_) => state.thread_started = true,
                Err(err) => tracing::error!(
                    "cannot start the policy watchdog thread ({err}); hung policy calls will not \
                     be detected"
                ),
            }
        }
        drop(state);
        dog.wake.notify_all();
        Watch(watched)
    }

    /// Whether the watchdog found one of this instance's calls running past `hang_after`.
    #[inline]
    pub(crate) fn is_hung(&self) -> bool {
        self.0.hung.load(Ordering::Relaxed)
    }

    /// The first hang found, once the instance is hung.
    pub(crate) fn hang(&self) -> Option<&Hang> {
        self.0.hang.get()
    }

    /// The failure every call of a hung instance gets.
    pub(crate) fn failure(&self) -> PolicyFailure {
        let (call, ran_ms) = match self.hang() {
            Some(hang) => (hang.call.as_str(), millis(hang.ran)),
            None => ("a call", millis(self.0.hang_after)),
        };
        PolicyFailure::Hung {
            call,
            ran_ms,
            hang_after_ms: millis(self.0.hang_after),
        }
    }

    /// Mark this thread as in `call` of this instance until the guard is dropped. `started` is
    /// the caller's own clock reading taken just before the call, if it has one (`pick` does);
    /// without one the watchdog times the call from when it first sees it.
    #[inline]
    pub(crate) fn begin(
        &self,
        call: Call,
        started: Option<Instant>,
        request: Option<u64>,
    ) -> CallGuard {
        let watched = &*self.0;
        let started_ns = started.map_or(0, |t| {
            nanos(t.saturating_duration_since(watched.epoch)).max(1)
        });
        let tag = (watched.id << CALL_BITS) | call.code();
        // Unknown request ids, and `u64::MAX` (which would wrap to "unknown"), store 0.
        let request = request.map_or(0, |id| id.wrapping_add(1));
        let slot = THREAD_SLOT.try_with(|own| {
            let seq = own.seq.get().wrapping_add(1);
            own.seq.set(seq);
            let slot = own.slot;
            slot.seq.store(seq, Ordering::Relaxed);
            slot.started_ns.store(started_ns, Ordering::Relaxed);
            slot.request.store(request, Ordering::Relaxed);
            // Last, with Release: the watchdog that reads this tag sees the fields above.
            slot.what.store(tag, Ordering::Release);
            slot
        });
        // No slot while this thread's thread-locals are being destroyed: the call is unwatched.
        CallGuard(slot.ok())
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        let dog = watchdog();
        let mut state = lock(&dog.state);
        state.instances.remove(&self.0.id);
        state.interval = interval(&state.instances);
    }
}

/// Marks the thread idle again when dropped (when the call returned).
#[must_use = "the call counts as running until the guard is dropped"]
pub(crate) struct CallGuard(Option<&'static Slot>);

impl Drop for CallGuard {
    #[inline]
    fn drop(&mut self) {
        if let Some(slot) = self.0 {
            slot.what.store(IDLE, Ordering::Release);
        }
    }
}

// ---- per-thread slots ---------------------------------------------------------------------------

/// What one thread is doing, written only by that thread.
#[derive(Default)]
struct Slot {
    /// `instance id << CALL_BITS | call`, or [`IDLE`].
    what: AtomicU64,
    /// The thread's call number: tells two calls with the same tag apart.
    seq: AtomicU64,
    /// Nanoseconds since the epoch at the call's start; 0 = not stored.
    started_ns: AtomicU64,
    /// Request id + 1; 0 = unknown.
    request: AtomicU64,
}

/// This thread's slot. Returned to the free list when the thread exits.
struct ThreadSlot {
    slot: &'static Slot,
    seq: Cell<u64>,
}

thread_local! {
    static THREAD_SLOT: ThreadSlot = ThreadSlot::acquire();
}

impl ThreadSlot {
    fn acquire() -> ThreadSlot {
        let mut state = lock(&watchdog().state);
        let slot = match state.free.pop() {
            Some(slot) => slot,
            None => {
                // Leaked on purpose: slots are reused by later threads, never freed, so the
                // watchdog can read them without holding anything but the registry lock.
                let padded: &'static CachePadded<Slot> = Box::leak(Box::default());
                let slot: &'static Slot = padded;
                state.slots.push(slot);
                slot
            }
        };
        ThreadSlot {
            slot,
            // Carry on the previous owner's numbering, so a call of this thread is never taken
            // for one of the previous owner's.
            seq: Cell::new(slot.seq.load(Ordering::Relaxed)),
        }
    }
}

impl Drop for ThreadSlot {
    fn drop(&mut self) {
        self.slot.what.store(IDLE, Ordering::Release);
        lock(&watchdog().state).free.push(self.slot);
    }
}

// ---- the watchdog -------------------------------------------------------------------------------

struct Watchdog {
    state: Mutex<State>,
    /// Notified when an instance is registered.
    wake: Condvar,
    epoch: Instant,
}

struct State {
    instances: HashMap<u64, Arc<Watched>>,
    /// Every slot ever handed out; a slot's index never changes.
    slots: Vec<&'static Slot>,
    /// Slots of threads that exited.
    free: Vec<&'static Slot>,
    /// Ids are never reused: a stuck call of a dropped instance is never blamed on a new one.
    next_id: u64,
    interval: Duration,
    thread_started: bool,
}

/// Shortest and longest sleep between two scans.
const MIN_INTERVAL: Duration = Duration::from_millis(10);
const MAX_INTERVAL: Duration = Duration::from_secs(1);

fn watchdog() -> &'static Watchdog {
    static WATCHDOG: OnceLock<Watchdog> = OnceLock::new();
    WATCHDOG.get_or_init(|| Watchdog {
        state: Mutex::new(State {
            instances: HashMap::new(),
            slots: Vec::new(),
            free: Vec::new(),
            next_id: 0,
            interval: MAX_INTERVAL,
            thread_started: false,
        }),
        wake: Condvar::new(),
        epoch: Instant::now(),
    })
}

/// The registry lock. Nothing panics while holding it, but a poisoned lock is still usable.
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// `d` in nanoseconds, saturating (u64 arithmetic: cheaper than `as_nanos` on the pick path).
#[inline]
fn nanos(d: Duration) -> u64 {
    d.as_secs()
        .saturating_mul(1_000_000_000)
        .saturating_add(u64::from(d.subsec_nanos()))
}

/// A quarter of the smallest `hang_after`, within [`MIN_INTERVAL`]..=[`MAX_INTERVAL`].
fn interval(instances: &HashMap<u64, Arc<Watched>>) -> Duration {
    instances
        .values()
        .map(|w| w.hang_after / 4)
        .min()
        .unwrap_or(MAX_INTERVAL)
        .clamp(MIN_INTERVAL, MAX_INTERVAL)
}

/// What the watchdog remembers about one slot between scans.
#[derive(Debug, Clone, Copy, Default)]
struct Memo {
    what: u64,
    seq: u64,
    first_seen_ns: u64,
    reported: bool,
}

fn run(dog: &'static Watchdog) {
    let mut memos: Vec<Memo> = Vec::new();
    let mut state = lock(&dog.state);
    loop {
        if state.instances.is_empty() {
            // Nothing to watch: sleep until an instance is registered.
            state = dog.wake.wait(state).unwrap_or_else(PoisonError::into_inner);
            continue;
        }
        let interval = state.interval;
        state = match dog.wake.wait_timeout(state, interval) {
            Ok((state, _)) => state,
            Err(poisoned) => poisoned.into_inner().0,
        };
        let found = scan(dog, &state, &mut memos);
        if found.is_empty() {
            continue;
        }
        // Log (and maybe end the process) without holding the registry lock.
        drop(state);
        for (watched, hang) in found {
            mark_hung(&watched, hang);
        }
        state = lock(&dog.state);
    }
}

/// One pass over every slot: the calls that just crossed their instance's `hang_after`.
fn scan(dog: &Watchdog, state: &State, memos: &mut Vec<Memo>) -> Vec<(Arc<Watched>, Hang)> {
    let now = nanos(dog.epoch.elapsed());
    let mut found = Vec::new();
    memos.resize(state.slots.len(), Memo::default());
    for (slot, memo) in state.slots.iter().zip(memos.iter_mut()) {
        let what = slot.what.load(Ordering::Acquire);
        if what == IDLE {
            *memo = Memo::default();
            continue;
        }
        // Read after the tag: these belong to the call that stored it, or to a later one.
        let seq = slot.seq.load(Ordering::Relaxed);
        let started_ns = slot.started_ns.load(Ordering::Relaxed);
        let request = slot.request.load(Ordering::Relaxed);
        if memo.what != what || memo.seq != seq {
            // A call not seen before. Only a call seen on two scans can be reported: that it
            // is the same call is then certain (same tag, same call number).
            *memo = Memo {
                what,
                seq,
                first_seen_ns: now,
                reported: false,
            };
            continue;
        }
        if memo.reported {
            continue;
        }
        let (Some(watched), Some(call)) = (
            state.instances.get(&(what >> CALL_BITS)),
            Call::from_code(what & CALL_MASK),
        ) else {
            // An instance that was dropped while one of its calls was stuck.
            continue;
        };
        let since = if started_ns == 0 {
            memo.first_seen_ns
        } else {
            started_ns
        };
        let ran = now.saturating_sub(since);
        if ran > watched.hang_after_ns {
            memo.reported = true;
            found.push((
                watched.clone(),
                Hang {
                    call,
                    ran: Duration::from_nanos(ran),
                    request: request.checked_sub(1),
                },
            ));
        }
    }
    found
}

fn mark_hung(watched: &Watched, hang: Hang) {
    watched.hangs.fetch_add(1, Ordering::Relaxed);
    let first = watched.hang.set(hang.clone()).is_ok();
    watched.hung.store(true, Ordering::Release);
    let ran_ms = u64::try_from(hang.ran.as_millis()).unwrap_or(u64::MAX);
    let hang_after_ms = u64::try_from(watched.hang_after.as_millis()).unwrap_or(u64::MAX);
    if first {
        let then = match watched.on_hang {
            OnHang::KeepServing => {
                "the instance is out of service: its requests go to its fallback and its hooks \
                 are no longer called (the stuck thread is lost)"
            }
            OnHang::Exit { .. } => "the process exits (on_hang: exit)",
        };
        tracing::error!(
            instance = %watched.name,
            policy = %watched.type_name,
            origin = %watched.origin,
            call = hang.call.as_str(),
            ran_ms,
            hang_after_ms,
            request = ?hang.request,
            "policy instance hung: its {} has run for {ran_ms} ms, past hang_after_ms \
             {hang_after_ms}; {then}",
            hang.call
        );
    } else {
        tracing::warn!(
            instance = %watched.name,
            origin = %watched.origin,
            call = hang.call.as_str(),
            ran_ms,
            request = ?hang.request,
            "another call of the hung policy instance is stuck too"
        );
    }
    if let OnHang::Exit { code } = watched.on_hang {
        let request = hang
            .request
            .map(|id| format!(" (request id {id})"))
            .unwrap_or_default();
        let message = format!(
            "error: policy instance `{}` (type `{}`, from {}) hung in {}{request}: it has run for \
             {ran_ms} ms, past its hang_after_ms of {hang_after_ms}; exiting with status {code}\n",
            watched.name, watched.type_name, watched.origin, hang.call
        );
        let mut stderr = std::io::stderr().lock();
        // Nothing more can be done if stderr is gone: the exit status still says it.
        let _ = stderr.write_all(message.as_bytes());
        let _ = stderr.flush();
        // SAFETY: `_exit` has no preconditions and never returns. It is used instead of
        // `std::process::exit` so that no exit handler or library finaliser runs while another
        // thread is stuck inside a plugin (one could wait on it forever, or unmap code it runs).
        unsafe { libc::_exit(code) }
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn call_codes_round_trip_and_fit_their_bits() {
        for call in [
            Call::Create,
            Call::Pick,
            Call::Explain,
            Call::OnDispatch,
            Call::OnComplete,
        ] {
            assert!(call.code() != IDLE && call.code() <= CALL_MASK, "{call}");
            assert_eq!(Call::from_code(call.code()), Some(call));
        }
        assert_eq!(Call::from_code(0), None);
        assert_eq!(Call::from_code(7), None);
    }

    fn watch(hang_after: Duration) -> Watch {
        Watch::register(WatchSpec {
            name: "unit",
            type_name: "unit-type",
            origin: "built-in",
            hang_after,
            on_hang: OnHang::KeepServing,
            hangs: Arc::default(),
        })
    }

    #[test]
    fn the_interval_is_a_quarter_of_the_smallest_threshold_within_bounds() {
        let watches = [
            watch(Duration::from_secs(3600)),
            watch(Duration::from_millis(400)),
            watch(Duration::from_millis(1)),
        ];
        let map = |picked: &[usize]| -> HashMap<u64, Arc<Watched>> {
            picked
                .iter()
                .map(|&i| (watches[i].0.id, watches[i].0.clone()))
                .collect()
        };
        assert_eq!(interval(&map(&[0, 1])), Duration::from_millis(100));
        assert_eq!(interval(&map(&[0])), MAX_INTERVAL);
        assert_eq!(interval(&map(&[0, 1, 2])), MIN_INTERVAL);
        assert_eq!(interval(&HashMap::new()), MAX_INTERVAL);
    }

    #[test]
    fn a_call_running_past_its_threshold_marks_the_instance_hung_once() {
        let w = watch(Duration::from_millis(20));
        let hangs = w.0.hangs.clone();
        let id = w.0.id;
        let guard = w.begin(Call::Explain, Some(Instant::now()), Some(41));
        let deadline = Instant::now() + Duration::from_secs(30);
        while !w.is_hung() {
            assert!(Instant::now() < deadline, "never marked hung");
            std::thread::sleep(Duration::from_millis(5));
        }
        let hang = w.hang().cloned().expect("hang recorded");
        assert_eq!((hang.call, hang.request), (Call::Explain, Some(41)));
        assert!(hang.ran > Duration::from_millis(20), "{hang:?}");
        let failure = w.failure().to_string();
        assert!(
            failure.contains("hung in explain") && failure.contains("hang_after_ms of 20"),
            "{failure}"
        );
        // Reported once, however long it stays stuck.
        std::thread::sleep(Duration::from_millis(100));
        assert_eq!(hangs.load(Ordering::Relaxed), 1);
        drop(guard);
        drop(w);
        assert!(!lock(&watchdog().state).instances.contains_key(&id));
    }

    #[test]
    fn calls_that_return_in_time_are_never_reported() {
        let w = watch(Duration::from_millis(200));
        let until = Instant::now() + Duration::from_millis(300);
        while Instant::now() < until {
            let _call = w.begin(Call::Pick, Some(Instant::now()), None);
            std::hint::black_box(());
        }
        std::thread::sleep(Duration::from_millis(100));
        assert!(!w.is_hung());
        assert_eq!(w.0.hangs.load(Ordering::Relaxed), 0);
    }
}
