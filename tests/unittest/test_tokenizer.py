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
from tensorrt_llm.tokenizer import (
    CHAT_TEMPLATE_FILE,
    TOKENIZER_CONFIG,
    TOKENIZER_FILE,
    TransformersTokenizer,
)


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
            text = ours.apply_chat_template(conversation, prompt)
            expected = theirs.apply_chat_template(
                conversation, tokenize=False, add_generation_prompt=prompt
            )
            assert text == expected, conversation
        ids = theirs.apply_chat_template(conversation, tokenize=True, add_generation_prompt=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        assert ours.encode(ours.apply_chat_template(conversation)) == list(ids)


def test_the_bundled_template_is_m3s_and_renders_its_protocol():
    ours = TransformersTokenizer.from_pretrained(bundled_target())
    root = Path(__file__).parents[2]
    assert ours.chat_template == (root / "examples/templates/minimax_m3.jinja").read_text()
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": " yo "},
        {"role": "user", "content": "q"},
    ]
    text = ours.apply_chat_template(messages, thinking_mode="disabled")
    assert text.startswith("]~!b[]~b]system\nYou are MiniMax-M3")
    assert "Answer directly, without reasoning.\n" in text
    assert text.endswith("]~b]user\nhi[e~[\n]~b]ai\n yo [e~[\n]~b]user\nq[e~[\n]~b]ai\n</mm:think>")
    with pytest.raises(ValueError, match=r"messages\[1\].role=robot: expected"):
        ours.apply_chat_template([messages[0], {"role": "robot", "content": "x"}])


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
    with pytest.raises(
        ValueError, match="no chat_template.jinja and no chat_template.*--chat_template"
    ):
        bare.apply_chat_template([{"role": "user", "content": "a"}])


def test_chat_template_jinja_then_the_option_take_the_configs_place(tmp_path):
    user = [{"role": "user", "content": "a"}]
    config_only = checkpoint(tmp_path, chat_template="config:{{ messages[0].content }}")
    assert config_only.apply_chat_template(user) == "config:a"
    # the hub keeps the template in its own file: it wins over tokenizer_config.json's
    (tmp_path / CHAT_TEMPLATE_FILE).write_text(
        "jinja:{{ messages[0].content }}|{{ thinking_mode }}"
    )
    hub = TransformersTokenizer.from_pretrained(tmp_path)
    assert hub.apply_chat_template(user, thinking_mode="enabled") == "jinja:a|enabled"
    # the option (trtllm-serve --chat_template): a file, or the template's text
    own = tmp_path / "own.jinja"
    own.write_text("file:{{ messages[0].content }}")
    assert (
        TransformersTokenizer.from_pretrained(tmp_path, chat_template=str(own)).apply_chat_template(
            user
        )
        == "file:a"
    )
    inline = TransformersTokenizer.from_pretrained(tmp_path, chat_template="text:{{ 1 + 1 }}")
    assert inline.apply_chat_template(user) == "text:2"
    with pytest.raises(ValueError, match="chat_template='missing.jinja': no such file"):
        TransformersTokenizer.from_pretrained(tmp_path, chat_template="missing.jinja")
    # a request's variables may not replace what the request itself sets
    with pytest.raises(ValueError, match="may not set \\['messages'\\]"):
        hub.apply_chat_template(user, messages=[])


def test_a_long_text_is_tokenized_without_holding_the_gil():
    """The server tokenizes on a worker thread; its other threads (``/health``, the streams) must
    keep running meanwhile (issue 37, finding 4)."""
    import threading
    import time

    tokenizer = TransformersTokenizer.from_pretrained(bundled_target())
    text = "Ann has 58 cups. " * 120_000  # 2 MB: about a second of tokenizing
    gaps, done = [], threading.Event()

    def tick():
        last = time.monotonic()
        while not done.is_set():
            time.sleep(0.005)
            gaps.append(time.monotonic() - last)
            last = time.monotonic()

    ticker = threading.Thread(target=tick)
    ticker.start()
    start = time.monotonic()
    ids = tokenizer.encode(text)
    took = time.monotonic() - start
    done.set()
    ticker.join()
    assert len(ids) == len(text)  # one token per character
    assert max(gaps) < min(0.2, took / 2), (max(gaps), took)


def test_a_text_too_long_for_max_seq_len_is_refused_by_its_length():
    tokenizer = TransformersTokenizer.from_pretrained(bundled_target())
    longest = max(len(t) for t in tokenizer.tokenizer.get_vocab())  # a phrase token of the template
    assert tokenizer.max_chars_per_token == longest > 100
    tokenizer.check_fits("a" * longest * 100, 100)
    with pytest.raises(ValueError, match=f"{longest * 100 + 1} characters: over {longest * 100}"):
        tokenizer.check_fits("a" * (longest * 100 + 1), 100)


def test_the_length_bound_is_claimed_only_where_no_character_can_vanish():
    from tokenizers import Tokenizer, models, pre_tokenizers

    byte_level = Tokenizer(models.BPE({"a": 0, "b": 1, "ab": 2}, [("a", "b")]))
    byte_level.pre_tokenizer = pre_tokenizers.ByteLevel()
    assert TransformersTokenizer(byte_level).max_chars_per_token == 2
    words = Tokenizer(models.WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()  # spaces vanish; a long word is one <unk>
    assert TransformersTokenizer(words).max_chars_per_token is None
    TransformersTokenizer(words).check_fits("a " * 10_000, 10)  # no bound: nothing refused


def test_the_m3_character_tokenizer_keeps_the_parsers_markers_as_text():
    from tensorrt_llm.evaluate.m3_tasks import tool_use
    from tensorrt_llm.tokenizer import (
        M3_ALPHABET,
        M3_SPECIAL_TOKENS,
        M3_TEXT_TOKENS,
        build_char_tokenizer,
        render_chat_template,
    )

    tokenizer = build_char_tokenizer(M3_ALPHABET, M3_SPECIAL_TOKENS, text_tokens=M3_TEXT_TOKENS)
    template = (
        Path(__file__).resolve().parents[2] / "examples/templates/minimax_m3.jinja"
    ).read_text()
    conv = tool_use(random.Random(0), "enabled")
    text = render_chat_template(
        template, conv.messages, False, tools=conv.tools, thinking_mode="enabled"
    )
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    assert tokenizer.token_to_id("<unk>") not in ids  # (every character of the format written)
    assert tokenizer.decode(ids, skip_special_tokens=False) == text
    for marker in M3_SPECIAL_TOKENS[2:] + M3_TEXT_TOKENS:  # one token each
        assert tokenizer.encode(marker, add_special_tokens=False).ids == [
            tokenizer.token_to_id(marker)
        ]
    # decoded as a server decodes a reply: the turn markers go, the reasoning and call markers stay
    shown = tokenizer.decode(ids, skip_special_tokens=True)
    assert not any(m in shown for m in M3_SPECIAL_TOKENS[2:])
    assert all(shown.count(m) == text.count(m) for m in M3_TEXT_TOKENS)
