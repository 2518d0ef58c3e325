"""The engine core in a process of its own (``engine_process=True``, what trtllm-serve runs): the
tokens, text, logprobs and stop strings of one process, a cancel that frees the request in the
core, and a core whose process dies."""

import os
import signal
import threading
import time

import pytest

from tensorrt_llm import LLM
from tensorrt_llm._torch.pyexecutor.llm_request import ErrorKind, FinishReason
from tensorrt_llm.llmapi import GenerationRequest
from tensorrt_llm.sampling_params import SamplingParams

PROMPTS = ["Ann has 58 cups. Ann gets 67 more cups.", "Bob has 3 apples", "red moon 4821 fish"]
PARAMS = [
    SamplingParams(max_tokens=16, temperature=0),
    SamplingParams(max_tokens=16, temperature=0.9, top_p=0.8, seed=7, logprobs=2),
    SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=["4"]),
]


def outputs(llm: LLM) -> list:
    return [
        (o.text, o.token_ids, o.logprobs, o.finish_reason, o.stop_reason)
        for o in (r.outputs[0] for r in llm.generate(PROMPTS, PARAMS))
    ]


def test_the_outputs_are_those_of_one_process():
    with LLM(device="cpu", max_batch_size=4) as here:
        expected = outputs(here)
        steps = here.get_stats()["num_steps"]
    with LLM(device="cpu", max_batch_size=4, engine_process=True) as apart:
        assert apart.executor is None  # (nothing of the engine in this process)
        got = outputs(apart)
        # the same tokens, text and ends; logprobs to float noise (the requests reach the core one
        # by one, so its first steps batch them differently)
        assert [o[:2] + o[3:] for o in got] == [o[:2] + o[3:] for o in expected]
        for (*_, mine, _, _), (*_, theirs, _, _) in zip(got, expected, strict=True):
            assert (mine is None) == (theirs is None)
            for (lp, top), (want, want_top) in zip(mine or [], theirs or [], strict=True):
                assert lp == pytest.approx(want, abs=1e-4)
                assert [t for t, _ in top] == [t for t, _ in want_top]
        assert apart.get_stats()["num_steps"] >= steps
        report = apart.kv_cache_report()
        assert report["KV_CACHE_MANAGER"]["used"] == 0 and report["active_requests"] == 0
        with pytest.raises(RuntimeError, match="another process"):
            apart.between_steps(lambda: None)


def _submit(llm: LLM, params: SamplingParams):
    seen, first, done = [], threading.Event(), threading.Event()

    def on_update(output):
        seen.append(output)
        if output.outputs[0].token_ids:
            first.set()
        if output.finished:
            done.set()

    rid = llm.submit(GenerationRequest(PROMPTS[0], params), on_update)
    return rid, seen, first, done


LONG = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)


def test_a_cancel_ends_the_request_in_the_core_and_frees_its_kv():
    with LLM(device="cpu", engine_process=True) as llm:
        rid, seen, first, done = _submit(llm, LONG)
        assert first.wait(60)
        llm.cancel(rid)
        assert done.wait(30)
        assert seen[-1].outputs[0].finish_reason is FinishReason.CANCELLED
        assert len(seen[-1].outputs[0].token_ids) < 400
        report = llm.kv_cache_report()
        assert report["KV_CACHE_MANAGER"]["used"] == 0 and report["active_requests"] == 0


def test_a_dead_core_ends_the_requests_in_flight_and_says_why():
    llm = LLM(device="cpu", engine_process=True)
    try:
        _, seen, first, done = _submit(llm, LONG)
        assert first.wait(60)
        os.kill(llm._core._process.pid, signal.SIGKILL)
        assert done.wait(10)
        last = seen[-1].outputs[0]
        assert last.finish_reason is FinishReason.ERROR
        assert last.stop_reason.kind is ErrorKind.RANK_LOST and "code -9" in last.stop_reason
        assert "exited (code -9)" in llm.lost_rank()
        with pytest.raises(RuntimeError, match="code -9"):
            llm.kv_cache_report()
        _, seen, _, done = _submit(llm, LONG)  # a request after it ends at once, told why
        assert done.is_set() and seen[-1].outputs[0].stop_reason.kind is ErrorKind.RANK_LOST
    finally:
        llm.shutdown()


def test_disaggregated_serving_between_two_engine_processes():
    """A context and a generation LLM, each with its core in a process of its own: the replies
    come back signed, the pull runs between the cores, and the tokens are the aggregated ones."""
    import json

    pytest.importorskip("nixl")
    from tensorrt_llm.llmapi.llm_args import CacheTransceiverConfig

    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    with LLM(device="cpu", max_batch_size=4) as here:
        expected = [o.outputs[0].token_ids for o in here.generate(PROMPTS, params)]
    options = {
        "device": "cpu",
        "max_batch_size": 4,
        "engine_process": True,
        "cache_transceiver_config": CacheTransceiverConfig(),
    }
    with LLM(**options) as ctx, LLM(**options) as gen:
        context_only = {"request_type": "context_only"}
        replies = [o.disaggregated_params for o in ctx.generate(PROMPTS, params, context_only)]
        wire = [json.loads(json.dumps(r.to_json())) for r in replies]
        prompts = [w["prompt_token_ids"] for w in wire]
        forged = {**wire[0], "first_token": (wire[0]["first_token"] + 1) % 80}
        with pytest.raises(ValueError, match="signature|sign"):
            gen.generate(prompts[0], params, forged)
        outputs = gen.generate(prompts, params, wire)
        assert [o.outputs[0].token_ids for o in outputs] == expected
        assert gen.get_stats()["num_context_tokens_computed"] == 0
        # the pulls' notifications reach the context agent asynchronously: wait for all three
        released, deadline = 0, time.monotonic() + 30
        while released < len(PROMPTS) and time.monotonic() < deadline:
            released += ctx.disaggregated.release_pulled()
            time.sleep(0.05)
        assert released == len(PROMPTS)
        for llm in (ctx, gen):
            assert llm.kv_cache_report()["KV_CACHE_MANAGER"]["used"] == 0


def test_the_engine_leaves_a_cpu_core_to_the_front_unless_omp_num_threads_says(monkeypatch):
    """The engine core's process leaves a core to the front, an ``LLM``'s engine loop one to the
    thread that loaded the model; never below one thread, and not where ``OMP_NUM_THREADS``
    says how many."""
    import os

    import torch

    from tensorrt_llm.llmapi.workers import leave_a_core

    cpu = torch.device("cpu")
    before = torch.get_num_threads()
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})  # two cores
    try:
        torch.set_num_threads(2)
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        leave_a_core(cpu, "the front")
        assert torch.get_num_threads() == 2  # the user's setting holds
        monkeypatch.delenv("OMP_NUM_THREADS")
        leave_a_core(torch.device("meta"), "the front")
        assert torch.get_num_threads() == 2  # (a CPU's threads only)
        leave_a_core(cpu, "the front")
        assert torch.get_num_threads() == 1
        leave_a_core(cpu, "the front")
        assert torch.get_num_threads() == 1  # once: never below one
    finally:
        torch.set_num_threads(before)
