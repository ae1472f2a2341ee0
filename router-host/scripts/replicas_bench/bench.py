#!/usr/bin/env python3
"""The multi-replica benchmark: 1, 2 and 4 `router-host serve` replicas behind haproxy
(`mode tcp`, `balance roundrobin`) in front of 8 mock engines and one redis-server, a seeded
multi-turn workload with shared tenant prefixes sent through the balancer with a new TCP
connection per request, once with session bindings only shared between the replicas
(`share_load: false`) and once with bindings plus booked load (`share_load: true`). Everything
runs on 127.0.0.1.

Per run: the engines' prefix-cache hit rate (delta of their counters), requests per engine and
their CoV, the active-load CoV (every engine's `vllm:num_requests_running` sampled every 100 ms,
the CoV across engines per sample, averaged), client TTFT p50/p99, failures, and each
replica's `router_shared_load_*`. OUT/replicas.json and OUT/replicas.md hold the table and the
goal check; process logs go to LOGS.

run.sh (beside this file) installs haproxy and redis-server, builds the binaries and calls this;
README.md says what is measured and how.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "chaos"))
# Processes, ports, polling, Redis and the metrics parser are the chaos test's, imported.
from chaos import (  # noqa: E402
    ChaosError,
    deep_merge,
    Lines,
    Proc,
    Redis,
    free_port,
    http_get,
    is_openai_error,
    msum,
    parse_metrics,
    poll,
    read_body,
)

import yaml  # noqa: E402  (PyYAML: run.sh makes sure it is importable)

REPO = HERE.parents[2]
BASE_CONFIG = REPO / "examples" / "two-tier-soft-affinity.yaml"
MODEL = "bench"
BLOCK_SIZE = 16
MAX_TOKENS = 64
CLIENT_TIMEOUT_S = 30.0
ROUTER_TIMEOUTS = {"connect_ms": 1000, "response_ms": 20000, "stream_idle_ms": 10000, "queue_ms": 10000}
SAMPLE_S = 0.1
SHARED_LOAD_GAUGES = ["router_shared_load_up", "router_shared_load_replicas", "router_shared_load_view_age_seconds"]
SHARED_LOAD_COUNTERS = ["router_shared_load_errors_total", "router_shared_load_outages_total",
                        "router_shared_load_dropped_total", "router_shared_load_refused_total"]
MODES = {"bindings": False, "shared": True}  # mode -> share_load
GOAL_HIT = 0.01
GOAL_COV = 0.02


class BenchError(Exception):
    """The run cannot go on; the message names what failed."""


def log(msg: str) -> None:
    print(f"[replicas-bench {time.strftime('%H:%M:%S', time.gmtime())}] {msg}", file=sys.stderr, flush=True)


def cov(values: list[float]) -> float | None:
    """Population standard deviation over the mean; None when the mean is 0."""
    if not values:
        return None
    mean = statistics.fmean(values)
    return statistics.pstdev(values) / mean if mean > 0 else None


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, int(round(q * (len(s) - 1)))))]


def rnd(x, n=4):
    return None if x is None else round(x, n)


# -- the workload --------------------------------------------------------------------------------

WORDS = ("cache block engine router stream token prefix session worker latency batch prompt answer "
         "budget queue replica event relay shard metric health drain reload tenant invoice ledger "
         "shipment refund policy contract schedule sensor firmware gateway account").split()


def build_workload(seed: int, tenants: int, sessions: int, prefix_tokens: int, turns: tuple[int, int],
                   user_tokens: tuple[int, int], think_s: tuple[float, float]) -> dict:
    """Seeded sessions: each belongs to a tenant (Zipf-like popularity, so the popular tenants'
    prefixes pull load onto the engines that cache them), opens with its tenant's system prompt
    (`prefix_tokens` bytes, one token a byte with the mock's tokenizer) and sends `turns` user
    messages, each followed by a think time."""
    rng = random.Random(seed)
    prompts = []
    for t in range(tenants):
        text = f"Tenant {t} system prompt. "
        while len(text) < prefix_tokens:
            text += rng.choice(WORDS) + " "
        prompts.append(text[:prefix_tokens])
    weights = [1.0 / (t + 1) for t in range(tenants)]
    out = []
    for s in range(sessions):
        tenant = rng.choices(range(tenants), weights)[0]
        n = rng.randint(*turns)
        msgs = []
        for _ in range(n):
            want = rng.randint(*user_tokens)
            text = ""
            while len(text) < want:
                text += rng.choice(WORDS) + " "
            msgs.append(text.strip())
        out.append({"sid": f"s{s:04d}", "tenant": tenant, "turns": msgs,
                    "think_s": [round(rng.uniform(*think_s), 3) for _ in range(n)]})
    return {"system_prompts": prompts, "sessions": out}


class Outcomes:
    def __init__(self):
        self.lock = threading.Lock()
        self.ttft: list[float] = []
        self.latency: list[float] = []
        self.completed = 0
        self.failed: dict[str, int] = {}
        self.examples: list[dict] = []

    def fail(self, detail: str, example: dict) -> None:
        with self.lock:
            self.failed[detail] = self.failed.get(detail, 0) + 1
            if len(self.examples) < 5:
                self.examples.append({"detail": detail, **example})


def one_turn(port: int, sid: str, messages: list[dict], out: Outcomes) -> str | None:
    """One streamed chat turn over a new TCP connection; the answer's text, or None when the
    request failed (recorded in `out`)."""
    body = {"model": MODEL, "messages": messages, "max_tokens": MAX_TOKENS, "stream": True,
            "stream_options": {"include_usage": True}}
    started = time.monotonic()
    deadline = started + CLIENT_TIMEOUT_S
    ex = {"session": sid, "turn": sum(m["role"] == "user" for m in messages)}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=CLIENT_TIMEOUT_S)
    ttft = None
    pieces: list[str] = []
    done = False
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body),
                     {"content-type": "application/json", "x-session-id": sid})
        resp = conn.getresponse()
        if resp.status != 200:
            raw = read_body(resp)
            try:
                code = is_openai_error(json.loads(raw))
            except ValueError:
                code = None
            ex["body"] = raw[:400].decode("utf-8", "replace")
            out.fail(f"http_{resp.status}_{code or 'no_openai_error'}", ex)
            return None
        lines = Lines(resp)
        while True:
            if time.monotonic() > deadline:
                out.fail("client_timeout", ex)
                return None
            line = lines.next()
            if line is None:
                out.fail("body_too_large", ex)
                return None
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                done = True
                continue
            value = json.loads(data)
            if is_openai_error(value):
                ex["event"] = data[:400].decode("utf-8", "replace")
                out.fail("stream_error_event", ex)
                return None
            for choice in value.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    if ttft is None:
                        ttft = time.monotonic() - started
                    pieces.append(piece)
    except (OSError, http.client.HTTPException, ValueError, AttributeError) as e:
        ex["error"] = repr(e)[:300]
        out.fail(f"connection_or_parse_{type(e).__name__}", ex)
        return None
    finally:
        conn.close()
    if not done or len(pieces) != MAX_TOKENS or ttft is None:
        ex["tokens"] = len(pieces)
        out.fail("stream_incomplete", ex)
        return None
    with out.lock:
        out.completed += 1
        out.ttft.append(ttft)
        out.latency.append(time.monotonic() - started)
    return "".join(pieces)


def client(port: int, workload: dict, queue: list, qlock: threading.Lock, out: Outcomes) -> None:
    """A closed loop: take the next session, run its turns one after the other (each turn's
    prompt is the whole conversation so far), until no session is left."""
    while True:
        with qlock:
            if not queue:
                return
            s = queue.pop(0)
        messages = [{"role": "system", "content": workload["system_prompts"][s["tenant"]]}]
        for text, think in zip(s["turns"], s["think_s"]):
            messages.append({"role": "user", "content": text})
            answer = one_turn(port, s["sid"], messages, out)
            if answer is None:
                break  # the conversation cannot go on without its answer
            messages.append({"role": "assistant", "content": answer})
            time.sleep(think)  # the user's think time, part of the workload


# -- the processes -------------------------------------------------------------------------------


class Engine:
    def __init__(self, wid: int, binary: Path, kv_blocks: int, logs: Path):
        self.id = wid
        self.http_port = free_port()
        self.kv_port = free_port()
        self.replay_port = free_port()
        argv = [str(binary), "mock-engine", "--listen", f"127.0.0.1:{self.http_port}", "--model", MODEL,
                "--block-size", str(BLOCK_SIZE), "--kv-blocks", str(kv_blocks),
                "--kv-events", f"tcp://127.0.0.1:{self.kv_port}",
                "--replay-endpoint", f"tcp://127.0.0.1:{self.replay_port}"]
        self.proc = Proc(f"engine-{wid}", argv, logs / f"engine-{wid}.log")
        self.conn: http.client.HTTPConnection | None = None

    def start(self) -> None:
        self.proc.start()
        if not poll(lambda: self.proc.alive() and http_get(self.http_port, "/health", 1.0)[0] == 200, 20.0):
            raise BenchError(f"engine {self.id} did not answer /health on port {self.http_port}; its log:\n"
                             f"{self.proc.tail()}")

    def worker_yaml(self) -> dict:
        return {"id": self.id, "url": f"http://127.0.0.1:{self.http_port}",
                "kv_events": {"endpoint": f"tcp://127.0.0.1:{self.kv_port}",
                              "replay_endpoint": f"tcp://127.0.0.1:{self.replay_port}"}}

    def metrics(self) -> list:
        """One scrape over a kept-alive connection (the 100 ms sampler would otherwise open 80
        connections a second); a broken connection is opened again once."""
        for attempt in (0, 1):
            if self.conn is None:
                self.conn = http.client.HTTPConnection("127.0.0.1", self.http_port, timeout=5.0)
            try:
                self.conn.request("GET", "/metrics")
                r = self.conn.getresponse()
                body = r.read(4 << 20)
                if r.status != 200:
                    raise BenchError(f"engine {self.id}: /metrics answered {r.status}")
                return parse_metrics(body.decode("utf-8", "replace"))
            except (OSError, http.client.HTTPException):
                self.conn.close()
                self.conn = None
                if attempt:
                    raise
        return []

    def counters(self) -> dict:
        m = self.metrics()
        return {"hits": msum(m, "vllm:prefix_cache_hits_total"),
                "queries": msum(m, "vllm:prefix_cache_queries_total"),
                "requests": msum(m, "vllm:request_success_total"),
                "busy": msum(m, "vllm:num_requests_running") + msum(m, "vllm:num_requests_waiting")}

    def reset_cache(self) -> None:
        def reset():
            conn = http.client.HTTPConnection("127.0.0.1", self.http_port, timeout=5.0)
            try:
                conn.request("POST", "/reset_prefix_cache")
                r = conn.getresponse()
                r.read(65536)
                return r.status == 200
            finally:
                conn.close()

        if not poll(reset, 30.0, 0.2):
            raise BenchError(f"engine {self.id}: POST /reset_prefix_cache did not answer 200 within 30 s")


def redis_cmd(port: int, *args: str) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5.0) as s:
        s.sendall(b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a.encode()) for a in args))
        return s.recv(4096)


class Replica:
    def __init__(self, idx: int, binary: Path, config: Path, logs: Path, run: str):
        self.idx = idx
        self.port = free_port()
        self.proc = Proc(f"{run}-replica-{idx}", [str(binary), "serve", "--config", str(config), "--listen",
                                                  f"127.0.0.1:{self.port}"], logs / f"{run}-replica-{idx}.log")

    def metrics(self) -> list:
        status, body = http_get(self.port, "/metrics", 5.0)
        if status != 200:
            raise ValueError(f"/metrics answered {status}")
        return parse_metrics(body.decode("utf-8", "replace"))


def haproxy_config(port: int, replicas: list[Replica]) -> str:
    servers = "\n".join(f"  server r{r.idx} 127.0.0.1:{r.port} check inter 1s" for r in replicas)
    return f"""# Generated by router-host/scripts/replicas_bench/bench.py
global
  maxconn 4096
defaults
  mode tcp
  timeout connect 2s
  timeout client 60s
  timeout server 60s
frontend routers
  bind 127.0.0.1:{port}
  default_backend replicas
backend replicas
  balance roundrobin
  option httpchk
  http-check send meth GET uri /ready
{servers}
"""


def router_config(plugin: Path, engines: list[Engine], redis: Redis, key_prefix: str, share_load: bool,
                  load_publish_ms: int | None = None, overlay: dict | None = None) -> dict:
    cfg = yaml.safe_load(BASE_CONFIG.read_text())
    cfg["plugins"] = [{"path": str(plugin)}]
    cfg["session_affinity"]["store"] = {"kind": "redis", "url": redis.url, "key_prefix": key_prefix,
                                        "timeout_ms": 50, "share_load": share_load}
    if load_publish_ms is not None:
        cfg["session_affinity"]["store"]["load_publish_ms"] = load_publish_ms
    cfg["workers"] = [e.worker_yaml() for e in engines]
    cfg["serve"] = {"timeouts": dict(ROUTER_TIMEOUTS)}
    return deep_merge(cfg, overlay or {})


# -- one run -------------------------------------------------------------------------------------


def one_run(a, name: str, n: int, mode: str, engines: list[Engine], redis: Redis, workload: dict,
            out: Path, logs: Path) -> dict:
    log(f"run {name}: {n} replica(s), {mode}")
    redis_cmd(redis.port, "FLUSHALL")
    for e in engines:
        e.reset_cache()
    cfg = router_config(a.plugin, engines, redis, f"rb:{name}:", MODES[mode], a.load_publish_ms,
                        a.overlay)
    cfg_path = logs / f"{name}-router.yaml"
    cfg_path.write_text("# Generated by router-host/scripts/replicas_bench/bench.py from "
                        "examples/two-tier-soft-affinity.yaml\n" + yaml.safe_dump(cfg, sort_keys=False))
    replicas = [Replica(i + 1, a.router_host, cfg_path, logs, name) for i in range(n)]
    lb_port = free_port()
    lb_cfg = logs / f"{name}-haproxy.cfg"
    lb_cfg.write_text(haproxy_config(lb_port, replicas))
    lb = Proc(f"{name}-haproxy", [a.haproxy, "-db", "-f", str(lb_cfg)], logs / f"{name}-haproxy.log")
    try:
        for r in replicas:
            r.proc.start()
        for r in replicas:
            def ready(r=r):
                if not r.proc.alive():
                    raise BenchError(f"replica {r.idx} exited at start; its log:\n{r.proc.tail()}")
                return http_get(r.port, "/ready", 1.0)[0] == 200 and \
                    msum(r.metrics(), "router_kv_subscriber_connected") == len(engines)

            if not poll(ready, 40.0, 0.2):
                raise BenchError(f"replica {r.idx} not ready with every KV subscriber connected within 40 s; "
                                 f"its log:\n{r.proc.tail()}")
        lb.start()

        def lb_up():
            if not lb.alive():
                raise BenchError(f"haproxy exited at start; its log:\n{lb.tail()}")
            return http_get(lb_port, "/ready", 1.0)[0] == 200

        if not poll(lb_up, 20.0, 0.2):
            raise BenchError(f"haproxy did not pass /ready through within 20 s; its log:\n{lb.tail()}")

        before = [e.counters() for e in engines]
        before_replica = [msum(r.metrics(), "router_requests_total") for r in replicas]
        stop = threading.Event()
        active_cov: list[float] = []
        active_mean: list[float] = []
        queued_cov: list[float] = []  # running + waiting
        queued_mean: list[float] = []
        shared_seen = {r.idx: {"max_other_active": 0.0, "max_view_age_s": 0.0, "max_replicas": 0.0}
                       for r in replicas}
        sampler_errors: list[str] = []

        def sample_engines():
            while not stop.is_set():
                t = time.monotonic()
                try:
                    ms = [e.metrics() for e in engines]
                    running = [msum(m, "vllm:num_requests_running") for m in ms]
                    queued = [r + msum(m, "vllm:num_requests_waiting") for r, m in zip(running, ms)]
                except (OSError, http.client.HTTPException, BenchError) as e:
                    if len(sampler_errors) < 5:
                        sampler_errors.append(f"engine scrape: {e!r}")
                else:
                    c = cov(running)
                    if c is not None:
                        active_cov.append(c)
                        active_mean.append(statistics.fmean(running))
                    c = cov(queued)
                    if c is not None:
                        queued_cov.append(c)
                        queued_mean.append(statistics.fmean(queued))
                stop.wait(max(0.0, SAMPLE_S - (time.monotonic() - t)))

        def sample_replicas():
            while not stop.wait(1.0):
                for r in replicas:
                    try:
                        m = r.metrics()
                    except (OSError, ValueError, http.client.HTTPException) as e:
                        if len(sampler_errors) < 5:
                            sampler_errors.append(f"replica {r.idx} scrape: {e!r}")
                        continue
                    s = shared_seen[r.idx]
                    s["max_other_active"] = max(s["max_other_active"], msum(m, "router_shared_load_active_requests"))
                    s["max_view_age_s"] = max(s["max_view_age_s"], msum(m, "router_shared_load_view_age_seconds"))
                    s["max_replicas"] = max(s["max_replicas"], msum(m, "router_shared_load_replicas"))

        samplers = [threading.Thread(target=sample_engines, daemon=True),
                    threading.Thread(target=sample_replicas, daemon=True)]
        for t in samplers:
            t.start()
        outcomes = Outcomes()
        queue = list(workload["sessions"])
        qlock = threading.Lock()
        t0 = time.monotonic()
        clients = [threading.Thread(target=client, args=(lb_port, workload, queue, qlock, outcomes), daemon=True)
                   for _ in range(a.concurrency)]
        for t in clients:
            t.start()
        limit = t0 + a.run_timeout
        for t in clients:
            t.join(timeout=max(0.1, limit - time.monotonic()))
        load_s = time.monotonic() - t0
        stop.set()
        for t in samplers:
            t.join(timeout=10)
        hung = sum(t.is_alive() for t in clients)
        if hung:
            raise BenchError(f"{hung} clients still running after {a.run_timeout:.0f} s")
        if not poll(lambda: all(e.counters()["busy"] == 0 for e in engines), 30.0, 0.2):
            raise BenchError("the engines did not go idle within 30 s of the load's end")
        after = [e.counters() for e in engines]
        dead = [r.idx for r in replicas if not r.proc.alive()]
        if dead:
            raise BenchError(f"replicas {dead} died during the run")
        replica_end = [r.metrics() for r in replicas]
        reasons: dict = {}
        for m in replica_end:
            for metric, labels, value in m:
                if metric == "router_decisions_total":
                    key = labels.get("reason", "?")
                    reasons[key] = reasons.get(key, 0) + int(value)
        per_replica = []
        for r, m, b in zip(replicas, replica_end, before_replica):
            entry = {"replica": r.idx, "requests": msum(m, "router_requests_total") - b,
                     **shared_seen[r.idx]}
            for g in SHARED_LOAD_GAUGES + SHARED_LOAD_COUNTERS:
                entry[g.removeprefix("router_shared_load_")] = msum(m, g)
            per_replica.append(entry)
        exits = {r.idx: r.proc.stop(20) for r in replicas}
        bad_exits = {k: v for k, v in exits.items() if v != 0}
    finally:
        lb.stop(5)
        for r in replicas:
            r.proc.stop(5)

    hits = sum(x["hits"] - y["hits"] for x, y in zip(after, before))
    queries = sum(x["queries"] - y["queries"] for x, y in zip(after, before))
    per_engine = [x["requests"] - y["requests"] for x, y in zip(after, before)]
    failed = sum(outcomes.failed.values())
    result = {
        "name": name, "replicas": n, "mode": mode, "share_load": MODES[mode],
        "load_s": round(load_s, 1),
        "requests_completed": outcomes.completed, "requests_failed": failed,
        "failures": outcomes.failed, "failure_examples": outcomes.examples,
        "hit_rate": rnd(hits / queries if queries else None),
        "prompt_tokens": queries, "cached_tokens": hits,
        "requests_per_engine": per_engine, "requests_cov": rnd(cov(per_engine)),
        "active_cov": rnd(statistics.fmean(active_cov) if active_cov else None),
        "active_mean": rnd(statistics.fmean(active_mean) if active_mean else None, 2),
        "active_samples": len(active_cov),
        "queued_cov": rnd(statistics.fmean(queued_cov) if queued_cov else None),
        "queued_mean": rnd(statistics.fmean(queued_mean) if queued_mean else None, 2),
        "ttft_p50_ms": rnd(1000 * pct(outcomes.ttft, 0.50), 1) if outcomes.ttft else None,
        "ttft_p99_ms": rnd(1000 * pct(outcomes.ttft, 0.99), 1) if outcomes.ttft else None,
        "ttft_ms": [round(1000 * x, 2) for x in outcomes.ttft],
        "replica_stats": per_replica,
        "decision_reasons": dict(sorted(reasons.items(), key=lambda kv: -kv[1])),
        "replica_exit_codes": exits,
        "sampler_errors": sampler_errors,
    }
    if bad_exits:
        result["problems"] = [f"replicas exited {bad_exits} on SIGTERM (expected 0)"]
    log(f"run {name}: {outcomes.completed} ok, {failed} failed in {load_s:.1f} s; hit rate {result['hit_rate']}, "
        f"requests CoV {result['requests_cov']}, active CoV {result['active_cov']}, TTFT p50/p99 "
        f"{result['ttft_p50_ms']}/{result['ttft_p99_ms']} ms; decisions by reason {result['decision_reasons']}")
    return result


# -- the report ----------------------------------------------------------------------------------


def summarize(runs: list[dict], replicas: list[int]) -> list[dict]:
    rows = []
    for n in replicas:
        for mode in MODES:
            rs = [r for r in runs if r["replicas"] == n and r["mode"] == mode]
            if not rs:
                continue

            def mean(key):
                v = [r[key] for r in rs if r.get(key) is not None]
                return rnd(statistics.fmean(v)) if v else None

            def spread(key):
                v = [r[key] for r in rs if r.get(key) is not None]
                return [rnd(min(v)), rnd(max(v))] if v else None

            ttft = [x for r in rs for x in r["ttft_ms"]]
            rows.append({
                "replicas": n, "mode": mode, "runs": len(rs),
                "hit_rate": mean("hit_rate"), "hit_rate_range": spread("hit_rate"),
                "requests_cov": mean("requests_cov"), "requests_cov_range": spread("requests_cov"),
                "active_cov": mean("active_cov"), "active_cov_range": spread("active_cov"),
                "queued_cov": mean("queued_cov"),
                "ttft_p50_ms": rnd(pct(ttft, 0.5), 1), "ttft_p99_ms": rnd(pct(ttft, 0.99), 1),
                "requests": sum(r["requests_completed"] for r in rs),
                "failed": sum(r["requests_failed"] for r in rs),
            })
    return rows


def goal(rows: list[dict]) -> dict:
    def row(n, mode):
        return next((r for r in rows if r["replicas"] == n and r["mode"] == mode), None)

    out = {}
    for mode in MODES:
        one, four = row(1, mode), row(4, mode)
        if not one or not four or None in (one["hit_rate"], four["hit_rate"], one["active_cov"], four["active_cov"]):
            continue
        dh = four["hit_rate"] - one["hit_rate"]
        da = four["active_cov"] - one["active_cov"]
        dr = four["requests_cov"] - one["requests_cov"]
        out[mode] = {"hit_rate_delta": rnd(dh), "active_cov_delta": rnd(da), "requests_cov_delta": rnd(dr),
                     "hit_rate_ok": abs(dh) <= GOAL_HIT or dh > 0,
                     "active_cov_ok": da <= GOAL_COV, "requests_cov_ok": dr <= GOAL_COV}
        out[mode]["met"] = out[mode]["hit_rate_ok"] and out[mode]["active_cov_ok"] and out[mode]["requests_cov_ok"]
    return out


def fmt(x, n=3):
    return "n/a" if x is None else f"{x:.{n}f}"


def markdown(r: dict) -> str:
    s = r["setup"]
    lines = [
        "# Several replicas: bindings only versus bindings plus shared load",
        "",
        f"Generated by `router-host/scripts/replicas_bench/bench.py` ({r['started_utc']}, {r['elapsed_s']:.0f} s in all). "
        "Command:",
        "",
        f"```\n{r['command']}\n```",
        "",
        f"{s['engines']} mock engines (`--kv-blocks {s['kv_blocks']}`, {s['block_size']}-token blocks: "
        f"{s['engines'] * s['kv_blocks']} blocks in all), one redis-server, N `serve` replicas on the same YAML "
        f"(`examples/two-tier-soft-affinity.yaml` + `store: {{kind: redis}}`"
        + (f" + overlay `{json.dumps(s['overlay'])}`" if s.get("overlay") else "")
        + f"), behind {s['haproxy']} "
        "(`mode tcp`, `balance roundrobin`). "
        f"Workload (seed {s['seed']}): {s['sessions']} sessions of {s['turns'][0]}-{s['turns'][1]} streamed chat turns, "
        f"{s['tenants']} tenants with a {s['prefix_tokens']}-token system prompt each (Zipf-like popularity), "
        f"user turns of {s['user_tokens'][0]}-{s['user_tokens'][1]} tokens, {MAX_TOKENS} output tokens, "
        f"think time {s['think_s'][0]}-{s['think_s'][1]} s, {s['concurrency']} sessions at a time (closed loop), "
        f"a new TCP connection per request. {s['requests']} requests per run; {s['reps']} repetition(s) of every "
        "(N, mode), interleaved.",
        "",
        "| replicas | mode | runs | hit rate (range) | requests CoV (range) | active CoV (range) | running+waiting CoV | TTFT p50 ms | TTFT p99 ms | requests | failed |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in r["summary"]:
        hr, rc, ac = row["hit_rate_range"], row["requests_cov_range"], row["active_cov_range"]
        lines.append(
            f"| {row['replicas']} | {row['mode']} | {row['runs']} | {fmt(row['hit_rate'])} ({fmt(hr[0])}-{fmt(hr[1])}) "
            f"| {fmt(row['requests_cov'])} ({fmt(rc[0])}-{fmt(rc[1])}) | {fmt(row['active_cov'])} "
            f"({fmt(ac[0])}-{fmt(ac[1])}) | {fmt(row['queued_cov'])} | {fmt(row['ttft_p50_ms'], 0)} | {fmt(row['ttft_p99_ms'], 0)} "
            f"| {row['requests']} | {row['failed']} |")
    lines += ["", "## Goal: 4 replicas against 1 (hit rate within 0.01, CoV within 0.02)", ""]
    for mode, g in r["goal"].items():
        verdict = "met" if g["met"] else "not met"
        lines.append(f"- **{mode}**: hit rate {g['hit_rate_delta']:+.4f}, active CoV {g['active_cov_delta']:+.4f}, "
                     f"requests CoV {g['requests_cov_delta']:+.4f}: {verdict}")
    if not r["goal"]:
        lines.append("- not checked: the run had no 1-replica and 4-replica rows of the same mode")
    lines += ["", "## Runs (in the order they ran)", "",
              "| run | replicas | mode | s | ok | failed | hit rate | requests CoV | active CoV | mean running | running+waiting CoV (mean) | TTFT p50/p99 ms | requests per replica | others' load seen (max active) |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for x in r["runs"]:
        per_rep = " / ".join(f"{e['requests']:g}" for e in x["replica_stats"])
        seen = " / ".join(f"{e['max_other_active']:g}" for e in x["replica_stats"])
        lines.append(f"| {x['name']} | {x['replicas']} | {x['mode']} | {x['load_s']} | {x['requests_completed']} "
                     f"| {x['requests_failed']} | {fmt(x['hit_rate'])} | {fmt(x['requests_cov'])} | {fmt(x['active_cov'])} "
                     f"| {fmt(x['active_mean'], 2)} | {fmt(x['queued_cov'])} ({fmt(x['queued_mean'], 2)}) | {fmt(x['ttft_p50_ms'], 0)}/{fmt(x['ttft_p99_ms'], 0)} | {per_rep} | {seen} |")
    lines += ["", "Shared-load counters at each run's end (every replica): "
              + ", ".join(f"{k} {v:g}" for k, v in r["shared_load_counters"].items()), ""]
    if r["problems"]:
        lines += ["## Problems", ""] + [f"- {p}" for p in r["problems"]] + [""]
    lines += ["## Processes", ""]
    for name, argv in s["processes"].items():
        lines.append(f"- {name}: `{shlex.join(argv).replace(str(REPO) + '/', '')}`")
    return "\n".join(lines) + "\n"


# -- main ----------------------------------------------------------------------------------------


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--router-host", required=True, type=Path)
    p.add_argument("--plugin", required=True, type=Path, help="libtwo_tier_cost_fn.so")
    p.add_argument("--haproxy", default="haproxy")
    p.add_argument("--out", type=Path, required=True, help="replicas.json and replicas.md go here")
    p.add_argument("--logs", type=Path, required=True, help="process logs and generated configs go here")
    p.add_argument("--replicas", default="1,2,4", help="replica counts, comma-separated")
    p.add_argument("--reps", type=int, default=2, help="repetitions of every (replicas, mode)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--engines", type=int, default=8)
    p.add_argument("--kv-blocks", type=int, default=320, help="KV blocks per engine")
    p.add_argument("--tenants", type=int, default=8)
    p.add_argument("--prefix-tokens", type=int, default=768, help="each tenant's system prompt, tokens")
    p.add_argument("--sessions", type=int, default=160)
    p.add_argument("--concurrency", type=int, default=32, help="sessions at a time")
    p.add_argument("--modes", default="bindings,shared", help="of bindings, shared; comma-separated")
    p.add_argument("--load-publish-ms", type=int, help="store.load_publish_ms (default: serve's own)")
    p.add_argument("--config-overlay", type=Path,
                   help="YAML merged into every replica's config after the generated keys")
    p.add_argument("--run-timeout", type=float, default=240.0, help="most one run's load may take, s")
    p.add_argument("--command", default="", help="the command line to record in the report")
    a = p.parse_args()
    try:
        replica_counts = [int(x) for x in a.replicas.split(",")]
    except ValueError:
        sys.exit(f"--replicas: comma-separated whole numbers, got `{a.replicas}`")
    modes = [m for m in a.modes.split(",") if m]
    if not modes or any(m not in MODES for m in modes):
        sys.exit(f"--modes: comma-separated of {', '.join(MODES)}, got `{a.modes}`")
    if not replica_counts or any(not 1 <= n <= 16 for n in replica_counts):
        sys.exit(f"--replicas: each from 1 to 16, got `{a.replicas}`")
    for flag, v, lo in (("--reps", a.reps, 1), ("--engines", a.engines, 2), ("--kv-blocks", a.kv_blocks, 64),
                        ("--tenants", a.tenants, 1), ("--sessions", a.sessions, 1), ("--concurrency", a.concurrency, 1)):
        if v < lo:
            sys.exit(f"{flag}: at least {lo}, got {v}")
    a.overlay = {}
    if a.config_overlay is not None:
        try:
            a.overlay = yaml.safe_load(a.config_overlay.read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            sys.exit(f"--config-overlay {a.config_overlay}: {e}")
        if not isinstance(a.overlay, dict):
            sys.exit(f"--config-overlay {a.config_overlay}: a YAML mapping, got {type(a.overlay).__name__}")
    a.router_host = a.router_host.resolve()
    a.plugin = a.plugin.resolve()
    out = a.out.resolve()
    logs = a.logs.resolve()
    out.mkdir(parents=True, exist_ok=True)
    logs.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    started_utc = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())

    turns, user_tokens, think_s = (3, 5), (80, 240), (0.05, 0.3)
    workload = build_workload(a.seed, a.tenants, a.sessions, a.prefix_tokens, turns, user_tokens, think_s)
    n_requests = sum(len(s["turns"]) for s in workload["sessions"])
    try:
        haproxy_version = subprocess.run([a.haproxy, "-v"], capture_output=True, text=True, timeout=10
                                         ).stdout.splitlines()[0]
    except (OSError, IndexError, subprocess.SubprocessError) as e:
        sys.exit(f"haproxy ({a.haproxy}) cannot run: {e}")
    haproxy_version = " ".join(haproxy_version.split()[:3])

    # Interleaved: every repetition runs every (N, mode) once, in an order rotated per repetition,
    # so that the machine's slow spells fall on all of them alike.
    plan = [(n, m) for n in replica_counts for m in modes]
    order = []
    for rep in range(a.reps):
        k = rep % len(plan)
        order += [(rep + 1, n, m) for n, m in plan[k:] + plan[:k]]

    engines: list[Engine] = []
    redis = None
    runs: list[dict] = []
    problems: list[str] = []
    setup = {}
    try:
        engines = [Engine(i + 1, a.router_host, a.kv_blocks, logs) for i in range(a.engines)]
        for e in engines:
            e.start()
        redis = Redis(logs)
        try:
            redis.start()
        except ChaosError as e:
            raise BenchError(str(e)) from e
        setup = {"seed": a.seed, "engines": a.engines, "kv_blocks": a.kv_blocks, "block_size": BLOCK_SIZE,
                 "tenants": a.tenants, "prefix_tokens": a.prefix_tokens, "sessions": a.sessions,
                 "turns": list(turns), "user_tokens": list(user_tokens), "think_s": list(think_s),
                 "concurrency": a.concurrency, "requests": n_requests, "reps": a.reps,
                 "replica_counts": replica_counts, "haproxy": haproxy_version, "max_tokens": MAX_TOKENS,
                 "router_timeouts_ms": ROUTER_TIMEOUTS, "sample_interval_s": SAMPLE_S,
                 "load_publish_ms": a.load_publish_ms if a.load_publish_ms is not None else "serve's default",
                 "config": router_config(a.plugin, engines, redis, "rb:RUN:", True, a.load_publish_ms, a.overlay),
                 "overlay": a.overlay,
                 "processes": {"redis": redis.proc.argv, **{f"engine-{e.id}": e.proc.argv for e in engines},
                               "replica": [str(a.router_host), "serve", "--config", "RUN-router.yaml", "--listen",
                                           "127.0.0.1:PORT"],
                               "haproxy": [a.haproxy, "-db", "-f", "RUN-haproxy.cfg"]}}
        log(f"{a.engines} engines, redis on {redis.port}; {len(order)} runs of {n_requests} requests each")
        for rep, n, mode in order:
            name = f"r{rep}-n{n}-{mode}"
            try:
                runs.append(one_run(a, name, n, mode, engines, redis, workload, out, logs))
            except (BenchError, ChaosError, OSError, http.client.HTTPException, ValueError) as e:
                problems.append(f"run {name}: {e}")
                log(f"run {name} FAILED: {e}")
    except BenchError as e:
        problems.append(str(e))
    except KeyboardInterrupt:
        problems.append("interrupted")
    finally:
        for e in engines:
            e.proc.stop(5)
        if redis:
            redis.proc.stop(5)

    for r in runs:
        problems += r.get("problems", [])
        if r["requests_failed"]:
            problems.append(f"run {r['name']}: {r['requests_failed']} requests failed: {r['failures']}")
    counters = {}
    for r in runs:
        for e in r["replica_stats"]:
            for c in SHARED_LOAD_COUNTERS:
                k = c.removeprefix("router_shared_load_")
                counters[k] = counters.get(k, 0) + e[k]
    summary = summarize(runs, replica_counts)
    report = {"started_utc": started_utc, "elapsed_s": round(time.monotonic() - started, 1), "command": a.command,
              "setup": setup, "summary": summary, "goal": goal(summary), "shared_load_counters": counters,
              "problems": problems, "runs": runs}
    # The report names files inside the repository relative to it (the plugin, the binary).
    (out / "replicas.json").write_text(json.dumps(report, indent=1).replace(str(REPO) + "/", "") + "\n")
    if setup:
        (out / "replicas.md").write_text(markdown(report))
    log(f"report: {out / 'replicas.md'}")
    for p_ in problems:
        log(f"PROBLEM: {p_}")
    return 0 if not problems and runs else 1


def _interrupt(_signum, _frame):
    raise KeyboardInterrupt


if __name__ == "__main__":
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupt)
    sys.exit(main())
