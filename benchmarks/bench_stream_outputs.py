"""What one step's output of one streamed request costs the output side as the output grows:
``OutputTracker.output()`` read the way a stream reads it (the text and ``num_tokens``) against
the same output with its ``token_ids`` and ``logprobs`` read as lists (what every step's output
copied before they were taken as snapshots of the request's growing lists), in one run.

    python benchmarks/bench_stream_outputs.py [--lengths 64,4096,32768] [--steps 256]

No model: a request whose output already holds ``length`` tokens (and logprobs) gets 4 more per
step (an Eagle3 step's accepted tokens), detokenized by a byte-level decoder. Printed per length:
µs per step each way and their ratio. Run on the CPU that runs the server's front.
"""

from __future__ import annotations

import argparse
import time

from bench_common import machine_name

from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
from tensorrt_llm.llmapi.outputs import OutputTracker
from tensorrt_llm.sampling_params import SamplingParams

TOKENS_PER_STEP = 4


def decode(tokens: list[int]) -> str:
    return bytes(t % 128 for t in tokens).decode("ascii")


def per_step_us(length: int, steps: int, read_lists: bool) -> float:
    params = SamplingParams(max_tokens=length + TOKENS_PER_STEP * steps + 1, logprobs=0)
    request = LlmRequest(1, [1, 2], params.max_tokens, params)
    request.output_token_ids.extend(range(32, 32 + length))
    request.py_logprobs.extend([(-0.5, [])] * length)
    tracker = OutputTracker(request, None, decode)
    tracker.consume()
    begin = time.perf_counter()
    for _ in range(steps):
        request.output_token_ids.extend([65] * TOKENS_PER_STEP)
        request.py_logprobs.extend([(-0.5, [])] * TOKENS_PER_STEP)
        tracker.consume()
        out = tracker.output(finished=False).outputs[0]
        _ = (out.text, out.num_tokens)
        if read_lists:
            _ = (out.token_ids, out.logprobs)
    return (time.perf_counter() - begin) / steps * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="64,4096,32768")
    p.add_argument("--steps", type=int, default=256)
    args = p.parse_args()
    print(f"machine: {machine_name('cpu')}")
    print(
        "\n| output tokens | snapshot, as a stream reads it µs/step | lists read µs/step | ratio |"
        "\n| --- | --- | --- | --- |"
    )
    for length in (int(n) for n in args.lengths.split(",")):
        lazy = min(per_step_us(length, args.steps, False) for _ in range(5))
        lists = min(per_step_us(length, args.steps, True) for _ in range(5))
        print(f"| {length} | {lazy:.1f} | {lists:.1f} | {lists / lazy:.1f} |")


if __name__ == "__main__":
    main()
