"""Which manager the draft loop attends through, decided from the registered resources."""

import logging

import pytest
from m3_helpers import executor_config, tiny_config

from tensorrt_llm._torch.attention_backend.sparse.minimax_m3 import cache_manager as m3
from tensorrt_llm._torch.pyexecutor._util import create_kv_cache_managers
from tensorrt_llm._torch.pyexecutor.kv_cache_manager_v2 import KVCacheManagerV2
from tensorrt_llm._torch.pyexecutor.resource_manager import ResourceManager, ResourceManagerType
from tensorrt_llm._torch.speculative import utils
from tensorrt_llm._torch.speculative.interface import Eagle3SpecConfig

EAGLE = Eagle3SpecConfig(max_draft_len=3, speculative_model="unused")
SEPARATE = Eagle3SpecConfig(3, "unused", draft_kv_cache="separate")


def build(cls=m3.MiniMaxM3KVCacheManagerV2, spec=EAGLE):
    """The creation site's managers for a 2-layer M3 and a 4-KV-head drafter, by manager class."""
    runtime = executor_config(128, max_tokens=1024, max_seq_len=512, max_batch_size=2, spec=spec)
    return create_kv_cache_managers(tiny_config(num_hidden_layers=2), runtime, (4, 8), cls)


def target(cls=m3.MiniMaxM3KVCacheManagerV2):
    return build(cls)[ResourceManagerType.KV_CACHE_MANAGER]


def registry(target_manager, draft_manager=None):
    managers = {ResourceManagerType.KV_CACHE_MANAGER: target_manager}
    if draft_manager is not None:
        managers[ResourceManagerType.DRAFT_KV_CACHE_MANAGER] = draft_manager
    return ResourceManager(managers)


def test_a_registered_separate_manager_wins():
    managers = build(spec=SEPARATE)
    separate = managers[ResourceManagerType.DRAFT_KV_CACHE_MANAGER]
    assert utils.resolve_draft_kv_cache_manager(ResourceManager(managers)) is separate


def test_the_target_view_is_the_fallback():
    mgr = target()
    assert utils.resolve_draft_kv_cache_manager(registry(mgr)) is mgr.draft_subpage_view


def test_a_manager_without_a_view_resolves_to_none():
    assert utils.resolve_draft_kv_cache_manager(registry(target(KVCacheManagerV2))) is None


def test_a_view_construction_error_propagates(monkeypatch):
    def broken(self, *args, **kwargs):
        raise AttributeError("stale field in the view")

    monkeypatch.setattr(m3.MiniMaxM3DraftSubpageView, "__init__", broken)
    with pytest.raises(AttributeError, match="stale field"):
        utils.resolve_draft_kv_cache_manager(registry(target()))


def test_resolution_is_logged_at_first_dispatch_and_at_every_change(caplog, monkeypatch):
    plain = registry(build(KVCacheManagerV2, spec=None)[ResourceManagerType.KV_CACHE_MANAGER])
    shared = registry(target())
    tracker = utils.DraftKvModeTracker()
    assert tracker.mode is None
    with caplog.at_level(logging.INFO, logger="tensorrt_llm"):
        for resources in (shared, shared, plain, shared):
            tracker.resolve(resources)
    assert tracker.mode == utils.VIEW_MODE
    lines = [r.getMessage() for r in caplog.records if "draft KV resolved" in r.getMessage()]
    assert lines == [
        "[unified-kv] draft KV resolved: target manager's draft sub-page view",
        "[unified-kv] draft KV resolved: none (the drafter attends the target manager directly)",
        "[unified-kv] draft KV resolved: target manager's draft sub-page view",
    ]


def test_separate_creation_is_decided_once_from_the_config_and_the_manager_class():
    assert not utils._should_create_separate_draft_kv_cache(EAGLE, m3.MiniMaxM3KVCacheManagerV2)
    assert utils._should_create_separate_draft_kv_cache(SEPARATE, m3.MiniMaxM3KVCacheManagerV2)
    assert utils._should_create_separate_draft_kv_cache(EAGLE, KVCacheManagerV2)
    assert not utils._should_create_separate_draft_kv_cache(None, KVCacheManagerV2)
