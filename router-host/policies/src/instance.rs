//! One configured policy instance: its counters, its state (serving, quarantined, poisoned,
//! hung) and every call into it, contained.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use plugin_api::abi::{PickFailure, PickFailureKind, PolicyBox};
use plugin_api::Inputs;
use router_core::select::PolicyFailure;
use router_core::striped::StripedCounter;

use crate::builtin::BuiltinSettings;
use crate::loader::plugin_text;
use crate::watchdog::{Call, Hang, OnHang, Watch};
use router_config::OnError;

/// The origin of a built-in instance or type (a plugin's is its file's path).
pub const BUILT_IN: &str = "built-in";

/// Host settings passed to every instance at creation.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HostSettings {
    pub block_size: u32,
    pub builtin: BuiltinSettings,
    /// What the watchdog does after it marked one of the instances hung.
    pub on_hang: OnHang,
}

/// Counters per instance, readable while the host runs.
#[derive(Debug, Default)]
pub struct InstanceStats {
    /// Bumped by every pick from every routing thread: striped, so it does not bounce a line.
    pub picks: StripedCounter,
    pub errors: AtomicU64,
    pub panics: AtomicU64,
    pub out_of_range: AtomicU64,
    pub fallbacks: AtomicU64,
    /// Decisions over the budget because `pick` alone took longer than it.
    pub slow_picks: AtomicU64,
    /// Decisions over the budget because `explain` pushed `pick + explain` past it.
    pub slow_explains: AtomicU64,
    /// Calls found running past `hang_after` (counted by the watchdog, which shares it).
    pub hangs: Arc<AtomicU64>,
}

/// A plain copy of [`InstanceStats`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct InstanceCounters {
    pub picks: u64,
    pub errors: u64,
    pub panics: u64,
    pub out_of_range: u64,
    pub fallbacks: u64,
    pub slow_picks: u64,
    pub slow_explains: u64,
    pub hangs: u64,
}

impl InstanceStats {
    pub fn snapshot(&self) -> InstanceCounters {
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        InstanceCounters {
            picks: self.picks.get(),
            errors: get(&self.errors),
            panics: get(&self.panics),
            out_of_range: get(&self.out_of_range),
            fallbacks: get(&self.fallbacks),
            slow_picks: get(&self.slow_picks),
            slow_explains: get(&self.slow_explains),
            hangs: get(&self.hangs),
        }
    }
}

/// One configured policy instance.
pub struct PolicyInstance {
    pub name: String,
    pub type_name: String,
    /// "built-in" or the plugin file's path.
    pub origin: String,
    /// Only the built-in `default` selector: the host narrows its rows to an eligible soft
    /// target. A one-off compatibility rule, not something a plugin can ask for.
    pub narrows_soft_target: bool,
    pub parameters_json: String,
    pub on_error: OnError,
    /// What one decision (`pick`, plus `explain` when the caller asks for one) may take.
    pub pick_budget: Duration,
    /// Consecutive over-budget decisions that quarantine the instance.
    pub quarantine_after: u32,
    /// A call still running after this long marks the instance hung (see [`crate::watchdog`]).
    pub hang_after: Duration,
    pub inputs: Inputs,
    pub(crate) policy: PolicyBox,
    /// On cache lines of its own: counters written per pick must not evict the fields every
    /// pick reads (the policy box, flags, inputs) from other cores' caches.
    pub stats: crossbeam_utils::CachePadded<InstanceStats>,
    /// Set after the policy panicked: it is no longer called.
    pub(crate) poisoned: AtomicBool,
    /// The panic that poisoned it (the first one seen).
    pub(crate) poison_reason: OnceLock<String>,
    /// Set after `quarantine_after` consecutive slow decisions: it is no longer called.
    pub(crate) quarantined: AtomicBool,
    pub(crate) quarantine_reason: OnceLock<String>,
    pub(crate) consecutive_slow: AtomicU32,
    /// Registered with the watchdog, which marks it hung; every call is marked in this
    /// thread's watchdog slot while it runs.
    pub(crate) watch: Watch,
    /// Log lines that could repeat per request, each rate-limited.
    pub(crate) logs: InstanceLogs,
}

/// Whether an instance is called, and if not, why. The first that applies, in this order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum InstanceState {
    InService,
    /// A callback panicked (in the plugin or seen by the host): never called again.
    Poisoned,
    /// `quarantine_after` consecutive decisions over `pick_budget_us`.
    Quarantined,
    /// A call ran past `hang_after_ms` (see [`crate::watchdog`]).
    Hung,
}

impl InstanceState {
    pub const ALL: [InstanceState; 4] = [
        InstanceState::InService,
        InstanceState::Poisoned,
        InstanceState::Quarantined,
        InstanceState::Hung,
    ];

    /// `in_service`, `poisoned`, `quarantined`, `hung`: the `state` label and `/ready`'s word.
    pub fn as_str(self) -> &'static str {
        match self {
            InstanceState::InService => "in_service",
            InstanceState::Poisoned => "poisoned",
            InstanceState::Quarantined => "quarantined",
            InstanceState::Hung => "hung",
        }
    }
}

impl std::fmt::Display for InstanceState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How often a log line that can repeat per request (a policy error, an out-of-range index, a
/// failed `explain`, a request sent to the fallback of an instance out of service) is written
/// for one instance: the first occurrence, then at most one line per interval saying how many
/// were not written. The counters (`router_policy_*`) count every occurrence.
pub const LOG_REPEAT_INTERVAL: Duration = Duration::from_secs(60);

/// `" (N more since the last such line, not logged)"`, or nothing.
pub(crate) fn suppressed_note(suppressed: u64) -> String {
    if suppressed == 0 {
        String::new()
    } else {
        format!(
            " ({suppressed} more like it in the last {} s, not logged)",
            LOG_REPEAT_INTERVAL.as_secs()
        )
    }
}

/// The rate-limited log lines of one instance.
#[derive(Debug, Default)]
pub(crate) struct InstanceLogs {
    /// `pick` returned an error or an out-of-range index.
    pub(crate) pick_failed: router_core::log_limit::LogThrottle,
    /// `explain` returned an error.
    pub(crate) explain_failed: router_core::log_limit::LogThrottle,
    /// A request of an instance out of service went to its fallback (or failed).
    pub(crate) out_of_service: router_core::log_limit::LogThrottle,
}

impl PolicyInstance {
    pub fn is_poisoned(&self) -> bool {
        self.poisoned.load(Ordering::Relaxed)
    }

    pub fn is_quarantined(&self) -> bool {
        self.quarantined.load(Ordering::Relaxed)
    }

    /// Whether the watchdog found one of its calls running past `hang_after`: it is no longer
    /// called.
    pub fn is_hung(&self) -> bool {
        self.watch.is_hung()
    }

    /// The call that made it hung, how long it had run and its request, once it is hung.
    pub fn hang(&self) -> Option<&Hang> {
        self.watch.hang()
    }

    /// In service, or why not (the first of poisoned, quarantined, hung).
    pub fn state(&self) -> InstanceState {
        if self.is_poisoned() {
            InstanceState::Poisoned
        } else if self.is_quarantined() {
            InstanceState::Quarantined
        } else if self.is_hung() {
            InstanceState::Hung
        } else {
            InstanceState::InService
        }
    }

    /// Why the instance is out of service (`None` while in service): the panic, the slow
    /// decisions, or the call that hung.
    pub fn state_reason(&self) -> Option<String> {
        match self.state() {
            InstanceState::InService => None,
            InstanceState::Poisoned => Some(
                self.poison_reason
                    .get()
                    .cloned()
                    .unwrap_or_else(|| "it panicked".to_owned()),
            ),
            InstanceState::Quarantined => self.quarantine_reason.get().cloned(),
            InstanceState::Hung => Some(self.watch.failure().to_string()),
        }
    }

    /// Built into the host (its calls are ours: they do not hang).
    pub fn is_builtin(&self) -> bool {
        self.origin == BUILT_IN
    }

    /// Not poisoned, quarantined or hung: hooks are called only then.
    pub(crate) fn in_service(&self) -> bool {
        !self.is_poisoned() && !self.is_quarantined() && !self.is_hung()
    }

    /// The policy object itself, as loaded. Calling it directly bypasses poisoning, quarantine,
    /// the pick budget and the row bounds check: for benchmarks and tools, never for routing.
    pub fn policy(&self) -> &PolicyBox {
        &self.policy
    }

    /// Whether the instance may be called: not poisoned (counted as an error, as before), not
    /// quarantined, not hung. The one place an instance's health is decided.
    pub(crate) fn callable(&self) -> Result<(), PolicyFailure> {
        if !self.is_poisoned() && !self.is_quarantined() && !self.is_hung() {
            return Ok(());
        }
        self.not_callable()
    }

    /// Why [`Self::callable`] refused. Cold and out of line, off the request path's hot code
    /// (docs/performance.md, "What the profiles showed").
    #[cold]
    #[inline(never)]
    fn not_callable(&self) -> Result<(), PolicyFailure> {
        if self.is_poisoned() {
            self.stats.errors.fetch_add(1, Ordering::Relaxed);
            return Err(PolicyFailure::Poisoned);
        }
        if self.is_quarantined() {
            return Err(PolicyFailure::Quarantined);
        }
        if self.is_hung() {
            return Err(self.watch.failure());
        }
        Ok(())
    }

    /// Mark this thread as in `call` of this instance until the guard is dropped (the watchdog
    /// reads it). `started`: the caller's clock reading just before the call, if it took one.
    #[inline]
    pub(crate) fn watch_call(
        &self,
        call: Call,
        started: Option<Instant>,
        request: Option<u64>,
    ) -> crate::watchdog::CallGuard {
        self.watch.begin(call, started, request)
    }

    /// Count a failed pick; a panic poisons the instance. Returns the failure.
    #[cold]
    #[inline(never)]
    pub(crate) fn failed(&self, failure: PolicyFailure) -> PolicyFailure {
        match &failure {
            PolicyFailure::OutOfRange { .. } => {
                self.stats.out_of_range.fetch_add(1, Ordering::Relaxed);
            }
            PolicyFailure::Panicked(_) => {
                self.stats.errors.fetch_add(1, Ordering::Relaxed);
                self.stats.panics.fetch_add(1, Ordering::Relaxed);
                if let PolicyFailure::Panicked(message) = &failure {
                    let _ = self.poison_reason.set(format!("panicked: {message}"));
                }
                self.poisoned.store(true, Ordering::Relaxed);
            }
            _ => {
                self.stats.errors.fetch_add(1, Ordering::Relaxed);
            }
        }
        failure
    }

    /// Count a failure the plugin returned from `call` (`pick` or `explain`); a panic poisons the
    /// instance. Returns the failure.
    ///
    /// A 1.1 hook (`on_dispatch`, `on_complete`) returns nothing across the ABI, so the host
    /// cannot see a hook panic when it happens. `plugin-api`'s adapter poisons itself and answers
    /// every later `pick` and `explain` with `POISONED` (message: `poisoned by a panic in <hook>:
    /// <panic message>`) without entering author code. A panic in `pick` or `explain` comes back
    /// as `PANICKED` and poisons the host side at once (see [`Self::failed`]), and a poisoned
    /// instance is not called again, so a `POISONED` answer from an instance the host has not
    /// poisoned means a panic the host did not see: in a hook. It is counted and poisoned here
    /// as a panic, at the first call after it, and returned as [`PolicyFailure::Panicked`] so it
    /// is logged like any other panic. Only the call that flips the host's flag counts it.
    #[cold]
    #[inline(never)]
    pub(crate) fn failed_in_plugin(&self, call: &str, failure: PickFailure) -> PolicyFailure {
        if failure.kind == PickFailureKind::POISONED {
            if self.poisoned.swap(true, Ordering::Relaxed) {
                return self.failed(PolicyFailure::Poisoned);
            }
            return self.failed(PolicyFailure::Panicked(format!(
                "{} (outside pick and explain; reported by the plugin at the next {call})",
                plugin_text(&failure.message)
            )));
        }
        let failure = PickFailure {
            message: plugin_text(&failure.message).into(),
            ..failure
        };
        self.failed(PolicyFailure::from_abi(failure))
    }

    /// Count one timed decision: `pick_ns` for `pick`, `explain_ns` for `explain` (0 when none
    /// was asked for). Their sum is held to the instance's `pick_budget`; after
    /// `quarantine_after` consecutive decisions over it the instance is quarantined (and said
    /// so, once).
    #[inline]
    pub(crate) fn record_decision_time(&self, pick_ns: u64, explain_ns: u64) {
        let budget = u64::try_from(self.pick_budget.as_nanos()).unwrap_or(u64::MAX);
        if pick_ns.saturating_add(explain_ns) <= budget {
            // Load first: an unconditional store would bounce this line between routing threads.
            if self.consecutive_slow.load(Ordering::Relaxed) != 0 {
                self.consecutive_slow.store(0, Ordering::Relaxed);
            }
            return;
        }
        self.slow_decision(pick_ns, explain_ns, budget);
    }

    /// A decision over its budget: counted as a slow pick (the pick alone was over) or a slow
    /// explain (the explanation pushed it over), and the instance quarantined (and said so,
    /// once) after `quarantine_after` in a row. Cold and out of line, as [`Self::not_callable`].
    #[cold]
    #[inline(never)]
    fn slow_decision(&self, pick_ns: u64, explain_ns: u64, budget_ns: u64) {
        if pick_ns > budget_ns {
            self.stats.slow_picks.fetch_add(1, Ordering::Relaxed);
        } else {
            self.stats.slow_explains.fetch_add(1, Ordering::Relaxed);
        }
        let streak = self.consecutive_slow.fetch_add(1, Ordering::Relaxed) + 1;
        if streak < self.quarantine_after {
            return;
        }
        let budget_us = self.pick_budget.as_micros() as u64;
        let (pick_us, explain_us) = (pick_ns / 1000, explain_ns / 1000);
        let _ = self.quarantine_reason.set(format!(
            "{} consecutive decisions over pick_budget_us {budget_us} (the last: pick {pick_us} \
             us, explain {explain_us} us)",
            self.quarantine_after
        ));
        if !self.quarantined.swap(true, Ordering::Relaxed) {
            tracing::error!(
                instance = %self.name,
                policy = %self.type_name,
                origin = %self.origin,
                budget_us,
                last_pick_us = pick_us,
                last_explain_us = explain_us,
                "instance quarantined after {} consecutive decisions (pick + explain) over its \
                 time budget; its requests now go to its fallback",
                self.quarantine_after
            );
        }
    }
}

impl std::fmt::Debug for PolicyInstance {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PolicyInstance")
            .field("name", &self.name)
            .field("type_name", &self.type_name)
            .field("origin", &self.origin)
            .field("inputs", &self.inputs)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_note_says_how_many_lines_were_left_out() {
        assert_eq!(suppressed_note(0), "");
        assert_eq!(
            suppressed_note(99),
            " (99 more like it in the last 60 s, not logged)"
        );
    }
}
