//! Driving a scenario through a [`Host`] and writing each request's outcome line
//! (`docs/select.md`).

use super::*;

/// What happened to one scenario request.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// Dispatched; `admitted_at` is the index of the step at which a queued request left its
    /// queue (`None` = dispatched on arrival).
    Routed {
        routed: Routed,
        admitted_at: Option<usize>,
    },
    Failed(RouteError),
    /// Still waiting for capacity when the scenario ended.
    StillQueued,
}

impl Outcome {
    pub fn routed(&self) -> Option<&Routed> {
        match self {
            Outcome::Routed { routed, .. } => Some(routed),
            _ => None,
        }
    }
}

/// Injected overlap without injected load: a queued request re-evaluated later sees the live
/// booked load, not the snapshot of the step it arrived at.
struct OverlapOnly<'a>(&'a InjectedRows);

impl OverlapSource for OverlapOnly<'_> {
    fn overlap(&self, row: RowId) -> TierOverlap {
        self.0.overlap(row)
    }
}

/// Drive `host` through the scenario: before each request apply its completions and worker
/// updates and let queued requests drain, then submit it. One outcome per request, in order.
pub fn run(host: &mut Host, scenario: &Scenario) -> Vec<Outcome> {
    let mut outcomes = Vec::with_capacity(scenario.requests.len());
    let Ok(()) = run_streaming(host, scenario, |_, _, outcome| {
        outcomes.push(outcome);
        Ok::<(), std::convert::Infallible>(())
    });
    outcomes
}

/// [`run`], handing each request's outcome to `emit` (with its index) as soon as it is final,
/// in request order: right after the request is decided, unless it (or an earlier one) waits in
/// an admission queue; then when those leave it, or at the end. `select` prints each line this
/// way, so a request that never comes back shows where the run stopped. An error from `emit`
/// stops the run and is returned.
pub fn run_streaming<E>(
    host: &mut Host,
    scenario: &Scenario,
    mut emit: impl FnMut(&Host, usize, Outcome) -> Result<(), E>,
) -> Result<(), E> {
    let n = scenario.requests.len();
    let mut outcomes = vec![Outcome::StillQueued; n];
    let mut dispatched: Vec<Option<RequestId>> = vec![None; n];
    let mut queued: HashMap<TicketId, usize> = HashMap::new();
    let mut waiting = vec![false; n];
    let mut emitted = 0;
    for (index, step) in scenario.requests.iter().enumerate() {
        for &earlier in &step.complete {
            if let Some(id) = dispatched[earlier] {
                host.complete(id);
            }
        }
        for update in &step.worker_updates {
            // Validated at parse time: every updated worker is in `workers`.
            host.set_worker_state(update.worker_id, update.available, update.overloaded);
        }
        let drained = host.drain(
            |ticket, _| {
                let origin = queued.get(&ticket).copied().unwrap_or(index);
                OverlapOnly(&scenario.requests[origin].rows)
            },
            true,
        );
        for d in drained {
            let Some(origin) = queued.remove(&d.ticket) else {
                continue;
            };
            waiting[origin] = false;
            outcomes[origin] = match d.result {
                Ok(routed) => {
                    dispatched[origin] = Some(routed.id);
                    Outcome::Routed {
                        routed,
                        admitted_at: Some(index),
                    }
                }
                Err(err) => Outcome::Failed(err),
            };
        }
        outcomes[index] = match host.submit(step.request.clone(), &step.rows, true) {
            Ok(Submitted::Dispatched(routed)) => {
                dispatched[index] = Some(routed.id);
                Outcome::Routed {
                    routed,
                    admitted_at: None,
                }
            }
            Ok(Submitted::Queued(ticket)) => {
                queued.insert(ticket.id(), index);
                waiting[index] = true;
                Outcome::StillQueued
            }
            Err(err) => Outcome::Failed(err),
        };
        while emitted <= index && !waiting[emitted] {
            let outcome = std::mem::replace(&mut outcomes[emitted], Outcome::StillQueued);
            emit(host, emitted, outcome)?;
            emitted += 1;
        }
    }
    for (index, outcome) in outcomes.into_iter().enumerate().skip(emitted) {
        emit(host, index, outcome)?;
    }
    Ok(())
}

/// The `select` output line for one request (contract in `docs/select.md`).
pub fn outcome_json(host: &Host, index: usize, outcome: &Outcome) -> serde_json::Value {
    use serde_json::{json, Map, Value};
    match outcome {
        Outcome::Failed(err) => json!({"request": index, "error": err.to_string()}),
        Outcome::StillQueued => json!({
            "request": index,
            "queued": true,
            "error": "still queued at the end of the scenario: no row was admissible for its class (or its pinned row stayed busy)",
        }),
        Outcome::Routed {
            routed,
            admitted_at,
        } => {
            let d = &routed.decision;
            // `instance` is the configured one; `policy` the type of the one that decided
            // (the built-in default, on fallback).
            let instance = host.policy_set().instance(d.instance);
            let policy = host.policy_set().instance(d.decided_by).type_name.as_str();
            let mut line = Map::new();
            line.insert("request".into(), json!(index));
            line.insert("worker_id".into(), json!(d.row.worker_id));
            line.insert("dp_rank".into(), json!(d.row.dp_rank));
            line.insert("instance".into(), json!(instance.name));
            line.insert("policy".into(), json!(policy));
            line.insert(
                "reason".into(),
                d.explanation
                    .as_ref()
                    .map_or(Value::Null, |e| json!(e.reason)),
            );
            if let Some(step) = admitted_at {
                line.insert("queued".into(), json!(true));
                line.insert("admitted_at".into(), json!(step));
            }
            if let Some(failure) = &d.fallback {
                line.insert("fallback".into(), json!(failure.to_string()));
            }
            if let Some(session) = &routed.session {
                let label = match session {
                    SessionOutcome::Dispatched(o) => o.as_str().to_string(),
                    SessionOutcome::HardBindingGone => "hard_binding_gone".to_string(),
                    SessionOutcome::NotRecorded(err) => format!("not_recorded: {err}"),
                };
                line.insert("session".into(), json!(label));
            }
            if let Some(e) = &d.explanation {
                let fields: Map<String, Value> = e
                    .fields
                    .iter()
                    .map(|(k, v)| (k.clone(), json!(v)))
                    .collect();
                let labels: Map<String, Value> = e
                    .labels
                    .iter()
                    .map(|(k, v)| (k.clone(), json!(v)))
                    .collect();
                line.insert(
                    "explain".into(),
                    json!({"fields": fields, "labels": labels}),
                );
            }
            Value::Object(line)
        }
    }
}
