"""A server's Prometheus metrics, through ``prometheus_client``.

Per request (observed by the HTTP handler, on the event loop): time to first token, inter-token
latency (a step that emits n tokens counts n intervals of its duration / n), end-to-end latency,
queue time (arrival to admission, when the scheduler grants the request its KV), of which the
handoff (arrival to the engine core receiving the request), and acceptance length. Counters of
requests, errors and prompt tokens. The executor's own counts (generated, reused, computed and
transferred tokens, KV slots, held transfers, the draft KV mode, the MoE layers' tokens per expert
and per rank) are read when ``/metrics`` is scraped.
"""

from __future__ import annotations

import bisect
import threading
import time
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

if TYPE_CHECKING:
    from tensorrt_llm.llmapi import LLM

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
LATENCY_BUCKETS += (30.0, 60.0, 120.0, 300.0)
AL_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0)
LOAD_BUCKETS = (0.25, 0.5, 0.75, 0.9, 1.1, 1.25, 1.5, 2.0, 4.0)  # an expert's tokens / the mean


class Histogram:
    """A Prometheus histogram that takes ``count`` equal observations at once (a step's tokens
    share its interval: one call, not one per token), with a bucket found by bisection. Observed
    on the event loop, scraped from a worker thread: one lock keeps a scrape's counts and sum
    together."""

    def __init__(
        self, name: str, doc: str, buckets: tuple[float, ...], registry: CollectorRegistry
    ) -> None:
        self.name, self.doc, self.bounds = name, doc, tuple(buckets)
        self.counts = [0] * (len(self.bounds) + 1)  # the last: above every bound (+Inf)
        self.sum = 0.0
        self.lock = threading.Lock()
        registry.register(self)

    def observe(self, value: float, count: int = 1) -> None:
        with self.lock:
            self.counts[bisect.bisect_left(self.bounds, value)] += count
            self.sum += value * count

    def collect(self):
        with self.lock:
            counts, total = list(self.counts), self.sum
        family = HistogramMetricFamily(self.name, self.doc)
        cumulative, buckets = 0, []
        for bound, count in zip((*map(str, self.bounds), "+Inf"), counts, strict=True):
            cumulative += count
            buckets.append((bound, cumulative))
        family.add_metric([], buckets, total)
        yield family


def _seconds(what: str, doc: str, registry: CollectorRegistry) -> Histogram:
    return Histogram(f"trtllm_{what}_seconds", doc, LATENCY_BUCKETS, registry)


class ServerMetrics:
    def __init__(self, llm: LLM) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("trtllm_requests", "Requests accepted", registry=r)
        self.errors = Counter("trtllm_request_errors", "Requests that failed", registry=r)
        self.prompt_tokens = Counter("trtllm_prompt_tokens", "Prompt tokens", registry=r)
        self.ttft = _seconds("time_to_first_token", "Arrival to the first output token", r)
        self.itl = _seconds("inter_token_latency", "Time per output token after the first", r)
        self.e2e = _seconds("e2e_request_latency", "Arrival to the last output token", r)
        self.queue = _seconds("request_queue_time", "Arrival to admission (KV granted)", r)
        self.handoff = _seconds(
            "request_handoff_time",
            "Arrival to the engine core receiving the request (the front and the trip to the core;"
            " the rest of the queue time is the core's)",
            r,
        )
        self.al = Histogram(
            "trtllm_request_acceptance_length",
            "Tokens emitted per generation step, per finished request",
            AL_BUCKETS,
            r,
        )
        r.register(_ExecutorCollector(llm))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def timer(self) -> RequestTimer:
        return RequestTimer(self)


class RequestTimer:
    """One request's latencies, fed each update of its output as the handler receives it."""

    def __init__(self, metrics: ServerMetrics, arrival: float | None = None) -> None:
        self.metrics = metrics
        self.arrival = time.monotonic() if arrival is None else arrival
        self.tokens = 0
        self.last = self.arrival
        self.queued = False

    def fork(self) -> RequestTimer:
        """A timer of another choice of the same request (the same arrival)."""
        return RequestTimer(self.metrics, self.arrival)

    def update(
        self,
        num_tokens: int,
        admitted_at: float | None,
        finished: bool,
        al: float | None,
        received_at: float | None = None,
    ) -> None:
        now, m = time.monotonic(), self.metrics
        if not self.queued and admitted_at is not None:
            m.queue.observe(max(0.0, admitted_at - self.arrival))
            if received_at is not None:  # (the same clock in both processes: one host)
                m.handoff.observe(max(0.0, received_at - self.arrival))
            self.queued = True
        new = num_tokens - self.tokens
        if new > 0:
            if self.tokens == 0:  # (tokens that came with the first have no interval to measure)
                m.ttft.observe(now - self.arrival)
            else:
                m.itl.observe((now - self.last) / new, new)
            self.tokens, self.last = num_tokens, now
        if finished:
            m.e2e.observe(now - self.arrival)
            if al is not None and num_tokens:
                m.al.observe(al)


class _ExecutorCollector:
    """The executor's counts, read at scrape time."""

    def __init__(self, llm: LLM) -> None:
        self.llm = llm

    def collect(self):
        stats = self.llm.get_stats()  # between steps
        counters = {
            "trtllm_generation_tokens": ("Output tokens", stats["num_generated_tokens"]),
            "trtllm_prefix_reuse_hits": (
                "KV blocks reused from the prefix cache",
                stats["kv_reused_blocks"],
            ),
            "trtllm_prefix_reused_tokens": ("Prompt tokens reused", stats["num_reused_tokens"]),
            "trtllm_context_tokens_computed": (
                "Prompt tokens prefilled here",
                stats["num_context_tokens_computed"],
            ),
            "trtllm_transferred_tokens": ("Prompt tokens pulled", stats["num_transferred_tokens"]),
            "trtllm_images_encoded": ("Images through the vision tower", stats["images_encoded"]),
            "trtllm_image_cache_hits": (
                "Images whose embeddings the encoder cache held",
                stats["image_cache_hits"],
            ),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(name, doc, value=value)
        yield GaugeMetricFamily(
            "trtllm_acceptance_length",
            "Tokens emitted per generation step, over the server's life",
            value=stats["avg_decoded_tokens_per_iter"] or 1.0,
        )
        slots = GaugeMetricFamily("trtllm_kv_cache_slots", "KV slots by state", labels=["state"])
        for state in ("free", "used", "cached"):
            slots.add_metric([state], stats[f"kv_{state}_slots"])
        yield slots
        yield GaugeMetricFamily(
            "trtllm_held_for_transfer",
            "Context-only requests whose KV waits for a pull",
            value=stats["held_for_transfer"],
        )
        mode = stats["draft_kv_mode"]
        mode = "target only" if not stats["speculative"] else mode or "unresolved"
        modes = GaugeMetricFamily("trtllm_draft_kv_mode", "The drafter's KV cache", labels=["mode"])
        modes.add_metric([mode], 1)
        yield modes
        if stats["expert_tokens"]:
            yield from moe_load(stats["expert_tokens"], stats["moe_ep_size"])


def moe_load(expert_tokens: list[int], ep_size: int):
    """The MoE layers' balance: the (token, choice) slots each expert took, a histogram per rank
    of its experts' load against the mean expert's, and the busiest rank against the mean rank
    (the ranks: the expert groups of ``moe_expert_parallel_size``)."""
    per_rank = len(expert_tokens) // ep_size
    tokens = CounterMetricFamily(
        "trtllm_moe_expert_tokens", "Tokens routed to each expert", labels=["rank", "expert"]
    )
    load = HistogramMetricFamily(
        "trtllm_moe_expert_load", "Each expert's tokens / the mean expert's", labels=["rank"]
    )
    mean = sum(expert_tokens) / len(expert_tokens) or 1.0
    ranks = []
    for rank in range(ep_size):
        held = expert_tokens[rank * per_rank : (rank + 1) * per_rank]
        for i, count in enumerate(held):
            tokens.add_metric([str(rank), str(rank * per_rank + i)], count)
        shares = [count / mean for count in held]
        buckets = [(str(le), sum(s <= le for s in shares)) for le in LOAD_BUCKETS]
        load.add_metric([str(rank)], [*buckets, ("+Inf", len(shares))], sum(shares))
        ranks.append(sum(held))
    yield tokens
    yield load
    busiest = max(ranks) / (sum(ranks) / len(ranks)) if sum(ranks) else 1.0
    yield GaugeMetricFamily(
        "trtllm_moe_rank_imbalance",
        "Tokens of the busiest rank's experts / the mean rank's",
        busiest,
    )
