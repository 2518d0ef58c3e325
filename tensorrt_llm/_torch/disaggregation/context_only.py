"""The context server's end of a disaggregated request: its reply, and releasing pulled KV.

A context-only request prefills its prompt (target and drafter KV, first token, first drafts) and
finishes with ``FinishReason.CONTEXT_DONE``; the executor then holds its slots (see
``disaggregation/coordinator.py``) until a generation server's pull notification arrives or the
transfer timeout passes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tensorrt_llm._torch.disaggregation import trust
from tensorrt_llm._torch.disaggregation.params import DisaggregatedParams, ImageRef, RequestType
from tensorrt_llm._torch.pyexecutor.llm_request import FinishReason, LlmRequest

if TYPE_CHECKING:
    from tensorrt_llm._torch.disaggregation.transceiver import KvCacheTransceiver
    from tensorrt_llm._torch.pyexecutor.py_executor import PyExecutor


def context_result(
    request: LlmRequest, transceiver: KvCacheTransceiver, hold_s: float = 0.0
) -> DisaggregatedParams:
    """The reply to a context-only request that ran: the handle to its held KV (held ``hold_s``
    more seconds), signed with the deployment's secret, or, when it ended outright (the end id at
    once, an error, a cancel), ``finished`` with its tokens."""
    if request.finish_reason is not FinishReason.CONTEXT_DONE:
        return DisaggregatedParams(
            request_type=RequestType.FINISHED,
            output_token_ids=list(request.output_token_ids),
            finish_reason=request.finish_reason,
        )
    reply = DisaggregatedParams(
        request_type=RequestType.CONTEXT_ONLY,
        first_token=request.output_token_ids[0],
        draft_tokens=list(request.py_draft_tokens),
        prompt_token_ids=list(request.prompt_token_ids),
        transfer_handle=transceiver.export(request.request_id, hold_s),
        images=image_refs(request),
    )
    return trust.sign(reply, transceiver.secret)


def image_refs(request: LlmRequest) -> list[ImageRef] | None:
    """Where the prompt's images are and their digests (None for a text prompt)."""
    mm = request.multimodal
    if mm is None:
        return None
    return [ImageRef(offset=o, num_tokens=n, digest=d) for o, n, d in mm.refs()]


def release_pulled(executor: PyExecutor, transceiver: KvCacheTransceiver) -> int:
    """Free the held requests a generation server has pulled, or whose hold timed out, each
    transfer revoked before its slots are freed. Returns how many were freed."""
    return executor.release_transferred(transceiver.pulled_request_ids(), transceiver.revoke)
