import logging

import pytest

from tensorrt_llm import envs
from tensorrt_llm.logger import Logger


def test_env_vars_are_parsed_on_every_read(monkeypatch):
    monkeypatch.delenv("TRTLLM_M3_DRAFT_KV_TOKENS_PER_BLOCK", raising=False)
    assert envs.TRTLLM_M3_DRAFT_KV_TOKENS_PER_BLOCK.get() is None
    monkeypatch.setenv("TRTLLM_M3_DRAFT_KV_TOKENS_PER_BLOCK", "64")
    assert envs.TRTLLM_M3_DRAFT_KV_TOKENS_PER_BLOCK.get() == 64
    monkeypatch.setenv("TRTLLM_M3_DRAFT_KV_TOKENS_PER_BLOCK", "sixty")
    with pytest.raises(ValueError, match="TRTLLM_M3_DRAFT_KV_TOKENS_PER_BLOCK='sixty'"):
        envs.TRTLLM_M3_DRAFT_KV_TOKENS_PER_BLOCK.get()


def test_every_declared_variable_is_a_trtllm_variable():
    names = [var.name for var in envs.ALL]
    assert len(set(names)) == len(names) and all(n.startswith("TRTLLM_") for n in names)


def test_info_once_logs_a_key_once(caplog):
    log = Logger("tensorrt_llm.test")
    log.set_level("info")
    with caplog.at_level(logging.INFO, logger="tensorrt_llm.test"):
        log.info_once("[unified-kv] hello", key="k")
        log.info_once("[unified-kv] hello again", key="k")
        log.debug("hidden")
    assert [r.getMessage() for r in caplog.records] == ["[unified-kv] hello"]
    with pytest.raises(ValueError, match="unknown log level 'loud'"):
        log.set_level("loud")
