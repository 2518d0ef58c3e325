"""StepDispatch: how a scheduled batch runs, as its ``StepPlan`` says (``step_plan.py``). A CUDA
graph replay when the plan has a bucket, else the step program run eagerly on the ``StepInputs``
the batch is built into: the same program either way (``step_program.py``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from tensorrt_llm._torch.pyexecutor.launched_step import DeviceTokens, LaunchedStep
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequestState
from tensorrt_llm._torch.pyexecutor.resource_manager import ResourceManager, ResourceManagerType
from tensorrt_llm._torch.pyexecutor.step_inputs import StepInputsBuilder
from tensorrt_llm._torch.pyexecutor.step_plan import StepPlan, plan_step
from tensorrt_llm._torch.pyexecutor.step_program import finish_step, forward_step

if TYPE_CHECKING:
    from tensorrt_llm._torch.pyexecutor.cuda_graph_runner import CUDAGraphRunner
    from tensorrt_llm._torch.pyexecutor.guided_decoder import GuidedDecoder
    from tensorrt_llm._torch.pyexecutor.model_engine import PyTorchModelEngine
    from tensorrt_llm._torch.pyexecutor.scheduler import ScheduledRequests
    from tensorrt_llm._torch.speculative.eagle3 import Eagle3OneModelWorker
    from tensorrt_llm._torch.speculative.interface import DraftGuide


class StepDispatch:
    def __init__(
        self,
        engine: PyTorchModelEngine,
        resource_manager: ResourceManager,
        spec_worker: Eagle3OneModelWorker | None,
        runner: CUDAGraphRunner | None,
        overlap: bool,
        guided: GuidedDecoder | None = None,
    ) -> None:
        """``overlap``: a launched step may be read after the next one launches (the overlap
        scheduler); ``guided``: the requests' grammars, whose masks a step applies."""
        self.engine = engine
        self.spec_worker = spec_worker
        self.runner = runner
        self.overlap = overlap
        self.guided = guided
        self.logits_state = resource_manager.get_resource_manager(ResourceManagerType.LOGITS_STATE)
        self._inputs = StepInputsBuilder(  # an eager step's inputs
            engine.device,
            spec_worker.max_draft_len if spec_worker is not None else 0,
            self.logits_state,
            spec_worker.draft_probs if spec_worker is not None else None,
            guided,
        )

    def plan(self, batch: ScheduledRequests, agreed: StepPlan | None = None) -> StepPlan:
        """``batch``'s plan (``plan_step``; under attention DP with EP, the step's collective)."""
        return plan_step(batch, self.runner, self.engine.exchange, agreed)

    def can_feed(self, plan: StepPlan) -> bool:
        """Whether the plan's batch can launch with the launched step's tokens still on the
        device."""
        batch = plan.batch
        fed = [r for r in batch.generation_requests if batch.pending_tokens(r)]
        if not fed or self.spec_worker is None:
            return True
        return plan.bucket is not None  # Eagle3 moves the positions on the device: graphs

    def _draft_guide(self, requests: list) -> DraftGuide | None:
        """The grammars' masks of the step's drafts (``GuidedDecoder.drafting``), where a row
        has a grammar and the step drafts."""
        if self.spec_worker is None or self.guided is None:
            return None
        return self.guided.drafting(requests, self.engine.device)

    def _masks_wait(self, batch: ScheduledRequests) -> bool:
        """Whether a request of ``batch`` with a grammar takes its tokens from the launched step
        not yet read: its mask rows are filled once the step's first part is queued."""
        guided = self.guided
        return (
            guided is not None
            and guided.active
            and any(batch.pending_tokens(r) and guided.guided(r) for r in batch.generation_requests)
        )

    @torch.inference_mode()
    def launch(self, plan: StepPlan, settle: Callable[[], object] | None = None) -> LaunchedStep:
        """The plan's step, queued on the device. ``settle``: reads the launched steps before
        it (what the grammars' masks need), called between the step's two parts when a request
        with a grammar was fed (``step_program``)."""
        batch = plan.batch
        decoding = [r.state is LlmRequestState.GENERATION_IN_PROGRESS for r in batch.all_requests]
        settle = settle if self._masks_wait(batch) else None
        if plan.bucket is not None:
            logits, tokens = self.runner.run(batch, plan.bucket, settle)
            # generation logits are copied from the bucket's at the read: read before a replay
            keeps_logits = any(
                r.sampling_params.return_generation_logits for r in batch.all_requests
            )
            overlappable = self.overlap and not keeps_logits
            return LaunchedStep(batch, decoding, logits, tokens, overlappable=overlappable)
        input_ids, md = self.engine.build_inputs(batch, plan.moe_capacity)
        inputs = self._inputs.build(batch, input_ids, md.seq_lens, masks=settle is None)
        forwarded = forward_step(
            self.engine,
            inputs,
            md,
            logits_state=self.logits_state,
            **self.engine.forward_extra(batch),
        )
        requests = [batch.all_requests[i] for i in inputs.rows]
        if settle is not None:
            settle()
            inputs.bitmask = self._inputs.masks(requests, inputs.width)
        out = finish_step(
            forwarded,
            inputs,
            md,
            logits_state=self.logits_state,
            spec_worker=self.spec_worker,
            draft_guide=self._draft_guide(requests),
        )
        tokens = DeviceTokens(inputs.rows, out.tokens, out.num_accepted, out.drafts, out.logprobs)
        return LaunchedStep(batch, decoding, out.logits, tokens, overlappable=self.overlap)
