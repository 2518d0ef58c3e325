"""The CUDA graph path's step on the CPU: ``CUDAGraphRunner`` with ``capture=False`` runs the ops a
graph captures (static buffers, padded rows, device-side accept and draft chain, launches sized by
``kv_len_bound``) eagerly, under Triton's interpreter. It must give the eager executor's tokens.
``cuda_graph_config`` and its translation are checked here too; capture itself is a GPU test
(``test_llm_triton_gpu.py``)."""

import functools
import os
import random

import pytest
import torch
from llm_helpers import staggered_outputs  # noqa: E402  (the tests' folder)
from tokenizers import Tokenizer

from tensorrt_llm import LLM, GuidedDecodingParams, SamplingParams
from tensorrt_llm._torch.pyexecutor.config import CudaGraphOptions
from tensorrt_llm._torch.pyexecutor.cuda_graph_runner import PADDING_REQUEST_ID, CUDAGraphRunner
from tensorrt_llm._torch.pyexecutor.resource_manager import ResourceManagerType
from tensorrt_llm.bundled import BUNDLED_DRAFT, BUNDLED_TARGET
from tensorrt_llm.evaluate.tasks import gsm8k_tiny
from tensorrt_llm.llmapi.llm_args import CudaGraphConfig, Eagle3DecodingConfig, KvCacheConfig

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The graph path's ops on CPU tensors need the interpreter; on a GPU the graphs themselves are
# tested (test_llm_triton_gpu.py).
CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's CPU form")
PROMPTS = ["12+7=", "the cat sat on", "3*4="]  # short raw prompts: the runner's bookkeeping
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def make_llm(draft_kv_cache: str | None, **options) -> LLM:
    spec = None
    if draft_kv_cache is not None:
        spec = Eagle3DecodingConfig(
            max_draft_len=3, speculative_model=str(BUNDLED_DRAFT), draft_kv_cache=draft_kv_cache
        )
    return LLM(
        device="cpu",
        dtype="float32",
        attn_backend="TRITON",
        speculative_config=spec,
        max_batch_size=4,
        kv_cache_config=KvCacheConfig(max_tokens=128 * 16),
        cuda_graph_config=None,
        **options,
    )


def attach_runner(
    llm: LLM, batch_sizes=(1, 2, 4), enable_padding=True, mixed_prompt_tokens=128
) -> CUDAGraphRunner:
    executor = llm.executor
    options = CudaGraphOptions(
        batch_sizes, enable_padding, capture=False, mixed_prompt_tokens=mixed_prompt_tokens
    )
    runner = CUDAGraphRunner(
        executor.model_engine,
        executor.resource_manager,
        options,
        llm.model_config.vocab_size,
        executor.spec_worker,
        executor.guided,
    )
    executor.dispatch.runner = runner
    return runner


def chat_prompts(llm: LLM) -> list[str]:
    """Problems the bundled drafter was trained on, so its drafts get accepted."""
    rng = random.Random(7)
    return [llm.tokenizer.apply_chat_template(gsm8k_tiny(rng)[0][:1]) for _ in range(3)]


def generate(llm: LLM):
    outs = [o.outputs[0] for o in llm.generate(chat_prompts(llm), GREEDY)]
    return [o.token_ids for o in outs], [o.avg_decoded_tokens_per_iter for o in outs]


def staggered(llm: LLM, params) -> list:
    """The chat prompts' outputs, each submitted once the one before has its first token."""
    return staggered_outputs(llm, chat_prompts(llm), params)


@functools.cache
def eager_run(draft_kv_cache: str | None):
    """The eager executor's tokens, AL and overlapped steps, once per module (each costs a run
    under the interpreter)."""
    eager = make_llm(draft_kv_cache)
    tokens, al = generate(eager)
    overlapped = eager.get_stats()["num_overlapped_steps"]
    eager.shutdown()
    return tokens, al, overlapped


@CPU_ONLY
@pytest.mark.parametrize("draft_kv_cache", [None, "separate"])  # (unified: the sampled test's)
def test_graph_step_gives_the_eager_tokens(draft_kv_cache):
    pytest.importorskip("triton.language")
    want_tokens, want_al, eager_overlapped = eager_run(draft_kv_cache)

    llm = make_llm(draft_kv_cache)
    runner = attach_runner(llm)
    outs = staggered(llm, GREEDY)  # (the eager run took the three prompts in one step)
    assert [o.token_ids for o in outs] == want_tokens
    assert [o.avg_decoded_tokens_per_iter for o in outs] == want_al
    # the second and third prompts ran in mixed buckets, beside the requests decoding
    assert runner.num_mixed_replays >= 2
    if draft_kv_cache is not None:  # the three at once: a mixed bucket of four prompt rows,
        mixed = runner.num_mixed_replays  # one of them padding (its draft chain's row too)
        assert generate(llm) == (want_tokens, want_al)
        assert runner.num_mixed_replays == mixed + 1
    # the graph steps overlapped: each launched before the one ahead of it was read (with Eagle3,
    # their positions moved on the device by the accepted counts); the eager ones could not
    assert llm.get_stats()["num_overlapped_steps"] > 0
    if draft_kv_cache is not None:
        assert eager_overlapped == 0
    # three requests decode in the bucket of 4: one padded row every decode step
    assert runner.num_replays >= GREEDY.max_tokens // 4
    # every bucket's logits are views of one buffer (a captured graph's outputs outlive it: one
    # logits tensor per bucket held GBs at the published vocabulary)
    buffers = {b.outputs.logits.untyped_storage().data_ptr() for b in runner._buckets.values()}
    assert len(runner._buckets) >= 2 and buffers == {runner._logits.data_ptr()}
    if draft_kv_cache is not None:  # the bundled drafter is accepted: accept paths past 0 ran
        assert max(o.avg_decoded_tokens_per_iter for o in outs) > 1.5
    target = llm.kv_cache_manager
    target.check_integrity()
    # every request's slots are back; the padding sequence keeps its own
    assert target.get_num_free_blocks() == target.get_max_resource_count()
    llm.shutdown()


@CPU_ONLY
def test_sampled_eagle3_in_the_graph_gives_the_eager_tokens_and_al():
    """Rejection sampling against the drafter's q, kept on the device between steps: the graph
    step and the eager one are the same code, so seeded requests give the same tokens and AL."""
    pytest.importorskip("triton.language")
    params = [
        SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, seed=5, ignore_eos=True),
        SamplingParams(max_tokens=8, temperature=1.0, top_k=7, seed=9, ignore_eos=True),
        SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),  # a greedy row with them
    ]

    def run(llm):
        outs = [o.outputs[0] for o in llm.generate(chat_prompts(llm), params)]
        return [o.token_ids for o in outs], [o.avg_decoded_tokens_per_iter for o in outs]

    eager = make_llm("unified")
    want_tokens, want_al = run(eager)
    assert eager.get_stats()["num_overlapped_steps"] == 0  # (Eagle3's eager positions: the host's)
    eager.shutdown()
    llm = make_llm("unified")
    runner = attach_runner(llm)
    outs = staggered(llm, params)  # (mixed steps: a sampled prompt's first draft has its q too)
    got_tokens, got_al = [o.token_ids for o in outs], [o.avg_decoded_tokens_per_iter for o in outs]
    assert runner.num_replays > 0 and runner.num_mixed_replays >= 2
    assert got_tokens == want_tokens
    assert got_al == want_al
    assert max(got_al) > 1.5  # sampled drafts were accepted against their q
    # the graph steps overlapped, their positions moved on the device by the accepted counts
    assert llm.get_stats()["num_overlapped_steps"] > 0
    target = llm.kv_cache_manager
    target.check_integrity()
    assert target.get_num_free_blocks() == target.get_max_resource_count()
    store = llm.executor.spec_worker.draft_probs
    assert store.allocated and not store._started  # every sampled request's row is let go
    assert not len(store.seq_slots)  # and its request slot is back
    llm.shutdown()


# the second prompt's reply opens a reasoning block: biased away, it answers directly
THINK = Tokenizer.from_file(str(BUNDLED_TARGET / "tokenizer.json")).token_to_id("<mm:think>")
PENALIZED = [
    SamplingParams(max_tokens=8, presence_penalty=2.0, frequency_penalty=2.0, ignore_eos=True),
    SamplingParams(max_tokens=8, logit_bias={THINK: -100.0}, ignore_eos=True),
    SamplingParams(max_tokens=8, temperature=1.0, seed=3, frequency_penalty=2.0, ignore_eos=True),
]


def penalized(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(chat_prompts(llm), PENALIZED)]


@functools.cache
def eager_penalized() -> list[list[int]]:
    """The target-only eager executor's tokens with penalties and bias, once per module."""
    eager = make_llm(None)
    want = penalized(eager)
    plain = eager_run(None)[0]
    assert THINK in plain[1] and THINK not in want[1]
    eager.shutdown()
    return want


@CPU_ONLY
@pytest.mark.parametrize("draft_kv_cache", [None, "unified"])
def test_penalties_and_bias_in_the_graph_give_the_eager_tokens(draft_kv_cache):
    """Their counts live on the device and count the drafts ahead of each verify row: the graph
    step and the eager one give the same tokens, and with Eagle3 the target-only tokens."""
    pytest.importorskip("triton.language")
    want = eager_penalized()
    llm = make_llm(draft_kv_cache)
    runner = attach_runner(llm)
    got = penalized(llm)
    assert runner.num_replays > 0
    if draft_kv_cache is None:  # (sampled Eagle3 draws other numbers than target-only)
        assert got == want
    else:
        assert got[:2] == want[:2]
    assert 67 not in got[1]
    state = llm.executor.resource_manager.get_resource_manager(ResourceManagerType.LOGITS_STATE)
    assert not state._filled and not len(state.seq_slots)  # every row and slot is back
    llm.shutdown()


@CPU_ONLY
def test_batches_the_runner_does_not_take_run_eagerly():
    pytest.importorskip("triton.language")
    llm = make_llm(None)  # target only: the three requests stay together to the end
    runner = attach_runner(llm, batch_sizes=(1, 2), enable_padding=False)
    short = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    llm.generate(PROMPTS, short)  # three at a time, no bucket of 3 without padding
    assert runner.num_replays == 0
    llm.generate(PROMPTS[:2], short)
    assert runner.num_replays > 0
    llm.shutdown()


@CPU_ONLY
def test_sampled_steps_with_logprobs_give_the_eager_tokens_and_logprobs():
    """Top-p rows with logprobs in the graph (the sorted top-k bucket runs in
    ``test_sampled_eagle3_in_the_graph_gives_the_eager_tokens_and_al``; logprobs are the same
    program either way)."""
    pytest.importorskip("triton.language")
    params = [
        SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, seed=5, logprobs=2),
        SamplingParams(max_tokens=8, temperature=1.0, seed=9, logprobs=1),
        SamplingParams(max_tokens=8, temperature=0, logprobs=0),  # greedy rows in the bucket
    ]

    def run(llm):
        outs = [o.outputs[0] for o in llm.generate(PROMPTS, params)]
        return [o.token_ids for o in outs], [o.logprobs for o in outs]

    eager = make_llm(None)
    want_tokens, want_logprobs = run(eager)
    eager.shutdown()
    llm = make_llm(None)
    runner = attach_runner(llm)
    got_tokens, got_logprobs = run(llm)
    assert runner.num_replays >= 6  # the decode steps ran in the sampled bucket of 4
    assert got_tokens == want_tokens
    for got, want in zip(got_logprobs, want_logprobs, strict=True):
        assert len(got) == len(want) == 8
        for (lp, top), (want_lp, want_top) in zip(got, want, strict=True):
            assert lp == pytest.approx(want_lp, abs=1e-4)
            assert [t for t, _ in top] == [t for t, _ in want_top]
            assert [v for _, v in top] == pytest.approx([v for _, v in want_top], abs=1e-4)
    llm.shutdown()


def test_padding_sequence_holds_the_mixed_buckets_prompt_tokens_per_manager():
    """The padding sequence takes what the prompts of the largest mixed bucket leave (four
    prompt rows of 128 tokens: four 128-token slots), in each manager."""
    llm = make_llm("separate")
    before = {
        kind: llm.executor.resource_manager.get_resource_manager(kind).get_max_resource_count()
        for kind in (
            ResourceManagerType.KV_CACHE_MANAGER,
            ResourceManagerType.DRAFT_KV_CACHE_MANAGER,
        )
    }
    runner = attach_runner(llm, mixed_prompt_tokens=128)
    assert runner.shapes.prompt_slots == (1, 2, 4)
    for kind, count in before.items():
        manager = llm.executor.resource_manager.get_resource_manager(kind)
        assert manager.get_max_resource_count() == count - 4
        assert manager.get_cache(PADDING_REQUEST_ID).num_blocks == 4
    llm.shutdown()


@CPU_ONLY
def test_steps_with_grammars_in_the_graph_give_the_eager_tokens():
    """Requests with a grammar decode in an extras bucket, their mask rows one of its inputs
    (all ones for the rows without), beside a request without one; Eagle3's drafts verified
    against the masked logits. Greedy: the eager executor's tokens."""
    pytest.importorskip("triton.language")
    guides = [
        GuidedDecodingParams(regex=r"[0-9]+ \+ [0-9]+ = [0-9]+\."),
        GuidedDecodingParams(grammar='root ::= "The answer is " [0-9] [0-9]? "."'),
        None,
    ]
    params = [
        SamplingParams(max_tokens=12, temperature=0, guided_decoding=guide) for guide in guides
    ]
    eager = make_llm("unified", guided_decoding_backend="xgrammar")
    prompts = chat_prompts(eager)
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, params)]
    eager.shutdown()
    llm = make_llm("unified", guided_decoding_backend="xgrammar")
    runner = attach_runner(llm)
    got = [o.outputs[0] for o in llm.generate(prompts, params)]
    assert [o.token_ids for o in got] == want
    assert got[1].text.startswith("The answer i")  # (12 tokens)
    extras = [b for k, b in runner._buckets.items() if k[2] and b.inputs.bitmask is not None]
    assert extras and runner.num_replays > 0
    # the graph steps overlapped, the masks filled between their two parts
    assert llm.get_stats()["num_overlapped_steps"] > 0
    llm.shutdown()


def test_cuda_graph_config_sizes():
    assert CudaGraphConfig().to_runtime(20, 4096).batch_sizes == (1, 2, 4, 8, 16, 20)
    assert CudaGraphConfig().to_runtime(1, 4096).batch_sizes == (1,)
    assert CudaGraphConfig(max_batch_size=8).to_runtime(64, 4096).batch_sizes == (1, 2, 4, 8)
    assert CudaGraphConfig(batch_sizes=[4, 1, 4]).to_runtime(8, 4096).batch_sizes == (1, 4)
    with pytest.raises(ValueError, match="batch_sizes"):
        CudaGraphConfig(batch_sizes=[16]).to_runtime(8, 4096)
    with pytest.raises(ValueError, match="batch_sizes"):
        CudaGraphOptions(())


def test_mixed_graph_padding_fits_one_sequence():
    # the padding sequence holds a mixed graph's padding tokens: with a short max_seq_len the
    # largest one (4 prompts of 256 tokens by default) would not fit its block table
    assert CudaGraphConfig().to_runtime(8, 4096).mixed_prompt_tokens == 256
    options = CudaGraphConfig().to_runtime(8, 256)
    assert options.mixed_prompt_tokens * options.max_prompts <= 256


def test_cuda_graph_config_where_graphs_cannot_run(tiny_checkpoint):
    # the default turns itself off on the CPU; asked for explicitly, it is an error that says why
    llm = LLM(tiny_checkpoint, device="cpu")
    assert llm.executor.cuda_graph_runner is None
    llm.shutdown()
    with pytest.raises(ValueError, match="cuda_graph_config needs device='cuda'"):
        LLM(tiny_checkpoint, device="cpu", cuda_graph_config=CudaGraphConfig())


def test_mixed_graph_shapes():
    """Which bucket a batch of prompts and decoding requests takes (``GraphShapes.shape``)."""
    from types import SimpleNamespace

    from tensorrt_llm._torch.pyexecutor.graph_shapes import GraphShapes
    from tensorrt_llm._torch.pyexecutor.mixed_bucket import GraphShape

    def prompt(length, last=True, image=None):
        return SimpleNamespace(
            context_chunk=list(range(length)),
            is_last_context_chunk=last,
            multimodal=image,
            sampling_params=GREEDY,
        )

    def batch(prompts, decoding, drafts=3):
        decode = [
            SimpleNamespace(py_draft_tokens=[0] * drafts, sampling_params=GREEDY)
            for _ in range(decoding)
        ]
        return SimpleNamespace(context_requests=prompts, generation_requests=decode)

    shapes = GraphShapes(CudaGraphOptions((1, 2, 4), mixed_prompt_tokens=100, max_prompts=4), 3)
    assert shapes.prompt_slots == (1, 2, 4) and shapes.padding_positions == 400
    assert shapes.shape(batch([], 3)) == GraphShape(4)
    assert shapes.shape(batch([prompt(80)], 0)) == GraphShape(0, 100, 1)  # a prompt alone
    assert shapes.shape(batch([prompt(80)], 2)) == GraphShape(2, 100, 1)
    # three prompts in four rows: 250 tokens, and one for the padding row, of 400
    assert shapes.shape(batch([prompt(80), prompt(90), prompt(80)], 1)) == GraphShape(1, 400, 4)
    assert shapes.shape(batch([prompt(150), prompt(40)], 1)) == GraphShape(1, 200, 2)
    assert shapes.shape(batch([prompt(150), prompt(60)], 1)) is None  # 210 tokens > 200
    assert shapes.shape(batch([prompt(80)] * 5, 1)) is None  # more prompts than a graph holds
    assert shapes.shape(batch([prompt(80, last=False)], 1)) is None  # a chunk that goes on
    assert shapes.shape(batch([prompt(80, image=object())], 1)) is None
    assert shapes.shape(batch([], 2, drafts=1)) is None  # a request without all its drafts
    assert shapes.shape(batch([], 5)) is None  # larger than every bucket
    guided = batch([prompt(10)], 1)
    guided.context_requests[0].sampling_params = SamplingParams(
        guided_decoding=GuidedDecodingParams(regex="a")
    )
    assert shapes.shape(guided) is None  # a grammar's mask: eager steps (for now)
    exact = GraphShapes(CudaGraphOptions((1, 2), False, mixed_prompt_tokens=100), 3)
    assert exact.shape(batch([prompt(10)] * 3, 1)) is None  # no padding: no graph of 3 prompts
    assert exact.shape(batch([prompt(10)] * 2, 2)) == GraphShape(2, 200, 2)
    off = GraphShapes(CudaGraphOptions((1, 2)), 3)  # mixed_prompt_tokens 0: no mixed graphs
    assert off.prompt_slots == () and off.shape(batch([prompt(10)], 1)) is None
    assert len(off.keys()) == 2 * 3 * 2 and len(shapes.keys()) == 3 * 3 * 2 + 4 * 3 * 3


def test_a_wave_of_prompts_beside_decoding_rows_runs_in_graph_steps():
    """More prompts than a mixed bucket takes, beside decoding requests: the first that fit run
    in a graph now, the rest wait a step (``step_plan.choose_bucket``); without decoding rows, or
    when even the first prompt fits no bucket, the batch stays whole (and runs eagerly)."""
    from types import SimpleNamespace

    from tensorrt_llm._torch.pyexecutor.graph_shapes import GraphShapes
    from tensorrt_llm._torch.pyexecutor.mixed_bucket import GraphShape
    from tensorrt_llm._torch.pyexecutor.scheduler import ScheduledRequests
    from tensorrt_llm._torch.pyexecutor.step_plan import plan_step

    def prompt(length, last=True):
        return SimpleNamespace(
            context_chunk=list(range(length)),
            is_last_context_chunk=last,
            multimodal=None,
            sampling_params=GREEDY,
        )

    shapes = GraphShapes(CudaGraphOptions((1, 2, 4), mixed_prompt_tokens=100, max_prompts=4), 3)
    runner = SimpleNamespace(shape_of=shapes.shape)
    decoding = [SimpleNamespace(py_draft_tokens=[0] * 3, sampling_params=GREEDY) for _ in range(2)]

    wave = [prompt(80) for _ in range(6)]
    plan = plan_step(ScheduledRequests(wave, list(decoding)), runner, None)
    assert plan.bucket == GraphShape(2, 400, 4)
    assert plan.batch.context_requests == wave[:4] and plan.batch.paused_requests == wave[4:]
    assert plan.batch.generation_requests == decoding
    # the token budget too: 90 + 90 + 250 (+ a padding row's 1) do not fit 400, 90 + 90 fit 200
    wave = [prompt(90), prompt(90), prompt(250), prompt(10)]
    plan = plan_step(ScheduledRequests(list(wave), list(decoding)), runner, None)
    assert plan.bucket == GraphShape(2, 200, 2) and plan.batch.paused_requests == wave[2:]
    # kept whole: prompts alone, a first prompt no bucket takes
    for prompts, rows in (
        (wave, []),
        ([prompt(80, last=False), *wave], decoding),
        ([prompt(350), *wave], decoding),
    ):
        plan = plan_step(ScheduledRequests(list(prompts), list(rows)), runner, None)
        assert plan.bucket is None and not plan.batch.paused_requests
        assert len(plan.batch.context_requests) == len(prompts)
