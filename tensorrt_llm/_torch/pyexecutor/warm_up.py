"""Start-up on a CUDA device: everything the first requests would otherwise pay for, done before
``LLM(...)`` returns (and so before a server's ``/health`` answers).

1. Requests of the warm-up's own run through the executor, one per step: prefills of lengths
   in every power-of-two class up to 1025 (Triton compiles a kernel per tile size, which follows
   the step's longest prompt, and per integer class: 1, multiples of 16, the rest), each beside the
   earlier ones decoding; greedy and sampled rows, top-k, logprobs and penalties. Their KV is keyed by a salt no request can send, so no request reuses it.
2. Every CUDA graph bucket captured (``CUDAGraphRunner.capture_all``).

Then the executor's counters start from zero. Every rank of a multi-rank engine does the same, in
the same order, so their collectives meet.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from tensorrt_llm._torch.pyexecutor.llm_request import FinishReason, LlmRequest
from tensorrt_llm.logger import logger
from tensorrt_llm.sampling_params import MAX_LOGPROBS, SamplingParams

if TYPE_CHECKING:
    from tensorrt_llm._torch.pyexecutor.py_executor import PyExecutor

WARM_UP_SALT = "trtllm-warm-up"  # (no request of a user's has a salt)
FIRST_ID = 1 << 62  # the warm-up's request ids, far from any ``LLM``'s
PROMPT_LENGTHS = (1, 2, 3, 5, 9, 16, 17, 33, 64, 65, 129, 257, 513, 1025)
MAX_STEPS = 256

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


def _requests(vocab_size: int, max_seq_len: int, max_num_tokens: int) -> list[LlmRequest]:
    """One request per prompt length class, each alone in the step that prefills it (the
    kernels' tile sizes follow the step's longest prompt), the earlier ones decoding beside it."""
    room = min(max_seq_len - 8, max_num_tokens)
    lengths = sorted({max(1, min(n, room)) for n in PROMPT_LENGTHS})
    params = (_GREEDY, _SAMPLED, _TOP_K)
    return [
        LlmRequest(
            request_id=FIRST_ID + i,
            prompt_token_ids=[(7 * i + j) % vocab_size for j in range(length)],
            max_new_tokens=4,
            sampling_params=params[i % len(params)],
            cache_salt=WARM_UP_SALT,
        )
        for i, length in enumerate(lengths)
    ]


def _run_warm_up_requests(executor: PyExecutor, vocab_size: int) -> int:
    requests = _requests(vocab_size, executor.max_seq_len, executor.scheduler.max_num_tokens)
    steps = executor.run_alone(requests, MAX_STEPS)
    if executor.has_work or not all(r.is_finished for r in requests):
        raise RuntimeError(f"the start-up warm-up did not finish in {MAX_STEPS} steps")
    failed = [r.stop_reason for r in requests if r.finish_reason is FinishReason.ERROR]
    if failed:
        raise RuntimeError(f"the start-up warm-up failed: {failed[0]}")
    return steps
