"""The server's warm-up pays the front's one-time costs and sends nothing to the engine."""

import asyncio

from tensorrt_llm.serve import warm_up
from tensorrt_llm.serve.media import MediaOptions, MediaPool


class Tokenizer:
    special_tokens: list[str] = []  # (no control token to form)

    def __init__(self) -> None:
        self.calls: list[str] = []

    def apply_chat_template(self, messages):
        self.calls.append("template")
        return "".join(m["content"] for m in messages)

    def encode(self, text):
        self.calls.append("encode")
        return [ord(c) for c in text]

    def decode(self, ids):
        self.calls.append("decode")
        return "".join(map(chr, ids))


class FrontOnly:
    """An LLM with a tokenizer and nothing else: any use of the engine (``submit``, ``check``,
    ``generate``, ...) fails the test."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def __getattr__(self, name):
        raise AssertionError(f"the warm-up reached the engine: LLM.{name}")


def run(llm) -> None:
    pool = MediaPool(MediaOptions())
    try:
        asyncio.run(warm_up.warm_up_front(llm, pool))
    finally:
        pool.close()


def test_the_front_is_warmed_without_the_engine(monkeypatch):
    warnings = []  # (the warm-up logs what fails, an engine call included, and goes on)
    monkeypatch.setattr(warm_up.logger, "warning", lambda *args: warnings.append(args))
    tokenizer = Tokenizer()
    run(FrontOnly(tokenizer))
    assert tokenizer.calls == ["template", "encode", "decode"] and warnings == []


def test_a_warm_up_that_fails_is_logged_and_the_server_starts(monkeypatch):
    class Refusing(Tokenizer):
        def apply_chat_template(self, messages):
            raise ValueError("this template takes no user turn")

    warnings = []
    monkeypatch.setattr(warm_up.logger, "warning", lambda *args: warnings.append(args))
    run(FrontOnly(Refusing()))  # does not raise
    assert len(warnings) == 1 and "takes no user turn" in str(warnings[0][1])
