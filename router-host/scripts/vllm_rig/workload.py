"""The rig's workload: multi-turn chat sessions and plain completions through the router with
the real `openai` client, and what counts as an answered request."""

from __future__ import annotations

import concurrent.futures
import random
from dataclasses import dataclass

from build_model import WORDS  # the same words the tokenizer was trained on
from support import log

MODEL_NAME = "tiny"
# The workload: SESSIONS conversations of TURNS chat turns, CLIENT_THREADS at a time. Few turns
# that each add many tokens (a small shared system prompt, a short document, long user turns):
# what a cache-aware policy saves per turn is the previous turn's growth, which round-robin
# recomputes whenever a turn lands on the other engine.
SESSIONS = 16
TURNS = 4
CLIENT_THREADS = 8
MAX_TOKENS = 16
# Words per part of a prompt (about one token each with the rig's tokenizer).
SYSTEM_WORDS = 30
DOC_WORDS = 40
USER_WORDS = 150


@dataclass
class Reply:
    session: str
    turn: int
    endpoint: str
    stream: bool
    worker: str | None
    session_outcome: str | None
    text: str
    completion_tokens: int | None
    error: str | None = None
    # The decision's reason (`x-router-reason`), for chat turns.
    reason: str | None = None


def session_script(seed: int) -> tuple[str, str, list[str]]:
    """A session's system prompt (shared by all), its document (its own) and its user turns."""
    rng = random.Random(seed)

    def words(n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n))

    system = "You are a careful assistant. " + " ".join(random.Random(7).choice(WORDS) for _ in range(SYSTEM_WORDS))
    document = f"Document for session {seed}: " + words(DOC_WORDS)
    turns = [f"Question {k + 1}: " + words(USER_WORDS) for k in range(TURNS + 1)]
    return system, document, turns


def run_session(client, index: int, extra_turns: range | None = None, history=None) -> tuple[list[Reply], list]:
    """One session's turns, in order, through the router: chat completions, alternately streamed
    (with the usage chunk) and not. Returns the replies and the conversation so far."""
    sid = f"rig-session-{index}"
    system, document, turns = session_script(index)
    if history is None:
        history = [{"role": "system", "content": system}]
    replies = []
    for k in extra_turns if extra_turns is not None else range(TURNS):
        content = (document + "\n" if k == 0 else "") + turns[k]
        history.append({"role": "user", "content": content})
        stream = k % 2 == 1
        reply = chat(client, sid, k, history, stream)
        replies.append(reply)
        history.append({"role": "assistant", "content": reply.text})
    return replies, history


def chat(client, sid: str, turn: int, messages: list, stream: bool) -> Reply:
    kwargs = dict(
        model=MODEL_NAME,
        messages=messages,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_headers={"x-session-id": sid},
        # Random weights: without these, a reply can end at once on an EOS.
        extra_body={"min_tokens": MAX_TOKENS, "ignore_eos": True},
    )
    try:
        if stream:
            raw = client.chat.completions.with_raw_response.create(
                stream=True, stream_options={"include_usage": True}, **kwargs
            )
            text, usage, finish = "", None, None
            for chunk in raw.parse():
                if chunk.choices:
                    text += chunk.choices[0].delta.content or ""
                    finish = chunk.choices[0].finish_reason or finish
                if chunk.usage:
                    usage = chunk.usage.completion_tokens
            err = None if finish else "the stream ended without a finish_reason"
        else:
            raw = client.chat.completions.with_raw_response.create(**kwargs)
            parsed = raw.parse()
            text = parsed.choices[0].message.content or ""
            usage = parsed.usage.completion_tokens if parsed.usage else None
            err = None if parsed.choices[0].finish_reason else "no finish_reason"
        return Reply(sid, turn, "chat", stream, raw.headers.get("x-router-worker"),
                     raw.headers.get("x-router-session"), text, usage, err,
                     reason=raw.headers.get("x-router-reason"))
    except Exception as e:  # every failure is reported as a failed request, with its message
        return Reply(sid, turn, "chat", stream, None, None, "", None, f"{type(e).__name__}: {e}")


def completions(client, index: int) -> list[Reply]:
    """A few plain completions (no session) sharing a long prefix, streamed and not."""
    rng = random.Random(1000 + index)
    prefix = "Shared report: " + " ".join(random.Random(99).choice(WORDS) for _ in range(200))
    prompt = prefix + " Query: " + " ".join(rng.choice(WORDS) for _ in range(20))
    out = []
    for stream in (False, True):
        try:
            kwargs = dict(model=MODEL_NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                          extra_body={"min_tokens": MAX_TOKENS, "ignore_eos": True})
            if stream:
                raw = client.completions.with_raw_response.create(
                    stream=True, stream_options={"include_usage": True}, **kwargs)
                text, usage, finish = "", None, None
                for chunk in raw.parse():
                    if chunk.choices:
                        text += chunk.choices[0].text or ""
                        finish = chunk.choices[0].finish_reason or finish
                    if chunk.usage:
                        usage = chunk.usage.completion_tokens
                err = None if finish else "the stream ended without a finish_reason"
            else:
                raw = client.completions.with_raw_response.create(**kwargs)
                parsed = raw.parse()
                text = parsed.choices[0].text
                usage = parsed.usage.completion_tokens if parsed.usage else None
                err = None if parsed.choices[0].finish_reason else "no finish_reason"
            out.append(Reply(f"completion-{index}", 0, "completions", stream,
                             raw.headers.get("x-router-worker"), None, text, usage, err))
        except Exception as e:
            out.append(Reply(f"completion-{index}", 0, "completions", stream, None, None, "", None,
                             f"{type(e).__name__}: {e}"))
    return out


def make_client(router_url: str):
    from openai import OpenAI

    return OpenAI(base_url=router_url + "/v1", api_key="unused", timeout=120.0, max_retries=0)


def run_workload(router_url: str) -> tuple[list[Reply], dict[int, list]]:
    client = make_client(router_url)
    replies: list[Reply] = []
    histories: dict[int, list] = {}
    with concurrent.futures.ThreadPoolExecutor(CLIENT_THREADS) as pool:
        futures = {pool.submit(run_session, client, i): i for i in range(SESSIONS)}
        done_completions = [pool.submit(completions, client, i) for i in range(2)]
        for fut in concurrent.futures.as_completed(list(futures) + done_completions, timeout=900):
            result = fut.result()
            if fut in futures:
                r, h = result
                replies.extend(r)
                histories[futures[fut]] = h
            else:
                replies.extend(result)
    return replies, histories


def check_replies(rig, phase: str, replies: list[Reply], expected: int) -> None:
    failed = [r for r in replies if r.error or r.completion_tokens != MAX_TOKENS or not r.text or r.worker not in ("1", "2")]
    rig.check(len(replies) == expected, f"{phase}: {len(replies)} requests sent, {expected} planned")
    for r in failed[:10]:
        log(f"  {phase}: {r.session} turn {r.turn} {r.endpoint} stream={r.stream}: worker={r.worker} "
            f"completion_tokens={r.completion_tokens} text={r.text[:40]!r} error={r.error}")
    kinds = {(r.endpoint, r.stream) for r in replies if r not in failed}
    rig.check(not failed, f"{phase}: every request answered with {MAX_TOKENS} tokens and a worker header "
                          f"({len(replies) - len(failed)}/{len(replies)})")
    rig.check(kinds == {("chat", False), ("chat", True), ("completions", False), ("completions", True)},
              f"{phase}: answered chat and completions, streamed and not: {sorted(kinds)}")


def sessions_by_worker(replies: list[Reply]) -> dict[str, set]:
    out: dict[str, set] = {}
    for r in replies:
        if r.endpoint == "chat":
            out.setdefault(r.session, set()).add(r.worker)
    return out


def bound_workers(replies: list[Reply]) -> dict[str, str]:
    """Each session's binding after these replies: the worker of its last chat turn (a session
    the cache gate moved is bound to where it moved, not where it started)."""
    last: dict[str, Reply] = {}
    for r in replies:
        if r.endpoint == "chat" and (r.session not in last or r.turn >= last[r.session].turn):
            last[r.session] = r
    return {s: r.worker for s, r in last.items()}
