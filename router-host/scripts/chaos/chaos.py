#!/usr/bin/env python3
"""The chaos test: `router-host serve` in front of mock engines under steady load while engines
are killed and restarted, KV-event connections are cut, the Redis session store is restarted
and the configuration is reloaded, at random (seeded), one event at a time, on 127.0.0.1 only.

Every request ends as exactly one of:

- completed: 200 and a whole answer (a JSON body, or a stream ending with `data: [DONE]`) with
  as many tokens as asked for;
- failed_clear: an HTTP error with an OpenAI-style JSON error body, or a stream carrying an
  `error` event before it closed;
- lost: anything else (no answer within the client timeout, a stream or body cut without an
  error event, a malformed body, a wrong token count, a refused connection).

At the end: the router's in-flight and booked gauges must come back to 0, its resident memory
must not have grown past the bound, it must still be running, and no request may be lost.
OUT/chaos.json and OUT/chaos.md say what happened; the process logs are under OUT/logs/.

run.sh (beside this file) builds the binary and calls this; README.md says what is checked.
"""

from __future__ import annotations

import argparse
import collections
import http.client
import json
import os
import random
import re
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import yaml  # PyYAML: run.sh makes sure it is importable (system or its own venv)

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
sys.path.insert(0, str(HERE.parent / "lib"))
import ports  # noqa: E402  (scripts/lib: ports no two children share)
BASE_CONFIG = REPO / "examples" / "two-tier-soft-affinity.yaml"
# `--over-capacity`: the overlay that makes the router shed (merged before `--config-overlay`),
# the engines' batch limit, the clients' default number and the classes they name (share of the
# requests each; `default` is sent without the header, as a client that names no class).
OVER_CAPACITY_OVERLAY = HERE / "over-capacity.yaml"
OVER_CAPACITY_MAX_NUM_SEQS = 2
OVER_CAPACITY_CONCURRENCY = 24
OVER_CAPACITY_CLASSES = [("interactive", 0.3), ("default", 0.4), ("batch", 0.3)]
# Three times the clients and up to twice the threads (each with its allocator arena): serve's
# RSS swings by tens of MiB within a run and gives it back (a 10-minute run peaked 182 MiB and
# ended at 131), so the leak bound is wider than the 64 MiB of the normal load.
OVER_CAPACITY_RSS_GROWTH_MIB = 128.0
# What the router answers when it turns a request away (docs/admission.md, docs/serve.md): each
# carries `x-router-rejected-reason`, equal to the body's `error.code`; a 429 also `retry-after`.
REFUSAL_STATUSES = (429, 503)
# The reasons admission turns a request away with (a 429; docs/admission.md).
ADMISSION_REASONS = ("queue_full", "shed_for_higher_priority", "queue_timeout")
RETRY_AFTER_MAX_S = 5.0  # the longest a client honours a 429's `retry-after`
MODEL = "chaos"
BLOCK_SIZE = 16

# The router's own bounds in the generated config, so that every request it accepts is answered
# (or failed) well within the client timeout below.
ROUTER_TIMEOUTS = {"connect_ms": 1000, "response_ms": 10000, "stream_idle_ms": 5000, "queue_ms": 5000}
CLIENT_TIMEOUT_S = 30.0
MAX_BODY_BYTES = 4 << 20  # a whole answer here is a few KiB; more is malformed
EXAMPLES_PER_CASE = 5

# The gauges that must read 0 once the load has stopped (docs/serve.md, "Metrics").
ZERO_GAUGES = [
    "router_inflight_requests",
    "router_booked_active_requests",
    "router_booked_prefill_tokens",
    "router_booked_decode_blocks",
    "router_core_in_flight",
    "router_queue_depth",
    "router_config_reloads_loading",
]
# Counters reported as they stand at the end.
REPORTED_COUNTERS = [
    "router_requests_total",
    "router_retries_total",
    "router_stream_error_events_total",
    "router_upstream_errors_total",
    "router_session_store_outages_total",
    "router_session_store_degraded_requests_total",
    "router_session_store_errors_total",
    "router_session_bindings_total",
    "router_config_reloads_total",
    "router_kv_row_clears_total",
    "router_kv_event_gaps_total",
    "router_kv_event_replays_total",
    "router_kv_protocol_errors_total",
    "router_tokenize_fallbacks_total",
    "router_client_connections_shed_total",
    "router_local_resource_errors_total",
    "router_queue_total",
    "router_admission_rejected_total",
]
MIGRATIONS = "router_migrations_total"
# Counters of the configuration serving now, which start again from 0 at every reload: the
# report adds up what each configuration had counted just before it was replaced.
PER_CONFIG_COUNTERS = [
    "router_session_store_outages_total",
    "router_session_store_degraded_requests_total",
    "router_session_store_errors_total",
]


def now_s(t0: float) -> float:
    return round(time.monotonic() - t0, 3)


class Log:
    def __init__(self, t0: float):
        self.t0 = t0
        self.lock = threading.Lock()

    def __call__(self, msg: str) -> None:
        with self.lock:
            print(f"[chaos {time.strftime('%H:%M:%S', time.gmtime())} +{time.monotonic() - self.t0:7.1f}s] {msg}",
                  file=sys.stderr, flush=True)


LOG = Log(time.monotonic())


class ChaosError(Exception):
    """The run cannot go on (a process would not start, the router died)."""


# -- ports and processes -----------------------------------------------------------------------


def free_port() -> int:
    return free_port_run(1)


def free_port_run(n: int) -> int:
    """A port P with P .. P+n-1 free on 127.0.0.1 (an engine's ranks bind PORT + r); see
    `scripts/lib/ports.py` for why not the kernel's pick."""
    try:
        return ports.free_port_run(n)
    except OSError as e:
        raise ChaosError(str(e)) from e


def http_get(port: int, path: str, timeout: float = 5.0) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        return r.status, r.read(16 << 20)
    finally:
        conn.close()


def poll(predicate, timeout: float, interval: float = 0.1):
    """Poll `predicate` until it returns a truthy value or `timeout` passes; returns the last
    value (falsy on a timeout). OSError and ValueError count as "not yet"."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = predicate()
        except (OSError, ValueError, http.client.HTTPException):
            value = None
        if value or time.monotonic() >= deadline:
            return value
        time.sleep(interval)


class Proc:
    """A child process in its own process group, its output appended to a log file."""

    def __init__(self, name: str, argv: list[str], log_path: Path):
        self.name = name
        self.argv = argv
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self) -> None:
        f = open(self.log_path, "ab")
        f.write(f"\n==== {time.strftime('%H:%M:%S')} start: {shlex.join(self.argv)}\n".encode())
        f.flush()
        try:
            self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        except OSError as e:
            raise ChaosError(f"cannot start {self.name} ({self.argv[0]}): {e}") from e
        finally:
            f.close()
        self.starts += 1

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill9(self) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM, then SIGKILL after `timeout`; the exit status (None if it was not running)."""
        if self.proc is None:
            return None
        if self.proc.poll() is not None:
            return self.proc.returncode
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill9()
            return self.proc.returncode

    def tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


# -- the KV-event relay --------------------------------------------------------------------------


class Relay:
    """A TCP relay between the router's KV-event subscriber and one engine rank's ZMQ PUB socket,
    so that the connection can be cut without touching the engine. Bounded: one 64 KiB buffer per
    direction and connection; at most a handful of connections (one subscriber per row)."""

    def __init__(self, listen_port: int, upstream_port: int):
        self.listen_port = listen_port
        self.upstream_port = upstream_port
        self.lock = threading.Lock()
        self.conns: set[socket.socket] = set()
        self.refuse_until = 0.0
        self.cuts = 0
        self.closed = False
        self.server = socket.socket()
        self.server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.server.bind(("127.0.0.1", listen_port))
        self.server.listen(16)
        threading.Thread(target=self._accept, daemon=True, name=f"relay-{listen_port}").start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                down, _ = self.server.accept()
            except OSError:
                return
            if time.monotonic() < self.refuse_until or len(self.conns) >= 8:
                down.close()
                continue
            try:
                up = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=1.0)
                up.settimeout(None)
            except OSError:
                down.close()  # the engine is down: so is its relayed socket
                continue
            with self.lock:
                self.conns.update((down, up))
            for a, b in ((down, up), (up, down)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            self._close(src, dst)

    def _close(self, *socks: socket.socket) -> None:
        with self.lock:
            for s in socks:
                self.conns.discard(s)
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def cut(self, refuse_s: float) -> int:
        """Close every relayed connection now and refuse new ones for `refuse_s` seconds;
        returns how many connections were cut."""
        with self.lock:
            conns = list(self.conns)
            self.refuse_until = time.monotonic() + refuse_s
        self._close(*conns)
        self.cuts += 1
        return len(conns) // 2

    def close(self) -> None:
        self.closed = True
        try:
            self.server.close()
        except OSError:
            pass
        with self.lock:
            conns = list(self.conns)
        self._close(*conns)


# -- the processes under test -------------------------------------------------------------------


class Engine:
    def __init__(self, wid: int, binary: Path, dp_size: int, logs: Path, max_num_seqs: int | None = None):
        self.id = wid
        self.dp_size = dp_size
        self.http_port = free_port()
        self.kv_port = free_port_run(dp_size)
        self.replay_port = free_port_run(dp_size)
        self.relays = [Relay(p, self.kv_port + r) for r, p in enumerate(self._relay_ports(dp_size))]
        argv = [str(binary), "mock-engine", "--listen", f"127.0.0.1:{self.http_port}", "--model", MODEL,
                "--block-size", str(BLOCK_SIZE), "--dp-size", str(dp_size),
                "--kv-events", f"tcp://127.0.0.1:{self.kv_port}",
                "--replay-endpoint", f"tcp://127.0.0.1:{self.replay_port}"]
        if max_num_seqs is not None:
            argv += ["--max-num-seqs", str(max_num_seqs)]
        self.proc = Proc(f"engine-{wid}", argv, logs / f"engine-{wid}.log")
        self.dead_since: float | None = None

    @staticmethod
    def _relay_ports(n: int) -> list[int]:
        base = free_port_run(n)
        return [base + r for r in range(n)]

    @property
    def relay_port(self) -> int:
        return self.relays[0].listen_port

    def start(self, timeout: float = 20.0) -> None:
        # A port that lingers after a kill: try again, a bounded number of times.
        for attempt in range(5):
            self.proc.start()
            if poll(lambda: self.proc.alive() and http_get(self.http_port, "/health", 1.0)[0] == 200,
                    timeout / 5 if attempt < 4 else timeout):
                self.dead_since = None
                return
            self.proc.kill9()
            time.sleep(0.5)
        raise ChaosError(f"engine {self.id} did not answer /health on port {self.http_port}; its log:\n"
                         f"{self.proc.tail()}")

    def kill9(self) -> None:
        self.proc.kill9()
        self.dead_since = time.monotonic()

    def worker_yaml(self, draining: bool) -> dict:
        w = {"id": self.id, "url": f"http://127.0.0.1:{self.http_port}", "dp_size": self.dp_size,
             "kv_events": {"endpoint": f"tcp://127.0.0.1:{self.relay_port}",
                           "replay_endpoint": f"tcp://127.0.0.1:{self.replay_port}"}}
        if draining:
            w["draining"] = True
        return w


class Redis:
    def __init__(self, logs: Path):
        self.port = free_port()
        self.dir = logs / "redis"
        self.dir.mkdir(parents=True, exist_ok=True)
        argv = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--daemonize", "no", "--protected-mode", "yes",
                "--dir", str(self.dir)]
        self.proc = Proc("redis", argv, logs / "redis.log")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1.0) as s:
                s.sendall(b"PING\r\n")
                return s.recv(64).startswith(b"+PONG")
        except OSError:
            return False

    def start(self) -> None:
        for _ in range(10):
            self.proc.start()
            if poll(lambda: self.proc.alive() and self.ping(), 5.0):
                return
            self.proc.kill9()
            time.sleep(0.5)
        raise ChaosError(f"redis-server did not answer on port {self.port}; its log:\n{self.proc.tail()}")


def deep_merge(base: dict, overlay: dict, path: str = "") -> dict:
    for k, v in overlay.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            deep_merge(base[k], v, f"{path}{k}.")
        else:
            base[k] = v
    return base


class Router:
    """`router-host serve` and the YAML it reads; `write()` regenerates the file from the state
    the chaos script toggles (a worker draining, a parameter)."""

    def __init__(self, binary: Path, plugin: Path, engines: list[Engine], redis: Redis, overlay: dict,
                 out: Path, logs: Path, retries: int):
        self.port = free_port()
        self.engines = engines
        self.redis = redis
        self.plugin = plugin
        self.overlay = overlay
        self.path = out / "router.yaml"
        self.draining: int | None = None
        self.retries = retries
        self.load_gate = True
        self.proc = Proc("serve", [str(binary), "serve", "--config", str(self.path)], logs / "serve.log")

    def config(self) -> dict:
        cfg = yaml.safe_load(BASE_CONFIG.read_text())
        # The shipped example names the plugin by library name; here it is the build's own file.
        cfg["plugins"] = [{"path": str(self.plugin)}]
        params = cfg["worker_selection"]["instances"][0].setdefault("parameters", {})
        params["soft_affinity_load_gate"] = self.load_gate
        cfg["session_affinity"]["store"] = {"kind": "redis", "url": self.redis.url, "key_prefix": "chaos:",
                                            "timeout_ms": 50}
        cfg["workers"] = [e.worker_yaml(self.draining == e.id) for e in self.engines]
        cfg["serve"] = {"listen": f"127.0.0.1:{self.port}", "retries": self.retries,
                        "timeouts": dict(ROUTER_TIMEOUTS), "health": {"interval_ms": 500, "timeout_ms": 1000}}
        return deep_merge(cfg, self.overlay)

    def write(self) -> None:
        tmp = self.path.with_suffix(".yaml.tmp")
        tmp.write_text("# Generated by router-host/scripts/chaos/chaos.py from examples/two-tier-soft-affinity.yaml\n"
                       + yaml.safe_dump(self.config(), sort_keys=False))
        os.replace(tmp, self.path)

    def metrics(self, timeout: float = 5.0) -> list[tuple[str, dict, float]]:
        status, body = http_get(self.port, "/metrics", timeout)
        if status != 200:
            raise ValueError(f"/metrics answered {status}")
        return parse_metrics(body.decode("utf-8", "replace"))


_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text: str) -> list[tuple[str, dict, float]]:
    out = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        try:
            value = float(m.group(4))
        except ValueError:
            continue
        out.append((m.group(1), dict(_LABEL.findall(m.group(3) or "")), value))
    return out


def msum(samples, name: str, **labels) -> float:
    return sum(v for n, l, v in samples if n == name and all(l.get(k) == x for k, x in labels.items()))


def has_metric(samples, name: str) -> bool:
    return any(n == name for n, _, _ in samples)


def by_labels(samples, name: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for n, labels, v in samples:
        if n == name:
            key = ",".join(f"{k}={labels[k]}" for k in sorted(labels)) or "-"
            out[key] = out.get(key, 0) + v
    return out


def read_status(pid: int) -> tuple[float, int] | None:
    """VmRSS in MiB and Threads of `pid`, or None when it is gone."""
    rss, threads = None, 0
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    rss = int(line.split()[1]) / 1024
                elif line.startswith("Threads:"):
                    threads = int(line.split()[1])
    except OSError:
        return None
    return None if rss is None else (rss, threads)


# -- the load ------------------------------------------------------------------------------------

SYSTEM_PROMPTS = [
    "You are a careful assistant for a hardware shop. Answer in two sentences and name the part number. ",
    "You are a travel planner. Suggest one route and one alternative, with travel times in hours. ",
    "You are a code reviewer for a Rust team. Point out the single most important problem first. ",
    "You are a tutor for secondary-school physics. Explain with one worked example and units. ",
]
WORDS = ("cache block engine router stream token prefix session worker latency batch prompt "
         "answer budget queue replica event relay shard metric health drain reload").split()
KINDS = ["completions", "completions+stream", "chat", "chat+stream"]
OUTCOMES = ["completed", "failed_clear", "lost"]


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


class Conversation:
    def __init__(self, rng: random.Random, sid: str):
        self.id = sid
        self.system = rng.choice(SYSTEM_PROMPTS)
        self.turns: list[tuple[str, str]] = []
        self.max_turns = rng.randint(3, 8)


class Results:
    def __init__(self):
        self.lock = threading.Lock()
        self.counts = {k: collections.Counter() for k in KINDS}  # kind -> outcome -> n
        self.details = collections.Counter()  # (outcome, detail) -> n
        self.details_by_kind = collections.Counter()  # (kind, outcome, detail) -> n
        self.examples: dict[str, list[dict]] = collections.defaultdict(list)
        self.with_session = collections.Counter()  # outcome -> n (requests carrying a session id)
        self.session_headers = collections.Counter()  # x-router-session values seen
        self.workers = collections.Counter()  # x-router-worker values seen
        self.latency = {k: [] for k in KINDS}
        self.crashes: list[str] = []  # load clients that stopped on an error of the driver
        self.refusals = collections.Counter()  # (status, x-router-rejected-reason, class) -> n
        self.refusal_problems = collections.Counter()  # what refusal_problem said -> n
        self.refusal_problem_examples: list[dict] = []
        self.classes = collections.Counter()  # (class, outcome) -> n

    def record(self, kind: str, outcome: str, detail: str, session: bool, example: dict, latency: float,
               headers: dict, policy_class: str = "default") -> None:
        with self.lock:
            self.classes[(policy_class, outcome)] += 1
            if example.get("status") in REFUSAL_STATUSES:
                self.refusals[(example["status"], headers.get("x-router-rejected-reason") or "-", policy_class)] += 1
                problem = refusal_problem(example)
                if problem:
                    self.refusal_problems[problem] += 1
                    if len(self.refusal_problem_examples) < EXAMPLES_PER_CASE:
                        self.refusal_problem_examples.append({**example, "problem": problem})
            self.counts[kind][outcome] += 1
            self.details[(outcome, detail)] += 1
            self.details_by_kind[(kind, outcome, detail)] += 1
            if session:
                self.with_session[outcome] += 1
                if headers.get("x-router-session"):
                    self.session_headers[headers["x-router-session"]] += 1
            if headers.get("x-router-worker"):
                self.workers[headers["x-router-worker"]] += 1
            if outcome == "completed":
                self.latency[kind].append(latency)
            elif len(self.examples[f"{outcome}/{detail}"]) < EXAMPLES_PER_CASE:
                self.examples[f"{outcome}/{detail}"].append(example)


def read_body(resp: http.client.HTTPResponse) -> bytes:
    """The whole body, at most MAX_BODY_BYTES + 1 bytes. A body shorter than its content-length
    raises IncompleteRead (http.client's bounded read returns what came without a word; a
    chunked body cut before its last chunk raises by itself)."""
    raw = resp.read(MAX_BODY_BYTES + 1)
    if len(raw) <= MAX_BODY_BYTES and resp.length:
        raise http.client.IncompleteRead(raw, resp.length)
    return raw


def is_openai_error(value) -> str | None:
    """The error's code (or type) if `value` is an OpenAI-style error object, else None."""
    if not isinstance(value, dict) or not isinstance(value.get("error"), dict):
        return None
    err = value["error"]
    if not isinstance(err.get("message"), str) or not err["message"]:
        return None
    code = err.get("code")
    return str(code if code not in (None, "") else err.get("type", "error"))


def refusal_problem(ex: dict) -> str | None:
    """What is wrong with a refusal (a 429 or 503 answer), None when it carries its reason: the
    `x-router-rejected-reason` header, equal to the body's `error.code`, and on a 429 a
    `retry-after`."""
    if ex.get("status") not in REFUSAL_STATUSES:
        return None
    headers = ex.get("headers") or {}
    reason = headers.get("x-router-rejected-reason")
    if not reason:
        return "no x-router-rejected-reason header"
    if reason != ex.get("error_code"):
        return f"x-router-rejected-reason {reason!r} but error.code {ex.get('error_code')!r}"
    if ex["status"] == 429 and not headers.get("retry-after"):
        return "a 429 without retry-after"
    return None


class Lines:
    """The lines of a response body, read with `read1`: http.client's `readline` on a chunked
    body takes a body cut before its last chunk for a clean end, `read1` raises. At most
    MAX_BODY_BYTES in all: past it `next` returns None."""

    def __init__(self, resp: http.client.HTTPResponse):
        self.resp = resp
        self.buf = b""
        self.total = 0

    def next(self) -> bytes | None:
        """One line with its newline; b"" at the clean end of the body."""
        while b"\n" not in self.buf:
            data = self.resp.read1(65536)
            if not data:
                line, self.buf = self.buf, b""
                return line
            self.total += len(data)
            if self.total > MAX_BODY_BYTES:
                return None
            self.buf += data
        line, _, self.buf = self.buf.partition(b"\n")
        return line + b"\n"


class Request:
    """One request's classification. Every path out of `run` records exactly one outcome."""

    def __init__(self, kind: str, body: dict, headers: dict, max_tokens: int, timeout: float = CLIENT_TIMEOUT_S):
        self.timeout = timeout
        self.kind = kind
        self.stream = kind.endswith("+stream")
        self.chat = kind.startswith("chat")
        self.body = body
        self.headers = headers
        self.max_tokens = max_tokens
        self.path = "/v1/chat/completions" if self.chat else "/v1/completions"

    def run(self, port: int, t0: float) -> tuple[str, str, dict, dict, str]:
        """(outcome, detail, example, response headers, answer text)."""
        started = time.monotonic()
        deadline = started + self.timeout
        ex = {"t_s": now_s(t0), "kind": self.kind, "session": self.headers.get("x-session-id"),
              "max_tokens": self.max_tokens}
        rheaders: dict = {}
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=self.timeout)
        try:
            conn.request("POST", self.path, json.dumps(self.body), {"content-type": "application/json",
                                                                     **self.headers})
            resp = conn.getresponse()
            rheaders = {k.lower(): v for k, v in resp.getheaders()
                        if k.lower().startswith("x-router-") or k.lower() == "retry-after"}
            ex["status"] = resp.status
            ex["headers"] = rheaders
            if resp.status != 200:
                raw = read_body(resp)
                ex["body"] = raw[:600].decode("utf-8", "replace")
                try:
                    code = is_openai_error(json.loads(raw))
                except ValueError:
                    code = None
                ex["error_code"] = code
                if code is None:
                    return "lost", f"http_{resp.status}_without_openai_error_body", ex, rheaders, ""
                return "failed_clear", f"http_{resp.status}_{code}", ex, rheaders, ""
            if self.stream:
                return self._stream(resp, deadline, ex, rheaders)
            return self._whole(resp, ex, rheaders)
        except socket.timeout:
            ex["error"] = f"no answer within the client timeout ({self.timeout:g} s)"
            return "lost", "client_timeout", ex, rheaders, ""
        except http.client.IncompleteRead as e:
            ex["error"] = repr(e)
            return "lost", "body_cut", ex, rheaders, ""
        except ConnectionRefusedError as e:
            ex["error"] = repr(e)
            return "lost", "router_refused_connection", ex, rheaders, ""
        except (http.client.HTTPException, OSError) as e:
            ex["error"] = repr(e)
            return "lost", f"connection_error_{type(e).__name__}", ex, rheaders, ""
        finally:
            ex["elapsed_s"] = round(time.monotonic() - started, 3)
            conn.close()

    def _whole(self, resp, ex, rheaders):
        raw = read_body(resp)  # IncompleteRead when the body is cut: lost, above
        if len(raw) > MAX_BODY_BYTES:
            return "lost", "body_too_large", ex, rheaders, ""
        try:
            value = json.loads(raw)
        except ValueError:
            ex["body"] = raw[:600].decode("utf-8", "replace")
            return "lost", "malformed_json_body", ex, rheaders, ""
        if is_openai_error(value):
            ex["body"] = raw[:600].decode("utf-8", "replace")
            return "failed_clear", "http_200_error_body", ex, rheaders, ""
        try:
            choice = value["choices"][0]
            text = choice["message"]["content"] if self.chat else choice["text"]
            got = value["usage"]["completion_tokens"]
        except (KeyError, IndexError, TypeError):
            ex["body"] = raw[:600].decode("utf-8", "replace")
            return "lost", "incomplete_json_answer", ex, rheaders, ""
        if got != self.max_tokens or not isinstance(text, str):
            ex["body"] = raw[:600].decode("utf-8", "replace")
            return "lost", "wrong_token_count", ex, rheaders, ""
        return "completed", "ok", ex, rheaders, text

    def _stream(self, resp, deadline, ex, rheaders):
        ctype = resp.getheader("content-type", "")
        if "text/event-stream" not in ctype:
            raw = resp.read(MAX_BODY_BYTES + 1)
            ex["body"] = raw[:600].decode("utf-8", "replace")
            return "lost", "stream_not_event_stream", ex, rheaders, ""
        tokens, usage, done, error = 0, None, False, None
        lines = Lines(resp)
        text = []
        last_events: collections.deque = collections.deque(maxlen=4)
        while True:
            if time.monotonic() > deadline:
                ex["error"] = f"stream still open after the client timeout ({self.timeout:g} s)"
                return "lost", "client_timeout", ex, rheaders, ""
            try:
                line = lines.next()
            except socket.timeout:
                raise
            except (http.client.HTTPException, OSError) as e:
                # The body broke off: clear only if the router said why first.
                ex["error"] = repr(e)
                ex["last_events"] = list(last_events)
                if error:
                    return "failed_clear", f"stream_error_event_{error}", ex, rheaders, ""
                return "lost", "stream_cut_without_error_event", ex, rheaders, ""
            if line is None:
                return "lost", "body_too_large", ex, rheaders, ""
            if not line:
                break  # the body's clean end
            line = line.rstrip(b"\r\n")
            if not line or line.startswith(b":"):
                continue
            if not line.startswith(b"data:"):
                continue  # other SSE fields (event:, id:) carry nothing here
            data = line[5:].strip()
            last_events.append(data[:300].decode("utf-8", "replace"))
            if data == b"[DONE]":
                done = True
                continue
            if done:
                ex["last_events"] = list(last_events)
                return "lost", "data_after_done", ex, rheaders, ""
            try:
                value = json.loads(data)
            except ValueError:
                ex["last_events"] = list(last_events)
                return "lost", "malformed_stream_event", ex, rheaders, ""
            code = is_openai_error(value)
            if code is not None:
                error = code
                ex["error_event"] = data[:600].decode("utf-8", "replace")
                continue
            if not isinstance(value, dict):
                ex["last_events"] = list(last_events)
                return "lost", "malformed_stream_event", ex, rheaders, ""
            if isinstance(value.get("usage"), dict):
                usage = value["usage"].get("completion_tokens")
            for choice in value.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content") if self.chat else choice.get("text")
                if piece:
                    tokens += 1
                    text.append(piece)
        ex["last_events"] = list(last_events)
        if error:
            return "failed_clear", f"stream_error_event_{error}", ex, rheaders, ""
        if not done:
            return "lost", "stream_ended_without_done", ex, rheaders, ""
        if tokens != self.max_tokens or (usage is not None and usage != self.max_tokens):
            ex["tokens"] = tokens
            ex["usage_completion_tokens"] = usage
            return "lost", "wrong_token_count", ex, rheaders, ""
        return "completed", "ok", ex, rheaders, "".join(text)


def pick_class(rng: random.Random, classes: list[tuple[str, float]] | None) -> str:
    """The request's priority class: `default` (no header) without `--over-capacity`."""
    if not classes:
        return "default"
    x = rng.random()
    for name, share in classes:
        if x < share:
            return name
        x -= share
    return classes[-1][0]


def load_thread(i: int, seed: int, port: int, stop: threading.Event, results: Results, t0: float,
                session_share: float, classes: list[tuple[str, float]] | None = None) -> None:
    try:
        _load(i, seed, port, stop, results, t0, session_share, classes)
    except Exception as e:  # noqa: BLE001
        with results.lock:
            results.crashes.append(f"load client {i}: {type(e).__name__}: {e}")
        LOG(f"load client {i} stopped: {type(e).__name__}: {e}")


def _load(i: int, seed: int, port: int, stop: threading.Event, results: Results, t0: float,
          session_share: float, classes: list[tuple[str, float]] | None) -> None:
    rng = random.Random(f"{seed}-load-{i}")
    class_rng = random.Random(f"{seed}-class-{i}")  # its own, so the load is the same without classes
    conversations: list[Conversation] = []
    n_sessions = 0
    while not stop.is_set():
        kind = rng.choice(KINDS)
        max_tokens = rng.randint(8, 64)
        headers = {}
        policy_class = pick_class(class_rng, classes)
        if policy_class != "default":
            headers["x-router-priority-class"] = policy_class
        convo = None
        if rng.random() < session_share:
            if len(conversations) < 3 or rng.random() < 0.1:
                n_sessions += 1
                conversations.append(Conversation(rng, f"chaos-{seed}-{i}-{n_sessions}"))
            convo = rng.choice(conversations)
            headers["x-session-id"] = convo.id
        question = words(rng, rng.randint(4, 24)) + "?"
        if kind.startswith("chat"):
            if convo:
                messages = [{"role": "system", "content": convo.system}]
                for q, a in convo.turns:
                    messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
            else:
                messages = [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)}]
            messages.append({"role": "user", "content": question})
            body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens}
        else:
            prefix = convo.system + "".join(f"Q: {q}\nA: {a}\n" for q, a in convo.turns) if convo \
                else rng.choice(SYSTEM_PROMPTS)
            body = {"model": MODEL, "prompt": f"{prefix}Q: {question}\nA:", "max_tokens": max_tokens}
        if kind.endswith("+stream"):
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        req = Request(kind, body, headers, max_tokens)
        started = time.monotonic()
        outcome, detail, ex, rheaders, text = req.run(port, t0)
        results.record(kind, outcome, detail, convo is not None, ex, time.monotonic() - started, rheaders,
                       policy_class)
        if ex.get("status") == 429:
            # As a well-behaved client does: wait what `retry-after` says (bounded) before the next.
            try:
                wait = float(rheaders.get("retry-after", "1"))
            except ValueError:
                wait = 1.0
            stop.wait(min(max(wait, 0.0), RETRY_AFTER_MAX_S))
        if convo is not None:
            if outcome == "completed":
                convo.turns.append((question, text[:400]))
            if len(convo.turns) >= convo.max_turns:
                conversations.remove(convo)


# -- the classifier's own check -------------------------------------------------------------------

def self_test() -> int:
    """Answers of every kind from a stand-in server on 127.0.0.1, each classified as it must be:
    the check that a lost request would be seen as lost. run.sh runs it before the chaos."""
    import http.server

    def sse(*events: str) -> bytes:
        return b"".join(f"data: {e}\n\n".encode() for e in events)

    chunk = json.dumps({"choices": [{"index": 0, "text": "a"}]})
    usage = json.dumps({"choices": [], "usage": {"completion_tokens": 2}})
    err = json.dumps({"error": {"message": "engine gone", "type": "upstream_error", "code": "upstream_error"}})
    shed = json.dumps({"error": {"message": "queues full", "type": "rate_limit_error", "code": "queue_full"}})
    reason = {"x-router-rejected-reason": "queue_full"}
    whole = lambda n: json.dumps({"choices": [{"text": "ab"}], "usage": {"completion_tokens": n}}).encode()  # noqa: E731
    cases = {
        # path: (kind, what the server does, outcome, detail)
        "/ok-stream": ("completions+stream", ("chunked", sse(chunk, chunk, usage, "[DONE]"), True), "completed", "ok"),
        "/ok-whole": ("completions", ("json", 200, whole(2)), "completed", "ok"),
        "/error-event": ("completions+stream", ("chunked", sse(chunk, err, "[DONE]"), True), "failed_clear",
                         "stream_error_event_upstream_error"),
        "/error-event-then-cut": ("completions+stream", ("chunked", sse(chunk, err), False), "failed_clear",
                                  "stream_error_event_upstream_error"),
        "/503-json": ("completions", ("json", 503, err.encode()), "failed_clear", "http_503_upstream_error"),
        "/503-with-reason": ("completions", ("json", 503, err.encode(), {"x-router-rejected-reason": "upstream_error"}),
                             "failed_clear", "http_503_upstream_error"),
        "/503-mismatch": ("completions", ("json", 503, err.encode(), reason), "failed_clear",
                          "http_503_upstream_error"),
        "/429-shed": ("completions+stream", ("json", 429, shed.encode(), {**reason, "retry-after": "1"}),
                      "failed_clear", "http_429_queue_full"),
        "/429-no-reason": ("completions", ("json", 429, shed.encode(), {"retry-after": "1"}), "failed_clear",
                           "http_429_queue_full"),
        "/429-no-retry-after": ("completions", ("json", 429, shed.encode(), reason), "failed_clear",
                                "http_429_queue_full"),
        "/cut-stream": ("completions+stream", ("chunked", sse(chunk), False), "lost", "stream_cut_without_error_event"),
        "/no-done": ("completions+stream", ("chunked", sse(chunk, chunk, usage), True), "lost",
                     "stream_ended_without_done"),
        "/short-stream": ("completions+stream", ("chunked", sse(chunk, usage, "[DONE]"), True), "lost",
                          "wrong_token_count"),
        "/bad-event": ("completions+stream", ("chunked", sse("{not json", "[DONE]"), True), "lost",
                       "malformed_stream_event"),
        "/502-html": ("completions", ("json", 502, b"<html>bad gateway</html>"), "lost",
                      "http_502_without_openai_error_body"),
        "/wrong-count": ("completions", ("json", 200, whole(5)), "lost", "wrong_token_count"),
        "/cut-body": ("completions", ("cut", 200, whole(2)), "lost", "body_cut"),
        "/cut-error-body": ("completions", ("cut", 503, err.encode()), "lost", "body_cut"),
        "/hang": ("completions", ("hang",), "lost", "client_timeout"),
        "/reset": ("completions", ("reset",), "lost", "connection_error_RemoteDisconnected"),
    }
    # Refusals: whether refusal_problem must find something wrong.
    refusal_wrong = {"/503-json": True, "/503-with-reason": False, "/503-mismatch": True, "/429-shed": False,
                     "/429-no-reason": True, "/429-no-retry-after": True}

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def do_POST(self):
            self.rfile.read(int(self.headers.get("content-length", 0)))
            what = cases[self.path][1]
            if what[0] == "hang":
                time.sleep(2.0)
                return
            if what[0] == "reset":
                self.close_connection = True
                return
            if what[0] == "chunked":
                self.send_response(200)
                self.send_header("content-type", "text/event-stream")
                self.send_header("transfer-encoding", "chunked")
                self.end_headers()
                self.wfile.write(f"{len(what[1]):x}\r\n".encode() + what[1] + b"\r\n")
                if what[2]:
                    self.wfile.write(b"0\r\n\r\n")
                self.close_connection = True
                return
            body = what[2]
            self.send_response(what[1])
            for name, value in (what[3] if len(what) > 3 else {}).items():
                self.send_header(name, value)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body) + (10 if what[0] == "cut" else 0)))
            self.end_headers()
            self.wfile.write(body)
            self.close_connection = True

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    wrong = []
    try:
        for path, (kind, _what, outcome, detail) in cases.items():
            req = Request(kind, {"model": MODEL, "prompt": "x", "max_tokens": 2}, {}, 2, timeout=1.0)
            req.path = path
            got = req.run(port, time.monotonic())
            if (got[0], got[1]) != (outcome, detail):
                wrong.append(f"{path}: classified {got[0]}/{got[1]}, expected {outcome}/{detail}")
            problem = refusal_problem(got[2])
            if path in refusal_wrong and bool(problem) != refusal_wrong[path]:
                wrong.append(f"{path}: refusal check said {problem!r}, expected "
                             f"{'a problem' if refusal_wrong[path] else 'none'}")
    finally:
        server.shutdown()
    for w in wrong:
        LOG(f"self-test FAILED: {w}")
    LOG(f"self-test: {len(cases) - len(wrong)} of {len(cases)} answers classified as expected")
    return 1 if wrong else 0


# -- chaos -----------------------------------------------------------------------------------------

EVENT_TYPES = ["kill_engine", "cut_kv", "restart_redis", "reload"]


class Chaos:
    def __init__(self, seed: int, router: Router, engines: list[Engine], redis: Redis, t0: float,
                 min_gap: float, max_gap: float):
        self.rng = random.Random(f"{seed}-chaos")
        self.router = router
        self.engines = engines
        self.redis = redis
        self.t0 = t0
        self.min_gap = min_gap
        self.max_gap = max_gap
        self.events: list[dict] = []
        self.failures: list[str] = []
        self.dead: Engine | None = None
        self.earlier_configs = collections.Counter()  # PER_CONFIG_COUNTERS of replaced configurations
        self.restart_at = 0.0
        self.cycle: list[str] = []

    def log_event(self, kind: str, **fields) -> dict:
        ev = {"t_s": now_s(self.t0), "event": kind, **fields}
        self.events.append(ev)
        LOG(f"event {kind} " + " ".join(f"{k}={v}" for k, v in fields.items()))
        return ev

    def next_type(self) -> str:
        # Every event type once per cycle, in a seeded order: a short run still sees them all.
        if not self.cycle:
            self.cycle = list(EVENT_TYPES)
            self.rng.shuffle(self.cycle)
        t = self.cycle.pop(0)
        if t == "kill_engine" and self.dead is not None:
            self.cycle.append(t)  # at most one engine dead: later in this cycle
            t = self.cycle.pop(0) if len(self.cycle) > 1 else "cut_kv"
        return t

    def run(self, stop_at: float, stop: threading.Event) -> None:
        try:
            self._run(stop_at, stop)
        except Exception as e:  # noqa: BLE001
            self.failures.append(f"the chaos stopped early: {type(e).__name__}: {e}")
            LOG(f"the chaos stopped early: {type(e).__name__}: {e}")

    def _run(self, stop_at: float, stop: threading.Event) -> None:
        next_at = time.monotonic() + self.rng.uniform(self.min_gap, self.max_gap)
        while not stop.is_set():
            now = time.monotonic()
            if now >= stop_at:
                break
            if self.dead is not None and now >= self.restart_at:
                self.restart_engine()
                continue
            if now >= next_at:
                self.one(self.next_type())
                next_at = time.monotonic() + self.rng.uniform(self.min_gap, self.max_gap)
                continue
            wake = min(next_at, stop_at, self.restart_at if self.dead else next_at)
            stop.wait(max(0.0, min(0.5, wake - now)))
        if self.dead is not None:
            self.restart_engine()

    def one(self, kind: str) -> None:
        # Any error of an event (a process that will not start, a full disk when the config is
        # rewritten) fails the run by name; the chaos goes on with the next event.
        try:
            getattr(self, kind)()
        except Exception as e:  # noqa: BLE001
            self.failures.append(f"{kind}: {type(e).__name__}: {e}")
            self.log_event(f"{kind}_failed", error=f"{type(e).__name__}: {e}")

    def kill_engine(self) -> None:
        e = self.rng.choice(self.engines)
        pid = e.proc.pid
        e.kill9()
        self.dead = e
        down = round(self.rng.uniform(2.0, 8.0), 1)
        self.restart_at = time.monotonic() + down
        self.log_event("kill_engine", worker=e.id, pid=pid, signal="SIGKILL", restart_after_s=down)

    def restart_engine(self) -> None:
        e = self.dead
        self.dead = None
        t = time.monotonic()
        dead_since = e.dead_since or t
        e.start()
        e.dead_since = dead_since
        self.log_event("restart_engine", worker=e.id, pid=e.proc.pid, down_s=round(t - dead_since, 1),
                       start_took_s=round(time.monotonic() - t, 2))

    def cut_kv(self) -> None:
        targets = self.engines if self.rng.random() < 0.3 else [self.rng.choice(self.engines)]
        refuse = round(self.rng.uniform(0.2, 3.0), 1)
        cut = {e.id: sum(r.cut(refuse) for r in e.relays) for e in targets}
        self.log_event("cut_kv", workers=sorted(cut), connections_cut=sum(cut.values()), refused_for_s=refuse)

    def restart_redis(self) -> None:
        pid = self.redis.proc.pid
        self.redis.proc.kill9()
        down = round(self.rng.uniform(0.2, 3.0), 1)
        time.sleep(down)
        t = time.monotonic()
        self.redis.start()
        self.log_event("restart_redis", pid=pid, signal="SIGKILL", down_s=down,
                       start_took_s=round(time.monotonic() - t, 2))

    def reload(self) -> None:
        r = self.router
        what = self.rng.choice(["drain", "param"])
        if what == "drain":
            if r.draining is not None:
                change = f"worker {r.draining} draining: false"
                r.draining = None
            else:
                # Never leave no engine to route to: the dead one (if any) is not drained.
                choices = [e.id for e in self.engines if e is not self.dead]
                r.draining = self.rng.choice(choices)
                change = f"worker {r.draining} draining: true"
        else:
            r.load_gate = not r.load_gate
            r.retries = 3 if r.retries == 2 else 2
            change = f"soft_affinity_load_gate: {str(r.load_gate).lower()}, serve.retries: {r.retries}"
        before = self._reloads()
        counted = {name: msum(self.router.metrics(), name) for name in PER_CONFIG_COUNTERS}
        r.write()
        os.kill(r.proc.pid, signal.SIGHUP)
        moved = poll(lambda: self._reloads()[0] > before[0] or self._reloads()[1] > before[1], 15.0, 0.1)
        after = self._reloads()
        ok = after[0] > before[0]
        if ok:
            self.earlier_configs.update(counted)
        self.log_event("reload", change=change, reloads_ok=f"{before[0]:.0f}->{after[0]:.0f}",
                       reloads_error=f"{before[1]:.0f}->{after[1]:.0f}", applied=ok)
        if not ok:
            self.failures.append(f"reload ({change}): router_config_reloads_total{{outcome=\"ok\"}} did not move "
                                 f"within 15 s (error: {before[1]:.0f}->{after[1]:.0f}; moved={bool(moved)})")

    def _reloads(self) -> tuple[float, float]:
        m = self.router.metrics()
        return (msum(m, "router_config_reloads_total", outcome="ok"),
                msum(m, "router_config_reloads_total", outcome="error"))


# -- the run ---------------------------------------------------------------------------------------


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--router-host", required=True, type=Path)
    p.add_argument("--plugin", required=True, type=Path, help="libtwo_tier_cost_fn.so")
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load (default 600)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--config-overlay", type=Path, help="YAML merged into the generated serve config")
    p.add_argument("--expect-no-stream-failures", action="store_true",
                   help="also fail on any streamed request that failed (with mid-stream migration on); "
                        "requests turned away by admission (429) are not stream failures")
    p.add_argument("--over-capacity", action="store_true",
                   help=f"drive the router over capacity: merge {OVER_CAPACITY_OVERLAY.name} (priority classes, "
                        f"a small queue bound, engine saturation), engines with --max-num-seqs "
                        f"{OVER_CAPACITY_MAX_NUM_SEQS}, {OVER_CAPACITY_CONCURRENCY} clients unless --concurrency "
                        f"says otherwise, requests of the classes "
                        + ", ".join(f"{n} {w:.0%}" for n, w in OVER_CAPACITY_CLASSES)
                        + "; the run then also fails unless some requests were shed")
    p.add_argument("--engines", type=int, default=3)
    p.add_argument("--dp-size", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=None,
                   help=f"closed-loop clients (default 8; {OVER_CAPACITY_CONCURRENCY} with --over-capacity)")
    p.add_argument("--session-share", type=float, default=0.5, help="share of requests carrying a session id")
    p.add_argument("--retries", type=int, default=2, help="serve.retries at start (a reload toggles 2 and 3)")
    p.add_argument("--min-gap", type=float, default=3.0, help="shortest wait between two chaos events, s")
    p.add_argument("--max-gap", type=float, default=8.0, help="longest wait between two chaos events, s")
    p.add_argument("--rss-growth-mib", type=float, default=None,
                   help="most serve's RSS may peak higher in the last third of the load than in the first, MiB "
                        f"(default 64; {OVER_CAPACITY_RSS_GROWTH_MIB:g} with --over-capacity)")
    p.add_argument("--rss-max-mib", type=float, default=512.0, help="most serve's RSS may reach, MiB")
    p.add_argument("--settle-timeout", type=float, default=30.0, help="how long the gauges get to reach 0, s")
    p.add_argument("--command", default="", help="the command line to record in the report")
    p.add_argument("--self-test", action="store_true",
                   help="only check the classifier against a stand-in server, then exit")
    if "--self-test" in sys.argv[1:]:
        return self_test()
    a = p.parse_args()
    if a.engines < 3:
        sys.exit("--engines: at least 3 (one dead and one draining must leave one to route to)")
    if a.duration < 20:
        sys.exit("--duration: at least 20 s")

    a.router_host = a.router_host.resolve()
    a.plugin = a.plugin.resolve()
    out = a.out.resolve()
    logs = out / "logs"
    # This run's logs only (the processes append across their restarts within a run).
    shutil.rmtree(logs, ignore_errors=True)
    logs.mkdir(parents=True, exist_ok=True)
    if a.concurrency is None:
        a.concurrency = OVER_CAPACITY_CONCURRENCY if a.over_capacity else 8
    if a.rss_growth_mib is None:
        a.rss_growth_mib = OVER_CAPACITY_RSS_GROWTH_MIB if a.over_capacity else 64.0
    overlay = {}
    for flag, path in (("--over-capacity", OVER_CAPACITY_OVERLAY if a.over_capacity else None),
                       ("--config-overlay", a.config_overlay)):
        if path is None:
            continue
        try:
            layer = yaml.safe_load(path.read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            sys.exit(f"{flag} {path}: {e}")
        if not isinstance(layer, dict):
            sys.exit(f"{flag} {path}: must be a YAML mapping, got {type(layer).__name__}")
        deep_merge(overlay, layer)
    classes = OVER_CAPACITY_CLASSES if a.over_capacity else None
    max_num_seqs = OVER_CAPACITY_MAX_NUM_SEQS if a.over_capacity else None

    t0 = time.monotonic()
    LOG.t0 = t0
    started_utc = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    engines: list[Engine] = []
    redis = None
    router = None
    stop = threading.Event()
    report: dict = {"seed": a.seed, "duration_s": a.duration, "started_utc": started_utc,
                    "command": a.command, "failures": []}
    failures: list[str] = report["failures"]
    try:
        engines = [Engine(i + 1, a.router_host, a.dp_size, logs, max_num_seqs) for i in range(a.engines)]
        for e in engines:
            e.start()
        redis = Redis(logs)
        redis.start()
        router = Router(a.router_host, a.plugin, engines, redis, overlay, out, logs, a.retries)
        router.write()
        router.proc.start()
        rows = a.engines * a.dp_size
        def ready():
            if not router.proc.alive():
                raise ChaosError(f"serve exited ({router.proc.proc.returncode}) at start; its log:\n"
                                 f"{router.proc.tail()}")
            return http_get(router.port, "/ready", 1.0)[0] == 200

        if not poll(ready, 30.0):
            raise ChaosError(f"serve did not become ready within 30 s; its log:\n{router.proc.tail()}")
        if not poll(lambda: msum(router.metrics(), "router_kv_subscriber_connected") == rows, 20.0):
            raise ChaosError(f"serve's KV subscribers did not all connect within 20 s; log:\n{router.proc.tail()}")
        LOG(f"serve pid {router.proc.pid} on 127.0.0.1:{router.port}; {a.engines} engines x {a.dp_size} ranks; "
            f"redis on {redis.port}; load for {a.duration:.0f} s, seed {a.seed}")
        report["setup"] = {
            "engines": a.engines, "dp_size": a.dp_size, "concurrency": a.concurrency, "retries": a.retries,
            "over_capacity": a.over_capacity, "classes": classes, "engine_max_num_seqs": max_num_seqs,
            "session_share": a.session_share, "client_timeout_s": CLIENT_TIMEOUT_S,
            "router_timeouts_ms": ROUTER_TIMEOUTS, "base_config": str(BASE_CONFIG.relative_to(REPO)),
            "overlay": overlay, "config": router.config(),
            "processes": {"serve": router.proc.argv, "redis": redis.proc.argv,
                          **{f"engine-{e.id}": e.proc.argv for e in engines}},
        }

        results = Results()
        samples: list[tuple[float, float, int]] = []
        rss_stop = threading.Event()

        def sampler():
            while not rss_stop.is_set():
                s = read_status(router.proc.pid)
                if s:
                    samples.append((now_s(t0), s[0], s[1]))
                rss_stop.wait(1.0)

        threading.Thread(target=sampler, daemon=True).start()
        load_start = time.monotonic()
        threads = [threading.Thread(target=load_thread, daemon=True,
                                    args=(i, a.seed, router.port, stop, results, t0, a.session_share, classes))
                   for i in range(a.concurrency)]
        for t in threads:
            t.start()
        # Chaos from 5 s into the load until 5 s before its end; the load runs throughout.
        chaos = Chaos(a.seed, router, engines, redis, t0, a.min_gap, a.max_gap)
        stop.wait(5.0)
        chaos_stop_at = load_start + a.duration - 5.0
        chaos_thread = threading.Thread(target=chaos.run, args=(chaos_stop_at, stop), daemon=True)
        chaos_thread.start()
        while time.monotonic() < load_start + a.duration:
            if not router.proc.alive():
                failures.append(f"serve died during the run (exit {router.proc.proc.returncode}); "
                                f"its log ends:\n{router.proc.tail()}")
                break
            time.sleep(0.5)
        load_end = time.monotonic()
        stop.set()
        chaos_thread.join(timeout=60)
        for t in threads:
            t.join(timeout=CLIENT_TIMEOUT_S + 10)
        failures.extend(results.crashes)
        hung_clients = sum(t.is_alive() for t in threads)
        if hung_clients:
            failures.append(f"{hung_clients} load threads did not finish within the client timeout")
        LOG(f"load stopped after {load_end - load_start:.0f} s")
        failures.extend(chaos.failures)
        report["events"] = chaos.events

        # The end: every engine and the store up again, no drain; then the gauges must reach 0.
        router_alive = router.proc.alive()
        settle = {}
        if router_alive:
            def zero():
                m = router.metrics()
                vals = {g: msum(m, g) for g in ZERO_GAUGES}
                settle["gauges"] = vals
                settle["kv_subscriber_connected"] = msum(m, "router_kv_subscriber_connected")
                return all(v == 0 for v in vals.values())

            t = time.monotonic()
            ok = poll(zero, a.settle_timeout, 0.25)
            settle["gauges_zero"] = bool(ok)
            settle["took_s"] = round(time.monotonic() - t, 2)
            if not ok:
                failures.append(f"gauges not back to 0 within {a.settle_timeout:.0f} s after the load: "
                                + ", ".join(f"{k}={v:g}" for k, v in settle.get("gauges", {}).items() if v))
            # KV subscribers come back after cuts and restarts (backoff at most 5 s).
            ok = poll(lambda: msum(router.metrics(), "router_kv_subscriber_connected") == rows, 20.0, 0.25)
            settle["kv_subscribers_connected"] = f"{msum(router.metrics(), 'router_kv_subscriber_connected'):g}/{rows}"
            if not ok:
                failures.append(f"KV subscribers not all connected 20 s after the load: "
                                f"{settle['kv_subscribers_connected']}")
            final = router.metrics()
            report["metrics"] = {name: by_labels(final, name) for name in REPORTED_COUNTERS}
            report["per_config_counters_summed"] = {
                name: chaos.earlier_configs[name] + msum(final, name) for name in PER_CONFIG_COUNTERS}
            report["migrations_total"] = msum(final, MIGRATIONS) if has_metric(final, MIGRATIONS) else "n/a"
            report["migrations"] = {k.removeprefix("outcome="): v for k, v in by_labels(final, MIGRATIONS).items()}
            report["router_requests_total"] = msum(final, "router_requests_total")
            report["configurations"] = int(msum(final, "router_config_generation"))
        else:
            failures.append("serve was not running at the end of the load")
            report["migrations_total"] = "n/a"
        report["settle"] = settle
        rss_stop.set()

        # Results.
        counts = {k: dict(results.counts[k]) for k in KINDS}
        totals = collections.Counter()
        for k in KINDS:
            totals.update(results.counts[k])
        report["requests"] = {
            "by_kind": counts,
            "total": {o: totals.get(o, 0) for o in OUTCOMES},
            "details": [{"outcome": o, "detail": d, "n": n} for (o, d), n in sorted(results.details.items())],
            "details_by_kind": [{"kind": k, "outcome": o, "detail": d, "n": n}
                                for (k, o, d), n in sorted(results.details_by_kind.items())],
            "with_session": dict(results.with_session),
            "x_router_session": dict(results.session_headers),
            "x_router_worker": dict(results.workers),
            "latency_completed_s": {k: _percentiles(v) for k, v in results.latency.items()},
            "examples": results.examples,
            "load_seconds": round(load_end - load_start, 1),
        }
        lost = totals.get("lost", 0)
        if lost:
            failures.append(f"{lost} requests lost (no answer and no clear error): "
                            + ", ".join(f"{d}: {n}" for (o, d), n in sorted(results.details.items()) if o == "lost"))
        # Turned away by admission before the stream began: over capacity, not a failed stream.
        stream_failed = sum(n for (k, o, d), n in results.details_by_kind.items()
                            if k.endswith("+stream") and o == "failed_clear" and not d.startswith("http_429_"))
        report["stream_failed_clear"] = stream_failed
        report["refusals"] = [{"status": st, "reason": r, "class": c, "n": n}
                              for (st, r, c), n in sorted(results.refusals.items())]
        report["refusal_problems"] = dict(results.refusal_problems)
        report["refusal_problem_examples"] = results.refusal_problem_examples
        report["by_class"] = [{"class": c, "outcome": o, "n": n} for (c, o), n in sorted(results.classes.items())]
        if results.refusal_problems:
            failures.append(f"{sum(results.refusal_problems.values())} refusals (429/503) without their reason: "
                            + ", ".join(f"{p}: {n}" for p, n in sorted(results.refusal_problems.items())))
        shed = sum(n for (st, _r, _c), n in results.refusals.items() if st == 429)
        report["shed_429"] = shed
        # Operator truth: the router counts every refusal the clients saw, by class and reason.
        if router_alive and "metrics" in report:
            counted = {k: v for k, v in report["metrics"].get("router_admission_rejected_total", {}).items()
                       if v and k.rsplit("reason=", 1)[-1] in ADMISSION_REASONS}
            seen = collections.Counter()
            for (st, reason, c), n in results.refusals.items():
                if st == 429 and reason in ADMISSION_REASONS:
                    seen[f"class={c},reason={reason}"] += n
            if counted != {k: float(v) for k, v in seen.items()}:
                failures.append(f"router_admission_rejected_total {counted} differs from the 429s the clients got "
                                f"{dict(seen)}")
        if a.over_capacity and not shed:
            failures.append("--over-capacity: no request was turned away (429): the load never went over capacity")
        if a.expect_no_stream_failures and stream_failed:
            failures.append(f"--expect-no-stream-failures: {stream_failed} streamed requests failed")
        if sum(totals.values()) == 0:
            failures.append("no request completed at all")

        # RSS: the first and last fifth of the load.
        rss = report["rss"] = rss_report(samples, load_start - t0, load_end - t0, a.rss_growth_mib, a.rss_max_mib)
        if rss.get("growth_mib") is None:
            failures.append(f"serve's RSS: {rss.get('note')}")
        elif rss["growth_mib"] > a.rss_growth_mib:
            failures.append(f"serve's RSS peaked {rss['growth_mib']:.1f} MiB higher in the last third of the load "
                            f"than in the first, over the bound of {a.rss_growth_mib:g} MiB")
        elif rss["max_mib"] > a.rss_max_mib:
            failures.append(f"serve's RSS reached {rss['max_mib']:.1f} MiB, over the cap of {a.rss_max_mib:g} MiB")

        report["router_alive_at_end"] = router_alive
        if router_alive:
            code = router.proc.stop(timeout=40)
            report["router_exit_on_sigterm"] = code
            if code != 0:
                failures.append(f"serve exited {code} on SIGTERM (expected 0)")
    except ChaosError as e:
        failures.append(str(e))
    except KeyboardInterrupt:
        failures.append("interrupted")
    finally:
        stop.set()
        if router:
            router.proc.stop(5)
        for e in engines:
            e.proc.stop(5)
            for r in e.relays:
                r.close()
        if redis:
            redis.proc.stop(5)
    report["passed"] = not failures
    report["elapsed_s"] = round(time.monotonic() - t0, 1)
    (out / "chaos.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    (out / "chaos.md").write_text(markdown(report))
    LOG(f"report: {out / 'chaos.md'}")
    for f in failures:
        LOG(f"FAILED: {f}")
    LOG("PASSED" if not failures else f"FAILED ({len(failures)} checks)")
    return 0 if not failures else 1


def _percentiles(v: list[float]) -> dict:
    if not v:
        return {}
    v = sorted(v)
    return {"p50": round(v[len(v) // 2], 3), "p99": round(v[min(len(v) - 1, int(len(v) * 0.99))], 3),
            "max": round(v[-1], 3)}


def rss_report(samples, load_from: float, load_to: float, bound: float, cap: float) -> dict:
    """serve's RSS over the load. Growth is the last third's peak over the first third's: the
    first third takes the warm-up (allocator arenas, blocking threads, the KV index filling up),
    so on a plateau the growth is about 0 and a leak shows as what the middle third added."""
    during = [(t, r, th) for t, r, th in samples if load_from <= t <= load_to]
    if len(during) < 9:
        return {"samples": len(samples), "growth_mib": None, "note": "too few samples"}
    span = load_to - load_from
    first = [r for t, r, _ in during if t <= load_from + span / 3]
    last = [r for t, r, _ in during if t >= load_to - span / 3]
    return {
        "samples": len(samples),
        "start_mib": round(samples[0][1], 1),
        "first_third_max_mib": round(max(first), 1),
        "last_third_max_mib": round(max(last), 1),
        "max_mib": round(max(r for _, r, _ in during), 1),
        "growth_mib": round(max(last) - max(first), 1),
        "bound_mib": bound,
        "cap_mib": cap,
        "threads_max": max(th for _, _, th in during),
        "end_mib": round(samples[-1][1], 1),
        "series": [[round(t, 1), round(r, 1), th] for t, r, th in samples[:: max(1, len(samples) // 120)]],
    }


def markdown(r: dict) -> str:
    req = r.get("requests", {})
    lines = [f"# Chaos test: {'PASSED' if r['passed'] else 'FAILED'}", ""]
    lines.append(f"Seed {r['seed']}, {r['duration_s']:.0f} s of load, started {r['started_utc']}, "
                 f"{r.get('elapsed_s', 0):.0f} s in all.")
    if r.get("command"):
        lines += ["", "```sh", r["command"], "```"]
    s = r.get("setup", {})
    if s:
        timeouts = ", ".join(f"{k} {v}" for k, v in s["router_timeouts_ms"].items())
        lines += ["", f"{s['engines']} mock engines x {s['dp_size']} data-parallel ranks, their KV events through "
                  f"relays the script cuts; `serve` on `{s['base_config']}` (two-tier, soft affinity) with a Redis "
                  f"session store, `serve.retries` {s['retries']} (reloads toggle 2 and 3) and timeouts "
                  f"({timeouts}); {s['concurrency']} closed-loop clients, {s['session_share']:.0%} of the requests "
                  f"in conversations with an `x-session-id`, client timeout {s['client_timeout_s']:.0f} s."]
        if s.get("over_capacity"):
            lines += ["", f"Over capacity (`--over-capacity`): engines with `--max-num-seqs "
                      f"{s['engine_max_num_seqs']}`, requests of the classes "
                      + ", ".join(f"`{n}` {w:.0%}" for n, w in s["classes"])
                      + f" (`x-router-priority-class`; `default` without the header), the overlay "
                      f"`{OVER_CAPACITY_OVERLAY.name}`."]
        if s.get("overlay"):
            lines += ["", f"Config overlay: `{json.dumps(s['overlay'])}`"]
    if r["failures"]:
        lines += ["", "## Failed checks", ""] + [f"- {f}" for f in r["failures"]]
    if req:
        lines += ["", "## Requests", "", "| kind | completed | failed_clear | lost |", "|---|---:|---:|---:|"]
        for k in KINDS:
            c = req["by_kind"].get(k, {})
            lines.append(f"| {k} | {c.get('completed', 0)} | {c.get('failed_clear', 0)} | {c.get('lost', 0)} |")
        t = req["total"]
        lines.append(f"| **all** | **{t['completed']}** | **{t['failed_clear']}** | **{t['lost']}** |")
        migrations = r.get("migrations") or {}
        by_outcome = ", ".join(f"{o} {v:g}" for o, v in sorted(migrations.items()))
        lines += ["", f"Migrated (`{MIGRATIONS}`): {r.get('migrations_total')}"
                  + (f" ({by_outcome})" if by_outcome else "") + ". "
                  f"Requests with a session: {req['with_session']}; `x-router-session` on them: "
                  f"{req['x_router_session']}. Per worker (`x-router-worker`): {req['x_router_worker']}. "
                  f"The router counted {r.get('router_requests_total', 'n/a')} requests "
                  f"(`router_requests_total`) in {req['load_seconds']} s of load."]
        lines += ["", "| kind | outcome | detail | n |", "|---|---|---|---:|"]
        for d in req["details_by_kind"]:
            if d["outcome"] != "completed":
                lines.append(f"| {d['kind']} | {d['outcome']} | `{d['detail']}` | {d['n']} |")
        refusals = r.get("refusals") or []
        if refusals:
            problems = r.get("refusal_problems") or {}
            lines += ["", "### Turned away (429 and 503), by `x-router-rejected-reason`", "",
                      f"{sum(x['n'] for x in refusals)} refusals; without their reason (the header, equal to "
                      f"`error.code`, and `retry-after` on a 429): {sum(problems.values())}"
                      + (" (" + ", ".join(f"{p}: {n}" for p, n in sorted(problems.items())) + ")" if problems else "")
                      + ".", "", "| status | reason | class | n |", "|---:|---|---|---:|"]
            lines += [f"| {x['status']} | `{x['reason']}` | {x['class']} | {x['n']} |" for x in refusals]
        by_class = r.get("by_class") or []
        if len({x["class"] for x in by_class}) > 1:
            lines += ["", "Outcomes per class: " + "; ".join(
                f"{c}: " + ", ".join(f"{x['outcome']} {x['n']}" for x in by_class if x["class"] == c)
                for c in sorted({x["class"] for x in by_class}))]
        lines += ["", "Completed latency (s): " + "; ".join(
            f"{k} p50 {v.get('p50')} p99 {v.get('p99')}" for k, v in req["latency_completed_s"].items() if v)]
        if req["examples"]:
            lines += ["", "### Examples of each outcome that is not `completed`", ""]
            for case, exs in sorted(req["examples"].items()):
                lines.append(f"- `{case}`:")
                for ex in exs[:2]:
                    lines.append(f"  - `{json.dumps(ex)[:700]}`")
    if r.get("events") is not None:
        lines += ["", "## Events", "", "| t s | event | details |", "|---:|---|---|"]
        for ev in r["events"]:
            rest = {k: v for k, v in ev.items() if k not in ("t_s", "event")}
            lines.append(f"| {ev['t_s']:.1f} | {ev['event']} | {', '.join(f'{k}={v}' for k, v in rest.items())} |")
        per = collections.Counter(ev["event"] for ev in r["events"])
        lines += ["", "Per type: " + ", ".join(f"{k} {v}" for k, v in sorted(per.items()))]
    st = r.get("settle", {})
    if st:
        lines += ["", "## After the load", "",
                  f"Gauges back to 0: {st.get('gauges_zero')} in {st.get('took_s')} s "
                  f"({', '.join(f'{k}={v:g}' for k, v in st.get('gauges', {}).items())}); "
                  f"KV subscribers connected: {st.get('kv_subscribers_connected')}. "
                  f"serve alive at the end: {r.get('router_alive_at_end')}, exit on SIGTERM: "
                  f"{r.get('router_exit_on_sigterm')}."]
    rss = r.get("rss", {})
    if rss.get("growth_mib") is not None:
        lines += ["", f"serve's RSS (MiB): {rss['start_mib']} at the start of the load, peak of its first third "
                  f"{rss['first_third_max_mib']}, of its last third {rss['last_third_max_mib']}: growth "
                  f"{rss['growth_mib']} (bound {rss['bound_mib']:g}); max {rss['max_mib']} (cap {rss['cap_mib']:g}), "
                  f"{rss['end_mib']} at the end; threads at most {rss['threads_max']}."]
    m = r.get("metrics")
    if m:
        lines += ["", "## Router counters at the end", ""]
        summed = r.get("per_config_counters_summed", {})
        for name, vals in m.items():
            if name in summed:
                lines.append(f"- `{name}`: {summed[name]:g} (summed over the {r.get('configurations', '?')} "
                             f"configurations: it starts from 0 at each reload)")
            elif vals:
                lines.append(f"- `{name}`: " + ", ".join(f"{k} {v:g}" for k, v in sorted(vals.items())))
    if s.get("processes"):
        lines += ["", "## Commands", ""]
        for name, argv in s["processes"].items():
            lines.append(f"- {name}: `{shlex.join(argv).replace(str(REPO) + '/', '')}`")
    return "\n".join(lines) + "\n"


def _interrupt(_signum, _frame):
    raise KeyboardInterrupt


if __name__ == "__main__":
    # SIGTERM and SIGHUP end the run as Ctrl-C does: every child is stopped on the way out.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupt)
    sys.exit(main())
