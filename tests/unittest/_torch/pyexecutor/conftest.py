import pytest

from tensorrt_llm._torch.pyexecutor.kv_cache_manager_v2 import KVCacheManagerV2


@pytest.fixture(autouse=True)
def integrity_after_every_step(monkeypatch):
    """Every step-protocol call in these tests is followed by ``check_integrity()``."""
    for name in (
        "prepare_resources",
        "update_resources",
        "free_resources",
        "add_sequence",
        "resize_sequence",
    ):
        original = getattr(KVCacheManagerV2, name)

        def wrapper(self, *args, _original=original, **kwargs):
            result = _original(self, *args, **kwargs)
            self.check_integrity()
            return result

        monkeypatch.setattr(KVCacheManagerV2, name, wrapper)
