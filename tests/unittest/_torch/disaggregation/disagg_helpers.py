"""Hand-made control-plane messages for tests that need no NIXL agent."""

import base64
import os

from tensorrt_llm._torch.disaggregation import trust
from tensorrt_llm._torch.disaggregation.params import (
    DisaggregatedParams,
    LayoutFingerprint,
    PoolFingerprint,
    RequestType,
    TransferHandle,
)


def fingerprint(slot_bytes: int = 4096, parallel: str = "tp1") -> LayoutFingerprint:
    half = slot_bytes // 2
    pool = PoolFingerprint(
        slot_bytes=slot_bytes,
        buffers=[(0, "key", 0, half, "float16"), (0, "value", half, half, "float16")],
    )
    return LayoutFingerprint.build(
        tokens_per_block=128, layers=[0], draft_layers=[], pools=[pool], parallel=parallel
    )


def handle(**changes) -> TransferHandle:
    fields = dict(
        request_id=7,
        transfer_id="t" * 32,
        expires_at=4102444800.0,  # 2100-01-01
        agent_name="ctx",
        agent_metadata=base64.b64encode(b"\x00nixl\xff").decode(),
        fingerprint=fingerprint(),
        slots=[4, 1, 9],
        pool_addresses=[140000000],
        ticket_address=150000000,
        ticket=12345,
    )
    return TransferHandle(**{**fields, **changes})


SECRET = os.environ["TRTLLM_DISAGG_SECRET"].encode()  # the tests' deployment (conftest.py)


def context_reply(prompt_token_ids: list[int] = (1, 2, 3), **handle_changes) -> DisaggregatedParams:
    """A context server's reply, signed with the tests' deployment secret."""
    reply = DisaggregatedParams(
        request_type=RequestType.CONTEXT_ONLY,
        first_token=11,
        draft_tokens=[12, 13, 14],
        prompt_token_ids=list(prompt_token_ids),
        transfer_handle=handle(**handle_changes),
    )
    return trust.sign(reply, SECRET)
