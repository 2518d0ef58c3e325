"""PyTorchModelEngine: turns a scheduled batch into one model forward on the paged cache."""

from __future__ import annotations

import torch

from tensorrt_llm._torch.attention_backend.interface import AttentionMetadata, MetadataBuffers
from tensorrt_llm._torch.pyexecutor.kv_cache_manager_v2 import KVCacheManagerV2
from tensorrt_llm._torch.pyexecutor.multimodal import MultimodalEncoder
from tensorrt_llm._torch.pyexecutor.scheduler import ScheduledRequests
from tensorrt_llm._torch.pyexecutor.token_feed import on_device

ENCODER_CACHE_TOKENS = 32768  # image tokens whose embeddings stay cached for reuse


def exchanging_moe(model: torch.nn.Module) -> list:
    """The MoE layers whose tokens travel between ranks (EP under attention DP), in forward
    order."""
    return [m for m in model.modules() if hasattr(m, "routed") and m.experts.all_to_all]


class PyTorchModelEngine:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache_manager: KVCacheManagerV2,
        device: torch.device,
        capture_layers: tuple[int, ...] = (),
        exchange=None,
    ) -> None:
        """``capture_layers``: the target layers whose hidden states the drafter reads;
        ``exchange``: the ranks' agreement on each step's MoE exchanges (``ExchangeSync``) where
        the MoE layers exchange tokens between ranks."""
        self.model = model
        self.kv_cache_manager = kv_cache_manager
        self.device = device
        self.num_context_tokens_computed = 0  # prompt tokens that went through a forward (stats)
        self.capture_layers = capture_layers
        self.buffers = MetadataBuffers(device)  # the step metadata's device tensors, reused
        self._moe = [m for m in model.modules() if hasattr(m, "routed")]
        self.exchange = exchange
        self.encoder = (  # images, for a model with a vision tower
            MultimodalEncoder(model, device, ENCODER_CACHE_TOKENS)
            if hasattr(model, "vision_tower")
            else None
        )

    def expert_tokens(self) -> torch.Tensor | None:
        """``[num_experts]``: the (token, choice) slots this rank's tokens routed to each expert,
        summed over the MoE layers (None without any)."""
        if not self._moe:
            return None
        return torch.stack([m.routed for m in self._moe]).sum(0)

    def reset_counters(self) -> None:
        """The statistics start again from zero (after the start-up warm-up)."""
        self.num_context_tokens_computed = 0
        for module in self._moe:
            module.routed.zero_()

    def build_inputs(
        self, batch: ScheduledRequests, moe_capacity: int | None = None
    ) -> tuple[torch.Tensor, AttentionMetadata]:
        """An eager step's token ids on the device and its metadata: each prompt's chunk, then
        each generation request's last token and drafts. ``moe_capacity``: the step's agreed
        MoE exchange (``StepPlan``)."""
        tokens: list[int] = []
        seq_lens, cached = [], []
        for req in batch.context_requests:
            start = req.context_current_position
            chunk = req.context_chunk
            tokens += chunk
            seq_lens.append(len(chunk))
            cached.append(start)
        fed: list[int] = []  # requests whose inputs come from the launched step not yet read
        fed_at: list[int] = []  # where their inputs start
        for req in batch.generation_requests:
            pending = batch.pending_tokens(req)
            if pending:
                fed.append(req.request_id)
                fed_at.append(len(tokens))
            step = [req.last_token, *req.py_draft_tokens]
            tokens += step
            seq_lens.append(len(step))
            cached.append(req.get_num_tokens() - 1 + pending)
        metadata = AttentionMetadata(
            kv_cache_manager=self.kv_cache_manager,
            request_ids=[r.request_id for r in batch.all_requests],
            seq_lens=seq_lens,
            num_cached_tokens_per_seq=cached,
            num_contexts=len(batch.context_requests),
            device=self.device,
            buffers=self.buffers,
            moe_capacity=moe_capacity,
        )
        input_ids = self.buffers.put(
            "input_ids", torch.tensor(tokens, dtype=torch.long), torch.long
        )
        if fed:
            ids, _ = batch.feed.take(fed)
            if ids.shape[1] != 1:
                raise RuntimeError("an eager step takes one fed token per request (target-only)")
            input_ids[on_device(fed_at, input_ids.device)] = ids[:, 0]
        self.num_context_tokens_computed += sum(seq_lens[: metadata.num_contexts])
        return input_ids, metadata

    def forward_extra(self, batch: ScheduledRequests) -> dict:
        """What the model's forward takes beside the tokens for this batch: its images' rows."""
        if self.encoder is None or not batch.context_requests:
            return {}
        self.encoder.prepare(batch.context_requests)
        return {"multimodal": self.encoder.rows(batch.context_requests)}
