"""Tokenizers: a Hugging Face ``tokenizer.json`` through the ``tokenizers`` library."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

TOKENIZER_FILE = "tokenizer.json"

# The chat template shared by training, ``LLM`` and the server:
#   <|user|>{content}<|end|><|assistant|>{content}<|end|>...   (+ "<|assistant|>" to prompt a reply)
USER, ASSISTANT, END = "<|user|>", "<|assistant|>", "<|end|>"
CHAT_SPECIAL_TOKENS = ["<unk>", "<pad>", END, USER, ASSISTANT]
CHAT_ALPHABET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,:;?!+-=*/()'\"\n"


def apply_chat_template(messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
    """Render ``[{"role": "user" | "assistant" | "system", "content": str}, ...]``."""
    parts = []
    for i, message in enumerate(messages):
        role = message.get("role")
        if role not in ("user", "assistant", "system"):
            raise ValueError(
                f"messages[{i}].role={role!r}: expected 'user', 'assistant' or 'system'"
            )
        tag = ASSISTANT if role == "assistant" else USER
        parts.append(f"{tag}{message.get('content', '')}{END}")
    if add_generation_prompt:
        parts.append(ASSISTANT)
    return "".join(parts)


class TransformersTokenizer:
    """The few operations the runtime needs: encode, decode, and the special ids."""

    def __init__(
        self, tokenizer: Tokenizer, eos_token: str | None = None, bos_token: str | None = None
    ) -> None:
        self.tokenizer = tokenizer
        self.eos_token_id = tokenizer.token_to_id(eos_token) if eos_token else None
        self.bos_token_id = tokenizer.token_to_id(bos_token) if bos_token else None

    @classmethod
    def from_pretrained(
        cls, model_dir: str | Path, eos_token: str | None = None
    ) -> TransformersTokenizer:
        path = Path(model_dir) / TOKENIZER_FILE
        if not path.is_file():
            raise ValueError(f"tokenizer={str(model_dir)!r}: no {TOKENIZER_FILE} there")
        return cls(Tokenizer.from_file(str(path)), eos_token=eos_token)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    @property
    def special_tokens(self) -> list[str]:
        """The text of every special (control) token, e.g. ``<|end|>``."""
        return [t.content for t in self.tokenizer.get_added_tokens_decoder().values() if t.special]

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        return apply_chat_template(messages, add_generation_prompt)


def build_char_tokenizer(alphabet: str, special_tokens: list[str]) -> Tokenizer:
    """A character-level tokenizer: each special token, then each character of ``alphabet``."""
    vocab = {tok: i for i, tok in enumerate(special_tokens)}
    for ch in alphabet:
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token=special_tokens[0]))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(special_tokens)
    return tok
