"""Guided decoding through ``LLM``: every output of a random tiny model (a character tokenizer that
can write JSON) matches its constraint and ends at the end token, greedy and sampled, constrained
and unconstrained requests in one batch; bad constraints are refused naming the field, and a
request whose grammar cannot be built ends alone."""

import json
import re
from pathlib import Path

import jsonschema
import pytest
from llm_helpers import ALPHABET, write_tiny_checkpoint

from tensorrt_llm import LLM, GuidedDecodingParams, SamplingParams
from tensorrt_llm.llmapi.llm_args import KvCacheConfig

JSON_ALPHABET = ALPHABET + '{}[]"_'
SCHEMA = {
    "type": "object",
    "properties": {
        "mode": {"enum": ["on", "off"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 2},
        "note": {"type": ["null", "boolean"]},
        "inner": {
            "type": "object",
            "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9}},
            "required": ["x"],
            "additionalProperties": False,
        },
    },
    "required": ["mode", "n", "tags", "note", "inner"],
    "additionalProperties": False,
}
REGEX = r"(yes|no)-[0-9]{2}"
EBNF = 'root ::= "sum:" [0-9] [0-9]? " " ("ok" | "bad")'


def guided_llm(model, max_batch_size: int = 8, **options) -> LLM:
    """An ``LLM`` of ``model`` on the CPU with xgrammar, KV for ``max_batch_size`` requests."""
    return LLM(
        str(model),
        device="cpu",
        guided_decoding_backend="xgrammar",
        max_batch_size=max_batch_size,
        kv_cache_config=KvCacheConfig(max_tokens=max_batch_size * 768),
        **options,
    )


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    model = write_tiny_checkpoint(
        tmp_path_factory.mktemp("tiny_json"), alphabet=JSON_ALPHABET, max_position_embeddings=1024
    )
    llm = guided_llm(model)
    yield llm
    llm.shutdown()


def params(guide: GuidedDecodingParams | None, sampled: bool) -> SamplingParams:
    sampling = {"temperature": 1.0, "top_p": 0.95, "seed": 3} if sampled else {"temperature": 0}
    return SamplingParams(max_tokens=600, guided_decoding=guide, **sampling)


def check_json_schema(text: str) -> bool:
    jsonschema.validate(json.loads(text), SCHEMA)  # (raises when it does not)
    return True


CASES = [  # constraints a random model must finish (each of finite length)
    (GuidedDecodingParams(json=SCHEMA), check_json_schema),
    (GuidedDecodingParams(regex=REGEX), lambda t: re.fullmatch(REGEX, t)),
    (GuidedDecodingParams(grammar=EBNF), lambda t: re.fullmatch(r"sum:\d\d? (ok|bad)", t)),
]
ANY_OBJECT = GuidedDecodingParams(json_object=True)  # (a random model may never close it)


def accepted(llm, guide: GuidedDecodingParams, token_ids: list[int]) -> bool:
    """Whether a fresh matcher of ``guide`` takes every token."""
    from tensorrt_llm._torch.pyexecutor.grammar_matcher import GrammarCompiler

    compiler = GrammarCompiler(llm.tokenizer.tokenizer, llm.model_config.vocab_size, [1])
    matcher = compiler.matcher(compiler.submit(guide).result(), [1])
    return all(matcher.accept_token(t) for t in token_ids)


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_every_output_matches_its_constraint_in_a_mixed_batch(llm, sampled):
    prompts = ["give json: ", "yes or no ", "sum 4+5 ", "an object "]
    free = params(None, sampled)
    guides = [g for g, _ in CASES] + [ANY_OBJECT]
    outs = llm.generate(
        [*prompts, "plain 1", "plain 2"], [params(g, sampled) for g in guides] + [free, free]
    )
    for (guide, check), out in zip(CASES, outs, strict=False):
        reply = out.outputs[0]
        assert reply.finish_reason == "stop", (guide.kind, reply.text)
        assert check(reply.text), (guide.kind, reply.text)
    obj = outs[len(CASES)].outputs[0]
    assert obj.text.startswith("{") and accepted(llm, ANY_OBJECT, obj.token_ids)
    if obj.finish_reason == "stop":
        assert isinstance(json.loads(obj.text), dict)
    # the unconstrained requests beside them are what they are alone
    alone = llm.generate(["plain 1", "plain 2"], free)
    assert [o.outputs[0].token_ids for o in outs[len(guides) :]] == [
        o.outputs[0].token_ids for o in alone
    ]
    # a random model left alone writes no such thing
    unguided = llm.generate(prompts[:1], free)[0].outputs[0].text
    with pytest.raises(ValueError):
        check_json_schema(unguided)


MORE_SCHEMAS = [
    {  # numbers with bounds, a nullable string of bounded length
        "type": "object",
        "properties": {
            "price": {"type": "number", "minimum": 0, "maximum": 10},
            "count": {"type": "integer", "minimum": -5, "maximum": 5},
            "label": {"type": ["string", "null"], "maxLength": 6},
        },
        "required": ["price", "count", "label"],
        "additionalProperties": False,
    },
    {  # nested arrays of objects, bounded
        "type": "object",
        "properties": {
            "rows": {
                "type": "array",
                "minItems": 1,
                "maxItems": 2,
                "items": {
                    "type": "object",
                    "properties": {"ok": {"type": "boolean"}, "tag": {"enum": ["a", "b", None]}},
                    "required": ["ok", "tag"],
                    "additionalProperties": False,
                },
            }
        },
        "required": ["rows"],
        "additionalProperties": False,
    },
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3},
    {"enum": ["red", "green", 3, True]},
]


def test_more_schemas_hold_every_output(llm):
    guides = [GuidedDecodingParams(json=schema) for schema in MORE_SCHEMAS]
    outs = llm.generate(
        [f"json {i}: " for i in range(len(guides))], [params(g, False) for g in guides]
    )
    for schema, out in zip(MORE_SCHEMAS, outs, strict=True):
        reply = out.outputs[0]
        assert reply.finish_reason == "stop", reply.text
        jsonschema.validate(json.loads(reply.text), schema)


@pytest.mark.parametrize(
    ("guide", "message"),
    [
        ({"json": '{"type": "object", "properties": 5}'}, "GuidedDecodingParams.json"),
        ({"json": "not json"}, "GuidedDecodingParams.json"),
        ({"regex": "(unclosed"}, "GuidedDecodingParams.regex"),
        ({"grammar": "root ::= missing_rule"}, "GuidedDecodingParams.grammar"),
    ],
)
def test_a_constraint_that_cannot_be_built_is_refused_naming_it(llm, guide, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(["x"], SamplingParams(guided_decoding=GuidedDecodingParams(**guide)))
    # the engine goes on
    assert (
        llm.generate(["x"], params(GuidedDecodingParams(regex="ab"), False))[0].outputs[0].text
        == "ab"
    )


def test_a_constraint_compiled_ahead_is_built_once_for_its_requests(llm, monkeypatch):
    """``LLM.compile_guide`` (what a server runs before it answers) compiles on the engine's
    compiler, so the requests that carry the same constraint find it compiled."""
    compiler = llm.rank_executor.guided.compiler
    built = []
    compile_one = compiler._compile
    monkeypatch.setattr(compiler, "_compile", lambda *key: built.append(key) or compile_one(*key))
    guide = GuidedDecodingParams(regex="(ab){1,3}c")
    assert llm.compile_guide(guide).result(timeout=30) is None
    outs = llm.generate(["x", "y"], [params(guide, False), params(guide, True)])
    assert all(out.outputs[0].finish_reason == "stop" for out in outs)
    assert built == [("regex", "(ab){1,3}c", False)]
    with pytest.raises(ValueError, match="GuidedDecodingParams.regex"):
        llm.compile_guide(GuidedDecodingParams(regex="(unclosed")).result(timeout=30)


def test_guided_decoding_without_a_backend_is_refused(tiny_checkpoint):
    plain = LLM(str(tiny_checkpoint), device="cpu", max_batch_size=2)
    try:
        with pytest.raises(ValueError, match="guided_decoding_backend"):
            plain.generate(["x"], SamplingParams(guided_decoding=GuidedDecodingParams(regex="a")))
    finally:
        plain.shutdown()


def test_guided_decoding_params_take_one_constraint():
    with pytest.raises(ValueError, match="exactly one of"):
        GuidedDecodingParams(regex="a", json_object=True)
    with pytest.raises(ValueError, match="exactly one of"):
        GuidedDecodingParams()
    guide = GuidedDecodingParams(json={"type": "object"})
    assert guide.kind == "json" and json.loads(guide.text) == {"type": "object"}
    ordered = GuidedDecodingParams(json={"properties": {"why": {}, "answer": {}}})
    assert list(json.loads(ordered.text)["properties"]) == ["why", "answer"]  # as written
    with pytest.raises(ValueError, match="disable_any_whitespace"):
        GuidedDecodingParams(json_object=True, disable_any_whitespace="yes")
    with pytest.raises(ValueError, match="over"):
        GuidedDecodingParams(regex="a" * 300_000)


@pytest.fixture(scope="module")
def spec_llm(llm, tmp_path_factory):
    """The same target with a random Eagle3 drafter (unified KV)."""
    from llm_helpers import write_tiny_eagle3

    from tensorrt_llm.llmapi.llm_args import Eagle3DecodingConfig

    target = llm.args.model
    drafter = write_tiny_eagle3(tmp_path_factory.mktemp("draft"), Path(target))
    spec = guided_llm(
        target,
        max_batch_size=32,
        speculative_config=Eagle3DecodingConfig(
            max_draft_len=3, speculative_model=str(drafter), draft_kv_cache="unified"
        ),
    )
    yield spec
    spec.shutdown()


def test_eagle3_under_a_grammar_gives_the_target_only_tokens(llm, spec_llm):
    """Greedy Eagle3 (unified KV) under each constraint makes the target-only tokens: a draft
    the grammar refuses is refused by its position's mask, the matcher rolled back after the
    drafts it walked through."""
    prompts = ["give json: ", "yes or no ", "sum 4+5 ", "plain"]
    sampling = [params(g, False) for g, _ in CASES] + [params(None, False)]
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, sampling)]
    got = spec_llm.generate(prompts, sampling)
    assert [o.outputs[0].token_ids for o in got] == want
    assert spec_llm.get_stats()["num_decode_iterations"] > 0


def test_sampled_eagle3_under_a_grammar_follows_the_masked_target_distribution(llm, spec_llm):
    """Rejection sampling against the masked target: each position's letter is drawn as the
    target alone draws it (400 seeded samples each; total variation within 0.15), the drafts
    the grammar refuses never accepted, and some drafts accepted."""
    from collections import Counter

    guide = GuidedDecodingParams(regex="[a-e][a-e][a-e]")
    sampling = [
        SamplingParams(max_tokens=8, temperature=1.0, seed=seed, guided_decoding=guide)
        for seed in range(400)
    ]
    outs = {}
    for name, model in (("target", llm), ("eagle3", spec_llm)):
        outs[name] = [o.outputs[0] for o in model.generate(["pick: "] * 400, sampling)]
        assert all(re.fullmatch("[a-e]{3}", o.text) for o in outs[name]), name
    for position in range(3):
        counts = [Counter(o.text[position] for o in outs[name]) for name in outs]
        tv = sum(abs(counts[0][c] - counts[1][c]) for c in "abcde") / (2 * 400)
        assert tv <= 0.15, (position, counts)
    assert max(o.avg_decoded_tokens_per_iter for o in outs["eagle3"]) > 1.0


def test_the_overlap_scheduler_overlaps_guided_steps_and_gives_the_same_tokens(llm):
    """With the overlap, a request with a grammar is fed from the device like any other: its
    next step's first part runs while the host reads the step before and fills its mask."""
    prompts = ["give json: ", "yes or no ", "sum 4+5 "]
    sampling = [params(g, False) for g, _ in CASES]
    plain = guided_llm(llm.args.model, disable_overlap_scheduler=True)
    try:
        want = [o.outputs[0].token_ids for o in plain.generate(prompts, sampling)]
    finally:
        plain.shutdown()
    before = llm.get_stats()["num_overlapped_steps"]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, sampling)] == want
    assert llm.get_stats()["num_overlapped_steps"] - before > 10


def test_mtp_under_a_grammar_gives_the_target_only_tokens(tmp_path):
    """The checkpoint's MTP module drafting under each constraint: the target-only tokens, the
    drafts the grammar refuses refused by their positions' masks."""
    from tensorrt_llm import MTPDecodingConfig

    model = write_tiny_checkpoint(
        tmp_path, alphabet=JSON_ALPHABET, max_position_embeddings=1024, num_mtp_modules=1
    )
    prompts = ["give json: ", "yes or no ", "sum 4+5 ", "plain"]
    sampling = [params(g, False) for g, _ in CASES] + [params(None, False)]
    outputs = []
    for spec in (None, MTPDecodingConfig(max_draft_len=3)):
        llm = guided_llm(model, speculative_config=spec)
        try:
            outputs.append([o.outputs[0].token_ids for o in llm.generate(prompts, sampling)])
        finally:
            llm.shutdown()
    assert outputs[1] == outputs[0]
