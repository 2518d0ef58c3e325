"""Which disaggregated params a server may act on: signed by a context server of its deployment.

A context server signs its reply (first token, drafts, prompt, transfer handle) with an HMAC-SHA256
keyed by the deployment's secret (``TRTLLM_DISAGG_SECRET``, shared by the router and the servers).
A generation server acts only on params whose signature it verifies, so a client cannot point a
pull at slots of its choosing or claim a prompt for pulled KV (which then enters the prefix
cache). The router presents the secret in ``DISAGG_AUTH_HEADER`` on the requests that carry
``disaggregated_params``; servers refuse such requests without it.
"""

from __future__ import annotations

import hashlib
import hmac
import json

from tensorrt_llm import envs
from tensorrt_llm._torch.disaggregation.params import DisaggregatedParams

MIN_SECRET_CHARS = 16
DISAGG_AUTH_HEADER = "x-trtllm-disagg-auth"
_UNSIGNED = {"request_type", "signature"}  # the router turns context_only into generation_only


class UntrustedParamsError(ValueError):
    """Disaggregated params that no context server of this deployment made."""


def deployment_secret() -> bytes:
    """``TRTLLM_DISAGG_SECRET``; a ``ValueError`` that says how to set it when it is unset or short."""
    secret = envs.TRTLLM_DISAGG_SECRET.get()
    if len(secret) < MIN_SECRET_CHARS:
        state = "is not set" if not secret else f"has {len(secret)} characters"
        raise ValueError(
            f"TRTLLM_DISAGG_SECRET {state}: a disaggregated deployment needs a secret of at least "
            f"{MIN_SECRET_CHARS} characters, the same on the router and on every context and "
            "generation server (e.g. export TRTLLM_DISAGG_SECRET=$(openssl rand -hex 16))"
        )
    return secret.encode()


def _digest(params: DisaggregatedParams, secret: bytes) -> str:
    body = params.model_dump(mode="json", exclude=_UNSIGNED)
    message = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


def sign(params: DisaggregatedParams, secret: bytes) -> DisaggregatedParams:
    return params.model_copy(update={"signature": _digest(params, secret)})


def verify(params: DisaggregatedParams, secret: bytes) -> None:
    """Raise ``UntrustedParamsError`` unless a holder of ``secret`` signed exactly these params."""
    if params.signature is None:
        raise UntrustedParamsError(
            "disaggregated_params carry no signature: only a context server's reply, forwarded "
            "unchanged, can start a generation-only request"
        )
    if not hmac.compare_digest(params.signature, _digest(params, secret)):
        raise UntrustedParamsError(
            "disaggregated_params do not match their signature: they were altered, or signed by a "
            "server with another TRTLLM_DISAGG_SECRET"
        )


def authorized(header_value: str | None, secret: bytes) -> bool:
    """Whether a request's ``DISAGG_AUTH_HEADER`` presents the deployment's secret."""
    return header_value is not None and hmac.compare_digest(header_value.encode(), secret)
