//! Shared load: replicas behind one store share the load each booked per row, so every
//! replica's policies see the cluster's booked load (docs/replicas.md, "Shared load").
//!
//! Every `load_publish_ms`, off the request path, one round trip (one Lua script) writes this
//! replica's booked totals per row into its own hash, `{PREFIXload}:N`, with a TTL of
//! [`TTL_PERIODS`] periods (its heartbeat), refreshes its entry in the registry `{PREFIXload}:replicas`
//! (a sorted set scored by each entry's deadline), and reads the hashes of the replicas whose
//! deadline has not passed. The core adds their sum to its own bookings per row
//! ([`RoutingCore::set_shared_load`]).
//!
//! Under `booking.decode: deduplicated` a replica's `decode_blocks` counts each prompt block its
//! requests on a row hold once; summing replicas would count a system prompt once per replica
//! although the engine holds one copy. So each replica also publishes how many distinct block
//! ids it holds on the row and a sketch of them ([`Sketch`]); the others' held blocks are
//! counted as the sketches' union less this replica's own ([`View::load`]).
//!
//! The braces are a Redis Cluster hash tag: every key of the shared load lies in one slot, so
//! the script may read the other replicas' hashes on a cluster too.
//!
//! Bounded: at most [`MAX_REPLICAS`] other replicas are read; a hash with more fields than
//! [`fields_cap`] or more bytes than [`bytes_cap`] is refused inside the script (never sent);
//! a field that does not parse is refused, one of a row this configuration does not have is
//! skipped. Refusals are counted (`router_shared_load_refused_total`) and logged at most once
//! a [`REFUSAL_LOG_EVERY`].
//!
//! A failed round keeps the others' last view until it is older than the TTL (a blip must not
//! halve the view), then drops it: this replica routes on its own bookings plus the engines'
//! observed load until the store answers again. Logged once per outage, counted.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use redis::{Client, Connection, Script};

use router_config::RedisStoreConfig;
use router_core::log_limit::LogThrottle;
use router_core::model::{RowId, RowLoad};
use router_core::routing::RoutingCore;

use super::redis_store::describe;
use super::sketch::Sketch;

/// The TTL of a replica's published load, in publish periods: a replica that stopped
/// publishing (killed, cut off) is gone from every other's view this long after its last
/// round. Five periods let four rounds in a row fail (a slow store, a pause) before a live
/// replica's load is missed.
pub const TTL_PERIODS: u32 = 5;
/// The TTL is never shorter than this (a short period must not turn a store pause into an
/// outage of the view).
pub const MIN_TTL: Duration = Duration::from_secs(1);
/// Most other replicas read per round.
pub const MAX_REPLICAS: usize = 256;
/// A round may take this long at least, whatever `timeout_ms` (it carries every row).
const MIN_ROUND_TIMEOUT: Duration = Duration::from_millis(250);
/// Least time between two lines about refused shared-load data.
pub const REFUSAL_LOG_EVERY: Duration = Duration::from_secs(10);
/// Arguments per `HSET` inside the script (Lua's `unpack` has a stack limit).
const HSET_ARGS: usize = 200;

/// Most fields accepted in another replica's hash: a replica of a configuration with more
/// workers than this one (a rollout adding engines) still fits.
pub fn fields_cap(rows: usize) -> usize {
    rows.saturating_mul(4).saturating_add(64)
}

/// Most bytes (fields and values) accepted in another replica's hash: a field `W:R` and its
/// value `A P D H SKETCH` take at most 20 + 1 + 10 and 4 * 20 + 4 + 1,024 bytes.
pub fn bytes_cap(rows: usize) -> usize {
    fields_cap(rows).saturating_mul(1_160)
}

/// Publish this replica's load, refresh its registry entry, read the others'. Answers a list of
/// lists: first `{'ok', N}` (N registry entries read, this one included), then one per other
/// replica: `{id, 'load', field, value, ...}`, `{id, 'idle'}` (no hash: nothing booked),
/// `{id, 'oversize'}`, `{id, 'foreign'}`; or only `{'foreign', key, type}` when one of this
/// replica's two keys holds something else (then nothing was written).
const EXCHANGE: &str = r#"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[2])
for _, key in ipairs({KEYS[1], KEYS[2]}) do
  local kind = redis.call('TYPE', key)['ok']
  local want = (key == KEYS[1]) and 'hash' or 'zset'
  if kind ~= want and kind ~= 'none' then
    return {{'foreign', key, kind}}
  end
end
redis.call('DEL', KEYS[1])
local n = #ARGV
local i = 7
local batch = HSET_ARGS
while i <= n do
  local j = math.min(i + batch - 1, n)
  redis.call('HSET', KEYS[1], unpack(ARGV, i, j))
  i = j + 1
end
if n >= 7 then redis.call('PEXPIRE', KEYS[1], ttl) end
redis.call('ZADD', KEYS[2], now + ttl, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', '(' .. now)
redis.call('PEXPIRE', KEYS[2], ttl)
local ids = redis.call('ZRANGEBYSCORE', KEYS[2], now, '+inf', 'LIMIT', 0, tonumber(ARGV[4]) + 1)
local out = {{'ok', tostring(#ids)}}
local max_fields = tonumber(ARGV[5])
local max_bytes = tonumber(ARGV[6])
for _, id in ipairs(ids) do
  if id ~= ARGV[1] then
    local key = ARGV[3] .. id
    local kind = redis.call('TYPE', key)['ok']
    if kind == 'none' then
      table.insert(out, {id, 'idle'})
    elseif kind ~= 'hash' then
      table.insert(out, {id, 'foreign'})
    elseif redis.call('HLEN', key) > max_fields then
      table.insert(out, {id, 'oversize'})
    else
      local flat = redis.call('HGETALL', key)
      local bytes = 0
      for _, v in ipairs(flat) do bytes = bytes + #v end
      if bytes > max_bytes then
        table.insert(out, {id, 'oversize'})
      else
        local entry = {id, 'load'}
        for _, v in ipairs(flat) do table.insert(entry, v) end
        table.insert(out, entry)
      end
    end
  end
end
return out
"#;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Why a round did not give a view.
#[derive(Debug, thiserror::Error)]
pub enum SharedLoadError {
    /// The store did not answer (refused, timed out, authentication, ...).
    #[error("{0}")]
    Unreachable(String),
    /// One of this replica's keys holds something else: nothing was written.
    #[error("key `{key}` holds a {kind}, not the shared load's; left untouched")]
    Foreign { key: String, kind: String },
    /// The script's answer is not what it answers.
    #[error("unexpected answer from the store: {0}")]
    Answer(String),
}

/// One row of what this replica publishes: its booked load and, under `booking.decode:
/// deduplicated`, the distinct prompt block ids its requests hold there
/// ([`RoutingCore::held_blocks_of`]), counted (at most `decode_blocks`) and sketched.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Booked {
    pub load: RowLoad,
    pub held: Option<(u64, Sketch)>,
}

impl From<RowLoad> for Booked {
    fn from(load: RowLoad) -> Self {
        Booked { load, held: None }
    }
}

/// The other replicas' load as one round read it.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct View {
    /// Other replicas alive in the registry (their deadline has not passed).
    pub replicas: usize,
    /// Their booked load summed per row (rows this configuration has; saturating), with
    /// `decode_blocks` less the held block ids each published a sketch of.
    pub rows: HashMap<RowId, RowLoad>,
    /// Per row, those held block ids: their sum, and the union of their sketches.
    pub held: HashMap<RowId, (u64, Sketch)>,
    /// Hashes and fields refused in this round (foreign, oversize, unparsable).
    pub refused: u64,
}

impl View {
    /// The other replicas' load on `row` for a replica whose own requests hold the block ids
    /// `own` sketches there: their sums, plus the held blocks of theirs that this replica does
    /// not hold too (estimated from the sketches; at least 0, at most their sum).
    pub fn load(&self, row: RowId, own: Option<&Sketch>) -> Option<RowLoad> {
        let mut load = *self.rows.get(&row)?;
        if let Some((sum, theirs)) = self.held.get(&row) {
            let extra = match own {
                Some(own) => {
                    let mut union = theirs.clone();
                    union.merge(own);
                    union.estimate() - own.estimate()
                }
                None => theirs.estimate(),
            };
            // Saturating float-to-int cast: NaN and negatives become 0.
            let extra = (extra.round() as u64).min(*sum);
            load.decode_blocks = load.decode_blocks.saturating_add(extra);
        }
        Some(load)
    }
}

/// The counters and gauges of the shared load, for metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct SharedLoadStats {
    /// The last round reached the store.
    pub up: bool,
    /// Other replicas in the view applied now (0 once it was dropped).
    pub replicas: u64,
    /// Seconds since the view applied now was read (since start while none was).
    pub view_age_secs: f64,
    /// Outages begun (a round failed after one that did not).
    pub outages: u64,
    /// Views dropped because the store stayed unreachable past the TTL.
    pub dropped: u64,
    /// Hashes and fields refused.
    pub refused: u64,
    /// Rounds that failed.
    pub errors: u64,
}

#[derive(Debug)]
struct State {
    /// When the view applied now was read.
    last_ok: Option<Instant>,
    /// When the current outage began.
    outage_since: Option<Instant>,
    /// Whether the others' load is applied now (false after a drop, before the first view).
    applied: bool,
    replicas: u64,
}

/// One replica's side of the shared load (see the module docs); one per store, so one per
/// loaded configuration.
pub struct SharedLoad {
    client: Client,
    url: String,
    replica: u64,
    /// `{PREFIXload}:N`, this replica's hash.
    own_key: String,
    /// `{PREFIXload}:replicas`.
    registry_key: String,
    /// `{PREFIXload}:`, the other hashes' names without their number.
    key_base: String,
    period: Duration,
    ttl: Duration,
    timeout: Duration,
    script: Script,
    con: Mutex<Option<Connection>>,
    state: Mutex<State>,
    started: Instant,
    up: AtomicBool,
    outages: AtomicU64,
    dropped: AtomicU64,
    refused: AtomicU64,
    errors: AtomicU64,
    refusal_log: LogThrottle,
}

impl std::fmt::Debug for SharedLoad {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedLoad")
            .field("url", &self.url)
            .field("own_key", &self.own_key)
            .field("period", &self.period)
            .field("ttl", &self.ttl)
            .finish_non_exhaustive()
    }
}

/// The names of the shared load's keys under `prefix`: (`{PREFIXload}:`, the registry).
pub fn key_names(prefix: &str) -> (String, String) {
    let base = format!("{{{prefix}load}}:");
    let registry = format!("{base}replicas");
    (base, registry)
}

/// The TTL of a replica's published load for a publish period.
pub fn ttl_for(period: Duration) -> Duration {
    (period * TTL_PERIODS).max(MIN_TTL)
}

impl SharedLoad {
    /// This replica's side, publishing as replica `replica` (the store's number: a new one per
    /// start and per reload). Connects lazily, in the first round.
    pub fn new(config: &RedisStoreConfig, client: Client, url: String, replica: u64) -> SharedLoad {
        let (key_base, registry_key) = key_names(&config.key_prefix);
        SharedLoad {
            client,
            url,
            replica,
            own_key: format!("{key_base}{replica}"),
            registry_key,
            key_base,
            period: config.load_publish,
            ttl: ttl_for(config.load_publish),
            timeout: config.timeout.max(MIN_ROUND_TIMEOUT),
            script: Script::new(&EXCHANGE.replace("HSET_ARGS", &HSET_ARGS.to_string())),
            con: Mutex::new(None),
            state: Mutex::new(State {
                last_ok: None,
                outage_since: None,
                applied: false,
                replicas: 0,
            }),
            started: Instant::now(),
            up: AtomicBool::new(true),
            outages: AtomicU64::new(0),
            dropped: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            errors: AtomicU64::new(0),
            refusal_log: LogThrottle::new(),
        }
    }

    /// How often a round runs.
    pub fn period(&self) -> Duration {
        self.period
    }

    /// How long a published load lives without a new round.
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// This replica's hash.
    pub fn own_key(&self) -> &str {
        &self.own_key
    }

    pub fn stats(&self) -> SharedLoadStats {
        let state = lock(&self.state);
        let since = state.last_ok.unwrap_or(self.started);
        SharedLoadStats {
            up: self.up.load(Ordering::Relaxed),
            replicas: if state.applied { state.replicas } else { 0 },
            view_age_secs: since.elapsed().as_secs_f64(),
            outages: self.outages.load(Ordering::Relaxed),
            dropped: self.dropped.load(Ordering::Relaxed),
            refused: self.refused.load(Ordering::Relaxed),
            errors: self.errors.load(Ordering::Relaxed),
        }
    }

    /// One round on `core`: publish its booked load, read the others', apply them (or, when
    /// the store does not answer, keep the last view until it is older than the TTL, then
    /// drop it). Blocking, bounded by the round's timeout: run it off the async workers.
    pub fn round(&self, core: &RoutingCore) {
        let topology = core.topology();
        let mut ids = Vec::new();
        let mine: Vec<(RowId, Booked)> = topology
            .rows()
            .map(|(row, _)| (row, core.booked(row)))
            .filter(|(_, load)| {
                load.active_requests != 0
                    || load.active_prefill_tokens != 0
                    || load.decode_blocks != 0
            })
            .map(|(row, load)| {
                if load.decode_blocks != 0 {
                    core.held_blocks_of(row, &mut ids);
                }
                let held = (load.decode_blocks != 0 && !ids.is_empty())
                    .then(|| ((ids.len() as u64).min(load.decode_blocks), Sketch::of(&ids)));
                (row, Booked { load, held })
            })
            .collect();
        let rows = topology.rows().count();
        let known = |row: RowId| topology.slot(row).is_some();
        match self.exchange(&mine, rows, &known) {
            Ok(view) => {
                let own: HashMap<RowId, &Sketch> = mine
                    .iter()
                    .filter_map(|(row, b)| b.held.as_ref().map(|(_, sketch)| (*row, sketch)))
                    .collect();
                core.set_shared_load(|row| view.load(row, own.get(&row).copied()));
                self.succeeded(&view);
            }
            Err(err) => {
                self.errors.fetch_add(1, Ordering::Relaxed);
                if matches!(err, SharedLoadError::Unreachable(_)) {
                    *lock(&self.con) = None;
                }
                if self.failed(&err) {
                    core.set_shared_load(|_| None);
                }
            }
        }
    }

    /// One exchange with the store: `mine` published, the others' load per row of those
    /// `known` read. Blocking, bounded by the round's timeout.
    ///
    /// # Errors
    /// [`SharedLoadError`]: the store unreachable, one of this replica's keys foreign, an
    /// answer out of shape.
    pub fn exchange(
        &self,
        mine: &[(RowId, Booked)],
        rows: usize,
        known: &dyn Fn(RowId) -> bool,
    ) -> Result<View, SharedLoadError> {
        let unreachable = |err: redis::RedisError| SharedLoadError::Unreachable(describe(&err));
        let mut con = lock(&self.con);
        if con.is_none() {
            let c = self
                .client
                .get_connection_with_timeout(self.timeout)
                .map_err(unreachable)?;
            c.set_read_timeout(Some(self.timeout))
                .and_then(|()| c.set_write_timeout(Some(self.timeout)))
                .map_err(unreachable)?;
            *con = Some(c);
        }
        let Some(c) = con.as_mut() else {
            return Err(SharedLoadError::Unreachable("no connection".to_owned()));
        };
        let mut invocation = self.script.prepare_invoke();
        invocation
            .key(&self.own_key)
            .key(&self.registry_key)
            .arg(self.replica)
            .arg(u64::try_from(self.ttl.as_millis()).unwrap_or(u64::MAX))
            .arg(&self.key_base)
            .arg(MAX_REPLICAS)
            .arg(fields_cap(rows))
            .arg(bytes_cap(rows));
        for (row, Booked { load, held }) in mine {
            let (a, p, d) = (
                load.active_requests,
                load.active_prefill_tokens,
                load.decode_blocks,
            );
            invocation
                .arg(format!("{}:{}", row.worker_id, row.dp_rank))
                .arg(match held {
                    None => format!("{a} {p} {d}"),
                    Some((count, sketch)) => format!("{a} {p} {d} {count} {}", sketch.encode()),
                });
        }
        let answer: Vec<Vec<String>> = invocation.invoke(c).map_err(|err| {
            if super::connection::is_outage(&err) {
                unreachable(err)
            } else {
                SharedLoadError::Answer(describe(&err))
            }
        })?;
        drop(con);
        self.parse(answer, known)
    }

    fn parse(
        &self,
        answer: Vec<Vec<String>>,
        known: &dyn Fn(RowId) -> bool,
    ) -> Result<View, SharedLoadError> {
        let mut entries = answer.into_iter();
        let head = entries.next().unwrap_or_default();
        let read = match head.iter().map(String::as_str).collect::<Vec<_>>()[..] {
            ["ok", n] => n.parse::<usize>().unwrap_or(0),
            ["foreign", key, kind] => {
                return Err(SharedLoadError::Foreign {
                    key: key.to_owned(),
                    kind: kind.to_owned(),
                })
            }
            _ => return Err(SharedLoadError::Answer(format!("{head:?}"))),
        };
        if read > MAX_REPLICAS {
            self.refuse(
                1,
                &format!(
                    "more than {MAX_REPLICAS} replicas publish their load under `{}`; the \
                     others are not read",
                    self.registry_key
                ),
            );
        }
        let mut view = View::default();
        for entry in entries {
            let mut parts = entry.into_iter();
            let (Some(id), Some(what)) = (parts.next(), parts.next()) else {
                continue;
            };
            if id.parse::<u64>().is_err() {
                view.refused += 1;
                self.refuse(
                    1,
                    &format!(
                        "registry `{}` holds `{}`, not a replica number",
                        self.registry_key,
                        excerpt(&id)
                    ),
                );
                continue;
            }
            view.replicas += 1;
            match what.as_str() {
                "idle" => {}
                "load" => {
                    let fields: Vec<String> = parts.collect();
                    let mut bad = 0;
                    for pair in fields.chunks(2) {
                        match pair {
                            [field, value] => match parse_row(field, value) {
                                Some((row, Booked { load, held })) if known(row) => {
                                    let mut held_count = 0;
                                    if let Some((count, sketch)) = held {
                                        held_count = count;
                                        let (sum, union) = view.held.entry(row).or_default();
                                        *sum = sum.saturating_add(count);
                                        union.merge(&sketch);
                                    }
                                    let sum = view.rows.entry(row).or_default();
                                    sum.active_requests =
                                        sum.active_requests.saturating_add(load.active_requests);
                                    sum.active_prefill_tokens = sum
                                        .active_prefill_tokens
                                        .saturating_add(load.active_prefill_tokens);
                                    sum.decode_blocks = sum
                                        .decode_blocks
                                        .saturating_add(load.decode_blocks - held_count);
                                }
                                // A row this configuration does not have: not ours to count.
                                Some(_) => {}
                                None => bad += 1,
                            },
                            _ => bad += 1,
                        }
                    }
                    if bad > 0 {
                        view.refused += bad;
                        self.refuse(
                            bad,
                            &format!(
                                "`{}{id}` has {bad} fields that are not `WORKER:RANK` = \
                                 `REQUESTS PREFILL_TOKENS DECODE_BLOCKS`; they were skipped",
                                self.key_base
                            ),
                        );
                    }
                }
                "oversize" => {
                    view.refused += 1;
                    self.refuse(
                        1,
                        &format!(
                            "`{}{id}` is larger than a replica's load can be (fields or bytes \
                             over the bound); not read",
                            self.key_base
                        ),
                    );
                }
                _ => {
                    view.refused += 1;
                    self.refuse(
                        1,
                        &format!(
                            "`{}{id}` is not a hash; not read, left untouched",
                            self.key_base
                        ),
                    );
                }
            }
        }
        Ok(view)
    }

    /// Counted, and logged at most once a [`REFUSAL_LOG_EVERY`].
    fn refuse(&self, n: u64, what: &str) {
        self.refused.fetch_add(n, Ordering::Relaxed);
        if let Some(left_out) = self.refusal_log.admit_now(REFUSAL_LOG_EVERY) {
            tracing::warn!(
                store = %self.url,
                left_out,
                "shared load: {what} (counted in router_shared_load_refused_total)"
            );
        }
    }

    fn succeeded(&self, view: &View) {
        self.up.store(true, Ordering::Relaxed);
        let mut state = lock(&self.state);
        state.last_ok = Some(Instant::now());
        state.applied = true;
        state.replicas = view.replicas as u64;
        if let Some(since) = state.outage_since.take() {
            tracing::warn!(
                store = %self.url,
                replicas = view.replicas,
                "shared load: store reachable again after {:.1} s; the other replicas' booked \
                 load is read again",
                since.elapsed().as_secs_f64()
            );
        }
    }

    /// A round failed: begin an outage unless one is under way (logged once); returns whether
    /// the view must be dropped now (older than the TTL, and still applied).
    fn failed(&self, err: &SharedLoadError) -> bool {
        self.up.store(false, Ordering::Relaxed);
        let mut state = lock(&self.state);
        if state.outage_since.is_none() {
            state.outage_since = Some(Instant::now());
            self.outages.fetch_add(1, Ordering::Relaxed);
            tracing::error!(
                store = %self.url,
                "shared load: the store failed ({err}); the other replicas' last booked load \
                 is kept for {} ms, then this replica routes on its own bookings and the \
                 engines' observed load until the store answers again",
                self.ttl.as_millis()
            );
        }
        let expired = state.last_ok.is_none_or(|at| at.elapsed() >= self.ttl);
        if expired && state.applied {
            state.applied = false;
            state.replicas = 0;
            self.dropped.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(
                store = %self.url,
                "shared load: no answer from the store for {} ms (the TTL); the other \
                 replicas' booked load is dropped",
                self.ttl.as_millis()
            );
            return true;
        }
        false
    }
}

/// `W:R` = `A P D`, or `A P D H SKETCH`, as a row, its load and the block ids it holds there
/// (`H` distinct ids, at most `D`, and their [`Sketch`]); `None` when either does not parse.
fn parse_row(field: &str, value: &str) -> Option<(RowId, Booked)> {
    let (worker, rank) = field.split_once(':')?;
    let row = RowId {
        worker_id: worker.parse().ok()?,
        dp_rank: rank.parse().ok()?,
    };
    let mut parts = value.split(' ');
    let mut number = || parts.next().and_then(|n| n.parse::<u64>().ok());
    let (Some(a), Some(p), Some(d)) = (number(), number(), number()) else {
        return None;
    };
    let held = match (parts.next(), parts.next(), parts.next()) {
        (None, None, None) => None,
        (Some(count), Some(sketch), None) => {
            let count = count.parse::<u64>().ok().filter(|&h| h <= d)?;
            Some((count, Sketch::decode(sketch)?))
        }
        _ => return None,
    };
    Some((
        row,
        Booked {
            load: RowLoad {
                available: true,
                active_requests: a,
                active_prefill_tokens: p,
                decode_blocks: d,
            },
            held,
        },
    ))
}

/// At most 40 characters of a value read from the store, for a log line.
fn excerpt(s: &str) -> String {
    let cut: String = s.chars().take(40).collect();
    if cut.len() < s.len() {
        format!("{}...", cut.escape_debug())
    } else {
        cut.escape_debug().to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_parse_only_in_their_one_form() {
        let (row, Booked { load, held }) = parse_row("12:3", "4 500 6").unwrap();
        assert_eq!((row.worker_id, row.dp_rank), (12, 3));
        assert_eq!(held, None, "three numbers: no held ids");
        let sketch = Sketch::of(&[1, 2, 3, 4, 5]);
        let (_, with) = parse_row("12:3", &format!("4 500 6 5 {}", sketch.encode())).unwrap();
        assert_eq!(with.held, Some((5, sketch.clone())));
        for value in [
            format!("4 500 6 7 {}", sketch.encode()),
            format!("4 500 6 5 {} 1", sketch.encode()),
            "4 500 6 5 xyz".to_owned(),
            "4 500 6 5".to_owned(),
        ] {
            assert!(parse_row("1:0", &value).is_none(), "{value}");
        }
        assert_eq!(
            (
                load.active_requests,
                load.active_prefill_tokens,
                load.decode_blocks
            ),
            (4, 500, 6)
        );
        for (field, value) in [
            ("12", "1 2 3"),
            ("12:x", "1 2 3"),
            ("1:0", "1 2"),
            ("1:0", "1 2 3 4"),
            ("1:0", "1 2 3 "),
            ("1:0", "-1 2 3"),
            ("1:0", "1  2 3"),
            ("1:99999999999", "1 2 3"),
            ("1:0", "99999999999999999999999 2 3"),
        ] {
            assert!(parse_row(field, value).is_none(), "{field} = {value}");
        }
    }

    #[test]
    fn held_blocks_count_once_across_replicas_and_the_rest_adds_up() {
        let r = RowId {
            worker_id: 1,
            dp_rank: 0,
        };
        let load = |d| RowLoad {
            available: true,
            active_requests: 1,
            active_prefill_tokens: 0,
            decode_blocks: d,
        };
        // A system prompt of 48 blocks, and per request 20 blocks of its own.
        let prompt: Vec<u64> = (1_000..1_048).collect();
        let own =
            |base: u64| -> Vec<u64> { prompt.iter().copied().chain(base..base + 20).collect() };
        // Two others hold the prompt and their own blocks (68 each), plus 2 blocks without ids.
        let (a, b) = (own(5_000), own(6_000));
        let mut union = Sketch::of(&a);
        union.merge(&Sketch::of(&b));
        let view = View {
            replicas: 2,
            rows: HashMap::from([(r, load(2))]),
            held: HashMap::from([(r, (136, union))]),
            refused: 0,
        };
        let others = |mine: Option<&Sketch>| view.load(r, mine).unwrap().decode_blocks;
        // This replica holds the prompt too: the others add their own 40 and the 2 without ids.
        let mine = Sketch::of(&own(7_000));
        assert!(
            (40..=44).contains(&others(Some(&mine))),
            "{}",
            others(Some(&mine))
        );
        // It holds nothing there: the prompt counts once, 88 + 2.
        assert!((86..=94).contains(&others(None)), "{}", others(None));
        // Never more than their sum, never less than what has no ids.
        let all: Vec<u64> = a.iter().chain(&b).copied().collect();
        assert_eq!(others(Some(&Sketch::of(&all))), 2);
        let other = RowId {
            worker_id: 2,
            dp_rank: 0,
        };
        assert_eq!(view.load(other, None), None, "nothing booked there");
    }

    #[test]
    fn keys_share_one_hash_tag_and_the_ttl_is_a_few_periods() {
        let (base, registry) = key_names("router:");
        assert_eq!(base, "{router:load}:");
        assert_eq!(registry, "{router:load}:replicas");
        let (base, _) = key_names("");
        assert_eq!(base, "{load}:", "never an empty tag");
        assert_eq!(ttl_for(Duration::from_millis(200)), Duration::from_secs(1));
        assert_eq!(ttl_for(Duration::from_millis(20)), MIN_TTL);
        assert_eq!(ttl_for(Duration::from_secs(2)), Duration::from_secs(10));
    }
}
