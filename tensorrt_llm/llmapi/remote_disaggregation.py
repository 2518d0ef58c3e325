"""``LLM.disaggregated`` when the engine core runs in another process (``core_process.py``): the
checks that need no engine are made here (the params read, their request type and prompt, the
deployment's signature), the pull and the hold run where the core is. A context-only request's
reply comes back with its last output."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tensorrt_llm._torch.disaggregation import trust
from tensorrt_llm._torch.disaggregation.params import DisaggregatedParams
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
from tensorrt_llm.llmapi.disaggregated import check_params


@dataclass(frozen=True)
class RemoteLoad:
    """A generation-only request's ``load_kv`` on the front side: the checked params, which the
    core's process turns into its pull."""

    params: dict


class RemoteDisaggregation:
    transceiver = None  # (in the engine core's process)

    def __init__(self, enabled: bool, total_slots: int, call: Callable[[str], object]) -> None:
        self.enabled = enabled
        self.total_slots = total_slots  # the KV slots of the server (per rank)
        self._call = call  # a read-out where the core is, by name
        self._secret = trust.deployment_secret() if enabled else b""
        self._replies: dict[int, DisaggregatedParams] = {}

    def prepare(self, request: LlmRequest, params: DisaggregatedParams | dict) -> RemoteLoad | None:
        """``DisaggregatedServing.prepare``'s checks; the pull itself starts in the core."""
        if not self.enabled:
            raise ValueError(
                "disaggregated_params need cache_transceiver_config (backend: NIXL); this LLM "
                "has none"
            )
        params = check_params(request, params)
        if params is None:
            return None
        trust.verify(params, self._secret)
        return RemoteLoad(params.to_json())

    def received(self, request_id: int, reply: dict) -> None:
        """A finished context-only request's reply, as the core sent it."""
        self._replies[request_id] = DisaggregatedParams.model_validate(reply)

    def reply(self, request: LlmRequest) -> DisaggregatedParams | None:
        return self._replies.pop(request.request_id, None)

    def authorized(self, header_value: str | None) -> bool:
        return self.enabled and trust.authorized(header_value, self._secret)

    def held_slots(self) -> int:
        return self._call("held_slots")

    def release_pulled(self) -> int:
        return self._call("release_pulled")

    def close(self) -> None:
        self._replies.clear()
