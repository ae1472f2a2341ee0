"""What the rig's other files share: logging, failures, child processes, HTTP, metrics, waits."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request


def log(msg: str) -> None:
    print(f"[vllm-rig {time.strftime('%H:%M:%S', time.gmtime())}] {msg}", file=sys.stderr, flush=True)


class RigFailure(Exception):
    pass


class Fatal(RigFailure):
    """A failure no amount of waiting fixes (a process died): stops a wait at once."""


class Processes:
    """Every child, each in its own process group (vLLM forks an engine-core process and workers),
    killed group-wide on exit."""

    def __init__(self, log_dir: str):
        self.log_dir = log_dir
        self.children: dict[str, subprocess.Popen] = {}
        self.lock = threading.Lock()

    def start(self, name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen:
        path = os.path.join(self.log_dir, f"{name}.log")
        out = open(path, "ab")
        out.write(f"\n==== {time.strftime('%H:%M:%S')} start: {' '.join(argv)}\n".encode())
        out.flush()
        proc = subprocess.Popen(
            argv,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        out.close()
        with self.lock:
            self.children[name] = proc
        # run.sh kills whatever is still listed here if this process itself is killed hard.
        with open(os.path.join(self.log_dir, "pgids"), "a") as f:
            f.write(f"{proc.pid}\n")
        return proc

    def stop(self, name: str, timeout: float = 30.0) -> None:
        with self.lock:
            proc = self.children.pop(name, None)
        if proc is None:
            return
        _kill_group(proc, timeout)

    def stop_all(self, timeout: float = 15.0) -> None:
        """SIGTERM every group at once, SIGKILL what is left after `timeout`."""
        with self.lock:
            procs = list(self.children.values())
            self.children.clear()
        for proc in procs:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + timeout
        for proc in procs:
            _kill_group(proc, max(0.0, deadline - time.monotonic()))

    def log_path(self, name: str) -> str:
        return os.path.join(self.log_dir, f"{name}.log")


def _kill_group(proc: subprocess.Popen, timeout: float) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None and not _group_alive(proc.pid):
            return
        time.sleep(0.2)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
    # The group's other members (engine core, workers) die with SIGKILL too; wait for them.
    deadline = time.monotonic() + 10
    while _group_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def tail(path: str, lines: int = 40) -> str:
    try:
        with open(path, "rb") as f:
            data = f.read()[-64 * 1024 :]
    except OSError as e:
        return f"(cannot read {path}: {e})"
    text = data.decode("utf-8", "replace").splitlines()
    return "\n".join(text[-lines:])


def http(method: str, url: str, body: dict | None = None, timeout: float = 10.0) -> tuple[int, bytes]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        req.add_header("content-type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def scrape(url: str, timeout: float = 5.0) -> list[tuple[str, dict[str, str], float]]:
    """Samples of a Prometheus or OpenMetrics text page: (name, labels, value)."""
    status, body = http("GET", url, timeout=timeout)
    if status != 200:
        raise RigFailure(f"GET {url}: status {status}: {body[:300]!r}")
    out = []
    for line in body.decode("utf-8", "replace").splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        labels = dict(_LABEL.findall(m.group(3) or ""))
        try:
            value = float(m.group(4))
        except ValueError:
            continue
        out.append((m.group(1), labels, value))
    return out


def metric_sum(samples, name: str, **labels: str) -> float:
    return sum(
        v for n, l, v in samples if n == name and all(l.get(k) == want for k, want in labels.items())
    )


def wait_for(what: str, predicate, timeout: float, interval: float = 0.5, on_timeout=None):
    """Poll `predicate` until it returns a truthy value or `timeout` passes."""
    deadline = time.monotonic() + timeout
    last_err = None
    while True:
        try:
            value = predicate()
            if value:
                return value
        except Fatal:
            raise
        except (OSError, RigFailure, urllib.error.URLError, ValueError) as e:
            last_err = e
        if time.monotonic() >= deadline:
            detail = on_timeout() if on_timeout else ""
            raise RigFailure(
                f"timed out after {timeout:.0f} s waiting for {what}"
                + (f" (last error: {last_err})" if last_err else "")
                + (f": {detail}" if detail else "")
            )
        time.sleep(interval)
