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

mod run;
#[cfg(test)]
mod tests;

pub use run::{outcome_json, run, run_streaming, Outcome};

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
                    // A scenario's requests are all first legs (no engines fail in `select`).
                    continues: false,
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

/// serde_json appends " at line L column C"; the error already carries them as fields (the
/// scenario's errors, and the replay trace's, which name the column themselves).
pub(crate) fn strip_position(message: &str) -> String {
    match message.rfind(" at line ") {
        Some(at) => message[..at].to_string(),
        None => message.to_string(),
    }
}
