#!/usr/bin/env python3
"""The tight-KV workload family, in `router-host replay`.

For every workload of the family (tenants, shared-prefix length, sessions, turns, arrival
rate, and the engines' KV capacity as a fraction of the workload's working set) and every
seed: generate the workload (`--write-workload`), measure its working set, size each engine's KV
from it, and replay it through the shipped configs and the pooled-LRU reference. Writes
`results/replay.md` and `results/replay.json` beside this file (`--out DIR`).

Working set: at each arrival, the blocks shared by more than one session (the tenants' system
prompts) plus, for every live session (between its first and last turn), the blocks of its
latest prompt that are its own; averaged over the arrivals. A cache that held it could reuse
every prompt block the ideal counts.

usage: replay.py [--router-host PATH] [--plugin-dir DIR] [--out DIR] [--seeds 42,43]
                 [--workloads a,b] [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
BLOCK_TOKENS = 512  # replay's generated workloads: tokens per block
REPO = HERE.parents[2]

# The shipped configs (built into replay) and what the table calls them.
CONFIGS = [
    ("builtin:default", "default (built-in)"),
    ("builtin:two-tier", "two-tier"),
    ("builtin:two-tier-sticky", "two-tier-sticky"),
    ("builtin:round-robin", "round-robin"),
]


@dataclass(frozen=True)
class Workload:
    name: str
    tenants: int  # distinct system prompts (`--system-prompts`)
    prefix_tokens: int  # tokens per system prompt
    turns: int  # mean turns per session
    sessions: int
    rate: float  # requests per second
    think_s: float  # mean seconds between a session's turns
    user_tokens: int = 600
    output_tokens: int = 100
    workers: int = 2
    kv_fraction: float = 0.25  # each engine's KV x workers / working set

    def generator_args(self, seed: int) -> list[str]:
        return [
            "--workers", str(self.workers), "--system-prompts", str(self.tenants),
            "--system-prompt-tokens", str(self.prefix_tokens), "--sessions", str(self.sessions),
            "--turns", str(self.turns), "--user-tokens", str(self.user_tokens),
            "--output-tokens", str(self.output_tokens), "--rate", str(self.rate),
            "--think-time", str(self.think_s), "--seed", str(seed),
        ]


# Two regimes, each tight (the engines together hold a quarter to a half of the working set),
# plus points with more room. Requests are few at a time (two a second), so the engines
# are rarely busy and what separates policies is what their caches keep:
# - "chat": sessions come back after 20 s, so a session's own history is worth keeping and
#   placement decides whether it survives;
# - "idle": sessions come back after 90 s; many are live, their histories rarely survive, and the
#   tenants' system prompts are what is worth keeping.
CHAT = dict(rate=2.0, think_s=20.0, sessions=300)
IDLE = dict(rate=2.0, think_s=90.0, sessions=400)
FAMILY = [
    Workload("chat-2-tenants-half", tenants=2, prefix_tokens=4096, turns=5, kv_fraction=0.5, **CHAT),
    Workload("chat-4-tenants-half", tenants=4, prefix_tokens=4096, turns=5, kv_fraction=0.5, **CHAT),
    Workload("chat-8-tenants-half", tenants=8, prefix_tokens=4096, turns=5, kv_fraction=0.5, **CHAT),
    Workload("chat-4-tenants-full", tenants=4, prefix_tokens=4096, turns=5, kv_fraction=1.0, **CHAT),
    Workload("idle-4-tenants-quarter", tenants=4, prefix_tokens=4096, turns=5, kv_fraction=0.25, **IDLE),
    Workload("idle-8-tenants-quarter", tenants=8, prefix_tokens=4096, turns=5, kv_fraction=0.25, **IDLE),
    Workload("idle-4-tenants-short-prefix-quarter", tenants=4, prefix_tokens=1024, turns=8, kv_fraction=0.25,
             **IDLE),
    Workload("idle-8-tenants-4-workers-quarter", tenants=8, prefix_tokens=4096, turns=5, kv_fraction=0.25,
             workers=4, **{**IDLE, "rate": 4.0, "sessions": 800}),
    Workload("chat-4-tenants-roomy", tenants=4, prefix_tokens=4096, turns=5, kv_fraction=4.0, **CHAT),
]
QUICK = [Workload("quick-chat-4-tenants-half", tenants=4, prefix_tokens=2048, turns=4, kv_fraction=0.5,
                  **{**CHAT, "sessions": 60})]

# An engine must hold this many of the workload's largest requests (prompt and output), or the
# workload is not "tight KV" but "requests that do not fit".
MIN_LARGEST_REQUESTS_PER_ENGINE = 1.25

# The goal: the best shipped policy within this much of the reference's hit rate and this many
# times its TTFT p99.
HIT_MARGIN = 0.03
TTFT_FACTOR = 2.0


def log(msg: str) -> None:
    print(f"[kv-family replay {time.strftime('%H:%M:%S', time.gmtime())}] {msg}", file=sys.stderr, flush=True)


def working_set(path: Path) -> dict:
    """Blocks shared by sessions, and the mean over arrivals of shared + live sessions' own."""
    requests = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    requests.sort(key=lambda r: r["timestamp"])
    sessions_of: dict[int, set[str]] = {}
    for r in requests:
        for b in r["hash_ids"]:
            sessions_of.setdefault(b, set()).add(r["session_id"])
    shared = {b for b, s in sessions_of.items() if len(s) > 1}
    last_arrival: dict[str, float] = {}
    for r in requests:
        last_arrival[r["session_id"]] = r["timestamp"]
    own_now: dict[str, int] = {}
    total = 0
    for r in requests:
        sid = r["session_id"]
        own_now[sid] = sum(1 for b in r["hash_ids"] if b not in shared)
        t = r["timestamp"]
        live = sum(n for s, n in own_now.items() if last_arrival[s] >= t)
        total += len(shared) + live
    largest = max(len(r["hash_ids"]) + math.ceil(max(r["output_length"], 1) / BLOCK_TOKENS) for r in requests)
    return {
        "requests": len(requests),
        "largest_request_blocks": largest,
        "shared_blocks": len(shared),
        "working_set_blocks": round(total / max(len(requests), 1), 1),
    }


def replay(bin_: Path, plugin_dir: Path, args: list[str], out: Path, configs: list[tuple[str, str]]) -> dict:
    cmd = [str(bin_), "replay", "--plugin-dir", str(plugin_dir), *args, "--json", str(out)]
    for config, _ in configs:
        cmd += ["-c", config]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"replay failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-2000:]}")
    # Repository-relative, so the command reads the same in every checkout.
    shown = " ".join(cmd).replace(f"{REPO}/", "")
    return {"command": shown, "report": json.loads(out.read_text())}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--router-host", type=Path, default=REPO / "target" / "release" / "router-host")
    parser.add_argument("--plugin-dir", type=Path, default=REPO / "target" / "release")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--seeds", default="42,43")
    parser.add_argument("--workloads", help="comma-separated names (default: the whole family)")
    parser.add_argument("--quick", action="store_true", help="one small workload, one seed: a smoke run")
    parser.add_argument("-c", "--config", action="append", default=[], type=Path,
                        help="a config of yours to run beside the shipped ones (repeatable)")
    a = parser.parse_args()
    configs = CONFIGS + [(str(c.resolve()), c.stem) for c in a.config]
    if not a.router_host.is_file():
        raise SystemExit(f"no {a.router_host}: run `cargo build --release` first")
    family = QUICK if a.quick else FAMILY
    if a.workloads:
        wanted = [w.strip() for w in a.workloads.split(",") if w.strip()]
        unknown = [w for w in wanted if w not in {x.name for x in FAMILY}]
        if unknown:
            raise SystemExit(f"unknown workload(s) {unknown}; the family: {[w.name for w in FAMILY]}")
        family = [w for w in FAMILY if w.name in wanted]
    seeds = [int(s) for s in a.seeds.split(",")][: 1 if a.quick else None]
    work = REPO / "target" / "kv-family"
    work.mkdir(parents=True, exist_ok=True)
    a.out.mkdir(parents=True, exist_ok=True)

    results = []
    for wl in family:
        for seed in seeds:
            trace = work / f"{wl.name}-{seed}.jsonl"
            gen = [str(a.router_host), "replay", *wl.generator_args(seed), "--write-workload", str(trace),
                   "-c", "builtin:round-robin"]
            subprocess.run(gen, capture_output=True, text=True, timeout=600, check=True)
            ws = working_set(trace)
            kv = max(1, math.ceil(wl.kv_fraction * ws["working_set_blocks"] / wl.workers))
            log(f"{wl.name} seed {seed}: working set {ws['working_set_blocks']} blocks, {kv} per engine")
            if kv < MIN_LARGEST_REQUESTS_PER_ENGINE * ws["largest_request_blocks"]:
                raise SystemExit(
                    f"{wl.name}: {kv} KV blocks per engine hold fewer than {MIN_LARGEST_REQUESTS_PER_ENGINE} of "
                    f"its largest requests ({ws['largest_request_blocks']} blocks): more live sessions (longer "
                    "think time, more sessions) or a larger kv_fraction")
            run = replay(a.router_host, a.plugin_dir, [*wl.generator_args(seed), "--kv-blocks", str(kv)],
                         work / f"{wl.name}-{seed}.json", configs)
            rep = run["report"]
            ref = rep["configs"][0]["pooled_lru_reference"]
            rows = []
            for (config, label), c in zip(configs, rep["configs"]):
                rows.append({
                    "config": config, "label": label, "hit_rate": c["hit_rate"],
                    "ttft_p50_ms": c["ttft_ms"]["p50"], "ttft_p99_ms": c["ttft_ms"]["p99"],
                    "errors": c["errors"],
                })
            results.append({
                "workload": asdict(wl), "seed": seed, **ws, "kv_blocks_per_engine": kv,
                "ideal_hit_rate": rep["workload"].get("ideal_hit_rate"),
                "reference": {"hit_rate": ref["hit_rate"], "ttft_p99_ms": ref["ttft_ms"]["p99"]},
                "configs": rows, "command": run["command"],
            })
    (a.out / "replay.json").write_text(json.dumps({"hit_margin": HIT_MARGIN, "ttft_factor": TTFT_FACTOR,
                                                   "results": results}, indent=1) + "\n")
    (a.out / "replay.md").write_text(report(results, configs))
    print(report(results, configs))
    return 0


def report(results: list[dict], configs: list[tuple[str, str]]) -> str:
    out = [
        "# The tight-KV family in replay",
        "",
        "Generated by `router-host/scripts/kv_family/replay.py`. Each cell: hit rate / TTFT p99 ms.",
        f"Goal: within {HIT_MARGIN} of the pooled-LRU reference's hit rate and {TTFT_FACTOR:g}x its TTFT p99"
        " (**bold**: met).",
        "",
    ]
    labels = [label for _, label in configs]

    def met(c: dict, ref: dict) -> bool:
        return (c["hit_rate"] >= ref["hit_rate"] - HIT_MARGIN
                and c["ttft_p99_ms"] <= TTFT_FACTOR * ref["ttft_p99_ms"])

    out.append("Within the goal, of " + f"{len(results)} workload x seed points: " + ", ".join(
        f"{label} {sum(met(r['configs'][i], r['reference']) for r in results)}" for i, label in enumerate(labels)))
    out.append("")
    out.append("| workload | seed | working set | KV per engine | reference | " + " | ".join(labels) + " |")
    out.append("|---|---:|---:|---:|---:|" + "---:|" * len(labels))
    for r in results:
        ref = r["reference"]
        cells = []
        for c in r["configs"]:
            cell = f"{c['hit_rate']:.3f} / {c['ttft_p99_ms']:,.0f}"
            cells.append(f"**{cell}**" if met(c, ref) else cell)
        out.append(
            f"| {r['workload']['name']} | {r['seed']} | {r['working_set_blocks']:,.0f} | {r['kv_blocks_per_engine']}"
            f" x {r['workload']['workers']} | {ref['hit_rate']:.3f} / {ref['ttft_p99_ms']:,.0f} | "
            + " | ".join(cells) + " |"
        )
    out += ["", "Workloads (all 512-token blocks; `--rate` requests/s, `--think-time` s):", ""]
    seen = set()
    for r in results:
        w = r["workload"]
        if w["name"] in seen:
            continue
        seen.add(w["name"])
        out.append(f"- `{w['name']}`: {w['tenants']} tenants x {w['prefix_tokens']}-token system prompts, "
                   f"{w['sessions']} sessions x ~{w['turns']} turns, user {w['user_tokens']} / output "
                   f"{w['output_tokens']} tokens, rate {w['rate']:g}, think {w['think_s']:g} s, {w['workers']} "
                   f"workers, KV = {w['kv_fraction']:g} x working set")
    out += ["", "Commands (one per workload and seed):", "", "```"]
    out += [r["command"] for r in results]
    out += ["```", ""]
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
