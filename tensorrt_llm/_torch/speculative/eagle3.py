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

import torch

from tensorrt_llm._torch.attention_backend.interface import AttentionMetadata, MetadataBuffers
from tensorrt_llm._torch.models.modeling_speculative import Eagle3DraftModel
from tensorrt_llm._torch.pyexecutor.model_engine import ForwardOutput
from tensorrt_llm._torch.pyexecutor.resource_manager import ResourceManager
from tensorrt_llm._torch.pyexecutor.sampler import SamplingTensors, sample
from tensorrt_llm._torch.pyexecutor.scheduler import ScheduledRequests
from tensorrt_llm._torch.speculative.acceptance import choose_drafts, greedy_accept, verify
from tensorrt_llm._torch.speculative.interface import Eagle3SpecConfig, StepTokens
from tensorrt_llm._torch.speculative.utils import DraftKvModeTracker


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

    def resolve_draft_kv(self):
        """The manager the draft loop attends through, resolved at each dispatch (the mode is
        logged when it changes)."""
        return self._draft_kv.resolve(self.resource_manager)

    @torch.inference_mode()
    def run(self, batch: ScheduledRequests, out: ForwardOutput) -> StepTokens:
        requests = batch.all_requests
        md = out.attn_metadata
        new_tokens, num_accepted = self._accept(batch, out)

        # First draft step: the target step's positions, each with its next token.
        next_ids: list[int] = []
        picks: list[int] = []  # token row of the last final position, per drafting request
        drafting: list[int] = []  # batch indices of requests that get drafts
        for i, req in enumerate(requests):
            start, end = md.cu_seqlens[i], md.cu_seqlens[i + 1]
            if i < len(batch.context_requests):
                first = req.context_current_position + 1
                following = req.prompt_token_ids[first : first + end - start]
                following += new_tokens[i][: end - start - len(following)]
            else:
                following = new_tokens[i] + [new_tokens[i][-1]] * (end - start - len(new_tokens[i]))
            next_ids += following
            if new_tokens[i]:
                drafting.append(i)
                picks.append(
                    start
                    + (end - start - 1 if i < len(batch.context_requests) else num_accepted[i])
                )
        features = self.draft_model.fuse(out.captured)
        draft_manager = self.resolve_draft_kv()
        ids = torch.tensor(next_ids, dtype=torch.long, device=features.device)
        with md.swap_kv_cache_manager(draft_manager):
            hidden, logits = self.draft_model(ids, features, md.position_ids, md)
        next_drafts: list[list[int]] = [[] for _ in requests]
        if not drafting:
            return StepTokens(new_tokens, next_drafts, num_accepted)

        rows = torch.tensor(picks, device=hidden.device)
        hidden, logits = hidden[rows], logits[rows]
        positions = md.position_ids_cpu[torch.tensor(picks)]
        drafting_reqs = [requests[i] for i in drafting]
        st = SamplingTensors.of(drafting_reqs, hidden.device)
        chain_md: AttentionMetadata | None = None
        chosen, probs = [], []
        for k in range(self.max_draft_len):
            tokens, q = choose_drafts(logits, st, k, self.draft_model.to_target_ids, self._target_q)
            chosen.append(tokens)
            probs.append(q)
            if k + 1 == self.max_draft_len:
                break
            # the draft just chosen sits at the next position; its successor is drafted from there
            if chain_md is None:  # built once per step (one table copy), then advanced in place
                chain_md = AttentionMetadata(
                    kv_cache_manager=md.kv_cache_manager,
                    request_ids=[r.request_id for r in drafting_reqs],
                    seq_lens=[1] * len(drafting),
                    num_cached_tokens_per_seq=(positions + 1).tolist(),
                    num_contexts=0,
                    device=md.device,
                    buffers=self._chain_buffers,
                )
                self.prefetch_draft_table(chain_md, draft_manager)
            else:
                chain_md.advance()
            with chain_md.swap_kv_cache_manager(draft_manager):
                hidden, logits = self.draft_model(tokens, hidden, chain_md.position_ids, chain_md)
        for i, row in zip(drafting, torch.stack(chosen, dim=1).tolist(), strict=True):
            next_drafts[i] = row
        q = None if st.all_greedy else torch.stack(probs, dim=1)  # [rows, K, V]
        for row, req in enumerate(drafting_reqs):  # what the next step's acceptance reads
            req.draft_probs = None if q is None or req.sampling_params.greedy else q[row]
        return StepTokens(new_tokens, next_drafts, num_accepted)

    def _target_q(self, draft_probs: torch.Tensor) -> torch.Tensor:
        return self.draft_model.target_probs(draft_probs, self.vocab_size)

    def prefetch_draft_table(self, md: AttentionMetadata, draft_manager) -> None:
        """Copy the draft manager's rows into ``md`` once, if the drafter's backend reads them
        (not when its kernels address the draft sub-pages from the target's slot table)."""
        if draft_manager is None:
            return
        with md.swap_kv_cache_manager(draft_manager):
            needed = self.draft_model.attn_backend.reads_block_table(md)
        if needed:
            md.prefetch_block_offsets(draft_manager)

    def greedy_step_on_device(
        self,
        input_ids: torch.Tensor,
        logits: torch.Tensor,
        captured: list[torch.Tensor],
        md: AttentionMetadata,
        chain_md: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Greedy accept and the whole draft chain of a generation-only batch of ``B`` sequences of
        ``T = 1 + max_draft_len`` tokens each, on device tensors only (what a CUDA graph captures).

        ``input_ids [B * T]`` (last token, drafts), ``logits [B * T, V]``; ``chain_md`` is a
        one-token-per-sequence metadata of the same rows (``place`` moves it). The draft manager's
        tables must already be in ``md`` and ``chain_md`` (``prefetch_draft_table``). Returns the
        target's argmax ``[B, T]`` (the accepted tokens and the bonus are its first
        ``num_accepted + 1``), ``num_accepted [B]`` and the next drafts ``[B, max_draft_len]``:
        the tokens ``acceptance.verify`` and ``run`` give.
        """
        num_seqs, width = md.num_seqs, self.max_draft_len + 1
        target = logits.argmax(dim=-1).view(num_seqs, width)
        drafts = input_ids.view(num_seqs, width)[:, 1:]
        num_accepted = greedy_accept(target, drafts)
        cols = torch.arange(width, device=target.device)
        # position j of the step gets the token after it: the accepted ones, then the bonus
        following = target.gather(1, torch.minimum(cols[None, :], num_accepted[:, None]))
        draft_manager = self.resolve_draft_kv()
        features = self.draft_model.fuse(captured)
        with md.swap_kv_cache_manager(draft_manager):
            hidden, draft_logits = self.draft_model(
                following.flatten(), features, md.position_ids, md
            )
        rows = torch.arange(num_seqs, device=target.device) * width + num_accepted
        hidden, draft_logits = hidden[rows], draft_logits[rows]
        last = md.position_ids[rows]  # the last accepted position
        next_drafts = []
        for k in range(self.max_draft_len):
            tokens = self.draft_model.to_target_ids(draft_logits.argmax(dim=-1))
            next_drafts.append(tokens)
            if k + 1 == self.max_draft_len:
                break
            chain_md.place(last + 1 + k)
            with chain_md.swap_kv_cache_manager(draft_manager):
                hidden, draft_logits = self.draft_model(
                    tokens, hidden, chain_md.position_ids, chain_md
                )
        return target, num_accepted, torch.stack(next_drafts, dim=1)

    def _accept(
        self, batch: ScheduledRequests, out: ForwardOutput
    ) -> tuple[list[list[int]], list[int | None]]:
        """The step's new tokens per request: a first token for each prompt that finished, the
        accepted drafts and one more for each generation request (``acceptance.verify``), all
        on the device, then one copy of each to the host."""
        requests, num_contexts = batch.all_requests, len(batch.context_requests)
        new_tokens: list[list[int]] = [[] for _ in requests]
        num_accepted: list[int | None] = [None] * len(requests)
        starts = [0]
        for n in out.num_logits:
            starts.append(starts[-1] + n)
        device = out.logits.device
        first = [i for i in range(num_contexts) if out.num_logits[i]]
        if first:
            rows = torch.tensor([starts[i] for i in first], device=device)
            st = SamplingTensors.of([requests[i] for i in first], device)
            for i, token in zip(first, sample(out.logits[rows], st).tolist(), strict=True):
                new_tokens[i] = [token]
        generating = list(range(num_contexts, len(requests)))
        if not generating:
            return new_tokens, num_accepted
        reqs = [requests[i] for i in generating]
        k = self.max_draft_len
        drafts = [list(r.py_draft_tokens) + [0] * (k - len(r.py_draft_tokens)) for r in reqs]
        # each request's 1 + drafts logits rows, padded to 1 + K with its last one
        index = [
            [starts[i] + min(j, out.num_logits[i] - 1) for j in range(k + 1)] for i in generating
        ]
        logits = out.logits[torch.tensor(index, device=device)]  # [G, K + 1, V]
        has_q = [r.draft_probs is not None for r in reqs]
        q = None
        if any(has_q):
            q = torch.stack(
                [
                    r.draft_probs
                    if r.draft_probs is not None
                    else logits.new_zeros(k, self.vocab_size)
                    for r in reqs
                ]
            )
        tokens, accepted = verify(
            logits,
            torch.tensor(drafts, device=device),
            torch.tensor([len(r.py_draft_tokens) for r in reqs], device=device),
            SamplingTensors.of(reqs, device),
            q,
            torch.tensor(has_q, device=device),
        )
        for i, row, a in zip(generating, tokens.tolist(), accepted.tolist(), strict=True):
            new_tokens[i], num_accepted[i] = row[: a + 1], a
        return new_tokens, num_accepted
