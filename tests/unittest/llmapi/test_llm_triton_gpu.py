"""On a GPU, the TRITON backend's greedy outputs equal the VANILLA reference's on the bundled
model, with CUDA graphs and without: target only, and Eagle3 with the unified and the separate
draft KV cache."""

import random
from types import SimpleNamespace

import pytest
from llm_helpers import staggered_outputs  # noqa: E402  (the tests' folder)

from tensorrt_llm import LLM, SamplingParams
from tensorrt_llm.bundled import BUNDLED_DRAFT
from tensorrt_llm.evaluate.tasks import gsm8k_tiny, long_prompt, multiturn_copy
from tensorrt_llm.llmapi.llm_args import Eagle3DecodingConfig, KvCacheConfig

pytestmark = pytest.mark.gpu
GREEDY = SamplingParams(max_tokens=64, temperature=0)


def prompts(llm: LLM) -> list[str]:
    """Chat prompts of the eval tasks: short problems, a multi-turn opening, and a long prompt
    that makes MSA select blocks."""
    rng = random.Random(7)
    conversations = [gsm8k_tiny(rng)[0][:1] for _ in range(6)]
    conversations += [multiturn_copy(rng)[:1], long_prompt(rng)[0][:1]]
    return [llm.tokenizer.apply_chat_template(c) for c in conversations]


def num_buckets(runner) -> int:
    """Every bucket: each size, way of sampling, extras or not; and 1, 2, 4 prompts (with no
    extras) beside each size of decoding rows or alone."""
    sizes = len(runner.options.batch_sizes)
    return 3 * 2 * sizes + 3 * (sizes + 1) * len(runner.shapes.prompt_slots)


def tokens(outputs) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in outputs]


@pytest.mark.parametrize("draft_kv_cache", [None, "unified", "separate"])
def test_triton_greedy_equals_vanilla_on_the_bundled_model(draft_kv_cache):
    spec = (
        None
        if draft_kv_cache is None
        else Eagle3DecodingConfig(
            max_draft_len=3, speculative_model=str(BUNDLED_DRAFT), draft_kv_cache=draft_kv_cache
        )
    )

    def run(backend: str, cuda_graphs: bool, one_by_one: bool = False):
        llm = LLM(
            device="cuda",
            attn_backend=backend,
            speculative_config=spec,
            kv_cache_config=KvCacheConfig(max_tokens=128 * 64),
            **({} if cuda_graphs else {"cuda_graph_config": None}),
        )
        runner = llm.executor.cuda_graph_runner
        if one_by_one:  # each prompt joins the requests decoding: mixed graphs replay
            outputs = staggered_outputs(llm, prompts(llm), GREEDY)
            assert runner.num_mixed_replays >= len(outputs) - 2  # (the long prompt's is eager)
            outputs = [SimpleNamespace(outputs=[o]) for o in outputs]
        else:
            outputs = llm.generate(prompts(llm), GREEDY)
        if cuda_graphs:  # the decode steps replayed graphs, at several batch sizes
            assert runner.num_replays > 0 and len(runner.captured_batch_sizes) > 1
            assert runner.inputs_pinned  # else the host could not run ahead of the device
        else:
            assert runner is None
        llm.shutdown()
        return outputs

    vanilla = run("VANILLA", cuda_graphs=False)
    triton, graphed = run("TRITON", cuda_graphs=False), run("TRITON", cuda_graphs=True)
    assert tokens(triton) == tokens(vanilla)
    assert tokens(graphed) == tokens(triton)
    mixed = run("TRITON", cuda_graphs=True, one_by_one=True)
    assert tokens(mixed) == tokens(triton)
    if spec is not None:
        # The drafter runs through the kernels too. Its bf16 numerics differ from the reference's
        # (fp32 einsum), so a near-tie can change one draft: acceptance stays within 2%.
        def mean_al(outputs):
            return sum(o.outputs[0].avg_decoded_tokens_per_iter for o in outputs) / len(outputs)

        assert mean_al(triton) == pytest.approx(mean_al(vanilla), rel=0.02)
        # Under a graph the attention kernels split the KV by the graph's length bound, eagerly by
        # the step's own lengths: the sums round differently, and with the published model a
        # near-tie draft can flip (graphed 3.747 against eager 3.774 on this run's prompts).
        assert mean_al(graphed) == pytest.approx(mean_al(triton), rel=0.02)
        assert mean_al(mixed) == pytest.approx(mean_al(triton), rel=0.02)
        assert mean_al(triton) > 3.0  # the bundled drafter is accepted through the kernels


def test_seeded_sampling_with_logprobs_runs_in_the_graphs_and_reproduces():
    """Sampled batches replay graphs of their own (their equality with the eager step, on the
    CPU's form of the same ops, is ``test_cuda_graph_runner.py``'s)."""
    llm = LLM(device="cuda", kv_cache_config=KvCacheConfig(max_tokens=128 * 64))
    params = [
        SamplingParams(
            max_tokens=32, temperature=0.8, top_p=0.9, seed=i, logprobs=2, ignore_eos=True
        )
        for i in range(8)
    ]
    runner = llm.executor.cuda_graph_runner
    captured = runner.num_captures
    assert captured == num_buckets(runner)
    first = llm.generate(prompts(llm), params)
    replays = runner.num_replays
    assert replays >= 31  # every decode step of the batch of 8
    again = llm.generate(prompts(llm), params)
    assert runner.num_replays >= 2 * replays
    assert tokens(again) == tokens(first)
    assert len({tuple(t) for t in tokens(first)}) > 1
    for out in first:
        out = out.outputs[0]
        assert len(out.logprobs) == len(out.token_ids) == 32
        assert all(lp <= 0 and len(top) == 2 for lp, top in out.logprobs)
    llm.shutdown()


def test_sampled_eagle3_runs_in_the_graphs_reproduces_and_accepts():
    """Rejection sampling against the drafter's q, captured: seeded requests reproduce, their
    drafts are accepted, and every q slot is back at the end. Every graph was captured before
    ``LLM(...)`` returned, none after."""
    spec = Eagle3DecodingConfig(max_draft_len=3, speculative_model=str(BUNDLED_DRAFT))
    llm = LLM(
        device="cuda", speculative_config=spec, kv_cache_config=KvCacheConfig(max_tokens=128 * 64)
    )
    params = [
        SamplingParams(max_tokens=32, temperature=0.8, top_p=0.9, seed=i, ignore_eos=True)
        for i in range(8)
    ]
    runner = llm.executor.cuda_graph_runner
    captured = runner.num_captures
    assert captured == num_buckets(runner)
    first = llm.generate(prompts(llm), params)
    replays = runner.num_replays
    assert replays > 0
    again = llm.generate(prompts(llm), params)
    assert runner.num_replays > replays
    assert tokens(again) == tokens(first)
    mean_al = sum(o.outputs[0].avg_decoded_tokens_per_iter for o in first) / len(first)
    assert mean_al > 2.0
    assert not llm.executor.spec_worker.draft_probs._started
    assert not len(llm.executor.spec_worker.draft_probs.seq_slots)
    assert runner.num_captures == captured  # none after LLM(...) returned
    llm.shutdown()


def test_penalties_and_bias_run_in_the_graphs_and_give_the_eager_tokens():
    """Penalized batches replay graphs whose counts live on the device (the capture's warm-up
    run must not count a step twice): the tokens are the eager steps'."""
    params = [
        SamplingParams(max_tokens=32, presence_penalty=2.0, frequency_penalty=2.0, ignore_eos=True),
        SamplingParams(
            max_tokens=32, logit_bias={100: 5.0}, frequency_penalty=1.0, ignore_eos=True
        ),
    ] * 4

    def run(cuda_graphs: bool):
        llm = LLM(
            device="cuda",
            kv_cache_config=KvCacheConfig(max_tokens=128 * 64),
            **({} if cuda_graphs else {"cuda_graph_config": None}),
        )
        out = tokens(llm.generate(prompts(llm), params))
        if cuda_graphs:
            assert llm.executor.cuda_graph_runner.num_replays > 0
        llm.shutdown()
        return out

    assert run(cuda_graphs=True) == run(cuda_graphs=False)


def test_a_failed_graph_replay_is_an_engine_fault_that_the_server_answers_with_a_500(monkeypatch):
    """A CUDA graph replay that raises whenever one request is in it: that request alone ends,
    with a typed engine fault that the server maps to ``500 server_error``; the others are run
    again and keep their tokens; no request slot or KV slot is left held. A prompt longer than
    the model's is the client's fault: ``400 invalid_request_error``."""
    from tensorrt_llm._torch.pyexecutor.llm_request import ErrorKind, FinishReason, RequestError
    from tensorrt_llm.serve.errors import request_failed

    spec = Eagle3DecodingConfig(max_draft_len=3, speculative_model=str(BUNDLED_DRAFT))
    llm = LLM(
        device="cuda", speculative_config=spec, kv_cache_config=KvCacheConfig(max_tokens=128 * 64)
    )
    texts = prompts(llm)[:4]

    def held():  # KV slots held and requests, per manager (the graphs' padding holds one)
        report = llm.kv_cache_report()
        return {
            k: (v["used"], v["live_requests"]) if isinstance(v, dict) else v
            for k, v in report.items()
        }

    idle = held()
    want = tokens(llm.generate(texts, GREEDY))
    executor = llm.rank_executor
    runner, poison = executor.cuda_graph_runner, llm.tokenizer.encode(texts[1])
    original = runner.run

    def run(batch, shape, settle=None):
        if any(r.prompt_token_ids == poison for r in batch.generation_requests):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return original(batch, shape, settle)

    monkeypatch.setattr(runner, "run", run)
    replays = runner.num_replays
    got = llm.generate(texts, GREEDY)
    assert runner.num_replays > replays  # the others decoded in graphs
    bad = got[1].outputs[0]
    assert bad.finish_reason is FinishReason.ERROR and isinstance(bad.stop_reason, RequestError)
    assert bad.stop_reason.kind is ErrorKind.ENGINE_FAULT
    assert "illegal memory access" in bad.stop_reason.message
    error = request_failed(bad.stop_reason)
    assert (error.status, error.kind) == (500, "server_error")
    assert [t for i, t in enumerate(tokens(got)) if i != 1] == want[:1] + want[2:]
    assert executor.isolation.num_failed_alone == 1 and not len(executor.seq_slots)
    assert held() == idle
    with pytest.raises(ValueError, match="exceeds max_seq_len"):
        llm.generate([[5] * (llm.max_seq_len + 1)], GREEDY)
    refused = request_failed(RequestError(ErrorKind.INVALID_REQUEST, "prompt too long"))
    assert (refused.status, refused.kind) == (400, "invalid_request_error")
    llm.shutdown()
