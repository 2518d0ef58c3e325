"""One-model Eagle3: verify the drafts in the target's forward, accept, then draft again.

Per step, after the target forward over [last token + drafts] (or a prompt chunk):

1. **accept** (``acceptance.verify``, for the whole batch on the device). Greedy: accept drafts
   while each equals the target's argmax at the position before it, then the target's argmax after
   the last accepted one (the bonus token); token-identical to target-only greedy decoding.
   Sampled: speculative rejection sampling against the drafter's q; the output follows p exactly.
2. **first draft step** over the same positions as the target step, inside the metadata's draft
   swap: position p gets token p+1 (the accepted tokens and the bonus) and the fused target features
   at p, so the drafter's KV for every accepted position is final; rows past the accepted ones write
   throwaway KV beyond the history (rewound later). Past the attention only the row at the last
   accepted position goes on (its MLP or MoE and the LM head): it yields d1.
3. **chain** ``max_draft_len - 1`` more one-token steps, each on the previous step's drafter hidden.
"""

from __future__ import annotations

import torch

from tensorrt_llm._torch.attention_backend.interface import AttentionMetadata, MetadataBuffers
from tensorrt_llm._torch.models.modeling_speculative import Eagle3DraftModel
from tensorrt_llm._torch.pyexecutor.resource_manager import ResourceManager, ResourceManagerType
from tensorrt_llm._torch.pyexecutor.sampler import SamplingTensors, sample
from tensorrt_llm._torch.pyexecutor.step_inputs import StepInputs
from tensorrt_llm._torch.pyexecutor.token_bitmask import token_allowed
from tensorrt_llm._torch.speculative.acceptance import choose_drafts, greedy_accept, verify
from tensorrt_llm._torch.speculative.draft_probs import DraftProbStore
from tensorrt_llm._torch.speculative.interface import DraftGuide, Eagle3SpecConfig
from tensorrt_llm._torch.speculative.utils import DraftKvModeTracker


class Eagle3OneModelWorker:
    """The one-model drafter's step, for an Eagle3 drafter or the target's MTP module
    (``speculative/mtp.py``: the same step, another drafter behind the same interface)."""

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

    def step(
        self,
        inputs: StepInputs,
        logits: torch.Tensor,
        captured: list[torch.Tensor],
        md: AttentionMetadata,
        chain_md: AttentionMetadata | None = None,
        guide: DraftGuide | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Accept, then the drafter's step over the target step's positions and the chain, for
        the step's rows (``logits [n * T, V]``, ``step_inputs``). Returns the rows' tokens ``[n,
        T]`` (the new ones are the first ``num_accepted + 1``), ``num_accepted [n]`` and the next
        drafts ``[n, K]``. ``chain_md`` is a one-token-per-row metadata of the same rows that
        ``place`` moves (a graph bucket's, the draft manager's table already in it,
        ``prefetch_draft_table``); without it (eager) the chain's metadata is built on the host
        from the positions. ``guide``: the grammars' masks of the drafts (``DraftGuide``; the
        host reads each draft before the next: eager only)."""
        num_rows, width = inputs.num_rows, self.max_draft_len + 1
        device = logits.device
        tokens, accepted = self._accept(logits.view(num_rows, width, -1), inputs)
        # position j of a row gets the token after it: the accepted ones, then the next one
        cols = torch.arange(width, device=device)
        after = tokens.gather(1, torch.minimum(cols[None, :], accepted[:, None])).flatten()
        if inputs.following is None:
            following = after
        else:
            following = inputs.following.clone()
            following[inputs.token_index.flatten()] = after  # repeated indices get one value
        draft_manager = self.resolve_draft_kv()
        features = self.draft_model.fuse(captured, inputs.input_ids)
        picks = inputs.first_tokens + accepted  # each row's last accepted position's token
        with md.swap_kv_cache_manager(draft_manager):  # (past the attention: the picks only)
            hidden, draft_logits = self.draft_model(following, features, md.position_ids, md, picks)
        if num_rows == 0:  # (under attention DP the others' chains exchange: take part)
            for _ in range(self.max_draft_len - 1):
                self.draft_model.idle(md.moe_capacity)
            return tokens, accepted, inputs.drafts
        last = md.position_ids[picks]  # the last accepted position
        if chain_md is None and self.max_draft_len > 1:
            chain_md = self._chain_metadata(md, inputs.request_ids, last, draft_manager)
        if guide is not None:
            guide.begin(tokens, accepted)
        try:
            drafts, q = self._chain(hidden, draft_logits, last, chain_md, inputs.st, guide)
        finally:
            if guide is not None:
                guide.end()
        if q is not None:
            self.draft_probs.write(inputs.q_slots, q, inputs.st.temperature > 0)
        return tokens, accepted, drafts

    def _accept(self, logits: torch.Tensor, rows: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """``logits [n, T, V]`` -> the rows' tokens ``[n, T]`` and accepted counts ``[n]``
        (``acceptance.verify``); a prompt's token is ``sample``'s, as without speculation."""
        k, store = self.max_draft_len, self.draft_probs
        valid = torch.arange(k, device=logits.device)[None, :] < rows.num_drafts[:, None]
        phases = store.phases
        if rows.st is None and phases is None:
            argmax = logits.argmax(dim=-1)
            return argmax, greedy_accept(argmax, rows.drafts, valid)
        if phases is not None:  # greedy rows: relaxed in the thinking phase
            greedy_tokens, greedy_accepted = phases.accept(logits, rows.drafts, valid, rows.q_slots)
        if rows.st is None:
            tokens, accepted = greedy_tokens, greedy_accepted
        else:
            q, has_q = None, None
            if store.allocated:
                q, has_q = store.read(rows.q_slots)
                q = self.draft_model.target_probs(q, self.vocab_size)
            tokens, accepted = verify(logits, rows.drafts, rows.num_drafts, rows.st, q, has_q)
            if phases is not None:
                greedy = rows.st.temperature <= 0
                tokens = torch.where(greedy[:, None], greedy_tokens, tokens)
                accepted = torch.where(greedy, greedy_accepted, accepted)
            if rows.num_prompts:
                p = rows.num_prompts
                tokens[:p, 0] = sample(logits[:p, 0], rows.st.select(slice(0, p)))
        if phases is not None:
            phases.advance(rows.q_slots, tokens, accepted)
        return tokens, accepted

    def _chain(
        self,
        hidden: torch.Tensor,
        logits: torch.Tensor,
        last: torch.Tensor,
        chain_md: AttentionMetadata | None,
        st: SamplingTensors | None,
        guide: DraftGuide | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The drafts ``[n, K]`` from the drafter's row at each last accepted position, and with
        sampled rows their q ``[n, K, Vd]`` (masked by ``guide`` where given: q is what the
        drafts were drawn from)."""
        draft_manager = self.resolve_draft_kv()
        chosen, probs = [], []
        for k in range(self.max_draft_len):
            if guide is not None:
                bitmask = guide.mask(chosen[-1] if chosen else None)
                if bitmask is not None:
                    logits = self._masked(logits, bitmask)
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

    def _masked(self, logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
        """``logits [n, Vd]`` with ``-inf`` where ``bitmask [n, W]`` refuses the target token;
        a row that would refuse every draft token is left alone."""
        allowed = token_allowed(bitmask, self.vocab_size)
        width = logits.shape[-1]
        if width != self.vocab_size:  # a drafter's own vocabulary
            ids = self.draft_model.to_target_ids(torch.arange(width, device=logits.device))
            allowed = allowed[:, ids]
        allowed |= ~allowed.any(dim=-1, keepdim=True)
        return logits.masked_fill(~allowed, float("-inf"))

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
            moe_capacity=md.moe_capacity,
        )
        self.prefetch_draft_table(chain_md, draft_manager)
        return chain_md
