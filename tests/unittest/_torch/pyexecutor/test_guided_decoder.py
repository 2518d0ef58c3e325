"""The guided decoder's host side: the mask rows of a step with drafts (one per draft position,
the matcher walked through the drafts the grammar allows and rolled back), a refused draft's
later rows, requests waiting for their grammar, and the logits masking itself (torch and the
Triton kernel, against xgrammar's own)."""

import time
from types import SimpleNamespace

import pytest
import torch

from tensorrt_llm._torch.pyexecutor import grammar_matcher
from tensorrt_llm._torch.pyexecutor.grammar_matcher import GrammarCompiler
from tensorrt_llm._torch.pyexecutor.guided_decoder import GuidedDecoder
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequestState
from tensorrt_llm._torch.pyexecutor.token_bitmask import apply_token_bitmask, token_allowed
from tensorrt_llm.sampling_params import GuidedDecodingParams, SamplingParams
from tensorrt_llm.tokenizer import build_char_tokenizer

TOKENIZER = build_char_tokenizer("abc0123456789-", ["<unk>", "<eos>"])
EOS = 1
VOCAB = 40  # (the model's rows past the tokenizer's 16: never allowed)


def ids(text: str) -> list[int]:
    return [TOKENIZER.token_to_id(c) for c in text]


def request(request_id: int, guide: GuidedDecodingParams | None, out="", drafts=""):
    return SimpleNamespace(
        request_id=request_id,
        sampling_params=SamplingParams(guided_decoding=guide),
        end_ids=(EOS,),
        output_token_ids=ids(out),
        py_draft_tokens=ids(drafts),
        state=LlmRequestState.CONTEXT_INIT,
        is_finished=False,
        fail=lambda kind, message: None,
    )


def allowed(mask: torch.Tensor, row: int) -> str:
    tokens = token_allowed(mask[row : row + 1], VOCAB)[0].nonzero().flatten().tolist()
    return "".join("$" if t == EOS else TOKENIZER.id_to_token(t) for t in tokens)


@pytest.fixture
def decoder():
    return GuidedDecoder(GrammarCompiler(TOKENIZER, VOCAB, [EOS]))


def ready(decoder: GuidedDecoder, *requests) -> None:
    for r in requests:
        decoder.submit(r)
        assert (
            r.state is LlmRequestState.WAITING_FOR_GRAMMAR
            or r.sampling_params.guided_decoding is None
        )
    deadline = time.monotonic() + 30
    while decoder.compiling and time.monotonic() < deadline:
        assert decoder.poll() == []
        time.sleep(0.01)
    assert all(r.state is LlmRequestState.CONTEXT_INIT for r in requests)


def test_a_rows_positions_follow_its_drafts_and_the_matcher_comes_back(decoder):
    guide = GuidedDecodingParams(regex="a-[0-9]{2}c")
    walked = request(1, guide, out="a", drafts="-4b")  # (b: refused)
    free = request(2, None, drafts="abc")
    ready(decoder, walked, free)
    mask = decoder.fill([walked, free], width=4)
    assert mask.shape == (8, 2) and mask.dtype == torch.int32  # 40 tokens: two words a row
    assert [allowed(mask, r) for r in range(3)] == ["-", "0123456789", "0123456789"]
    assert (mask[3] == -1).all()  # after the refused "b": never read
    assert (mask[4:] == -1).all()  # a request without a grammar: every token
    # the matcher is where the emitted tokens left it: the same rows again
    assert torch.equal(decoder.fill([walked, free], width=4), mask)
    # the step's tokens are emitted; the next step catches up with them
    walked.output_token_ids += ids("-4")
    walked.py_draft_tokens = ids("2c")
    mask = decoder.fill([walked], width=3)
    assert [allowed(mask, r) for r in range(3)] == ["0123456789", "c", "$"]


def test_the_drafts_masks_follow_the_steps_tokens_and_each_draft_then_give_them_back(decoder):
    """``drafting``: the first draft's mask after the step's new tokens (its accepted drafts and
    the bonus), each next one after the draft before; rows without a grammar, padding rows and a
    row whose draft the grammar refuses are not masked; ``end`` gives every token back."""
    walked = request(1, GuidedDecodingParams(regex="a-[0-9]{2}c"), out="a", drafts="-4")
    other = request(2, GuidedDecodingParams(regex="a-[0-9]{2}c"), out="a", drafts="-4")
    free = request(3, None, drafts="ab")
    ready(decoder, walked, other, free)
    before = decoder.fill([walked, other, free], width=3)
    guide = decoder.drafting([walked, other, free], torch.device("cpu"))
    # the step accepted "-" and "4" of walked's drafts (then the bonus "7"), none of other's
    # (its bonus "-"); the fourth row is padding
    tokens = torch.tensor([ids("-47"), ids("-bb"), ids("abc"), ids("000")])
    guide.begin(tokens, torch.tensor([2, 0, 0, 0]))
    first = guide.mask(None)
    assert first.shape == (4, 2)
    assert [allowed(first, 0), allowed(first, 1)] == ["c", "0123456789"]
    assert (first[2:] == -1).all()
    second = guide.mask(torch.tensor(ids("c500")))  # walked ends; other takes "5"
    assert allowed(second, 0) == "$" and allowed(second, 1) == "0123456789"
    assert guide.mask(torch.tensor([EOS, *ids("b00")])) is None  # walked ends, other refuses b
    guide.end()
    assert torch.equal(decoder.fill([walked, other, free], width=3), before)
    assert decoder.drafting([free], torch.device("cpu")) is None


def test_a_refused_draft_leaves_the_rows_after_it_unconstrained(decoder):
    walked = request(1, GuidedDecodingParams(regex="abc"), drafts="ab3")
    ready(decoder, walked)
    mask = decoder.fill([walked], width=4)
    assert [allowed(mask, r) for r in range(3)] == ["a", "b", "c"]
    assert (mask[3] == -1).all()  # after the refused "3": never read


def draft_ids(drafts: str) -> list[int]:
    return [EOS if c == "$" else TOKENIZER.token_to_id(c) for c in drafts]


def serial_rows(compiler: GrammarCompiler, guide, out: str, drafts: str, width: int):
    """One request's rows as a lone matcher fills them, one position at a time."""
    matcher = compiler.matcher(compiler.submit(guide).result(timeout=30), [EOS])
    rows = torch.full((width, 2), -1, dtype=torch.int32)
    for token in ids(out):
        assert matcher.accept_token(token)
    if matcher.is_terminated():
        return rows
    matcher.fill_next_token_bitmask(rows, 0)
    for j, draft in enumerate(draft_ids(drafts)[: width - 1]):
        if not matcher.accept_token(draft) or matcher.is_terminated():
            break
        matcher.fill_next_token_bitmask(rows, j + 1)
    return rows


@pytest.mark.parametrize("threads", ["this", "xgrammar's"])
def test_the_batched_fill_gives_each_request_its_own_rows_and_rolls_every_matcher_back(
    decoder, threads, monkeypatch
):
    """Many requests' rows filled depth by depth in batched calls (on this thread, or on
    xgrammar's) equal each request's filled alone: drafts all taken, refused at each depth,
    ending the grammar midway, none; a finished grammar; requests without one between them."""
    if threads != "this":
        monkeypatch.setattr(grammar_matcher, "PARALLEL_FILL_ROWS", 0)
    cases = [
        ("a-[0-9]{2}c", "a", "-42"),
        ("a-[0-9]{2}c", "a", "b12"),
        ("a-[0-9]{2}c", "a-", "1bc"),
        ("a-[0-9]{2}c", "a-1", "2cb"),
        ("a-[0-9]{2}c", "a-1", "2c$"),  # the third draft ends the grammar (its end token)
        ("a-[0-9]{2}c", "a-12", "c$1"),  # the second does
        ("[0-9]+", "", "12a"),
        ("[0-9]+", "3", ""),
        ("abc", "abc", "1"),  # finished: its matcher takes nothing more
        (None, "", "abc"),
        ("(ab|ac)+", "ab", "acab"),
    ]
    width = 4
    requests = [
        request(i, GuidedDecodingParams(regex=g) if g else None, out=o)
        for i, (g, o, _) in enumerate(cases)
    ]
    for r, (_, _, d) in zip(requests, cases, strict=True):
        r.py_draft_tokens = draft_ids(d)
    ready(decoder, *requests)
    mask = decoder.fill(requests, width)
    for i, (g, o, d) in enumerate(cases):
        got = mask[i * width : (i + 1) * width]
        want = (
            serial_rows(decoder.compiler, GuidedDecodingParams(regex=g), o, d, width)
            if g
            else torch.full_like(got, -1)
        )
        assert torch.equal(got, want), cases[i]
    assert torch.equal(decoder.fill(requests, width), mask)  # every matcher rolled back


def test_a_grammar_that_fails_to_compile_ends_its_request_alone(decoder):
    bad = request(1, GuidedDecodingParams(grammar="root ::= nowhere"))
    good = request(2, GuidedDecodingParams(regex="a"))
    errors = []
    bad.fail = lambda kind, message: errors.append((kind, message))
    decoder.submit(bad)
    decoder.submit(good)
    failed = []
    deadline = time.monotonic() + 30
    while decoder.compiling and time.monotonic() < deadline:
        failed += decoder.poll()
        time.sleep(0.01)
    assert failed == [bad] and errors[0][0] == "invalid_request"
    assert "guided_decoding" in errors[0][1]
    assert good.state is LlmRequestState.CONTEXT_INIT and decoder.guided(good)


def test_the_same_constraint_compiles_once(decoder):
    guide = GuidedDecodingParams(regex="a+")
    first = decoder.compiler.submit(guide)
    assert decoder.compiler.submit(GuidedDecodingParams(regex="a+")) is first
    assert decoder.compiler.submit(GuidedDecodingParams(regex="b+")) is not first


@pytest.mark.parametrize("kernel", [False, True], ids=["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masking_the_logits_matches_xgrammar(kernel, dtype):
    """(The kernel on a CPU: under Triton's interpreter, as ``conftest.py`` sets it.)"""
    import xgrammar as xgr

    generator = torch.Generator().manual_seed(0)
    vocab, rows = 5000, 3
    mask = torch.randint(-(2**31), 2**31 - 1, (rows, (vocab + 31) // 32), generator=generator)
    mask = mask.to(torch.int32)
    logits = torch.randn(rows, vocab, generator=generator).to(dtype)
    want = logits.float()
    xgr.apply_token_bitmask_inplace(want, mask)
    apply_token_bitmask(logits, mask, kernel=kernel)
    assert torch.equal(logits.float(), want)


def test_a_constraint_the_vocabulary_cannot_write_ends_its_request(decoder):
    """(The tokenizer has no "x": a row allowing nothing would sample garbage.)"""
    stuck = request(1, GuidedDecodingParams(regex="ax"), out="a")
    errors = []
    stuck.fail = lambda kind, message: errors.append((kind, message))
    ready(decoder, stuck)
    mask = decoder.fill([stuck], width=2)
    assert (mask == -1).all() and errors[0][0] == "invalid_request"
    assert "no token of this model's vocabulary" in errors[0][1]
    assert decoder.poll() == [stuck] and decoder.poll() == []


def test_a_request_loading_its_kv_compiles_beside_and_waits_only_if_it_must(decoder):
    """A generation-only request: its grammar compiles while its KV is pulled (its state left
    alone); joining the batch before the grammar is ready, it waits, then goes on as it was; a
    grammar that fails ends it only once it joins (its KV load is not cut short)."""
    loading = LlmRequestState.DISAGG_GENERATION_TRANS_IN_PROGRESS
    ready_first = request(1, GuidedDecodingParams(regex="a"))
    ready_first.state = loading
    decoder.submit(ready_first, beside=True)
    assert ready_first.state is loading
    deadline = time.monotonic() + 30
    while not decoder.guided(ready_first) and time.monotonic() < deadline:
        assert decoder.poll() == []
        time.sleep(0.01)
    assert ready_first.state is loading  # compiled while it loaded: nothing to wait for
    decoder.hold(ready_first)
    assert ready_first.state is loading

    bad = request(2, GuidedDecodingParams(grammar="root ::= nowhere"))
    bad.state, errors = loading, []
    bad.fail = lambda kind, message: errors.append(kind)
    decoder.submit(bad, beside=True)
    decoder.compiler.submit(bad.sampling_params.guided_decoding).exception(timeout=30)
    assert decoder.poll() == [] and not errors  # still loading: not ended yet
    bad.state = LlmRequestState.GENERATION_IN_PROGRESS  # its KV arrived
    decoder.hold(bad)
    assert bad.state is LlmRequestState.WAITING_FOR_GRAMMAR
    assert decoder.poll() == [bad] and errors == ["invalid_request"]


def test_a_schema_is_written_in_its_order_with_or_without_whitespace():
    """Properties in the schema's order; ``disable_any_whitespace``: no blank anywhere."""
    tokenizer = build_char_tokenizer('{}":, ab12', ["<unk>", "<eos>"])
    compiler = GrammarCompiler(tokenizer, 16, [1])
    schema = {"properties": {"b": {"type": "integer"}, "a": {"type": "integer"}}}
    schema |= {"required": ["b", "a"], "additionalProperties": False}

    def takes(compact: bool, text: str) -> bool:
        guide = GuidedDecodingParams(json=schema, disable_any_whitespace=compact)
        matcher = compiler.matcher(compiler.submit(guide).result(), [1])
        return all(matcher.accept_token(tokenizer.token_to_id(c)) for c in text)

    assert takes(False, '{"b": 1, "a": 2}') and takes(False, '{"b":1,"a":2}')
    assert not takes(False, '{"a"')
    assert takes(True, '{"b":1,"a":2}')
    assert not takes(True, '{"b": 1') and not takes(True, '{ "b"')
