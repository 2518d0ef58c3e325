"""The resource-manager contract the executor drives every step, and the layer bookkeeping helper."""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING

from tensorrt_llm._torch.speculative.interface import Eagle3SpecConfig

if TYPE_CHECKING:
    from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
    from tensorrt_llm._torch.pyexecutor.scheduler import ScheduledRequests


class ResourceManagerType(enum.Enum):
    KV_CACHE_MANAGER = "KV_CACHE_MANAGER"
    DRAFT_KV_CACHE_MANAGER = "DRAFT_KV_CACHE_MANAGER"
    SEQ_SLOT_MANAGER = "SEQ_SLOT_MANAGER"
    SPEC_RESOURCE_MANAGER = "SPEC_RESOURCE_MANAGER"
    LOGITS_STATE = "LOGITS_STATE"  # penalties' counts and logit bias per request


KV_CACHE_MANAGER_TYPES = (
    ResourceManagerType.KV_CACHE_MANAGER,
    ResourceManagerType.DRAFT_KV_CACHE_MANAGER,
)


class BaseResourceManager(ABC):
    """A per-request resource with a step life cycle.

    Per step the executor calls ``prepare_resources`` (before the forward: reserve what the scheduled
    requests need), then ``update_resources`` (after sampling: record what became final, release
    what was speculative), and ``free_resources`` once per finished request.
    """

    @abstractmethod
    def get_max_resource_count(self) -> int:
        """Total units of the resource (for the KV cache: slots)."""

    @abstractmethod
    def get_needed_resource_to_completion(self, request: LlmRequest) -> int:
        """Units ``request`` still needs to run to its token limit."""

    def prepare_resources(self, scheduled_batch: ScheduledRequests) -> None:  # noqa: B027
        pass

    def update_resources(self, scheduled_batch: ScheduledRequests) -> None:  # noqa: B027
        pass

    def free_resources(self, request: LlmRequest) -> None:  # noqa: B027
        pass

    def shutdown(self) -> None:  # noqa: B027
        pass


class ResourceManager:
    """The registry of a model's resource managers, keyed by ``ResourceManagerType``."""

    def __init__(
        self, resource_managers: dict[ResourceManagerType, BaseResourceManager] | None = None
    ):
        self.resource_managers: dict[ResourceManagerType, BaseResourceManager] = dict(
            resource_managers or {}
        )

    def get_resource_manager(self, kind: ResourceManagerType) -> BaseResourceManager | None:
        return self.resource_managers.get(kind)

    @property
    def kv_cache_managers(self) -> dict[ResourceManagerType, BaseResourceManager]:
        """The KV cache managers: the target's, and a separate drafter's where there is one."""
        return {k: m for k, m in self.resource_managers.items() if k in KV_CACHE_MANAGER_TYPES}

    def prepare_resources(self, scheduled_batch: ScheduledRequests) -> None:
        """The KV cache manager first, whatever the registration order: it reports the reused
        prefixes (``scheduled_batch.reused_tokens``) that the others (a separate draft manager)
        reserve past."""
        first = self.resource_managers.get(ResourceManagerType.KV_CACHE_MANAGER)
        if first is not None:
            first.prepare_resources(scheduled_batch)
        for manager in self.resource_managers.values():
            if manager is not first:
                manager.prepare_resources(scheduled_batch)

    def update_resources(self, scheduled_batch: ScheduledRequests) -> None:
        for manager in self.resource_managers.values():
            manager.update_resources(scheduled_batch)

    def free_resources(self, request: LlmRequest) -> None:
        for manager in reversed(list(self.resource_managers.values())):
            manager.free_resources(request)

    def shutdown(self) -> None:
        for manager in self.resource_managers.values():
            manager.shutdown()


def get_pp_layers(
    num_layers: int,
    mapping: object | None = None,
    spec_config: Eagle3SpecConfig | None = None,
    layer_mask: Sequence[bool] | None = None,
) -> tuple[list[int], int]:
    """The layer ids this rank holds KV for, and the total layer count.

    Without a mask: layers ``0 .. num_layers - 1``, then a one-model speculative config's draft
    layers appended after them (ids ``num_layers .. num_layers + num_draft - 1``). With a mask
    (one bool per layer of the full stack, drafts included): the layers whose entry is true. This
    fork has no pipeline parallelism, so ``mapping`` is accepted for signature compatibility only.
    """
    del mapping
    if layer_mask is not None:
        total = len(layer_mask)
        layers = [i for i, keep in enumerate(layer_mask) if keep]
    else:
        total = num_layers + (spec_config.num_draft_layers if spec_config is not None else 0)
        layers = list(range(total))
    if not layers:
        raise ValueError(f"no local layers: num_layers={num_layers}, layer_mask={layer_mask}")
    return layers, total
