"""The disaggregated router: context server first, then generation server, per request.

For ``/v1/completions`` and ``/v1/chat/completions`` the router sends the request to a context
server (round robin) with ``disaggregated_params: {"request_type": "context_only"}``; the reply's
``DisaggregatedParams`` carry the KV handle (JSON). It then sends the original request plus those
params, marked ``generation_only``, to a generation server (round robin), which pulls the KV over
NIXL and decodes; that reply (streamed or not) goes back to the client unchanged. A request that
ended on the context server (``finished``) is answered from there.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from pathlib import Path

import httpx
import yaml
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from tensorrt_llm import envs
from tensorrt_llm._torch.disaggregation.params import DisaggregatedParams, RequestType
from tensorrt_llm._torch.disaggregation.trust import DISAGG_AUTH_HEADER, deployment_secret
from tensorrt_llm.serve.errors import error_response, install_error_handling
from tensorrt_llm.serve.openai_protocol import ErrorInfo, ErrorResponse


def load_disagg_config(path: Path) -> dict:
    """``hostname``, ``port``, ``context_servers.urls``, ``generation_servers.urls`` from YAML."""
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"disaggregated config {str(path)!r}: {exc}") from None
    for role in ("context_servers", "generation_servers"):
        urls = (data.get(role) or {}).get("urls")
        if not urls or not all(isinstance(u, str) for u in urls):
            raise ValueError(
                f"disaggregated config {str(path)!r}: {role}.urls must list at least one host:port"
            )
    return data


def _base(url: str) -> str:
    return url if url.startswith("http") else f"http://{url}"


_HEALTH_TIMEOUT_S = 2.0
# The router drops an idle connection to a backend after this long: well before the backend closes
# it (commands/serve.SERVER_KEEP_ALIVE_S), so no request is sent on a connection being closed.
ROUTER_KEEPALIVE_S = 5.0
_FIRST_RETRY_S, _LAST_RETRY_S = 0.05, 1.0  # pauses between tries of a full context server


class DisaggRouter:
    def __init__(
        self,
        context_urls: list[str],
        generation_urls: list[str],
        timeout_s: float = 600.0,
        keepalive_s: float = ROUTER_KEEPALIVE_S,
        context_wait_s: float = 120.0,
    ) -> None:
        """``context_wait_s``: how long a request waits while every context server is full
        (429) before the client gets that 429."""
        self.context_urls = [_base(u) for u in context_urls]
        self.generation_urls = [_base(u) for u in generation_urls]
        self._ctx = itertools.cycle(self.context_urls)
        self._gen = itertools.cycle(self.generation_urls)
        # the servers take disaggregated_params only with the deployment's secret (trust.py)
        auth = {DISAGG_AUTH_HEADER: deployment_secret().decode()}
        self.client = httpx.AsyncClient(
            timeout=timeout_s, headers=auth, limits=httpx.Limits(keepalive_expiry=keepalive_s)
        )
        self.context_wait_s = context_wait_s
        self.counters = {
            "requests": 0,
            "errors": 0,
            "backend_failures": 0,
            "cut_streams": 0,
            "context_retries": 0,
        }
        self.app = FastAPI(title="trtllm-serve disaggregated")
        install_error_handling(self.app, envs.TRTLLM_API_KEY.get() or None)
        self._routes()

    def _routes(self) -> None:
        app = self.app

        @app.get("/health")
        async def health():
            """Ok only while every context and generation server answers its own ``/health``."""
            down = [
                url for url in self.context_urls + self.generation_urls if not await self._up(url)
            ]
            body = {
                "status": "ok" if not down else "degraded",
                "context_servers": self.context_urls,
                "generation_servers": self.generation_urls,
                "unreachable": down,
            }
            return JSONResponse(body, status_code=200 if not down else 503)

        @app.get("/metrics")
        async def metrics():
            lines = []
            for name, value in self.counters.items():
                lines += [f"# TYPE trtllm_router_{name} counter", f"trtllm_router_{name} {value}"]
            return PlainTextResponse(
                "\n".join(lines) + "\n", media_type="text/plain; version=0.0.4"
            )

        @app.get("/v1/models")
        async def models():
            try:
                reply = await self.client.get(self.generation_urls[0] + "/v1/models")
                return JSONResponse(reply.json(), status_code=reply.status_code)
            except (httpx.HTTPError, ValueError) as exc:
                return self._failure(f"generation server unreachable: {exc}")

        @app.post("/v1/completions")
        async def completions(request: Request):
            return await self._route("/v1/completions", request)

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            return await self._route("/v1/chat/completions", request)

    async def _up(self, url: str) -> bool:
        try:
            reply = await self.client.get(url + "/health", timeout=_HEALTH_TIMEOUT_S)
            return reply.status_code == 200
        except httpx.HTTPError:
            return False

    def _failure(self, message: str) -> JSONResponse:
        self.counters["backend_failures"] += 1
        return error_response(502, message, "server_error")

    async def _route(self, path: str, request: Request):
        self.counters["requests"] += 1
        try:
            body = await request.json()
        except (ValueError, RecursionError):
            body = None
        if not isinstance(body, dict):
            self.counters["errors"] += 1
            return error_response(
                400, "the request body must be a JSON object", "invalid_request_error"
            )
        forward = {k: v for k, v in request.headers.items() if k == "authorization"}
        handed_over = await self._context_phase(path, body, forward)
        if not isinstance(handed_over, DisaggregatedParams):
            return handed_over  # the context server's answer (it finished there, or an error)
        gen_body = {**body, "disaggregated_params": handed_over.to_json()}
        gen_url = next(self._gen) + path
        if not body.get("stream"):
            try:
                reply = await self.client.post(gen_url, json=gen_body, headers=forward)
                return JSONResponse(reply.json(), status_code=reply.status_code)
            except (httpx.HTTPError, ValueError) as exc:
                return self._failure(f"generation server {gen_url}: {exc}")
        return await self._stream(gen_url, gen_body, forward)

    async def _stream(self, url: str, body: dict, headers: dict[str, str]):
        """The generation server's stream; its refusal (an error status, before any event) is
        answered as that status and error, not as a stream."""
        try:
            reply = await self.client.send(
                self.client.build_request("POST", url, json=body, headers=headers), stream=True
            )
        except httpx.HTTPError as exc:
            return self._failure(f"generation server {url}: {exc}")
        if reply.status_code != 200:
            try:
                content = await reply.aread()
                return JSONResponse(json.loads(content), status_code=reply.status_code)
            except (httpx.HTTPError, ValueError) as exc:
                return self._failure(f"generation server {url}: HTTP {reply.status_code}: {exc}")
            finally:
                await reply.aclose()
        return StreamingResponse(self._relay(url, reply), media_type="text/event-stream")

    async def _relay(self, url: str, reply: httpx.Response):
        """The generation server's events as they come; if it fails or goes away mid-stream, an
        OpenAI error event and ``[DONE]``, so the client sees an end and a reason. A client that
        leaves closes the generation server's stream, which cancels the request there."""
        try:
            async for chunk in reply.aiter_raw():
                yield chunk
        except httpx.HTTPError as exc:
            self.counters["cut_streams"] += 1
            error = ErrorResponse(
                error=ErrorInfo(
                    message=f"generation server {url} failed mid-stream: {exc}",
                    type="server_error",
                    code=502,
                )
            )
            yield f"\n\ndata: {json.dumps(error.model_dump())}\n\ndata: [DONE]\n\n".encode()
        finally:
            await reply.aclose()

    async def _context_phase(
        self, path: str, body: dict, headers: dict[str, str]
    ) -> DisaggregatedParams | JSONResponse:
        """Prefill on a context server; returns the ``generation_only`` params to send on, or
        the reply to give the client when there is nothing to hand over."""
        ask = DisaggregatedParams(request_type=RequestType.CONTEXT_ONLY)
        ctx_body = {**body, "stream": False, "disaggregated_params": ask.to_json()}
        try:
            ctx_reply = await self._prefill(path, ctx_body, headers)
            result = ctx_reply.json()
        except (httpx.HTTPError, ValueError) as exc:
            return self._failure(f"context server: {exc}")
        if not isinstance(result, dict):
            return self._failure("context server: its reply is not a JSON object")
        if ctx_reply.status_code != 200:
            return JSONResponse(result, status_code=ctx_reply.status_code)
        raw = result.pop("disaggregated_params", None)
        try:
            params = None if raw is None else DisaggregatedParams.model_validate(raw)
            if params is None or params.request_type is RequestType.FINISHED:
                # it ended on the context server (the end token at once, or max_tokens 1)
                if body.get("stream"):
                    return StreamingResponse(_as_events(result), media_type="text/event-stream")
                return JSONResponse(result)
            return params.for_generation()
        except ValueError as exc:
            return error_response(
                502, f"the context server's disaggregated_params: {exc}", "server_error"
            )

    async def _prefill(self, path: str, body: dict, headers: dict[str, str]) -> httpx.Response:
        """The context servers' reply, waiting (up to ``context_wait_s``) while they answer 429:
        each holds KV for the generation servers' pulls, and those wait for room to decode, so a
        full context server is back pressure to wait on, not an error for the client."""
        deadline = time.monotonic() + self.context_wait_s
        pause = _FIRST_RETRY_S
        while True:
            reply = await self.client.post(next(self._ctx) + path, json=body, headers=headers)
            if reply.status_code != 429 or time.monotonic() + pause > deadline:
                return reply
            self.counters["context_retries"] += 1
            await asyncio.sleep(pause)
            pause = min(2 * pause, _LAST_RETRY_S)


def _as_events(completion: dict):
    """A whole (chat) completion as the stream a client asked for: one chunk, then ``[DONE]``."""
    chunk = {**completion, "choices": []}
    chunk.pop("usage", None)
    for choice in completion.get("choices", []):
        choice = dict(choice)
        if completion.get("object") == "chat.completion":
            choice["delta"] = choice.pop("message", {})
        chunk["choices"].append(choice)
    if completion.get("object") == "chat.completion":
        chunk["object"] = "chat.completion.chunk"
    yield f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode()
