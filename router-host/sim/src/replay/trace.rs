//! Workloads: the Mooncake JSONL trace format (read and write) and the ideal prefix-reuse bound.
//!
//! One line = one request: `timestamp` (arrival, milliseconds), `input_length` (prompt tokens),
//! `output_length` (generated tokens), `hash_ids` (one id per `block_size` prompt tokens; equal ids
//! mean an equal prefix block) and an optional `session_id` (string or non-negative integer).
//! Other fields are ignored. Blank lines are skipped. Every problem is reported as
//! `trace FILE: line N: field `F`: PROBLEM`; a malformed line never panics.

use std::fmt;
use std::io::{BufRead, Read, Write};
use std::path::Path;

use serde::Deserialize;

use crate::scenario::strip_position;
use router_core::fast_hash::{FastMap, FastSet};

/// Tokens per `hash_ids` entry in the Mooncake traces (and the default `--trace-block-size`).
pub const DEFAULT_TRACE_BLOCK_SIZE: u32 = 512;

/// Largest accepted `timestamp` (milliseconds, about 31 years): simulated nanoseconds stay far
/// from `u64` overflow.
pub const MAX_TIMESTAMP_MS: f64 = 1e12;
/// Longest trace line read, in bytes (without its newline). A longer line is an error naming the
/// file and line; the reader never holds more than this much of one line.
pub const MAX_TRACE_LINE_BYTES: usize = 1 << 20;
/// Largest trace file read, in bytes: the workload is held in memory, about as large as the file.
pub const MAX_TRACE_BYTES: u64 = 1 << 30;
/// Largest accepted `output_length`.
pub const MAX_OUTPUT_LENGTH: u64 = 1_000_000_000;

/// One request of a workload.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkloadRequest {
    /// Arrival time, nanoseconds since the workload's time origin.
    pub arrival_ns: u64,
    /// Prompt tokens (>= 1).
    pub input_length: u64,
    /// Tokens to generate (0 is treated as 1: prefill always yields the first token).
    pub output_length: u64,
    /// Prompt block ids, `ceil(input_length / block_size)` of them.
    pub hash_ids: Vec<u64>,
    pub session_id: Option<String>,
}

/// What a request of a closed-loop trace adds to the Mooncake fields.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RequestLinks {
    /// The request (index in [`Workload::requests`], always an earlier one) after whose end
    /// this one arrives, and the client's gap in nanoseconds: the trace's `after` and `gap_ms`.
    pub after: Option<(u32, u64)>,
    /// Ids of the full blocks the generated tokens complete, past the prompt's full blocks (the
    /// trace's `output_hash_ids`).
    pub output_hash_ids: Vec<u64>,
}

/// Requests in arrival order, all cut into blocks of one size.
#[derive(Debug, Clone, PartialEq)]
pub struct Workload {
    /// Tokens per block (per `hash_ids` entry).
    pub block_size: u32,
    /// Sorted by `arrival_ns`; equal arrivals keep their input order.
    pub requests: Vec<WorkloadRequest>,
    /// Where it came from, for the report (`trace PATH` or a synthetic description).
    pub source: String,
    /// Closed-loop links and generated blocks: one per request, or empty when no request has
    /// any (a plain Mooncake trace).
    pub links: Vec<RequestLinks>,
}

/// Reuse statistics that do not depend on any policy.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WorkloadStats {
    pub requests: usize,
    pub prompt_blocks: u64,
    /// Prompt blocks in the leading run of blocks already seen in an earlier request.
    pub reusable_blocks: u64,
    /// `reusable_blocks / prompt_blocks` (0 for an empty workload).
    pub ideal_hit_rate: f64,
    pub input_tokens: u64,
    pub output_tokens: u64,
    /// Distinct session ids (0 when the workload has none).
    pub sessions: usize,
    /// Last arrival minus first arrival, seconds.
    pub duration_s: f64,
}

impl Workload {
    /// The policy-independent statistics, including the ideal hit rate: with an infinite cache
    /// shared by everyone, a request can reuse the leading run of its blocks that appeared in any
    /// earlier request.
    pub fn stats(&self) -> WorkloadStats {
        let mut seen: FastSet<u64> = FastSet::default();
        let mut sessions: FastSet<&str> = FastSet::default();
        let (mut prompt_blocks, mut reusable, mut input, mut output) = (0u64, 0u64, 0u64, 0u64);
        for r in &self.requests {
            prompt_blocks += r.hash_ids.len() as u64;
            reusable += r.hash_ids.iter().take_while(|b| seen.contains(b)).count() as u64;
            seen.extend(r.hash_ids.iter().copied());
            input += r.input_length;
            output += r.output_length.max(1);
            if let Some(s) = &r.session_id {
                sessions.insert(s);
            }
        }
        let duration_ns = match (self.requests.first(), self.requests.last()) {
            (Some(a), Some(b)) => b.arrival_ns - a.arrival_ns,
            _ => 0,
        };
        WorkloadStats {
            requests: self.requests.len(),
            prompt_blocks,
            reusable_blocks: reusable,
            ideal_hit_rate: ratio(reusable, prompt_blocks),
            input_tokens: input,
            output_tokens: output,
            sessions: sessions.len(),
            duration_s: duration_ns as f64 / 1e9,
        }
    }

    /// Keep only the first `n` requests (in arrival order). A request only ever follows an
    /// earlier one, so every link left points inside.
    pub fn truncate(&mut self, n: usize) {
        self.requests.truncate(n);
        self.links.truncate(n);
    }

    /// Request `i`'s closed-loop link and generated blocks, if it has any.
    pub fn links(&self, i: usize) -> Option<&RequestLinks> {
        self.links.get(i)
    }

    /// Whether any request arrives after another one's end (`after`).
    pub fn is_closed_loop(&self) -> bool {
        self.links.iter().any(|l| l.after.is_some())
    }

    /// Drop the `after` links: every request arrives at its `timestamp` (replay without
    /// `--closed-loop`).
    pub fn open_loop(&mut self) {
        for l in &mut self.links {
            l.after = None;
        }
    }

    /// Multiply every arrival time by `factor` (0.5 = the same requests twice as fast).
    ///
    /// `factor` must be finite and > 0, and must keep every arrival within
    /// [`MAX_TIMESTAMP_MS`], the limit on trace timestamps (simulated time cannot overflow);
    /// otherwise nothing changes and the error says why and what range is valid.
    pub fn scale_time(&mut self, factor: f64) -> Result<(), TimeScaleError> {
        if !(factor.is_finite() && factor > 0.0) {
            return Err(TimeScaleError::NotPositive { factor });
        }
        let latest_ns = self
            .requests
            .iter()
            .map(|r| r.arrival_ns)
            .max()
            .unwrap_or(0);
        if latest_ns > 0 {
            let max_factor = MAX_ARRIVAL_NS / latest_ns as f64;
            if factor > max_factor {
                return Err(TimeScaleError::Overflow {
                    factor,
                    latest_ms: latest_ns as f64 / 1e6,
                    max_factor,
                });
            }
        }
        for r in &mut self.requests {
            // `min` only absorbs rounding: the check above keeps every product within the cap.
            r.arrival_ns = (r.arrival_ns as f64 * factor).round().min(MAX_ARRIVAL_NS) as u64;
        }
        // A client's gaps are part of its traffic: twice as fast is half the gap. A gap is at
        // most the timestamp limit, so the product stays far inside u64 at any valid factor.
        for l in &mut self.links {
            if let Some((_, gap)) = &mut l.after {
                *gap = (*gap as f64 * factor).round().min(MAX_ARRIVAL_NS) as u64;
            }
        }
        Ok(())
    }

    /// Read a Mooncake-format JSONL file: a regular file (a FIFO would block, a device never
    /// end) of at most [`MAX_TRACE_BYTES`].
    pub fn from_jsonl_file(path: &Path, block_size: u32) -> Result<Workload, TraceError> {
        use router_config::input::InputError;
        let name = path.display().to_string();
        let refused = |message: String| TraceError {
            file: name.clone(),
            line: None,
            field: None,
            message,
        };
        let file = router_config::input::open_regular(path).map_err(|err| match err {
            InputError::Io(e) => refused(format!("cannot read: {e}")),
            other => refused(format!("{other}; give the JSONL file itself")),
        })?;
        let too_large = || {
            refused(format!(
                "larger than {MAX_TRACE_BYTES} bytes (1 GiB), the limit on a trace file"
            ))
        };
        if file.metadata().map_or(0, |m| m.len()) > MAX_TRACE_BYTES {
            return Err(too_large());
        }
        // A file that grows while it is read is still read no further than the limit.
        let mut limited = file.take(MAX_TRACE_BYTES + 1);
        let mut workload =
            Self::from_jsonl_reader(std::io::BufReader::new(&mut limited), &name, block_size)?;
        if limited.limit() == 0 {
            return Err(too_large());
        }
        workload.source = format!("trace {name}");
        Ok(workload)
    }

    /// Parse Mooncake-format JSONL; `file` names the input in errors.
    pub fn from_jsonl_reader(
        mut reader: impl BufRead,
        file: &str,
        block_size: u32,
    ) -> Result<Workload, TraceError> {
        if block_size == 0 {
            return Err(TraceError {
                file: file.to_string(),
                line: None,
                field: None,
                message: "block size must be at least 1".to_string(),
            });
        }
        let mut requests: Vec<WorkloadRequest> = Vec::new();
        let mut raw_links: Vec<RawLinks> = Vec::new();
        // `id` -> (index of its request in file order, its line).
        let mut ids: FastMap<String, (u32, usize)> = FastMap::default();
        let mut bytes = Vec::new();
        for number in 1.. {
            let bad = |field: Option<&str>, message: String| TraceError {
                file: file.to_string(),
                line: Some(number),
                field: field.map(str::to_string),
                message,
            };
            bytes.clear();
            // At most the cap, its newline and one byte more: a longer line (or a file with no
            // newline at all, such as /dev/zero) is refused without reading the rest.
            (&mut reader)
                .take(MAX_TRACE_LINE_BYTES as u64 + 1)
                .read_until(b'\n', &mut bytes)
                .map_err(|e| bad(None, format!("cannot read: {e}")))?;
            if bytes.is_empty() {
                break;
            }
            if bytes.last() == Some(&b'\n') {
                bytes.pop();
            } else if bytes.len() > MAX_TRACE_LINE_BYTES {
                return Err(bad(
                    None,
                    format!(
                        "longer than {MAX_TRACE_LINE_BYTES} bytes (1 MiB), the limit on one \
                         trace line"
                    ),
                ));
            }
            let text = std::str::from_utf8(&bytes)
                .map_err(|e| bad(None, format!("not UTF-8: {e}")))?
                .trim();
            if text.is_empty() {
                continue;
            }
            let (request, links) = parse_line(text, block_size).map_err(|(f, m)| bad(f, m))?;
            let index = requests.len() as u32;
            if let Some(after) = &links.after {
                let Some(&(earlier, line)) = ids.get(after) else {
                    return Err(bad(
                        Some("after"),
                        format!("`{after}` is not the id of an earlier line"),
                    ));
                };
                let at = requests[earlier as usize].arrival_ns;
                if request.arrival_ns < at {
                    return Err(bad(
                        Some("timestamp"),
                        format!(
                            "{} ms is before the timestamp of line {line} ({} ms), which it \
                             comes after",
                            request.arrival_ns as f64 / 1e6,
                            at as f64 / 1e6
                        ),
                    ));
                }
            }
            if let Some(id) = &links.id {
                if let Some(&(_, line)) = ids.get(id) {
                    return Err(bad(
                        Some("id"),
                        format!("`{id}` is already the id of line {line}"),
                    ));
                }
                ids.insert(id.clone(), (index, number));
            }
            // Only a trace that has links keeps one per request.
            if !links.is_empty() || !raw_links.is_empty() {
                raw_links.resize_with(requests.len(), RawLinks::default);
                raw_links.push(links);
            }
            requests.push(request);
        }
        // Replay in timestamp order; a stable sort keeps file order for equal timestamps (and
        // a request after the one it follows, which is earlier in the file and not later).
        let mut order: Vec<u32> = (0..requests.len() as u32).collect();
        order.sort_by_key(|&i| requests[i as usize].arrival_ns);
        let links = if raw_links.is_empty() {
            Vec::new()
        } else {
            let mut position = vec![0u32; order.len()];
            for (new, &old) in order.iter().enumerate() {
                position[old as usize] = new as u32;
            }
            order
                .iter()
                .map(|&old| {
                    let raw = &mut raw_links[old as usize];
                    RequestLinks {
                        after: raw.after.as_ref().and_then(|a| {
                            ids.get(a)
                                .map(|&(earlier, _)| (position[earlier as usize], raw.gap_ns))
                        }),
                        output_hash_ids: std::mem::take(&mut raw.output_hash_ids),
                    }
                })
                .collect()
        };
        let mut slots: Vec<Option<WorkloadRequest>> = requests.into_iter().map(Some).collect();
        let requests = order
            .iter()
            .filter_map(|&old| slots[old as usize].take())
            .collect();
        Ok(Workload {
            block_size,
            requests,
            source: format!("trace {file}"),
            links,
        })
    }

    /// Write the workload as Mooncake-format JSONL (timestamps in milliseconds, rebased so the
    /// first request is at 0).
    pub fn write_jsonl(&self, mut out: impl Write) -> std::io::Result<()> {
        let origin = self.requests.first().map_or(0, |r| r.arrival_ns);
        let millis = |ns: u64| {
            if ns.is_multiple_of(1_000_000) {
                serde_json::json!(ns / 1_000_000)
            } else {
                serde_json::json!(ns as f64 / 1e6)
            }
        };
        let mut followed = vec![false; self.links.len()];
        for l in &self.links {
            if let Some(f) = l
                .after
                .and_then(|(earlier, _)| followed.get_mut(earlier as usize))
            {
                *f = true;
            }
        }
        for (i, r) in self.requests.iter().enumerate() {
            let mut line = serde_json::Map::new();
            line.insert("timestamp".into(), millis(r.arrival_ns - origin));
            line.insert("input_length".into(), r.input_length.into());
            line.insert("output_length".into(), r.output_length.into());
            line.insert("hash_ids".into(), serde_json::json!(r.hash_ids));
            if let Some(s) = &r.session_id {
                line.insert("session_id".into(), s.clone().into());
            }
            if let Some(l) = self.links.get(i) {
                // Ids are the requests' indices, written on the requests another one follows.
                if followed.get(i).copied().unwrap_or(false) {
                    line.insert("id".into(), i.into());
                }
                if let Some((earlier, gap)) = l.after {
                    line.insert("after".into(), earlier.into());
                    line.insert("gap_ms".into(), millis(gap));
                }
                if !l.output_hash_ids.is_empty() {
                    line.insert(
                        "output_hash_ids".into(),
                        serde_json::json!(l.output_hash_ids),
                    );
                }
            }
            serde_json::to_writer(&mut out, &serde_json::Value::Object(line))?;
            out.write_all(b"\n")?;
        }
        out.flush()
    }
}

pub(crate) fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 {
        0.0
    } else {
        a as f64 / b as f64
    }
}

/// [`MAX_TIMESTAMP_MS`] in nanoseconds, the latest arrival a workload may have.
const MAX_ARRIVAL_NS: f64 = MAX_TIMESTAMP_MS * 1e6;

/// A [`Workload::scale_time`] factor that cannot be applied. The message leaves the flag to the
/// caller: `--time-scale: {error}`.
#[derive(Debug, Clone, Copy, PartialEq, thiserror::Error)]
pub enum TimeScaleError {
    #[error("{} is not a finite number > 0", show(*.factor))]
    NotPositive { factor: f64 },
    #[error(
        "{} would move the latest arrival, {} ms, to {} ms, past the {:e} ms limit on \
         timestamps; the valid range for this workload is 0 < F <= {}",
        show(*.factor),
        show(*.latest_ms),
        show(.latest_ms * .factor),
        MAX_TIMESTAMP_MS,
        show(*.max_factor)
    )]
    Overflow {
        factor: f64,
        /// The latest arrival before scaling, milliseconds.
        latest_ms: f64,
        /// The largest factor that keeps it within [`MAX_TIMESTAMP_MS`].
        max_factor: f64,
    },
}

/// `x` in its shortest exact form; very large or very small magnitudes in exponent form (`1e300`,
/// not 301 digits).
fn show(x: f64) -> String {
    if x != 0.0 && x.is_finite() && !(1e-4..1e15).contains(&x.abs()) {
        format!("{x:e}")
    } else {
        format!("{x}")
    }
}

/// A trace that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceError {
    pub file: String,
    /// 1-based line, when the problem is on one line.
    pub line: Option<usize>,
    /// The offending field, when one is to blame.
    pub field: Option<String>,
    pub message: String,
}

impl fmt::Display for TraceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "trace {}: ", self.file)?;
        if let Some(line) = self.line {
            write!(f, "line {line}: ")?;
        }
        if let Some(field) = &self.field {
            write!(f, "field `{field}`: ")?;
        }
        f.write_str(&self.message)
    }
}

impl std::error::Error for TraceError {}

/// The fast path: the well-formed line (an object only: an array of the fields in order goes to
/// the slow path, which refuses it).
#[derive(Deserialize)]
#[serde(remote = "Self")]
struct Line {
    timestamp: f64,
    input_length: u64,
    output_length: u64,
    hash_ids: Vec<u64>,
    #[serde(default)]
    session_id: Option<serde_json::Value>,
    #[serde(default)]
    id: Option<serde_json::Value>,
    #[serde(default)]
    after: Option<serde_json::Value>,
    #[serde(default)]
    gap_ms: Option<f64>,
    #[serde(default)]
    output_hash_ids: Option<Vec<u64>>,
}

/// A line's closed-loop fields before `after` is resolved to a line.
#[derive(Debug, Default)]
struct RawLinks {
    id: Option<String>,
    after: Option<String>,
    gap_ns: u64,
    output_hash_ids: Vec<u64>,
}

impl RawLinks {
    fn is_empty(&self) -> bool {
        self.id.is_none() && self.after.is_none() && self.output_hash_ids.is_empty()
    }
}

router_config::input::objects_only!(Line);

type LineError = (Option<&'static str>, String);

fn parse_line(text: &str, block_size: u32) -> Result<(WorkloadRequest, RawLinks), LineError> {
    let line: Line = match serde_json::from_str(text) {
        Ok(line) => line,
        Err(e) => return Err(diagnose(text, &e)),
    };
    let name = |field: &'static str, value: Option<serde_json::Value>| match value {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(value) => name_value(field, &value).map(Some),
    };
    let session_id = name("session_id", line.session_id)?;
    let id = name("id", line.id)?;
    let after = name("after", line.after)?;
    let gap_ns =
        match line.gap_ms {
            None => 0,
            Some(_) if after.is_none() => return Err((
                Some("gap_ms"),
                "given without `after`: it is the gap after the end of the request `after` names"
                    .to_string(),
            )),
            Some(gap) if gap.is_finite() && (0.0..=MAX_TIMESTAMP_MS).contains(&gap) => {
                (gap * 1e6).round() as u64
            }
            Some(gap) => {
                return Err((
                    Some("gap_ms"),
                    format!("must be a number of milliseconds from 0 to 1e12, got {gap}"),
                ))
            }
        };
    if !(line.timestamp.is_finite() && (0.0..=MAX_TIMESTAMP_MS).contains(&line.timestamp)) {
        return Err((
            Some("timestamp"),
            format!(
                "must be a number of milliseconds from 0 to 1e12, got {}",
                line.timestamp
            ),
        ));
    }
    if line.output_length > MAX_OUTPUT_LENGTH {
        return Err((
            Some("output_length"),
            format!(
                "must be at most {MAX_OUTPUT_LENGTH}, got {}",
                line.output_length
            ),
        ));
    }
    if line.input_length == 0 {
        return Err((Some("input_length"), "must be at least 1".to_string()));
    }
    let expected = line.input_length.div_ceil(u64::from(block_size));
    if line.hash_ids.len() as u64 != expected {
        return Err((
            Some("hash_ids"),
            format!(
                "has {} entries, but input_length {} at {} tokens per block needs {expected} \
                 (set --trace-block-size to the trace's block size)",
                line.hash_ids.len(),
                line.input_length,
                block_size
            ),
        ));
    }
    let output_hash_ids = line.output_hash_ids.unwrap_or_default();
    // vLLM caches a block once its tokens are computed; the last generated token never is.
    let bs = u64::from(block_size);
    let computed = line.input_length + line.output_length.max(1) - 1;
    let most = computed / bs - line.input_length / bs;
    if output_hash_ids.len() as u64 > most {
        return Err((
            Some("output_hash_ids"),
            format!(
                "has {} entries, but input_length {} and output_length {} at {} tokens per \
                 block complete at most {most} blocks past the prompt's full blocks",
                output_hash_ids.len(),
                line.input_length,
                line.output_length,
                block_size
            ),
        ));
    }
    let request = WorkloadRequest {
        arrival_ns: (line.timestamp * 1e6).round() as u64,
        input_length: line.input_length,
        output_length: line.output_length,
        hash_ids: line.hash_ids,
        session_id,
    };
    let links = RawLinks {
        id,
        after,
        gap_ns,
        output_hash_ids,
    };
    Ok((request, links))
}

/// A `session_id`, `id` or `after`: a non-empty string, or a non-negative integer (its decimal
/// string).
fn name_value(field: &'static str, value: &serde_json::Value) -> Result<String, LineError> {
    match value {
        serde_json::Value::String(s) if !s.is_empty() => Ok(s.clone()),
        serde_json::Value::String(_) => Err((Some(field), "must not be empty".to_string())),
        serde_json::Value::Number(n) if n.is_u64() => Ok(n.to_string()),
        other => Err((
            Some(field),
            format!(
                "expected a string or a non-negative integer, got {}",
                describe(other)
            ),
        )),
    }
}

/// The fields of [`Line`], as `'static` names for [`LineError`].
const FIELDS: [&str; 9] = [
    "timestamp",
    "input_length",
    "output_length",
    "hash_ids",
    "session_id",
    "id",
    "after",
    "gap_ms",
    "output_hash_ids",
];

/// The slow path: say which field is wrong. `fast` is the fast path's error, for what a parsed
/// value no longer shows: a key given twice (the value keeps only the last).
fn diagnose(text: &str, fast: &serde_json::Error) -> LineError {
    let value: serde_json::Value = match serde_json::from_str(text) {
        Ok(v) => v,
        Err(e) => {
            return (
                None,
                format!(
                    "invalid JSON at column {}: {}",
                    e.column(),
                    strip_position(&e.to_string())
                ),
            )
        }
    };
    let Some(map) = value.as_object() else {
        return (
            None,
            format!("expected a JSON object, got {}", describe(&value)),
        );
    };
    let uint = |v: &serde_json::Value| v.as_u64().is_some();
    for (field, ok, expected) in [
        (
            "timestamp",
            &(|v: &serde_json::Value| v.is_number()) as &dyn Fn(&serde_json::Value) -> bool,
            "a number (milliseconds)",
        ),
        ("input_length", &uint, "a non-negative integer"),
        ("output_length", &uint, "a non-negative integer"),
    ] {
        match map.get(field) {
            None => return (Some(field), "missing".to_string()),
            Some(v) if !ok(v) => {
                return (
                    Some(field),
                    format!("expected {expected}, got {}", describe(v)),
                )
            }
            Some(_) => {}
        }
    }
    for field in ["hash_ids", "output_hash_ids"] {
        match map.get(field) {
            None if field == "hash_ids" => return (Some(field), "missing".to_string()),
            None | Some(serde_json::Value::Null) if field == "output_hash_ids" => {}
            Some(serde_json::Value::Array(ids)) => {
                if let Some((i, v)) = ids.iter().enumerate().find(|(_, v)| !uint(v)) {
                    return (
                        Some(field),
                        format!(
                            "entry {i}: expected a non-negative integer, got {}",
                            describe(v)
                        ),
                    );
                }
            }
            Some(v) => {
                return (
                    Some(field),
                    format!(
                        "expected an array of non-negative integers, got {}",
                        describe(v)
                    ),
                )
            }
            None => return (Some(field), "missing".to_string()),
        }
    }
    for field in ["session_id", "id", "after"] {
        if let Some(v) = map.get(field) {
            if !v.is_null() {
                if let Err(e) = name_value(field, v) {
                    return e;
                }
            }
        }
    }
    if let Some(v) = map.get("gap_ms") {
        if !v.is_number() && !v.is_null() {
            return (
                Some("gap_ms"),
                format!("expected a number (milliseconds), got {}", describe(v)),
            );
        }
    }
    let message = strip_position(&fast.to_string());
    if let Some(field) = message
        .strip_prefix("duplicate field `")
        .and_then(|rest| rest.strip_suffix('`'))
        .and_then(|name| FIELDS.into_iter().find(|f| *f == name))
    {
        return (
            Some(field),
            "given twice on the line (a key may appear only once)".to_string(),
        );
    }
    (None, format!("malformed line: {message}"))
}

fn describe(v: &serde_json::Value) -> String {
    let text = v.to_string();
    let shown = if text.len() > 40 {
        let mut end = 40;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        format!("{}...", &text[..end])
    } else {
        text
    };
    let kind = match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "the number",
        serde_json::Value::String(_) => "the string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    };
    if matches!(v, serde_json::Value::Null) {
        kind.to_string()
    } else {
        format!("{kind} {shown}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Workload, TraceError> {
        Workload::from_jsonl_reader(text.as_bytes(), "t.jsonl", 4)
    }

    #[test]
    fn reads_sorts_and_computes_the_ideal_bound() {
        let w = parse(
            "{\"timestamp\": 5, \"input_length\": 8, \"output_length\": 2, \"hash_ids\": [1, 2, 9], \"extra\": 1}\n\
             \n\
             {\"timestamp\": 0, \"input_length\": 8, \"output_length\": 2, \"hash_ids\": [1, 2], \"session_id\": 7}\n",
        );
        // 9 tokens needs 3 blocks of 4; 8 needs 2: the first line is wrong.
        let err = w.unwrap_err();
        assert_eq!(err.line, Some(1));
        assert_eq!(err.field.as_deref(), Some("hash_ids"));
        let w = parse(
            "{\"timestamp\": 5, \"input_length\": 9, \"output_length\": 2, \"hash_ids\": [1, 2, 9]}\n\
             {\"timestamp\": 0.5, \"input_length\": 8, \"output_length\": 2, \"hash_ids\": [1, 2], \"session_id\": 7}\n",
        )
        .unwrap();
        assert_eq!(w.requests[0].arrival_ns, 500_000);
        assert_eq!(w.requests[0].session_id.as_deref(), Some("7"));
        let s = w.stats();
        assert_eq!((s.prompt_blocks, s.reusable_blocks), (5, 2));
        assert!((s.ideal_hit_rate - 0.4).abs() < 1e-12);
    }

    #[test]
    fn every_malformed_line_names_line_and_field() {
        let good =
            "{\"timestamp\": 0, \"input_length\": 4, \"output_length\": 1, \"hash_ids\": [1]}";
        for (bad, field) in [
            ("{\"timestamp\": \"x\", \"input_length\": 4, \"output_length\": 1, \"hash_ids\": [1]}", Some("timestamp")),
            ("{\"timestamp\": -1, \"input_length\": 4, \"output_length\": 1, \"hash_ids\": [1]}", Some("timestamp")),
            ("{\"timestamp\": 0, \"output_length\": 1, \"hash_ids\": [1]}", Some("input_length")),
            ("{\"timestamp\": 0, \"input_length\": -4, \"output_length\": 1, \"hash_ids\": [1]}", Some("input_length")),
            ("{\"timestamp\": 0, \"input_length\": 0, \"output_length\": 1, \"hash_ids\": []}", Some("input_length")),
            ("{\"timestamp\": 0, \"input_length\": 4, \"output_length\": 1.5, \"hash_ids\": [1]}", Some("output_length")),
            ("{\"timestamp\": 0, \"input_length\": 4, \"output_length\": 1, \"hash_ids\": [\"a\"]}", Some("hash_ids")),
            ("{\"timestamp\": 0, \"input_length\": 4, \"output_length\": 1, \"hash_ids\": 3}", Some("hash_ids")),
            ("{\"timestamp\": 0, \"input_length\": 4, \"output_length\": 1}", Some("hash_ids")),
            ("{\"timestamp\": 0, \"input_length\": 4, \"output_length\": 1, \"hash_ids\": [1], \"session_id\": [1]}", Some("session_id")),
            ("{\"timestamp\": 0, \"input_length\": 4, \"output_length\": 1, \"hash_ids\": [1], \"session_id\": \"\"}", Some("session_id")),
            ("{\"timestamp\": 0, \"input_length\": 4,", None),
            ("[1, 2]", None),
            ("\u{1F600}", None),
        ] {
            let err = parse(&format!("{good}\n{good}\n{bad}\n")).unwrap_err();
            assert_eq!(err.line, Some(3), "{err}");
            assert_eq!(err.field.as_deref(), field, "{err}");
            let text = err.to_string();
            assert!(text.starts_with("trace t.jsonl: line 3: "), "{text}");
        }
    }

    #[test]
    fn a_duplicated_key_names_the_field_and_the_line() {
        // Issue: the parsed value keeps the last of two equal keys, so the slow path found
        // nothing wrong and said only "malformed line".
        let good =
            "{\"timestamp\": 0, \"input_length\": 4, \"output_length\": 1, \"hash_ids\": [1]}";
        for field in FIELDS {
            let value = match field {
                "hash_ids" | "output_hash_ids" => "[]",
                _ => "3",
            };
            let value = if field == "hash_ids" { "[2]" } else { value };
            let bad = format!("{}, \"{field}\": {value}}}", &good[..good.len() - 1]);
            // A field the good line lacks is given twice.
            let bad = if !good.contains(&format!("\"{field}\"")) {
                format!("{}, \"{field}\": {value}}}", &bad[..bad.len() - 1])
            } else {
                bad
            };
            let err = parse(&format!("{good}\n{bad}\n")).unwrap_err();
            assert_eq!(err.line, Some(2), "{err}");
            assert_eq!(err.field.as_deref(), Some(field), "{err}");
            assert_eq!(
                err.to_string(),
                format!(
                    "trace t.jsonl: line 2: field `{field}`: given twice on the line (a key may \
                     appear only once)"
                )
            );
        }
        // A duplicated field the reader ignores is fine, as any other field it ignores.
        let w = parse(&format!(
            "{}, \"extra\": 1, \"extra\": 2}}\n",
            &good[..good.len() - 1]
        ))
        .unwrap();
        assert_eq!(w.requests.len(), 1);
    }

    #[test]
    fn jsonl_round_trips() {
        let w = parse(
            "{\"timestamp\": 0, \"input_length\": 5, \"output_length\": 3, \"hash_ids\": [1, 2], \"session_id\": \"a\"}\n\
             {\"timestamp\": 1.25, \"input_length\": 4, \"output_length\": 0, \"hash_ids\": [1]}\n",
        )
        .unwrap();
        let mut out = Vec::new();
        w.write_jsonl(&mut out).unwrap();
        let again = Workload::from_jsonl_reader(out.as_slice(), "t.jsonl", 4).unwrap();
        assert_eq!(again.requests, w.requests);
    }

    #[test]
    fn a_line_over_the_cap_is_refused_without_reading_the_rest() {
        let good =
            "{\"timestamp\": 0, \"input_length\": 4, \"output_length\": 1, \"hash_ids\": [1]}";
        // Padded with spaces to exactly the cap: read, then judged as JSON (it is fine).
        let at_cap = format!("{good}{}", " ".repeat(MAX_TRACE_LINE_BYTES - good.len()));
        let w = parse(&format!("{good}\n{at_cap}\n{at_cap}")).unwrap();
        assert_eq!(w.requests.len(), 3);
        // One byte more, with or without a newline, and an endless line.
        for tail in ["\n", ""] {
            let err = parse(&format!("{good}\n{at_cap} {tail}{good}\n")).unwrap_err();
            assert_eq!((err.line, err.field.as_deref()), (Some(2), None), "{err}");
            assert!(err.message.contains("1048576 bytes"), "{err}");
        }
        let err =
            Workload::from_jsonl_reader(std::io::BufReader::new(std::io::repeat(b'x')), "z", 4)
                .unwrap_err();
        assert_eq!(err.line, Some(1), "{err}");
    }

    #[test]
    fn scale_time_refuses_factors_that_leave_the_timestamp_range() {
        let mut w = parse(
            "{\"timestamp\": 1000, \"input_length\": 4, \"output_length\": 1, \"hash_ids\": [1]}\n",
        )
        .unwrap();
        let before = w.clone();
        for bad in [f64::NAN, f64::INFINITY, 0.0, -1.0] {
            assert!(
                matches!(w.scale_time(bad), Err(TimeScaleError::NotPositive { .. })),
                "{bad}"
            );
        }
        let err = w.scale_time(1e300).unwrap_err();
        let TimeScaleError::Overflow { max_factor, .. } = err else {
            panic!("{err}");
        };
        assert_eq!(max_factor, 1e9);
        assert!(err.to_string().contains("0 < F <= 1000000000"), "{err}");
        assert_eq!(w, before, "a refused factor changes nothing");
        w.scale_time(max_factor).unwrap();
        assert_eq!(w.requests[0].arrival_ns, 1_000_000_000_000_000_000);
    }

    const A: &str = "\"input_length\": 6, \"output_length\": 7, \"hash_ids\": [1, 2]";

    #[test]
    fn closed_loop_links_resolve_across_the_sort_and_round_trip() {
        // File order: a (t 5), b after a (t 9), c (t 0): sorted c, a, b.
        let w = parse(&format!(
            "{{\"timestamp\": 5, {A}, \"id\": \"a\", \"output_hash_ids\": [10, 11]}}\n\
             {{\"timestamp\": 9, {A}, \"after\": \"a\", \"gap_ms\": 2.5}}\n\
             {{\"timestamp\": 0, {A}}}\n"
        ))
        .unwrap();
        assert_eq!(
            w.requests
                .iter()
                .map(|r| r.arrival_ns / 1_000_000)
                .collect::<Vec<_>>(),
            [0, 5, 9]
        );
        assert!(w.is_closed_loop());
        assert_eq!(w.links[1].output_hash_ids, [10, 11]);
        assert_eq!(w.links[2].after, Some((1, 2_500_000)));
        assert_eq!(w.links[0], RequestLinks::default());
        let mut out = Vec::new();
        w.write_jsonl(&mut out).unwrap();
        let again = Workload::from_jsonl_reader(out.as_slice(), "t.jsonl", 4).unwrap();
        assert_eq!((&again.requests, &again.links), (&w.requests, &w.links));
        let mut open = w.clone();
        open.open_loop();
        assert!(!open.is_closed_loop());
        assert_eq!(open.links[1].output_hash_ids, [10, 11]);
        // A plain trace has no links at all.
        let plain = parse(&format!("{{\"timestamp\": 0, {A}}}\n")).unwrap();
        assert!(plain.links.is_empty());
    }

    #[test]
    fn a_bad_link_names_its_line_and_field() {
        let first = format!("{{\"timestamp\": 5, {A}, \"id\": 1}}");
        for (bad, field, says) in [
            (
                format!("{{\"timestamp\": 6, {A}, \"after\": 2}}"),
                "after",
                "`2` is not the id of an earlier line",
            ),
            (
                format!("{{\"timestamp\": 6, {A}, \"id\": \"1\"}}"),
                "id",
                "`1` is already the id of line 1",
            ),
            (
                format!("{{\"timestamp\": 4, {A}, \"after\": 1}}"),
                "timestamp",
                "before the timestamp of line 1",
            ),
            (
                format!("{{\"timestamp\": 6, {A}, \"gap_ms\": 3}}"),
                "gap_ms",
                "given without `after`",
            ),
            (
                format!("{{\"timestamp\": 6, {A}, \"after\": 1, \"gap_ms\": -3}}"),
                "gap_ms",
                "from 0 to 1e12",
            ),
            (
                format!("{{\"timestamp\": 6, {A}, \"after\": 1, \"gap_ms\": \"3\"}}"),
                "gap_ms",
                "expected a number",
            ),
            (
                format!("{{\"timestamp\": 6, {A}, \"after\": [1]}}"),
                "after",
                "expected a string",
            ),
            // 6 + 7 - 1 = 12 tokens computed: blocks 2 and 3 past the prompt's 1 full block.
            (
                format!("{{\"timestamp\": 6, {A}, \"output_hash_ids\": [1, 2, 3]}}"),
                "output_hash_ids",
                "at most 2 blocks",
            ),
            (
                format!("{{\"timestamp\": 6, {A}, \"output_hash_ids\": [\"x\"]}}"),
                "output_hash_ids",
                "entry 0",
            ),
        ] {
            let err = parse(&format!("{first}\n{bad}\n")).unwrap_err();
            assert_eq!(
                (err.line, err.field.as_deref()),
                (Some(2), Some(field)),
                "{err}"
            );
            assert!(err.to_string().contains(says), "{err}");
        }
    }
}
