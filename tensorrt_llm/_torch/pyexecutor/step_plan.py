"""StepPlan: how one scheduled batch runs, decided once, before anything is launched.

``plan_step`` is the only caller of the CUDA graph runner's bucket choice. Under attention DP with
EP it also runs the step's one collective (``ExchangeSync.agree``): every rank learns whether the
MoE layers exchange through their fixed buffers (then graphs may replay) or buffers sized by the
counts (every rank runs eagerly). A decoding batch with more prompts than a mixed bucket takes
runs the first that fit (``choose_bucket``). The plan then travels with the batch: to the feed
check, the launch, the step's metadata (``moe_capacity``) and, on a rank with nothing to run, the
idle exchange. Nothing about the step is decided again later, and nothing is written into the model.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tensorrt_llm._torch.distributed.moe_all_to_all import ExchangeSync
    from tensorrt_llm._torch.pyexecutor.cuda_graph_runner import CUDAGraphRunner
    from tensorrt_llm._torch.pyexecutor.mixed_bucket import GraphShape
    from tensorrt_llm._torch.pyexecutor.scheduler import ScheduledRequests


@dataclass(frozen=True)
class StepPlan:
    """``batch``: the final batch (its ``feed``: the launched step whose tokens it takes on the
    device); ``bucket``: the graph bucket that replays it, None when it runs eagerly;
    ``moe_capacity``: the rows of the MoE layers' fixed exchange buffers in this step, None when
    they are sized by the counts or nothing is exchanged."""

    batch: ScheduledRequests
    bucket: GraphShape | None = None
    moe_capacity: int | None = None

    @property
    def idle(self) -> bool:
        """Nothing runs on this rank (it may still take part in the others' exchanges)."""
        return not self.batch.batch_size


def step_tokens(batch: ScheduledRequests, bucket: GraphShape | None, tokens_per_seq: int) -> int:
    """The tokens the step's forward carries: a graph bucket's padded ones, else the batch's."""
    return bucket.num_tokens(tokens_per_seq) if bucket is not None else batch.num_tokens


def plan_step(
    batch: ScheduledRequests,
    runner: CUDAGraphRunner | None,
    exchange: ExchangeSync | None,
    agreed: StepPlan | None = None,
) -> StepPlan:
    """The plan of ``batch``. With ``exchange`` the ranks agree in one collective, which every
    rank runs once per step, with or without a batch. ``agreed``: this step's plan before
    requests were paused from the batch: its agreement still holds (the step carries no more
    tokens than agreed), so no collective runs again and only the bucket is chosen anew."""
    bucket = choose_bucket(batch, runner)
    if exchange is None:
        return StepPlan(batch, bucket)
    if agreed is not None:
        capacity = agreed.moe_capacity
    else:
        tokens_per_seq = runner.tokens_per_seq if runner is not None else 1
        capacity = exchange.agree(step_tokens(batch, bucket, tokens_per_seq))
    # graphs are captured with the fixed buffers: they replay only when every rank uses them
    return StepPlan(batch, bucket if capacity is not None else None, capacity)


def choose_bucket(batch: ScheduledRequests, runner: CUDAGraphRunner | None) -> GraphShape | None:
    """The graph bucket of ``batch``. A batch that decodes and would run eagerly only because it
    has more prompts than a mixed bucket takes keeps the first prompts that fit one; the others
    wait a step (paused: admitted, their KV kept). An eager step would hold every decoding row
    for its launches, while graph steps advance them once per prompt group. The first prompt
    always runs, so every prompt gets its turn."""
    if runner is None or not batch.batch_size:
        return None
    bucket = runner.shape_of(batch)
    if bucket is not None:
        return bucket
    prompts = batch.context_requests
    if not batch.generation_requests or len(prompts) < 2:
        return None
    for keep in range(len(prompts) - 1, 0, -1):
        bucket = runner.shape_of(replace(batch, context_requests=prompts[:keep]))
        if bucket is not None:
            batch.pause(prompts[keep:])
            return bucket
    return None
