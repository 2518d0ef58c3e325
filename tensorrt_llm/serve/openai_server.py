"""An OpenAI-compatible HTTP server over an ``LLM``: /v1/models, /v1/completions,
/v1/chat/completions (streaming SSE or not), /health and /metrics (Prometheus text).

Requests are batched continuously by an ``EngineLoop``. A client that disconnects mid-stream
cancels its request, which frees its KV slots. Errors are OpenAI-style error objects.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tensorrt_llm._torch.disaggregation.generation_only import PromptKvPull
from tensorrt_llm._torch.disaggregation.params import DisaggregatedParams, RequestType
from tensorrt_llm._torch.pyexecutor.llm_request import FinishReason, LlmRequest
from tensorrt_llm.llmapi.engine_loop import EngineLoop
from tensorrt_llm.llmapi.llm import LLM
from tensorrt_llm.logger import logger
from tensorrt_llm.sampling_params import SamplingParams
from tensorrt_llm.serve import guards
from tensorrt_llm.serve.choices import ChoiceStream, Renderer, Snapshot, merged
from tensorrt_llm.serve.errors import ServerError, error_response, install_error_handling
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

DISCONNECT_POLL_S = 0.25  # how often a non-streamed request checks that its client is still there


class OpenAIServer:
    def __init__(self, llm: LLM, model_name: str, api_key: str | None = None) -> None:
        """``api_key``: when set, every path but ``/health`` needs ``Authorization: Bearer``."""
        self.llm = llm
        self.model_name = model_name
        self.engine = EngineLoop(
            llm.executor, llm.release_pulled if llm.transceiver is not None else None
        )
        self.metrics = ServerMetrics(llm)
        self.app = FastAPI(title="trtllm-serve")
        install_error_handling(self.app, api_key)
        self._routes()

    def shutdown(self) -> None:
        """Stop the engine loop (the LLM stays usable)."""
        self.engine.shutdown()

    def close(self) -> None:
        """Stop the engine loop, then the LLM: the loop's thread is the one that talks to the
        LLM's other ranks, so it stops first."""
        self.shutdown()
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

            def inspect():
                managers = self.llm.executor.resource_manager.resource_managers
                report = {}
                for kind, manager in managers.items():
                    manager.check_integrity()
                    stats = manager.get_kv_cache_stats()
                    report[kind.value] = {
                        "free": stats.num_free_slots,
                        "used": stats.num_used_slots,
                        "cached": stats.num_cached_slots,
                        "live_requests": len(manager.impl.live_caches),
                    }
                report["held_for_transfer"] = len(self.llm.executor.disagg.held)
                report["active_requests"] = len(self.llm.executor.active)
                return report

            try:
                return await asyncio.wrap_future(self.engine.call(inspect))
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
            return Response(self.metrics.render(), media_type=METRICS_CONTENT_TYPE)

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
            messages = [m.model_dump() for m in body.messages]
            guards.refuse_control_tokens(self.llm.tokenizer, messages)
            tokenizer = self.llm.tokenizer
            try:  # the checkpoint's template may refuse a conversation (raise_exception)
                token_ids = await asyncio.to_thread(
                    lambda: tokenizer.encode(tokenizer.apply_chat_template(messages))
                )
            except ValueError as exc:
                raise ServerError(400, str(exc), param="messages") from None
            return await self._serve(body, [token_ids], request, timer, chat=True)

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
        except ValueError as exc:
            raise ServerError(400, str(exc)) from None

    def _logit_bias(self, bias: dict[int, float] | None) -> dict[int, float] | None:
        vocab = self.llm.model_config.vocab_size
        bad = [t for t in bias or {} if not 0 <= t < vocab]
        if bad:
            raise ServerError(
                400, f"token ids {bad[:5]} are not in [0, {vocab})", param="logit_bias"
            )
        return bias or None

    def _llm_request(
        self, body, token_ids: list[int], params: SamplingParams
    ) -> tuple[LlmRequest, PromptKvPull | None]:
        """The request to run, and for a ``generation_only`` one the ``load_kv`` of its prompt."""
        disagg: DisaggregatedParams | None = body.disaggregated_params
        if disagg is None:
            return self.llm._make_request(token_ids, params)[0], None
        if self.llm.transceiver is None:
            raise ServerError(
                400,
                "this server has no cache_transceiver_config; it cannot serve disaggregated requests",
                param="disaggregated_params",
            )
        if disagg.request_type is RequestType.GENERATION_ONLY:
            if disagg.prompt_token_ids != token_ids:
                raise ValueError(
                    "the request's prompt is not the one the context server prefilled "
                    "(disaggregated_params.prompt_token_ids)"
                )
            return self.llm.generation_only_request(disagg, params)
        if disagg.request_type is not RequestType.CONTEXT_ONLY:
            raise ValueError(
                f"disaggregated_params.request_type={disagg.request_type.value!r}: a server takes "
                "'context_only' or 'generation_only'"
            )
        llm_request, _ = self.llm._make_request(token_ids, params)
        llm_request.context_only = True
        body.stream = False  # a context server answers once, with the KV handle
        return llm_request, None

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
        await guards.check_hold_room(self.llm, self.engine, body.disaggregated_params)
        jobs = self._jobs(body, prompts, params, chat)
        usage = _Usage(sum(len(p) for p in prompts))
        self.metrics.requests.inc()
        self.metrics.prompt_tokens.inc(usage.prompt_tokens)
        rid = new_id("chatcmpl" if chat else "cmpl")
        streams = self._streams(jobs, request, timer, shared_prefix=body.n > 1)
        renderer = Renderer(self.llm.tokenizer, chat)
        if body.stream:
            return StreamingResponse(
                self._sse(rid, streams, renderer, params, usage, body),
                media_type="text/event-stream",
            )
        lasts = await asyncio.gather(
            *(
                self._until_finished(s, request, req.request_id)
                for s, (req, _) in zip(streams, jobs)
            )
        )
        if any(last is None for last in lasts):  # the client went away: nobody to answer
            return JSONResponse({}, status_code=499)
        for last in lasts:
            if last.finish_reason is FinishReason.ERROR:
                self.metrics.errors.inc()
                refused = isinstance(last.stop_reason, str)  # admission refused it (a ValueError)
                raise ServerError(
                    400 if refused else 500,
                    str(last.stop_reason or "generation failed"),
                    "invalid_request_error" if refused else "server_error",
                )
        reply = {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": now(),
            "model": self.model_name,
            "choices": [renderer.whole(last, i) for i, last in enumerate(lasts)],
            "usage": usage.of(sum(len(last.token_ids) for last in lasts)),
        }
        if lasts[0].disaggregated_params is not None:
            reply["disaggregated_params"] = lasts[0].disaggregated_params.to_json()
        return reply

    def _jobs(self, body, prompts: list[list[int]], params: SamplingParams, chat: bool) -> list:
        """``(LlmRequest, load_kv)`` per choice: prompt-major, ``n`` samples each (sample i of a
        seeded request draws with ``seed + i``)."""
        if body.disaggregated_params is not None and (body.n > 1 or len(prompts) > 1):
            raise ServerError(
                400, "a disaggregated request has one prompt and n=1", param="disaggregated_params"
            )
        jobs = []
        for token_ids in prompts:
            for i in range(body.n):
                sample = params if params.seed is None else replace(params, seed=params.seed + i)
                try:
                    jobs.append(self._llm_request(body, token_ids, sample))
                except (ValueError, TypeError) as exc:
                    param = "messages" if chat else "prompt"
                    if body.disaggregated_params is not None:
                        param = "disaggregated_params"
                    raise ServerError(400, str(exc), param=param) from None
        return jobs

    def _streams(self, jobs, request: Request, timer: RequestTimer, shared_prefix: bool) -> list:
        """Each job's snapshots. With ``shared_prefix`` (n samples of one prompt) the others are
        submitted once the first has prefilled, so they reuse its prompt KV from the cache."""
        streams = [self._run(req, request, kv, timer.fork()) for req, kv in jobs]
        if not shared_prefix or len(streams) < 2:
            return streams
        prefilled = asyncio.Event()
        return [_signal_first(streams[0], prefilled)] + [_after(prefilled, s) for s in streams[1:]]

    async def _run(
        self, llm_request: LlmRequest, request: Request, load_kv, timer: RequestTimer
    ) -> AsyncIterator[Snapshot]:
        """Submit, then yield a snapshot after every step that touched the request. Leaving early
        (a disconnected client, a cancelled task) cancels the request and frees its slots."""
        loop = asyncio.get_running_loop()
        updates: asyncio.Queue[Snapshot] = asyncio.Queue()

        def on_update(req: LlmRequest, finished: bool) -> None:  # on the engine thread
            result = self.llm.context_result(req) if finished and req.context_only else None
            snap = Snapshot(
                list(req.output_token_ids),
                finished,
                req.finish_reason,
                req.stop_reason,
                req.text_limit,
                req.avg_decoded_tokens_per_iter,
                result,
                req.admitted_at,
                list(req.py_logprobs) if req.sampling_params.logprobs is not None else None,
            )
            loop.call_soon_threadsafe(updates.put_nowait, snap)

        if load_kv is None:
            self.engine.submit(llm_request, on_update)
        else:
            self.engine.submit_generation_only(llm_request, load_kv, on_update)
        finished = False
        try:
            while not finished:
                snap = await updates.get()
                finished = snap.finished
                al = snap.avg_decoded_tokens_per_iter
                timer.update(len(snap.token_ids), snap.admitted_at, finished, al)
                yield snap
        finally:
            if not finished:
                self.engine.cancel(llm_request.request_id)

    async def _until_finished(
        self, updates: AsyncIterator[Snapshot], request: Request, request_id: int
    ) -> Snapshot | None:
        """The last snapshot of a non-streamed request, or None if its client disconnected first
        (then the request is cancelled and its KV freed at once, not when it would have ended)."""

        async def last() -> Snapshot:
            final = None
            async for snap in updates:
                final = snap
            return final

        task = asyncio.ensure_future(last())
        while not task.done():
            await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if not task.done() and await request.is_disconnected():
                task.cancel()
                self.engine.cancel(request_id)
                return None
        return task.result()

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
            if snap.finish_reason is FinishReason.ERROR:
                self.metrics.errors.inc()
                error = ErrorInfo(message=str(snap.stop_reason), type="server_error", code=500)
                yield f"data: {json.dumps(ErrorResponse(error=error).model_dump())}\n\n"
                break
            choice = choices[index].chunk(snap)
            if choice is not None:
                yield f"data: {json.dumps(head | {'created': now(), 'choices': [choice]})}\n\n"
        if (body.stream_options or {}).get("include_usage"):  # one last chunk: usage, no choices
            tokens = usage.of(sum(c.emitted for c in choices))
            yield f"data: {json.dumps(head | {'created': now(), 'choices': [], 'usage': tokens})}\n\n"
        yield "data: [DONE]\n\n"


@dataclass(frozen=True)
class _Usage:
    prompt_tokens: int

    def of(self, completion_tokens: int) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": self.prompt_tokens + completion_tokens,
        }


async def _signal_first(stream, event: asyncio.Event):
    """``stream``, setting ``event`` at its first snapshot (its prompt is prefilled) or its end."""
    try:
        async for snap in stream:
            event.set()
            yield snap
    finally:
        event.set()


async def _after(event: asyncio.Event, stream):
    """``stream``, started (so its request submitted) only once ``event`` is set."""
    await event.wait()
    async for snap in stream:
        yield snap
