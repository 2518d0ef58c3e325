"""An OpenAI-compatible HTTP server over an ``LLM``: /v1/models, /v1/completions,
/v1/chat/completions (streaming SSE or not), /health and /metrics (Prometheus text).

It drives the ``LLM`` only through its public calls: ``submit`` (requests run on the LLM's engine
loop, batched continuously), ``cancel``, ``kv_cache_report``, ``get_stats`` and
``LLM.disaggregated``. A client that disconnects mid-stream cancels its request, which frees its
KV slots. Errors are OpenAI-style error objects.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tensorrt_llm._torch.disaggregation.params import RequestType
from tensorrt_llm._torch.pyexecutor.llm_request import FinishReason
from tensorrt_llm.llmapi.llm import LLM, GenerationRequest, RequestOutput
from tensorrt_llm.logger import logger
from tensorrt_llm.sampling_params import MAX_INT64, SamplingParams, SamplingParamsError
from tensorrt_llm.serve import guards, media
from tensorrt_llm.serve.choices import ChoiceStream, Renderer
from tensorrt_llm.serve.errors import (
    ServerError,
    error_response,
    install_error_handling,
    request_failed,
)
from tensorrt_llm.serve.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from tensorrt_llm.serve.metrics import RequestTimer, ServerMetrics
from tensorrt_llm.serve.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ErrorInfo,
    ErrorResponse,
    new_id,
    now,
)
from tensorrt_llm.serve.waits import (
    after,
    merged,
    signal_first,
    unless_disconnected,
    until_finished,
)


class OpenAIServer:
    def __init__(
        self,
        llm: LLM,
        model_name: str,
        api_key: str | None = None,
        media_options: media.MediaOptions | None = None,
    ) -> None:
        """``api_key``: when set, every path but ``/health`` needs ``Authorization: Bearer``.
        ``media_options``: where chat images may come from (``serve/media.py``)."""
        self.llm = llm
        self.media = media.MediaPool(media_options or media.MediaOptions())
        self.model_name = model_name
        self.metrics = ServerMetrics(llm)
        self.app = FastAPI(title="trtllm-serve")
        install_error_handling(self.app, api_key)
        self._routes()

    def close(self) -> None:
        """Shut the LLM down (its engine loop first)."""
        self.media.close()
        self.llm.shutdown()

    # ---- routes -------------------------------------------------------------------------------
    def _routes(self) -> None:
        app = self.app

        @app.get("/health")
        async def health():
            return guards.health_reply(self.llm)

        @app.get("/kv_cache")
        async def kv_cache():
            """KV slot counts and ``check_integrity()`` of every manager, taken between steps."""

            try:
                return await asyncio.to_thread(self.llm.kv_cache_report)
            except AssertionError as exc:
                return error_response(500, f"KV cache integrity: {exc}", "server_error")

        @app.get("/v1/models")
        async def models():
            return {
                "object": "list",
                "data": [
                    {
                        "id": self.model_name,
                        "object": "model",
                        "created": now(),
                        "owned_by": "tensorrt_llm",
                    }
                ],
            }

        @app.get("/metrics")
        async def metrics():
            text = await asyncio.to_thread(self.metrics.render)  # read between steps
            return Response(text, media_type=METRICS_CONTENT_TYPE)

        @app.post("/v1/completions")
        async def completions(body: CompletionRequest, request: Request):
            timer = self.metrics.timer()
            prompts = body.prompts()
            encode = self.llm.tokenizer.encode
            token_ids = [  # tokenized off the event loop: a long prompt stalls no other request
                p if isinstance(p, list) else await asyncio.to_thread(encode, p) for p in prompts
            ]
            return await self._serve(body, token_ids, request, timer, chat=False)

        @app.post("/v1/chat/completions")
        async def chat(body: ChatCompletionRequest, request: Request):
            timer = self.metrics.timer()
            plain = [{"role": m.role, "content": m.text()} for m in body.messages]
            guards.refuse_control_tokens(self.llm.tokenizer, plain)
            disagg = body.disaggregated_params
            known = disagg.images if disagg and disagg.has_handle else None
            prompt = media.chat_prompt(self.llm, body.messages, self.media, known)
            prompt = await unless_disconnected(prompt, request)
            if prompt is None:  # the client left while its images were fetched
                return JSONResponse({}, status_code=499)
            return await self._serve(body, [prompt], request, timer, chat=True)

    # ---- generation ---------------------------------------------------------------------------
    def _params(self, body) -> SamplingParams:
        if body.model is not None and body.model != self.model_name:
            raise ServerError(
                404,
                f"model {body.model!r} does not exist; this server serves {self.model_name!r}",
                "not_found_error",
                "model",
            )
        try:
            return SamplingParams(
                max_tokens=body.max_tokens or body.max_completion_tokens or 128,
                temperature=self.llm.generation_defaults.openai_temperature(body.temperature),
                top_p=body.top_p,
                top_k=body.top_k,
                seed=body.seed,
                stop=body.stop,
                ignore_eos=body.ignore_eos,
                logprobs=body.wanted_logprobs(),
                presence_penalty=body.presence_penalty,
                frequency_penalty=body.frequency_penalty,
                logit_bias=self._logit_bias(body.logit_bias),
            )
        except SamplingParamsError as exc:
            raise ServerError(400, str(exc), param=exc.field) from None

    def _logit_bias(self, bias: dict[int, float] | None) -> dict[int, float] | None:
        vocab = self.llm.model_config.vocab_size
        bad = [t for t in bias or {} if not 0 <= t < vocab]
        if bad:
            raise ServerError(
                400, f"token ids {bad[:5]} are not in [0, {vocab})", param="logit_bias"
            )
        return bias or None

    def _request(self, body, token_ids: list[int], params: SamplingParams) -> GenerationRequest:
        disagg = body.disaggregated_params
        if disagg is not None and not self.llm.disaggregated.enabled:
            raise ServerError(
                400,
                "this server has no cache_transceiver_config; it cannot serve disaggregated requests",
                param="disaggregated_params",
            )
        return GenerationRequest(token_ids, params, disagg)

    async def _serve(
        self, body, prompts: list[list[int]], request: Request, timer: RequestTimer, chat: bool
    ):
        """``prompts`` (one, or a completions request's list), each sampled ``body.n`` times."""
        guards.check_ranks(self.llm)
        guards.check_disagg_access(self.llm, request, body.disaggregated_params)
        if body.ignored_fields():
            logger.warning(
                "%s: ignoring unknown field(s) %s", request.url.path, body.ignored_fields()
            )
        params = self._params(body)
        await guards.check_hold_room(self.llm, body.disaggregated_params)
        jobs = self._jobs(body, prompts, params)
        param = (
            "disaggregated_params"
            if body.disaggregated_params
            else "messages"
            if chat
            else "prompt"
        )
        streams, ids = self._streams(jobs, timer, shared_prefix=body.n > 1, param=param)
        usage = _Usage(
            sum(len(p["prompt_token_ids"] if isinstance(p, dict) else p) for p in prompts)
        )
        self.metrics.requests.inc()
        self.metrics.prompt_tokens.inc(usage.prompt_tokens)
        rid = new_id("chatcmpl" if chat else "cmpl")
        renderer = Renderer(self.llm.tokenizer, chat)
        if body.stream:
            return StreamingResponse(
                self._sse(rid, streams, renderer, params, usage, body),
                media_type="text/event-stream",
            )
        lasts = await asyncio.gather(
            *(until_finished(s, request, lambda: self._cancel_all(ids)) for s in streams)
        )
        if any(last is None for last in lasts):  # the client went away: nobody to answer
            return JSONResponse({}, status_code=499)
        for last in lasts:
            out = last.outputs[0]
            if out.finish_reason is FinishReason.ERROR:
                self.metrics.errors.inc()
                raise request_failed(out.stop_reason)
        reply = {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": now(),
            "model": self.model_name,
            "choices": [renderer.whole(last, i) for i, last in enumerate(lasts)],
            "usage": usage.of(sum(len(last.outputs[0].token_ids) for last in lasts)),
        }
        if lasts[0].disaggregated_params is not None:
            reply["disaggregated_params"] = lasts[0].disaggregated_params.to_json()
        return reply

    def _jobs(self, body, prompts: list[list[int]], params: SamplingParams) -> list:
        """A ``GenerationRequest`` per choice: prompt-major, ``n`` samples each (sample i of a
        seeded request draws with ``seed + i``)."""
        if body.disaggregated_params is not None and (body.n > 1 or len(prompts) > 1):
            raise ServerError(
                400, "a disaggregated request has one prompt and n=1", param="disaggregated_params"
            )
        if params.seed is not None and params.seed + body.n - 1 > MAX_INT64:
            raise ServerError(
                400,
                f"seed={params.seed}: sample i of n={body.n} draws with seed + i, which must stay "
                f"at most {MAX_INT64}",
                param="seed",
            )
        disagg = body.disaggregated_params
        if disagg is not None and disagg.request_type is RequestType.CONTEXT_ONLY:
            body.stream = False  # a context server answers once, with the KV handle
        return [
            self._request(
                body,
                token_ids,
                params if params.seed is None else replace(params, seed=params.seed + i),
            )
            for token_ids in prompts
            for i in range(body.n)
        ]

    def _streams(
        self, jobs: list, timer: RequestTimer, shared_prefix: bool, param: str
    ) -> tuple[list, list[int]]:
        """Each job's outputs, and the ids of the requests submitted. Every job is submitted
        here (one the LLM refuses is a 400, and the ones before it are cancelled), except that
        with ``shared_prefix`` (n samples of one prompt) the others wait until the first has
        prefilled, so they reuse its prompt KV from the cache."""
        now_jobs = jobs[:1] if shared_prefix else jobs
        started = []
        try:
            for job in now_jobs:
                started.append(self._start(job))
        except (ValueError, TypeError) as exc:
            for running in started:
                self.llm.cancel(running.request_id)
            raise ServerError(400, str(exc), param=param) from None
        ids = [running.request_id for running in started]
        streams = [self._updates(running, timer.fork()) for running in started]
        if len(jobs) == len(started):
            return streams, ids
        prefilled = asyncio.Event()
        later = [after(prefilled, self._later(job, timer.fork(), ids)) for job in jobs[1:]]
        return [signal_first(streams[0], prefilled), *later], ids

    def _start(self, job: GenerationRequest) -> _Running:
        """Submit ``job``; its outputs arrive in the returned queue (from the engine's thread)."""
        loop = asyncio.get_running_loop()
        running = _Running(asyncio.Queue())

        def on_update(output: RequestOutput) -> None:  # on the engine loop's thread
            loop.call_soon_threadsafe(running.outputs.put_nowait, output)

        running.request_id = self.llm.submit(job, on_update)
        return running

    async def _later(self, job: GenerationRequest, timer: RequestTimer, ids: list[int]):
        running = self._start(job)
        ids.append(running.request_id)
        async for output in self._updates(running, timer):
            yield output

    async def _updates(
        self, running: _Running, timer: RequestTimer
    ) -> AsyncIterator[RequestOutput]:
        """A submitted request's outputs, one per step that touched it. Leaving early (a
        disconnected client, a cancelled task) cancels the request and frees its slots."""
        finished = False
        try:
            while not finished:
                output = await running.outputs.get()
                finished = output.finished
                out = output.outputs[0]
                al = out.avg_decoded_tokens_per_iter
                timer.update(len(out.token_ids), output.admitted_at, finished, al)
                yield output
        finally:
            if not finished:
                self.llm.cancel(running.request_id)

    def _cancel_all(self, request_ids: list[int]) -> None:
        for request_id in request_ids:
            self.llm.cancel(request_id)

    async def _sse(
        self,
        rid: str,
        streams: list,
        renderer: Renderer,
        params: SamplingParams,
        usage: _Usage,
        body,
    ):
        kind = "chat.completion.chunk" if renderer.chat else "text_completion"
        head = {"id": rid, "object": kind, "model": self.model_name}
        choices = [ChoiceStream(renderer, i, params.stop) for i in range(len(streams))]
        async for index, snap in merged(streams):
            if snap.outputs[0].finish_reason is FinishReason.ERROR:
                self.metrics.errors.inc()
                failed = request_failed(snap.outputs[0].stop_reason)
                error = ErrorInfo(message=failed.message, type=failed.kind, code=failed.status)
                yield f"data: {json.dumps(ErrorResponse(error=error).model_dump())}\n\n"
                break
            choice = choices[index].chunk(snap)
            if choice is not None:
                yield f"data: {json.dumps(head | {'created': now(), 'choices': [choice]})}\n\n"
        if (body.stream_options or {}).get("include_usage"):  # one last chunk: usage, no choices
            tokens = usage.of(sum(c.emitted for c in choices))
            yield f"data: {json.dumps(head | {'created': now(), 'choices': [], 'usage': tokens})}\n\n"
        yield "data: [DONE]\n\n"


@dataclass
class _Running:
    outputs: asyncio.Queue[RequestOutput]
    request_id: int = -1


@dataclass(frozen=True)
class _Usage:
    prompt_tokens: int

    def of(self, completion_tokens: int) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": self.prompt_tokens + completion_tokens,
        }
