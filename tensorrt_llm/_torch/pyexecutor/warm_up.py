"""Start-up on a CUDA device: everything the first requests would otherwise pay for, done before
``LLM(...)`` returns (and so before a server's ``/health`` answers).

1. Requests of the warm-up's own run through the executor. Triton compiles a kernel per tile size
   (which follows the step's longest prompt, or for the MoE the step's tokens per expert) and per
   integer class (1, multiples of 16, the rest), so the prompts take both integer classes in every
   power-of-two class, and both sides of every MoE tile limit (``fused_moe.ops.tile_limits``).
   They run twice: joining one per step beside the earlier ones decoding, then each alone (the
   first request to an idle server). Greedy and sampled rows, top-k, logprobs and penalties. Their
   KV is keyed by a salt no request can send, so no request reuses it.
2. Every CUDA graph bucket captured (``CUDAGraphRunner.capture_all``).

Then the executor's counters start from zero. Every rank of a multi-rank engine does the same, in
the same order, so their collectives meet.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from tensorrt_llm._torch.modules.fused_moe.ops import tile_limits
from tensorrt_llm._torch.pyexecutor.llm_request import FinishReason, LlmRequest
from tensorrt_llm.logger import logger
from tensorrt_llm.sampling_params import MAX_LOGPROBS, SamplingParams

if TYPE_CHECKING:
    from tensorrt_llm._torch.pyexecutor.py_executor import PyExecutor

WARM_UP_SALT = "trtllm-warm-up"  # (no request of a user's has a salt)
FIRST_ID = 1 << 62  # the warm-up's request ids, far from any ``LLM``'s
SHORT_LENGTHS = (1, 2, 3, 5, 9)  # (the integer class 1, and the smallest tiles)
LONGEST = 1024  # the power-of-two classes run up to this (or the room a step has)
MAX_STEPS = 1024

_GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
_SAMPLED = SamplingParams(
    max_tokens=4,
    temperature=0.8,
    top_p=0.9,
    ignore_eos=True,
    logprobs=MAX_LOGPROBS,
    presence_penalty=0.5,
    seed=0,
)
_TOP_K = SamplingParams(max_tokens=4, temperature=0.8, top_k=8, ignore_eos=True, seed=1)


def start_up(executor: PyExecutor, vocab_size: int) -> None:
    """Compile and capture what serving needs (CUDA only; elsewhere nothing)."""
    engine = executor.model_engine
    if engine.device.type != "cuda":
        return
    start = time.perf_counter()
    steps = _run_warm_up_requests(executor, vocab_size)
    warmed = time.perf_counter()
    runner = executor.cuda_graph_runner
    if runner is not None:
        runner.capture_all()
    executor.reset_stats()
    engine.reset_counters()
    logger.info(
        "start-up: %d warm-up steps in %.1f s, CUDA graphs in %.1f s",
        steps,
        warmed - start,
        time.perf_counter() - warmed,
    )


def prompt_lengths(room: int, moe_limits: list[int]) -> list[int]:
    """Prompt lengths up to ``room``: both integer classes (a multiple of 16, and one past it) in
    every power-of-two class and on each side of every MoE tile limit (in tokens)."""
    lengths = set(SHORT_LENGTHS)
    k = 16
    while k <= LONGEST:
        lengths |= {k, k + 1}
        k *= 2
    for limit in moe_limits:
        below = limit // 16 * 16  # the largest multiple of 16 in the class, then the next's
        lengths |= {limit, limit + 1, below, below + 1, below + 16, below + 17}
    return sorted({max(1, min(n, room)) for n in lengths})


def _requests(lengths: list[int], vocab_size: int, first_id: int) -> list[LlmRequest]:
    params = (_GREEDY, _SAMPLED, _TOP_K)
    return [
        LlmRequest(
            request_id=first_id + i,
            prompt_token_ids=[(7 * i + j) % vocab_size for j in range(length)],
            max_new_tokens=4,
            sampling_params=params[i % len(params)],
            cache_salt=WARM_UP_SALT,
        )
        for i, length in enumerate(lengths)
    ]


def _moe_limits(model) -> list[int]:
    """Every MoE layer's tile limits (``tile_limits``), in tokens per step."""
    limits = set()
    for module in model.modules():
        experts = getattr(module, "experts", None)
        if hasattr(module, "top_k") and hasattr(experts, "num_experts"):
            limits.update(tile_limits(experts.num_experts, module.top_k))
    return sorted(limits)


def kv_room(executor: PyExecutor, room: int) -> int:
    """The longest prompt, up to ``room``, whose warm-up request the KV cache can hold to its end
    (a cache sized for a few requests holds no 1,024-token prompt: longer ones never run there)."""

    def fits(length: int) -> bool:
        probe = _requests([length], 1, FIRST_ID)[0]
        try:
            executor.check_request(probe)
        except ValueError:
            return False
        return True

    low, high = 1, room
    if not fits(low):
        raise RuntimeError("the KV cache cannot hold even a one-token request")
    while low < high:  # (``fits`` holds at ``low``)
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(middle) else (low, middle - 1)
    return low


def _run_warm_up_requests(executor: PyExecutor, vocab_size: int) -> int:
    room = kv_room(executor, min(executor.max_seq_len - 8, executor.scheduler.max_num_tokens))
    lengths = prompt_lengths(room, _moe_limits(executor.model_engine.model))
    joined = _requests(lengths, vocab_size, FIRST_ID)
    alone = _requests(lengths, vocab_size, FIRST_ID + len(lengths))
    steps = executor.run_alone(joined, MAX_STEPS)  # one joins each step, beside the decodes
    for request in alone:  # each alone: its prefill is the whole step
        steps += executor.run_alone([request], MAX_STEPS)
    requests = joined + alone
    if executor.has_work or not all(r.is_finished for r in requests):
        raise RuntimeError(f"the start-up warm-up did not finish in {MAX_STEPS} steps")
    failed = [r.stop_reason for r in requests if r.finish_reason is FinishReason.ERROR]
    if failed:
        raise RuntimeError(f"the start-up warm-up failed: {failed[0]}")
    return steps
