"""The grammar gate and the limits a constraint is held to before any grammar is built."""

import asyncio
from concurrent.futures import Future

import pytest

from tensorrt_llm.llmapi.core_handle import EngineCoreLost
from tensorrt_llm.logger import plain_message
from tensorrt_llm.sampling_params import GuidedDecodingParams, SamplingParamsError
from tensorrt_llm.serve import grammar_limits
from tensorrt_llm.serve.errors import ServerError
from tensorrt_llm.serve.grammar_gate import GrammarGate
from tensorrt_llm.serve.structured_output import FormatError, structured_guide

GUIDE_A = GuidedDecodingParams(regex="a+")
GUIDE_B = GuidedDecodingParams(regex="b+")


class Engine:
    """``LLM.compile_guide`` as the gate sees it: a compile per call, ended by the test."""

    def __init__(self) -> None:
        self.compiles: list[tuple[GuidedDecodingParams, Future]] = []

    def compile_guide(self, guide: GuidedDecodingParams) -> Future:
        future: Future = Future()
        self.compiles.append((guide, future))
        return future


def field() -> str:
    return "response_format"


def test_a_compile_past_the_deadline_is_a_400_naming_the_field_and_counts_until_it_ends():
    engine = Engine()
    gate = GrammarGate(engine.compile_guide, max_builds=1, deadline_s=0.05)

    async def run():
        with pytest.raises(ServerError) as caught:
            await gate.build(lambda: GUIDE_A, field)
        assert (caught.value.status, caught.value.param) == (400, "response_format")
        assert "not built within 0.05 s" in caught.value.message
        with pytest.raises(ServerError) as caught:  # (A's compile still runs: B never starts)
            await gate.build(lambda: GUIDE_B, field)
        assert caught.value.status == 503 and "retry later" in caught.value.message
        engine.compiles[0][1].set_result(None)
        built = asyncio.ensure_future(gate.build(lambda: GUIDE_B, field))
        while len(engine.compiles) < 2:
            await asyncio.sleep(0.01)
        engine.compiles[1][1].set_result(None)
        assert await built is GUIDE_B

    asyncio.run(run())
    assert [guide for guide, _ in engine.compiles] == [GUIDE_A, GUIDE_B]
    gate.close()


GUIDE_C = GuidedDecodingParams(regex="c+")


def test_requests_share_a_running_compile_and_a_new_one_waits_for_room():
    """One compile at most: a second constraint waits for the first to end, a third (past one
    waiting) is a 503, and requests under a compiling constraint share its compile."""
    engine = Engine()
    gate = GrammarGate(engine.compile_guide, max_builds=1, deadline_s=5, max_waiting=1)

    async def run():
        first = asyncio.ensure_future(gate.build(lambda: GUIDE_A, field))
        same = asyncio.ensure_future(gate.build(lambda: GUIDE_A, field))
        while len(engine.compiles) < 1:
            await asyncio.sleep(0.01)
        waiting = asyncio.ensure_future(gate.build(lambda: GUIDE_B, field))
        await asyncio.sleep(0.05)
        with pytest.raises(ServerError) as caught:
            await gate.build(lambda: GUIDE_C, field)
        assert caught.value.status == 503 and "retry later" in caught.value.message
        assert len(engine.compiles) == 1 and not waiting.done()
        engine.compiles[0][1].set_result(None)
        assert await first is GUIDE_A and await same is GUIDE_A
        while len(engine.compiles) < 2:
            await asyncio.sleep(0.01)
        engine.compiles[1][1].set_result(None)
        assert await waiting is GUIDE_B

    asyncio.run(run())
    assert [guide for guide, _ in engine.compiles] == [GUIDE_A, GUIDE_B]
    gate.close()


def test_a_request_that_waits_for_room_past_its_deadline_is_a_503():
    engine = Engine()
    gate = GrammarGate(engine.compile_guide, max_builds=1, deadline_s=0.1)

    async def run():
        running = asyncio.ensure_future(gate.build(lambda: GUIDE_A, field))
        await asyncio.sleep(0.02)
        with pytest.raises(ServerError) as caught:
            await gate.build(lambda: GUIDE_B, field)
        assert caught.value.status == 503
        with pytest.raises(ServerError) as caught:
            await running
        assert caught.value.status == 400  # (its own compile passed the deadline)

    asyncio.run(run())
    gate.close()


def test_the_engines_refusal_is_a_400_naming_the_field_and_a_lost_core_passes_through():
    engine = Engine()
    gate = GrammarGate(engine.compile_guide)

    async def refused(error: Exception) -> Exception:
        task = asyncio.ensure_future(gate.build(lambda: GUIDE_A, field))
        while not engine.compiles or engine.compiles[-1][1].done():
            await asyncio.sleep(0.01)
        engine.compiles[-1][1].set_exception(error)
        with pytest.raises(Exception) as caught:
            await task
        return caught.value

    async def run():
        bad = await refused(SamplingParamsError("guided_decoding", "GuidedDecodingParams.regex: x"))
        assert (bad.status, bad.param) == (400, "response_format")
        assert bad.message == "response_format: x"
        lost = await refused(EngineCoreLost("the engine core's process exited"))
        assert isinstance(lost, EngineCoreLost)  # (a 503 at the edge)

        def no_tools():
            raise ServerError(400, "tool_choice: bad", param="tool_choice")

        with pytest.raises(ServerError, match="tool_choice: bad"):
            await gate.build(no_tools, field)
        assert await gate.build(lambda: None, field) is None

    asyncio.run(run())
    gate.close()


def nested(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize(
    "kind, value, words",
    [
        ("json", nested(2000), "deeper than 128"),
        ("json", '{"properties": {"a": ' * 2000 + "{}" + "}}" * 2000, "deeper than 128"),
        ("json", "[" * 100_000 + "]" * 100_000, "bytes; at most"),
        ("json", "[" * 30_000 + "]" * 30_000, "deeper than 128"),
        ("json", {"properties": {f"p{i}": {} for i in range(1025)}}, "1025 properties"),
        ("json", {"enum": list(range(1025))}, "1025 enum values"),
        ("json", {"examples": [0] * 40_000}, "more than 32768 values"),
        ("regex", "a" * 4097, "4097 characters"),
        ("grammar", "root ::= " + '"a" ' * 20_000, "bytes; at most"),
        ("structural_tag", {"format": nested(100)}, "deeper than 128"),
    ],
)
def test_a_constraint_past_a_limit_is_refused_naming_its_field(kind, value, words):
    with pytest.raises(ValueError, match="structured_outputs.x") as caught:
        grammar_limits.check_constraint(kind, value, "structured_outputs.x")
    assert words in str(caught.value)


def test_a_constraint_within_the_limits_passes():
    grammar_limits.check_constraint("json", nested(60), "x")
    grammar_limits.check_constraint("regex", "[a-z]{1,8}", "x")
    grammar_limits.check_choices(["yes", "no"], "x")
    with pytest.raises(ValueError, match="257 strings"):
        grammar_limits.check_choices(["c"] * 257, "x")


def test_a_native_librarys_message_loses_its_clock_and_source_paths():
    native = RuntimeError(
        "[05:28:29] /project/cpp/grammar_parser.cc:820: EBNF parser error at line 1, column 10: "
        'Rule "foo" is not defined\nmore'
    )
    assert (
        plain_message(native) == 'EBNF parser error at line 1, column 10: Rule "foo" is not defined'
    )
    assert plain_message(RuntimeError("failed in /a/b/kernels.cu:42 x")) == "failed in <source> x"
    assert plain_message(RuntimeError("")) == "RuntimeError"
    check = "[05:48:26] /project/cpp/a.cc:9: Check failed: (x.ok()) is false: rule r"
    assert plain_message(RuntimeError(check)) == "an internal check failed: rule r"


@pytest.mark.parametrize("tag", [{"a": 1}, '{"format": 3}', "[]"])
def test_a_structural_tag_without_a_format_is_refused_naming_structured_outputs(tag):
    with pytest.raises(FormatError, match="structural_tag must be an object with a format"):
        structured_guide({"structural_tag": tag}, None)
