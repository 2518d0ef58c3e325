"""The disaggregated router: context server first, then generation server, per request.

For ``/v1/completions`` and ``/v1/chat/completions`` the router sends the request to a context
server (round robin over those up) with ``disaggregated_params: {"request_type":
"context_only"}``; the reply's ``DisaggregatedParams`` carry the KV handle (JSON). It then sends
the original request plus those params, marked ``generation_only``, to a generation server (round
robin over those up), which pulls the KV over NIXL and decodes; that reply (streamed or not) goes
back to the client unchanged, except that a server error's message names the servers it came
from. A request that ended on the context server (``finished``) is answered from there.

Servers that fail their health checks are left out (``backends.py``): a context server that
cannot be reached, or freezes while the router waits on it, is left for the next one up, and with
none up the client gets a 503 at once.
"""

from __future__ import annotations

import asyncio
import contextlib
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
from tensorrt_llm.serve.backends import Backends, ServerDown, watching
from tensorrt_llm.serve.errors import error_response, install_error_handling
from tensorrt_llm.serve.openai_protocol import ErrorInfo, ErrorResponse
from tensorrt_llm.serve.waits import EndingStream


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
CONNECT_TIMEOUT_S = 2.0  # a server that does not take the connection by then is down
# A context server answers once its prefill is done; one that is frozen, not just slow, is given
# up on as soon as it fails its health checks (``backends.py``), whatever this says.
CONTEXT_TIMEOUT_S = 300.0


class DisaggRouter:
    def __init__(
        self,
        context_urls: list[str],
        generation_urls: list[str],
        timeout_s: float = 600.0,
        keepalive_s: float = ROUTER_KEEPALIVE_S,
        context_wait_s: float = 120.0,
        context_timeout_s: float = CONTEXT_TIMEOUT_S,
    ) -> None:
        """``context_wait_s``: how long a request waits while every context server is full
        (429) before the client gets that 429; ``context_timeout_s``: the longest a context
        server may take to answer (a frozen one is left sooner, when its health checks fail)."""
        self.context_urls = [_base(u) for u in context_urls]
        self.generation_urls = [_base(u) for u in generation_urls]
        self.context = Backends("context", self.context_urls)
        self.generation = Backends("generation", self.generation_urls)
        # the servers take disaggregated_params only with the deployment's secret (trust.py)
        auth = {DISAGG_AUTH_HEADER: deployment_secret().decode()}
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s, connect=CONNECT_TIMEOUT_S),
            headers=auth,
            limits=httpx.Limits(keepalive_expiry=keepalive_s),
        )
        self.context_timeout = httpx.Timeout(context_timeout_s, connect=CONNECT_TIMEOUT_S)
        self.context_wait_s = context_wait_s
        self.counters = {
            "requests": 0,
            "errors": 0,
            "backend_failures": 0,
            "cut_streams": 0,
            "context_retries": 0,
            "context_failovers": 0,  # requests sent on to another context server
        }

        @contextlib.asynccontextmanager
        async def lifespan(app: FastAPI):
            async with watching(self.client, [self.context, self.generation]):
                yield

        self.app = FastAPI(title="trtllm-serve disaggregated", lifespan=lifespan)
        install_error_handling(self.app, envs.TRTLLM_API_KEY.get() or None)
        self._routes()

    def _routes(self) -> None:
        app = self.app

        @app.get("/health")
        async def health():
            """Ok only while every context and generation server answers its own ``/health``."""
            down = []
            for role in (self.context, self.generation):
                for url in role.urls:
                    if await self._up(url):
                        role.checked(url, True)  # (back: in the rotation at once)
                    else:
                        down.append(url)
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

    def _unavailable(self, role: Backends) -> JSONResponse:
        self.counters["backend_failures"] += 1
        message = (
            f"no {role.role} server is up: {role.down()} fail their health checks; retry later"
        )
        return error_response(503, message, "server_error")

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
        if not self.generation.up():  # (no prefill, and no KV held, for a request nobody decodes)
            await self.generation.recheck(self.client)
            if not self.generation.up():
                return self._unavailable(self.generation)
        handed_over = await self._context_phase(path, body, forward)
        if not isinstance(handed_over, tuple):
            return handed_over  # the context server's answer (it finished there, or an error)
        params, ctx_url = handed_over
        gen_body = {**body, "disaggregated_params": params.to_json()}
        gen = self.generation.next()
        if gen is None:
            await self.generation.recheck(self.client)
            gen = self.generation.next()
        if gen is None:
            return self._unavailable(self.generation)
        where = f"(context server {ctx_url}, generation server {gen})"
        if not body.get("stream"):
            try:
                reply = await self.client.post(gen + path, json=gen_body, headers=forward)
                return _annotated(reply.status_code, reply.json(), where)
            except (httpx.HTTPError, ValueError) as exc:
                if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout):
                    self.generation.failed(gen)
                return self._failure(f"generation server {gen}: {exc}")
        return await self._stream(gen + path, gen_body, forward, where)

    async def _stream(self, url: str, body: dict, headers: dict[str, str], where: str):
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
                return _annotated(reply.status_code, json.loads(content), where)
            except (httpx.HTTPError, ValueError) as exc:
                return self._failure(f"generation server {url}: HTTP {reply.status_code}: {exc}")
            finally:
                await reply.aclose()
        return EndingStream(self._relay(url, reply), reply.aclose)

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
    ) -> tuple[DisaggregatedParams, str] | JSONResponse:
        """Prefill on a context server; returns the ``generation_only`` params to send on and
        the context server's URL, or the reply to give the client when there is nothing to hand
        over."""
        ask = DisaggregatedParams(request_type=RequestType.CONTEXT_ONLY)
        ctx_body = {**body, "stream": False, "disaggregated_params": ask.to_json()}
        try:
            ctx_url, ctx_reply = await self._prefill(path, ctx_body, headers)
            result = ctx_reply.json()
        except _NoContextServer as exc:
            return exc.reply
        except (httpx.HTTPError, ValueError) as exc:
            return self._failure(f"context server: {exc}")
        if not isinstance(result, dict):
            return self._failure(f"context server {ctx_url}: its reply is not a JSON object")
        if ctx_reply.status_code != 200:
            return _annotated(ctx_reply.status_code, result, f"(context server {ctx_url})")
        raw = result.pop("disaggregated_params", None)
        try:
            params = None if raw is None else DisaggregatedParams.model_validate(raw)
            if params is None or params.request_type is RequestType.FINISHED:
                # it ended on the context server (the end token at once, or max_tokens 1)
                if body.get("stream"):
                    return StreamingResponse(_as_events(result), media_type="text/event-stream")
                return JSONResponse(result)
            return params.for_generation(), ctx_url
        except ValueError as exc:
            return error_response(
                502, f"the context server's disaggregated_params: {exc}", "server_error"
            )

    async def _prefill(
        self, path: str, body: dict, headers: dict[str, str]
    ) -> tuple[str, httpx.Response]:
        """A context server's reply, and which one gave it. A server that cannot be reached or
        stops answering its health checks meanwhile is left for the next one up (each tried
        once). While they answer 429 the request waits (up to ``context_wait_s``): each holds KV
        for the generation servers' pulls, and those wait for room to decode, so a full context
        server is back pressure to wait on, not an error for the client."""
        deadline = time.monotonic() + self.context_wait_s
        pause, tried = _FIRST_RETRY_S, []
        while True:
            url = self.context.next(exclude=tuple(tried))
            if url is None and not tried:  # one may be back since the last round of checks
                await self.context.recheck(self.client)
                url = self.context.next()
            if url is None:
                if tried:
                    raise _NoContextServer(
                        self._failure(f"context servers {tried} could not serve the request")
                    )
                raise _NoContextServer(self._unavailable(self.context))
            try:
                post = self.client.post(
                    url + path, json=body, headers=headers, timeout=self.context_timeout
                )
                reply = await self.context.wait_on(url, post)
            except (httpx.ConnectError, httpx.ConnectTimeout, httpx.ReadTimeout, ServerDown):
                self.context.failed(url)
                tried.append(url)
                self.counters["context_failovers"] += 1
                continue
            if reply.status_code != 429 or time.monotonic() + pause > deadline:
                return url, reply
            self.counters["context_retries"] += 1
            await asyncio.sleep(pause)
            pause = min(2 * pause, _LAST_RETRY_S)


class _NoContextServer(Exception):
    def __init__(self, reply: JSONResponse) -> None:
        super().__init__("no context server")
        self.reply = reply


def _annotated(status: int, body, where: str) -> JSONResponse:
    """A backend's reply as it is; a server error's message says which servers it came from."""
    if status >= 500 and isinstance(body, dict) and isinstance(body.get("error"), dict):
        error = body["error"]
        error["message"] = f"{error.get('message', '')} {where}".strip()
    return JSONResponse(body, status_code=status)


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
