"""``LLM.disaggregated``: everything an ``LLM`` does for disaggregated serving, behind one object.

A request takes part through its ``disaggregated_params`` (upstream's key, on ``LLM.generate`` and
``LLM.submit``):

- ``context_only``: prefill (target and drafter KV, first token, first drafts), then hold the KV
  for a generation server; the finished ``RequestOutput`` carries the signed reply with the
  handle to it (``disaggregated_params``);
- ``generation_only`` (a context server's reply, sent on by the router): pull the prompt's KV when
  the executor admits the request, then decode. No prefill runs.

The rest is the server's: whether a caller may send ``disaggregated_params`` (``authorized``),
how much KV waits for pulls (``held_slots``), and freeing what was pulled (``release_pulled``,
which the LLM's engine loop runs between steps).
"""

from __future__ import annotations

from collections.abc import Callable

from tensorrt_llm._torch.disaggregation import context_only, generation_only, trust
from tensorrt_llm._torch.disaggregation.generation_only import PromptKvPull
from tensorrt_llm._torch.disaggregation.parallel import pull_options
from tensorrt_llm._torch.disaggregation.params import DisaggregatedParams, RequestType
from tensorrt_llm._torch.disaggregation.transceiver import KvCacheTransceiver
from tensorrt_llm._torch.distributed.mapping import Mapping
from tensorrt_llm._torch.pyexecutor.executor import Executor
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
from tensorrt_llm._torch.pyexecutor.py_executor import PyExecutor


def check_params(request: LlmRequest, params: DisaggregatedParams | dict):
    """``params`` read and checked against ``request`` (a ``ValueError`` naming what is wrong):
    None for a context-only request (``request`` then made one), else a generation-only request's
    params (a context server's reply)."""
    params = DisaggregatedParams.model_validate(params)
    if params.request_type is RequestType.CONTEXT_ONLY and not params.has_handle:
        request.context_only = True
        return None
    if params.request_type not in (RequestType.CONTEXT_ONLY, RequestType.GENERATION_ONLY):
        raise ValueError(
            f"disaggregated_params.request_type={params.request_type.value!r}: a request "
            "takes 'context_only' or 'generation_only'"
        )
    generation_only.check_resumable(params)
    if params.prompt_token_ids != request.prompt_token_ids:
        raise ValueError(
            "the request's prompt is not the one the context server prefilled "
            "(disaggregated_params.prompt_token_ids)"
        )
    return params


class DisaggregatedServing:
    def __init__(
        self,
        transceiver: KvCacheTransceiver | None,
        executor: Executor,
        rank_executor: PyExecutor,
        mapping: Mapping,
        between_steps: Callable[[Callable[[], object]], object],
    ) -> None:
        self.transceiver = transceiver
        self._executor = executor  # what the LLM drives (rank 0's, under attention DP)
        self._rank_executor = rank_executor  # this rank's, which pulls
        self._mapping = mapping
        self._between_steps = between_steps  # LLM.between_steps

    @property
    def enabled(self) -> bool:
        """Whether this LLM has a KV transceiver (``cache_transceiver_config``)."""
        return self.transceiver is not None

    def _require(self) -> KvCacheTransceiver:
        if self.transceiver is None:
            raise ValueError(
                "disaggregated_params need cache_transceiver_config (backend: NIXL); this LLM "
                "has none"
            )
        return self.transceiver

    # ---- requests -------------------------------------------------------------------------------
    def prepare(
        self, request: LlmRequest, params: DisaggregatedParams | dict
    ) -> PromptKvPull | None:
        """Make ``request`` (built from its prompt) a context-only one, or a generation-only one
        resumed from a context server's reply; returns the latter's ``load_kv``. A
        ``ValueError`` (or ``trust.UntrustedParamsError``) names what is wrong with ``params``."""
        transceiver = self._require()
        params = check_params(request, params)
        if params is None:
            return None
        options = pull_options(self._mapping)
        return generation_only.resume_from_context(
            request, params, self._rank_executor, transceiver, **options
        )

    def reply(self, request: LlmRequest) -> DisaggregatedParams | None:
        """A finished context-only request's reply (None for any other request)."""
        if not request.context_only or self.transceiver is None:
            return None
        hold_s = self._executor.disagg.hold_left_s(request.request_id)
        return context_only.context_result(request, self.transceiver, hold_s)

    # ---- the server's ---------------------------------------------------------------------------
    def authorized(self, header_value: str | None) -> bool:
        """Whether a caller's ``trust.DISAGG_AUTH_HEADER`` carries this deployment's secret."""
        return trust.authorized(header_value, self._require().secret)

    @property
    def total_slots(self) -> int:
        """The KV slots of this server (per rank)."""
        return self._executor.limits.kv_usable_slots

    def held_slots(self) -> int:
        """KV slots held for pulls that have not come (counted between steps)."""
        return self._between_steps(self._executor.disagg.held_slots)

    def release_pulled(self) -> int:
        """Free held KV that a generation server pulled, or whose hold timed out (the engine
        loop does this between steps; call it when no loop runs). Returns how many were freed."""
        if self.transceiver is None:
            return 0
        return self._between_steps(
            lambda: context_only.release_pulled(self._executor, self.transceiver)
        )

    def close(self) -> None:
        """End this LLM's NIXL agent and let go of the executors and the KV (``LLM.shutdown``)."""
        if self.transceiver is not None:
            self.transceiver.close()
        self._executor = self._rank_executor = None
