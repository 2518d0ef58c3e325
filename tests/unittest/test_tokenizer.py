"""Chat templates the Hugging Face way (issue 12, item 1): the bundled checkpoint's Jinja
``chat_template`` renders every evaluation conversation exactly as ``transformers`` does, in the
format the bundled model was trained on; any checkpoint's own template works, sandboxed."""

import json
import random
import shutil
from pathlib import Path

import pytest

from tensorrt_llm.bundled import bundled_target
from tensorrt_llm.evaluate.tasks import gsm8k_tiny, long_prompt, multiturn_copy
from tensorrt_llm.tokenizer import TOKENIZER_CONFIG, TOKENIZER_FILE, TransformersTokenizer


def conversations() -> list[list[dict]]:
    """Every shape the evaluation sends: gsm8k questions, each multiturn history, long prompts."""
    rng = random.Random(3)
    out = []
    for _ in range(50):
        messages, _ = gsm8k_tiny(rng)
        out += [messages[:1], messages]
    for _ in range(20):
        conversation = multiturn_copy(rng)
        out += [conversation[: i + 1] for i in range(len(conversation))]
    out += [long_prompt(rng)[0] for _ in range(10)]
    out.append([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}])
    return out


def test_transformers_renders_every_evaluation_conversation_as_the_server_does():
    transformers = pytest.importorskip("transformers")
    theirs = transformers.AutoTokenizer.from_pretrained(str(bundled_target()))
    ours = TransformersTokenizer.from_pretrained(bundled_target())
    for conversation in conversations():
        for prompt in (True, False):
            text = ours.apply_chat_template(conversation, add_generation_prompt=prompt)
            expected = theirs.apply_chat_template(
                conversation, tokenize=False, add_generation_prompt=prompt
            )
            assert text == expected, conversation
        ids = theirs.apply_chat_template(conversation, tokenize=True, add_generation_prompt=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        assert ours.encode(ours.apply_chat_template(conversation)) == list(ids)


def test_the_template_renders_the_format_the_bundled_model_was_trained_on():
    ours = TransformersTokenizer.from_pretrained(bundled_target())
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": " yo "},
        {"role": "system", "content": "q"},
    ]
    assert ours.apply_chat_template(messages) == (
        "<|user|>hi<|end|><|assistant|> yo <|end|><|user|>q<|end|><|assistant|>"
    )
    with pytest.raises(ValueError, match=r"messages\[1\].role=tool: expected"):
        ours.apply_chat_template([messages[0], {"role": "tool", "content": "x"}])


def checkpoint(tmp_path, **config):
    shutil.copy(Path(bundled_target()) / TOKENIZER_FILE, tmp_path / TOKENIZER_FILE)
    (tmp_path / TOKENIZER_CONFIG).write_text(json.dumps(config))
    return TransformersTokenizer.from_pretrained(tmp_path)


def test_a_checkpoints_own_template_is_used_and_sandboxed(tmp_path):
    own = checkpoint(
        tmp_path,
        chat_template=[
            {"name": "tool_use", "template": "unused"},
            {
                "name": "default",
                "template": "{% for m in messages %}[{{ m.role }}]{{ m.content }}"
                "{{ eos_token }}{% endfor %}",
            },
        ],
        eos_token={"content": "<|end|>", "special": True},
    )
    assert own.apply_chat_template([{"role": "user", "content": "a"}]) == "[user]a<|end|>"
    escape = checkpoint(tmp_path, chat_template="{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ValueError, match="chat template"):
        escape.apply_chat_template([{"role": "user", "content": "a"}])


def test_a_checkpoint_without_a_template_says_so(tmp_path):
    bare = checkpoint(tmp_path, eos_token="<|end|>")
    with pytest.raises(ValueError, match="has no chat_template"):
        bare.apply_chat_template([{"role": "user", "content": "a"}])
