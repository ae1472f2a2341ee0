"""Part 1 of the live benchmark: what each router adds, and how much it holds.

Two `router-host mock-engine`s with their timing set to 0 (answers as fast as the HTTP stack
allows, KV events on) stand in for the engines. They tokenize with a real tokenizer (`--tokenizer`):
the real-vLLM rig's tiny model's byte-level BPE (`$ROUTER_RIG_CACHE/tiny-llama-v1`, built by
../vllm_rig/run.sh) when it is there, else the repository's fixture (WordLevel,
router-host/tests/data/tokenizer); router-host gets the same files (`serve.tokenizer: {path:
DIR}`), as a user with the model's files runs it, plus one row with `tokenizer: remote`. `oha`
drives, at fixed request rates (`-q`, with latency correction against coordinated omission),
first both engines directly, then every router of peers.ALL_ROUTERS in front of both engines, for
two workloads:

- `short-stream`: short prompts (about 50 tokens), `stream: true`, `max_tokens` 8;
- `prompt-4k`: prompts of about 4,096 tokens of that tokenizer (sized with the engine's POST
  /tokenize), a shared preamble of about 1,024 tokens and the rest distinct, 256 different
  prompts, not streamed, `max_tokens` 4; oha picks one of the bodies at random for each request
  (`-Z`).
- `prompt-16k` (only when named in `--workloads`): prompts of 16 KiB (16,384 bytes), a shared
  preamble of 4 KiB and the rest distinct, 256 different prompts, not streamed, `max_tokens` 4,
  on *instant* engines: two more mocks with their built-in byte tokenizer (one token per UTF-8
  byte, no tokenizer CPU), `--max-model-len 32768` and 256-token blocks, so what is measured is
  the routers; router-host tokenizes locally with a generated `tokenizer.json` that gives the
  same ids (a byte-level BPE without merges), with its word split and prefix cache.

Per router and workload, at each rate: latency p50 / p99 / p99.9 of the successful requests and
the same minus the direct run's at that rate (added latency); the router process's CPU time
(utime + stime from /proc/PID/stat, before and after the run) per completed request, and its
VmRSS; the ladder of rates stops after the first rate not held (p99 over 10 ms, any request not
2xx, or under 90 % of the rate achieved). A fresh router per workload (so VmHWM is that
workload's peak), and the engines' prefix caches reset before each. After each router-host
ladder, its KV index must hold blocks (router_kv_index_blocks above 0) and, for two-tier, a
prompt cached on each engine in turn must be routed back to it (peers.overlap_probe).

Writes OUT/overhead.json: {"versions", "machine", "commands", "settings" (with "tokenizer"),
"workloads" (with the measured prompt token counts), "quick", "rows": [one per router and
workload, with "rates": [one per rate]]}.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import subprocess
import sys
import time
from pathlib import Path

sys.dont_write_bytecode = True  # no __pycache__ in the repository, however this is run

import peers  # noqa: E402
from common import (  # noqa: E402
    BenchError,
    RigFailure,
    free_port,
    http,
    install_signal_handlers,
    log,
    metric_sum,
    proc_cpu_seconds,
    proc_memory_kib,
    scrape,
    stop_all,
    wait_for,
)

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
MODEL = "mock-bench"
BLOCK_SIZE = 16
P99_LIMIT_MS = 10.0
# A rate is held when at least this share of it was achieved.
MIN_ACHIEVED = 0.9
DIRECT = "engines directly"

# The 4k prompts get lower rates: the engines' own tokenization of 4k tokens of BPE takes
# several ms of CPU per request, and this machine has 2 cores for engines, router and oha.
# The engines directly hold 6,400 req/s of short streams here; a router that holds 3,200 goes on
# to 4,800 and 6,400, so "highest rate held" tells apart the routers that reach 3,200.
FULL = {"rates": [100, 200, 400, 800, 1600, 3200, 4800, 6400], "step_s": 8.0, "warmup_s": 2.0, "idle_s": 3.0,
        "rates_by_workload": {"prompt-4k": [25, 50, 100, 200, 400],
                              "prompt-16k": [400, 800, 1600, 2400, 3200, 4800, 6400]}}
QUICK = {"rates": [100, 400, 1600], "step_s": 2.0, "warmup_s": 0.5, "idle_s": 1.0,
         "rates_by_workload": {"prompt-4k": [25, 100, 400], "prompt-16k": [400, 1600]}}

LONG_PROMPTS = 256
LONG_TOKENS = 4096
LONG_SHARED = 1024
# prompt-16k: sized in bytes, on instant engines (byte tokenizer: one token per byte). Blocks
# of 256 tokens keep the engines' KV events at 64 blocks per request.
BYTES_PROMPTS = 256
BYTES_PROMPT = 16384
BYTES_SHARED = 4096
BYTES_BLOCK_SIZE = 256
BYTES_MAX_MODEL_LEN = 32768
SHORT_PROMPTS = 64
SHORT_TOKENS = 50
# Prompts the overlap probe sends (never in the load): two per two-tier row, one per engine.
PROBE_PROMPTS = 8

# The real-vLLM rig's tiny model (../vllm_rig/run.sh: MODEL_DIR="$CACHE/tiny-llama-v1", stamped
# .rig-built once complete), and the repository's fixture tokenizer when it is not built.
RIG_CACHE = Path(os.environ.get("ROUTER_RIG_CACHE") or Path.home() / ".cache" / "router-host-vllm")
RIG_MODEL_DIR = RIG_CACHE / "tiny-llama-v1"
FIXTURE_TOKENIZER = REPO / "router-host" / "tests" / "data" / "tokenizer"
# Share of made-up words: BPE splits each into several tokens, as a real tokenizer splits rare
# words; with the rig's tokenizer this gives about 1.4 tokens per word, near English text with a
# real model's. None with a WordLevel tokenizer, which would make each one `<unk>`.
PSEUDO_WORD_SHARE = 0.08


def pick_tokenizer(explicit: Path | None) -> dict:
    """The tokenizer the engines (and router-host) run: `explicit`, else the rig's tiny model
    when it is built, else the fixture. Returns what the JSON records, with its words."""
    if explicit is not None:
        path, source = explicit.resolve(), "--tokenizer"
    elif (RIG_MODEL_DIR / ".rig-built").is_file() and (RIG_MODEL_DIR / "tokenizer.json").is_file():
        path, source = RIG_MODEL_DIR, "the real-vLLM rig's tiny model (../vllm_rig/build_model.py)"
    else:
        path = FIXTURE_TOKENIZER
        source = (f"the repository's fixture tokenizer ({RIG_MODEL_DIR} is not built: "
                  "router-host/scripts/vllm_rig/run.sh install builds it)")
    try:
        doc = json.loads((path / "tokenizer.json").read_text())
        model = doc["model"]
        kind = str(model.get("type", "?"))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise BenchError(f"tokenizer {path / 'tokenizer.json'}: {e}") from e
    words = vocabulary_words(doc)
    if len(words) < 20:
        raise BenchError(f"tokenizer {path}: only {len(words)} whole words in its vocabulary; prompts need more")
    pre = doc.get("pre_tokenizer") or {}
    return {
        "path": str(path),
        "source": source,
        "model_type": kind,
        "pre_tokenizer": pre.get("type") if isinstance(pre, dict) else None,
        "vocab_size": len(model.get("vocab") or ()),
        "prompt_words": len(words),
        "pseudo_word_share": 0.0 if kind == "WordLevel" else PSEUDO_WORD_SHARE,
        "_words": words,
    }


def vocabulary_words(doc: dict) -> list[str]:
    """Whole ASCII words of a tokenizer.json's vocabulary: with a byte-level (`Ġ`) or metaspace
    (`▁`) marker when it has them (the pieces that start a word after a space), else every
    alphabetic entry (WordLevel), special tokens left out."""
    vocab = doc["model"].get("vocab") or {}
    pieces = [v[0] for v in vocab] if isinstance(vocab, list) else list(vocab)  # Unigram: [[piece, score]]
    special = {t.get("content") for t in doc.get("added_tokens") or ()}
    pieces = [p for p in pieces if isinstance(p, str) and p not in special]
    marked = [p[1:] for p in pieces if p[:1] in ("Ġ", "▁")]
    chosen = marked if marked else pieces
    return sorted({w.lower() for w in chosen if w.isascii() and w.isalpha()})


def write_byte_tokenizer(directory: Path) -> Path:
    """A tokenizer.json giving the mock engine's byte tokenizer's ids (token b for UTF-8 byte b,
    nothing added): a byte-level BPE whose vocabulary is GPT-2's 256 byte characters in byte
    order, with no merges, and GPT-2's pre-tokenizer. Returns the directory."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    doc = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
        "pre_tokenizer": level, "post_processor": None, "decoder": level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "vocab": {table[b]: b for b in range(256)}, "merges": []},
    }  # fmt: skip
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer.json").write_text(json.dumps(doc))
    return directory


def byte_sized(builder: "PromptBuilder", prefix: str, size: int) -> str:
    """`prefix` (may be "") then the builder's words, exactly `size` bytes (the last word cut)."""
    text = prefix
    while len(text.encode()) < size:
        text = f"{text} {' '.join(builder.items(64))}" if text else " ".join(builder.items(64))
    return text.encode()[:size].decode("ascii")


class PromptBuilder:
    """Prompts of a given size in tokens of the engines' tokenizer, counted by engine 1's POST
    /tokenize (as vLLM answers: {"count", "tokens", "max_model_len"})."""

    def __init__(self, engine: peers.Engine, tok: dict, seed: int):
        self.url = engine.url + "/tokenize"
        self.words = tok["_words"]
        self.pseudo = tok["pseudo_word_share"]
        self.rng = random.Random(seed)
        self.calls = 0
        self.prefix_counts: dict[str, int] = {}
        self.tokens_per_item = 1.0
        sample = self.items(2000)
        self.base = self.count("")  # what the tokenizer adds to every prompt (BOS)
        self.tokens_per_item = max(0.2, (self.count(" ".join(sample)) - self.base) / len(sample))

    def tokenize(self, text: str) -> list[int]:
        self.calls += 1
        status, raw = http("POST", self.url, {"model": MODEL, "prompt": text}, timeout=30)
        if status != 200:
            raise BenchError(f"POST {self.url}: status {status}: {raw[:300]!r}")
        answer = json.loads(raw)
        tokens = answer.get("tokens")
        if not isinstance(tokens, list) or answer.get("count") != len(tokens):
            raise BenchError(f"POST {self.url}: unexpected answer {raw[:300]!r}")
        return tokens

    def count(self, text: str) -> int:
        return len(self.tokenize(text))

    def items(self, n: int) -> list[str]:
        """`n` words (some made up, see PSEUDO_WORD_SHARE), a sentence ending every 6 to 20."""
        out = []
        left = 0
        for _ in range(n):
            if self.pseudo and self.rng.random() < self.pseudo:
                w = "".join(self.rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(self.rng.randint(3, 9)))
            else:
                w = self.rng.choice(self.words)
            if left <= 0:
                left = self.rng.randint(6, 20)
            left -= 1
            out.append(w + "." if left == 0 else w)
        return out

    def sized(self, prefix: str, target: int) -> tuple[str, int]:
        """`prefix` (may be "") then words, about `target` tokens in all: words are added or
        dropped at the end, guided by the counts, until the count is `target` (or, after a
        bounded number of tries, the closest seen)."""

        def join(items):
            return " ".join([prefix, *items]) if prefix else " ".join(items)

        if prefix not in self.prefix_counts:
            self.prefix_counts[prefix] = self.count(prefix) if prefix else self.base
        have = self.prefix_counts[prefix]
        items = self.items(max(1, round((target - have) / self.tokens_per_item)))
        best = None
        for _ in range(24):
            text = join(items)
            c = self.count(text)
            if best is None or abs(c - target) < abs(best[1] - target):
                best = (text, c)
            if c == target:
                break
            step = max(1, int(abs(target - c) / max(self.tokens_per_item, 1.0)))
            if c < target:
                items += self.items(step)
            else:
                del items[max(1, len(items) - step):]
        assert best is not None
        return best


def token_stats(counts: list[int]) -> dict:
    return {"min": min(counts), "mean": round(sum(counts) / len(counts), 1), "max": max(counts)}


def workload_bodies(name: str, builder: PromptBuilder) -> tuple[list[dict], list[int], dict, list[str]]:
    """The bodies, their prompt token counts (by the engine's /tokenize), what the JSON records
    about them, and fresh prompts of the same kind for the overlap probe."""
    if name == "short-stream":
        prompts = [builder.sized("", SHORT_TOKENS) for _ in range(SHORT_PROMPTS + PROBE_PROMPTS)]
        bodies = [{"model": MODEL, "prompt": p, "max_tokens": 8, "stream": True} for p, _ in prompts[:SHORT_PROMPTS]]
        counts = [c for _, c in prompts[:SHORT_PROMPTS]]
        info = {"prompt_tokens": token_stats(counts), "target_prompt_tokens": SHORT_TOKENS}
        probes = [p for p, _ in prompts[SHORT_PROMPTS:]]
    elif name == "prompt-4k":
        shared, shared_count = builder.sized("", LONG_SHARED)
        prompts = [builder.sized(shared, LONG_TOKENS) for _ in range(LONG_PROMPTS + PROBE_PROMPTS)]
        bodies = [{"model": MODEL, "prompt": p, "max_tokens": 4} for p, _ in prompts[:LONG_PROMPTS]]
        counts = [c for _, c in prompts[:LONG_PROMPTS]]
        # The preamble's tokens must be the start of every prompt's (else no prefix is shared).
        head = builder.tokenize(shared)
        for i in (0, len(bodies) - 1):
            got = builder.tokenize(bodies[i]["prompt"])[: len(head)]
            if got != head:
                raise BenchError(f"prompt-4k: prompt {i} does not start with the shared preamble's {len(head)} tokens")
        info = {
            "prompt_tokens": token_stats(counts),
            "target_prompt_tokens": LONG_TOKENS,
            "shared_prefix_tokens": shared_count,
            "shared_prefix_full_blocks": shared_count // BLOCK_SIZE,
        }
        probes = [p for p, _ in prompts[LONG_PROMPTS:]]
    elif name == "prompt-16k":
        # Byte tokenizer: tokens are bytes, so no sizing by /tokenize.
        shared = byte_sized(builder, "", BYTES_SHARED)
        texts = [byte_sized(builder, shared, BYTES_PROMPT) for _ in range(BYTES_PROMPTS + PROBE_PROMPTS)]
        bodies = [{"model": MODEL, "prompt": t, "max_tokens": 4} for t in texts[:BYTES_PROMPTS]]
        counts = [len(t.encode()) for t in texts[:BYTES_PROMPTS]]
        info = {
            "prompt_tokens": token_stats(counts),
            "target_prompt_bytes": BYTES_PROMPT,
            "shared_prefix_tokens": BYTES_SHARED,
            "shared_prefix_full_blocks": BYTES_SHARED // BYTES_BLOCK_SIZE,
            "block_size": BYTES_BLOCK_SIZE,
        }
        probes = texts[BYTES_PROMPTS:]
    else:
        raise BenchError(f"unknown workload `{name}`")
    if len({b["prompt"] for b in bodies}) != len(bodies):
        raise BenchError(f"{name}: two of the {len(bodies)} prompts are the same")
    info["prompt_chars"] = token_stats([len(b["prompt"]) for b in bodies])
    return bodies, counts, info, probes


WORKLOADS = {
    "short-stream": {
        "what": f"{SHORT_PROMPTS} different short prompts (about {SHORT_TOKENS} tokens), streamed (`stream: true`), "
        "`max_tokens` 8; latency is oha's, to the end of the stream",
        "stream": True,
        "max_tokens": 8,
    },
    "prompt-4k": {
        "what": f"{LONG_PROMPTS} different prompts of about {LONG_TOKENS:,} tokens (a preamble of about {LONG_SHARED:,} "
        "that all share, the rest distinct), not streamed, `max_tokens` 4; each request takes one at random "
        "(oha -Z), so the routers tokenize, hash and look up 4k tokens every time, and the engines store and "
        "evict blocks",
        "stream": False,
        "max_tokens": 4,
        "prompt_tokens": LONG_TOKENS,
    },
    "prompt-16k": {
        "what": f"{BYTES_PROMPTS} different prompts of {BYTES_PROMPT:,} bytes (a preamble of {BYTES_SHARED:,} bytes "
        "that all share, the rest distinct), not streamed, `max_tokens` 4, on instant engines (the mock's byte "
        f"tokenizer: one token per byte, no tokenizer CPU; {BYTES_BLOCK_SIZE}-token blocks); router-host tokenizes "
        "with a tokenizer.json giving the same ids; each request takes one at random (oha -Z)",
        "stream": False,
        "max_tokens": 4,
        "prompt_bytes": BYTES_PROMPT,
        "engines": "instant",
    },
}

# Run only when named in --workloads.
DEFAULT_WORKLOADS = ["short-stream", "prompt-4k"]


# -- one oha run -------------------------------------------------------------------------------


class Oha:
    def __init__(self, binary: Path, connections: int, log_dir: Path):
        self.binary = binary
        self.connections = connections
        self.log_dir = log_dir
        self.runs = 0

    def argv(self, url: str, rate: float, seconds: float, bodies: Path, out: Path,
             spread_to: list[str] | None = None) -> list[str]:
        # `spread_to`: the engines directly. oha resolves `url`'s host:port to one of them at
        # random for each connection it opens (--connect-to, given several times), so the
        # direct run loads both engines as a router does.
        spread = []
        if spread_to:
            authority = url.split("://", 1)[1].split("/", 1)[0]
            for target in spread_to:
                spread += ["--connect-to", f"{authority}:{target.split('://', 1)[1].rstrip('/')}"]
        return [
            str(self.binary),
            "--no-tui",
            "--output-format", "json",
            "-o", str(out),
            "-z", f"{seconds:g}s",
            "-w",  # wait for requests in flight at the deadline: none is aborted
            "-q", f"{rate:g}",
            "--latency-correction",
            "--stats-success-breakdown",
            "-c", str(self.connections),
            "-t", "10s",
            "-m", "POST",
            "-T", "application/json",
            "-Z", str(bodies),
            *spread,
            url,
        ]  # fmt: skip

    def run(self, url: str, rate: float, seconds: float, bodies: Path,
            spread_to: list[str] | None = None) -> tuple[dict, list[str]]:
        self.runs += 1
        out = self.log_dir / f"oha-{self.runs:04d}.json"
        argv = self.argv(url, rate, seconds, bodies, out, spread_to)
        try:
            r = subprocess.run(argv, capture_output=True, text=True, timeout=seconds + 60)
        except subprocess.TimeoutExpired as e:
            raise BenchError(f"oha ran over {seconds + 60:.0f} s: {shlex.join(argv)}") from e
        if r.returncode != 0:
            raise BenchError(f"oha exited {r.returncode}: {r.stderr.strip()[-500:]} ({shlex.join(argv)})")
        try:
            return json.loads(out.read_text()), argv
        except (OSError, ValueError) as e:
            raise BenchError(f"oha wrote no JSON to {out}: {e}") from e


def _ms(x) -> float | None:
    return None if x is None else round(float(x) * 1000.0, 4)


def summarize(res: dict, rate: float, seconds: float) -> dict:
    """The numbers of one oha run; every response that is not 2xx and every transport error is
    counted and named."""
    codes = {str(k): int(v) for k, v in (res.get("statusCodeDistribution") or {}).items()}
    errors = {str(k): int(v) for k, v in (res.get("errorDistribution") or {}).items()}
    ok = sum(v for k, v in codes.items() if k.startswith("2"))
    non_2xx = {k: v for k, v in codes.items() if not k.startswith("2")}
    requests = sum(codes.values()) + sum(errors.values())
    pct = res.get("latencyPercentilesSuccessful") or res.get("latencyPercentiles") or {}
    summary = res.get("summary") or {}
    point = {
        "rate_rps": rate,
        "duration_s": seconds,
        "requests": requests,
        "ok": ok,
        "non_2xx": non_2xx,
        "errors": errors,
        "achieved_rps": round(ok / float(summary.get("total") or seconds), 1) if requests else 0.0,
        "p50_ms": _ms(pct.get("p50")),
        "p99_ms": _ms(pct.get("p99")),
        "p99_9_ms": _ms(pct.get("p99.9")),
        "max_ms": _ms(summary.get("slowest")),
    }
    problems = []
    if requests == 0:
        problems.append("no request completed")
    if non_2xx:
        problems.append(f"{sum(non_2xx.values())} not 2xx ({', '.join(f'{k}: {v}' for k, v in sorted(non_2xx.items()))})")
    if errors:
        problems.append(f"{sum(errors.values())} errors ({'; '.join(f'{k}: {v}' for k, v in sorted(errors.items()))})")
    point["error"] = "; ".join(problems) or None
    reasons = list(problems)
    if point["p99_ms"] is not None and point["p99_ms"] >= P99_LIMIT_MS:
        reasons.append(f"p99 {point['p99_ms']:.2f} ms >= {P99_LIMIT_MS:g} ms")
    if point["achieved_rps"] < MIN_ACHIEVED * rate:
        reasons.append(f"achieved {point['achieved_rps']:.0f} of {rate:g} req/s")
    point["held"] = not reasons
    point["not_held_because"] = "; ".join(reasons) or None
    return point


# -- engines -----------------------------------------------------------------------------------


def reset_engines(engines: list[peers.Engine]) -> None:
    """Empty the engines' prefix caches (the mock answers 409 while a request runs: retry)."""
    for e in engines:

        def reset():
            status, body = http("POST", e.url + "/reset_prefix_cache", timeout=5)
            if status == 409:
                return False
            if status != 200:
                raise BenchError(f"engine {e.worker_id} POST /reset_prefix_cache: status {status}: {body[:200]!r}")
            return True

        wait_for(f"engine {e.worker_id} to reset its prefix cache", reset, 15, interval=0.1)


def check_body(url: str, body: dict, what: str, prompt_tokens: int) -> None:
    """One request with the workload's body, checked in full, before the load (oha only counts
    statuses); `prompt_tokens` is the engine's /tokenize count of its prompt, which the usage
    must repeat (a streamed body is also sent once unstreamed, for its usage)."""
    if body.get("stream"):
        check_body(url, {**body, "stream": False}, what + " (unstreamed)", prompt_tokens)
    status, raw = http("POST", url + "/v1/completions", body, timeout=10)
    if status != 200:
        raise BenchError(f"{what}: status {status}: {raw[:300]!r}")
    text = raw.decode("utf-8", "replace")
    if body.get("stream"):
        events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
        if not events or events[-1] != "[DONE]":
            raise BenchError(f"{what}: the stream does not end with [DONE]: {text[-300:]!r}")
        chunks = [json.loads(e) for e in events[:-1]]
        n = sum(1 for c in chunks if c.get("choices") and c["choices"][0].get("text") is not None)
    else:
        answer = json.loads(text)
        n = (answer.get("usage") or {}).get("completion_tokens")
        counted = (answer.get("usage") or {}).get("prompt_tokens")
        if counted != prompt_tokens:
            raise BenchError(
                f"{what}: the engine counted {counted} prompt tokens, /tokenize {prompt_tokens}"
            )
    if n != body["max_tokens"]:
        raise BenchError(f"{what}: {n} tokens came back, expected {body['max_tokens']}")


def engine_cpu(children) -> float:
    return sum(proc_cpu_seconds(c.pid) for c in children)


def engine_requests(engines: list[peers.Engine]) -> dict[int, float]:
    """vllm:request_success_total of each engine (the mock counts every completed request)."""
    return {e.worker_id: metric_sum(scrape(e.url + "/metrics"), "vllm:request_success_total") for e in engines}


# -- one target: the engines directly or a router ----------------------------------------------


def ladder(
    label: str,
    url: str,
    pid: int | None,
    engines: list[peers.Engine],
    engine_children,
    oha: Oha,
    bodies_file: Path,
    body: dict,
    body_tokens: int,
    cfg: dict,
    stop_early: bool,
    direct: list[dict] | None = None,
) -> tuple[list[dict], str | None, list[str], float | None]:
    """Idle CPU, warm-up, then each rate in turn. Returns the points, why the ladder stopped
    early (None when it ran to the end), the oha commands, and the router's idle CPU (ms/s).
    `pid` None: `url` is engine 1 and oha spreads its connections over every engine.
    `direct`: the engines' own points; each point then gets its added latency, and with
    `stop_early` the ladder stops after the first rate where the router does not hold
    (held_added: an error, under 90 % achieved, or an added p99 of 10 ms or more) in two
    runs in a row."""
    spread = None if pid else [e.url for e in engines]
    idle = None
    if pid:
        # What the router burns with no traffic (health probes, scrapes, timers): part of
        # every figure per request below, and shown on its own.
        c0, t0 = proc_cpu_seconds(pid), time.monotonic()
        time.sleep(cfg["idle_s"])
        idle = round((proc_cpu_seconds(pid) - c0) * 1000 / (time.monotonic() - t0), 3)
    check_body(url, body, f"{label}: check request", body_tokens)
    oha.run(url + "/v1/completions", cfg["rates"][0], cfg["warmup_s"], bodies_file, spread)
    points = []
    commands = []
    stopped = None

    def measure(rate: float) -> dict:
        served0 = engine_requests(engines)
        cpu0 = proc_cpu_seconds(pid) if pid else None
        ecpu0 = engine_cpu(engine_children)
        res, argv = oha.run(url + "/v1/completions", rate, cfg["step_s"], bodies_file, spread)
        cpu1 = proc_cpu_seconds(pid) if pid else None
        ecpu1 = engine_cpu(engine_children)
        served1 = engine_requests(engines)
        p = summarize(res, rate, cfg["step_s"])
        ok = max(1, p["ok"])
        p["cpu_ms_per_request"] = round((cpu1 - cpu0) * 1000 / ok, 4) if pid else None
        p["router_cpu_s"] = round(cpu1 - cpu0, 3) if pid else None
        p["engines_cpu_ms_per_request"] = round((ecpu1 - ecpu0) * 1000 / ok, 4)
        p["requests_per_engine"] = {str(w): int(served1[w] - served0[w]) for w in served1}
        if pid:
            p["rss_mib"] = round(proc_memory_kib(pid)["VmRSS"] / 1024, 1)
        p["command"] = shlex.join(argv)
        if direct is not None:
            add_deltas([p], direct)
        commands.append(p["command"])
        log(
            f"  {label} @ {rate:g} req/s: {p['ok']}/{p['requests']} ok, {p['achieved_rps']:.0f} req/s, "
            f"p50 {p['p50_ms']} ms, p99 {p['p99_ms']} ms, p99.9 {p['p99_9_ms']} ms"
            + (f" (added p99 {p['added_p99_ms']} ms)" if direct is not None else "")
            + (f", CPU {p['cpu_ms_per_request']} ms/request" if pid else "")
            + f", per engine {p['requests_per_engine']}"
            + ("" if p["held"] else f"  NOT HELD: {p['not_held_because']}")
            + ("" if direct is None or p["held_added"] else f"; NOT HELD (added): {p['not_held_added_because']}")
        )
        return p

    for rate in cfg["rates"]:
        p = measure(rate)
        if stop_early and direct is not None and not p["held_added"]:
            # One stall of the shared machine (a few hundred ms) is enough to fail a p99 over
            # 8 s; a rate that fails is run once more, for every router alike, and both runs
            # are kept (`first_attempt`).
            log(f"  {label} @ {rate:g} req/s: not held; once more")
            first = {k: p[k] for k in ("p50_ms", "p99_ms", "p99_9_ms", "added_p99_ms", "ok", "requests",
                                       "achieved_rps", "not_held_added_because") if k in p}
            p = measure(rate)
            p["first_attempt"] = first
        points.append(p)
        if stop_early and direct is not None and not p["held_added"]:
            stopped = f"stopped after {rate:g} req/s: {p['not_held_added_because']}"
            break
    return points, stopped, commands, idle


def add_deltas(points: list[dict], direct: list[dict]) -> None:
    by_rate = {p["rate_rps"]: p for p in direct}
    for p in points:
        d = by_rate.get(p["rate_rps"])
        for k in ("p50_ms", "p99_ms", "p99_9_ms"):
            ak = "added_" + k
            if d is None or p[k] is None or d[k] is None:
                p[ak] = None
            else:
                p[ak] = round(p[k] - d[k], 4)
        p["direct_held"] = None if d is None else d["held"]
        # The same test as `held`, on the router's added p99 instead of its own: with engines
        # that take several ms themselves (4k prompts, a real tokenizer) no router can hold an
        # absolute 10 ms, and this says up to where the router's own cost stays under it.
        reasons = [p["error"]] if p["error"] else []
        if p["achieved_rps"] < MIN_ACHIEVED * p["rate_rps"]:
            reasons.append(f"achieved {p['achieved_rps']:.0f} of {p['rate_rps']:g} req/s")
        added = p["added_p99_ms"]
        if added is None:
            reasons.append("no added p99 (no direct run at this rate)")
        elif added >= P99_LIMIT_MS:
            reasons.append(f"added p99 {added:.2f} ms >= {P99_LIMIT_MS:g} ms")
        p["held_added"] = not reasons
        p["not_held_added_because"] = "; ".join(reasons) or None


def finish_row(row: dict, points: list[dict]) -> None:
    held = [p for p in points if p["held"]]
    row["rates"] = points
    row["max_rate_p99_under_10ms_rps"] = max((p["rate_rps"] for p in held), default=None)
    if all("held_added" in p for p in points):
        row["max_rate_added_p99_under_10ms_rps"] = max(
            (p["rate_rps"] for p in points if p["held_added"]), default=None
        )
    measured = [p for p in points if p.get("router_cpu_s") is not None and p["ok"]]
    total_ok = sum(p["ok"] for p in measured)
    row["cpu_ms_per_request"] = (
        round(sum(p["router_cpu_s"] for p in measured) * 1000 / total_ok, 4) if total_ok else None
    )
    row["requests"] = sum(p["requests"] for p in points)
    row["failures"] = sum(p["requests"] - p["ok"] for p in points)


def check_overlap(spec: peers.RouterSpec, router: peers.Router, engines: list[peers.Engine], row: dict,
                  probes: list[str]) -> None:
    """After a router-host ladder: its KV index must hold blocks (the engines' events reached
    it; it should hold what they published, and the row says whether it does), and a two-tier
    router must route a prompt cached on each engine back to that engine (its token ids hash
    to the engines'). Raises BenchError otherwise: the row's numbers would not be two-tier's."""
    kv = peers.wait_kv_index(router, engines, timeout_s=10)
    row["kv_index_after_ladder"] = kv
    log(f"  {spec.label}: router_kv_index_blocks {kv['router_blocks']}, engines published "
        f"{kv['engine_published_blocks']}" + ("" if kv["agree"] else " (NOT EQUAL after 10 s: events lost?)"))
    if not any(v > 0 for v in kv["router_blocks"].values()):
        raise BenchError(f"{spec.label}: router_kv_index_blocks is 0 for every worker after the ladder: "
                         f"the engines' KV events did not reach it ({kv})")
    if spec.policy == "two-tier":
        if len(probes) < len(engines):
            raise BenchError(f"{spec.label}: no fresh prompts left for the overlap probe")
        seen = peers.overlap_probe(router, engines, MODEL, [probes.pop() for _ in engines])
        row["overlap_probe"] = seen
        log(f"  {spec.label}: overlap probe ok: "
            + ", ".join(f"cached on worker {w}, routed to {x['routed_to']}, {x['cached_tokens']} of "
                        f"{x['prompt_tokens']} tokens cached" for w, x in seen.items()))


# -- main --------------------------------------------------------------------------------------


def main() -> int:
    install_signal_handlers()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=HERE / "results",
                    help="writes OUT/overhead.json (default: results/ beside this script)")
    ap.add_argument("--quick", action="store_true", help=f"smoke-sized: {QUICK}")
    ap.add_argument("--bench-cache", type=Path,
                    default=Path(os.environ.get("ROUTER_BENCH_CACHE", Path.home() / ".cache" / "router-host-live-bench")))
    ap.add_argument("--target-dir", type=Path, default=Path(os.environ.get("CARGO_TARGET_DIR", REPO / "target")))
    ap.add_argument("--log-dir", type=Path, help="default TARGET/live-bench/logs/overhead")
    ap.add_argument("--routers", help="comma-separated labels (or parts of labels) of peers.ALL_ROUTERS; default all")
    ap.add_argument("--workloads", default=",".join(DEFAULT_WORKLOADS),
                    help=f"comma-separated, of {', '.join(WORKLOADS)} (default {','.join(DEFAULT_WORKLOADS)})")
    ap.add_argument("--rates", help="comma-separated request rates (req/s), ascending, for every workload; default "
                    f"{FULL['rates']} ({QUICK['rates']} with --quick), prompt-4k {FULL['rates_by_workload']['prompt-4k']} "
                    f"({QUICK['rates_by_workload']['prompt-4k']})")
    ap.add_argument("--step-seconds", type=float, help=f"seconds per rate (default {FULL['step_s']:g}, {QUICK['step_s']:g} with --quick)")
    ap.add_argument("--connections", type=int, default=32, help="oha -c (default 32)")
    ap.add_argument("--tokenizer", type=Path,
                    help="the engines' (and router-host's) tokenizer directory; default the real-vLLM rig's "
                    f"tiny model ({RIG_MODEL_DIR}, honours ROUTER_RIG_CACHE) when built, else {FIXTURE_TOKENIZER}")
    args = ap.parse_args()

    cfg = dict(QUICK if args.quick else FULL)
    if args.rates:
        try:
            cfg["rates"] = [float(x) for x in args.rates.split(",") if x.strip()]
            cfg["rates_by_workload"] = {}
        except ValueError:
            ap.error(f"--rates {args.rates!r}: expected numbers separated by commas")
        if not cfg["rates"] or cfg["rates"] != sorted(cfg["rates"]) or min(cfg["rates"]) <= 0:
            ap.error(f"--rates {args.rates!r}: expected positive rates in ascending order")
    if args.step_seconds is not None:
        if args.step_seconds <= 0:
            ap.error("--step-seconds must be positive")
        cfg["step_s"] = args.step_seconds
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    for w in workloads:
        if w not in WORKLOADS:
            ap.error(f"--workloads: unknown workload `{w}` (known: {', '.join(WORKLOADS)})")
    # Part 1 only: the remote-tokenizer row, beside the local one it is the cost of.
    specs = []
    for spec in peers.ALL_ROUTERS:
        specs.append(spec)
        if spec.name == "router-host" and spec.policy == "two-tier":
            specs.append(peers.TWO_TIER_REMOTE_TOKENIZER)
    if args.routers:
        # The gateway rows (run.sh --gateway) are chosen by name only.
        specs = specs + peers.GATEWAY_ROUTERS
        known = [s.label for s in specs]
        specs = peers.select_routers(specs, args.routers)
        if not specs:
            ap.error(f"--routers {args.routers!r} matches none of {known}")
    try:
        tok = pick_tokenizer(args.tokenizer)
    except BenchError as e:
        ap.error(str(e))
    log(f"tokenizer: {tok['path']} ({tok['model_type']}, {tok['vocab_size']} entries; {tok['source']})")

    target = args.target_dir if args.target_dir.is_absolute() else REPO / args.target_dir
    bins = peers.find_bins(args.bench_cache, target)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    log_dir = args.log_dir or target / "live-bench" / "logs" / "overhead"
    log_dir.mkdir(parents=True, exist_ok=True)
    oha = Oha(bins.oha, args.connections, log_dir)
    t_start = time.monotonic()

    try:
        import report

        machine = report.machine_info()
    except ImportError as e:
        machine = {"nproc": os.cpu_count(), "note": f"report.machine_info unavailable: {e}"}
    doc = {
        "part": "overhead",
        "quick": args.quick,
        "versions": peers.peer_versions(bins, REPO),
        "machine": machine,
        "settings": {
            **cfg,
            "p99_limit_ms": P99_LIMIT_MS,
            "min_achieved_share": MIN_ACHIEVED,
            "oha_connections": args.connections,
            "engines": "2 x router-host mock-engine, --step-overhead-ms 0 --decode-ms-per-seq 0 "
            f"--prefill-ms-per-token 0, --tokenizer {tok['path']} ({tok['model_type']}), KV events on ZMQ",
            "tokenizer": {k: v for k, v in tok.items() if not k.startswith("_")},
            "router_host_tokenizer": "local (serve.tokenizer: {path: DIR}, the engines' files) unless the row says "
            "remote (serve.tokenizer: remote: one POST /tokenize to an engine per request)",
            "direct": "oha straight to the engines at the same rates, each connection to one of them at random "
            "(oha --connect-to given once per engine); requests_per_engine shows the split",
            "added_latency": "the router's percentile minus the direct run's at the same rate (successful requests only)",
            "held": "held: every request 2xx, at least 90 % of the rate achieved and p99 under 10 ms "
            "(max_rate_p99_under_10ms_rps); held_added: the same with the router's added p99 under 10 ms "
            "(max_rate_added_p99_under_10ms_rps). A router's ladder stops after the first rate not held_added",
            "cpu": "utime + stime of the router's process group from /proc, before and after each rate, "
            "divided by the 2xx requests of that rate; the row's figure is over every rate run; "
            "idle_cpu_ms_per_s is the router's CPU with no traffic (included in the figures per request)",
            "rss": "VmRSS after the last rate (rss_mib) and VmHWM (rss_peak_mib) of a router started for this workload",
        },
        "workloads": {w: WORKLOADS[w] for w in workloads},
        "commands": [],
        "rows": [],
    }

    def write() -> None:
        doc["elapsed_s"] = round(time.monotonic() - t_start, 1)
        tmp = out / "overhead.json.tmp"
        tmp.write_text(json.dumps(doc, indent=2) + "\n")
        tmp.replace(out / "overhead.json")

    status = 0
    engine_children = []
    try:
        engines = []
        for w in (1, 2):
            e, child = peers.start_mock_engine(w, bins, log_dir, model=MODEL, block_size=BLOCK_SIZE,
                                               tokenizer_dir=tok["path"])
            engines.append(e)
            engine_children.append(child)
            doc["commands"].append(shlex.join(child.argv))
        log("engines: " + ", ".join(f"{e.url} (events {e.kv_events})" for e in engines))
        builder = PromptBuilder(engines[0], tok, seed=16)
        doc["settings"]["tokenizer"]["tokens_per_word"] = round(builder.tokens_per_item, 3)
        instant: list[peers.Engine] = []
        instant_children = []
        for w in workloads:
            t0 = time.monotonic()
            w_engines, w_children = engines, engine_children
            if WORKLOADS[w].get("engines") == "instant":
                if not instant:
                    byte_dir = write_byte_tokenizer(log_dir / "byte-tokenizer")
                    for wid in (1, 2):
                        e, child = peers.start_mock_engine(
                            wid, bins, log_dir / "instant", model=MODEL, block_size=BYTES_BLOCK_SIZE,
                            extra_args=["--max-model-len", str(BYTES_MAX_MODEL_LEN)])
                        # The mock's byte tokenizer's ids, for router-host's local tokenizer.
                        e.tokenizer_dir = str(byte_dir)
                        instant.append(e)
                        instant_children.append(child)
                        doc["commands"].append(shlex.join(child.argv))
                    log("instant engines: " + ", ".join(f"{e.url} (events {e.kv_events})" for e in instant))
                w_engines, w_children = instant, instant_children
            bodies, counts, info, probes = workload_bodies(w, builder)
            bodies_file = log_dir / f"bodies-{w}.jsonl"
            bodies_file.write_text("".join(json.dumps(b, separators=(",", ":")) + "\n" for b in bodies))
            doc["workloads"][w] = {**WORKLOADS[w], **info, "bodies": len(bodies), "bodies_file": str(bodies_file)}
            log(f"[{w}] {len(bodies)} bodies, prompt tokens {info['prompt_tokens']}"
                + (f", shared preamble {info['shared_prefix_tokens']} tokens" if "shared_prefix_tokens" in info else "")
                + f" ({time.monotonic() - t0:.1f} s, {builder.calls} /tokenize calls so far)")

            log(f"[{w}] {DIRECT} ({w_engines[0].url})")
            reset_engines(w_engines)
            wcfg = {**cfg, "rates": cfg["rates_by_workload"].get(w, cfg["rates"])}
            doc["workloads"][w]["rates"] = wcfg["rates"]
            direct, _, cmds, _ = ladder(DIRECT, w_engines[0].url, None, w_engines, w_children, oha,
                                        bodies_file, bodies[0], counts[0], wcfg, stop_early=False)
            row = {"router": DIRECT, "router_name": "direct", "policy": None, "workload": w}
            finish_row(row, direct)
            for p in direct:
                p.update(added_p50_ms=None, added_p99_ms=None, added_p99_9_ms=None, direct_held=p["held"],
                         held_added=None, not_held_added_because=None)
            row["max_rate_added_p99_under_10ms_rps"] = None
            doc["rows"].append(row)
            doc["commands"] += cmds[:1]
            write()

            for spec in specs:
                log(f"[{w}] {spec.label}")
                row = {"router": spec.label, "router_name": spec.name, "policy": spec.policy, "workload": w,
                       "tokenizer": None}
                router = None
                try:
                    reset_engines(w_engines)
                    # On instant engines the ids would save them nothing: router-host sends the
                    # prompt as text, as the peers do, and tokenizes only when its policy reads ids.
                    router = peers.start_router(spec, w_engines, port=free_port(), log_dir=log_dir, bins=bins,
                                                model=MODEL, timeout_s=60,
                                                forward_token_ids=WORKLOADS[w].get("engines") != "instant")
                    row["command"] = shlex.join(router.argv)
                    row["tokenizer"] = router.tokenizer
                    if router.config:
                        row["config"] = router.config.read_text()
                    points, stopped, cmds, idle = ladder(spec.label, router.url, router.pid, w_engines,
                                                         w_children, oha, bodies_file, bodies[0], counts[0],
                                                         wcfg, stop_early=True, direct=direct)
                    row["idle_cpu_ms_per_s"] = idle
                    finish_row(row, points)
                    mem = proc_memory_kib(router.pid)
                    row["rss_mib"] = round(mem["VmRSS"] / 1024, 1)
                    row["rss_peak_mib"] = round(mem["VmHWM"] / 1024, 1)
                    row["stopped"] = stopped
                    if not router.alive():
                        raise BenchError(f"{spec.label} died during the run: {router.child.log_tail()}")
                    if spec.name in ("router-host", "envoy-epp"):
                        check_overlap(spec, router, w_engines, row, probes)
                    if w == workloads[0]:
                        doc["commands"].append(row["command"])
                except (RigFailure, OSError, ValueError) as e:
                    # One router failing (a start, a check, a load run) is reported in its row;
                    # the others still run.
                    row["error"] = f"{type(e).__name__}: {e}"[:2000]
                    status = 1
                    log(f"FAILED: {spec.label} ({w}): {e}")
                finally:
                    if router is not None:
                        router.stop()
                doc["rows"].append(row)
                write()
    except (RigFailure, OSError, ValueError, KeyboardInterrupt, SystemExit) as e:
        doc["error"] = f"{type(e).__name__}: {e}"
        log(f"FAILED: {doc['error']}")
        status = 1
    finally:
        stop_all()
        write()
        log(f"wrote {out / 'overhead.json'} in {time.monotonic() - t_start:.0f} s ({oha.runs} oha runs)")
    return status


if __name__ == "__main__":
    sys.exit(main())
