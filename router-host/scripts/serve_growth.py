#!/usr/bin/env python3
"""Sustained load on `router-host serve` in front of two instant mock engines, on 127.0.0.1:
how serve's resident memory and thread count move over time, and how the requests split
between the two engines.

Everything it starts (two `router-host mock-engine`, one `router-host serve`) runs on loopback
ports and is stopped at the end, whatever happens. The load is a closed loop of --concurrency
keep-alive clients sending short completions (prompts of random length, so requests differ)
for --seconds. Every --sample seconds it prints serve's VmRSS and Threads from
/proc/PID/status; at the end the thread names and the split per engine.

    python3 router-host/scripts/serve_growth.py --policy two-tier --seconds 50
    python3 router-host/scripts/serve_growth.py --policy round-robin --seconds 50

docs/serve.md ("Limits") has the figures and what bounds them.
"""

import argparse
import collections
import http.client
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "router-host" / "scripts" / "lib"))
from ports import free_port  # noqa: E402  (ports no two children share)

POLICIES = {
    "default": "",
    "two-tier": (
        "plugins:\n  - path: {plugin}\nworker_selection:\n  aggregated: tt\n  instances:\n"
        "    - {{name: tt, type: dynamo-two-tier-cost-fn{params}}}\n"
    ),
    "round-robin": (
        "worker_selection:\n  aggregated: rr\n  instances:\n    - {{name: rr, type: round-robin}}\n"
    ),
}


def status(pid):
    """VmRSS in MiB and Threads of `pid`."""
    rss, threads = 0.0, 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) / 1024
            elif line.startswith("Threads:"):
                threads = int(line.split()[1])
    return rss, threads


def thread_names(pid):
    names = collections.Counter()
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            names[Path(f"/proc/{pid}/task/{task}/comm").read_text().strip()] += 1
        except OSError:
            pass
    return dict(names)


def wait_ready(port, deadline):
    while time.monotonic() < deadline:
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
            c.request("GET", "/ready")
            if c.getresponse().status == 200:
                return True
        except OSError:
            pass
        time.sleep(0.1)
    return False


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--router-host", default=str(REPO / "target/release/router-host"))
    p.add_argument("--plugin", default=None, help="libtwo_tier_cost_fn.so (default: next to --router-host)")
    p.add_argument("--policy", choices=sorted(POLICIES), default="two-tier")
    p.add_argument("--tie-break", choices=["spread", "lowest_row"], default=None,
                   help="two-tier's tie_break (default: the policy's own default)")
    p.add_argument("--seconds", type=float, default=50)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--sample", type=float, default=5)
    a = p.parse_args()
    if a.seconds > 180:
        sys.exit("--seconds: at most 180 (the machine is shared)")
    binary = Path(a.router_host)
    plugin = Path(a.plugin) if a.plugin else binary.parent / "libtwo_tier_cost_fn.so"
    procs = []
    ok = False
    work = tempfile.mkdtemp(prefix="serve-growth-")
    try:
        engines = []
        for _ in range(2):
            port = free_port()
            procs.append(subprocess.Popen(
                [str(binary), "mock-engine", "--listen", f"127.0.0.1:{port}", "--model", "tiny",
                 "--step-overhead-ms", "0", "--decode-ms-per-seq", "0", "--prefill-ms-per-token", "0"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            engines.append(port)
        listen = free_port()
        params = f", parameters: {{tie_break: {a.tie_break}}}" if a.tie_break else ""
        yaml = "block_size: 16\n" + POLICIES[a.policy].format(plugin=plugin, params=params)
        yaml += "workers:\n" + "".join(
            f"  - {{id: {i + 1}, url: \"http://127.0.0.1:{port}\"}}\n" for i, port in enumerate(engines))
        yaml += f"serve:\n  listen: 127.0.0.1:{listen}\n"
        config = Path(work) / "router.yaml"
        config.write_text(yaml)
        log = open(Path(work) / "serve.log", "w")
        serve = subprocess.Popen([str(binary), "serve", "--config", str(config)],
                                 stdout=log, stderr=subprocess.STDOUT)
        procs.append(serve)
        if not wait_ready(listen, time.monotonic() + 30):
            sys.exit(f"serve did not become ready; log in {log.name}")
        split = collections.Counter()
        counts = {"ok": 0, "failed": 0}
        lock = threading.Lock()
        stop = time.monotonic() + a.seconds

        def client(seed):
            rng = random.Random(seed)
            conn = http.client.HTTPConnection("127.0.0.1", listen, timeout=10)
            while time.monotonic() < stop:
                prompt = "x" * rng.randint(20, 400)
                body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 4})
                try:
                    conn.request("POST", "/v1/completions", body, {"content-type": "application/json"})
                    r = conn.getresponse()
                    r.read()
                    worker = r.getheader("x-router-worker")
                    with lock:
                        counts["ok" if r.status == 200 else "failed"] += 1
                        split[worker] += 1
                except OSError:
                    with lock:
                        counts["failed"] += 1
                    conn.close()
                    conn = http.client.HTTPConnection("127.0.0.1", listen, timeout=10)
            conn.close()

        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(a.concurrency)]
        started = time.monotonic()
        print(f"policy {a.policy}{' tie_break ' + a.tie_break if a.tie_break else ''}, "
              f"{a.concurrency} clients, {a.seconds:.0f} s; serve pid {serve.pid}")
        print(f"{'t s':>6} {'VmRSS MiB':>10} {'Threads':>8} {'requests':>9}")
        rss, nthreads = status(serve.pid)
        print(f"{0:6.0f} {rss:10.1f} {nthreads:8d} {0:9d}")
        for t in threads:
            t.start()
        samples = []
        while time.monotonic() < stop:
            time.sleep(min(a.sample, max(0.0, stop - time.monotonic())))
            rss, nthreads = status(serve.pid)
            samples.append((rss, nthreads))
            with lock:
                done = counts["ok"] + counts["failed"]
            print(f"{time.monotonic() - started:6.0f} {rss:10.1f} {nthreads:8d} {done:9d}", flush=True)
        for t in threads:
            t.join(timeout=15)
        elapsed = time.monotonic() - started
        time.sleep(12)  # past tokio's 10 s keep-alive of idle blocking threads
        rss, nthreads = status(serve.pid)
        total = counts["ok"] + counts["failed"]
        print(f"12 s after the load: VmRSS {rss:.1f} MiB, Threads {nthreads}")
        print(f"requests: {counts['ok']} ok, {counts['failed']} failed, {total / elapsed:.0f} req/s")
        print("per engine (x-router-worker): " + ", ".join(
            f"{w}: {n} ({100 * n / max(total, 1):.1f} %)" for w, n in sorted(split.items(), key=str)))
        print(f"max VmRSS {max(s[0] for s in samples):.1f} MiB, max Threads {max(s[1] for s in samples)}")
        print(f"thread names: {thread_names(serve.pid)}")
        ok = True
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=35)
            except subprocess.TimeoutExpired:
                proc.kill()
        if ok:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"serve's log and config kept in {work}", file=sys.stderr)


if __name__ == "__main__":
    main()
