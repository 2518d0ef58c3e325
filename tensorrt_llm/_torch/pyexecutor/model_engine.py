"""PyTorchModelEngine: turns a scheduled batch into one model forward on the paged cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tensorrt_llm._torch.attention_backend.interface import AttentionMetadata, MetadataBuffers
from tensorrt_llm._torch.pyexecutor.kv_cache_manager_v2 import KVCacheManagerV2
from tensorrt_llm._torch.pyexecutor.multimodal import MultimodalEncoder
from tensorrt_llm._torch.pyexecutor.scheduler import ScheduledRequests
from tensorrt_llm._torch.pyexecutor.token_feed import on_device


@dataclass
class ForwardOutput:
    """Logits of the rows the sampler needs, in batch order: the last prompt token of each context
    request that finishes its prompt this step, then every input token of each generation request
    (its last token and its drafts). ``num_logits[i]`` rows belong to the i-th request of the batch."""

    logits: torch.Tensor  # [num_rows, vocab]
    num_logits: list[int]
    hidden_states: torch.Tensor  # [num_tokens, hidden], every input token
    attn_metadata: AttentionMetadata
    captured: list[torch.Tensor]


ENCODER_CACHE_TOKENS = 32768  # image tokens whose embeddings stay cached for reuse


class PyTorchModelEngine:
    def __init__(
        self, model: torch.nn.Module, kv_cache_manager: KVCacheManagerV2, device: torch.device
    ) -> None:
        self.model = model
        self.kv_cache_manager = kv_cache_manager
        self.device = device
        self.num_context_tokens_computed = 0  # prompt tokens that went through a forward (stats)
        self.capture_layers: tuple[int, ...] = ()
        self.buffers = MetadataBuffers(device)  # the step metadata's device tensors, reused
        self._moe = [m for m in model.modules() if hasattr(m, "routed")]
        # where the MoE layers exchange tokens between ranks (EP under attention DP): the
        # ranks' agreement on each step's exchanges (``ExchangeSync``, set by the creation site)
        self.exchange = None
        self.encoder = (  # images, for a model with a vision tower
            MultimodalEncoder(model, device, ENCODER_CACHE_TOKENS)
            if hasattr(model, "vision_tower")
            else None
        )

    @property
    def exchanging(self) -> list:
        """The MoE layers whose tokens travel between ranks, in forward order."""
        return [m for m in self._moe if m.experts.all_to_all]

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
        self, batch: ScheduledRequests
    ) -> tuple[torch.Tensor, AttentionMetadata, list[int]]:
        tokens: list[int] = []
        seq_lens, cached, num_logits = [], [], []
        for req in batch.context_requests:
            start = req.context_current_position
            chunk = req.prompt_token_ids[start : start + req.context_chunk_size]
            tokens += chunk
            seq_lens.append(len(chunk))
            cached.append(start)
            num_logits.append(1 if req.is_last_context_chunk else 0)
        fed: list[int] = []  # requests whose inputs come from the launched step not yet read
        fed_at: list[int] = []  # where their inputs start
        for req in batch.generation_requests:
            pending = batch.pending_tokens(req)
            if pending:
                fed.append(req.request_id)
                fed_at.append(len(tokens))
            step = [req.get_tokens()[-1], *req.py_draft_tokens]
            tokens += step
            seq_lens.append(len(step))
            cached.append(req.get_num_tokens() - 1 + pending)
            num_logits.append(len(step))
        metadata = AttentionMetadata(
            kv_cache_manager=self.kv_cache_manager,
            request_ids=[r.request_id for r in batch.all_requests],
            seq_lens=seq_lens,
            num_cached_tokens_per_seq=cached,
            num_contexts=len(batch.context_requests),
            device=self.device,
            buffers=self.buffers,
        )
        input_ids = self.buffers.put(
            "input_ids", torch.tensor(tokens, dtype=torch.long), torch.long
        )
        if fed:
            ids, _ = batch.feed.take(fed)
            if ids.shape[1] != 1:
                raise RuntimeError("an eager step takes one fed token per request (target-only)")
            input_ids[on_device(fed_at, input_ids.device)] = ids[:, 0]
        return input_ids, metadata, num_logits

    @torch.inference_mode()
    def forward(self, batch: ScheduledRequests) -> ForwardOutput:
        input_ids, metadata, num_logits = self.build_inputs(batch)
        self.num_context_tokens_computed += sum(metadata.seq_lens[: metadata.num_contexts])
        extra = {}
        if self.encoder is not None and batch.context_requests:
            self.encoder.prepare(batch.context_requests)
            extra["multimodal"] = self.encoder.rows(batch.context_requests)
        hidden, captured = self.model(
            input_ids, attn_metadata=metadata, capture_layers=self.capture_layers, **extra
        )
        logits = self.model.compute_logits(hidden[self.logits_rows(metadata, num_logits)])
        return ForwardOutput(logits, num_logits, hidden, metadata, captured)

    def logits_rows(self, metadata: AttentionMetadata, num_logits: list[int]) -> torch.Tensor:
        """The token rows that get logits (the last ``num_logits[i]`` of sequence ``i``), derived
        on the device from the query offsets: only the counts cross from the host."""
        counts = self.buffers.put("num_logits", torch.tensor(num_logits), torch.long)  # [num_seqs]
        ends = metadata.cu_seqlens_q[1:].long()
        total = sum(num_logits)
        seq = torch.repeat_interleave(  # [total]: each row's sequence
            torch.arange(len(num_logits), device=counts.device), counts, output_size=total
        )
        first_of_seq = torch.cumsum(counts, 0) - counts  # row index where each sequence's begin
        index = torch.arange(total, device=counts.device)
        return (ends - counts)[seq] + index - first_of_seq[seq]
