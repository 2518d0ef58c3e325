"""MTP through ``LLM``: MiniMax-M3's own module drafts (``MTPDecodingConfig``), losslessly, and
is accepted when it is right.

The constructed checkpoint: every target layer adds nothing (zero output projections), so the
next token depends on the current one only, ``next = f(t)``; its MTP module passes the embedding
half through (``eh_proj = [I, 0]``) and its layer adds nothing either, so at position p it
predicts ``f(t_{p+1})``, the token after next: every draft is right and AL is K + 1. A module fed
the target's hidden state in place of the next token's embedding (the halves swapped, or the
input unshifted) predicts ``f(t_p) = t_{p+1}`` instead, the token already known, and is refused.
"""

import sys
from pathlib import Path

import pytest
import torch

from tensorrt_llm import LLM, MTPDecodingConfig, SamplingParams

sys.path.insert(0, str(Path(__file__).parent))
from llm_helpers import write_tiny_checkpoint  # noqa: E402

GREEDY = SamplingParams(max_tokens=24, temperature=0)
PROMPTS = ["hello world", "the cat sat on the mat", "abc abc abc abc", "z"]


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def mean_al(outputs) -> float:
    return sum(o.outputs[0].avg_decoded_tokens_per_iter for o in outputs) / len(outputs)


def _pass_through(model_dir: Path, swap: bool = False) -> Path:
    """``model_dir``'s checkpoint made into the constructed one (see the module docstring)."""
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    weights = load_file(str(path))
    for name, w in weights.items():
        # silent layers; the norms of the two paths to the LM head alike (Gemma's: 1 + 0)
        if name.endswith(("o_proj.weight", "w2.weight", "down_proj.weight")):
            weights[name] = torch.zeros_like(w)
        if name.endswith(("model.norm.weight", "enorm.weight", "final_layernorm.weight")):
            weights[name] = torch.zeros_like(w)
        if name.endswith("eh_proj.weight"):
            hidden = w.shape[0]
            eye = torch.eye(hidden, dtype=w.dtype)
            halves = (torch.zeros_like(eye), eye) if swap else (eye, torch.zeros_like(eye))
            weights[name] = torch.cat(halves, dim=1)
    save_file(weights, str(path), metadata={"format": "pt"})
    return model_dir


@pytest.fixture(scope="module")
def random_mtp(tmp_path_factory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("mtp"), seed=5, num_mtp_modules=1)


@pytest.fixture(scope="module")
def target_only(random_mtp) -> list[list[int]]:
    llm = LLM(model=str(random_mtp), device="cpu")
    try:
        return tokens(llm.generate(PROMPTS, GREEDY))
    finally:
        llm.shutdown()


@pytest.mark.parametrize("draft_kv_cache", ["unified", "separate"])
def test_mtp_greedy_gives_the_target_only_tokens(random_mtp, target_only, draft_kv_cache):
    spec = MTPDecodingConfig(max_draft_len=3, draft_kv_cache=draft_kv_cache)
    llm = LLM(model=str(random_mtp), device="cpu", speculative_config=spec)
    try:
        assert tokens(llm.generate(PROMPTS, GREEDY)) == target_only
        assert llm.rank_executor.spec_worker.draft_kv_mode.startswith(
            "target manager's whole-page" if draft_kv_cache == "unified" else "separate"
        )
    finally:
        llm.shutdown()


def test_a_right_module_is_accepted_and_a_misfed_one_is_not(tmp_path):
    right = _pass_through(write_tiny_checkpoint(tmp_path / "right", seed=2, num_mtp_modules=1))
    wrong = _pass_through(
        write_tiny_checkpoint(tmp_path / "wrong", seed=2, num_mtp_modules=1), swap=True
    )
    spec = MTPDecodingConfig(max_draft_len=3)
    results = {}
    for name, model_dir in (("right", right), ("wrong", wrong)):
        llm = LLM(model=str(model_dir), device="cpu", speculative_config=spec)
        try:
            results[name] = llm.generate(PROMPTS[:3], GREEDY)
        finally:
            llm.shutdown()
    assert tokens(results["right"]) == tokens(results["wrong"])  # (lossless either way)
    # every draft right: 23 tokens after the prompt's in 6 steps of 4 (at position 0 the module
    # sees no embedding, as published: a one-token prompt's first drafts would be refused)
    assert [o.outputs[0].avg_decoded_tokens_per_iter for o in results["right"]] == [23 / 6] * 3
    assert mean_al(results["wrong"]) < 1.2


@pytest.mark.skipif(torch.cuda.is_available(), reason="the graph path's CPU form")
@pytest.mark.parametrize("relaxed", [False, True], ids=["exact", "relaxed"])
def test_mtp_in_the_graph_path_gives_the_target_only_tokens(tmp_path, monkeypatch, relaxed):
    """The CUDA graph path's step (``capture=False``, Triton's interpreter): the MTP layer's
    sparse attention in the verify step and down the chain, in decode and mixed buckets. With
    relaxed acceptance (any draft taken in a "thinking phase" opened by ``c``, closed by ``=``),
    the eager step's tokens: the phases are graph inputs too."""
    pytest.importorskip("triton.language")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from llm_helpers import staggered_outputs
    from tokenizers import Tokenizer

    from tensorrt_llm._torch.pyexecutor.config import CudaGraphOptions
    from tensorrt_llm._torch.pyexecutor.cuda_graph_runner import CUDAGraphRunner
    from tensorrt_llm.llmapi.llm_args import KvCacheConfig

    model_dir = write_tiny_checkpoint(
        tmp_path, seed=5, num_mtp_modules=1, max_position_embeddings=1024
    )
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)

    def make(**options) -> LLM:
        return LLM(
            model=str(model_dir),
            device="cpu",
            attn_backend="TRITON",
            max_batch_size=4,
            kv_cache_config=KvCacheConfig(max_tokens=128 * 16),
            cuda_graph_config=None,
            **options,
        )

    spec = MTPDecodingConfig(max_draft_len=3)
    if relaxed:
        ids = Tokenizer.from_file(str(model_dir / "tokenizer.json")).token_to_id
        spec = MTPDecodingConfig(
            max_draft_len=3,
            use_relaxed_acceptance_for_thinking=True,
            relaxed_topk=10**6,
            relaxed_delta=1.0,
            begin_thinking_phase_token=ids("c"),
            end_thinking_phase_token=ids("="),
        )
    base = make(speculative_config=spec) if relaxed else make()
    want = tokens(base.generate(PROMPTS[:3], params))
    base.shutdown()
    llm = make(speculative_config=spec)
    executor = llm.executor
    runner = CUDAGraphRunner(
        executor.model_engine,
        executor.resource_manager,
        CudaGraphOptions((1, 2, 4), True, capture=False, mixed_prompt_tokens=128),
        llm.model_config.vocab_size,
        executor.spec_worker,
        executor.guided,
    )
    executor.dispatch.runner = runner
    try:
        outs = staggered_outputs(llm, PROMPTS[:3], params)
        assert [o.token_ids for o in outs] == want
        if relaxed:  # a request whose every draft was taken (9 tokens after its first in 3 steps)
            assert max(o.avg_decoded_tokens_per_iter for o in outs) == 3
        assert runner.num_replays > 0 and runner.num_mixed_replays >= 2
    finally:
        llm.shutdown()


@pytest.mark.gpu
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_mtp_on_cuda_with_graphs_is_lossless_and_accepted(tmp_path, overlap):
    """On CUDA with the Triton kernels, every step in a captured graph: the target-only tokens,
    and the constructed module accepted every draft."""
    options = dict(
        device="cuda", dtype="float32", disable_overlap_scheduler=not overlap, max_batch_size=4
    )
    model_dir = write_tiny_checkpoint(tmp_path / "random", seed=5, num_mtp_modules=1)
    right = _pass_through(write_tiny_checkpoint(tmp_path / "right", seed=2, num_mtp_modules=1))
    spec = MTPDecodingConfig(max_draft_len=3)
    for checkpoint in (model_dir, right):
        base = LLM(model=str(checkpoint), **options)
        want = tokens(base.generate(PROMPTS[:3], GREEDY))
        base.shutdown()
        llm = LLM(model=str(checkpoint), speculative_config=spec, **options)
        try:
            runner = llm.executor.cuda_graph_runner
            replays = runner.num_replays
            got = llm.generate(PROMPTS[:3], GREEDY)
            assert tokens(got) == want
            assert runner.num_replays > replays
            if checkpoint == right:
                assert [o.outputs[0].avg_decoded_tokens_per_iter for o in got] == [23 / 6] * 3
        finally:
            llm.shutdown()


def test_a_reused_prefix_keeps_the_modules_kv(random_mtp):
    """A second turn reuses the first's committed block, the module's KV in it (unified), so it
    accepts what a cold run accepts."""
    first = "abc abc abc abc " * 9  # 144 characters: one whole block of 128 committed
    second = first + "abc abc ab"
    spec = MTPDecodingConfig(max_draft_len=3)

    def al_of(llm, text):
        return llm.generate([text], GREEDY)[0].outputs[0].avg_decoded_tokens_per_iter

    cold = LLM(model=str(random_mtp), device="cpu", speculative_config=spec)
    want = al_of(cold, second)
    cold.shutdown()
    llm = LLM(model=str(random_mtp), device="cpu", speculative_config=spec)
    try:
        al_of(llm, first)
        before = llm.get_stats()["num_reused_tokens"]
        got = al_of(llm, second)
        assert llm.get_stats()["num_reused_tokens"] - before == 128
        assert want > 1.0  # (drafts accepted: the KV they read matters)
        assert got == want
    finally:
        llm.shutdown()


def test_sampled_mtp_reproduces_and_stays_in_the_vocabulary(random_mtp):
    """Rejection sampling against the module's q (over the whole vocabulary): a seeded request
    draws the same tokens again, alone or beside others."""
    spec = MTPDecodingConfig(max_draft_len=3)
    params = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=7)
    llm = LLM(model=str(random_mtp), device="cpu", speculative_config=spec)
    try:
        together = tokens(llm.generate(PROMPTS, params))
        alone = tokens(llm.generate(PROMPTS[:1], params))
        assert alone[0] == together[0] and len(together[0]) == 16
        vocab = llm.model_config.vocab_size
        assert all(0 <= t < vocab for row in together for t in row)
    finally:
        llm.shutdown()


def test_the_first_step_embeds_a_prompts_next_token_as_the_target_did():
    """Where a row's next token is the step's next input row (a prompt's next position), the
    module gets that row's input embedding (an image's, where it is one); elsewhere (a prompt's
    last row, a decode row whose draft was refused, the last row) the token's own embedding."""
    from tensorrt_llm._torch.speculative.mtp import FirstStep

    image = 60
    input_ids = torch.tensor([5, image, image, 7, 9, 3])  # a prompt, then a decode and its draft
    positions = torch.tensor([0, 1, 2, 3, 10, 11])
    following = torch.tensor([image, image, 7, 8, 4, 6])  # (the draft 3 refused: 4 follows 9)
    inputs = torch.randn(6, 4)  # as the target saw them: rows 1 and 2 are an image's features
    embedded = torch.randn(6, 4)  # the module's own embedding of each following token
    step = FirstStep(hidden=torch.zeros(6, 4), embeddings=inputs, input_ids=input_ids)
    got = step.next_embeddings(following, positions, embedded)
    want = torch.stack([inputs[1], inputs[2], inputs[3], embedded[3], embedded[4], embedded[5]])
    assert torch.equal(got, want)


def test_mtp_on_image_prompts_gives_the_target_only_tokens(tmp_path):
    import numpy as np
    from llm_helpers import write_tiny_vl_checkpoint

    from tensorrt_llm.llmapi.llm_args import KvCacheConfig

    model_dir = write_tiny_vl_checkpoint(tmp_path, num_mtp_modules=1)
    rng = np.random.RandomState(0)
    images = [rng.randint(0, 255, (32, 48, 3), dtype=np.uint8) for _ in range(2)]
    text = "<|user|>see ]<]image[>[ and tell<|end|><|assistant|>"
    prompts = [{"prompt": text, "multi_modal_data": {"image": [image]}} for image in images]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    kv = KvCacheConfig(tokens_per_block=16, max_tokens=4096)
    base = LLM(str(model_dir), device="cpu", kv_cache_config=kv)
    want = tokens(base.generate(prompts, params))
    base.shutdown()
    spec = MTPDecodingConfig(max_draft_len=3)
    llm = LLM(str(model_dir), device="cpu", kv_cache_config=kv, speculative_config=spec)
    try:
        assert tokens(llm.generate(prompts, params)) == want
    finally:
        llm.shutdown()


def test_a_standalone_mtp_checkpoint_drafts_as_the_bundled_module(random_mtp, tmp_path):
    """``speculative_model``: the module's weights from a checkpoint of their own (no
    ``language_model.`` prefix; its copy of the embedding left) for a target that has none: the
    same tokens and acceptance as the module bundled in the target's checkpoint."""
    import json

    from safetensors.torch import load_file, save_file

    weights = load_file(str(random_mtp / "model.safetensors"))
    config = json.loads((random_mtp / "config.json").read_text())
    target, standalone = tmp_path / "target", tmp_path / "mtp"
    target.mkdir(), standalone.mkdir()
    for name in ("tokenizer.json",):
        (target / name).write_bytes((random_mtp / name).read_bytes())
    save_file(
        {n: w for n, w in weights.items() if ".mtp." not in n}, str(target / "model.safetensors")
    )
    (target / "config.json").write_text(json.dumps({**config, "num_mtp_modules": 0}))
    own = {n.removeprefix("language_model."): w for n, w in weights.items() if ".mtp." in n}
    own["model.embed_tokens.weight"] = weights["language_model.model.embed_tokens.weight"]
    save_file(own, str(standalone / "model.safetensors"))
    (standalone / "config.json").write_text(json.dumps({"model_type": "minimax_m3_mtp"}))

    def run(model_dir, **spec):
        llm = LLM(
            model=str(model_dir),
            device="cpu",
            speculative_config=MTPDecodingConfig(max_draft_len=3, **spec),
        )
        try:
            outputs = llm.generate(PROMPTS, GREEDY)
        finally:
            llm.shutdown()
        return [(o.outputs[0].token_ids, o.outputs[0].avg_decoded_tokens_per_iter) for o in outputs]

    assert run(target, speculative_model=str(standalone)) == run(random_mtp)
    with pytest.raises(ValueError, match="num_mtp_modules=0 .*speculative_model"):
        run(target)  # (the target alone has no module)
