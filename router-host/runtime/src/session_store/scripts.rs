//! The Lua scripts that keep a binding's rules atomic inside Redis (docs/replicas.md, "Keys").
//!
//! One hash per session, `PREFIX s:SESSION`: `w` the bound worker id, `r` its rank (absent = any
//! rank), `v` the binding version (from the shared counter `PREFIX version`, so a binding removed
//! and re-created never reuses a version an old lease holds), and one `l:REPLICA` field per
//! replica with requests of the session in flight, holding that lease's deadline in the server's
//! milliseconds. The key's own TTL is the idle TTL: `ttl` after the last live lease ended, and
//! never less than `lease + ttl` while one is live. A key that is not such a hash (another
//! program's) is reported and never written.
//!
//! Every script answers a list of strings whose first element says what happened.

use redis::Script;

/// Shared helpers, prepended to every script.
const PRELUDE: &str = r#"
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function digits(s)
  return s and string.match(s, '^%d+$') ~= nil
end
-- nil when KEYS[1] is absent or one of ours, else why not.
local function foreign(key)
  local t = redis.call('TYPE', key)['ok']
  if t == 'none' then return nil, false end
  if t ~= 'hash' then return 'it holds a ' .. t .. ', not a hash', true end
  local f = redis.call('HMGET', key, 'w', 'r', 'v')
  if not digits(f[3]) then return 'a hash without a numeric version field `v`', true end
  if f[1] and not digits(f[1]) then return 'worker field `w` is not a number', true end
  if f[2] and not digits(f[2]) then return 'rank field `r` is not a number', true end
  return nil, true
end
-- Live leases of the session; dead ones (their replica stopped renewing) are removed.
local function live_leases(key, now)
  local all = redis.call('HGETALL', key)
  local live = 0
  for i = 1, #all, 2 do
    local field = all[i]
    if string.sub(field, 1, 2) == 'l:' then
      local deadline = tonumber(all[i + 1])
      if deadline and deadline >= now then
        live = live + 1
      else
        redis.call('HDEL', key, field)
      end
    end
  end
  return live
end
-- This replica holds a lease on the session until now + lease_ms; the key lives at least
-- lease_ms + ttl_ms more.
local function hold(key, field, now, lease_ms, ttl_ms)
  redis.call('HSET', key, field, tostring(now + lease_ms))
  local want = lease_ms + ttl_ms
  if redis.call('PTTL', key) < want then redis.call('PEXPIRE', key, want) end
end
"#;

/// KEYS: session. ARGV: lease field (empty: read only), lease ms, ttl ms. Answers `none`,
/// `unbound VERSION`, `bound VERSION WORKER RANK` (RANK empty for any rank) or `foreign REASON`.
/// A bound session is held for the replica at once (the lease `dispatched` would take), so a
/// request that stays on its binding needs no second round trip.
const LOOKUP: &str = r#"
local key = KEYS[1]
local why, exists = foreign(key)
if why then return {'foreign', why} end
if not exists then return {'none'} end
local f = redis.call('HMGET', key, 'w', 'r', 'v')
if not f[1] then return {'unbound', f[3]} end
if ARGV[1] ~= '' then
  hold(key, ARGV[1], now_ms(), tonumber(ARGV[2]), tonumber(ARGV[3]))
end
return {'bound', f[3], f[1], f[2] or ''}
"#;

/// KEYS: session, version counter. ARGV: lease version, worker, rank, `1` when a new binding
/// keeps the rank, `soft`/`hard`, lease field, lease ms, ttl ms. Answers `created`, `kept`,
/// `stale`, `moved OLD_WORKER OLD_RANK`, `violated OLD_WORKER OLD_RANK` or `foreign REASON`.
const DISPATCH: &str = r#"
local key = KEYS[1]
local why, exists = foreign(key)
if why then return {'foreign', why} end
local now = now_ms()
local lease_ms = tonumber(ARGV[7])
local ttl_ms = tonumber(ARGV[8])
if exists then
  local f = redis.call('HMGET', key, 'w', 'r', 'v')
  if f[1] then
    if f[1] == ARGV[2] and ((not f[2]) or f[2] == ARGV[3]) then
      hold(key, ARGV[6], now, lease_ms, ttl_ms)
      return {'kept'}
    end
    if f[3] ~= ARGV[1] then
      hold(key, ARGV[6], now, lease_ms, ttl_ms)
      return {'stale'}
    end
    local version = tostring(redis.call('INCR', KEYS[2]))
    if ARGV[5] == 'soft' then
      redis.call('HSET', key, 'w', ARGV[2], 'v', version)
      if f[2] then redis.call('HSET', key, 'r', ARGV[3]) end
      hold(key, ARGV[6], now, lease_ms, ttl_ms)
      return {'moved', f[1], f[2] or ''}
    end
    redis.call('HDEL', key, 'w', 'r')
    redis.call('HSET', key, 'v', version)
    if live_leases(key, now) == 0 then redis.call('DEL', key) end
    return {'violated', f[1], f[2] or ''}
  end
end
local version = tostring(redis.call('INCR', KEYS[2]))
redis.call('HSET', key, 'w', ARGV[2], 'v', version)
if ARGV[4] == '1' then redis.call('HSET', key, 'r', ARGV[3]) end
hold(key, ARGV[6], now, lease_ms, ttl_ms)
return {'created'}
"#;

/// KEYS: session. ARGV: lease field, ttl ms. This replica's last request of the session ended:
/// drop its lease; with no live lease left the idle TTL starts (or the binding-less entry goes).
const COMPLETE: &str = r#"
local key = KEYS[1]
local why, exists = foreign(key)
if why or not exists then return {'skipped'} end
redis.call('HDEL', key, ARGV[1])
if live_leases(key, now_ms()) == 0 then
  if redis.call('HEXISTS', key, 'w') == 1 then
    redis.call('PEXPIRE', key, tonumber(ARGV[2]))
  else
    redis.call('DEL', key)
  end
end
return {'done'}
"#;

/// KEYS: session. ARGV: lease field, lease ms, ttl ms. The heartbeat: this replica still has
/// requests of the session in flight. Never creates a key.
const RENEW: &str = r#"
local key = KEYS[1]
local why, exists = foreign(key)
if why or not exists then return {'skipped'} end
hold(key, ARGV[1], now_ms(), tonumber(ARGV[2]), tonumber(ARGV[3]))
return {'renewed'}
"#;

/// KEYS: session, version counter. Removes the binding (requests in flight keep their leases).
/// Answers `removed`, `none` or `foreign REASON`.
const INVALIDATE: &str = r#"
local key = KEYS[1]
local why, exists = foreign(key)
if why then return {'foreign', why} end
if not exists or redis.call('HEXISTS', key, 'w') == 0 then return {'none'} end
redis.call('HDEL', key, 'w', 'r')
redis.call('HSET', key, 'v', tostring(redis.call('INCR', KEYS[2])))
if live_leases(key, now_ms()) == 0 then redis.call('DEL', key) end
return {'removed'}
"#;

/// The compiled scripts (each knows its SHA1 for `EVALSHA`).
pub(super) struct Scripts {
    pub lookup: Script,
    pub dispatch: Script,
    pub complete: Script,
    pub renew: Script,
    pub invalidate: Script,
}

impl Scripts {
    pub fn new() -> Scripts {
        let with_prelude = |body: &str| Script::new(&format!("{PRELUDE}{body}"));
        Scripts {
            lookup: with_prelude(LOOKUP),
            dispatch: with_prelude(DISPATCH),
            complete: with_prelude(COMPLETE),
            renew: with_prelude(RENEW),
            invalidate: with_prelude(INVALIDATE),
        }
    }
}
