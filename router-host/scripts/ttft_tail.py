#!/usr/bin/env python3
"""Why a replay's TTFT tail is what it is: reads a trace and `router-host replay --requests`
output and sorts the requests slower than a threshold into what no routing can fix, what needed
a cached prefix and found it or not (with how long ago that prefix was last used), and the rest.

    router-host replay --trace T.jsonl --workers 8 --kv-blocks 2048 -c C.yaml --requests r.csv
    python3 router-host/scripts/ttft_tail.py --trace T.jsonl --requests r.csv --threshold-ms 3900

docs/replay.md, "Why TTFT p99 stays near 3,900 ms", is this script's output on the Dynamo
side-by-side setting.
"""
import argparse
import csv
import json
import sys


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", required=True, help="the Mooncake JSONL trace that was replayed (no --limit / --time-scale)")
    p.add_argument("--requests", required=True, help="the CSV `router-host replay --requests` wrote")
    p.add_argument("--config", help="the config column to read (default: the first in the CSV)")
    p.add_argument("--threshold-ms", type=float, default=3900.0)
    p.add_argument("--block-size", type=int, default=512, help="tokens per hash_ids entry (--trace-block-size)")
    p.add_argument("--prefill-ms-per-token", type=float, default=0.05)
    a = p.parse_args(argv)

    try:
        with open(a.trace) as f:
            trace = [json.loads(line) for line in f if line.strip()]
        with open(a.requests, newline="") as f:
            rows = list(csv.DictReader(f))
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    configs = list(dict.fromkeys(r["config"] for r in rows))
    config = a.config or (configs[0] if configs else None)
    if config not in configs:
        print(f"error: no config {config!r} in {a.requests}; it has: {', '.join(configs) or 'no rows'}",
              file=sys.stderr)
        return 1
    rows = [r for r in rows if r["config"] == config]
    # The replay sorts a trace by arrival (stable); so does this.
    trace = sorted(trace, key=lambda r: r["timestamp"])
    if len(rows) != len(trace):
        print(f"error: {len(rows)} requests of config {config!r} in {a.requests}, {len(trace)} in {a.trace}: "
              "not the same workload (replayed with --limit or --time-scale?)", file=sys.stderr)
        return 1

    # Per request: the leading run of blocks seen in an earlier request (an infinite shared
    # cache's hit), and when the deepest of them was last used.
    last_use: dict[int, float] = {}
    needs, irreducible, other_slow, slow = [], 0, 0, 0
    for req, row in zip(trace, rows):
        ids, now = req["hash_ids"], req["timestamp"]
        seen = 0
        for b in ids:
            if b not in last_use:
                break
            seen += 1
        age_s = (now - last_use[ids[seen - 1]]) / 1000 if seen else None
        for b in ids:
            last_use[b] = now
        isl = req["input_length"]
        floor_ideal = a.prefill_ms_per_token * max(isl - seen * a.block_size, 1)
        floor_cold = a.prefill_ms_per_token * isl
        ttft = float(row["ttft_ms"]) if row["ttft_ms"] else None
        over = ttft is None or ttft > a.threshold_ms
        slow += over
        if floor_ideal > a.threshold_ms:
            irreducible += 1
        elif floor_cold > a.threshold_ms:
            hit = int(row["hit_blocks"] or 0)
            found = a.prefill_ms_per_token * max(isl - hit * a.block_size, 1) <= a.threshold_ms
            needs.append((found, age_s, over))
        elif over:
            other_slow += 1

    n = len(rows)
    allowed = n - 1 - int(0.99 * (n - 1))  # requests above the p99 position
    found = [x for x in needs if x[0]]
    missed = [x for x in needs if not x[0]]
    ages = lambda xs: (f"{min(x[1] for x in xs):.0f} to {max(x[1] for x in xs):.0f} s"
                       if xs and all(x[1] is not None for x in xs) else "-")
    print(f"config {config}: {n} requests, {slow} slower than {a.threshold_ms:g} ms "
          f"(p99 allows about {allowed})")
    print(f"  {irreducible} need more than {a.threshold_ms:g} ms of prefill even with every earlier prefix cached")
    print(f"  {len(needs)} need their cached prefix to get under it "
          f"(at least {max(len(needs) - max(allowed - irreducible, 0), 0)} of them must find it):")
    still = sum(1 for x in found if x[2])
    print(f"    {len(found)} found it (prefix last used {ages(found)} earlier); "
          f"{still} of them still slower (step overheads, queueing)")
    print(f"    {len(missed)} did not (prefix last used {ages(missed)} earlier)")
    print(f"  {other_slow} other requests slower than {a.threshold_ms:g} ms (queueing)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
