"""The M3-format training data (``examples/training/m3_format.py``): every example trains what
the model writes and only that, its text is the template's, and no evaluation problem is in it."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples" / "training"))
from m3_format import (  # noqa: E402
    EOS,
    TEMPLATE,
    build_m3_tokenizer,
    encode_m3,
    m3_conversations,
    save_m3_tokenizer,
)

from tensorrt_llm.evaluate.m3_tasks import training_pairs  # noqa: E402
from tensorrt_llm.tokenizer import TransformersTokenizer  # noqa: E402


def test_each_example_trains_exactly_what_the_model_writes():
    tokenizer = build_m3_tokenizer()
    convs, _ = m3_conversations(seed=0, count=60)
    kinds = set()
    for conv in convs:
        examples = encode_m3(tokenizer, conv)
        assert len(examples) == sum(m["role"] == "assistant" for m in conv.messages)
        for (ids, mask), (prompt, target) in zip(
            examples, training_pairs(conv, TEMPLATE), strict=True
        ):
            assert len(ids) == len(mask) and set(mask) <= {0, 1}
            first = mask.index(1)
            assert all(mask[first:]) and not any(mask[:first])  # (one trained span: the end)
            assert tokenizer.decode(ids[:first], skip_special_tokens=False) == prompt
            assert tokenizer.decode(ids[first:], skip_special_tokens=False) == target
            assert tokenizer.token_to_id("<unk>") not in ids
        kinds.add((conv.thinking_mode, bool(conv.tools)))
    assert len(kinds) == 6  # every thinking mode, with and without tools


def test_the_excluded_problems_are_left_out():
    # (training leaves out every evaluation problem: evaluation_questions())
    convs, _ = m3_conversations(seed=0, count=50)
    held = {c.messages[0]["content"] for c in convs[:10]}
    again, skipped = m3_conversations(seed=0, count=50, exclude=held)
    assert skipped >= 10 and not any(c.messages[0]["content"] in held for c in again)


def test_the_saved_tokenizer_loads_with_its_template(tmp_path):
    save_m3_tokenizer(build_m3_tokenizer(), tmp_path)
    loaded = TransformersTokenizer.from_pretrained(tmp_path)
    assert loaded.special_tokens_map["eos_token"] == EOS
    text = loaded.apply_chat_template([{"role": "user", "content": "Hi"}], thinking_mode="enabled")
    assert text.endswith("]~b]user\nHi[e~[\n]~b]ai\n<mm:think>")
