"""Which manager the draft loop attends through, decided from the registered resources."""

import logging

import pytest
import torch

from tensorrt_llm._torch.attention_backend.sparse.minimax_m3 import cache_manager as m3
from tensorrt_llm._torch.pyexecutor.kv_cache_manager_v2 import KVCacheManagerV2
from tensorrt_llm._torch.pyexecutor.resource_manager import ResourceManager, ResourceManagerType
from tensorrt_llm._torch.speculative import utils
from tensorrt_llm.llmapi.llm_args import Eagle3DecodingConfig, KvCacheConfig

EAGLE = Eagle3DecodingConfig(max_draft_len=3)
COMMON = dict(
    head_dim=8, tokens_per_block=128, max_seq_len=512, max_batch_size=2, dtype=torch.float16
)


def target(cls=m3.MiniMaxM3KVCacheManagerV2, **kw):
    extra = {"num_one_model_draft_layers": 1} if cls is m3.MiniMaxM3KVCacheManagerV2 else {}
    return cls(
        KvCacheConfig(max_tokens=1024),
        num_layers=2,
        num_kv_heads=[2, 2, 4],
        spec_config=EAGLE,
        **extra,
        **COMMON,
        **kw,
    )


def registry(target_manager, draft_manager=None):
    managers = {ResourceManagerType.KV_CACHE_MANAGER: target_manager}
    if draft_manager is not None:
        managers[ResourceManagerType.DRAFT_KV_CACHE_MANAGER] = draft_manager
    return ResourceManager(managers)


def test_a_registered_separate_manager_wins():
    separate = KVCacheManagerV2(
        KvCacheConfig(max_tokens=1024, enable_block_reuse=False),
        num_layers=2,
        num_kv_heads=[2, 2, 4],
        spec_config=EAGLE,
        is_draft=True,
        layer_mask=[False, False, True],
        **COMMON,
    )
    assert utils.resolve_draft_kv_cache_manager(registry(target(), separate)) is separate


def test_the_target_view_is_the_fallback_and_both_lookups_agree():
    mgr = target()
    resources = registry(mgr)
    assert utils.resolve_draft_kv_cache_manager(resources) is mgr.draft_subpage_view
    assert utils.get_draft_kv_cache_manager(resources) is mgr.draft_subpage_view


def test_a_manager_without_a_view_resolves_to_none():
    assert utils.resolve_draft_kv_cache_manager(registry(target(KVCacheManagerV2))) is None


def test_a_view_construction_error_propagates(monkeypatch):
    def broken(self, *args, **kwargs):
        raise AttributeError("stale field in the view")

    monkeypatch.setattr(m3.MiniMaxM3DraftSubpageView, "__init__", broken)
    with pytest.raises(AttributeError, match="stale field"):
        utils.resolve_draft_kv_cache_manager(registry(target()))


def test_resolution_is_logged_at_first_dispatch_and_at_every_change(caplog, monkeypatch):
    monkeypatch.setattr(utils, "_resolved_mode", None)
    plain, shared = registry(target(KVCacheManagerV2)), registry(target())
    with caplog.at_level(logging.INFO, logger="tensorrt_llm"):
        for resources in (shared, shared, plain, shared):
            utils.resolve_draft_kv_cache_manager(resources)
    lines = [r.getMessage() for r in caplog.records if "draft KV resolved" in r.getMessage()]
    assert lines == [
        "[unified-kv] draft KV resolved: target manager's draft sub-page view",
        "[unified-kv] draft KV resolved: none (the drafter attends the target manager directly)",
        "[unified-kv] draft KV resolved: target manager's draft sub-page view",
    ]


def test_separate_creation_is_decided_once_from_the_config_and_the_manager_class():
    separate = Eagle3DecodingConfig(max_draft_len=3, draft_kv_cache="separate")
    assert not utils._should_create_separate_draft_kv_cache(EAGLE, m3.MiniMaxM3KVCacheManagerV2)
    assert utils._should_create_separate_draft_kv_cache(separate, m3.MiniMaxM3KVCacheManagerV2)
    assert utils._should_create_separate_draft_kv_cache(EAGLE, KVCacheManagerV2)
    assert not utils._should_create_separate_draft_kv_cache(None, KVCacheManagerV2)
