"""The output side: incremental detokenization and stop strings, on a byte-level toy tokenizer
whose characters can span several tokens (as byte-level BPE does)."""

import pytest

from tensorrt_llm._torch.pyexecutor.llm_request import FinishReason, LlmRequest
from tensorrt_llm.llmapi.outputs import IncrementalDetokenizer, OutputTracker
from tensorrt_llm.sampling_params import SamplingParams


def decode(tokens: list[int]) -> str:
    """One token per byte: a character of 2 to 4 UTF-8 bytes takes 2 to 4 tokens."""
    return bytes(tokens).decode("utf-8", errors="replace")


def encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))


TEXT = "naïve café → 北京 ok 😀!"


def test_the_incremental_text_is_the_whole_decode_and_never_shows_half_a_character():
    detokenizer = IncrementalDetokenizer(decode)
    deltas = [detokenizer.add(token) for token in encode(TEXT)]
    assert "".join(deltas) == detokenizer.text == TEXT
    assert not any("\ufffd" in delta for delta in deltas)
    assert deltas.count("") == len(encode(TEXT)) - len(TEXT)  # continuation bytes show nothing


def tracker_for(text: str, stop: list[str], end: int | None = None) -> OutputTracker:
    params = SamplingParams(max_tokens=64, stop=stop)
    request = LlmRequest(1, [1, 2], 64, params, end_ids=(end,) if end is not None else ())
    request.output_token_ids = encode(text)
    return OutputTracker(request, None, decode)


@pytest.mark.parametrize("stop", ["北京", "é →", "!"])
def test_a_stop_string_ends_the_output_at_the_token_that_completes_it(stop):
    tracker = tracker_for(TEXT, ["zzz", stop])
    assert tracker.consume() == stop
    end = TEXT.index(stop) + len(stop)
    kept = len(TEXT[:end].encode("utf-8"))
    out = tracker.output(finished=True).outputs[0]
    assert out.token_ids == encode(TEXT)[:kept]
    assert out.text == TEXT[: TEXT.index(stop)]


def test_the_earliest_of_several_stop_strings_wins():
    tracker = tracker_for("one two three", ["three", "two"])
    assert tracker.consume() == "two"
    assert tracker.output(finished=True).outputs[0].text == "one "


def test_tokens_arriving_over_several_steps_find_a_string_split_between_them():
    tracker = tracker_for("", ["cd"])
    request = tracker.request
    for chunk in ("ab", "c", "de"):
        assert tracker.output(finished=False).outputs[0].text == decode(request.output_token_ids)
        request.output_token_ids += encode(chunk)
        hit = tracker.consume()
    assert hit == "cd"
    assert tracker.output(finished=True).outputs[0].token_ids == encode("abcd")


def test_an_end_token_that_stopped_the_request_is_not_text():
    tracker = tracker_for("hi", [], end=0)
    tracker.request.output_token_ids.append(0)
    tracker.request.finish(FinishReason.STOP, 0)
    assert tracker.consume() is None
    out = tracker.output(finished=True).outputs[0]
    assert out.text == "hi" and out.token_ids == [*encode("hi"), 0]


def test_without_detokenize_there_is_no_text_and_no_stop_string():
    params = SamplingParams(max_tokens=8, detokenize=False)
    request = LlmRequest(1, [1], 8, params)
    request.output_token_ids = encode("abc")
    tracker = OutputTracker(request, None, decode)
    assert tracker.consume() is None
    out = tracker.output(finished=False).outputs[0]
    assert out.text == "" and out.token_ids == encode("abc")


def test_a_steps_output_is_a_snapshot_that_copies_the_tokens_only_when_read():
    params = SamplingParams(max_tokens=64, logprobs=0)
    request = LlmRequest(1, [1, 2], 64, params)
    tracker = OutputTracker(request, None, decode)
    request.output_token_ids.extend(encode("ab"))
    request.py_logprobs.extend([(-0.5, []), (-0.25, [])])
    tracker.consume()
    first = tracker.output(finished=False).outputs[0]
    request.output_token_ids.extend(encode("cd"))  # the next steps' tokens
    request.py_logprobs.extend([(-1.0, []), (-2.0, [])])
    tracker.consume()
    second = tracker.output(finished=False).outputs[0]
    assert (first.num_tokens, first.text, second.num_tokens, second.text) == (2, "ab", 4, "abcd")
    assert first.tokens_from(1) == encode("b") and first.logprobs_from(1) == [(-0.25, [])]
    assert first.token_ids == encode("ab") and first.logprobs == [(-0.5, []), (-0.25, [])]
    assert first.token_ids is not request.output_token_ids  # (read: a list of its own)
    assert second.token_ids == encode("abcd")
