"""Hand-made control-plane messages for tests that need no NIXL agent, and the bundled model's
KV managers of any rank."""

import base64
import os
import time

from tensorrt_llm._torch.disaggregation import trust
from tensorrt_llm._torch.disaggregation.params import (
    DisaggregatedParams,
    LayoutFingerprint,
    PoolFingerprint,
    RequestType,
    TransferHandle,
)
from tensorrt_llm._torch.distributed.mapping import Mapping
from tensorrt_llm._torch.models.checkpoint import load_config
from tensorrt_llm._torch.pyexecutor._util import create_kv_cache_managers
from tensorrt_llm._torch.pyexecutor.config import KvCacheOptions, PyExecutorConfig
from tensorrt_llm._torch.pyexecutor.resource_manager import ResourceManagerType
from tensorrt_llm._torch.speculative.interface import Eagle3SpecConfig
from tensorrt_llm.bundled import BUNDLED_DRAFT, BUNDLED_TARGET


def fingerprint(
    slot_bytes: int = 4096, parallel: str = "tp1", kv_dtype: str = "float16"
) -> LayoutFingerprint:
    half = slot_bytes // 2
    pool = PoolFingerprint(
        slot_bytes=slot_bytes,
        buffers=[(0, "key", 0, half, kv_dtype), (0, "value", half, half, kv_dtype)],
    )
    return LayoutFingerprint.build(
        kv_dtype=kv_dtype,
        tokens_per_block=128,
        layers=[0],
        draft_layers=[],
        pools=[pool],
        parallel=parallel,
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


def pulled(transceiver, timeout_s: float = 10.0) -> list[int]:
    """The pull notifications arrive asynchronously: wait for the first ones."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ids = transceiver.pulled_request_ids()
        if ids:
            return ids
        time.sleep(0.01)
    return []


def bundled_manager(
    tp_size: int = 1,
    rank: int = 0,
    attention_dp: bool = False,
    device: str = "cpu",
    kv_dtype: str = "float32",
):
    """The bundled model's unified KV manager (``kv_dtype``, 16 slots) on one rank of a layout."""
    mapping = Mapping(tp_size, tp_size, rank, attention_dp)
    config = PyExecutorConfig(
        max_batch_size=2,
        max_num_tokens=512,
        max_seq_len=512,
        kv_cache=KvCacheOptions(dtype=kv_dtype, max_tokens=2048),
        speculative=Eagle3SpecConfig(max_draft_len=3, speculative_model=str(BUNDLED_DRAFT)),
        mapping=mapping,
        device=device,
    )
    draft_heads = 4 // mapping.attn_tp_size  # the drafter's 4 KV heads, split like the target's
    managers = create_kv_cache_managers(load_config(BUNDLED_TARGET), config, (draft_heads, 64))
    return managers[ResourceManagerType.KV_CACHE_MANAGER]
