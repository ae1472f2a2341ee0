//! The policy set ([`PolicySet`]): every configured instance, the role map, and the
//! `Selector` the routing core calls.
//!
//! Startup (config -> libraries -> catalog -> instances) and the per-request policy call.
//!
//! [`PolicySet::select`] is the only place a policy is called. Per request it: computes the
//! eligible rows (one [`router_core::eligibility`] view); for the built-in `default` only, narrows them
//! to an eligible soft target; materialises the columns the instance declared; calls `pick`
//! once; bounds-checks the index. An error, a panic or an out-of-range index never yields a row
//! from that policy: the request gets the instance's fallback (`on_error: fallback`, the built-in
//! default over the same rows) or an error (`on_error: fail`). `explain`, asked for only after a
//! successful pick, cannot undo it: a failing or panicking `explain` is counted (a panic poisons
//! the instance) and the request keeps its row without an explanation. The decision's time,
//! `pick` plus `explain` when one was asked for (`serve` asks on every request), is held to the
//! instance's `pick_budget`: `quarantine_after` decisions over it in a row quarantine the
//! instance.
//!
//! Every call into a policy (`create`, `pick`, `explain`, the hooks) is marked in the calling
//! thread's [`crate::watchdog`] slot while it runs. A call that runs past its instance's
//! `hang_after` marks the instance hung: it refuses every later call like a poisoned one (its
//! requests get the fallback, its hooks are skipped), and the policy set's [`OnHang`] choice says
//! whether the process keeps serving or exits.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use abi_stable::std_types::{ROption, RResult, RSlice, RStr};
use plugin_api::abi::{
    opt_str, CompleteEvent, DispatchEvent, Extension, ExtensionValue, ExtraColumn,
    RawAffinityTarget, RawExplanation, RawRequestContext,
};
use plugin_api::Explanation;
use router_core::ledger::Charge;
pub use router_core::select::{
    Decision, InstanceId, Pick, PolicyFailure, PrefillBooking, Scratch, SelectError, Selection,
    Selector,
};

use crate::builtin::{Builtin, BuiltinSettings};
use crate::catalog::{Catalog, PolicyError};
use crate::instance::{suppressed_note, HostSettings, PolicyInstance, LOG_REPEAT_INTERVAL};
use crate::loader::{resolve, LoadError, Loader, SearchPath, Verify};
use crate::watchdog::Call;
pub use crate::watchdog::{Hang, OnHang};
use router_config::{InstanceConfig, OnError, RouterConfig, DEFAULT_INSTANCE};
use router_core::eligibility::eligible;
use router_core::model::{Cluster, IdColumns, RequestRole, RowId, Signals};

/// Choices of whoever builds a [`PolicySet`] that are not configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PolicySetOptions {
    /// What happens once a policy call runs past its instance's `hang_after`: by default the
    /// instance is taken out of service and the host keeps serving. Single-threaded tools, whose
    /// only thread would be the stuck one, choose [`OnHang::Exit`].
    pub on_hang: OnHang,
}

/// Why the host could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartupError {
    // The cause is reported through `source()` (printed by `{:#}` and error-chain loggers).
    #[error("plugins[{index}]{}", .line.map(|l| format!(" (line {l})")).unwrap_or_default())]
    Plugin {
        index: usize,
        line: Option<usize>,
        #[source]
        source: Box<LoadError>,
    },
    #[error(transparent)]
    Policy(#[from] PolicyError),
}

/// The loaded policies and which instance serves which role.
#[derive(Debug)]
pub struct PolicySet {
    catalog: Catalog,
    instances: Vec<PolicyInstance>,
    roles: [InstanceId; 3],
    default_instance: InstanceId,
    settings: HostSettings,
    /// How dispatch books prompt tokens (`booking.prefill`).
    prefill_booking: PrefillBooking,
    /// `plugin_images_max` of the configuration it was built from.
    plugin_images_max: usize,
}

impl PolicySet {
    /// Load every plugin, build the catalog, create every instance (so bad parameters fail here,
    /// before any request) and wire the roles. A hung policy call is only taken out of service
    /// ([`PolicySetOptions::default`]).
    pub fn from_config(
        config: &RouterConfig,
        search: &SearchPath,
    ) -> Result<PolicySet, StartupError> {
        PolicySet::from_config_with(config, search, PolicySetOptions::default())
    }

    /// [`PolicySet::from_config`] with the builder's own [`PolicySetOptions`] (they apply from the first
    /// `create` on).
    pub fn from_config_with(
        config: &RouterConfig,
        search: &SearchPath,
        options: PolicySetOptions,
    ) -> Result<PolicySet, StartupError> {
        let mut loader = Loader::with_image_cap(config.plugin_images_max);
        for (index, spec) in config.plugins.iter().enumerate() {
            let plugin_error = |source| StartupError::Plugin {
                index,
                line: spec.line,
                source: Box::new(source),
            };
            let path = resolve(spec, search).map_err(plugin_error)?;
            loader
                .load(&path, Verify::from_spec(spec))
                .map_err(plugin_error)?;
        }
        let catalog = Catalog::new(loader.into_libraries())?;
        let settings = HostSettings {
            block_size: config.block_size,
            builtin: BuiltinSettings {
                host_cache_hit_weight: config.host_cache_hit_weight,
                disk_cache_hit_weight: config.disk_cache_hit_weight,
                prefill_load_scale: config.default_selector.prefill_load_scale,
                decode_active_request_weight: config.default_selector.decode_active_request_weight,
                overlap_credit: config.default_selector.overlap_credit,
                tie_break: config.default_selector.tie_break,
                room: config.default_selector.room,
                live_eviction_weight: config.default_selector.live_eviction_weight,
            },
            on_hang: options.on_hang,
        };
        let pick_budget = std::time::Duration::from_millis(1);
        let default_config = InstanceConfig {
            name: DEFAULT_INSTANCE.to_string(),
            type_name: Builtin::Default.as_str().to_string(),
            parameters_json: "{}".to_string(),
            on_error: OnError::Fail,
            pick_budget,
            quarantine_after: u32::MAX,
            hang_after: router_config::default_hang_after(pick_budget),
            line: None,
        };
        let mut instances = vec![catalog.instantiate(&default_config, &settings)?];
        for instance in &config.worker_selection.instances {
            let created = catalog.instantiate(instance, &settings)?;
            tracing::info!(
                instance = %created.name,
                policy = %created.type_name,
                origin = %created.origin,
                inputs = %created.inputs,
                parameters = %created.parameters_json,
                "created policy instance"
            );
            instances.push(created);
        }
        let find = |name: &str| instances.iter().position(|i| i.name == name);
        let mut roles = [0; 3];
        for role in RequestRole::ALL {
            let name = config.worker_selection.instance_for(role.role());
            // The config module already rejected roles naming undefined instances.
            roles[role.index()] = find(name).unwrap_or(0);
        }
        Ok(PolicySet {
            catalog,
            instances,
            roles,
            default_instance: 0,
            settings,
            prefill_booking: config.booking.prefill,
            plugin_images_max: config.plugin_images_max,
        })
    }

    /// The most plugin images the process may map (`plugin_images_max`); how many it has is
    /// [`crate::loader::images_mapped`].
    pub fn plugin_images_max(&self) -> usize {
        self.plugin_images_max
    }

    pub fn catalog(&self) -> &Catalog {
        &self.catalog
    }

    /// Every instance; index 0 is the built-in `default`.
    pub fn instances(&self) -> &[PolicyInstance] {
        &self.instances
    }

    pub fn instance(&self, id: InstanceId) -> &PolicyInstance {
        &self.instances[id]
    }

    /// The longest `hang_after` of any plugin instance: a call running longer than this is hung
    /// whichever instance it is in (the core's `drain_stall`).
    pub fn longest_hang_after(&self) -> Duration {
        self.instances
            .iter()
            .filter(|instance| !instance.is_builtin())
            .map(|instance| instance.hang_after)
            .max()
            .unwrap_or(router_core::routing::DEFAULT_DRAIN_STALL)
    }

    /// The instance serving `role`.
    pub fn instance_for(&self, role: RequestRole) -> InstanceId {
        self.roles[role.index()]
    }

    pub fn settings(&self) -> &HostSettings {
        &self.settings
    }

    /// `ceil(isl / block_size)`.
    pub fn request_blocks(&self, isl_tokens: u64) -> u64 {
        isl_tokens.div_ceil(u64::from(self.settings.block_size.max(1)))
    }

    /// How dispatch books prompt tokens (`booking.prefill`, docs/routing-contract.md §7).
    pub fn prefill_booking(&self) -> PrefillBooking {
        self.prefill_booking
    }

    /// What a request of `isl_tokens` books on its row: its prompt tokens under
    /// [`PolicySet::prefill_booking`] (`cached_blocks` = the row's device overlap, read only in
    /// `uncached` mode) and `request_blocks` decode blocks.
    pub fn charge(&self, isl_tokens: u64, cached_blocks: &dyn Fn() -> f64) -> Charge {
        Charge {
            prefill_tokens: self.prefill_booking.prefill_tokens(
                isl_tokens,
                self.settings.block_size,
                cached_blocks,
            ),
            decode_blocks: self.request_blocks(isl_tokens),
        }
    }

    /// Decide one request (see the module docs). Books nothing.
    pub fn select<S: Signals + ?Sized>(
        &self,
        cluster: &Cluster,
        selection: Selection<'_>,
        signals: &S,
        scratch: &mut Scratch,
    ) -> Result<Decision, SelectError> {
        let request = selection.request;
        let mut buffer = std::mem::take(&mut scratch.rows);
        let eligible = eligible(cluster, request, selection.pin, &mut buffer);
        let result = eligible.map_err(SelectError::from).and_then(|rows| {
            // A decision over every row lends the cluster's id columns instead of writing them.
            let rows = Candidates {
                rows,
                ids: cluster.id_columns_of(rows),
            };
            let configured = self.instance_for(request.role);
            match self.call(configured, rows, selection, signals, scratch) {
                Ok(pick) => Ok(Decision::new(configured, configured, pick, None)),
                Err(failure) => {
                    self.fall_back(configured, failure, rows, selection, signals, scratch)
                }
            }
        });
        scratch.rows = buffer;
        result
    }

    fn fall_back<S: Signals + ?Sized>(
        &self,
        configured: InstanceId,
        failure: PolicyFailure,
        rows: Candidates<'_>,
        selection: Selection<'_>,
        signals: &S,
        scratch: &mut Scratch,
    ) -> Result<Decision, SelectError> {
        let instance = &self.instances[configured];
        let error = SelectError::Policy {
            instance: instance.name.clone(),
            origin: instance.origin.clone(),
            failure: failure.clone(),
        };
        let fails = instance.on_error == OnError::Fail || configured == self.default_instance;
        log_failure(instance, &failure, &error, fails);
        if fails {
            return Err(error);
        }
        instance.stats.fallbacks.fetch_add(1, Ordering::Relaxed);
        let pick = self
            .call(self.default_instance, rows, selection, signals, scratch)
            .map_err(|_| error)?;
        Ok(Decision::new(
            configured,
            self.default_instance,
            pick,
            Some(failure),
        ))
    }

    /// Call one instance over `rows`; the returned row is bounds-checked.
    fn call<S: Signals + ?Sized>(
        &self,
        id: InstanceId,
        Candidates { rows, ids }: Candidates<'_>,
        selection: Selection<'_>,
        signals: &S,
        scratch: &mut Scratch,
    ) -> Result<Pick, PolicyFailure> {
        let instance = &self.instances[id];
        instance.callable()?;
        // Only the built-in default narrows to an eligible soft target (docs/routing-contract.md §4);
        // otherwise the policy gets `rows` themselves, not a copy.
        let mut target_rows = std::mem::take(&mut scratch.narrowed);
        target_rows.clear();
        if let Some(target) = selection.target.filter(|_| instance.narrows_soft_target) {
            target_rows.extend(rows.iter().copied().filter(|r| target.matches(*r)));
        }
        let (narrowed, ids) = if target_rows.is_empty() {
            (rows, ids)
        } else {
            (&target_rows[..], None)
        };
        scratch.materialise(narrowed, ids, instance.inputs, signals);
        let request = selection.request;
        // A pick that will be explained carries a token naming this input, so the policy can
        // explain the pick it made instead of deciding again (`plugin_api::EXPLAIN_TOKEN`).
        let token = [Extension {
            name: RStr::from_str(plugin_api::EXPLAIN_TOKEN),
            value: ExtensionValue::U64(if selection.explain {
                next_explain_token()
            } else {
                0
            }),
        }];
        let ctx = RawRequestContext {
            prompt_tokens: request.isl_tokens,
            request_blocks: self.request_blocks(request.isl_tokens),
            block_size: self.settings.block_size,
            role: request.role.role().code(),
            affinity_target: selection.target.map(RawAffinityTarget::from).into(),
            pinned_worker: selection.pin.into(),
            session_id: opt_str(request.session_id.as_deref()),
            expected_output_tokens: request.expected_output_tokens.into(),
            priority: request.priority,
            extensions: if selection.explain {
                RSlice::from_slice(&token)
            } else {
                RSlice::EMPTY
            },
        };
        let mut view = scratch.columns.candidate_view(instance.inputs, ids);
        // Each extra column is filled only when the host knows it: the capacity when some
        // worker's is known, the indexed blocks (with LOAD) and the index states (with CACHE)
        // when a KV index answers, the recent blocks beside the indexed ones when the core
        // tracks them.
        let named = scratch.columns.extra();
        let mut extra = [ExtraColumn {
            name: RStr::from_str(""),
            values: RSlice::EMPTY,
        }; 6];
        let mut sent = 0;
        for (name, values) in named.into_iter().filter(|(_, v)| !v.is_empty()) {
            extra[sent] = ExtraColumn {
                name: RStr::from_str(name),
                values: RSlice::from_slice(values),
            };
            sent += 1;
        }
        view.extra_columns = RSlice::from_slice(&extra[..sent]);
        instance.stats.picks.add(1);
        let started = Instant::now();
        let picked = {
            let _call = instance.watch_call(Call::Pick, Some(started), request.id);
            instance.policy.pick(&ctx, &view)
        };
        let pick_ns = u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX);
        let outcome = match picked {
            RResult::ROk(index) if index < narrowed.len() => Ok(narrowed[index]),
            RResult::ROk(index) => Err(instance.failed(PolicyFailure::OutOfRange {
                index,
                rows: narrowed.len(),
            })),
            RResult::RErr(failure) => Err(instance.failed_in_plugin("pick", failure)),
        };
        let (explanation, explain_ns) = match (&outcome, selection.explain) {
            // A pick that came back after the watchdog gave up on it keeps its row, but the
            // instance is not called again.
            (Ok(_), true) if !instance.is_hung() => explain(instance, &ctx, &view, request.id),
            _ => (None, 0),
        };
        // `serve` explains every decision (its headers and metric labels), so `explain` is on
        // the request path and held to the same budget as `pick`.
        instance.record_decision_time(pick_ns, explain_ns);
        let candidates = narrowed.len();
        scratch.narrowed = target_rows;
        outcome.map(|row| Pick {
            row,
            explanation,
            candidates,
            pick_ns,
        })
    }
}

/// The eligible rows of one decision, and their id columns when the cluster lends them (the rows
/// are its own: [`Cluster::id_columns_of`]).
#[derive(Clone, Copy)]
struct Candidates<'a> {
    rows: &'a [RowId],
    ids: Option<IdColumns<'a>>,
}

/// Log a failed call of `instance` (`fails`: the request fails instead of falling back). Only
/// what happens once per instance is logged every time (a panic, the transition into poison);
/// what can repeat on every request is rate-limited per instance (see
/// [`crate::instance::LOG_REPEAT_INTERVAL`]): a returned error or an out-of-range index at error
/// level, and, for an instance out of service (its transition was logged when it happened), a
/// warning saying how many requests went to the fallback.
#[cold]
#[inline(never)]
fn log_failure(
    instance: &PolicyInstance,
    failure: &PolicyFailure,
    error: &SelectError,
    fails: bool,
) {
    match failure {
        PolicyFailure::Poisoned | PolicyFailure::Quarantined | PolicyFailure::Hung { .. } => {
            tracing::debug!(instance = %instance.name, origin = %instance.origin, "{error}");
            if let Some(suppressed) = instance
                .logs
                .out_of_service
                .admit_after_first_now(LOG_REPEAT_INTERVAL)
            {
                let state = instance.state();
                let reason = instance.state_reason().unwrap_or_default();
                let then = if fails {
                    "its requests fail (on_error: fail)"
                } else {
                    "its requests go to its fallback"
                };
                tracing::warn!(
                    instance = %instance.name,
                    policy = %instance.type_name,
                    origin = %instance.origin,
                    state = state.as_str(),
                    requests = suppressed + 1,
                    "policy instance out of service ({state}: {reason}); {then}: {} request(s) in \
                     the last {} s",
                    suppressed + 1,
                    crate::instance::LOG_REPEAT_INTERVAL.as_secs()
                );
            }
        }
        PolicyFailure::Panicked(_) => {
            tracing::error!(instance = %instance.name, policy = %instance.type_name, origin = %instance.origin, "{error}");
        }
        _ => {
            if let Some(suppressed) = instance.logs.pick_failed.admit_now(LOG_REPEAT_INTERVAL) {
                tracing::error!(
                    instance = %instance.name,
                    policy = %instance.type_name,
                    origin = %instance.origin,
                    suppressed,
                    "{error}{}",
                    suppressed_note(suppressed)
                );
            }
        }
    }
}

impl PolicySet {
    /// Tell the instance that decided (or fell back for) a request where it was booked. Hooks
    /// exist since plugin-api 1.1; for a 1.0 plugin this is a no-op.
    /// Not called for an instance that is poisoned, quarantined or hung.
    pub fn notify_dispatch(&self, id: InstanceId, event: &DispatchEvent<'_>) {
        let instance = &self.instances[id];
        if instance.in_service() {
            // No clock reading here (this is the request path): the watchdog times a hook from
            // when it first sees it running.
            let _call = instance.watch_call(Call::OnDispatch, None, Some(event.request_id));
            instance.policy.on_dispatch(event);
        }
    }

    /// Tell the instance that a request it was notified about finished.
    pub fn notify_complete(&self, id: InstanceId, event: &CompleteEvent<'_>) {
        let instance = &self.instances[id];
        if instance.in_service() {
            let _call = instance.watch_call(Call::OnComplete, None, Some(event.request_id));
            instance.policy.on_complete(event);
        }
    }
}

/// A token no other explained pick in this process carries.
fn next_explain_token() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// Ask `instance` to explain the pick it just made, and how long that took (nanoseconds). A
/// failure is counted like a failed pick (a panic poisons the instance) but does not undo the
/// pick: the request keeps its row, without an explanation. Out of line: most callers other
/// than `serve` do not ask.
#[inline(never)]
fn explain(
    instance: &PolicyInstance,
    ctx: &RawRequestContext<'_>,
    view: &plugin_api::abi::RawCandidateView<'_>,
    request: Option<u64>,
) -> (Option<Box<Explanation>>, u64) {
    let started = Instant::now();
    let explained = {
        let _call = instance.watch_call(Call::Explain, Some(started), request);
        instance.policy.explain(ctx, view)
    };
    let explain_ns = u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX);
    let failure = match explained {
        RResult::ROk(ROption::RSome(raw)) => {
            return (Some(Box::new(explanation_from_abi(raw))), explain_ns)
        }
        RResult::ROk(ROption::RNone) => return (None, explain_ns),
        RResult::RErr(failure) => instance.failed_in_plugin("explain", failure),
    };
    match &failure {
        // Poisoned by a concurrent call, which logged the transition.
        PolicyFailure::Poisoned => {
            tracing::debug!(instance = %instance.name, origin = %instance.origin, "explain: {failure}");
        }
        // The transition into poison: logged once, as it happens once.
        PolicyFailure::Panicked(_) => tracing::error!(
            instance = %instance.name,
            policy = %instance.type_name,
            origin = %instance.origin,
            "explain failed: {failure}; the request keeps the row its pick chose, without an explanation"
        ),
        // Can repeat on every request: rate-limited.
        _ => {
            if let Some(suppressed) = instance.logs.explain_failed.admit_now(LOG_REPEAT_INTERVAL) {
                tracing::error!(
                    instance = %instance.name,
                    policy = %instance.type_name,
                    origin = %instance.origin,
                    suppressed,
                    "explain failed: {failure}; the request keeps the row its pick chose, without an explanation{}",
                    suppressed_note(suppressed)
                );
            }
        }
    }
    (None, explain_ns)
}

fn explanation_from_abi(raw: RawExplanation) -> Explanation {
    Explanation {
        row: raw.row,
        reason: raw.reason.into_string(),
        fields: raw
            .fields
            .into_iter()
            .map(|f| (f.name.into_string(), f.value))
            .collect(),
        labels: raw
            .labels
            .into_iter()
            .map(|l| (l.name.into_string(), l.value.into_string()))
            .collect(),
    }
}

impl Selector for PolicySet {
    fn select(
        &self,
        cluster: &Cluster,
        selection: Selection<'_>,
        signals: &dyn Signals,
        scratch: &mut Scratch,
    ) -> Result<Decision, SelectError> {
        PolicySet::select(self, cluster, selection, signals, scratch)
    }

    fn request_blocks(&self, isl_tokens: u64) -> u64 {
        PolicySet::request_blocks(self, isl_tokens)
    }

    fn charge(&self, isl_tokens: u64, cached_blocks: &dyn Fn() -> f64) -> Charge {
        PolicySet::charge(self, isl_tokens, cached_blocks)
    }

    fn notify_dispatch(&self, instance: InstanceId, event: &DispatchEvent<'_>) {
        PolicySet::notify_dispatch(self, instance, event);
    }

    fn notify_complete(&self, instance: InstanceId, event: &CompleteEvent<'_>) {
        PolicySet::notify_complete(self, instance, event);
    }

    fn instance_name(&self, instance: InstanceId) -> &str {
        &self.instances[instance].name
    }
}
