"""Helpers shared by the speculative-decoding workers, the creation site and the resource managers."""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING

from tensorrt_llm.logger import logger

if TYPE_CHECKING:
    from tensorrt_llm._torch.pyexecutor.resource_manager import ResourceManager
    from tensorrt_llm.llmapi.llm_args import Eagle3DecodingConfig


def get_num_spec_layers(spec_config: Eagle3DecodingConfig | None) -> int:
    """Draft layers a one-model speculative config appends to the target's KV cache (0 otherwise)."""
    if spec_config is None or not spec_config.eagle3_one_model:
        return 0
    return spec_config.num_eagle_layers


def get_num_extra_kv_tokens(spec_config: Eagle3DecodingConfig | None) -> int:
    """Positions a sequence may hold beyond its length within one step: the verify window
    (``max_draft_len`` drafts) plus the draft chain run after acceptance (up to ``max_draft_len - 1``
    more positions past the accepted tokens)."""
    return 0 if spec_config is None else 2 * spec_config.max_draft_len


def _should_create_separate_draft_kv_cache(
    spec_config: Eagle3DecodingConfig | None, manager_cls: type
) -> bool:
    """Decided once, at the creation site; everything downstream trusts the registered resource.

    Upstream forces shared draft layers under attention DP, disaggregated serving and for M3. This
    fork keeps the separate manager only as an explicit, documented measurement switch
    (``speculative_config.draft_kv_cache: separate``); otherwise a manager class that supports shared
    draft layers gets them.
    """
    if get_num_spec_layers(spec_config) == 0:
        return False
    if spec_config.draft_kv_cache == "separate":
        return True
    return not manager_cls.supports_shared_draft_layers


_resolved_mode: str | None = None


def resolve_draft_kv_cache_manager(resource_manager: ResourceManager):
    """The manager the draft loop attends through.

    1. a registered ``DRAFT_KV_CACHE_MANAGER`` (separate mode) wins;
    2. else the target manager's ``draft_subpage_view``, if its class defines one. The class is probed
       (no instance attribute lookup), then the property is read directly, so a failure while
       building the view propagates instead of silently meaning "no view";
    3. else ``None``: the drafter attends the target manager as it is.
    """
    from tensorrt_llm._torch.pyexecutor.resource_manager import ResourceManagerType

    separate = resource_manager.get_resource_manager(ResourceManagerType.DRAFT_KV_CACHE_MANAGER)
    if separate is not None:
        _log_mode("separate draft KV cache manager")
        return separate
    target = resource_manager.get_resource_manager(ResourceManagerType.KV_CACHE_MANAGER)
    if target is not None and isinstance(
        inspect.getattr_static(type(target), "draft_subpage_view", None), property
    ):
        view = target.draft_subpage_view
        if view is not None:
            _log_mode("target manager's draft sub-page view")
            return view
    _log_mode("none (the drafter attends the target manager directly)")
    return None


def get_draft_kv_cache_manager(resource_manager: ResourceManager):
    return resolve_draft_kv_cache_manager(resource_manager)


def _log_mode(mode: str) -> None:
    global _resolved_mode
    if mode != _resolved_mode:
        logger.info("[unified-kv] draft KV resolved: %s", mode)
        _resolved_mode = mode
