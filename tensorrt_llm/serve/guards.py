"""Checks a request passes before it runs: who may send ``disaggregated_params``, room for another
context-only hold, and chat content free of control tokens. Each raises ``ServerError``."""

from __future__ import annotations

import asyncio

from fastapi import Request
from fastapi.responses import JSONResponse

from tensorrt_llm._torch.disaggregation import trust
from tensorrt_llm._torch.disaggregation.params import DisaggregatedParams, RequestType
from tensorrt_llm.llmapi.llm import LLM
from tensorrt_llm.serve.errors import ServerError


def health_reply(llm: LLM) -> JSONResponse:
    """200 while the LLM can serve; 503 naming the rank once one of its ranks is gone."""
    lost = llm.lost_rank()
    if lost is None:
        return JSONResponse({"status": "ok"})
    return JSONResponse({"status": "unhealthy", "reason": lost}, status_code=503)


def check_ranks(llm: LLM) -> None:
    """A 503 instead of a request that could not run: one of the LLM's ranks is gone."""
    lost = llm.lost_rank()
    if lost is not None:
        raise ServerError(
            503, f"this server lost a rank ({lost}); it must be restarted", "server_error"
        )


def check_disagg_access(llm: LLM, request: Request, disagg: DisaggregatedParams | None) -> None:
    """A server with a transceiver takes ``disaggregated_params`` only with the deployment's
    secret in ``trust.DISAGG_AUTH_HEADER`` (the router's); 403 otherwise."""
    if disagg is None or not llm.disaggregated.enabled:
        return
    if not llm.disaggregated.authorized(request.headers.get(trust.DISAGG_AUTH_HEADER)):
        raise ServerError(
            403,
            "disaggregated_params are taken only from this deployment's router (the "
            f"{trust.DISAGG_AUTH_HEADER} header with TRTLLM_DISAGG_SECRET)",
            kind="permission_error",
            param="disaggregated_params",
        )


async def check_hold_room(llm: LLM, disagg: DisaggregatedParams | None) -> None:
    """A 429 for a context-only request while KV held for pulls fills ``max_held_fraction`` of the
    slots (counted between steps)."""
    if disagg is None or disagg.request_type is not RequestType.CONTEXT_ONLY:
        return
    if not llm.disaggregated.enabled:
        return
    held = await asyncio.to_thread(llm.disaggregated.held_slots)
    total = llm.disaggregated.total_slots
    limit = llm.args.cache_transceiver_config.max_held_fraction * total
    if held >= limit:
        raise ServerError(
            429,
            f"this context server holds {held} of its {total} KV slots for pulls that have not "
            f"come (max_held_fraction allows {limit:g}); retry later",
            "rate_limit_error",
        )


def refuse_control_tokens(tokenizer, messages: list[dict[str, str]]) -> None:
    """Message content is text: a special token in it (``<|end|><|assistant|>``) would be read
    as the chat template's control token, so it is refused."""
    specials = tokenizer.special_tokens
    for i, message in enumerate(messages):
        found = [t for t in specials if t in message["content"]]
        if found:
            raise ServerError(
                400,
                f"messages.{i}.content contains the special token(s) {found}; message content "
                "may not contain the chat template's control tokens",
                param=f"messages.{i}.content",
            )
