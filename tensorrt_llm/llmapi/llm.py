"""LLM: the Python entry point. ``LLM(model=dir).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tensorrt_llm._torch.disaggregation import context_only, generation_only
from tensorrt_llm._torch.disaggregation.generation_only import PromptKvPull
from tensorrt_llm._torch.disaggregation.parallel import pull_options
from tensorrt_llm._torch.disaggregation.params import DisaggregatedParams
from tensorrt_llm._torch.disaggregation.transceiver import KvCacheTransceiver
from tensorrt_llm._torch.distributed.communicator import init_distributed, shutdown_distributed
from tensorrt_llm._torch.distributed.data_parallel import AttentionDpExecutor
from tensorrt_llm._torch.distributed.ranks import TensorParallelLeader, stop_followers
from tensorrt_llm._torch.models.config_utils import read_generation_config
from tensorrt_llm._torch.pyexecutor.llm_request import FinishReason, LlmRequest
from tensorrt_llm._torch.pyexecutor.py_executor import PyExecutor
from tensorrt_llm.bundled import bundled_target
from tensorrt_llm.llmapi.llm_args import TorchLlmArgs, default_attn_backend
from tensorrt_llm.llmapi.workers import Followers, build_rank, join_ranks, rank_device
from tensorrt_llm.logger import logger
from tensorrt_llm.sampling_params import GenerationDefaults, SamplingParams

PromptInputs = str | list[int]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    avg_decoded_tokens_per_iter: float | None = None
    generation_logits: torch.Tensor | None = None  # [num_tokens, vocab] if requested
    # per token of token_ids, if SamplingParams.logprobs: (its log-probability, [(token, lp)...])
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None


@dataclass
class RequestOutput:
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False


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
        self._followers: Followers | None = None
        if self.mapping.world_size > 1:  # ranks 1..N-1 in child processes; this one is rank 0
            logger.set_rank(0)
            self._followers = Followers(args, self.mapping)
        try:
            if self._followers is not None:
                self._followers.wait("joining")
                init_distributed(self.mapping, self._followers.init_method, self.device.type)
            engine = build_rank(args, self.mapping)
            if self._followers is not None:
                self._followers.wait("ready")
                join_ranks(engine, self.mapping)
        except BaseException:
            if self._followers is not None:
                self._followers.kill()
                shutdown_distributed()
            raise
        dtype = engine.dtype
        self.model_config = engine.config
        self.model = engine.model
        self.tokenizer = engine.tokenizer
        self.eos_token_ids = engine.config.eos_token_ids
        self.generation_defaults = GenerationDefaults.from_generation_config(
            read_generation_config(args.model), f"{args.model}/generation_config.json"
        )
        self.max_seq_len = engine.max_seq_len
        self._rank_executor = engine.executor  # this rank's
        self.executor: PyExecutor | AttentionDpExecutor = engine.executor
        if self.mapping.enable_attention_dp and self.mapping.world_size > 1:
            self.executor = AttentionDpExecutor(engine.executor, self.mapping, self.lost_rank)
        elif self.mapping.world_size > 1:
            self.executor.rank_sync = TensorParallelLeader(self.lost_rank)
        self.kv_cache_manager = self.executor.kv_cache_manager
        self.transceiver: KvCacheTransceiver | None = engine.transceiver
        self._ids = itertools.count()
        logger.info(
            "LLM ready: %s on %s (%s, %s), %d KV slots of %d tokens%s",
            args.model,
            self.device,
            str(dtype).removeprefix("torch."),
            self.mapping.describe(),
            self.kv_cache_manager.blocks_in_primary_pool,
            self.kv_cache_manager.tokens_per_block,
            " per rank" if self.mapping.world_size > 1 else "",
        )

    def _make_request(
        self, prompt: PromptInputs, params: SamplingParams
    ) -> tuple[LlmRequest, str | None]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("skip_tokenizer_init=True: prompts must be lists of token ids")
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
        params = self.generation_defaults.apply(params)
        if self.tokenizer is None:
            if params.stop:
                raise ValueError("skip_tokenizer_init=True: stop strings need a tokenizer")
            params = dataclasses.replace(params, detokenize=False)
        request = LlmRequest(
            request_id=next(self._ids),
            prompt_token_ids=token_ids,
            max_new_tokens=min(params.max_tokens, self.max_seq_len - len(token_ids)),
            sampling_params=params,
            end_ids=(params.end_id,) if params.end_id is not None else self.eos_token_ids,
        )
        return request, text

    def generate(
        self,
        inputs: PromptInputs | list[PromptInputs],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
    ) -> RequestOutput | list[RequestOutput]:
        """Generate for one prompt or a batch (continuous batching inside); outputs in input order."""
        single = isinstance(inputs, str) or (
            isinstance(inputs, list) and inputs and isinstance(inputs[0], int)
        )
        prompts = [inputs] if single else list(inputs)
        params = sampling_params or SamplingParams()
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(params_list)} sampling_params for {len(prompts)} prompts")
        made = [
            self._make_request(p, sp) for p, sp in zip(prompts, params_list)
        ]  # validate all first
        for request, _ in made:
            self.executor.enqueue_request(request)
        while self.executor.has_work:
            self.executor.step()
        outputs = [self._output(request, text) for request, text in made]
        return outputs[0] if single else outputs

    # ---- disaggregated serving ------------------------------------------------------------------
    def _require_transceiver(self) -> KvCacheTransceiver:
        if self.transceiver is None:
            raise ValueError("disaggregated serving needs cache_transceiver_config (backend: NIXL)")
        return self.transceiver

    def generate_context_only(
        self, inputs: list[PromptInputs], sampling_params: SamplingParams | None = None
    ) -> list[DisaggregatedParams]:
        """Prefill each prompt (target and drafter KV, first token, first drafts) and keep its KV
        for a generation server; returns the ``disaggregated_params`` per prompt."""
        self._require_transceiver()
        made = [self._make_request(p, sampling_params or SamplingParams())[0] for p in inputs]
        for request in made:
            request.context_only = True
            self.executor.enqueue_request(request)
        while self.executor.has_work:
            self.executor.step()
        return [self.context_result(request) for request in made]

    def context_result(self, request: LlmRequest) -> DisaggregatedParams:
        """The ``disaggregated_params`` of a context-only request that ran."""
        return context_only.context_result(
            request,
            self._require_transceiver(),
            self.executor.disagg.hold_left_s(request.request_id),
        )

    def release_pulled(self) -> int:
        """Free context-only requests whose KV a generation server has pulled (or timed out)."""
        return context_only.release_pulled(self.executor, self._require_transceiver())

    def generation_only_request(
        self, disaggregated_params: DisaggregatedParams | dict, sampling_params: SamplingParams
    ) -> tuple[LlmRequest, PromptKvPull]:
        """A request resuming after a context server's prefill, and the ``load_kv`` that pulls its
        prompt KV when the executor admits it (see ``generation_only.resume_from_context``)."""
        transceiver = self._require_transceiver()
        params = DisaggregatedParams.model_validate(disaggregated_params)
        generation_only.check_resumable(params)
        request, _ = self._make_request(list(params.prompt_token_ids), sampling_params)
        load_kv = generation_only.resume_from_context(
            request, params, self._rank_executor, transceiver, **pull_options(self.mapping)
        )
        return request, load_kv

    def generate_from_context(
        self,
        disaggregated_params: list[DisaggregatedParams | dict],
        sampling_params: SamplingParams | None = None,
    ) -> list[RequestOutput]:
        """Decode requests whose prompts a context server prefilled (see ``generation_only_request``)."""
        made = []
        for params in disaggregated_params:
            request, load_kv = self.generation_only_request(
                params, sampling_params or SamplingParams()
            )
            self.executor.enqueue_generation_only(request, load_kv)
            made.append(request)
        while self.executor.has_work:
            self.executor.step()
        return [self._output(r, None) for r in made]

    def _output(self, request: LlmRequest, prompt: str | None) -> RequestOutput:
        tokens = list(request.output_token_ids)
        visible = (
            tokens[:-1]
            if request.finish_reason is FinishReason.STOP and isinstance(request.stop_reason, int)
            else tokens
        )
        text = self.tokenizer.decode(visible) if request.sampling_params.detokenize else ""
        if request.text_limit is not None:
            text = text[: request.text_limit]
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=tokens,
            finish_reason=request.finish_reason,
            stop_reason=request.stop_reason,
            avg_decoded_tokens_per_iter=request.avg_decoded_tokens_per_iter,
            generation_logits=torch.stack(request.py_generation_logits)
            if request.py_generation_logits
            else None,
            logprobs=list(request.py_logprobs)
            if request.sampling_params.logprobs is not None
            else None,
        )
        return RequestOutput(
            request.request_id, prompt, request.prompt_token_ids, [completion], finished=True
        )

    def lost_rank(self) -> str | None:
        """With several ranks: which one's process is gone (None while all run). Every step
        then fails, ending its requests with an error: the LLM must be restarted."""
        return None if self._followers is None else self._followers.lost()

    def shutdown(self) -> None:
        """Free the KV cache; with several ranks, stop the others and leave torch.distributed."""
        if self._followers is not None:
            stop_followers(self.lost_rank)
        self._rank_executor.shutdown()
        if self._followers is not None:
            shutdown_distributed()  # with the followers: NCCL's teardown waits for every rank
            self._followers.stop()
            self._followers = None
            logger.set_rank(None)

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
