#!/usr/bin/env python3
"""Side by side: NVIDIA Dynamo's mocker + KV router replay vs. `router-host replay`.

Runs one Mooncake trace through
  * Dynamo's offline trace replay (`dynamo._core.run_mocker_trace_replay`, PyPI
    `ai-dynamo-runtime`, vLLM mocker) with its KV router, several times (it is not
    deterministic), and with round-robin (the engine-model sanity check), and
  * our `router-host replay` with the configs of OUR_CONFIGS,
with the same cluster (workers, KV blocks, block size, token budget, batch limit) and the
same linear step timing, then prints one table and writes it as Markdown and JSON.

Dynamo is installed into a Python venv in a cache directory outside the repository
(`${XDG_CACHE_HOME:-$HOME/.cache}/router-bench/dynamo-venv`); a second run reuses it.
Its mocker gets our linear timing through a "planner profile" NPZ file written here.

Our side uses the Python standard library only. This same file is also run with the
venv's interpreter as the Dynamo worker (`--dynamo-worker`), so that nothing of Dynamo is
imported into the calling interpreter.

See docs/replay.md ("Side by side with Dynamo") for usage, results and caveats, and `--help`.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import io
import json
import math
import os
import shutil
import struct
import subprocess
import sys
import time
import zipfile
from pathlib import Path

# The version this script was written and measured against. The latest release (1.6.1) replaced
# the mocker's `planner_profile_data` NPZ timing model with a "canonical" engine config that
# rejects it, so a linear timing profile cannot be given there; do not float this pin.
DYNAMO_PACKAGE = "ai-dynamo-runtime"
DYNAMO_VERSION = "1.5.1"

SCRIPT = Path(__file__).resolve()
REPO_ROOT = SCRIPT.parents[2]
DEFAULT_TRACE = REPO_ROOT.parent / "shared" / "traces" / "mooncake_conversation" / "conversation_trace.jsonl"
# Our configs: (label, file relative to the repository, or None for a config this script writes
# into its work directory from GENERATED_CONFIGS).
OUR_CONFIGS = [
    ("default", "examples/replay/default.yaml"),
    ("default (Dynamo weights)", None),
    ("two-tier (active_requests)", "examples/two-tier-active-requests.yaml"),
    ("two-tier", "examples/replay/two-tier.yaml"),
    ("round-robin", "examples/replay/round-robin.yaml"),
]
# The built-in `default` with Dynamo's weights, whole-prompt booking and lowest-row ties: the
# host's defaults before the measured-best settings became the defaults (docs/configuration.md
# names these keys as the way back).
DYNAMO_WEIGHTS = ("default_selector:\n  prefill_load_scale: 1.0\n  overlap_credit: 1.0\n"
                  "  tie_break: lowest_row\n  live_eviction_weight: 0.0\n"
                  "worker_selection:\n  aggregated: default\n")
GENERATED_CONFIGS = {
    "default (Dynamo weights)": ("dynamo-weights.yaml", "booking:\n  prefill: prompt\n" + DYNAMO_WEIGHTS),
    # --booking-variants: the same with Dynamo's decode booking, then with all of Dynamo's
    # booking (prefill as isl - cached overlap too), and default.yaml with deduplicated decode.
    "default (Dynamo weights, decode deduplicated)": (
        "dynamo-weights-decode-deduplicated.yaml",
        "booking:\n  prefill: prompt\n  decode: deduplicated\n" + DYNAMO_WEIGHTS,
    ),
    "default (Dynamo weights, Dynamo's booking)": (
        "dynamo-weights-dynamo-booking.yaml",
        "booking:\n  prefill: uncached\n  decode: deduplicated\n" + DYNAMO_WEIGHTS,
    ),
    "default, decode deduplicated": (
        "default-decode-deduplicated.yaml",
        "booking:\n  decode: deduplicated\nworker_selection:\n  aggregated: default\n",
    ),
}
# Added by --booking-variants, after the default list.
BOOKING_VARIANTS = [
    ("default (Dynamo weights, decode deduplicated)", None),
    ("default (Dynamo weights, Dynamo's booking)", None),
    ("default, decode deduplicated", None),
]


class Fail(Exception):
    """A precondition or a step failed; the message says what is missing or wrong."""


def log(msg: str) -> None:
    print(f"[side-by-side] {msg}", file=sys.stderr, flush=True)


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "router-bench"


def niced(cmd: list[str], nice: int) -> list[str]:
    if nice and shutil.which("nice"):
        return ["nice", "-n", str(nice), *cmd]
    return cmd


def run_bounded(cmd, timeout_s, what, **kw):
    """Run `cmd`, killing it after `timeout_s` seconds; raise Fail with `what` on error."""
    try:
        proc = subprocess.run(cmd, timeout=timeout_s, **kw)
    except subprocess.TimeoutExpired:
        raise Fail(f"{what}: still running after {timeout_s:.0f} s, stopped (raise --timeout to allow more)")
    except FileNotFoundError as e:
        raise Fail(f"{what}: cannot start {cmd[0]!r}: {e}")
    if proc.returncode != 0:
        tail = ""
        if isinstance(proc.stderr, (str, bytes)) and proc.stderr:
            err = proc.stderr.decode() if isinstance(proc.stderr, bytes) else proc.stderr
            tail = "\n" + "\n".join(err.strip().splitlines()[-25:])
        raise Fail(f"{what}: exit status {proc.returncode}{tail}")
    return proc


# ----------------------------------------------------------------------------------------
# Percentiles and summaries (same convention as router-host: linear between order statistics)


def percentile(sorted_vals: list[float], q: float) -> float:
    if not sorted_vals:
        return 0.0
    pos = (len(sorted_vals) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_vals) - 1)
    frac = pos - lo
    return sorted_vals[lo] + (sorted_vals[hi] - sorted_vals[lo]) * frac


def pct_obj(vals: list[float]) -> dict:
    s = sorted(vals)
    return {
        "p50": percentile(s, 50),
        "p90": percentile(s, 90),
        "p99": percentile(s, 99),
        "mean": (sum(s) / len(s)) if s else 0.0,
        "max": s[-1] if s else 0.0,
    }


# ----------------------------------------------------------------------------------------
# The timing profile: Dynamo's mocker `planner_profile_data` NPZ (prefill 1-D, decode 2-D)


def _npy_f64(values: list[float], shape: tuple[int, ...]) -> bytes:
    """One little-endian float64 C-order array in .npy format version 1.0."""
    dims = ", ".join(str(d) for d in shape) + ("," if len(shape) == 1 else "")
    header = "{'descr': '<f8', 'fortran_order': False, 'shape': (%s), }" % dims
    pad = (64 - (10 + len(header) + 1) % 64) % 64
    header = header + " " * pad + "\n"
    return (
        b"\x93NUMPY\x01\x00"
        + struct.pack("<H", len(header))
        + header.encode("latin1")
        + struct.pack("<%dd" % len(values), *values)
    )


def write_timing_profile(path: Path, step_ms: float, prefill_ms_per_token: float, decode_ms_per_seq: float,
                         max_tokens: int, max_context: int) -> dict:
    """Write the NPZ that makes the mocker's pass time match our linear step model.

    The vLLM mocker (ai-dynamo-runtime 1.5.1, aisimulate-core 0.12) times one pass as
        prefill(batch_count * (mean_isl - mean_prefix))            -- 1-D interpolation
      + decode(active_kv_tokens = sum of emitting seqs' lengths,
               context_length   = active_kv_tokens / emitting seqs) -- bilinear, only if a token is emitted
    Ours:  step = step_ms + prefill_ms_per_token * prefill_tokens + decode_ms_per_seq * decoding.
    So: prefill(x) = prefill_ms_per_token * x (a line through 0), and
        decode(x, y) = step_ms + decode_ms_per_seq * x / y (x / y = emitting sequences).
    x / y is linear in x (2 grid points are exact) and 1/y is sampled on a geometric grid
    (ratio 1.02: bilinear error below 0.01 %). Both interpolators extrapolate linearly.
    """
    prefill_x = [0.0, float(max_tokens)]
    prefill_y = [0.0, prefill_ms_per_token * max_tokens]
    kv_x = [0.0, float(max_tokens)]
    ctx_y = [1.0]
    while ctx_y[-1] < max_context:
        ctx_y.append(ctx_y[-1] * 1.02)
    itl = [step_ms + decode_ms_per_seq * x / y for x in kv_x for y in ctx_y]
    arrays = {
        "prefill_isl": (prefill_x, (len(prefill_x),)),
        "prefill_ttft_ms": (prefill_y, (len(prefill_y),)),
        "decode_active_kv_tokens": (kv_x, (len(kv_x),)),
        "decode_context_length": (ctx_y, (len(ctx_y),)),
        "decode_itl": (itl, (len(kv_x), len(ctx_y))),
    }
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        for name, (vals, shape) in arrays.items():
            z.writestr(name + ".npy", _npy_f64(vals, shape))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(buf.getvalue())
    tmp.replace(path)
    return {
        "file": str(path),
        "prefill": f"{prefill_ms_per_token} ms x new prompt tokens of the pass",
        "decode": f"{step_ms} ms + {decode_ms_per_seq} ms x sequences emitting a token in the pass",
        "decode_grid": [len(kv_x), len(ctx_y)],
    }


# ----------------------------------------------------------------------------------------
# Dynamo venv


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def ensure_dynamo_venv(venv: Path, timeout_s: float, nice: int) -> dict:
    """Create the venv and install the pinned package unless a previous run did."""
    stamp = venv / ".router-bench-installed"
    spec = f"{DYNAMO_PACKAGE}=={DYNAMO_VERSION}"
    py = venv_python(venv)
    if stamp.exists() and stamp.read_text().strip() == spec and py.exists():
        probe = subprocess.run([str(py), "-c", "import dynamo._core"], capture_output=True, text=True)
        if probe.returncode == 0:
            return {"venv": str(venv), "package": spec, "installed_now": False}
        log(f"venv {venv} is stamped but `import dynamo._core` fails; reinstalling")
    if venv.exists():
        shutil.rmtree(venv)
    venv.parent.mkdir(parents=True, exist_ok=True)
    if sys.version_info < (3, 10):
        raise Fail(f"{spec} needs Python >= 3.10; this is {sys.version.split()[0]} ({sys.executable})")
    t0 = time.monotonic()
    uv = shutil.which("uv")
    if uv:
        log(f"installing {spec} into {venv} with uv")
        run_bounded(niced([uv, "venv", "--python", sys.executable, str(venv)], nice), timeout_s,
                    "uv venv", capture_output=True, text=True)
        run_bounded(niced([uv, "pip", "install", "--python", str(py), spec], nice), timeout_s,
                    f"uv pip install {spec}", capture_output=True, text=True)
    else:
        log(f"installing {spec} into {venv} with python3 -m venv + pip (uv not found)")
        probe = subprocess.run([sys.executable, "-c", "import venv, ensurepip"], capture_output=True)
        if probe.returncode != 0:
            raise Fail(f"{sys.executable} lacks the venv/ensurepip modules (Debian: apt-get install python3-venv), "
                       "and uv is not on PATH")
        run_bounded(niced([sys.executable, "-m", "venv", str(venv)], nice), timeout_s, "python3 -m venv",
                    capture_output=True, text=True)
        run_bounded(niced([str(py), "-m", "pip", "install", "--disable-pip-version-check", "-q", spec], nice),
                    timeout_s, f"pip install {spec} (is PyPI reachable?)", capture_output=True, text=True)
    run_bounded([str(py), "-c", "import dynamo._core"], 120, f"import dynamo._core from {spec}",
                capture_output=True, text=True)
    stamp.write_text(spec + "\n")
    took = time.monotonic() - t0
    size = sum(f.stat().st_size for f in venv.rglob("*") if f.is_file() and not f.is_symlink())
    log(f"installed {spec} in {took:.1f} s, {size / 2**20:.0f} MiB at {venv}")
    return {"venv": str(venv), "package": spec, "installed_now": True, "install_s": round(took, 1),
            "size_mib": round(size / 2**20)}


# ----------------------------------------------------------------------------------------
# Dynamo worker: runs inside the venv's interpreter


def dynamo_worker(job_path: str) -> int:
    job = json.loads(Path(job_path).read_text())
    from dynamo import _core  # noqa: only available in the venv

    engine = {
        "engine_type": "vllm",
        "num_gpu_blocks": job["kv_blocks"],
        "block_size": job["block_size"],
        "max_num_seqs": job["max_num_seqs"],
        "max_num_batched_tokens": job["max_num_batched_tokens"],
        "enable_prefix_caching": True,
        "enable_chunked_prefill": True,
        "planner_profile_data": job["profile"],
    }
    args = _core.MockEngineArgs.from_json(json.dumps(engine))
    kw = {}
    router = None
    if job["router_mode"] == "kv_router":
        router = _core.KvRouterConfig(**job.get("router_kwargs", {}))
        kw["router_config"] = router
    t0 = time.monotonic()
    res = _core.run_mocker_trace_replay(
        [job["trace"]],
        extra_engine_args=args,
        num_workers=job["workers"],
        router_mode=job["router_mode"],
        trace_block_size=job["block_size"],
        arrival_speedup_ratio=1.0 / job.get("time_scale", 1.0),
        capture_per_request=True,
        **kw,
    )
    wall = time.monotonic() - t0
    summary = res.summary
    per_request = res.per_request or []
    keep = ("arrival_time_ms", "input_length", "output_length", "reused_input_tokens", "ttft_ms", "e2e_latency_ms",
            "decode_worker_idx", "readmission_count", "terminal_status")
    out = {
        "wall_s": wall,
        "summary": {k: v for k, v in summary.items() if isinstance(v, (int, float, str)) or v is None},
        "per_request": [{k: p.get(k) for k in keep} for p in per_request],
        "engine_args": engine,
    }
    if router is not None:
        cfg = {}
        for name in ("overlap_score_weight", "overlap_score_credit", "overlap_score_credit_decay",
                     "prefill_load_scale", "decode_active_request_weight"):
            try:
                cfg[name] = getattr(router, name)
            except Exception:  # property missing in this version
                pass
        cfg["kwargs"] = job.get("router_kwargs", {})
        cfg["constructor_defaults"] = "KvRouterConfig(**kwargs); defaults: router_temperature 0.0, "\
            "use_kv_events true, router_track_active_blocks true, router_assume_kv_reuse true, "\
            "router_track_prefill_tokens true, router_track_output_blocks false, router_queue_threshold None"
        out["router_config"] = cfg
    Path(job["out"]).write_text(json.dumps(out))
    return 0


def run_dynamo(py: Path, job: dict, work: Path, timeout_s: float, nice: int, name: str) -> dict:
    job_file = work / f"job-{name}.json"
    job["out"] = str(work / f"raw-{name}.json")
    job_file.write_text(json.dumps(job))
    env = dict(os.environ)
    env.setdefault("RUST_LOG", "warn")  # the mocker logs every NPZ load at info
    t0 = time.monotonic()
    run_bounded(niced([str(py), str(SCRIPT), "--dynamo-worker", str(job_file)], nice), timeout_s,
                f"Dynamo replay {name}", capture_output=True, text=True, env=env)
    raw = json.loads(Path(job["out"]).read_text())
    raw["process_wall_s"] = time.monotonic() - t0
    return raw


def check_profile_applied(py: Path, base_job: dict, work: Path, timeout_s: float, nice: int, a) -> dict:
    """One 1,024-token request on one worker: TTFT and ITL must follow our formulas.

    The mocker silently falls back to its polynomial model when it cannot read the NPZ,
    so this guards the whole comparison.
    """
    probe_trace = work / "profile-check.jsonl"
    bs = a.block_size
    isl = 2 * bs
    probe_trace.write_text(json.dumps({"timestamp": 0, "input_length": isl, "output_length": 3,
                                       "hash_ids": [10**9 + i for i in range(math.ceil(isl / bs))]}) + "\n")
    job = dict(base_job, trace=str(probe_trace), workers=1, router_mode="round_robin", time_scale=1.0)
    raw = run_dynamo(py, job, work, timeout_s, nice, "profile-check")
    p = raw["per_request"][0]
    want_ttft = a.prefill_ms_per_token * isl + a.step_overhead_ms + a.decode_ms_per_seq
    want_e2e = want_ttft + 2 * (a.step_overhead_ms + a.decode_ms_per_seq)
    ok = abs(p["ttft_ms"] - want_ttft) <= 0.01 * want_ttft and abs(p["e2e_latency_ms"] - want_e2e) <= 0.01 * want_e2e
    if not ok:
        raise Fail(f"Dynamo's mocker did not apply the timing profile {base_job['profile']}: a {isl}-token request "
                   f"got TTFT {p['ttft_ms']:.2f} ms / e2e {p['e2e_latency_ms']:.2f} ms, expected "
                   f"{want_ttft:.2f} / {want_e2e:.2f} (did it fall back to its polynomial model?)")
    return {"request_tokens": isl, "ttft_ms": p["ttft_ms"], "expected_ttft_ms": want_ttft,
            "e2e_ms": p["e2e_latency_ms"], "expected_e2e_ms": want_e2e}


def dynamo_metrics(raw: dict, block_size: int, workers: int) -> dict:
    pr = raw["per_request"]
    done = [p for p in pr if p.get("ttft_ms") is not None]
    prompt_blocks = sum(math.ceil(p["input_length"] / block_size) for p in pr)
    hit_blocks = sum((p.get("reused_input_tokens") or 0) // block_size for p in pr)
    input_tokens = sum(p["input_length"] for p in pr)
    hit_tokens = sum(p.get("reused_input_tokens") or 0 for p in pr)
    per_worker = [0] * workers
    for p in pr:
        w = p.get("decode_worker_idx")
        if w is not None and 0 <= w < workers:
            per_worker[w] += 1
    mean = sum(per_worker) / workers if workers else 0
    return {
        "requests": len(pr),
        "completed": len(done),
        "hit_rate_blocks": hit_blocks / prompt_blocks if prompt_blocks else 0.0,
        "hit_rate_tokens": hit_tokens / input_tokens if input_tokens else 0.0,
        "hit_blocks": hit_blocks,
        "prompt_blocks": prompt_blocks,
        "prefill_tokens": input_tokens - hit_tokens,
        "ttft_ms": pct_obj([p["ttft_ms"] for p in done]),
        "e2e_ms": pct_obj([p["e2e_latency_ms"] for p in done if p.get("e2e_latency_ms") is not None]),
        "requests_per_worker": per_worker,
        "imbalance": (max(per_worker) / mean) if mean else 0.0,
        "readmissions": sum(p.get("readmission_count") or 0 for p in pr),
        "errors": sum(1 for p in pr if p.get("terminal_status") not in (None, "completed")),
        "dynamo_summary": {k: raw["summary"].get(k) for k in (
            "median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "median_e2e_latency_ms", "p99_e2e_latency_ms",
            "prefix_cache_reused_ratio", "completed_requests", "duration_ms")},
        "wall_s": raw.get("wall_s"),
    }


# ----------------------------------------------------------------------------------------
# Our side


def cargo_target_dir() -> Path:
    env = os.environ.get("CARGO_TARGET_DIR")
    if env:
        p = Path(env)
        return p if p.is_absolute() else REPO_ROOT / p
    if shutil.which("cargo"):
        try:
            out = subprocess.run(["cargo", "metadata", "--format-version", "1", "--no-deps"], cwd=REPO_ROOT,
                                 capture_output=True, text=True, timeout=120)
            if out.returncode == 0:
                return Path(json.loads(out.stdout)["target_directory"])
        except (subprocess.TimeoutExpired, ValueError, KeyError):
            pass
    return REPO_ROOT / "target"


def ensure_router_host(explicit: str | None, rebuild: bool, timeout_s: float, nice: int) -> Path:
    if explicit:
        exe = Path(explicit)
        if not exe.is_file():
            raise Fail(f"--router-host {exe}: no such file")
        return exe
    release = cargo_target_dir() / "release"
    exe = release / "router-host"
    plugin = release / "libtwo_tier_cost_fn.so"
    if rebuild or not exe.is_file() or not plugin.is_file():
        if not shutil.which("cargo"):
            raise Fail(f"{exe if not exe.is_file() else plugin} is missing and cargo is not on PATH to build it")
        log(f"building the workspace: cargo build --release (in {REPO_ROOT}; may wait for the cargo lock)")
        run_bounded(niced(["cargo", "build", "--release"], nice), timeout_s, "cargo build --release", cwd=REPO_ROOT)
        if not exe.is_file():
            raise Fail(f"cargo build --release finished but {exe} does not exist")
        if not plugin.is_file():
            raise Fail(f"cargo build --release finished but the two-tier plugin {plugin} does not exist")
    return exe


def git_state() -> str | None:
    """`git describe --always --dirty` of the repository: the binary may hold uncommitted changes."""
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=REPO_ROOT, capture_output=True,
                             text=True, timeout=30)
        return out.stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        return None


def run_ours(exe: Path, a, work: Path, timeout_s: float, nice: int) -> tuple[dict, str]:
    out_json = work / "ours.json"
    cmd = [str(exe), "replay", "--trace", str(a.trace), "--trace-block-size", str(a.block_size),
           "--workers", str(a.workers), "--kv-blocks", str(a.kv_blocks),
           "--max-num-batched-tokens", str(a.max_num_batched_tokens), "--max-num-seqs", str(a.max_num_seqs),
           "--step-overhead-ms", str(a.step_overhead_ms), "--decode-ms-per-seq", str(a.decode_ms_per_seq),
           "--prefill-ms-per-token", str(a.prefill_ms_per_token), "--json", str(out_json)]
    if a.limit:
        cmd += ["--limit", str(a.limit)]
    if a.time_scale != 1.0:
        cmd += ["--time-scale", repr(a.time_scale)]
    for label, cfg in our_configs(a):
        if cfg is None:
            name, text = GENERATED_CONFIGS[label]
            path = work / name
            path.write_text(text)
        else:
            path = Path(cfg) if Path(cfg).is_absolute() else REPO_ROOT / cfg
        if not path.is_file():
            raise Fail(f"our config {path} not found")
        cmd += ["-c", str(path)]
    # Plugins given by `name:` in configs outside target/release are found there.
    cmd += ["--plugin-dir", str(exe.parent)]
    t0 = time.monotonic()
    proc = run_bounded(niced(cmd, nice), timeout_s, "router-host replay", capture_output=True, text=True,
                       cwd=REPO_ROOT)
    wall = time.monotonic() - t0
    (work / "ours-table.txt").write_text(proc.stdout)
    return json.loads(out_json.read_text()), f"{' '.join(cmd)}  ({wall:.2f} s)"


def our_configs(a) -> list[tuple[str, str]]:
    configs = [] if a.no_default_configs else list(OUR_CONFIGS)
    if a.booking_variants:
        configs += BOOKING_VARIANTS
    for extra in a.config or []:
        p = Path(extra).expanduser().resolve()
        configs.append((p.stem, str(p)))
    if not configs:
        raise Fail("no router-host configs to run (--no-default-configs without --config)")
    return configs


def dynamo_variants(a) -> list[tuple[str, dict]]:
    variants = []
    for spec in a.dynamo_variant or []:
        name, sep, js = spec.partition("=")
        try:
            kwargs = json.loads(js) if sep else None
        except ValueError as e:
            raise Fail(f"--dynamo-variant {spec!r}: not NAME=JSON ({e})")
        if not name or not isinstance(kwargs, dict):
            raise Fail(f"--dynamo-variant {spec!r}: expected NAME={{\"kwarg\": value, ...}} for KvRouterConfig")
        variants.append((name, kwargs))
    return variants


def our_metrics(report: dict, cfg: dict) -> dict:
    input_tokens = report["workload"]["input_tokens"]
    per_worker = cfg["requests_per_worker"]
    # Our report has computed (prefill) tokens, not cached tokens: hit tokens = input - computed.
    # A fully cached prompt still computes 1 token, so this is a hair below the exact figure.
    return {
        "requests": report["workload"]["requests"],
        "completed": cfg["requests_completed"],
        "hit_rate_blocks": cfg["hit_rate"],
        "hit_rate_tokens": 1.0 - cfg["prefill_tokens"] / input_tokens if input_tokens else 0.0,
        "hit_blocks": cfg["hit_blocks"],
        "prompt_blocks": cfg["prompt_blocks"],
        "prefill_tokens": cfg["prefill_tokens"],
        "ttft_ms": cfg["ttft_ms"],
        "e2e_ms": cfg["e2e_ms"],
        "requests_per_worker": per_worker,
        "imbalance": cfg["load_imbalance"],
        "readmissions": 0,
        "errors": cfg["errors"],
    }


# ----------------------------------------------------------------------------------------
# Table


# (label, value of a run's metrics, format of one value)
ROWS = [
    ("hit rate (blocks)", lambda m: m["hit_rate_blocks"], "{:.4f}"),
    ("hit rate (tokens)", lambda m: m["hit_rate_tokens"], "{:.4f}"),
    ("TTFT p50 ms", lambda m: m["ttft_ms"]["p50"], "{:,.1f}"),
    ("TTFT p90 ms", lambda m: m["ttft_ms"]["p90"], "{:,.1f}"),
    ("TTFT p99 ms", lambda m: m["ttft_ms"]["p99"], "{:,.1f}"),
    ("e2e p50 ms", lambda m: m["e2e_ms"]["p50"], "{:,.1f}"),
    ("e2e p99 ms", lambda m: m["e2e_ms"]["p99"], "{:,.1f}"),
    ("prefill tokens", lambda m: m["prefill_tokens"], "{:,}"),
    ("imbalance max/mean", lambda m: m["imbalance"], "{:.2f}"),
    ("preemptions (readmits)", lambda m: m["readmissions"], "{}"),
    ("errors", lambda m: m["errors"], "{}"),
]


def columns(runs: list[dict], per_run: bool) -> list[tuple[str, list[dict]]]:
    """Table columns, each (name, runs it summarises): Dynamo's KV-router runs (no variant) form
    one column showing their range, unless `per_run`; every other run is its own column."""
    kv = [r for r in runs if r["simulator"] == "dynamo" and r["policy"] == "kv_router"]
    if per_run or len(kv) < 2:
        return [(r["name"], [r]) for r in runs]
    cols, placed = [], False
    for r in runs:
        if r in kv:
            if not placed:
                cols.append((f"dynamo kv-router ({len(kv)} runs: range)", kv))
                placed = True
        else:
            cols.append((r["name"], [r]))
    return cols


def cell(col_runs: list[dict], value, fmt: str) -> str:
    vals = [value(r["metrics"]) for r in col_runs]
    lo, hi = min(vals), max(vals)
    return fmt.format(lo) if fmt.format(lo) == fmt.format(hi) else f"{fmt.format(lo)}-{fmt.format(hi)}"


def render(runs: list[dict], per_run: bool = False) -> tuple[str, str]:
    cols = columns(runs, per_run)
    names = [name for name, _ in cols]
    label_w = max(len(label) for label, _, _ in ROWS)
    table = [[cell(col_runs, value, fmt) for _, col_runs in cols] for _, value, fmt in ROWS]
    col_w = [max([len(n), 10] + [len(row[i]) for row in table]) for i, n in enumerate(names)]
    lines = [" " * label_w + "  " + "  ".join(n.rjust(w) for n, w in zip(names, col_w))]
    md = ["| | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for (label, _, _), cells in zip(ROWS, table):
        lines.append(label.ljust(label_w) + "  " + "  ".join(c.rjust(w) for c, w in zip(cells, col_w)))
        md.append(f"| {label} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("requests per worker:")
    md.append("")
    md.append("Requests per worker:")
    md.append("")
    for r in runs:
        rpw = " ".join(str(x) for x in r["metrics"]["requests_per_worker"])
        lines.append(f"  {r['name']}: {rpw}")
        md.append(f"- {r['name']}: {rpw}")
    return "\n".join(lines), "\n".join(md)


def spread(runs: list[dict]) -> dict:
    kv = [r["metrics"] for r in runs if r["simulator"] == "dynamo" and r["policy"] == "kv_router"]
    if not kv:
        return {}
    def rng(f):
        vals = [f(m) for m in kv]
        return [min(vals), max(vals)]
    return {
        "runs": len(kv),
        "hit_rate_blocks": rng(lambda m: m["hit_rate_blocks"]),
        "hit_rate_tokens": rng(lambda m: m["hit_rate_tokens"]),
        "ttft_p50_ms": rng(lambda m: m["ttft_ms"]["p50"]),
        "ttft_p90_ms": rng(lambda m: m["ttft_ms"]["p90"]),
        "ttft_p99_ms": rng(lambda m: m["ttft_ms"]["p99"]),
        "e2e_p50_ms": rng(lambda m: m["e2e_ms"]["p50"]),
        "e2e_p99_ms": rng(lambda m: m["e2e_ms"]["p99"]),
    }


# ----------------------------------------------------------------------------------------


def parse_args(argv):
    p = argparse.ArgumentParser(
        description="Replay one Mooncake trace through Dynamo's mocker + KV router (ai-dynamo-runtime "
                    f"{DYNAMO_VERSION}) and through router-host replay, and compare.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="Mooncake JSONL trace (read in place)")
    p.add_argument("--out", type=Path, default=None,
                   help="output directory for results.md / results.json (default: <cache>/out/<UTC time>)")
    p.add_argument("--cache-dir", type=Path, default=None,
                   help="cache directory (default: ${XDG_CACHE_HOME:-$HOME/.cache}/router-bench)")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--kv-blocks", type=int, default=2048, help="KV blocks per worker")
    p.add_argument("--block-size", type=int, default=512, help="tokens per block (= the trace's hash_ids block)")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--step-overhead-ms", type=float, default=5.0)
    p.add_argument("--prefill-ms-per-token", type=float, default=0.05)
    p.add_argument("--decode-ms-per-seq", type=float, default=0.1)
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="multiply arrival times by F (ours: --time-scale F; Dynamo: arrival_speedup_ratio 1/F)")
    p.add_argument("--dynamo-runs", type=int, default=8,
                   help="Dynamo KV-router replays (it is not deterministic; the table shows each, plus the spread)")
    p.add_argument("--limit", type=int, default=0,
                   help="only the first N requests (ours: --limit; Dynamo: a truncated copy under the output dir)")
    p.add_argument("--timeout", type=float, default=900.0,
                   help="seconds allowed for each step (install, build, each replay)")
    p.add_argument("--nice", type=int, default=10, help="niceness of the child processes (0 = not niced)")
    p.add_argument("--router-host", default=None, help="use this router-host binary instead of target/release")
    p.add_argument("--rebuild", action="store_true", help="run cargo build --release even if the binary exists")
    p.add_argument("--config", "-c", action="append", metavar="FILE",
                   help="an extra router-host config to run (repeatable), after " + ", ".join(l for l, _ in OUR_CONFIGS))
    p.add_argument("--no-default-configs", action="store_true",
                   help="run only the --config files on our side, not the built-in list")
    p.add_argument("--booking-variants", action="store_true",
                   help="also run the built-in default with booking.decode: deduplicated, with Dynamo's whole "
                        "booking model (prefill: uncached too), and default.yaml with deduplicated decode")
    p.add_argument("--dynamo-variant", action="append", metavar="NAME=JSON",
                   help="an extra Dynamo KV-router run with KvRouterConfig(**JSON) (repeatable), e.g. "
                        "'no-reuse={\"router_assume_kv_reuse\": false}'")
    p.add_argument("--no-dynamo-round-robin", action="store_true", help="skip Dynamo's round-robin run")
    p.add_argument("--per-run", action="store_true",
                   help="one table column per Dynamo KV-router run instead of one column with their range")
    p.add_argument("--skip-dynamo", action="store_true", help="only run ours")
    p.add_argument("--skip-ours", action="store_true", help="only run Dynamo")
    p.add_argument("--dynamo-worker", metavar="JOB", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.dynamo_worker:
        return dynamo_worker(a.dynamo_worker)

    started = time.monotonic()
    a.trace = a.trace.expanduser().resolve()
    if not a.trace.is_file():
        raise Fail(f"trace not found: {a.trace} (the shared Mooncake trace lives in "
                   f"../shared/traces/mooncake_conversation/ next to the repository; pass --trace FILE)")
    if not (math.isfinite(a.time_scale) and a.time_scale > 0):
        raise Fail("--time-scale must be finite and > 0")
    for name in ("workers", "kv_blocks", "block_size", "max_num_batched_tokens", "max_num_seqs", "dynamo_runs"):
        if getattr(a, name) < (0 if name == "dynamo_runs" else 1):
            raise Fail(f"--{name.replace('_', '-')} must be positive")
    cache = (a.cache_dir or cache_root()).expanduser().resolve()
    out = (a.out or cache / "out" / _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")).expanduser().resolve()
    if out == REPO_ROOT or REPO_ROOT in out.parents:
        log(f"note: output directory {out} is inside the repository")
    out.mkdir(parents=True, exist_ok=True)
    work = out / "work"
    work.mkdir(exist_ok=True)

    trace_for_dynamo = a.trace
    if a.limit:
        trace_for_dynamo = work / f"trace-first-{a.limit}.jsonl"
        with a.trace.open() as src, trace_for_dynamo.open("w") as dst:
            n = 0
            for line in src:
                if line.strip():
                    dst.write(line)
                    n += 1
                    if n >= a.limit:
                        break

    settings = {
        "trace": str(a.trace), "limit": a.limit or None, "time_scale": a.time_scale,
        "workers": a.workers, "kv_blocks": a.kv_blocks,
        "block_size": a.block_size, "max_num_batched_tokens": a.max_num_batched_tokens,
        "max_num_seqs": a.max_num_seqs, "step_overhead_ms": a.step_overhead_ms,
        "prefill_ms_per_token": a.prefill_ms_per_token, "decode_ms_per_seq": a.decode_ms_per_seq,
    }
    runs: list[dict] = []
    result: dict = {"settings": settings, "started_utc": _dt.datetime.now(_dt.timezone.utc).isoformat()}

    if not a.skip_ours:
        exe = ensure_router_host(a.router_host, a.rebuild, max(a.timeout, 1800.0), a.nice)
        log("running router-host replay (" + ", ".join(label for label, _ in our_configs(a)) + ")")
        report, cmdline = run_ours(exe, a, work, a.timeout, a.nice)
        result["ours"] = {"binary": str(exe), "command": cmdline, "git": git_state(),
                          "binary_mtime_utc": _dt.datetime.fromtimestamp(exe.stat().st_mtime, _dt.timezone.utc).isoformat()}
        reference = report["configs"][0].get("pooled_lru_reference") if report["configs"] else None
        if reference:
            result["ours"]["pooled_lru_reference"] = reference
        for (label, _), cfg in zip(our_configs(a), report["configs"]):
            runs.append({"name": f"ours {label}", "simulator": "router-host", "policy": label,
                         "config": cfg["config"], "metrics": our_metrics(report, cfg)})

    if not a.skip_dynamo:
        install = ensure_dynamo_venv(cache / "dynamo-venv", a.timeout, a.nice)
        py = venv_python(cache / "dynamo-venv")
        profile = write_timing_profile(work / "linear-timing-profile.npz", a.step_overhead_ms,
                                       a.prefill_ms_per_token, a.decode_ms_per_seq,
                                       max_tokens=max(2_000_000, 2 * a.kv_blocks * a.block_size),
                                       max_context=1 << 18)
        base_job = {"trace": str(trace_for_dynamo), "workers": a.workers, "kv_blocks": a.kv_blocks,
                    "block_size": a.block_size, "max_num_batched_tokens": a.max_num_batched_tokens,
                    "max_num_seqs": a.max_num_seqs, "profile": profile["file"], "time_scale": a.time_scale}
        profile["check"] = check_profile_applied(py, base_job, work, min(a.timeout, 300.0), a.nice, a)
        result["dynamo"] = {"install": install, "timing_profile": profile}
        dyn_runs = [("kv_router", f"dynamo kv-router #{i + 1}", {}) for i in range(a.dynamo_runs)]
        if not a.no_dynamo_round_robin:
            dyn_runs.append(("round_robin", "dynamo round-robin", {}))
        dyn_runs += [("kv_router", f"dynamo {name}", kwargs) for name, kwargs in dynamo_variants(a)]
        variants_cfg = {}
        for mode, name, kwargs in dyn_runs:
            log(f"running Dynamo replay: {name}")
            raw = run_dynamo(py, dict(base_job, router_mode=mode, router_kwargs=kwargs), work,
                             a.timeout, a.nice, name.replace(" ", "_").replace("#", ""))
            if "router_config" in raw:
                if kwargs:
                    variants_cfg[name] = raw["router_config"]
                else:
                    result["dynamo"]["router_config"] = raw["router_config"]
            result["dynamo"]["engine_args"] = raw["engine_args"]
            runs.append({"name": name, "simulator": "dynamo", "policy": mode if not kwargs else "kv_router variant",
                         "router_kwargs": kwargs, "metrics": dynamo_metrics(raw, a.block_size, a.workers)})
        if variants_cfg:
            result["dynamo"]["variants"] = variants_cfg

    # Dynamo first, then ours, as in the issue's table.
    runs.sort(key=lambda r: 0 if r["simulator"] == "dynamo" else 1)
    table, md_table = render(runs, a.per_run)
    sp = spread(runs)
    result["runs"] = runs
    result["dynamo_kv_router_spread"] = sp
    result["wall_s"] = round(time.monotonic() - started, 1)

    header = [
        f"trace: {a.trace}" + (f" (first {a.limit} requests)" if a.limit else "")
        + (f", arrival times x {a.time_scale}" if a.time_scale != 1.0 else ""),
        f"cluster: {a.workers} workers, {a.kv_blocks} KV blocks of {a.block_size} tokens each, "
        f"{a.max_num_batched_tokens} tokens/step, {a.max_num_seqs} seqs",
        f"timing: step {a.step_overhead_ms} ms + {a.decode_ms_per_seq} ms/decoding seq + "
        f"{a.prefill_ms_per_token} ms/prefill token (Dynamo: planner profile NPZ, checked on one request)",
    ]
    if not a.skip_dynamo:
        header.append(f"dynamo: {DYNAMO_PACKAGE}=={DYNAMO_VERSION}, vLLM mocker, KvRouterConfig() defaults")
    reference = result.get("ours", {}).get("pooled_lru_reference")
    if reference:
        # What the KV capacity allows a router (docs/replay.md, "The pooled-LRU reference").
        t = reference["ttft_ms"]
        header.append(f"pooled-LRU reference ({reference['kv_blocks'] or 'unlimited'} blocks as one LRU cache, "
                      f"each request alone on an idle engine): hit rate (blocks) {reference['hit_rate']:.4f}, "
                      f"TTFT p50 / p90 / p99 {t['p50']:,.1f} / {t['p90']:,.1f} / {t['p99']:,.1f} ms")
    spread_line = ""
    if sp and sp["runs"] > 1:
        spread_line = (f"Dynamo kv_router spread over {sp['runs']} runs: hit (blocks) "
                       f"{sp['hit_rate_blocks'][0]:.4f}-{sp['hit_rate_blocks'][1]:.4f}, TTFT p50 "
                       f"{sp['ttft_p50_ms'][0]:.1f}-{sp['ttft_p50_ms'][1]:.1f}, p90 "
                       f"{sp['ttft_p90_ms'][0]:.1f}-{sp['ttft_p90_ms'][1]:.1f}, p99 "
                       f"{sp['ttft_p99_ms'][0]:.1f}-{sp['ttft_p99_ms'][1]:.1f} ms")
    text = "\n".join(header) + "\n\n" + table + ("\n\n" + spread_line if spread_line else "") + "\n"
    md = ("# Dynamo vs router-host replay, side by side\n\n" + "\n".join(f"- {h}" for h in header) + "\n\n"
          + md_table + ("\n\n" + spread_line if spread_line else "") + "\n")
    (out / "results.md").write_text(md)
    tmp = out / f".results.json.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    tmp.replace(out / "results.json")
    print(text, end="")
    log(f"wrote {out / 'results.md'} and {out / 'results.json'} ({result['wall_s']} s)")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Fail as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
