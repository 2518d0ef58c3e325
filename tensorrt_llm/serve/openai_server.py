"""An OpenAI-compatible HTTP server over an ``LLM``: /v1/models, /v1/completions,
/v1/chat/completions (streaming SSE or not), /health and /metrics (Prometheus text).

It drives the ``LLM`` only through its public calls: ``submit`` (requests run on the LLM's engine
loop, batched continuously), ``cancel``, ``kv_cache_report``, ``get_stats`` and
``LLM.disaggregated``. A client that disconnects mid-stream cancels its request, which frees its
KV slots. Errors are OpenAI-style error objects.
"""

from __future__ import annotations

import asyncio
import contextlib
import traceback
from dataclasses import dataclass, replace

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from tensorrt_llm._torch.disaggregation.params import RequestType
from tensorrt_llm._torch.pyexecutor.llm_request import FinishReason
from tensorrt_llm.llmapi.llm import LLM, GenerationRequest
from tensorrt_llm.logger import logger
from tensorrt_llm.sampling_params import MAX_INT64, SamplingParams, SamplingParamsError
from tensorrt_llm.serve import guards, media
from tensorrt_llm.serve.chat_protocol import ChatProtocol
from tensorrt_llm.serve.choices import ChoiceStream, Renderer
from tensorrt_llm.serve.errors import (
    ServerError,
    error_response,
    install_error_handling,
    request_failed,
)
from tensorrt_llm.serve.grammar_gate import GrammarGate
from tensorrt_llm.serve.memory import MemoryReturn
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
from tensorrt_llm.serve.submission import Submission
from tensorrt_llm.serve.waits import (
    EndingStream,
    Last,
    merged,
    unless_disconnected,
    until_finished,
)
from tensorrt_llm.serve.warm_up import warm_up_front

_encode_json = msgspec.json.Encoder().encode  # (compact JSON, UTF-8 as is)
_BODY_NAMES = {"bad": "bad_words"}  # SamplingParams' fields the request body names as vLLM does


class OpenAIServer:
    def __init__(
        self,
        llm: LLM,
        model_name: str,
        api_key: str | None = None,
        media_options: media.MediaOptions | None = None,
        limits: guards.ServeLimits | None = None,
        reasoning_parser: str | None = None,
        tool_parser: str | None = None,
    ) -> None:
        """``api_key``: when set, every path but ``/health`` needs ``Authorization: Bearer``.
        ``media_options``: where chat images may come from (``serve/media.py``). ``limits``: how
        much work one request may ask for. ``reasoning_parser``: the name of the parser that
        splits a chat reply's reasoning from its content (``reasoning_parser.py``);
        ``tool_parser``: of the one that reads its tool calls (``tool_parser/``)."""
        self.protocol = ChatProtocol(
            llm.tokenizer, reasoning_parser, tool_parser, llm.args.guided_decoding_backend
        )
        self.grammars = GrammarGate(llm.compile_guide)  # (beside the event loop)
        self.limits = limits or guards.ServeLimits()
        self.llm = llm
        self.media = media.MediaPool(media_options or media.MediaOptions())
        self.model_name = model_name
        self.metrics = ServerMetrics(llm)
        self.memory = MemoryReturn()  # what large requests took goes back to the system

        @contextlib.asynccontextmanager
        async def lifespan(app: FastAPI):
            await warm_up_front(self.llm, self.media)  # (before /health answers)
            async with self.memory.watching():
                yield

        self.app = FastAPI(title="trtllm-serve", lifespan=lifespan)
        install_error_handling(self.app, api_key)
        self._routes()

    def close(self) -> None:
        """Shut the LLM down (its engine loop first)."""
        self.media.close()
        self.grammars.close()
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
            guards.check_ranks(self.llm)  # (a 503 at once while the engine core is lost)
            try:  # (a core lost while it waited for the report: a 503, errors.py)
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
            names = (
                ["prompt"]
                if isinstance(body.prompt, str)
                else [f"prompt.{i}" for i in range(len(prompts))]
            )
            texts = [(name, p) for name, p in zip(names, prompts) if isinstance(p, str)]
            guards.check_text_fits(self.llm, texts)
            encode = self.llm.tokenizer.encode  # (it leaves the GIL while it works)
            token_ids = [  # a long prompt tokenized off the event loop: it stalls no other request
                p
                if isinstance(p, list)
                else encode(p)
                if len(p) <= media.INLINE_TEXT_CHARS
                else await asyncio.to_thread(encode, p)
                for p in prompts
            ]
            return await self._serve(body, token_ids, request, timer, chat=False)

        @app.post("/v1/chat/completions")
        async def chat(body: ChatCompletionRequest, request: Request):
            timer = self.metrics.timer()
            variables = guards.check_chat(self.llm, body)
            disagg = body.disaggregated_params
            known = disagg.images if disagg and disagg.has_handle else None
            prompt = media.short_chat_prompt(self.llm, body.messages, variables)
            if prompt is None:
                prompt = media.chat_prompt(self.llm, body.messages, self.media, known, variables)
                prompt = await unless_disconnected(prompt, request)
            if prompt is None:  # the client left while its images were fetched
                return JSONResponse({}, status_code=499)
            return await self._serve(body, [prompt], request, timer, chat=True)

    # ---- generation ---------------------------------------------------------------------------
    def _params(self, body, prompt_lengths: list[int]) -> SamplingParams:
        if body.model is not None and body.model != self.model_name:
            raise ServerError(
                404,
                f"model {body.model!r} does not exist; this server serves {self.model_name!r}",
                "not_found_error",
                "model",
            )
        max_tokens = self.limits.max_tokens(self.llm, body, prompt_lengths)
        try:
            params = SamplingParams(
                max_tokens=max_tokens,
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
                stop_token_ids=body.stop_token_ids or [],
                allowed_token_ids=body.allowed_token_ids,
                bad=body.bad_words or None,
            )
            vocab = self.llm.model_config.vocab_size
            params.check_vocab(vocab)
            params.bad_word_ids(self.llm.tokenizer.encode, vocab)  # (a word too long: named here)
            return params
        except SamplingParamsError as exc:
            field = _BODY_NAMES.get(exc.field, exc.field)
            message = str(exc) if field == exc.field else f"{field}: {exc}"
            raise ServerError(400, message, param=field) from None

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
        lengths = [len(p["prompt_token_ids"] if isinstance(p, dict) else p) for p in prompts]
        params = self._params(body, lengths)  # (a bad field: a 400 before any grammar)
        if self.protocol.constrains(body, chat):
            guide = await self.grammars.build(
                lambda: self.protocol.guide(body, prompts[0], chat),
                lambda: self.protocol.field(body, chat),
            )
            params = replace(params, guided_decoding=guide)
        await guards.check_hold_room(self.llm, body.disaggregated_params)
        jobs = self._jobs(body, prompts, params)
        param = (
            "disaggregated_params"
            if body.disaggregated_params
            else "messages"
            if chat
            else "prompt"
        )
        submission = Submission(
            self.llm, jobs, timer, body.n > 1, self.limits.max_running(self.llm), param
        )
        streams = submission.streams
        usage = _Usage(sum(lengths))
        self.metrics.requests.inc()
        self.metrics.prompt_tokens.inc(usage.prompt_tokens)
        rid = new_id("chatcmpl" if chat else "cmpl")
        parsing = self.protocol.parsing(body, prompts[0]) if chat else None
        renderer = Renderer(self.llm.tokenizer, chat, parsing)
        if body.stream:
            return EndingStream(
                self._sse(rid, streams, renderer, params, usage, body), submission.cancel
            )
        lasts = await asyncio.gather(
            *(until_finished(s, request, submission.cancel) for s in streams)
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
            "usage": usage.of(sum(last.outputs[0].num_tokens for last in lasts)),
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

    async def _sse(
        self,
        rid: str,
        streams: list,
        renderer: Renderer,
        params: SamplingParams,
        usage: _Usage,
        body,
    ):
        """The reply's events: a chunk per step that moved a choice; the last choice's last
        chunk, the usage chunk and ``[DONE]`` go out together with the response's end, in one
        write."""
        kind = "chat.completion.chunk" if renderer.chat else "text_completion"
        head = {"id": rid, "object": kind, "model": self.model_name}
        choices = [ChoiceStream(renderer, i, params.stop) for i in range(len(streams))]
        tail, open_ = b"", len(streams)
        try:
            async for index, snap in merged(streams):
                if snap.outputs[0].finish_reason is FinishReason.ERROR:
                    yield _error_event(self, request_failed(snap.outputs[0].stop_reason))
                    break
                choice = choices[index].chunk(snap)
                open_ -= snap.finished
                if choice is not None:
                    event = _event(head | {"created": now(), "choices": [choice]})
                    if open_:
                        yield event
                    else:
                        tail = event  # (the last: with the end)
        except Exception as exc:  # anything unforeseen ends the stream with an error object
            logger.error("a stream failed:\n%s", traceback.format_exc())
            message = f"the server failed this stream ({type(exc).__name__}); it is logged"
            yield _error_event(self, ServerError(500, message, "server_error"))
        if (body.stream_options or {}).get("include_usage"):  # one last chunk: usage, no choices
            tokens = usage.of(sum(c.emitted for c in choices))
            tail += _event(head | {"created": now(), "choices": [], "usage": tokens})
        yield Last(tail + b"data: [DONE]\n\n")


def _event(payload: dict) -> bytes:
    return b"data: " + _encode_json(payload) + b"\n\n"


def _error_event(server: OpenAIServer, failed: ServerError) -> bytes:
    server.metrics.errors.inc()
    error = ErrorInfo(message=failed.message, type=failed.kind, code=failed.status)
    return _event(ErrorResponse(error=error).model_dump())


@dataclass(frozen=True)
class _Usage:
    prompt_tokens: int

    def of(self, completion_tokens: int) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": self.prompt_tokens + completion_tokens,
        }
