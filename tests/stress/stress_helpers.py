"""The fault and load suite's client side: the request mix, early disconnects, and the checks that
every server ends with no KV slot in use.

Size: ``TRTLLM_STRESS=large`` runs the full mix (500 requests at concurrency 64, ``max_tokens`` up
to 200); the default is the CI size.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

LARGE = os.environ.get("TRTLLM_STRESS", "").lower() == "large"
SLOTS = 16  # every server's KV pool: 16 slots of 128 tokens, so long requests force eviction
POOL = {"kv_cache_config": {"tokens_per_block": 128, "max_tokens": SLOTS * 128}}


@dataclass(frozen=True)
class Mix:
    requests: int
    concurrency: int
    max_tokens: int  # each request asks for 1 .. this many
    disconnect_fraction: float = 0.0  # clients that go away early (streamed or not)
    seed: int = 0


CI_MIX = Mix(requests=64, concurrency=16, max_tokens=48)
LARGE_MIX = Mix(requests=500, concurrency=64, max_tokens=200)
MIX = LARGE_MIX if LARGE else CI_MIX

# prompts share a few long prefixes (the prefix cache reuses them, then evicts them under load)
_PREFIXES = [
    "You are a careful tutor. Work through the arithmetic step by step and then state the answer. ",
    "Answer in one short sentence, with the number first. Keep the units of the question. ",
    "Read the question twice. Then count, add or subtract as it asks, and say the result. ",
]
_NAMES = ["Ann", "Ben", "Cal", "Dee", "Eve", "Fay", "Gus", "Hal"]
_THINGS = ["cups", "pens", "books", "apples", "coins", "shells"]


def prompt(rng: random.Random) -> str:
    name, thing = rng.choice(_NAMES), rng.choice(_THINGS)
    a, b = rng.randint(10, 99), rng.randint(1, 9)
    return f"{rng.choice(_PREFIXES)}{name} has {a} {thing}. {name} gets {b} more {thing}. How many?"


@dataclass
class Outcome:
    kind: str  # "ok", "disconnected" (on purpose) or "failed"
    status: int = 0
    detail: str = ""


@dataclass
class Report:
    outcomes: list[Outcome] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def counts(self) -> Counter:
        return Counter(o.kind for o in self.outcomes)

    def failures(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.kind == "failed"]


def _body(rng: random.Random, mix: Mix, index: int) -> dict:
    sampled = rng.random() < 0.5
    return {
        "messages": [{"role": "user", "content": prompt(rng)}],
        "max_tokens": rng.randint(1, mix.max_tokens),
        "temperature": 0.8 if sampled else 0.0,
        "seed": index,
        "stream": rng.random() < 0.5,
    }


async def _streamed(client: httpx.AsyncClient, url: str, body: dict, leave: bool) -> Outcome:
    async with client.stream("POST", url, json=body) as reply:
        if reply.status_code != 200:
            await reply.aread()
            return Outcome("failed", reply.status_code, reply.text[:300])
        seen = []
        async for line in reply.aiter_lines():
            seen = [*seen[-2:], line]
            if leave:
                return Outcome("disconnected", 200)  # leaving the block closes the connection
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                return Outcome("ok", 200)
            event = json.loads(data)
            if "error" in event:
                return Outcome("failed", 200, json.dumps(event["error"])[:300])
        return Outcome("failed", 200, f"the stream ended without [DONE] after {seen}")


async def _whole(client: httpx.AsyncClient, url: str, body: dict, max_tokens: int) -> Outcome:
    reply = await client.post(url, json=body)
    if reply.status_code != 200:
        return Outcome("failed", reply.status_code, reply.text[:300])
    payload = reply.json()
    choice, usage = payload["choices"][0], payload["usage"]
    if choice["finish_reason"] not in ("stop", "length") or usage["completion_tokens"] > max_tokens:
        return Outcome("failed", 200, json.dumps(payload)[:300])
    return Outcome("ok", 200)


async def one(client: httpx.AsyncClient, base: str, body: dict, leave: bool) -> Outcome:
    url = base + "/v1/chat/completions"
    try:
        if body["stream"]:
            return await _streamed(client, url, body, leave)
        if leave:  # a client that gives up before the reply
            try:
                await asyncio.wait_for(_whole(client, url, body, body["max_tokens"]), 0.2)
            except TimeoutError:
                return Outcome("disconnected")
            return Outcome("ok", 200)
        return await _whole(client, url, body, body["max_tokens"])
    except httpx.HTTPError as exc:
        return Outcome("failed", 0, repr(exc))


async def _run(base: str, mix: Mix) -> Report:
    rng = random.Random(mix.seed)
    plan = [
        (_body(rng, mix, i), rng.random() < mix.disconnect_fraction) for i in range(mix.requests)
    ]
    gate = asyncio.Semaphore(mix.concurrency)
    limits = httpx.Limits(max_connections=mix.concurrency + 8)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:

        async def gated(body, leave):
            async with gate:
                return await one(client, base, body, leave)

        start = time.monotonic()
        outcomes = await asyncio.gather(*(gated(b, leave) for b, leave in plan))
    return Report(list(outcomes), time.monotonic() - start)


def run_mix(base: str, mix: Mix = MIX) -> Report:
    return asyncio.run(_run(base, mix))


def kv_state(base: str) -> dict:
    reply = httpx.get(base + "/kv_cache", timeout=30)
    assert reply.status_code == 200, f"{base}/kv_cache: {reply.status_code} {reply.text[:500]}"
    return reply.json()


def _in_use(state: dict) -> int:
    managers = [v for v in state.values() if isinstance(v, dict)]
    return (
        sum(m["used"] + m["live_requests"] for m in managers)
        + state["held_for_transfer"]
        + state["active_requests"]
    )


def assert_no_slot_in_use(*bases: str, within_s: float = 20.0) -> None:
    """Every server's KV managers end with no used slot, no live sequence and no held transfer
    (each ``/kv_cache`` also runs ``check_integrity``): nothing leaked."""
    deadline = time.monotonic() + within_s
    for base in bases:
        state = kv_state(base)
        while _in_use(state) and time.monotonic() < deadline:
            time.sleep(0.25)
            state = kv_state(base)
        assert not _in_use(state), f"{base} still holds KV after the load: {state}"
