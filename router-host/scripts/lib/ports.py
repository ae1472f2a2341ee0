"""Ports for the processes a harness starts on 127.0.0.1.

The kernel's own pick (`bind(("127.0.0.1", 0))`) hands out a port from the ephemeral range and
forgets it once the probe socket closes. Between that pick and the child's `bind`, any process's
outgoing connection (the router's to an engine, an engine's to Redis) may be given the same port
as its local end, and a second pick may return the same port again. A chaos run starts dozens of
children and restarts some on their old ports, so both happen.

A port handed out here is therefore
- below the kernel's ephemeral range (`net.ipv4.ip_local_port_range`), so no outgoing connection
  is ever given it,
- never handed out twice by one harness process, and
- bindable on 127.0.0.1 when handed out (another listener may still take it later; a child that
  cannot bind fails its start with a clear error and the harness's own retries apply).
"""

from __future__ import annotations

import random
import socket
import threading

# Below this are well-known and registered services more often run on a developer's machine.
_LOWEST = 10000
# A pool smaller than this (an ephemeral range that starts very low) is not worth avoiding the
# ephemeral range for: use everything above `_LOWEST` instead.
_MIN_POOL = 2000

_LOCK = threading.Lock()
_HANDED_OUT: set[int] = set()
# Not the workloads' seeded generators: two harnesses started at once must not pick alike.
_RNG = random.SystemRandom()


def _pool() -> tuple[int, int]:
    """[low, high): the ports this module picks from."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral_low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768  # Linux's default
    if ephemeral_low - _LOWEST >= _MIN_POOL:
        return _LOWEST, ephemeral_low
    return _LOWEST, 65536


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port_run(n: int = 1) -> int:
    """A port P such that P .. P+n-1 are all free on 127.0.0.1 now and none was handed out
    before by this process (an engine's data-parallel ranks bind PORT + rank)."""
    if n < 1:
        raise ValueError(f"free_port_run: n must be at least 1, not {n}")
    low, high = _pool()
    with _LOCK:
        for _ in range(1000):
            base = _RNG.randrange(low, high - n + 1)
            run = range(base, base + n)
            if any(p in _HANDED_OUT for p in run) or not all(_bindable(p) for p in run):
                continue
            _HANDED_OUT.update(run)
            return base
    raise OSError(f"no run of {n} free ports in [{low}, {high}) on 127.0.0.1 after 1000 tries")


def free_port() -> int:
    """One port, as `free_port_run(1)`."""
    return free_port_run(1)
