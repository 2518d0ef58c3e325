"""Which CUDA graph bucket a batch runs in (``GraphShapes.shape``), and every bucket captured at
start-up (``GraphShapes.keys``).

A bucket is keyed by its ``GraphShape`` (decoding rows padded to a captured batch size; in a mixed
bucket 1, 2, 4, ... up to ``max_prompts`` prompt rows of ``mixed_prompt_tokens`` tokens each), how
it samples (greedy; top-p and temperature; with a top-k, whose draws sort) and whether it has the
extras (penalties and bias, logprobs). A mixed bucket has no extras: a prompt asking for them runs
eagerly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
from tensorrt_llm._torch.pyexecutor.mixed_bucket import GraphShape, prompt_tokens_used
from tensorrt_llm._torch.pyexecutor.sampler import uses_top_k
from tensorrt_llm._torch.pyexecutor.step_inputs import logprobs_top

if TYPE_CHECKING:
    from tensorrt_llm._torch.pyexecutor.config import CudaGraphOptions
    from tensorrt_llm._torch.pyexecutor.scheduler import ScheduledRequests

GREEDY, NUCLEUS, TOP_K = 0, 1, 2  # how a bucket samples
BucketKey = tuple[GraphShape, int, bool]  # shape, how it samples, extras


class GraphShapes:
    def __init__(self, options: CudaGraphOptions, max_draft_len: int) -> None:
        self.options = options
        self.max_draft_len = max_draft_len
        # the prompt rows of the mixed buckets: powers of two below ``max_prompts``, and it
        # (none when ``mixed_prompt_tokens`` is 0)
        most = options.max_prompts
        powers = {1 << i for i in range(most.bit_length()) if 1 << i < most}
        self.prompt_slots = tuple(sorted(powers | {most})) if options.mixed_prompt_tokens else ()

    def prompt_budget(self, slots: int) -> int:
        """The prompt tokens of a mixed bucket of ``slots`` prompt rows."""
        return slots * self.options.mixed_prompt_tokens

    @property
    def padding_positions(self) -> int:
        """The positions the padding sequence holds: a padded row's step and draft chain, or what
        the largest mixed bucket's prompts leave of its tokens."""
        slots = self.prompt_slots[-1] if self.prompt_slots else 0
        return max(2 * (1 + self.max_draft_len), self.prompt_budget(slots))

    def keys(self) -> list[BucketKey]:
        """Every bucket captured at start-up."""
        modes = (GREEDY, NUCLEUS, TOP_K)
        sizes = self.options.batch_sizes
        keys = [(GraphShape(b), m, e) for b in sizes for m in modes for e in (False, True)]
        keys += [
            (GraphShape(b, self.prompt_budget(p), p), m, False)
            for p in self.prompt_slots
            for b in (0, *sizes)
            for m in modes
        ]
        return keys

    def shape(self, batch: ScheduledRequests) -> GraphShape | None:
        """The shape of the bucket that runs ``batch``, or None when no bucket can: decoding
        requests with all their drafts, and up to ``max_prompts`` prompts whose last chunks fit a
        mixed bucket's tokens."""
        requests, prompts = batch.generation_requests, batch.context_requests
        if any(len(r.py_draft_tokens) != self.max_draft_len for r in requests):
            return None
        if prompts and any(r.sampling_params.guided_decoding for r in (*prompts, *requests)):
            return None  # (a grammar's mask rows: decode-only buckets carry them)
        padding = self.options.enable_padding
        sizes, slots = self.options.batch_sizes, 0
        if prompts:
            slots = next((p for p in self.prompt_slots if p >= len(prompts)), 0)
            if not slots or (not padding and slots != len(prompts)):
                return None
            if not all(map(_fits, prompts)):
                return None
            if prompt_tokens_used(prompts, slots) > self.prompt_budget(slots):
                return None
            sizes = (0, *sizes)  # (prompts alone)
        elif not requests:
            return None
        n = len(requests)
        size = next((b for b in sizes if b >= n), None) if padding else (n if n in sizes else None)
        return None if size is None else GraphShape(size, self.prompt_budget(slots), slots)

    @staticmethod
    def key(batch: ScheduledRequests, shape: GraphShape) -> BucketKey:
        """The key of the bucket of ``shape`` that runs ``batch``."""
        requests = batch.all_requests
        mode = GREEDY
        if not all(r.sampling_params.greedy for r in requests):
            mode = TOP_K if uses_top_k(requests) else NUCLEUS
        extras = logprobs_top(requests) is not None or any(
            r.sampling_params.processes_logits or r.sampling_params.guided_decoding
            for r in requests
        )
        return shape, mode, extras


def _fits(prompt: LlmRequest) -> bool:
    """Whether ``prompt``'s step can run in a mixed bucket: its last chunk, without images (their
    rows are the encoder's, sized on the host)."""
    return prompt.is_last_context_chunk and prompt.multimodal is None
