"""The bundled model's data in MiniMax-M3's chat protocol (``--format m3`` of the training
scripts): its tokenizer, its chat template (``examples/templates/minimax_m3.jinja``, saved as
the checkpoint's ``chat_template.jinja``), and its corpus as training examples.

The corpus mixes gsm8k-tiny in the three thinking modes and tool use (``m3_tasks.py``) with
multiturn-copy and long-prompt (in the adaptive mode: a bare ``</mm:think>``, then the reply).
Every assistant turn is an example: the conversation before it with the mode's generation
prompt (not trained), then what the model writes (trained; ``m3_tasks.training_pairs``).
Conversations whose first user turn is an evaluation problem are left out."""

from __future__ import annotations

import json
import random
from pathlib import Path

from tokenizers import Tokenizer

from tensorrt_llm.evaluate.m3_tasks import (
    THINKING_MODES,
    M3Conversation,
    gsm8k_thinking,
    tool_use,
    training_pairs,
)
from tensorrt_llm.evaluate.tasks import long_prompt, multiturn_copy
from tensorrt_llm.tokenizer import (
    CHAT_TEMPLATE_FILE,
    M3_ALPHABET,
    M3_SPECIAL_TOKENS,
    M3_TEXT_TOKENS,
    build_char_tokenizer,
)

TEMPLATE = (Path(__file__).resolve().parents[1] / "templates" / "minimax_m3.jinja").read_text()
EOS = "[e~["
# gsm8k-tiny (thinking modes), tool use, multiturn-copy, long-prompt
M3_MIX = (0.35, 0.25, 0.25, 0.15)
# the vocabulary, padded with filler tokens to a multiple of 8: the vocabulary-parallel embedding
# and LM heads split evenly over up to 8 tensor-parallel ranks (published vocabularies are padded)
VOCAB_SIZE = 136


# Whole phrases of the template and of tool markup, one token each (as a BPE tokenizer trained
# on such text would have them): a prompt's fixed parts then take a few tokens instead of a
# thousand characters, so that the model learns to copy from the request rather than wade through
# boilerplate. (Encoding picks the longest phrase at the leftmost place.)
_INSTRUCTIONS = TEMPLATE.split("</tools>\n", 1)[1].split("{% endif", 1)[0]
PHRASE_TOKENS = [
    "You are MiniMax-M3, a helpful assistant.\n<thinking_instructions>\n"
    "Reason inside <mm:think></mm:think> before the answer when reasoning helps.\n",
    "Always reason before you answer.\n",
    "Answer directly, without reasoning.\n",
    "Reason when the request needs it; otherwise answer directly.\n",
    "</thinking_instructions>",
    "# Tools\nYou may call these tools:\n<tools>\n",
    "</tools>\n" + _INSTRUCTIONS.replace("{{ ns_token }}", "]<]minimax[>["),
    "<tool>",
    "</tool>\n",
    '{"name": "',
    '", "description": "',
    '", "parameters": {"type": "object", "properties": {',
    '{"type": "integer"}',
    '{"type": "number"}',
    '{"type": "string"}',
    '{"type": "boolean"}',
    '"required": [',
    "<tool_call>",
    "</tool_call>",
    '<invoke name="',
    "</invoke>",
    "<response>",
    "</response>",
    "<item>",
    "</item>",
]


def build_m3_tokenizer() -> Tokenizer:
    return build_char_tokenizer(
        M3_ALPHABET,
        M3_SPECIAL_TOKENS,
        vocab_size=VOCAB_SIZE,
        text_tokens=[*M3_TEXT_TOKENS, *PHRASE_TOKENS],
    )


def save_m3_tokenizer(tokenizer: Tokenizer, model_dir: Path) -> None:
    """``tokenizer.json``, ``tokenizer_config.json`` and ``chat_template.jinja``, as the hub
    keeps them."""
    model_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(model_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS,
        "pad_token": "<pad>",
        "unk_token": "<unk>",
    }
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (model_dir / CHAT_TEMPLATE_FILE).write_text(TEMPLATE)


def m3_conversations(
    seed: int, count: int, exclude: set[str] | frozenset[str] = frozenset(), long_min_chars=700
) -> tuple[list[M3Conversation], int]:
    """``count`` conversations of the mix (``M3_MIX``, seeded), none whose first user turn is in
    ``exclude``; and how many were drawn and skipped."""
    rng = random.Random(seed)
    out: list[M3Conversation] = []
    skipped = 0
    while len(out) < count:
        r, mode = rng.random(), rng.choice(THINKING_MODES)
        if r < M3_MIX[0]:
            conv = gsm8k_thinking(rng, mode)
        elif r < M3_MIX[0] + M3_MIX[1]:
            conv = tool_use(rng, mode)
        elif r < M3_MIX[0] + M3_MIX[1] + M3_MIX[2]:
            conv = M3Conversation(multiturn_copy(rng), "adaptive", 0)
        else:
            conv = M3Conversation(long_prompt(rng, long_min_chars)[0], "adaptive", 0)
        if conv.messages[0]["content"] in exclude:
            skipped += 1
        else:
            out.append(conv)
    return out, skipped


def encode_m3(tokenizer: Tokenizer, conv: M3Conversation) -> list[tuple[list[int], list[int]]]:
    """``(ids, mask)`` per assistant turn: mask 1 on what the model writes."""
    examples = []
    for prompt, target in training_pairs(conv, TEMPLATE):
        context = tokenizer.encode(prompt, add_special_tokens=False).ids
        written = tokenizer.encode(target, add_special_tokens=False).ids
        examples.append((context + written, [0] * len(context) + [1] * len(written)))
    return examples
