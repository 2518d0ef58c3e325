"""Checks a request passes before it runs: who may send ``disaggregated_params``, room for another
context-only hold, chat content free of control tokens, text short enough to tokenize, and the
server's limits on one request's work (``ServeLimits``). Each raises ``ServerError``."""

from __future__ import annotations

import asyncio
import functools
import re
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse

from tensorrt_llm._torch.disaggregation import trust
from tensorrt_llm._torch.disaggregation.params import DisaggregatedParams, RequestType
from tensorrt_llm.llmapi.llm import LLM
from tensorrt_llm.serve.errors import ServerError
from tensorrt_llm.serve.grammar_limits import check_json


def health_reply(llm: LLM) -> JSONResponse:
    """200 while the LLM can serve; 503 naming why not (``LLM.lost_rank``: a rank gone, an
    engine core that exited or stalled, while a new one starts or for good). Once an engine
    core was replaced, both say how many times (``engine_core_restarts``)."""
    lost, restarts = llm.lost_rank(), llm.engine_core_restarts()
    counted = {"engine_core_restarts": restarts} if restarts else {}
    if lost is None:
        return JSONResponse({"status": "ok", **counted})
    return JSONResponse({"status": "unhealthy", "reason": lost, **counted}, status_code=503)


def check_ranks(llm: LLM) -> None:
    """A 503 at once instead of work that could not run: a rank or the engine core is lost (or
    a new core is starting)."""
    lost = llm.lost_rank()
    if lost is not None:
        raise ServerError(
            503, f"this server lost a rank or its engine core ({lost})", "server_error"
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


def refuse_control_tokens(tokenizer, texts: list[tuple[str, str]]) -> None:
    """Text is text: a special token in it (M3's ``[e~[`` or ``]~b]``) would be read as the chat
    template's control token, so it is refused, wherever it would reach the template (message
    text, the tools' names, descriptions and schemas, template variables). ``texts`` as
    ``(param, text)``; the first holding one is named."""
    specials = tokenizer.special_tokens
    joined = "\0".join(text for _, text in texts)  # (one search per token; no token holds NUL)
    if not any(t in joined for t in specials):
        return
    for param, text in texts:
        found = [t for t in specials if t in text]
        if found:
            raise ServerError(
                400,
                f"{param} contains the special token(s) {found}; text that reaches the chat "
                "template may not contain its control tokens",
                param=param,
            )


def refuse_formed_tokens(tokenizer, marked: list[dict], variables: dict, text: str) -> None:
    """A 400 when the rendered chat ``text`` is cut into control tokens otherwise than its
    template alone cuts it: a message that ends with the start of a control token
    (``hello]~!b``) completes it with the template's text after it (``[e~[``), or takes the
    start of the template's own token, which checking each string alone cannot see. The same
    chat rendered with each string fenced by ``FENCE`` (where nothing can form across a
    string's edge) must hold the same control tokens at the same places (fences not counted),
    both cut as the tokenizer cuts text: leftmost, longest first."""
    if not tokenizer.special_tokens:
        return
    fenced = tokenizer.apply_chat_template(_fenced(marked), **variables)
    specials = _specials(tuple(tokenizer.special_tokens))
    if _control_tokens(specials, text) != _control_tokens(specials, fenced, FENCE):
        raise ServerError(
            400,
            "messages: a message's text next to the chat template's own forms or splits one of "
            "its control tokens (a message ends or begins with part of one)",
            param="messages",
        )


FENCE = "\uffff"  # (a noncharacter: no text a tokenizer is given holds it)
_TEXT_FIELDS = ("content", "reasoning_content", "name", "tool_call_id")


@functools.lru_cache(maxsize=4)
def _specials(tokens: tuple[str, ...]) -> re.Pattern:
    return re.compile("|".join(re.escape(t) for t in sorted(tokens, key=len, reverse=True)))


def _control_tokens(specials: re.Pattern, text: str, fence: str | None = None) -> list:
    """``(place, token)`` of each control token in ``text``; a place does not count ``fence``
    characters before it."""
    found, fences, last = [], 0, 0
    for match in specials.finditer(text):
        if fence is not None:
            fences += text.count(fence, last, match.start())
            last = match.end()
        found.append((match.start() - fences, match.group()))
    return found


def _fenced(marked: list[dict]) -> list[dict]:
    """The messages with each non-empty text between fences, the string values of their tool
    calls' arguments too."""
    out = []
    for message in marked:
        message = {k: _fence(v) if k in _TEXT_FIELDS else v for k, v in message.items()}
        if message.get("tool_calls"):
            message["tool_calls"] = [
                {
                    **call,
                    "function": {
                        **call["function"],
                        "arguments": _fence(call["function"]["arguments"]),
                    },
                }
                for call in message["tool_calls"]
            ]
        out.append(message)
    return out


def _fence(value):
    if isinstance(value, str):
        return f"{FENCE}{value}{FENCE}" if value else value
    if isinstance(value, dict):
        return {key: _fence(child) for key, child in value.items()}
    if isinstance(value, list):
        return [_fence(child) for child in value]
    return value


def strings_in(value, param: str) -> list[tuple[str, str]]:
    """Every string of a JSON value, keys included, as ``(param, text)``: a key's param is its
    object's path with the key's name in brackets (``tools.0.function.parameters.properties[n]``
    for the key ``n``), a value's is its path."""
    out, stack = [], [(value, param)]
    while stack:
        node, where = stack.pop()
        if isinstance(node, str):
            out.append((where, node))
        elif isinstance(node, dict):
            for key, child in node.items():
                out.append((f"{where}[{key}]", str(key)))
                stack.append((child, f"{where}.{key}"))
        elif isinstance(node, list):
            stack.extend((child, f"{where}.{i}") for i, child in enumerate(node))
    return out


def check_template_variables(tokenizer, variables: dict | None) -> None:
    """A 400 naming each ``chat_template_kwargs`` key the chat template does not take from a
    request (``TransformersTokenizer.template_variables``): ``messages``, ``tools`` and
    ``add_generation_prompt`` come from the request's own fields, special tokens from the
    checkpoint; anything else the template never reads."""
    allowed = tokenizer.template_variables
    for key, value in (variables or {}).items():
        param = f"chat_template_kwargs.{key}"
        if key not in allowed:
            raise ServerError(
                400,
                f"{param}: not a variable this server's chat template takes from a request (it "
                f"takes {', '.join(sorted(allowed))})",
                param=param,
            )
        try:
            check_json(value, param)
        except ValueError as exc:
            raise ServerError(400, str(exc), param=param) from None


def check_chat(llm: LLM, body) -> dict:
    """A chat request's checks before its template renders it, over every string the template
    would render (messages, tools, template variables): the variables the template takes, no
    control tokens, text short enough to tokenize. Returns the template's variables."""
    check_template_variables(llm.tokenizer, body.chat_template_kwargs)
    variables = body.template_kwargs()
    texts = [
        *(text for i, m in enumerate(body.messages) for text in m.texts(i)),
        *strings_in(variables.get("tools", []), "tools"),
        *strings_in(body.chat_template_kwargs or {}, "chat_template_kwargs"),
    ]
    whole = "".join(text for _, text in texts)
    check_text_fits(llm, [*texts, ("messages", whole)])
    refuse_control_tokens(llm.tokenizer, texts)
    return variables


def check_text_fits(llm: LLM, texts: list[tuple[str, str]]) -> None:
    """A 400 for text that cannot fit ``max_seq_len`` tokens, found by its length alone before it
    is tokenized (``TransformersTokenizer.check_fits``): ``texts`` as ``(param, text)``."""
    for param, text in texts:
        try:
            llm.tokenizer.check_fits(text, llm.max_seq_len, param)
        except ValueError as exc:
            raise ServerError(400, str(exc), param=param) from None


DEFAULT_MAX_TOKENS = 128  # a request that names no max_tokens gets this many at most


@dataclass(frozen=True)
class ServeLimits:
    """How much work one request may ask for.

    ``max_request_tokens``: the completion tokens of all its choices together (``n`` times
    ``max_tokens``, times its prompts); None: ``max(2 * max_seq_len, 16384)``. A request over it is a
    400, as is one whose prompt plus ``max_tokens`` passes ``max_seq_len`` (nothing is clamped
    silently). ``running_share``: the share of ``max_batch_size`` one request's choices may run
    in at once (the others wait for those to end)."""

    max_request_tokens: int | None = None
    running_share: float = 0.5

    def max_running(self, llm: LLM) -> int:
        return max(1, int(llm.args.max_batch_size * self.running_share))

    def max_tokens(self, llm: LLM, body, prompt_lengths: list[int]) -> int:
        """The request's ``max_tokens``: as asked (checked), else the default within room."""
        asked = body.max_tokens or body.max_completion_tokens
        param = "max_tokens" if body.max_tokens else "max_completion_tokens"
        room = llm.max_seq_len - max(prompt_lengths)
        if asked is None:
            return max(1, min(DEFAULT_MAX_TOKENS, room))
        if asked > room:
            raise ServerError(
                400,
                f"{param}={asked} with a prompt of {max(prompt_lengths)} tokens passes "
                f"max_seq_len={llm.max_seq_len}: at most {max(room, 0)} tokens fit",
                param=param,
            )
        total = asked * body.n * len(prompt_lengths)
        limit = self.max_request_tokens or max(2 * llm.max_seq_len, 16384)
        if total > limit:
            raise ServerError(
                400,
                f"{len(prompt_lengths)} prompt(s) x n={body.n} x {param}={asked} = {total} "
                f"completion tokens; this server takes at most {limit} per request "
                "(--max-request-tokens)",
                param=param,
            )
        return asked
