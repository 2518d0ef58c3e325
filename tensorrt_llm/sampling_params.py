"""SamplingParams: how one request is decoded (upstream TensorRT-LLM's names)."""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    """Greedy when ``temperature`` is None or 0, or ``top_k == 1``; otherwise sampled.

    ``stop`` strings end generation once the text contains one (the text is cut before it);
    ``stop_token_ids`` and the model's end id end it at that token (kept in ``token_ids``, not in
    ``text``) unless ``ignore_eos``. ``seed`` makes sampling reproducible per request.
    """

    max_tokens: int = 32
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    end_id: int | None = None
    ignore_eos: bool = False
    detokenize: bool = True
    return_generation_logits: bool = False
    # Log-probabilities of the emitted tokens under the target's distribution (its raw logits, the
    # same with or without speculative decoding), and of this many most likely tokens at each.
    logprobs: int | None = None

    def __post_init__(self) -> None:
        def bad(name: str, rule: str) -> ValueError:
            return ValueError(f"SamplingParams.{name}={getattr(self, name)!r}: {rule}")

        if (
            not isinstance(self.max_tokens, int)
            or isinstance(self.max_tokens, bool)
            or self.max_tokens < 1
        ):
            raise bad("max_tokens", "must be an int >= 1")
        if self.temperature is not None and (
            not isinstance(self.temperature, int | float) or self.temperature < 0
        ):
            raise bad("temperature", "must be a number >= 0")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 0):
            raise bad("top_k", "must be an int >= 0 (0 disables it)")
        if self.top_p is not None and (
            not isinstance(self.top_p, int | float) or not 0 < self.top_p <= 1
        ):
            raise bad("top_p", "must be in (0, 1]")
        if self.logprobs is not None and (
            not isinstance(self.logprobs, int)
            or isinstance(self.logprobs, bool)
            or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise bad("logprobs", f"must be an int in [0, {MAX_LOGPROBS}] (top tokens per token)")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", "must be an int")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None and not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", "must be a non-empty string or a list of them")
        self.stop_token_ids = list(self.stop_token_ids)

    @property
    def greedy(self) -> bool:
        return not self.temperature or self.top_k == 1
