"""An OpenAI-compatible HTTP server over an ``LLM``: /v1/models, /v1/completions,
/v1/chat/completions (streaming SSE or not), /health and /metrics (Prometheus text).

Requests are batched continuously by an ``EngineLoop``. A client that disconnects mid-stream
cancels its request, which frees its KV slots. Errors are OpenAI-style error objects.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

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
from tensorrt_llm.serve.errors import ServerError, error_response, install_error_handling
from tensorrt_llm.serve.logprobs import chat_logprobs, completion_logprobs
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


@dataclass
class Snapshot:
    token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None
    stop_reason: int | str | None
    text_limit: int | None
    avg_decoded_tokens_per_iter: float | None
    disaggregated_params: DisaggregatedParams | None = None
    admitted_at: float | None = None  # time.monotonic() when the scheduler granted its KV
    logprobs: list | None = None  # LlmRequest.py_logprobs, when asked for


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
        self.engine.shutdown()

    # ---- routes -------------------------------------------------------------------------------
    def _routes(self) -> None:
        app = self.app

        @app.get("/health")
        async def health():
            return {"status": "ok"}

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
                report["held_for_transfer"] = len(self.llm.executor.held_for_transfer)
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
            prompt = body.prompt
            token_ids = (  # tokenized off the event loop: a long prompt stalls no other request
                prompt
                if isinstance(prompt, list)
                else await asyncio.to_thread(self.llm.tokenizer.encode, prompt)
            )
            return await self._serve(body, token_ids, request, timer, chat=False)

        @app.post("/v1/chat/completions")
        async def chat(body: ChatCompletionRequest, request: Request):
            timer = self.metrics.timer()
            messages = [m.model_dump() for m in body.messages]
            guards.refuse_control_tokens(self.llm.tokenizer, messages)
            tokenizer = self.llm.tokenizer
            token_ids = await asyncio.to_thread(
                lambda: tokenizer.encode(tokenizer.apply_chat_template(messages))
            )
            return await self._serve(body, token_ids, request, timer, chat=True)

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
                temperature=1.0 if body.temperature is None else body.temperature,
                top_p=body.top_p,
                top_k=body.top_k,
                seed=body.seed,
                stop=body.stop,
                ignore_eos=body.ignore_eos,
                logprobs=body.wanted_logprobs(),
            )
        except ValueError as exc:
            raise ServerError(400, str(exc)) from None

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
        self, body, token_ids: list[int], request: Request, timer: RequestTimer, chat: bool
    ):
        guards.check_disagg_access(self.llm, request, body.disaggregated_params)
        if body.ignored_fields():
            logger.warning(
                "%s: ignoring unknown field(s) %s", request.url.path, body.ignored_fields()
            )
        params = self._params(body)
        await guards.check_hold_room(self.llm, self.engine, body.disaggregated_params)
        try:
            llm_request, load_kv = self._llm_request(body, token_ids, params)
        except (ValueError, TypeError) as exc:
            param = "messages" if chat else "prompt"
            if body.disaggregated_params is not None:
                param = "disaggregated_params"
            raise ServerError(400, str(exc), param=param) from None
        token_ids = llm_request.prompt_token_ids
        self.metrics.requests.inc()
        self.metrics.prompt_tokens.inc(len(token_ids))
        rid = new_id("chatcmpl" if chat else "cmpl")
        updates = self._run(llm_request, request, load_kv, timer)
        if body.stream:
            return StreamingResponse(
                self._sse(rid, updates, params, chat, len(token_ids), body),
                media_type="text/event-stream",
            )
        last = await self._until_finished(updates, request, llm_request.request_id)
        if last is None:  # the client went away: its request was cancelled, nobody to answer
            return JSONResponse({}, status_code=499)
        if last.finish_reason is FinishReason.ERROR:
            self.metrics.errors.inc()
            refused = isinstance(last.stop_reason, str)  # admission refused it (a ValueError)
            raise ServerError(
                400 if refused else 500,
                str(last.stop_reason or "generation failed"),
                "invalid_request_error" if refused else "server_error",
            )
        text = self._text(last)
        choice = {
            "index": 0,
            "finish_reason": last.finish_reason,
            "avg_decoded_tokens_per_iter": last.avg_decoded_tokens_per_iter,
        }
        choice.update(
            {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
        )
        if last.logprobs is not None:
            choice["logprobs"] = self._logprobs(last, 0, chat)
        usage = {
            "prompt_tokens": len(token_ids),
            "completion_tokens": len(last.token_ids),
            "total_tokens": len(token_ids) + len(last.token_ids),
        }
        kind = "chat.completion" if chat else "text_completion"
        reply = {
            "id": rid,
            "object": kind,
            "created": now(),
            "model": self.model_name,
            "choices": [choice],
            "usage": usage,
        }
        if last.disaggregated_params is not None:
            reply["disaggregated_params"] = last.disaggregated_params.to_json()
        return reply

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

    @staticmethod
    def _visible(snap: Snapshot) -> list[int]:
        """The output tokens the text shows (an end token that stopped it is not shown)."""
        tokens = snap.token_ids
        if snap.finish_reason is FinishReason.STOP and isinstance(snap.stop_reason, int):
            tokens = tokens[:-1]
        return tokens

    def _text(self, snap: Snapshot) -> str:
        text = self.llm.tokenizer.decode(self._visible(snap))
        return text if snap.text_limit is None else text[: snap.text_limit]

    def _logprobs(self, snap: Snapshot, start: int, chat: bool) -> dict:
        """The logprobs of the visible tokens from ``start`` on."""
        tokens = self._visible(snap)[start:]
        values = snap.logprobs[start : start + len(tokens)]
        if chat:
            return chat_logprobs(self.llm.tokenizer, tokens, values)
        offset = len(self.llm.tokenizer.decode(self._visible(snap)[:start]))
        return completion_logprobs(self.llm.tokenizer, tokens, values, offset)

    async def _sse(
        self,
        rid: str,
        updates: AsyncIterator[Snapshot],
        params: SamplingParams,
        chat: bool,
        num_prompt: int,
        body,
    ):
        kind = "chat.completion.chunk" if chat else "text_completion"
        hold = (
            max((len(s) for s in params.stop or []), default=1) - 1
        )  # a stop string may still complete
        sent, first, emitted, logprobs_sent = "", True, 0, 0
        async for snap in updates:
            emitted = len(snap.token_ids)
            if snap.finish_reason is FinishReason.ERROR:
                self.metrics.errors.inc()
                yield f"data: {json.dumps(ErrorResponse(error=ErrorInfo(message=str(snap.stop_reason), type='server_error', code=500)).model_dump())}\n\n"
                break
            text = self._text(snap)
            visible = text if snap.finished else text[: max(len(sent), len(text) - hold)]
            delta, sent = visible[len(sent) :], visible
            if not delta and not snap.finished and not first:
                continue
            choice = {"index": 0, "finish_reason": snap.finish_reason if snap.finished else None}
            if chat:
                choice["delta"] = ({"role": "assistant"} if first else {}) | (
                    {"content": delta} if delta or not first else {}
                )
            else:
                choice["text"] = delta
            if snap.logprobs is not None:  # those of the tokens not sent yet
                choice["logprobs"] = self._logprobs(snap, logprobs_sent, chat)
                logprobs_sent = len(self._visible(snap))
            if snap.finished:
                choice["avg_decoded_tokens_per_iter"] = snap.avg_decoded_tokens_per_iter
            first = False
            yield f"data: {json.dumps({'id': rid, 'object': kind, 'created': now(), 'model': self.model_name, 'choices': [choice]})}\n\n"
        if (body.stream_options or {}).get("include_usage"):  # one last chunk: usage, no choices
            usage = {
                "prompt_tokens": num_prompt,
                "completion_tokens": emitted,
                "total_tokens": num_prompt + emitted,
            }
            chunk = {"id": rid, "object": kind, "created": now(), "model": self.model_name}
            yield f"data: {json.dumps(chunk | {'choices': [], 'usage': usage})}\n\n"
        yield "data: [DONE]\n\n"
