"""LLM: the Python entry point. ``LLM(model=dir).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field, replace
from pathlib import Path

from tensorrt_llm._torch.disaggregation.generation_only import PromptKvPull
from tensorrt_llm._torch.disaggregation.params import DisaggregatedParams
from tensorrt_llm._torch.models.config_utils import read_generation_config
from tensorrt_llm._torch.pyexecutor.engine_loop import Submit
from tensorrt_llm._torch.pyexecutor.executor import Executor
from tensorrt_llm._torch.pyexecutor.grammar_matcher import COMPILE_TIMEOUT_S
from tensorrt_llm._torch.pyexecutor.llm_request import FinishReason, LlmRequest
from tensorrt_llm._torch.pyexecutor.py_executor import PyExecutor
from tensorrt_llm.bundled import bundled_target
from tensorrt_llm.inputs import MultimodalPrompts
from tensorrt_llm.llmapi.core_handle import EngineCoreLost
from tensorrt_llm.llmapi.core_process import CoreProcess
from tensorrt_llm.llmapi.disaggregated import DisaggregatedServing
from tensorrt_llm.llmapi.engine_core import EngineCore
from tensorrt_llm.llmapi.llm_args import TorchLlmArgs, default_attn_backend
from tensorrt_llm.llmapi.outputs import CompletionOutput, OutputTracker, RequestOutput
from tensorrt_llm.llmapi.workers import rank_device
from tensorrt_llm.logger import logger
from tensorrt_llm.sampling_params import GenerationDefaults, GuidedDecodingParams, SamplingParams

__all__ = ["LLM", "GenerationRequest", "RequestOutput", "CompletionOutput", "EngineCoreLost"]

# text, token ids, or upstream's dict: {"prompt" or "prompt_token_ids": ..., "multi_modal_data":
# {"image": [...]}} (``tensorrt_llm.inputs.multimodal_prompts``)
PromptInputs = str | list[int] | dict
OnUpdate = Callable[[RequestOutput], None]


@dataclass(frozen=True)
class GenerationRequest:
    """What ``LLM.submit`` runs: a prompt (text, token ids, or a dict with images), its sampling,
    and in a disaggregated deployment its ``disaggregated_params`` (``LLM.disaggregated``)."""

    prompt: PromptInputs
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    disaggregated_params: DisaggregatedParams | dict | None = None


@dataclass
class _Job:
    """A validated request, ready for the engine loop."""

    request: LlmRequest
    tracker: OutputTracker
    load_kv: PromptKvPull | None = None  # a generation-only request's


class LLM:
    def __init__(
        self, model: str | Path | None = None, tokenizer: str | Path | None = None, **kwargs
    ) -> None:
        self.args = TorchLlmArgs.from_kwargs(
            model=None if model is None else str(model),
            tokenizer=None if tokenizer is None else str(tokenizer),
            **kwargs,
        )
        if self.args.model is None:
            self.args = self.args.model_copy(update={"model": bundled_target()})
        self.mapping = self.args.mapping()
        self.device = rank_device(self.args.device, self.mapping)
        if self.args.attn_backend is None:
            backend = default_attn_backend(self.device.type)
            self.args = self.args.model_copy(update={"attn_backend": backend})
        args = self.args
        self._closed = False
        self._core = CoreProcess(args) if args.engine_process else EngineCore(args)
        core = self._core
        self.model_config = core.config
        self.tokenizer = core.tokenizer
        self.multimodal = MultimodalPrompts(args.model, core.config.vision, core.tokenizer)
        self.eos_token_ids = core.config.eos_token_ids
        self.generation_defaults = GenerationDefaults.from_generation_config(
            read_generation_config(args.model), f"{args.model}/generation_config.json"
        )
        self.max_seq_len = core.max_seq_len
        self._ids = itertools.count()
        logger.info(
            "LLM ready: %s on %s (%s, %s), %d KV slots of %d tokens%s",
            args.model,
            self.device,
            str(core.dtype).removeprefix("torch."),
            self.mapping.describe(),
            core.kv_slots,
            core.tokens_per_block,
            " per rank" if self.mapping.world_size > 1 else "",
        )

    # ---- the engine core's parts (in this process) --------------------------------------------------
    @property
    def model(self):
        return self._core.model

    @property
    def executor(self) -> Executor | None:
        return self._core.executor

    @property
    def rank_executor(self) -> PyExecutor | None:
        """This rank's executor (rank 0's)."""
        return self._core.rank_executor

    @property
    def kv_cache_manager(self):
        return self._core.kv_cache_manager

    @property
    def disaggregated(self) -> DisaggregatedServing:
        return self._core.disaggregated

    @property
    def _followers(self):
        return getattr(self._core, "_followers", None)

    # ---- the front door --------------------------------------------------------------------------
    def submit(self, request: GenerationRequest, on_update: OnUpdate) -> int:
        """Start ``request`` on the LLM's engine loop (a background thread, started by the first
        call) and return its id. ``on_update(output)`` is called on that thread after every step
        that touched it, the last time with ``output.finished``. A request that cannot run raises
        ``ValueError`` or ``TypeError`` here, naming what is wrong, and takes nothing; a
        constraint that cannot be compiled ends it with an error naming ``guided_decoding``
        instead (``compile_guide`` refuses one ahead)."""
        job = self._prepare(request)
        self._core.start()
        self._dispatch(job, on_update)
        return job.request.request_id

    def check(self, request: GenerationRequest) -> None:
        """Raise what ``submit`` would raise for ``request`` (a ``ValueError`` or ``TypeError``
        naming what is wrong), without running it."""
        self._prepare(request)

    def cancel(self, request_id: int) -> None:
        """End a submitted request with ``FinishReason.CANCELLED`` and free its KV (between steps;
        its ``on_update`` then gets its last output). Unknown or finished ids are ignored, and so is
        every id once the LLM is shut down."""
        if not self._closed:
            self._core.cancel(request_id)

    def kv_cache_report(self) -> dict:
        """Every KV manager's slot counts (free, used, cached, live requests), checked with
        ``check_integrity()``, and the requests active and held for pulls; taken between steps.
        Raises ``AssertionError`` naming a broken invariant, ``EngineCoreLost`` while the engine
        core's process is lost or restarting."""
        self._check_open()
        return self._core.kv_cache_report()

    def get_stats(self) -> dict:
        """The executor's counts (steps, prompt tokens computed, reused and transferred, tokens
        generated, decode iterations, accepted drafts: every rank's under attention DP), the
        requests active and held for pulls, the KV slots, where the drafter's KV was found, the
        tokens each expert took, and the images through the vision tower and those its encoder
        cache saved (this rank's)."""
        self._check_open()
        return self._core.stats()

    def compile_guide(self, guide: GuidedDecodingParams) -> Future:
        """Compile ``guide`` ahead of the requests that carry it (they then find it compiled:
        the engine builds each constraint once and keeps the most recent, up to 256 and 512 MiB).
        A future done once it is compiled; its exception, a ``SamplingParamsError`` naming
        ``guided_decoding``, says why it cannot be used. ``generate`` does this for its
        requests; a server does it before it answers."""
        self._check_open()
        if self.args.guided_decoding_backend is None:
            raise ValueError("guided_decoding needs LLM(guided_decoding_backend='xgrammar')")
        return self._core.compile_guide(guide)

    def between_steps(self, fn: Callable[[], object]):
        """``fn()`` where no step runs: on the engine loop's thread while it runs, else here."""
        self._check_open()
        return self._core.between_steps(fn)

    def generate(
        self,
        inputs: PromptInputs | list[PromptInputs],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        disaggregated_params: DisaggregatedParams | dict | list | None = None,
    ) -> RequestOutput | list[RequestOutput]:
        """Generate for one prompt or a batch (continuous batching inside); outputs in input
        order. ``disaggregated_params`` (one, or one per prompt): see ``LLM.disaggregated``."""
        single = isinstance(inputs, str | dict) or (
            isinstance(inputs, list) and inputs and isinstance(inputs[0], int)
        )
        prompts = [inputs] if single else list(inputs)
        params = sampling_params or SamplingParams()
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        disagg = disaggregated_params
        disagg_list = disagg if isinstance(disagg, list) else [disagg] * len(prompts)
        for name, given in (
            ("sampling_params", params_list),
            ("disaggregated_params", disagg_list),
        ):
            if len(given) != len(prompts):
                raise ValueError(f"{len(given)} {name} for {len(prompts)} prompts")
        jobs = [  # validate all first
            self._prepare(GenerationRequest(p, sp, d))
            for p, sp, d in zip(prompts, params_list, disagg_list, strict=True)
        ]
        guides = {}  # (a bad constraint fails here, not in a step)
        for job in jobs:
            guide = job.request.sampling_params.guided_decoding
            if guide is not None:
                guides.setdefault((guide.kind, guide.text, guide.disable_any_whitespace), guide)
        for compiled in [self.compile_guide(guide) for guide in guides.values()]:
            try:
                compiled.result(timeout=COMPILE_TIMEOUT_S)
            except FutureTimeout:
                raise ValueError(
                    f"guided_decoding: a constraint was not compiled within {COMPILE_TIMEOUT_S:g} s"
                ) from None
        outputs = self._run(jobs)
        return outputs[0] if single else outputs

    # ---- requests --------------------------------------------------------------------------------
    def _prepare(self, request: GenerationRequest) -> _Job:
        self._check_open()
        prompt, multimodal = self._prompt_with_images(request.prompt)
        if multimodal is not None:
            text, token_ids = multimodal.text, multimodal.token_ids
            multimodal = multimodal.multimodal
        elif isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("skip_tokenizer_init=True: prompts must be lists of token ids")
            self.tokenizer.check_fits(prompt, self.max_seq_len)  # (before it is tokenized)
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            text, token_ids = None, list(prompt)
        else:
            raise TypeError(
                f"a prompt must be a str or a list of token ids, got {type(prompt).__name__}"
            )
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in token_ids):
            raise ValueError(
                f"prompt token ids must be in [0, {vocab}); got {[t for t in token_ids if not 0 <= t < vocab][:5]}"
            )
        if len(token_ids) >= self.max_seq_len:
            raise ValueError(
                f"prompt of {len(token_ids)} tokens exceeds max_seq_len={self.max_seq_len} (leaving no room to generate)"
            )
        params = self.generation_defaults.apply(request.sampling_params)
        if params.guided_decoding is not None and self.args.guided_decoding_backend is None:
            raise ValueError(
                "SamplingParams.guided_decoding needs LLM(guided_decoding_backend='xgrammar')"
            )
        if self.tokenizer is None:
            if params.stop or params.bad:
                raise ValueError(
                    "skip_tokenizer_init=True: stop strings and bad words need a tokenizer"
                )
            params = replace(params, detokenize=False)
        params.check_vocab(vocab)
        encode = self.tokenizer.encode if self.tokenizer is not None else None
        bad_word_ids = params.bad_word_ids(encode, vocab)
        llm_request = LlmRequest(
            request_id=next(self._ids),
            prompt_token_ids=token_ids,
            max_new_tokens=min(params.max_tokens, self.max_seq_len - len(token_ids)),
            sampling_params=params,
            end_ids=(params.end_id,) if params.end_id is not None else self.eos_token_ids,
            bad_word_ids=bad_word_ids,
            multimodal=multimodal,
        )
        load_kv = None
        if request.disaggregated_params is not None:
            load_kv = self.disaggregated.prepare(llm_request, request.disaggregated_params)
        decode = self.tokenizer.decode if self.tokenizer is not None else None
        return _Job(llm_request, OutputTracker(llm_request, text, decode), load_kv)

    def _prompt_with_images(self, prompt: PromptInputs):
        """``(prompt, None)`` for text or token ids; for a dict, its prompt and (with images)
        the expanded prompt and its images (``MultimodalPrompt``)."""
        if not isinstance(prompt, dict):
            return prompt, None
        unknown = sorted(set(prompt) - {"prompt", "prompt_token_ids", "multi_modal_data"})
        if unknown or ("prompt" in prompt) == ("prompt_token_ids" in prompt):
            raise ValueError(
                "a prompt dict takes one of 'prompt' or 'prompt_token_ids', and "
                f"'multi_modal_data'; got keys {sorted(prompt)}"
            )
        inner = prompt.get("prompt", prompt.get("prompt_token_ids"))
        if "multi_modal_data" not in prompt:
            return inner, None
        multimodal = self.multimodal.prepare(inner, prompt["multi_modal_data"])
        return inner, multimodal if multimodal.multimodal is not None else None

    def _dispatch(self, job: _Job, on_update: OnUpdate, final_only: bool = False) -> None:
        """Hand ``job`` to the engine loop; ``on_update`` gets an output after every step, or
        (``final_only``: ``generate``) only the last one, none being built before."""

        def update(request: LlmRequest, finished: bool) -> None:  # on the engine loop's thread
            stop = job.tracker.consume()  # the output side: text, stop strings
            if stop is not None:
                if not request.is_finished:
                    self._core.finish(request.request_id, FinishReason.STOP, stop)
                elif request.finish_reason is FinishReason.LENGTH:  # the string came first
                    request.finish(FinishReason.STOP, stop)
            finished = finished or request.is_finished
            if finished or not final_only:
                reply = self.disaggregated.reply(request) if finished else None
                on_update(job.tracker.output(finished, reply))

        self._core.submit(Submit(job.request, update, job.load_kv))

    def _run(self, jobs: list[_Job]) -> list[RequestOutput]:
        """Run ``jobs`` to their end: on this thread, or through the engine loop's while it runs."""
        if not jobs:
            return []  # (nothing would ever end the wait)
        results: dict[int, RequestOutput] = {}
        done = threading.Event()

        def collect(output: RequestOutput) -> None:
            results[output.request_id] = output
            if len(results) == len(jobs):
                done.set()

        for job in jobs:
            self._dispatch(job, collect, final_only=True)
        self._core.run_until(done)
        return [results[job.request.request_id] for job in jobs]

    def lost_rank(self) -> str | None:
        """Why the LLM cannot run requests now; None while it can. With the core in this process
        and several ranks: which one's process is gone (every step then fails, ending its
        requests with an error: the LLM must be restarted). With ``engine_process``: the core's
        process exited, lost a rank, or finished no step for ``engine_core_deadline_s``; its
        requests ended, and a new core is starting (``lost_rank`` is None again once it is
        ready), or the message says that none will."""
        return None if self._closed else self._core.lost_rank()

    def engine_core_restarts(self) -> int:
        """How many engine cores were started in place of a lost one (``engine_process``)."""
        return self._core.restarts if isinstance(self._core, CoreProcess) else 0

    def shutdown(self) -> None:
        """End the engine loop, free the KV cache and end the NIXL agent; with several ranks, stop
        the others and leave torch.distributed. Then the device memory the LLM held (weights, KV,
        CUDA graphs) goes back: another ``LLM`` built after it gets its full share. The LLM takes
        no request after this; a second call does nothing."""
        if self._closed:
            return
        self._closed = True
        self._core.shutdown()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this LLM was shut down; build a new one")

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
