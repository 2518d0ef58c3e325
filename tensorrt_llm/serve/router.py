"""The disaggregated router: context server first, then generation server, per request.

For ``/v1/completions`` and ``/v1/chat/completions`` the router sends the request to a context
server (round robin) with ``disaggregated_params: {"request_type": "context_only"}``; the reply's
``DisaggregatedParams`` carry the KV handle (JSON). It then sends the original request plus those
params, marked ``generation_only``, to a generation server (round robin), which pulls the KV over
NIXL and decodes; that reply (streamed or not) goes back to the client unchanged. A request that
ended on the context server (``finished``) is answered from there.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import httpx
import yaml
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from tensorrt_llm._torch.disaggregation.params import DisaggregatedParams, RequestType
from tensorrt_llm._torch.disaggregation.trust import DISAGG_AUTH_HEADER, deployment_secret
from tensorrt_llm.serve.errors import error_response


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


class DisaggRouter:
    def __init__(
        self, context_urls: list[str], generation_urls: list[str], timeout_s: float = 600.0
    ) -> None:
        self.context_urls = [_base(u) for u in context_urls]
        self.generation_urls = [_base(u) for u in generation_urls]
        self._ctx = itertools.cycle(self.context_urls)
        self._gen = itertools.cycle(self.generation_urls)
        # the servers take disaggregated_params only with the deployment's secret (trust.py)
        auth = {DISAGG_AUTH_HEADER: deployment_secret().decode()}
        self.client = httpx.AsyncClient(timeout=timeout_s, headers=auth)
        self.app = FastAPI(title="trtllm-serve disaggregated")
        self._routes()

    def _routes(self) -> None:
        app = self.app

        @app.get("/health")
        async def health():
            return {
                "status": "ok",
                "context_servers": self.context_urls,
                "generation_servers": self.generation_urls,
            }

        @app.get("/v1/models")
        async def models():
            reply = await self.client.get(self.generation_urls[0] + "/v1/models")
            return JSONResponse(reply.json(), status_code=reply.status_code)

        @app.post("/v1/completions")
        async def completions(request: Request):
            return await self._route("/v1/completions", request)

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            return await self._route("/v1/chat/completions", request)

    async def _route(self, path: str, request: Request):
        try:
            body = await request.json()
        except ValueError:
            return error_response(400, "the request body is not JSON", "invalid_request_error")
        handed_over = await self._context_phase(path, body)
        if not isinstance(handed_over, DisaggregatedParams):
            return handed_over  # the context server's answer (it finished there, or an error)
        gen_body = {**body, "disaggregated_params": handed_over.to_json()}
        gen_url = next(self._gen) + path
        if not body.get("stream"):
            try:
                reply = await self.client.post(gen_url, json=gen_body)
            except httpx.HTTPError as exc:
                return error_response(502, f"generation server unreachable: {exc}", "server_error")
            return JSONResponse(reply.json(), status_code=reply.status_code)

        async def relay():
            async with self.client.stream("POST", gen_url, json=gen_body) as reply:
                async for chunk in reply.aiter_raw():
                    yield chunk

        return StreamingResponse(relay(), media_type="text/event-stream")

    async def _context_phase(self, path: str, body: dict) -> DisaggregatedParams | JSONResponse:
        """Prefill on a context server; returns the ``generation_only`` params to send on, or
        the reply to give the client when there is nothing to hand over."""
        ask = DisaggregatedParams(request_type=RequestType.CONTEXT_ONLY)
        ctx_body = {**body, "stream": False, "disaggregated_params": ask.to_json()}
        try:
            ctx_reply = await self.client.post(next(self._ctx) + path, json=ctx_body)
        except httpx.HTTPError as exc:
            return error_response(502, f"context server unreachable: {exc}", "server_error")
        if ctx_reply.status_code != 200:
            return JSONResponse(ctx_reply.json(), status_code=ctx_reply.status_code)
        result = ctx_reply.json()
        raw = result.pop("disaggregated_params", None)
        try:
            params = None if raw is None else DisaggregatedParams.model_validate(raw)
            if params is None or params.request_type is RequestType.FINISHED:
                return JSONResponse(result)  # it ended on the context server
            return params.for_generation()
        except ValueError as exc:
            return error_response(
                502, f"the context server's disaggregated_params: {exc}", "server_error"
            )
