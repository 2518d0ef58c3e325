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


def test_a_rank_is_named_in_every_line_while_set():
    log = Logger("tensorrt_llm.test_rank")
    (handler,) = log._logger.handlers
    record = logging.LogRecord("x", logging.INFO, "", 0, "[unified-kv] hi", None, None)
    log.set_rank(1)
    assert handler.format(record) == "[TRT-LLM] [RANK 1] [INFO] [unified-kv] hi"
    log.set_rank(None)
    assert handler.format(record) == "[TRT-LLM] [INFO] [unified-kv] hi"
