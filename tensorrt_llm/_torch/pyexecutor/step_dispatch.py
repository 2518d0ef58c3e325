"""StepDispatch: how a scheduled batch runs. A CUDA graph replay when the runner has a bucket for
it (and the ranks' MoE exchanges allow the graphs), else ``run_step`` eagerly on the ``StepInputs``
the batch is built into: the same program either way (``step_program.py``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tensorrt_llm._torch.pyexecutor.launched_step import DeviceTokens, LaunchedStep
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequestState
from tensorrt_llm._torch.pyexecutor.resource_manager import ResourceManager, ResourceManagerType
from tensorrt_llm._torch.pyexecutor.step_inputs import StepInputsBuilder
from tensorrt_llm._torch.pyexecutor.step_program import run_step

if TYPE_CHECKING:
    from tensorrt_llm._torch.pyexecutor.cuda_graph_runner import CUDAGraphRunner
    from tensorrt_llm._torch.pyexecutor.model_engine import PyTorchModelEngine
    from tensorrt_llm._torch.pyexecutor.scheduler import ScheduledRequests
    from tensorrt_llm._torch.speculative.eagle3 import Eagle3OneModelWorker


class StepDispatch:
    def __init__(
        self,
        engine: PyTorchModelEngine,
        resource_manager: ResourceManager,
        spec_worker: Eagle3OneModelWorker | None,
        runner: CUDAGraphRunner | None,
        overlap: bool,
    ) -> None:
        """``overlap``: a launched step may be read after the next one launches (the overlap
        scheduler)."""
        self.engine = engine
        self.spec_worker = spec_worker
        self.runner = runner
        self.overlap = overlap
        self.logits_state = resource_manager.get_resource_manager(ResourceManagerType.LOGITS_STATE)
        self._inputs = StepInputsBuilder(  # an eager step's inputs
            engine.device,
            spec_worker.max_draft_len if spec_worker is not None else 0,
            self.logits_state,
            spec_worker.draft_probs if spec_worker is not None else None,
        )

    def bucket(self, batch: ScheduledRequests) -> int | None:
        """The graph bucket that runs ``batch``, or None when it runs eagerly."""
        if self.runner is None:
            return None
        exchange = self.engine.exchange  # as the ranks agreed on their MoE exchanges
        if exchange is not None and not exchange.graphs:
            return None
        return self.runner.bucket_size(batch)

    def can_feed(self, batch: ScheduledRequests) -> bool:
        """Whether ``batch`` can launch with the launched step's tokens still on the device."""
        fed = [r for r in batch.generation_requests if batch.pending_tokens(r)]
        if not fed or self.spec_worker is None:
            return True
        return self.bucket(batch) is not None  # Eagle3 moves the positions on the device: graphs

    @torch.inference_mode()
    def launch(self, batch: ScheduledRequests) -> LaunchedStep:
        """``batch``'s step, queued on the device."""
        decoding = [r.state is LlmRequestState.GENERATION_IN_PROGRESS for r in batch.all_requests]
        bucket = self.bucket(batch)
        if bucket is not None:
            logits, tokens = self.runner.run(batch, bucket)
            # generation logits are copied from the bucket's at the read: read before a replay
            keeps_logits = any(
                r.sampling_params.return_generation_logits for r in batch.all_requests
            )
            overlappable = self.overlap and not keeps_logits
            return LaunchedStep(batch, decoding, logits, tokens, overlappable=overlappable)
        input_ids, md = self.engine.build_inputs(batch)
        inputs = self._inputs.build(batch, input_ids, md.seq_lens)
        out = run_step(
            self.engine,
            inputs,
            md,
            logits_state=self.logits_state,
            spec_worker=self.spec_worker,
            **self.engine.forward_extra(batch),
        )
        tokens = DeviceTokens(inputs.rows, out.tokens, out.num_accepted, out.drafts, out.logprobs)
        return LaunchedStep(batch, decoding, out.logits, tokens, overlappable=self.overlap)
