"""One-model Eagle3: verify the drafts in the target's forward, accept, then draft again.

Per step, after the target forward over [last token + drafts] (or a prompt chunk):

1. **accept** (``acceptance.verify``, for the whole batch on the device). Greedy: accept drafts
   while each equals the target's argmax at the position before it, then the target's argmax after
   the last accepted one (the bonus token); token-identical to target-only greedy decoding.
   Sampled: speculative rejection sampling against the drafter's q; the output follows p exactly.
2. **first draft step** over the same positions as the target step, inside the metadata's draft
   swap: position p gets token p+1 (the accepted tokens and the bonus) and the fused target features
   at p, so the drafter's KV for every accepted position is final; rows past the accepted ones write
   throwaway KV beyond the history (rewound later). The row at the last accepted position yields d1.
3. **chain** ``max_draft_len - 1`` more one-token steps, each on the previous step's drafter hidden.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tensorrt_llm._torch.attention_backend.interface import AttentionMetadata, MetadataBuffers
from tensorrt_llm._torch.models.modeling_speculative import Eagle3DraftModel
from tensorrt_llm._torch.pyexecutor.launched_step import DeviceTokens
from tensorrt_llm._torch.pyexecutor.model_engine import ForwardOutput
from tensorrt_llm._torch.pyexecutor.resource_manager import ResourceManager, ResourceManagerType
from tensorrt_llm._torch.pyexecutor.sampler import SamplingTensors, sample
from tensorrt_llm._torch.pyexecutor.scheduler import ScheduledRequests
from tensorrt_llm._torch.pyexecutor.token_feed import on_device
from tensorrt_llm._torch.speculative.acceptance import choose_drafts, greedy_accept, verify
from tensorrt_llm._torch.speculative.draft_probs import DraftProbStore
from tensorrt_llm._torch.speculative.interface import Eagle3SpecConfig
from tensorrt_llm._torch.speculative.utils import DraftKvModeTracker


@dataclass
class StepRows:
    """The rows of a step that make tokens, in batch order: ``num_prompts`` prompts that finish in
    this step (one token each, nothing to verify), then generation requests (``T = 1 + K``
    positions each, ``num_drafts`` of them drafts). Device tensors, ``n`` rows."""

    drafts: torch.Tensor  # [n, K] target ids
    num_drafts: torch.Tensor  # [n]
    pick_base: torch.Tensor  # [n]: the step token whose drafter row drafts, less the accepted
    # [n, T] the step's logits row at each position (None: the logits are [n * T, V] in order)
    logit_index: torch.Tensor | None = None
    # [n, T] the step token each position's following token goes to (None: n * T in order)
    token_index: torch.Tensor | None = None
    # [num_tokens] what follows each step token where the prompt says (None: every token is a row's)
    following: torch.Tensor | None = None
    num_prompts: int = 0
    st: SamplingTensors | None = None  # None: every row greedy
    slots: torch.Tensor | None = None  # [n] DraftProbStore slots, where sampled
    request_ids: list[int] | None = None  # (eager) each row's, for the chain's metadata


class Eagle3OneModelWorker:
    def __init__(
        self,
        spec_config: Eagle3SpecConfig,
        draft_model: Eagle3DraftModel,
        resource_manager: ResourceManager,
        vocab_size: int,
    ) -> None:
        self.spec_config = spec_config
        self.draft_model = draft_model
        self.resource_manager = resource_manager
        self.vocab_size = vocab_size
        self._draft_kv = DraftKvModeTracker()
        # the draft chain's metadata tensors (apart from the target step's)
        self._chain_buffers = MetadataBuffers(next(draft_model.parameters()).device)

    @property
    def draft_kv_mode(self) -> str | None:
        """Where the drafter's KV was found at the last dispatch (None before the first)."""
        return self._draft_kv.mode

    @property
    def max_draft_len(self) -> int:
        return self.spec_config.max_draft_len

    @property
    def draft_probs(self) -> DraftProbStore:
        """The q behind sampled requests' drafts (the executor's ``SPEC_RESOURCE_MANAGER``)."""
        return self.resource_manager.get_resource_manager(ResourceManagerType.SPEC_RESOURCE_MANAGER)

    def resolve_draft_kv(self):
        """The manager the draft loop attends through, resolved at each dispatch (the mode is
        logged when it changes)."""
        return self._draft_kv.resolve(self.resource_manager)

    def prefetch_draft_table(self, md: AttentionMetadata, draft_manager) -> None:
        """Copy the draft manager's rows into ``md`` once, if the drafter's backend reads them
        (not when its kernels address the draft sub-pages from the target's slot table)."""
        if draft_manager is None:
            return
        with md.swap_kv_cache_manager(draft_manager):
            needed = self.draft_model.attn_backend.reads_block_table(md)
        if needed:
            md.prefetch_block_offsets(draft_manager)

    @torch.inference_mode()
    def launch(self, batch: ScheduledRequests, out: ForwardOutput) -> DeviceTokens:
        """An eager step of any batch (prompt chunks and generation requests): its rows are
        indexed on the host, then ``step`` runs on the device; one sync, for the draft chain's
        positions."""
        requests, num_contexts = batch.all_requests, len(batch.context_requests)
        md, k = out.attn_metadata, self.max_draft_len
        starts = [0]
        for n in out.num_logits:
            starts.append(starts[-1] + n)
        following: list[int] = []
        for i, req in enumerate(requests):
            length = md.cu_seqlens[i + 1] - md.cu_seqlens[i]
            first = req.context_current_position + 1
            prompt = req.prompt_token_ids[first : first + length] if i < num_contexts else []
            following += prompt + [0] * (length - len(prompt))
        prompts = [i for i in range(num_contexts) if out.num_logits[i]]
        rows = prompts + list(range(num_contexts, len(requests)))
        drafts, num_drafts, logit_index, token_index, pick_base = [], [], [], [], []
        for i in rows:
            start, end = md.cu_seqlens[i], md.cu_seqlens[i + 1]
            own = [] if i < num_contexts else list(requests[i].py_draft_tokens)
            drafts.append(own + [0] * (k - len(own)))
            num_drafts.append(len(own))
            logit_index.append([starts[i] + min(j, out.num_logits[i] - 1) for j in range(k + 1)])
            last = end - 1 if i < num_contexts else start
            token_index.append([min(start + j, end - 1) if own else last for j in range(k + 1)])
            pick_base.append(last)
        device = out.logits.device
        reqs = [requests[i] for i in rows]
        sampled = any(not r.sampling_params.greedy for r in reqs)
        step_rows = StepRows(
            drafts=on_device(drafts, device).view(len(rows), k),
            num_drafts=on_device(num_drafts, device),
            pick_base=on_device(pick_base, device),
            logit_index=on_device(logit_index, device).view(len(rows), k + 1),
            token_index=on_device(token_index, device).view(len(rows), k + 1),
            following=on_device(following, device),
            num_prompts=len(prompts),
            st=SamplingTensors.of(reqs, device) if sampled else None,
            slots=on_device(self.draft_probs.slots(reqs), device) if sampled else None,
            request_ids=[r.request_id for r in reqs],
        )
        tokens, accepted, next_drafts = self.step(step_rows, out.logits, out.captured, md)
        return DeviceTokens(rows, tokens, accepted, next_drafts)

    def decode(
        self,
        input_ids: torch.Tensor,
        logits: torch.Tensor,
        captured: list[torch.Tensor],
        md: AttentionMetadata,
        chain_md: AttentionMetadata,
        st: SamplingTensors | None = None,
        slots: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``step`` for a generation-only batch of ``B`` sequences of ``T = 1 + max_draft_len``
        tokens each, on device tensors only (what a CUDA graph captures): ``input_ids [B * T]``
        (last token, drafts), ``logits [B * T, V]``; ``chain_md`` is a one-token-per-sequence
        metadata of the same rows (``place`` moves it). The draft manager's tables must already
        be in ``md`` and ``chain_md`` (``prefetch_draft_table``)."""
        num_seqs, width = md.num_seqs, self.max_draft_len + 1
        rows = StepRows(
            drafts=input_ids.view(num_seqs, width)[:, 1:],
            num_drafts=torch.full((num_seqs,), width - 1, device=input_ids.device),
            pick_base=torch.arange(num_seqs, device=input_ids.device) * width,
            st=st,
            slots=slots,
        )
        return self.step(rows, logits, captured, md, chain_md)

    def step(
        self,
        rows: StepRows,
        logits: torch.Tensor,
        captured: list[torch.Tensor],
        md: AttentionMetadata,
        chain_md: AttentionMetadata | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Accept, then the drafter's step over the target step's positions and the chain. Returns
        the rows' tokens ``[n, T]`` (the new ones are the first ``num_accepted + 1``),
        ``num_accepted [n]`` and the next drafts ``[n, K]``. Without ``chain_md`` (eager) the
        chain's metadata is built on the host from the positions."""
        num_rows, width = rows.drafts.shape[0], self.max_draft_len + 1
        device = logits.device
        if rows.logit_index is None:
            tokens, accepted = self._accept(logits.view(num_rows, width, -1), rows)
        else:
            tokens, accepted = self._accept(logits[rows.logit_index], rows)
        # position j of a row gets the token after it: the accepted ones, then the next one
        cols = torch.arange(width, device=device)
        after = tokens.gather(1, torch.minimum(cols[None, :], accepted[:, None])).flatten()
        if rows.following is None:
            following = after
        else:
            following = rows.following.clone()
            following[rows.token_index.flatten()] = after  # repeated indices get one value
        draft_manager = self.resolve_draft_kv()
        features = self.draft_model.fuse(captured)
        with md.swap_kv_cache_manager(draft_manager):
            hidden, draft_logits = self.draft_model(following, features, md.position_ids, md)
        if num_rows == 0:
            return tokens, accepted, rows.drafts
        picks = rows.pick_base + accepted
        last = md.position_ids[picks]  # the last accepted position
        if chain_md is None and self.max_draft_len > 1:
            chain_md = self._chain_metadata(md, rows.request_ids, last, draft_manager)
        drafts, q = self._chain(hidden[picks], draft_logits[picks], last, chain_md, rows.st)
        if q is not None:
            self.draft_probs.write(rows.slots, q, rows.st.temperature > 0)
        return tokens, accepted, drafts

    def _accept(self, logits: torch.Tensor, rows: StepRows) -> tuple[torch.Tensor, torch.Tensor]:
        """``logits [n, T, V]`` -> the rows' tokens ``[n, T]`` and accepted counts ``[n]``
        (``acceptance.verify``); a prompt's token is ``sample``'s, as without speculation."""
        k = self.max_draft_len
        if rows.st is None:
            argmax = logits.argmax(dim=-1)
            valid = torch.arange(k, device=logits.device)[None, :] < rows.num_drafts[:, None]
            return argmax, greedy_accept(argmax, rows.drafts, valid)
        store, q, has_q = self.draft_probs, None, None
        if store.allocated:
            q, has_q = store.read(rows.slots)
            q = self.draft_model.target_probs(q, self.vocab_size)
        tokens, accepted = verify(logits, rows.drafts, rows.num_drafts, rows.st, q, has_q)
        if rows.num_prompts:
            p = rows.num_prompts
            tokens[:p, 0] = sample(logits[:p, 0], rows.st.select(slice(0, p)))
        return tokens, accepted

    def _chain(
        self,
        hidden: torch.Tensor,
        logits: torch.Tensor,
        last: torch.Tensor,
        chain_md: AttentionMetadata | None,
        st: SamplingTensors | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The drafts ``[n, K]`` from the drafter's row at each last accepted position, and with
        sampled rows their q ``[n, K, Vd]``."""
        draft_manager = self.resolve_draft_kv()
        chosen, probs = [], []
        for k in range(self.max_draft_len):
            tokens, q = choose_drafts(logits, st, k, self.draft_model.to_target_ids)
            chosen.append(tokens)
            probs.append(q)
            if k + 1 == self.max_draft_len:
                break
            # the draft just chosen sits at the next position; its successor is drafted from there
            if chain_md.kv_len_bound is not None:
                chain_md.place(last + 1 + k)
            elif k:
                chain_md.advance()
            with chain_md.swap_kv_cache_manager(draft_manager):
                hidden, logits = self.draft_model(tokens, hidden, chain_md.position_ids, chain_md)
        q = None if probs[0] is None else torch.stack(probs, dim=1)
        return torch.stack(chosen, dim=1), q

    def _chain_metadata(
        self, md: AttentionMetadata, request_ids: list[int], last: torch.Tensor, draft_manager
    ) -> AttentionMetadata:
        """An eager step's chain metadata: one token per row, first at ``last + 1`` (read to the
        host), with the draft manager's table."""
        chain_md = AttentionMetadata(
            kv_cache_manager=md.kv_cache_manager,
            request_ids=request_ids,
            seq_lens=[1] * len(request_ids),
            num_cached_tokens_per_seq=(last + 1).tolist(),
            num_contexts=0,
            device=md.device,
            buffers=self._chain_buffers,
        )
        self.prefetch_draft_table(chain_md, draft_manager)
        return chain_md
