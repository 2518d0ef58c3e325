"""Which requests run this step: a token budget, a batch-size cap, chunked prefill, and KV admission.

Policy (upstream's GUARANTEED_NO_EVICT): a new request is admitted only if the KV slots it needs to
run to completion, plus those still owed to running requests, fit in the slots available (free plus
evictable cached). Running requests therefore never stall for KV, and nothing is preempted.
Admission is first-come first-served: a request that does not fit blocks those behind it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from tensorrt_llm._torch.pyexecutor.config import BatchWait
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest, LlmRequestState

if TYPE_CHECKING:
    from tensorrt_llm._torch.pyexecutor.token_feed import TokenFeed


class KvCapacity(Protocol):
    """What admission reads from the KV cache manager."""

    def get_needed_resource_to_completion(self, request: LlmRequest) -> int: ...

    def get_num_free_blocks(self) -> int: ...


class Admitted(Protocol):
    """The admitted requests, one request slot each (``seq_slot_manager.SeqSlotManager``)."""

    num_free: int

    def __contains__(self, request_id: int) -> bool: ...

    def admit(self, request: LlmRequest) -> int: ...


@dataclass
class ScheduledRequests:
    context_requests: list[LlmRequest] = field(default_factory=list)
    generation_requests: list[LlmRequest] = field(default_factory=list)
    # Requests the resource managers could not serve this step; the scheduler retries them.
    paused_requests: list[LlmRequest] = field(default_factory=list)
    # Reported by the KV cache manager in prepare_resources: request id -> prompt tokens whose KV
    # came from the prefix cache (the executor skips them; the scheduler's fields stay as chosen).
    reused_tokens: dict[int, int] = field(default_factory=dict)
    # The overlap scheduler: the launched step not yet read whose tokens this batch's requests
    # that were in it take on the device; and (set when this batch is read) the requests whose
    # KV reservation belongs to a later launched step, which the commit must not shrink.
    feed: TokenFeed | None = None
    keep_capacity: set[int] = field(default_factory=set)

    def pending_tokens(self, request: LlmRequest) -> int:
        """Tokens, at most, that the launched step not yet read adds to ``request``."""
        feed = self.feed
        return feed.max_advance if feed is not None and request.request_id in feed.rows else 0

    @property
    def all_requests(self) -> list[LlmRequest]:
        return self.context_requests + self.generation_requests

    @property
    def batch_size(self) -> int:
        return len(self.context_requests) + len(self.generation_requests)

    @property
    def num_tokens(self) -> int:
        """The tokens an eager step of this batch carries: each prompt's chunk and each
        generation request's ``1 + drafts``."""
        tokens = sum(r.context_chunk_size for r in self.context_requests)
        return tokens + sum(1 + len(r.py_draft_tokens) for r in self.generation_requests)

    def hold_back_at_length(self, max_seq_len: int) -> None:
        """Leave out the requests the launched step (``feed``) may end by length: they wait for
        it to be read (nothing is computed past a length that is known)."""
        wait = []
        for req in self.generation_requests:
            pending = self.pending_tokens(req)
            if pending and (
                len(req.output_token_ids) + pending >= req.max_new_tokens
                or req.get_num_tokens() + pending >= max_seq_len
            ):
                wait.append(req)
        if wait:
            self.pause(wait)

    def pause(self, requests: list[LlmRequest]) -> None:
        """Move ``requests`` out of this step's batch into ``paused_requests``."""
        ids = {id(r) for r in requests}
        self.context_requests = [r for r in self.context_requests if id(r) not in ids]
        self.generation_requests = [r for r in self.generation_requests if id(r) not in ids]
        self.paused_requests.extend(requests)


def check_fits(request: LlmRequest, kv_cache_manager, max_seq_len: int) -> None:
    """Raise ``ValueError`` if ``request`` can never run: an empty prompt, one that leaves no room
    within ``max_seq_len``, or more KV to complete than the cache has."""
    where = f"request {request.request_id}"
    if request.prompt_len == 0:
        raise ValueError(f"{where}: the prompt is empty")
    if request.prompt_len >= max_seq_len:
        raise ValueError(
            f"{where}: a prompt of {request.prompt_len} tokens leaves no room to generate "
            f"within max_seq_len={max_seq_len}"
        )
    need = kv_cache_manager.get_needed_resource_to_completion(request)
    total = kv_cache_manager.get_max_resource_count()
    if need > total:
        raise ValueError(
            f"{where} needs {need} KV slots to complete but the cache has {total}; "
            f"raise kv_cache_config.max_tokens or lower max_tokens"
        )


def owed_to_admitted(kv_cache_manager, active: list[LlmRequest], admitted: Admitted) -> int:
    """KV blocks the admitted requests of ``active`` still need to complete: what admission keeps
    in reserve before it grants a new request its KV."""
    return sum(
        kv_cache_manager.get_needed_resource_to_completion(r)
        for r in active
        if r.request_id in admitted
    )


def admit(request: LlmRequest, admitted: Admitted) -> None:
    """Grant ``request`` its KV and its slot (it leaves the queue now)."""
    admitted.admit(request)
    request.admitted_at = time.monotonic()


class GuaranteedNoEvictScheduler:
    def __init__(
        self,
        max_batch_size: int,
        max_num_tokens: int,
        kv_cache_manager: KvCapacity,
        enable_chunked_prefill: bool = True,
        batch_wait: BatchWait | None = None,
    ) -> None:
        self.max_batch_size = max_batch_size
        self.max_num_tokens = max_num_tokens
        self.kv_cache_manager = kv_cache_manager
        self.enable_chunked_prefill = enable_chunked_prefill
        self.batch_wait = batch_wait or BatchWait()
        self._waited = 0  # steps the prompts waiting now have waited

    def schedule(
        self, active: list[LlmRequest], admitted: Admitted, may_wait: bool = True
    ) -> ScheduledRequests:
        """``active`` in arrival order; ``admitted``: the slots of the requests already granted
        KV (new ones admitted here, while a slot and their KV are free). ``may_wait``: batch
        waiting applies (``BatchWait``)."""
        batch = self._schedule(active, admitted)
        if may_wait and batch.context_requests and batch.generation_requests and self._wait(batch):
            batch.context_requests = []  # (admitted: their KV stays reserved while they wait)
        return batch

    def _wait(self, batch: ScheduledRequests) -> bool:
        """Whether the batch's prompts wait for this step (``BatchWait``)."""
        wait = self.batch_wait
        tokens = batch.num_tokens
        full = wait.max_tokens_ratio > 0 and tokens >= wait.max_tokens_ratio * self.max_num_tokens
        if self._waited >= wait.timeout_iters or full:
            self._waited = 0
            return False
        self._waited += 1
        return True

    def _schedule(self, active: list[LlmRequest], admitted: Admitted) -> ScheduledRequests:
        batch = ScheduledRequests()
        budget = self.max_num_tokens
        for req in active:
            if (
                req.state is LlmRequestState.GENERATION_IN_PROGRESS
                and batch.batch_size < self.max_batch_size
            ):
                cost = 1 + len(req.py_draft_tokens)
                if cost <= budget:
                    batch.generation_requests.append(req)
                    budget -= cost
        owed = owed_to_admitted(self.kv_cache_manager, active, admitted)
        available = self.kv_cache_manager.get_num_free_blocks()
        for req in active:
            if (
                req.state is not LlmRequestState.CONTEXT_INIT
                or batch.batch_size >= self.max_batch_size
            ):
                continue
            if req.request_id not in admitted:
                need = self.kv_cache_manager.get_needed_resource_to_completion(req)
                if owed + need > available or not admitted.num_free:
                    break
                owed += need
                admit(req, admitted)
            remaining = req.prompt_len - req.context_current_position
            if remaining == 0:  # its last chunk is launched, not yet read
                continue
            chunk = min(remaining, budget)
            if chunk <= 0 or (chunk < remaining and not self.enable_chunked_prefill):
                break
            req.context_chunk_size = chunk
            batch.context_requests.append(req)
            budget -= chunk
        return batch
