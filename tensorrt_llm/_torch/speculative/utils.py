"""Where the drafter's KV lives: decided once at the creation site, resolved from the registered
resources at dispatch."""

from __future__ import annotations

import inspect

from tensorrt_llm._torch.pyexecutor.resource_manager import ResourceManager, ResourceManagerType
from tensorrt_llm._torch.speculative.interface import Eagle3SpecConfig
from tensorrt_llm.logger import logger

SEPARATE_MODE = "separate draft KV cache manager"
VIEW_MODE = "target manager's draft sub-page view"
WHOLE_PAGE_MODE = "target manager's whole-page draft layer (an MTP module's)"
DIRECT_MODE = "none (the drafter attends the target manager directly)"


def _should_create_separate_draft_kv_cache(
    spec_config: Eagle3SpecConfig | None, manager_cls: type, attention_dp: bool = False
) -> bool:
    """Decided once, at the creation site; everything downstream trusts the registered resource.

    Upstream forces shared draft layers under attention DP, disaggregated serving and for M3. This
    fork keeps the separate manager only as an explicit, documented measurement switch
    (``speculative_config.draft_kv_cache: separate``); otherwise a manager class that supports shared
    draft layers gets them. Under attention DP a separate manager is an error, not a silent switch:
    each rank keeps the drafter's KV in its own unified cache.
    """
    if spec_config is None or spec_config.num_draft_layers == 0:
        return False
    separate = (
        spec_config.draft_kv_cache == "separate" or not manager_cls.supports_shared_draft_layers
    )
    if separate and attention_dp:
        raise ValueError(
            "speculative_config.draft_kv_cache='separate' is not supported with "
            "enable_attention_dp=True: each attention-DP rank keeps the drafter's KV in its own "
            "unified cache (use draft_kv_cache='unified')"
        )
    return separate


def resolve_draft_kv(resource_manager: ResourceManager) -> tuple[object | None, str]:
    """The manager the draft loop attends through, and the mode's name.

    1. a registered ``DRAFT_KV_CACHE_MANAGER`` (separate mode) wins;
    2. else the target manager's ``draft_subpage_view``, if its class defines one. The class is probed
       (no instance attribute lookup), then the property is read directly, so a failure while
       building the view propagates instead of silently meaning "no view";
    3. else ``None``: the drafter attends the target manager as it is; its draft layer in whole
       pages of the slots when the manager holds one (``whole_page_draft``: an MTP module's).
    """
    separate = resource_manager.get_resource_manager(ResourceManagerType.DRAFT_KV_CACHE_MANAGER)
    if separate is not None:
        return separate, SEPARATE_MODE
    target = resource_manager.get_resource_manager(ResourceManagerType.KV_CACHE_MANAGER)
    if target is not None and isinstance(
        inspect.getattr_static(type(target), "draft_subpage_view", None), property
    ):
        view = target.draft_subpage_view
        if view is not None:
            return view, VIEW_MODE
    if getattr(target, "whole_page_draft", False) and target.local_draft_layer_ids:
        return None, WHOLE_PAGE_MODE
    return None, DIRECT_MODE


def resolve_draft_kv_cache_manager(resource_manager: ResourceManager):
    """The manager the draft loop attends through (see ``resolve_draft_kv``)."""
    return resolve_draft_kv(resource_manager)[0]


class DraftKvModeTracker:
    """Resolves at each dispatch and remembers the mode (``mode``: None before the first); logs
    the mode at the first dispatch and at every change."""

    def __init__(self) -> None:
        self.mode: str | None = None

    def resolve(self, resource_manager: ResourceManager):
        manager, mode = resolve_draft_kv(resource_manager)
        if mode != self.mode:
            logger.info("[unified-kv] draft KV resolved: %s", mode)
            self.mode = mode
        return manager
