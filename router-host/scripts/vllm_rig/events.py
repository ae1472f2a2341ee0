"""The engines' own account of their caches: a SUB socket per engine next to the router's.

What it holds is the ground truth the router's index is compared with (docs/engines.md, "The
real-vLLM rig"). It can also save raw messages as test fixtures.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field

import msgspec
import zmq


@dataclass
class EngineTruth:
    """What one engine says it caches, from its own events (device tier, group 0)."""

    blocks: set = field(default_factory=set)
    last_seq: int | None = None
    messages: int = 0
    stored_events: int = 0
    removed_events: int = 0
    cleared_events: int = 0
    restarts: int = 0
    gaps: int = 0
    other_events: int = 0


class EventWatcher:
    """A SUB socket per engine, next to the router's (PUB fans out to every subscriber)."""

    def __init__(self, endpoints: dict[int, str], capture_dir: str | None, capture_limit: int):
        self.ctx = zmq.Context()
        self.truth = {w: EngineTruth() for w in endpoints}
        self.lock = threading.Lock()
        self.stop_flag = threading.Event()
        self.capture_dir = capture_dir
        self.capture_limit = capture_limit
        self.captured: dict[str, int] = {}
        self.last_message_at = time.monotonic()
        self.threads = []
        for worker, endpoint in endpoints.items():
            t = threading.Thread(target=self._run, args=(worker, endpoint), daemon=True)
            t.start()
            self.threads.append(t)

    def _run(self, worker: int, endpoint: str) -> None:
        sock = self.ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        try:
            while not self.stop_flag.is_set():
                if not sock.poll(200):
                    continue
                frames = sock.recv_multipart()
                self._apply(worker, frames)
        finally:
            sock.close()

    def _apply(self, worker: int, frames: list[bytes]) -> None:
        with self.lock:
            self.last_message_at = time.monotonic()
            t = self.truth[worker]
            t.messages += 1
            if len(frames) != 3 or len(frames[1]) != 8:
                t.other_events += 1
                return
            seq = int.from_bytes(frames[1], "big")
            restarted = False
            if t.last_seq is not None:
                if seq <= t.last_seq:
                    restarted = True
                    t.restarts += 1
                    t.blocks.clear()
                elif seq > t.last_seq + 1:
                    t.gaps += 1
            t.last_seq = seq
            batch = msgspec.msgpack.decode(frames[2])
            for event in batch[1]:
                kind, fields = _event_fields(event)
                device = fields.get("medium") in (None, "GPU") and fields.get("group_idx") in (None, 0)
                if kind == "BlockStored" and device:
                    t.stored_events += 1
                    t.blocks.update(_hashable(h) for h in fields["block_hashes"])
                elif kind == "BlockRemoved" and device:
                    t.removed_events += 1
                    for h in fields["block_hashes"]:
                        t.blocks.discard(_hashable(h))
                elif kind == "AllBlocksCleared":
                    t.cleared_events += 1
                    t.blocks.clear()
                else:
                    t.other_events += 1
            self._capture(worker, seq, frames, restarted)

    def _capture(self, worker: int, seq: int, frames: list[bytes], restarted: bool) -> None:
        """Save the first `capture_limit` messages of each engine process, in order, frame by
        frame (the fixtures of tests/vllm_event_fixtures.rs)."""
        if not self.capture_dir:
            return
        process = self.captured.get(f"process{worker}", 1) + (1 if restarted else 0)
        self.captured[f"process{worker}"] = process
        key = f"w{worker}-p{process}"
        if self.captured.get(key, 0) >= self.capture_limit:
            return
        self.captured[key] = self.captured.get(key, 0) + 1
        directory = os.path.join(self.capture_dir, key)
        os.makedirs(directory, exist_ok=True)
        for i, frame in enumerate(frames):
            with open(os.path.join(directory, f"seq{seq:05d}.frame{i}"), "wb") as f:
                f.write(frame)

    def snapshot(self) -> dict[int, EngineTruth]:
        with self.lock:
            return {
                w: EngineTruth(**{**t.__dict__, "blocks": set(t.blocks)}) for w, t in self.truth.items()
            }

    def quiet_for(self, seconds: float) -> bool:
        with self.lock:
            return time.monotonic() - self.last_message_at >= seconds

    def close(self) -> None:
        self.stop_flag.set()
        for t in self.threads:
            t.join(timeout=5)
        self.ctx.term()


def _event_fields(event) -> tuple[str, dict]:
    if isinstance(event, dict):
        return str(event.get("type")), event
    if isinstance(event, (list, tuple)) and event:
        kind = str(event[0])
        names = {
            "BlockStored": ["block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium"],
            "BlockRemoved": ["block_hashes", "medium"],
        }.get(kind, [])
        return kind, dict(zip(names, event[1:]))
    return "?", {}


def _hashable(h):
    return bytes(h) if isinstance(h, (bytes, bytearray, list)) else h
