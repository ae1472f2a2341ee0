"""What the live benchmark's scripts share: child processes in their own process groups (killed
at exit, on Ctrl-C and on SIGTERM), free ports on 127.0.0.1, waits with deadlines, and the
kernel's view of a process (CPU time and resident memory from /proc).

HTTP, Prometheus scraping and polling come from the real-vLLM rig (`../vllm_rig/support.py`),
imported rather than copied.
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RIG_DIR = HERE.parent / "vllm_rig"
LIB_DIR = HERE.parent / "lib"
for d in (RIG_DIR, LIB_DIR):
    if str(d) not in sys.path:
        sys.path.insert(0, str(d))

# Re-exported for the other scripts of this directory.
from support import Fatal, RigFailure, http, metric_sum, scrape, tail, wait_for  # noqa: E402,F401
from support import _group_alive, _kill_group  # noqa: E402,F401  (process groups, as the rig kills them)
from ports import free_port  # noqa: E402,F401  (scripts/lib: ports no two children share)

__all__ = [
    "BenchError",
    "Child",
    "Fatal",
    "RigFailure",
    "free_port",
    "http",
    "install_signal_handlers",
    "log",
    "metric_sum",
    "proc_cpu_seconds",
    "proc_memory_kib",
    "scrape",
    "spawn",
    "stop_all",
    "tail",
    "wait_for",
]

CLK_TCK = os.sysconf("SC_CLK_TCK")


def log(msg: str) -> None:
    print(f"[live-bench {time.strftime('%H:%M:%S', time.gmtime())}] {msg}", file=sys.stderr, flush=True)


class BenchError(RigFailure):
    """A failure of the benchmark that names what failed (a router, an engine, a load run)."""


# -- child processes -------------------------------------------------------------------------


class Child:
    """One started process, the leader of its own process group (a router may fork helpers;
    the whole group goes on stop)."""

    def __init__(self, name: str, argv: list[str], proc: subprocess.Popen, log_path: Path, stdout_path: Path | None):
        self.name = name
        self.argv = argv  # the exact command, for the report
        self.proc = proc
        self.pid = proc.pid
        self.log_path = log_path
        self.stdout_path = stdout_path

    def alive(self) -> bool:
        return self.proc.poll() is None

    def returncode(self) -> int | None:
        return self.proc.poll()

    def log_tail(self, lines: int = 30) -> str:
        out = tail(str(self.log_path), lines)
        if self.stdout_path is not None:
            out = tail(str(self.stdout_path), 5) + "\n" + out
        return out

    def stop(self, timeout: float = 10.0) -> None:
        _forget(self)
        _kill_group(self.proc, timeout)
        _unlist([self.pid])


_children: list[Child] = []
_children_lock = threading.Lock()


def _forget(child: Child) -> None:
    with _children_lock:
        if child in _children:
            _children.remove(child)


def _unlist(pgids: list[int]) -> None:
    """Drop stopped groups from run.sh's list, so that it never signals a process group number
    the kernel may since have given to someone else."""
    path = os.environ.get("LIVE_BENCH_PGIDS")
    if not path or not pgids:
        return
    with _children_lock:
        try:
            with open(path) as f:
                listed = [line.strip() for line in f if line.strip()]
        except OSError:
            return
        gone = {str(p) for p in pgids}
        with open(path, "w") as f:
            f.writelines(f"{p}\n" for p in listed if p not in gone)


def spawn(
    name: str,
    argv: list[str],
    log_dir: Path,
    *,
    env: dict[str, str] | None = None,
    separate_stdout: bool = False,
) -> Child:
    """Start `argv` in a new session (its own process group), stderr (and stdout unless
    `separate_stdout`) to `log_dir/NAME.log`; with `separate_stdout`, stdout goes to
    `log_dir/NAME.stdout` (the mock engine prints its addresses there)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    stdout_path = log_dir / f"{name}.stdout" if separate_stdout else None
    err = open(log_path, "ab")
    err.write(f"\n==== {time.strftime('%H:%M:%S')} start: {' '.join(argv)}\n".encode())
    err.flush()
    out = open(stdout_path, "wb") if stdout_path is not None else err
    try:
        proc = subprocess.Popen(
            argv,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err if stdout_path is not None else subprocess.STDOUT,
            start_new_session=True,
        )
    except OSError as e:
        raise BenchError(f"cannot start {name} ({argv[0]}): {e}") from e
    finally:
        err.close()
        if out is not err:
            out.close()
    child = Child(name, list(argv), proc, log_path, stdout_path)
    with _children_lock:
        _children.append(child)
    # run.sh kills every group listed here if this Python process is itself killed hard.
    pgids = os.environ.get("LIVE_BENCH_PGIDS")
    if pgids:
        with open(pgids, "a") as f:
            f.write(f"{proc.pid}\n")
    return child


def stop_all(timeout: float = 10.0) -> None:
    """SIGTERM every child group at once, SIGKILL what is left after `timeout`."""
    with _children_lock:
        children = list(_children)
        _children.clear()
    for c in children:
        try:
            os.killpg(c.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout
    for c in children:
        _kill_group(c.proc, max(0.0, deadline - time.monotonic()))
    _unlist([c.pid for c in children])


atexit.register(stop_all)


def install_signal_handlers() -> None:
    """SIGTERM and SIGHUP exit through `SystemExit` (so `finally` blocks and atexit run and
    every child group is killed), as SIGINT does through KeyboardInterrupt."""

    def handler(signum, _frame):
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, handler)


# -- /proc -----------------------------------------------------------------------------------


def _group_pids(pgid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        # fields[0] is field 3 (state); pgrp is field 5.
        if int(fields[2]) == pgid:
            pids.append(int(entry))
    return pids


def _cpu_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        stat = f.read()
    # The command name may hold spaces and parentheses: split after the last ')'.
    fields = stat[stat.rindex(")") + 2 :].split()
    # utime and stime are fields 14 and 15 (1-based), i.e. 11 and 12 after the name.
    return int(fields[11]) + int(fields[12])


def proc_cpu_seconds(pid: int) -> float:
    """utime + stime of every process in `pid`'s process group (all their threads), seconds.
    Routers here are a single process; the group sum also covers any helper they fork."""
    total = 0
    for p in _group_pids(pid) or [pid]:
        try:
            total += _cpu_ticks(p)
        except (OSError, ValueError, IndexError):
            pass
    return total / CLK_TCK


def proc_memory_kib(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (peak RSS) of the process `pid`, in KiB."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(rest.split()[0])
    if "VmRSS" not in out or "VmHWM" not in out:
        raise BenchError(f"/proc/{pid}/status has no VmRSS/VmHWM (the process is gone?)")
    return out
