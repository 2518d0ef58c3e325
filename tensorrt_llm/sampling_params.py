"""SamplingParams: how one request is decoded (upstream TensorRT-LLM's names)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace

MAX_LOGPROBS = 20
MAX_INT64 = 2**63 - 1  # seeds, top-k and token ids travel to the device as int64
MAX_STOP_TOKEN_IDS = 256
MAX_BAD_WORDS = 128  # strings of ``bad``; each is banned in up to two tokenizations
MAX_BAD_WORD_CHARS = 256
MAX_BAD_WORD_TOKENS = 16  # the longest tokenization of a bad word the step can match
MAX_BAD_TOKEN_IDS = 1024


class SamplingParamsError(ValueError):
    """A ``SamplingParams`` field out of what the engine can represent; ``field`` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _token_ids(value, most: int) -> bool:
    """A list (or tuple) of at most ``most`` token ids (ints in ``[0, 2**63)``)."""
    return (
        isinstance(value, list | tuple)
        and len(value) <= most
        and all(_is_int(t) and 0 <= t <= MAX_INT64 for t in value)
    )


def _is_number(value, low: float, high: float) -> bool:
    """A real number (not a bool) in ``[low, high]``; NaN and infinities are not."""
    return isinstance(value, int | float) and not isinstance(value, bool) and low <= value <= high


GUIDE_KINDS = ("json", "regex", "grammar", "json_object", "structural_tag")
MAX_GUIDE_BYTES = 256 * 1024  # a schema, regex or grammar's text


@dataclass
class GuidedDecodingParams:
    """A constraint on what a request writes (upstream's names; exactly one is set): ``json``, a
    JSON schema (a dict, its JSON text, or a pydantic model class); ``regex``; ``grammar``, an
    EBNF grammar (GBNF, as xgrammar reads it); ``json_object``, any JSON object; and
    ``structural_tag``, an xgrammar structural tag (its JSON text). The engine builds it with the
    ``guided_decoding_backend`` of the ``LLM`` (``xgrammar``). A schema's properties are written
    in its order. ``disable_any_whitespace`` (vLLM's name): JSON without whitespace between its
    tokens (``{"a":1,"b":[2]}``); else up to 4 whitespace characters in a row
    (``grammar_matcher.MAX_WHITESPACE``)."""

    json: str | dict | None = None
    regex: str | None = None
    grammar: str | None = None
    json_object: bool = False
    structural_tag: str | dict | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        import json

        if hasattr(self.json, "model_json_schema"):  # a pydantic model (class)
            self.json = self.json.model_json_schema()
        for name in ("json", "structural_tag"):
            value = getattr(self, name)
            if isinstance(value, dict):
                setattr(self, name, json.dumps(value))  # (in order: the order written)
        given = [k for k in GUIDE_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise SamplingParamsError(
                "guided_decoding",
                f"GuidedDecodingParams takes exactly one of {', '.join(GUIDE_KINDS)}; got "
                f"{', '.join(given) or 'none'}",
            )
        if not isinstance(self.disable_any_whitespace, bool):
            raise SamplingParamsError(
                "guided_decoding", "GuidedDecodingParams.disable_any_whitespace must be a bool"
            )
        kind = given[0]
        value = getattr(self, kind)
        if kind == "json_object":
            if value is not True:
                raise SamplingParamsError("guided_decoding", "json_object must be True or False")
            return
        if not isinstance(value, str) or not value:
            raise SamplingParamsError(
                "guided_decoding", f"GuidedDecodingParams.{kind} must be a non-empty string"
            )
        if len(value.encode()) > MAX_GUIDE_BYTES:
            raise SamplingParamsError(
                "guided_decoding",
                f"GuidedDecodingParams.{kind} is {len(value.encode())} bytes: over "
                f"{MAX_GUIDE_BYTES}",
            )

    def to_json(self) -> dict:
        return asdict(self)

    @property
    def kind(self) -> str:
        """Which constraint is set (one of ``GUIDE_KINDS``)."""
        return next(k for k in GUIDE_KINDS if getattr(self, k) not in (None, False))

    @property
    def text(self) -> str:
        """The constraint's text (a schema's JSON; ``""`` for ``json_object``)."""
        return "" if self.kind == "json_object" else getattr(self, self.kind)


@dataclass
class SamplingParams:
    """Greedy when ``temperature`` is None or 0, or ``top_k == 1``; otherwise sampled.

    ``stop`` strings end generation once the text contains one (the text is cut before it);
    ``stop_token_ids`` and the model's end id end it at that token (kept in ``token_ids``, not in
    ``text``), the end id unless ``ignore_eos``. ``seed`` makes sampling reproducible per request.

    Token constraints, applied to the target's logits before sampling and before speculative
    acceptance (so speculation decodes what plain decoding does): ``allowed_token_ids``, the only
    tokens the output may hold (vLLM's name); ``bad_token_ids``, tokens it never holds; ``bad``,
    words it never holds, banned as vLLM bans its ``bad_words``: each word is tokenized as written
    (its leading whitespace stripped) and after a space, and the last token of a tokenization is
    banned where the output so far ends with the tokens before it (always, for one token).
    """

    max_tokens: int = 32
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    allowed_token_ids: list[int] | None = None
    bad: str | list[str] | None = None
    bad_token_ids: list[int] = field(default_factory=list)
    end_id: int | None = None
    ignore_eos: bool = False
    detokenize: bool = True
    return_generation_logits: bool = False
    # Log-probabilities of the emitted tokens under the target's distribution (its raw logits, the
    # same with or without speculative decoding), and of this many most likely tokens at each.
    logprobs: int | None = None
    # OpenAI's: subtract presence_penalty from the logit of every token already in the output, and
    # frequency_penalty times its count; add logit_bias[token] to its logit. They apply to the
    # target's logits before sampling and before speculative acceptance (so decoding stays
    # lossless), and the logprobs are those of the processed logits.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    # what the output must match (a JSON schema, regex, grammar, ...): masked at every step
    guided_decoding: GuidedDecodingParams | None = None

    def __post_init__(self) -> None:
        def bad(name: str, rule: str) -> SamplingParamsError:
            return SamplingParamsError(
                name, f"SamplingParams.{name}={getattr(self, name)!r}: {rule}"
            )

        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise bad("max_tokens", "must be an int >= 1")
        if self.temperature is not None and not _is_number(self.temperature, 0, sys.float_info.max):
            raise bad("temperature", "must be a finite number >= 0")
        if self.top_k is not None and (not _is_int(self.top_k) or not 0 <= self.top_k <= MAX_INT64):
            raise bad("top_k", f"must be an int in [0, {MAX_INT64}] (0 disables it)")
        if self.top_p is not None and (not _is_number(self.top_p, 0, 1) or self.top_p == 0):
            raise bad("top_p", "must be in (0, 1]")
        if self.logprobs is not None and (
            not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise bad("logprobs", f"must be an int in [0, {MAX_LOGPROBS}] (top tokens per token)")
        for name in ("presence_penalty", "frequency_penalty"):
            if not _is_number(getattr(self, name), -2, 2):
                raise bad(name, "must be a number in [-2, 2]")
        if self.logit_bias is not None and not (
            isinstance(self.logit_bias, dict)
            and all(
                _is_int(k) and 0 <= k <= MAX_INT64 and _is_number(v, -100, 100)
                for k, v in self.logit_bias.items()
            )
        ):
            raise bad("logit_bias", "must map token ids (ints >= 0) to numbers in [-100, 100]")
        if self.seed is not None and (
            not _is_int(self.seed) or not -MAX_INT64 - 1 <= self.seed <= MAX_INT64
        ):
            raise bad("seed", "must be an int64 (in [-2**63, 2**63))")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None and not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", "must be a non-empty string or a list of them")
        for name, most in (
            ("stop_token_ids", MAX_STOP_TOKEN_IDS),
            ("bad_token_ids", MAX_BAD_TOKEN_IDS),
        ):
            if not _token_ids(getattr(self, name), most):
                raise bad(name, f"must be a list of at most {most} token ids (ints >= 0)")
            setattr(self, name, list(getattr(self, name)))
        if self.allowed_token_ids is not None:
            if not _token_ids(self.allowed_token_ids, MAX_INT64) or not self.allowed_token_ids:
                raise bad("allowed_token_ids", "must be a non-empty list of token ids (ints >= 0)")
            self.allowed_token_ids = list(self.allowed_token_ids)
        if isinstance(self.bad, str):
            self.bad = [self.bad]
        if self.bad is not None and not (
            isinstance(self.bad, list | tuple)
            and len(self.bad) <= MAX_BAD_WORDS
            and all(
                isinstance(w, str) and w.strip() and len(w) <= MAX_BAD_WORD_CHARS for w in self.bad
            )
        ):
            raise bad(
                "bad",
                f"must be a word or a list of at most {MAX_BAD_WORDS} words, each with a "
                f"character other than whitespace and at most {MAX_BAD_WORD_CHARS} characters",
            )
        if self.bad is not None:
            self.bad = list(self.bad)
        if self.end_id is not None and (not _is_int(self.end_id) or self.end_id < 0):
            raise bad("end_id", "must be a token id (an int >= 0)")
        if isinstance(self.guided_decoding, dict):  # (as it travels between processes)
            self.guided_decoding = GuidedDecodingParams(**self.guided_decoding)
        if self.guided_decoding is not None and not isinstance(
            self.guided_decoding, GuidedDecodingParams
        ):
            raise bad("guided_decoding", "must be a GuidedDecodingParams")

    @property
    def processes_logits(self) -> bool:
        """Whether penalties, a logit bias or token constraints change the target's logits."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.logit_bias
            or self.allowed_token_ids is not None
            or self.bad
            or self.bad_token_ids
        )

    def check_vocab(self, vocab_size: int) -> None:
        """A ``SamplingParamsError`` naming the field of a token id outside ``[0, vocab_size)``."""
        for name in ("stop_token_ids", "allowed_token_ids", "bad_token_ids"):
            outside = [t for t in getattr(self, name) or () if t >= vocab_size]
            if outside:
                raise SamplingParamsError(
                    name,
                    f"SamplingParams.{name}: token ids {outside[:5]} are not in [0, {vocab_size})",
                )
        allowed = self.allowed_token_ids
        if allowed is not None and len(allowed) > vocab_size:
            raise SamplingParamsError(
                "allowed_token_ids",
                f"SamplingParams.allowed_token_ids: {len(allowed)} ids, over the vocabulary's "
                f"{vocab_size}",
            )

    def bad_word_ids(
        self, encode: Callable[[str], list[int]], vocab_size: int
    ) -> tuple[tuple[int, ...], ...]:
        """The token sequences the output never ends with: ``bad``'s words tokenized by
        ``encode`` as vLLM tokenizes ``bad_words`` (as written, without leading whitespace; after
        a space too, where that gives another first token and as many tokens), then
        ``bad_token_ids`` (one token each). A ``SamplingParamsError`` naming ``bad`` for a
        tokenization longer than ``MAX_BAD_WORD_TOKENS`` or outside the vocabulary, and naming
        ``allowed_token_ids`` when the single-token bans leave none of them."""
        words: list[tuple[int, ...]] = []
        for word in self.bad or ():
            plain = tuple(encode(word.lstrip()))
            spaced = tuple(encode(" " + word.lstrip()))
            forms = [plain]
            if plain and spaced[:1] != plain[:1] and len(spaced) == len(plain):
                forms.append(spaced)
            for form in forms:
                if not 1 <= len(form) <= MAX_BAD_WORD_TOKENS:
                    raise SamplingParamsError(
                        "bad",
                        f"SamplingParams.bad: {word!r} is {len(form)} tokens; the step matches 1 to "
                        f"{MAX_BAD_WORD_TOKENS}",
                    )
                if any(t >= vocab_size for t in form):
                    raise SamplingParamsError(
                        "bad", f"SamplingParams.bad: {word!r} has tokens outside [0, {vocab_size})"
                    )
            words += forms
        words += [(t,) for t in self.bad_token_ids]
        banned = {w[0] for w in words if len(w) == 1}
        if self.allowed_token_ids is not None and set(self.allowed_token_ids) <= banned:
            raise SamplingParamsError(
                "allowed_token_ids",
                "SamplingParams.allowed_token_ids: the bad words ban every one of them",
            )
        return tuple(words)

    @property
    def greedy(self) -> bool:
        return not self.temperature or self.top_k == 1


@dataclass(frozen=True)
class GenerationDefaults:
    """A checkpoint's ``generation_config.json`` sampling defaults, as transformers' ``generate``
    reads them: with ``do_sample: true`` a request that leaves ``temperature``, ``top_p`` or
    ``top_k`` unset (None) takes the file's value, else transformers' default (1.0, 1.0, 50);
    without it requests stay greedy by default."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None

    @classmethod
    def from_generation_config(cls, data: dict, where: str) -> GenerationDefaults:
        if data.get("do_sample") is not True:
            return cls()
        values = {"temperature": 1.0, "top_p": 1.0, "top_k": 50}
        values.update({k: data[k] for k in values if data.get(k) is not None})
        try:
            SamplingParams(**values)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
        return cls(**values)

    def openai_temperature(self, requested: float | None) -> float:
        """An OpenAI request's temperature: as requested, else this default, else OpenAI's 1.0."""
        if requested is not None:
            return requested
        return 1.0 if self.temperature is None else self.temperature

    def apply(self, params: SamplingParams) -> SamplingParams:
        unset = {
            name: value
            for name in ("temperature", "top_p", "top_k")
            if getattr(params, name) is None and (value := getattr(self, name)) is not None
        }
        return replace(params, **unset) if unset else params
