"""Tokenizers: a Hugging Face ``tokenizer.json`` through the ``tokenizers`` library."""

from __future__ import annotations

import functools
import json
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

TOKENIZER_FILE = "tokenizer.json"

TOKENIZER_CONFIG = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"  # a checkpoint's template, as the hub keeps it
USER, ASSISTANT, END = "<|user|>", "<|assistant|>", "<|end|>"
CHAT_SPECIAL_TOKENS = ["<unk>", "<pad>", END, USER, ASSISTANT]
CHAT_ALPHABET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,:;?!+-=*/()'\"\n"
# The plain chat format of the first bundled model (and of the tests' tiny checkpoints):
#   <|user|>{content}<|end|><|assistant|>{content}<|end|>...   (+ "<|assistant|>" to prompt a reply)
# A system message takes the user tag.
PLAIN_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['user', 'assistant', 'system'] -%}"
    "{{- raise_exception('messages[' ~ loop.index0 ~ '].role=' ~ message['role'] ~ "
    "\": expected 'user', 'assistant' or 'system'\") -}}"
    "{%- endif -%}"
    "{{- '<|assistant|>' if message['role'] == 'assistant' else '<|user|>' -}}"
    "{{- message['content'] -}}<|end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)


def plain_tokenizer_config() -> dict:
    """``tokenizer_config.json`` of a character tokenizer of the plain format (its template, its
    end-of-turn, padding and unknown tokens)."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": PLAIN_CHAT_TEMPLATE,
        "eos_token": END,
        "pad_token": "<pad>",
        "unk_token": "<unk>",
    }


# MiniMax-M3's chat protocol in a character tokenizer: the turn markers are control tokens; the
# reasoning and tool-call markers single tokens that decode to their text (the parsers read
# them); the alphabet writes JSON and XML too.
M3_SPECIAL_TOKENS = ["<unk>", "<pad>", "]~!b[", "]~b]", "[e~["]
M3_TEXT_TOKENS = ["<mm:think>", "</mm:think>", "]<]minimax[>["]
M3_ALPHABET = CHAT_ALPHABET + "{}[]<>_&%#@~^|\\`$\t"
_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")
# the variables a chat template gets from the request's own fields, never from its
# chat_template_kwargs
REQUEST_VARIABLES = ("messages", "tools", "add_generation_prompt")
# what chat_template_kwargs may set beside the template's own variables: the common way to ask
# for thinking, which the server reads as a template's thinking_mode
THINKING_SWITCHES = ("enable_thinking",)


def _template_environment():
    """Jinja as ``transformers`` renders chat templates: sandboxed, immutable, blocks trimmed,
    ``raise_exception`` and ``tojson`` available."""
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    env.filters["tojson"] = lambda value, indent=None: json.dumps(value, indent=indent)
    return env


@functools.lru_cache(maxsize=8)
def _compiled(template: str):
    return _template_environment().from_string(template)


def render_chat_template(
    template: str, messages: list[dict], add_generation_prompt: bool = True, **special_tokens
) -> str:
    """A checkpoint's Jinja ``chat_template`` applied to ``messages``; the template's own errors
    (``raise_exception``) and Jinja's become a ``ValueError`` with the template's message."""
    from jinja2.exceptions import TemplateError

    try:
        return _compiled(template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **special_tokens
        )
    except TemplateError as exc:
        raise ValueError(f"chat template: {exc}") from None


def _token_text(value) -> str | None:
    """A special token as ``tokenizer_config.json`` writes it: a string or ``{"content": ...}``."""
    return value.get("content") if isinstance(value, dict) else value


def _chat_template(config: dict) -> str | None:
    """The default template: a string, or the ``"default"`` one of a list of named templates."""
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


class TransformersTokenizer:
    """The few operations the runtime needs: encode, decode, and the special ids."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        eos_token: str | None = None,
        bos_token: str | None = None,
        chat_template: str | None = None,
        special_tokens: dict[str, str] | None = None,
        name: str = "this tokenizer",
    ) -> None:
        self.tokenizer = tokenizer
        # the batch calls release the GIL while they work (encode does not): a long text
        # tokenized on one thread leaves the others running (the server's /health, its streams)
        self._encode_batch = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
        self.eos_token_id = tokenizer.token_to_id(eos_token) if eos_token else None
        self.bos_token_id = tokenizer.token_to_id(bos_token) if bos_token else None
        self.chat_template = chat_template
        self.special_tokens_map = dict(special_tokens or {})
        self.name = name

    @classmethod
    def from_pretrained(
        cls, model_dir: str | Path, eos_token: str | None = None, chat_template: str | None = None
    ) -> TransformersTokenizer:
        """``tokenizer.json``, plus the special tokens of ``tokenizer_config.json`` and the chat
        template, as ``transformers`` reads them: ``chat_template.jinja`` when the checkpoint has
        one, else ``tokenizer_config.json``'s. ``chat_template`` (a Jinja file, or a template's
        text) takes their place."""
        path = Path(model_dir) / TOKENIZER_FILE
        if not path.is_file():
            raise ValueError(f"tokenizer={str(model_dir)!r}: no {TOKENIZER_FILE} there")
        config_path = Path(model_dir) / TOKENIZER_CONFIG
        try:
            config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        except json.JSONDecodeError as exc:
            raise ValueError(f"{config_path}: not JSON ({exc})") from None
        special = {k: _token_text(config[k]) for k in _SPECIAL_KEYS if config.get(k)}
        template = _chat_template(config)
        jinja = Path(model_dir) / CHAT_TEMPLATE_FILE
        if jinja.is_file():
            template = jinja.read_text()
        if chat_template is not None:
            template = read_chat_template(chat_template)
        return cls(
            Tokenizer.from_file(str(path)),
            eos_token=eos_token,
            chat_template=template,
            special_tokens=special,
            name=str(model_dir),
        )

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    @functools.cached_property
    def template_variables(self) -> frozenset[str]:
        """The variables a request's ``chat_template_kwargs`` may set: those the chat template
        reads and nothing else gives it (not ``REQUEST_VARIABLES``, the special tokens, or
        Jinja's globals), and ``THINKING_SWITCHES``."""
        if self.chat_template is None:
            return frozenset(THINKING_SWITCHES)
        from jinja2 import meta

        env = _template_environment()
        read = meta.find_undeclared_variables(env.parse(self.chat_template))
        given = {*REQUEST_VARIABLES, *_SPECIAL_KEYS, *self.special_tokens_map, *env.globals}
        return frozenset(read - given) | frozenset(THINKING_SWITCHES)

    @property
    def special_tokens(self) -> list[str]:
        """The text of every special (control) token, e.g. ``<|end|>``."""
        return [t.content for t in self.tokenizer.get_added_tokens_decoder().values() if t.special]

    def encode(self, text: str) -> list[int]:
        return self._encode_batch([text], add_special_tokens=False)[0].ids

    @functools.cached_property
    def max_chars_per_token(self) -> int | None:
        """The most characters one token can stand for, where that is known from the tokenizer's
        kind (``_keeps_every_character``): the longest token's text, special ones included, times
        4 when a normalizer could shorten the text first. A text of more than
        ``n * max_chars_per_token`` characters then has more than ``n`` tokens. None for a
        tokenizer that may drop or fuse characters (whitespace splitting, fused unknowns)."""
        spec = json.loads(self.tokenizer.to_str())
        if not _keeps_every_character(spec):
            return None
        longest = max(map(len, self.tokenizer.get_vocab(with_added_tokens=True)), default=1)
        return longest * (4 if spec.get("normalizer") else 1)

    def check_fits(self, text: str, max_tokens: int, what: str = "the prompt") -> None:
        """A ``ValueError`` for a text too long to be ``max_tokens`` tokens, found by its length
        before any token is made (where ``max_chars_per_token`` is known)."""
        if self.max_chars_per_token is None:
            return
        limit = max_tokens * self.max_chars_per_token
        if len(text) > limit:
            raise ValueError(
                f"{what} is {len(text)} characters: over {limit}, the most that "
                f"max_seq_len={max_tokens} tokens of this tokenizer can hold"
            )

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, /, **template_kwargs
    ) -> str:
        """``messages`` rendered by the checkpoint's Jinja ``chat_template``, with
        ``template_kwargs`` (a request's ``chat_template_kwargs``, its ``tools``) among the
        template's variables."""
        if self.chat_template is None:
            raise ValueError(
                f"{self.name}: no {CHAT_TEMPLATE_FILE} and no chat_template in its "
                f"{TOKENIZER_CONFIG}, so chat messages cannot be rendered; give the LLM a "
                "chat_template (trtllm-serve --chat_template FILE) or send a prompt to "
                "/v1/completions"
            )
        taken = sorted({"messages", "add_generation_prompt"} & template_kwargs.keys())
        if taken:
            raise ValueError(f"chat_template_kwargs may not set {taken}: the request sets them")
        variables = {**self.special_tokens_map, **template_kwargs}
        return render_chat_template(
            self.chat_template, messages, add_generation_prompt, **variables
        )


def read_chat_template(value: str) -> str:
    """A ``chat_template`` option: the text of the Jinja file it names, or the template's text
    itself."""
    if "{{" in value or "{%" in value:
        return value
    try:
        return Path(value).read_text()
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise ValueError(f"chat_template={value!r}: {exc.strerror}") from None
    raise ValueError(f"chat_template={value!r}: no such file, and not a Jinja template's text")


def _keeps_every_character(spec: dict) -> bool:
    """Whether every character of a text ends up inside some token (a tokenizer.json ``spec``):
    byte-level BPE, BPE with byte fallback (neither fusing unknowns), or a model fed one
    character at a time (``build_char_tokenizer``)."""
    model, pre = spec.get("model") or {}, spec.get("pre_tokenizer") or {}
    pres = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    if model.get("type") == "BPE" and not model.get("fuse_unk"):
        return model.get("byte_fallback") or any(p.get("type") == "ByteLevel" for p in pres)
    one_char = {"type": "Split", "pattern": {"Regex": "[\\s\\S]"}, "behavior": "Isolated"}
    return model.get("type") == "WordLevel" and any(
        all(p.get(k) == v for k, v in one_char.items()) for p in pres
    )


def build_char_tokenizer(
    alphabet: str,
    special_tokens: list[str],
    vocab_size: int | None = None,
    text_tokens: list[str] = (),
) -> Tokenizer:
    """A character-level tokenizer: each special token, each text token, then each character of
    ``alphabet``; with ``vocab_size``, filler tokens (``<#N>``, never produced by encoding) up to
    that size, so that every id a model of that vocabulary emits decodes to some text. Special
    tokens (control tokens) are left out of decoded text; ``text_tokens`` are single tokens that
    decode to their text (markers a reply's parsers read: ``<mm:think>``)."""
    vocab = {tok: i for i, tok in enumerate([*special_tokens, *text_tokens])}
    for ch in alphabet:
        vocab.setdefault(ch, len(vocab))
    for i in range(len(vocab), vocab_size or 0):
        vocab[f"<#{i}>"] = i
    tok = Tokenizer(models.WordLevel(vocab, unk_token=special_tokens[0]))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(special_tokens)
    if text_tokens:
        tok.add_tokens(list(text_tokens))
    return tok
