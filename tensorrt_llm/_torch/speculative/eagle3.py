"""One-model Eagle3: verify the drafts in the target's forward, accept, then draft again.

Per step, after the target forward over [last token + drafts] (or a prompt chunk):

1. **accept** (per request). Greedy: accept drafts while each equals the target's argmax at the
   position before it, then add the target's argmax after the last accepted one (the bonus token);
   the result is token-identical to target-only greedy decoding. Sampled (temperature > 0):
   speculative rejection sampling, accepting draft d with probability min(1, p(d) / q(d)) and, at
   the first rejection, sampling from normalize(max(p - q, 0)); the output follows p exactly.
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
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
from tensorrt_llm._torch.pyexecutor.model_engine import ForwardOutput
from tensorrt_llm._torch.pyexecutor.resource_manager import ResourceManager
from tensorrt_llm._torch.pyexecutor.sampler import TorchSampler, filtered_probs
from tensorrt_llm._torch.pyexecutor.scheduler import ScheduledRequests
from tensorrt_llm._torch.speculative.interface import Eagle3SpecConfig, StepTokens
from tensorrt_llm._torch.speculative.utils import DraftKvModeTracker


def greedy_accept(drafts: list[int], target_argmax: list[int]) -> list[int]:
    """``target_argmax[j]`` is the target's choice after the input's j-th token (len = drafts + 1).
    Returns the accepted drafts followed by the target's next token."""
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == target_argmax[accepted]:
        accepted += 1
    return drafts[:accepted] + [target_argmax[accepted]]


def rejection_accept(
    drafts: list[int],
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
) -> list[int]:
    """Speculative sampling. ``draft_probs [K, V]`` (q, what each draft was drawn from),
    ``target_probs [K + 1, V]`` (p). Returns the accepted drafts and one token drawn from p (or from
    the residual at the first rejection)."""
    for j, d in enumerate(drafts):
        p, q = target_probs[j, d], draft_probs[j, d]
        if q > 0 and torch.rand((), generator=generator) < torch.clamp(p / q, max=1.0):
            continue
        residual = torch.clamp(target_probs[j] - draft_probs[j], min=0.0)
        residual = residual / residual.sum() if residual.sum() > 0 else target_probs[j]
        return drafts[:j] + [int(torch.multinomial(residual, 1, generator=generator))]
    return drafts + [int(torch.multinomial(target_probs[len(drafts)], 1, generator=generator))]


def sample_match_accept(
    drafts: list[int], target_probs: torch.Tensor, generator: torch.Generator | None
) -> list[int]:
    """Acceptance without the drafter's distribution (drafts made elsewhere, e.g. by a context
    server): draw from p at each position and keep the draft while the draw equals it. The output
    follows p exactly; acceptance is lower than rejection sampling's."""
    for j, d in enumerate(drafts):
        token = int(torch.multinomial(target_probs[j], 1, generator=generator))
        if token != d:
            return drafts[:j] + [token]
    return drafts + [int(torch.multinomial(target_probs[len(drafts)], 1, generator=generator))]


class Eagle3OneModelWorker:
    def __init__(
        self,
        spec_config: Eagle3SpecConfig,
        draft_model: Eagle3DraftModel,
        resource_manager: ResourceManager,
        sampler: TorchSampler,
        vocab_size: int,
    ) -> None:
        self.spec_config = spec_config
        self.draft_model = draft_model
        self.resource_manager = resource_manager
        self.sampler = sampler
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
        for req in drafting_reqs:
            req.py_draft_probs = []
        chain_md: AttentionMetadata | None = None
        for k in range(self.max_draft_len):
            tokens = self._choose_drafts(logits, drafting_reqs)
            for i, token in zip(drafting, tokens, strict=True):
                next_drafts[i].append(token)
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
            ids = torch.tensor(tokens, dtype=torch.long, device=hidden.device)
            with chain_md.swap_kv_cache_manager(draft_manager):
                hidden, logits = self.draft_model(ids, hidden, chain_md.position_ids, chain_md)
        return StepTokens(new_tokens, next_drafts, num_accepted)

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
        the tokens ``greedy_accept`` and ``run`` give.
        """
        num_seqs, width = md.num_seqs, self.max_draft_len + 1
        target = logits.argmax(dim=-1).view(num_seqs, width)
        drafts = input_ids.view(num_seqs, width)[:, 1:]
        num_accepted = (drafts == target[:, :-1]).int().cumprod(dim=1).sum(dim=1)
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
        new_tokens: list[list[int]] = []
        num_accepted: list[int | None] = []
        row = 0
        for i, req in enumerate(batch.all_requests):
            n = out.num_logits[i]
            logits = out.logits[row : row + n]  # [n, vocab]
            row += n
            if n == 0:
                new_tokens.append([])
                num_accepted.append(None)
            elif i < len(batch.context_requests):
                new_tokens.append(
                    self.sampler.sample(logits, [req.sampling_params], [req.generator]).tolist()
                )
                num_accepted.append(None)
            else:
                drafts = list(req.py_draft_tokens)
                if req.sampling_params.greedy:
                    tokens = greedy_accept(drafts, logits.argmax(dim=-1).tolist())
                else:
                    target = filtered_probs(logits, req.sampling_params).cpu()
                    if len(req.py_draft_probs) == len(drafts):
                        tokens = rejection_accept(
                            drafts, torch.stack(req.py_draft_probs), target, req.generator
                        )
                    else:  # drafts made on a context server: their q stayed there
                        tokens = sample_match_accept(drafts, target, req.generator)
                new_tokens.append(tokens)
                num_accepted.append(len(tokens) - 1)
        return new_tokens, num_accepted

    def _choose_drafts(self, draft_logits: torch.Tensor, requests: list[LlmRequest]) -> list[int]:
        """One draft token (a target id) per request: greedy, or drawn from the request's filtered
        draft distribution (kept for rejection sampling)."""
        greedy = self.draft_model.to_target_ids(draft_logits.argmax(dim=-1)).tolist()
        tokens = []
        for row, req in enumerate(requests):
            if req.sampling_params.greedy:
                tokens.append(greedy[row])
                continue
            q = filtered_probs(draft_logits[row], req.sampling_params)
            q = self.draft_model.target_probs(q, self.vocab_size).cpu()
            tokens.append(int(torch.multinomial(q, 1, generator=req.generator)))
            req.py_draft_probs.append(q)
        return tokens
