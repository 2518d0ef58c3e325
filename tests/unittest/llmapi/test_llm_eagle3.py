"""One-model Eagle3 end to end: lossless in unified and separate mode, AL accounting, and the draft
KV that prefix reuse keeps (unified) or loses (separate)."""

import pytest
import torch

from tensorrt_llm import LLM, SamplingParams
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
from tensorrt_llm._torch.speculative.eagle3 import Eagle3OneModelWorker
from tensorrt_llm.llmapi.llm_args import Eagle3DecodingConfig, KvCacheConfig

SHORT = ["hi", "what is 7+8? "]
LONG = ["the quick brown fox jumps over the lazy dog 0123456789 " * 6]  # 330 tokens > top_k x 128
PREFIX = (
    "copy this: abcdefghijklmnopqrstuvwxyz " * 4
)  # 152 tokens: one full 128-token block to reuse
GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)


def make(ckpts, mode=None, max_draft_len=3, device="cpu", **kwargs):
    target, draft = ckpts
    spec = (
        None
        if mode is None
        else Eagle3DecodingConfig(
            max_draft_len=max_draft_len, speculative_model=str(draft), draft_kv_cache=mode
        )
    )
    return LLM(
        target,
        device=device,
        max_batch_size=8,
        kv_cache_config=KvCacheConfig(max_tokens=16384),
        speculative_config=spec,
        **kwargs,
    )


def tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("mode", ["unified", "separate"])
def test_greedy_speculation_is_token_identical_to_target_only(spec_checkpoints, mode):
    warm_up = [PREFIX + "first"]
    batch = SHORT + LONG + [PREFIX + "second turn", PREFIX + "third"]
    base = make(spec_checkpoints)
    base.generate(warm_up, GREEDY)
    expected = tokens(base.generate(batch, GREEDY))
    llm = make(spec_checkpoints, mode)
    llm.generate(warm_up, GREEDY)
    got = llm.generate(batch, GREEDY)
    assert tokens(got) == expected
    assert llm.get_stats()["num_reused_tokens"] == 2 * 128  # the two PREFIX prompts hit the cache
    assert all(o.outputs[0].avg_decoded_tokens_per_iter >= 1.0 for o in got)
    report = llm.kv_cache_report()  # every manager's, integrity checked
    assert [report[kind]["used"] for kind in report if kind.endswith("MANAGER")] in ([0], [0, 0])


class OracleDrafts(Eagle3OneModelWorker):
    """Runs the real draft forward, then proposes the target's own continuation with every third
    draft corrupted, so acceptance, bonus tokens and rewinds all happen."""

    reference: dict[int, list[int]] = {}
    executor = None  # whose active requests the rows are

    @torch.inference_mode()
    def step(self, inputs, logits, captured, md, chain_md=None, guide=None):
        tokens, accepted, drafts = super().step(inputs, logits, captured, md, chain_md, guide)
        active = {r.request_id: r for r in self.executor.active}
        for r, (request_id, n) in enumerate(zip(inputs.request_ids, accepted.tolist())):
            ref = self.reference[request_id]
            done = len(active[request_id].output_token_ids) + n + 1
            proposal = ref[done : done + self.max_draft_len]
            corrupted = [t if (done + k) % 3 else (t + 1) % 40 for k, t in enumerate(proposal)]
            if corrupted:
                drafts[r, : len(corrupted)] = torch.tensor(corrupted)
        return tokens, accepted, drafts


@pytest.mark.parametrize("mode", ["unified", "separate"])
def test_accepted_drafts_keep_the_output_identical_and_raise_al(spec_checkpoints, mode):
    prompts = SHORT + LONG
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    expected = tokens(make(spec_checkpoints).generate(prompts, params))
    llm = make(spec_checkpoints, mode)
    worker = llm.executor.spec_worker
    worker.__class__ = OracleDrafts
    OracleDrafts.executor = llm.executor
    OracleDrafts.reference = {i: ref for i, ref in enumerate(expected)}  # request ids count from 0
    got = llm.generate(prompts, params)
    assert tokens(got) == expected
    als = [o.outputs[0].avg_decoded_tokens_per_iter for o in got]
    assert all(al > 1.5 for al in als), als
    assert llm.get_stats()["avg_decoded_tokens_per_iter"] > 1.5


def test_sampled_speculation_is_reproducible_per_seed(spec_checkpoints):
    params = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.95, seed=3, ignore_eos=True)
    a = tokens(make(spec_checkpoints, "unified").generate(SHORT, params))
    b = tokens(make(spec_checkpoints, "unified").generate(SHORT, params))
    assert a == b and all(len(t) == 12 for t in a)


def first_step_draft_kv(llm, prompt_ids):
    """Run only the prefill step of ``prompt_ids`` and return (the request's draft K/V per position
    [num_positions, 2, heads, dim], the number of reused tokens)."""
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    request = LlmRequest(1000 + len(prompt_ids), list(prompt_ids), 4, params, llm.eos_token_ids)
    llm.executor.enqueue_request(request)
    llm.executor.step()
    resources = llm.executor.resource_manager.kv_cache_managers
    draft_layer = llm.model_config.num_hidden_layers
    holder = next(m for m in resources.values() if draft_layer in m.pp_layers)
    slots = holder.get_batch_cache_indices([request.request_id])[0]
    kv = holder.get_buffers(draft_layer)[torch.tensor(slots)]  # [blocks, 2, tpb, heads, dim]
    per_position = kv.permute(0, 2, 1, 3, 4).reshape(-1, *kv.shape[1:2], *kv.shape[3:])
    reused = request.num_reused_tokens
    while llm.executor.has_work:
        llm.executor.step()
    return per_position[: len(prompt_ids)].clone(), reused


@pytest.mark.parametrize(("mode", "kept"), [("unified", True), ("separate", False)])
def test_reused_blocks_carry_the_drafters_kv_only_in_unified_mode(spec_checkpoints, mode, kept):
    llm = make(spec_checkpoints, mode)
    turn1 = llm.tokenizer.encode(PREFIX + "hello there")
    out1 = llm.generate(turn1, SamplingParams(max_tokens=8, ignore_eos=True))
    turn2 = turn1 + out1.outputs[0].token_ids + llm.tokenizer.encode(" and again")
    warm, reused = first_step_draft_kv(llm, turn2)
    cold, cold_reused = first_step_draft_kv(make(spec_checkpoints, mode), turn2)
    assert reused == 128 and cold_reused == 0
    same = torch.allclose(warm[:reused], cold[:reused], rtol=1e-4, atol=1e-4)
    assert same is kept
    torch.testing.assert_close(warm[reused:], cold[reused:], rtol=1e-4, atol=1e-4)  # computed alike
