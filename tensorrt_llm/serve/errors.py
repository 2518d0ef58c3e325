"""Every error a server answers is an OpenAI error object with the matching status; the guards
that answer before a handler runs (body size, API key)."""

from __future__ import annotations

import hmac

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tensorrt_llm._torch.pyexecutor.llm_request import ErrorKind, RequestError
from tensorrt_llm.serve.openai_protocol import ErrorInfo, ErrorResponse

MAX_BODY_BYTES = 8 * 2**20  # a larger request body is refused (413) before it is read


class ServerError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        param: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


# A request's error, by whose fault it is: (HTTP status, OpenAI error type).
_STATUS = {
    ErrorKind.INVALID_REQUEST: (400, "invalid_request_error"),
    ErrorKind.ENGINE_FAULT: (500, "server_error"),
    ErrorKind.KV_TRANSFER: (502, "server_error"),  # the context server's KV did not come
    ErrorKind.RANK_LOST: (503, "server_error"),
}


def request_failed(stop_reason) -> ServerError:
    """The ``ServerError`` of a request that ended with ``FinishReason.ERROR``."""
    if isinstance(stop_reason, RequestError):
        status, kind = _STATUS[stop_reason.kind]
        return ServerError(status, stop_reason.message, kind)
    return ServerError(500, str(stop_reason or "the engine failed this request"), "server_error")


def error_response(status: int, message: str, kind: str, param: str | None = None) -> JSONResponse:
    body = ErrorResponse(error=ErrorInfo(message=message, type=kind, param=param, code=status))
    return JSONResponse(body.model_dump(), status_code=status)


class _BodySizeLimit:
    """Refuses a request whose declared body is over ``MAX_BODY_BYTES`` before reading it (a plain
    ASGI middleware: it leaves ``receive`` alone, so handlers still see a client disconnect)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            length = dict(scope["headers"]).get(b"content-length", b"0").decode("latin-1")
            if not length.isdigit() or int(length) > MAX_BODY_BYTES:
                reply = error_response(
                    413,
                    f"the request body is {length} bytes; the limit is {MAX_BODY_BYTES}",
                    "invalid_request_error",
                )
                await reply(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _ApiKey:
    """With an API key set, every path but ``/health`` needs ``Authorization: Bearer <key>``."""

    def __init__(self, app, api_key: str) -> None:
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] != "/health":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                reply = error_response(
                    401,
                    "missing or wrong API key (Authorization: Bearer <key>)",
                    "authentication_error",
                )
                await reply(scope, receive, send)
                return
        await self.app(scope, receive, send)


def install_error_handling(app: FastAPI, api_key: str | None = None) -> None:
    """The body-size limit, the API key when one is set, and OpenAI error objects for validation
    errors, ``ServerError`` and unknown paths or methods."""
    app.add_middleware(_BodySizeLimit)
    if api_key:
        app.add_middleware(_ApiKey, api_key=api_key)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return error_response(
            400, f"{param}: {first.get('msg', 'invalid request')}", "invalid_request_error", param
        )

    @app.exception_handler(ServerError)
    async def _server_error(_: Request, exc: ServerError):
        return error_response(exc.status, exc.message, exc.kind, exc.param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return error_response(exc.status_code, message, kind)
