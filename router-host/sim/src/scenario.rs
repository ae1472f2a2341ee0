//! The `router-host select` scenario file: workers, then requests in time order.
//!
//! The contract (field names are stable for scripts) is documented in `docs/select.md`.

use std::collections::HashMap;
use std::path::Path;

use serde::Deserialize;

use router_core::model::{
    AffinityTarget, Cluster, ClusterError, Request, RequestRole, RowId, RowLoad, TierOverlap,
    Worker,
};
use router_policies::host::{
    Host, InjectedRows, OverlapSource, RequestId, RouteError, Routed, SessionOutcome, Submitted,
    TicketId,
};

/// Largest scenario file read (a scenario is operator input, but `--scenario /dev/zero` must not
/// exhaust memory).
pub const MAX_SCENARIO_BYTES: u64 = 256 << 20;

/// Most rows a scenario may declare: the same cap as a configuration's `workers:`.
pub const MAX_SCENARIO_ROWS: usize = router_config::MAX_ROWS;

/// Most row decisions a scenario may ask for: its requests times its rows. Every request looks at
/// every row (eligibility, the policy's columns), so this bounds the run's time whatever the
/// file's size: 16 workers of 65,536 ranks are within the row caps, but 1,500 requests over them
/// (a 34 KB file) are 1.5e9 row decisions, minutes of work.
pub const MAX_SCENARIO_ROW_DECISIONS: u64 = 1 << 27;

/// A parsed scenario.
#[derive(Debug, Clone, PartialEq)]
pub struct Scenario {
    /// Tokens per block the scenario was written for, if it says.
    pub block_size: Option<u32>,
    pub cluster: Cluster,
    pub requests: Vec<ScenarioRequest>,
}

/// One request of a scenario and what happens just before it.
#[derive(Debug, Clone, PartialEq)]
pub struct ScenarioRequest {
    pub request: Request,
    /// Injected overlap and load for listed rows (override the host's own snapshot).
    pub rows: HashMap<RowId, (TierOverlap, RowLoad)>,
    /// Indices of earlier requests that complete before this one arrives.
    pub complete: Vec<usize>,
    /// Worker state changes applied before this request (e.g. a worker leaving).
    pub worker_updates: Vec<WorkerUpdate>,
}

/// A change to one worker's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(
    remote = "Self",
    deny_unknown_fields,
    expecting = "a worker update object with `worker_id`"
)]
pub struct WorkerUpdate {
    pub worker_id: u64,
    #[serde(default)]
    pub available: Option<bool>,
    #[serde(default)]
    pub overloaded: Option<bool>,
}

/// Why a scenario file is unusable.
#[derive(Debug, thiserror::Error)]
pub enum ScenarioError {
    // The cause is in the message, not a `source`: printed with its chain it would say it twice.
    #[error("scenario {file}: cannot read: {reason}")]
    Read {
        file: String,
        reason: std::io::Error,
    },
    #[error("scenario {file}: line {line} column {column}: {message}")]
    Parse {
        file: String,
        line: usize,
        column: usize,
        message: String,
    },
    #[error("scenario {file}: not a regular file ({kind}); give the JSON file itself")]
    NotAFile { file: String, kind: &'static str },
    #[error("scenario {file}: workers: {reason}")]
    Workers { file: String, reason: ClusterError },
    #[error("scenario {file}: larger than {max} bytes")]
    TooLarge { file: String, max: u64 },
    #[error(
        "scenario {file}: {requests} requests over {rows} rows is {decisions} row decisions, over \
         the limit of {max} (requests times rows); use fewer rows or split the scenario"
    )]
    TooMuchWork {
        file: String,
        requests: usize,
        rows: usize,
        decisions: u64,
        max: u64,
    },
    #[error("scenario {file}: requests[{request}]: {message}")]
    Request {
        file: String,
        request: usize,
        message: String,
    },
}

// `expecting` keeps the internal type names out of messages ("expected struct RawWorker").
// `remote = "Self"`: each struct is read from an object only (`objects_only!` below); a derived
// `Deserialize` would also take an array of its fields in order.
#[derive(Deserialize)]
#[serde(
    remote = "Self",
    deny_unknown_fields,
    expecting = "a scenario object with `workers` and `requests`"
)]
struct RawScenario {
    #[serde(default)]
    block_size: Option<u32>,
    workers: Vec<RawWorker>,
    requests: Vec<RawRequest>,
}

router_config::input::objects_only!(
    WorkerUpdate,
    RawScenario,
    RawWorker,
    RawTarget,
    RawPin,
    RawRequest,
    RawRow
);

fn yes() -> bool {
    true
}

#[derive(Deserialize)]
#[serde(
    remote = "Self",
    deny_unknown_fields,
    expecting = "a worker object with `worker_id`"
)]
struct RawWorker {
    worker_id: u64,
    #[serde(default)]
    dp_start: u32,
    /// 1 to `MAX_DP_SIZE`, as in a configuration.
    #[serde(default, deserialize_with = "router_config::de_dp_size")]
    dp_size: Option<u32>,
    #[serde(default = "yes")]
    available: bool,
    #[serde(default)]
    overloaded: bool,
    #[serde(default)]
    max_num_batched_tokens: Option<u64>,
    #[serde(default)]
    total_kv_blocks: Option<u64>,
}

#[derive(Deserialize, Clone, Copy)]
#[serde(
    remote = "Self",
    deny_unknown_fields,
    expecting = "an affinity target object with `worker_id`"
)]
struct RawTarget {
    worker_id: u64,
    #[serde(default)]
    dp_rank: Option<u32>,
}

#[derive(Deserialize, Clone, Copy)]
#[serde(
    remote = "Self",
    deny_unknown_fields,
    expecting = "a pinned worker object with `worker_id`"
)]
struct RawPin {
    worker_id: u64,
    #[serde(default)]
    dp_rank: u32,
}

/// A request's `role`, spelled as `RequestRole::from_name` reads it (the one list of names).
#[derive(Clone, Copy, Default)]
struct RawRole(RequestRole);

impl<'de> Deserialize<'de> for RawRole {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Names;
        impl serde::de::Visitor<'_> for Names {
            type Value = RawRole;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a role: `aggregated`, `prefill` or `decode`")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<RawRole, E> {
                static NAMES: std::sync::OnceLock<[&str; 3]> = std::sync::OnceLock::new();
                let names = NAMES.get_or_init(|| RequestRole::ALL.map(RequestRole::as_str));
                RequestRole::from_name(v)
                    .map(RawRole)
                    .ok_or_else(|| E::unknown_variant(v, names))
            }
        }
        d.deserialize_str(Names)
    }
}

#[derive(Deserialize)]
#[serde(
    remote = "Self",
    deny_unknown_fields,
    expecting = "a request object with `isl_tokens`"
)]
struct RawRequest {
    isl_tokens: u64,
    #[serde(default)]
    role: RawRole,
    #[serde(default)]
    session_id: Option<String>,
    #[serde(default)]
    affinity_target: Option<RawTarget>,
    #[serde(default)]
    pinned_worker: Option<RawPin>,
    #[serde(default)]
    allowed_worker_ids: Option<Vec<u64>>,
    #[serde(default)]
    expected_output_tokens: Option<u64>,
    #[serde(default)]
    priority: i32,
    #[serde(default)]
    policy_class: Option<String>,
    #[serde(default)]
    rows: Vec<RawRow>,
    #[serde(default)]
    complete: Vec<usize>,
    #[serde(default)]
    worker_updates: Vec<WorkerUpdate>,
}

#[derive(Deserialize)]
#[serde(
    remote = "Self",
    deny_unknown_fields,
    expecting = "a row object with `worker_id`"
)]
struct RawRow {
    worker_id: u64,
    #[serde(default)]
    dp_rank: u32,
    #[serde(default)]
    device_blocks: f64,
    #[serde(default)]
    host_blocks: f64,
    #[serde(default)]
    disk_blocks: f64,
    #[serde(default = "yes")]
    available: bool,
    #[serde(default)]
    active_requests: u64,
    #[serde(default)]
    active_prefill_tokens: u64,
    #[serde(default)]
    decode_blocks: u64,
}

impl Scenario {
    /// Reads and parses the scenario file at `path`: a regular file of at most
    /// [`MAX_SCENARIO_BYTES`] (a FIFO would block, a device never end).
    pub fn from_file(path: &Path) -> Result<Scenario, ScenarioError> {
        use router_config::input::InputError;
        let file = path.display().to_string();
        let bytes =
            router_config::input::read_capped(path, MAX_SCENARIO_BYTES).map_err(
                |err| match err {
                    InputError::Io(reason) => ScenarioError::Read {
                        file: file.clone(),
                        reason,
                    },
                    InputError::NotAFile { kind } => ScenarioError::NotAFile {
                        file: file.clone(),
                        kind,
                    },
                    InputError::TooLarge { limit } => ScenarioError::TooLarge {
                        file: file.clone(),
                        max: limit,
                    },
                },
            )?;
        let text = String::from_utf8(bytes).map_err(|err| ScenarioError::Read {
            file: file.clone(),
            reason: std::io::Error::new(std::io::ErrorKind::InvalidData, err.utf8_error()),
        })?;
        Self::from_json_str(&text, &file)
    }

    /// Parse scenario text; `file` names it in errors.
    pub fn from_json_str(text: &str, file: &str) -> Result<Scenario, ScenarioError> {
        let parse_error = |path: Option<String>, e: &serde_json::Error| {
            let message = strip_position(&e.to_string());
            ScenarioError::Parse {
                file: file.to_string(),
                line: e.line(),
                column: e.column(),
                message: match path {
                    Some(path) => format!("{path}: {message}"),
                    None => message,
                },
            }
        };
        let mut de = serde_json::Deserializer::from_str(text);
        let raw: RawScenario = serde_path_to_error::deserialize(&mut de).map_err(|e| {
            // `.` is the top level and `?` no place (the end of the text): the line and column
            // say it all.
            let path = e.path().to_string();
            parse_error((path != "." && path != "?").then_some(path), e.inner())
        })?;
        de.end().map_err(|e| parse_error(None, &e))?;
        if raw.block_size == Some(0) {
            return Err(ScenarioError::Parse {
                file: file.to_string(),
                line: 1,
                column: 1,
                message: "block_size must be at least 1".to_string(),
            });
        }
        let workers = raw
            .workers
            .into_iter()
            .map(|w| Worker {
                worker_id: w.worker_id,
                dp_start: w.dp_start,
                dp_size: w.dp_size.unwrap_or(1),
                available: w.available,
                overloaded: w.overloaded,
                draining: false,
                max_num_batched_tokens: w.max_num_batched_tokens,
                total_kv_blocks: w.total_kv_blocks,
            })
            .collect();
        let cluster = Cluster::new(workers).map_err(|reason| ScenarioError::Workers {
            file: file.to_string(),
            reason,
        })?;
        let decisions = (raw.requests.len() as u64).saturating_mul(cluster.row_count() as u64);
        if decisions > MAX_SCENARIO_ROW_DECISIONS {
            return Err(ScenarioError::TooMuchWork {
                file: file.to_string(),
                requests: raw.requests.len(),
                rows: cluster.row_count(),
                decisions,
                max: MAX_SCENARIO_ROW_DECISIONS,
            });
        }
        let mut requests = Vec::with_capacity(raw.requests.len());
        for (index, r) in raw.requests.into_iter().enumerate() {
            let bad = |message: String| ScenarioError::Request {
                file: file.to_string(),
                request: index,
                message,
            };
            if r.isl_tokens == 0 {
                return Err(bad(
                    "isl_tokens: must be at least 1 (a request without a prompt token is not a request)"
                        .to_string(),
                ));
            }
            if let Some(u) = r
                .worker_updates
                .iter()
                .find(|u| cluster.worker(u.worker_id).is_none())
            {
                return Err(bad(format!(
                    "worker_updates: worker {} is not in `workers`",
                    u.worker_id
                )));
            }
            if let Some(&later) = r.complete.iter().find(|&&c| c >= index) {
                return Err(bad(format!(
                    "complete: request {later} has not been sent yet (only earlier requests can complete)"
                )));
            }
            let mut rows = HashMap::with_capacity(r.rows.len());
            for (i, row) in r.rows.into_iter().enumerate() {
                let id = RowId {
                    worker_id: row.worker_id,
                    dp_rank: row.dp_rank,
                };
                for (name, value) in [
                    ("device_blocks", row.device_blocks),
                    ("host_blocks", row.host_blocks),
                    ("disk_blocks", row.disk_blocks),
                ] {
                    if !(value.is_finite() && value >= 0.0) {
                        return Err(bad(format!(
                            "rows[{i}].{name}: must be a finite number >= 0, got {value}"
                        )));
                    }
                }
                let signals = (
                    TierOverlap {
                        device: row.device_blocks,
                        host: row.host_blocks,
                        disk: row.disk_blocks,
                    },
                    RowLoad {
                        available: row.available,
                        active_requests: row.active_requests,
                        active_prefill_tokens: row.active_prefill_tokens,
                        decode_blocks: row.decode_blocks,
                    },
                );
                if rows.insert(id, signals).is_some() {
                    return Err(bad(format!(
                        "rows[{i}]: row {}:{} is listed twice",
                        id.worker_id, id.dp_rank
                    )));
                }
            }
            requests.push(ScenarioRequest {
                request: Request {
                    // Scenario requests are numbered by the host, in dispatch order.
                    id: None,
                    blocks: Vec::new(),
                    isl_tokens: r.isl_tokens,
                    role: r.role.0,
                    session_id: r.session_id,
                    affinity_target: r.affinity_target.map(|t| AffinityTarget {
                        worker_id: t.worker_id,
                        dp_rank: t.dp_rank,
                    }),
                    pinned_worker: r.pinned_worker.map(|p| RowId {
                        worker_id: p.worker_id,
                        dp_rank: p.dp_rank,
                    }),
                    allowed_worker_ids: r.allowed_worker_ids,
                    expected_output_tokens: r.expected_output_tokens,
                    priority: r.priority,
                    policy_class: r.policy_class,
                },
                rows,
                complete: r.complete,
                worker_updates: r.worker_updates,
            });
        }
        Ok(Scenario {
            block_size: raw.block_size,
            cluster,
            requests,
        })
    }
}

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
            let instance = host.router().instance(d.instance);
            let policy = host.router().instance(d.decided_by).type_name.as_str();
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

/// serde_json appends " at line L column C"; the error already carries them as fields (the
/// scenario's errors, and the replay trace's, which name the column themselves).
pub(crate) fn strip_position(message: &str) -> String {
    match message.rfind(" at line ") {
        Some(at) => message[..at].to_string(),
        None => message.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use router_config::MAX_DP_SIZE;

    #[test]
    fn minimal_scenario_takes_the_documented_defaults() {
        let s = Scenario::from_json_str(
            r#"{"workers": [{"worker_id": 29}], "requests": [{"isl_tokens": 160}]}"#,
            "t.json",
        )
        .unwrap();
        let w = &s.cluster.workers()[0];
        assert_eq!(
            (w.dp_start, w.dp_size, w.available, w.overloaded),
            (0, 1, true, false)
        );
        assert_eq!(s.requests[0].request.role, RequestRole::Aggregated);
        assert!(s.requests[0].rows.is_empty());
    }

    #[test]
    fn errors_name_file_line_and_field() {
        let err = Scenario::from_json_str(
            "{\"workers\": [],\n \"requests\": [{\"isl_tokens\": 1, \"colour\": 2}]}",
            "s.json",
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("s.json: line 2"), "{err}");
        assert!(err.contains("unknown field `colour`"), "{err}");

        let err = Scenario::from_json_str(
            r#"{"workers": [{"worker_id": 1}, {"worker_id": 1}], "requests": []}"#,
            "s.json",
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("duplicate worker_id 1"), "{err}");

        let err = Scenario::from_json_str(
            r#"{"workers": [], "requests": [{"isl_tokens": 1, "complete": [0]}]}"#,
            "s.json",
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("requests[0]: complete: request 0"), "{err}");

        let err = Scenario::from_json_str(
            r#"{"workers": [], "requests": [{"isl_tokens": 99999999999999999999999}]}"#,
            "s.json",
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("line 1"), "{err}");

        let err = Scenario::from_json_str(
            r#"{"workers": [], "requests": [{"isl_tokens": 1}, {"isl_tokens": 0}]}"#,
            "s.json",
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("requests[1]: isl_tokens: must be at least 1"),
            "{err}"
        );
    }

    #[test]
    fn a_scenario_that_is_not_an_object_is_refused_naming_the_file() {
        // Issue: the derived parser took an array of the fields in order for a scenario.
        for text in [
            r#"[[{"worker_id": 1}], [{"isl_tokens": 1}]]"#,
            r#"[null, [{"worker_id": 1}], [{"isl_tokens": 1}]]"#,
            "[]",
            "7",
            r#""workers""#,
        ] {
            let err = Scenario::from_json_str(text, "s.json")
                .unwrap_err()
                .to_string();
            assert!(err.starts_with("scenario s.json: line 1 column "), "{err}");
            assert!(
                err.ends_with("expected a scenario object with `workers` and `requests`"),
                "{err}"
            );
        }
        let err = Scenario::from_json_str(r#"[[{"worker_id": 1}], [{"isl_tokens": 1}]]"#, "s.json")
            .unwrap_err()
            .to_string();
        assert_eq!(
            err,
            "scenario s.json: line 1 column 0: invalid type: sequence, expected a scenario object \
             with `workers` and `requests`"
        );
        // The object form, with whitespace before it, is unchanged.
        let s = Scenario::from_json_str(
            " \n{\"workers\": [{\"worker_id\": 1}], \"requests\": [{\"isl_tokens\": 1}]}",
            "s.json",
        )
        .unwrap();
        assert_eq!(s.requests.len(), 1);
        let err = Scenario::from_json_str(
            r#"{"workers": [], "requests": [], "workers": []}"#,
            "s.json",
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("duplicate field `workers`"), "{err}");
        let err = Scenario::from_json_str(r#"{"workers": []}"#, "s.json")
            .unwrap_err()
            .to_string();
        assert!(err.contains("missing field `requests`"), "{err}");
    }

    #[test]
    fn every_object_of_a_scenario_written_as_an_array_is_refused_naming_its_place() {
        // The derived parser took an array of a struct's fields in order, at every level below
        // the top: `{"workers": [[1, 0, 2]]}` was worker 1 with two ranks.
        let request = |extra: &str| {
            format!(
                r#"{{"workers": [{{"worker_id": 1}}], "requests": [{{"isl_tokens": 1}}, {{"isl_tokens": 1{extra}}}]}}"#
            )
        };
        for (text, place, what) in [
            (
                r#"{"workers": [[1, 0, 2]], "requests": []}"#.to_owned(),
                "workers[0]",
                "a worker object with `worker_id`",
            ),
            (
                r#"{"workers": [{"worker_id": 1}], "requests": [{"isl_tokens": 1}, [16]]}"#
                    .to_owned(),
                "requests[1]",
                "a request object with `isl_tokens`",
            ),
            (
                request(r#", "rows": [[1, 0, 5.0]]"#),
                "requests[1].rows[0]",
                "a row object with `worker_id`",
            ),
            (
                request(r#", "affinity_target": [1, 0]"#),
                "requests[1].affinity_target",
                "an affinity target object with `worker_id`",
            ),
            (
                request(r#", "pinned_worker": [1, 0]"#),
                "requests[1].pinned_worker",
                "a pinned worker object with `worker_id`",
            ),
            (
                request(r#", "worker_updates": [[1, false]]"#),
                "requests[1].worker_updates[0]",
                "a worker update object with `worker_id`",
            ),
        ] {
            let err = Scenario::from_json_str(&text, "s.json")
                .unwrap_err()
                .to_string();
            assert!(
                err.starts_with("scenario s.json: line 1 column ")
                    && err.ends_with(&format!(
                        ": {place}: invalid type: sequence, expected {what}"
                    )),
                "{text}: {err}"
            );
        }
    }

    #[test]
    fn rows_beyond_the_cap_are_refused_before_anything_is_allocated() {
        // Found while writing the `select_scenario` fuzz target: 80 bytes asking for 4e9 rows made the first
        // request try to allocate 64 GB for its eligible rows.
        let err = Scenario::from_json_str(
            r#"{"workers": [{"worker_id": 1, "dp_size": 4000000000}, {"worker_id": 2, "dp_size": 4000000000}],
                "requests": [{"isl_tokens": 1}]}"#,
            "s.json",
        )
        .unwrap_err()
        .to_string();
        assert_eq!(
            err,
            "scenario s.json: line 1 column 51: workers[0].dp_size: invalid value: integer \
             `4000000000` is out of range, expected an integer from 1 to 65536"
        );
        // Within the dp_size cap, over the total.
        let workers = |n: u64| {
            (0..n)
                .map(|id| format!(r#"{{"worker_id": {id}, "dp_size": {MAX_DP_SIZE}}}"#))
                .collect::<Vec<_>>()
                .join(",")
        };
        let err = Scenario::from_json_str(
            &format!(r#"{{"workers": [{}], "requests": []}}"#, workers(17)),
            "s.json",
        )
        .unwrap_err()
        .to_string();
        assert_eq!(
            err,
            "scenario s.json: workers: 1114112 rows in total (the sum of every dp_size), \
             over the limit of 1048576"
        );
        // Exactly at the cap is fine.
        let s = Scenario::from_json_str(
            &format!(r#"{{"workers": [{}], "requests": []}}"#, workers(16)),
            "s.json",
        )
        .unwrap();
        assert_eq!(s.cluster.row_count(), MAX_SCENARIO_ROWS);
    }

    #[test]
    fn requests_times_rows_beyond_the_budget_are_refused_before_any_is_decided() {
        let scenario = |requests: u64| {
            let requests = vec![r#"{"isl_tokens": 1}"#; requests as usize].join(",");
            format!(
                r#"{{"workers": [{{"worker_id": 1, "dp_size": {MAX_DP_SIZE}}}], "requests": [{requests}]}}"#
            )
        };
        let at_budget = MAX_SCENARIO_ROW_DECISIONS / MAX_DP_SIZE;
        let s = Scenario::from_json_str(&scenario(at_budget), "s.json").unwrap();
        assert_eq!(s.requests.len() as u64, at_budget);
        let err = Scenario::from_json_str(&scenario(at_budget + 1), "s.json")
            .unwrap_err()
            .to_string();
        assert_eq!(
            err,
            "scenario s.json: 2049 requests over 65536 rows is 134283264 row decisions, over the \
             limit of 134217728 (requests times rows); use fewer rows or split the scenario"
        );
    }
}
