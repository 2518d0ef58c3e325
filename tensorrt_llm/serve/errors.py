"""Every error a server answers is an OpenAI error object with the matching status: validation
errors name the field (``param``), a request's engine error is mapped by its kind, an engine
core that is lost or restarting is a 503, and anything unforeseen is a 500 object that names
only its type (the traceback goes to the log)."""

from __future__ import annotations

import re
import traceback

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tensorrt_llm._torch.pyexecutor.llm_request import ErrorKind, RequestError
from tensorrt_llm.llmapi.core_handle import EngineCoreLost
from tensorrt_llm.logger import logger
from tensorrt_llm.serve.middleware import ApiKey, BodySizeLimit
from tensorrt_llm.serve.openai_protocol import ErrorInfo, ErrorResponse


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


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
_UNPARSED = "There was an error parsing the body"  # FastAPI's, when reading the JSON raised
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
    message = _ADDRESS.sub("", message)  # an object's repr says where it lives: nobody's business
    body = ErrorResponse(error=ErrorInfo(message=message, type=kind, param=param, code=status))
    return JSONResponse(body.model_dump(), status_code=status)


def install_error_handling(app: FastAPI, api_key: str | None = None) -> None:
    """The body-size limit, the API key when one is set, and OpenAI error objects for validation
    errors, ``ServerError``, unknown paths or methods, and any other exception."""
    app.add_middleware(BodySizeLimit)
    if api_key:
        app.add_middleware(ApiKey, api_key=api_key)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError):
        param, message = validation_message(exc.errors())
        return error_response(400, message, "invalid_request_error", param)

    @app.exception_handler(ServerError)
    async def _server_error(_: Request, exc: ServerError):
        return error_response(exc.status, exc.message, exc.kind, exc.param)

    @app.exception_handler(EngineCoreLost)
    async def _core_lost(request: Request, exc: EngineCoreLost):  # (lost or restarting)
        message = f"{request.url.path}: the engine core cannot answer now ({exc})"
        return error_response(503, message, "server_error")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 400 and exc.detail == _UNPARSED:  # (Python's parser gave up)
            message = "the body could not be read as JSON (nested too deep, or not text)"
            return error_response(400, message, "invalid_request_error", "body")
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return error_response(exc.status_code, message, kind)

    @app.exception_handler(Exception)
    async def _unforeseen(request: Request, exc: Exception):
        logger.error("%s %s failed:\n%s", request.method, request.url.path, traceback.format_exc())
        message = f"the server failed this request ({type(exc).__name__}); it is logged"
        return error_response(500, message, "server_error")


def validation_message(errors) -> tuple[str | None, str]:
    """The field (dotted path in the body) and the message of pydantic's telling error, without
    pydantic's own prefixes ("Value error, ") and the union members it tried ("list[int]").

    A value that fits none of a union's members gets an error per member; the telling one is a
    member's error about the value, not the members that its type did not match."""
    telling = [e for e in errors if not str(e.get("type", "")).endswith("_type")]
    first = (telling or errors or [{}])[0]
    if first.get("type") == "json_invalid":  # (its place is a byte offset, not a field)
        where = first.get("loc", ("body", None))[-1]
        why = (first.get("ctx") or {}).get("error", "cannot be decoded")
        at = f" at byte {where}" if isinstance(where, int) else ""
        return "body", f"the body is not JSON: {why}{at}"
    path = [p for p in first.get("loc", ())[1:] if isinstance(p, int) or _FIELD.fullmatch(p)]
    param = ".".join(str(p) for p in path if p not in _TYPE_TAGS) or None
    text = str(first.get("msg", "invalid request"))
    for prefix in ("Value error, ", "Assertion failed, "):
        text = text.removeprefix(prefix)
    return param, f"{param}: {text}" if param and not text.startswith(param) else text


_FIELD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}  # pydantic's union members
