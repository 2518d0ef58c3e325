"""A serving benchmark against any OpenAI-compatible server: a fixed-seed workload sent at a fixed
concurrency or at a Poisson request rate, every request streamed, and per request the time to first
token (TTFT), the gaps between tokens (ITL), the time per output token after the first (TPOT) and,
where the server reports it (``avg_decoded_tokens_per_iter``), the acceptance length.

Output tokens are counted from the usage the server sends last (``stream_options.include_usage``);
a server that sends none is counted one token per chunk of text (reasoning, content or a tool call). A chunk that carries several
tokens (speculative decoding emits several per step) spreads its gap over them.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import multiprocessing
import queue
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from tensorrt_llm.evaluate.tasks import gsm8k_tiny

_WORDS = [
    "the",
    "a",
    "of",
    "to",
    "and",
    "in",
    "is",
    "was",
    "for",
    "on",
    "that",
    "with",
    "as",
    "by",
    "at",
    "from",
    "it",
    "be",
    "this",
    "are",
    "or",
    "an",
]
DATASETS = ("gsm8k", "random")


@dataclass(frozen=True)
class Workload:
    """``num_requests`` requests made from ``seed``: ``gsm8k`` questions (trtllm-eval's
    generator; the bundled drafter's domain) or ``random`` words of ``input_len`` +- 25%."""

    dataset: str = "gsm8k"
    num_requests: int = 64
    input_len: int = 128
    output_len: int = 64
    seed: int = 0

    def requests(self) -> list[dict]:
        if self.dataset not in DATASETS:
            raise ValueError(f"dataset {self.dataset!r}: choose one of {DATASETS}")
        rng = random.Random(self.seed)
        out = []
        for _ in range(self.num_requests):
            if self.dataset == "gsm8k":
                content = gsm8k_tiny(rng)[0][0]["content"]
            else:
                n = max(1, round(self.input_len * rng.uniform(0.75, 1.25)))
                content = " ".join(rng.choice(_WORDS) for _ in range(n))
            out.append({"messages": [{"role": "user", "content": content}]})
        return out


@dataclass
class RequestResult:
    ok: bool
    error: str = ""
    ttft: float = 0.0
    latency: float = 0.0
    output_tokens: int = 0
    itls: list[float] = field(default_factory=list)
    al: float | None = None

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def _chunk_tokens(event: dict) -> tuple[str, dict | None]:
    """The text and the choice of one streamed chunk (chat or completions; a chat chunk's text
    is its reasoning, content and tool-call deltas together)."""
    choices = event.get("choices") or []
    if not choices:
        return "", None
    choice = choices[0]
    delta = choice.get("delta")
    if delta is None:
        return choice.get("text") or "", choice
    # what the model wrote in this chunk, however the server's parsers filed it
    calls = "".join(
        (call.get("function") or {}).get(key) or ""
        for call in delta.get("tool_calls") or []
        for key in ("name", "arguments")
    )
    return (delta.get("reasoning_content") or "") + (delta.get("content") or "") + calls, choice


async def one_request(
    client: httpx.AsyncClient, url: str, body: dict, headers: dict | None = None
) -> RequestResult:
    start = time.perf_counter()
    result, chunk_times, last, usage = RequestResult(ok=False), [], start, None
    try:
        async with client.stream("POST", url, json=body, headers=headers) as reply:
            if reply.status_code != 200:
                await reply.aread()
                return RequestResult(False, f"HTTP {reply.status_code}: {reply.text[:200]}")
            async for line in reply.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line.removeprefix("data: "))
                if "error" in event:
                    return RequestResult(False, json.dumps(event["error"])[:200])
                usage = event.get("usage") or usage
                text, choice = _chunk_tokens(event)
                now = time.perf_counter()
                if text:
                    chunk_times.append((now - last, now))
                    last = now
                if choice and choice.get("avg_decoded_tokens_per_iter") is not None:
                    result.al = float(choice["avg_decoded_tokens_per_iter"])
    except httpx.HTTPError as exc:
        return RequestResult(False, repr(exc)[:200])
    if not chunk_times:
        return RequestResult(False, "no output tokens")
    result.ok = True
    result.ttft = chunk_times[0][1] - start
    result.latency = time.perf_counter() - start
    result.output_tokens = (usage or {}).get("completion_tokens") or len(chunk_times)
    # the tokens after the first, spread evenly over the chunks after the first: k per chunk
    k = max(1, round((result.output_tokens - 1) / max(1, len(chunk_times) - 1)))
    for gap, _ in chunk_times[1:]:  # a chunk of k tokens: k gaps of gap / k
        result.itls += [gap / k] * k
    return result


async def run_level(
    url: str,
    bodies: list[dict],
    concurrency: int | None = None,
    request_rate: float | None = None,
    seed: int = 0,
    on_done: Callable[[], None] | None = None,
    headers: dict | None = None,
    take: Callable[[], int | None] | None = None,
) -> tuple[list[RequestResult], float]:
    """All ``bodies`` at ``concurrency`` in flight (each slot sends the next one as its request
    ends), or arriving at ``request_rate`` per second (exponential gaps from ``seed``), from
    this process's event loop. ``take`` hands out the index of the next body to send (one shared
    by several client processes); None once all are taken. Returns the results and the wall
    time."""
    limits = httpx.Limits(max_connections=(concurrency or len(bodies)) + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:

        async def send(body: dict) -> RequestResult:
            result = await one_request(client, url, body, headers)
            if on_done is not None:
                on_done()
            return result

        start = time.perf_counter()
        if request_rate:
            rng = random.Random(seed)

            async def later(body: dict, delay: float) -> RequestResult:
                await asyncio.sleep(delay)
                return await send(body)

            delays = list(itertools.accumulate(rng.expovariate(request_rate) for _ in bodies))
            starts = [0.0, *delays[:-1]]
            results = await asyncio.gather(*(later(b, d) for b, d in zip(bodies, starts)))
            return list(results), time.perf_counter() - start
        if take is None:
            indices = iter(range(len(bodies)))
            take = lambda: next(indices, None)  # noqa: E731
        results: list[RequestResult] = []

        async def slot() -> None:
            while (index := take()) is not None:
                results.append(await send(bodies[index]))

        await asyncio.gather(*(slot() for _ in range(concurrency or len(bodies))))
    return results, time.perf_counter() - start


class _SharedQueue:
    """The next body's index, handed out across client processes (a counter in shared memory):
    every slot of every process sends the next request as its own ends, as one client with that
    many slots would; a split fixed in advance leaves a process's slots idle while the others
    still run."""

    def __init__(self, context, total: int) -> None:
        self.counter, self.total = context.Value("l", 0), total

    def __call__(self) -> int | None:
        with self.counter.get_lock():
            index = self.counter.value
            if index >= self.total:
                return None
            self.counter.value = index + 1
        return index


def _client(url, bodies, concurrency, request_rate, seed, headers, take, start, done) -> None:
    """One client process of ``run_spread``: waits for the others, runs its share and sends its
    results back on ``done``; every finished request is reported as it ends."""
    start.wait()
    begin = time.monotonic()
    results, _ = asyncio.run(
        run_level(
            url, bodies, concurrency, request_rate, seed, lambda: done.put(None), headers, take
        )
    )
    done.put((begin, time.monotonic(), results))


def run_spread(
    url: str,
    bodies: list[dict],
    concurrency: int | None = None,
    request_rate: float | None = None,
    seed: int = 0,
    on_done: Callable[[], None] | None = None,
    headers: dict | None = None,
    processes: int = 1,
) -> tuple[list[RequestResult], float]:
    """``run_level`` from ``processes`` client processes, so that the client's own parsing does
    not limit what a fast server is measured at. Each holds an equal share of the concurrency and
    takes the next request from one shared queue (or sends every ``processes``-th request at an
    equal share of the rate: Poisson arrivals add up); they start together, and the wall time
    runs from the first start to the last end."""
    processes = max(1, min(processes, len(bodies), concurrency or len(bodies)))
    if processes == 1:
        return asyncio.run(
            run_level(url, bodies, concurrency, request_rate, seed, on_done, headers)
        )
    context = multiprocessing.get_context("spawn")
    start, done = context.Barrier(processes), context.Queue()
    take = None if request_rate else _SharedQueue(context, len(bodies))
    workers = []
    for i in range(processes):
        share = (
            None
            if concurrency is None
            else concurrency // processes + (i < concurrency % processes)
        )
        rate = None if request_rate is None else request_rate / processes
        mine = bodies if take is not None else bodies[i::processes]
        args = (url, mine, share, rate, seed + i, headers, take, start, done)
        workers.append(context.Process(target=_client, args=args, daemon=True))
    for worker in workers:
        worker.start()
    spans, results = [], []
    try:
        while len(spans) < processes:
            try:
                message = done.get(timeout=1.0)
            except queue.Empty:
                dead = [w.exitcode for w in workers if w.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"a client process exited with code {dead[0]}") from None
                continue
            if message is None:
                if on_done is not None:
                    on_done()
                continue
            begin, end, part = message
            spans.append((begin, end))
            results += part
    finally:
        for worker in workers:
            worker.join(timeout=10)
            if worker.is_alive():
                worker.terminate()
    return results, max(e for _, e in spans) - min(b for b, _ in spans)


def _percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {"p50": at(0.5), "p90": at(0.9), "p99": at(0.99), "mean": statistics.fmean(values)}


def summarize(results: list[RequestResult], wall_s: float) -> dict:
    good = [r for r in results if r.ok]
    tokens = sum(r.output_tokens for r in good)
    als = [r.al for r in good if r.al is not None]
    return {
        "requests": len(results),
        "failed": len(results) - len(good),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "wall_s": wall_s,
        "request_throughput": len(good) / wall_s if wall_s else 0.0,
        "output_tokens_per_s": tokens / wall_s if wall_s else 0.0,
        "mean_output_tokens": tokens / len(good) if good else 0.0,
        "ttft_s": _percentiles([r.ttft for r in good]),
        "tpot_s": _percentiles([r.tpot for r in good if r.tpot is not None]),
        "itl_s": _percentiles([x for r in good for x in r.itls]),
        "mean_al": statistics.fmean(als) if als else None,
    }
