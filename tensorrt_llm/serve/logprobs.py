"""The ``logprobs`` of a choice, in OpenAI's two shapes: chat (``content``: a list of tokens with
their top alternatives) and completions (parallel lists, with each token's text offset). A token
that a constraint refuses (``allowed_token_ids``, a bad word, a grammar) has a logprob of -inf,
which JSON cannot hold: it is sent as ``MIN_LOGPROB``, as vLLM sends it."""

from __future__ import annotations

from tensorrt_llm.tokenizer import TransformersTokenizer

TokenLogprobs = list[tuple[float, list[tuple[int, float]]]]  # LlmRequest.py_logprobs
MIN_LOGPROB = -9999.0


def _finite(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


def _text(tokenizer: TransformersTokenizer, token: int) -> str:
    return tokenizer.decode([token], skip_special_tokens=False)


def chat_logprobs(
    tokenizer: TransformersTokenizer, token_ids: list[int], logprobs: TokenLogprobs
) -> dict:
    def entry(token: int, logprob: float) -> dict:
        text = _text(tokenizer, token)
        return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode())}

    return {
        "content": [
            entry(token, logprob) | {"top_logprobs": [entry(t, lp) for t, lp in top]}
            for token, (logprob, top) in zip(token_ids, logprobs, strict=True)
        ]
    }


def completion_logprobs(
    tokenizer: TransformersTokenizer,
    token_ids: list[int],
    logprobs: TokenLogprobs,
    text_offset: int = 0,
) -> dict:
    tokens = [_text(tokenizer, t) for t in token_ids]
    offsets = []
    for text in tokens:
        offsets.append(text_offset)
        text_offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [_finite(logprob) for logprob, _ in logprobs],
        "top_logprobs": [
            {_text(tokenizer, t): _finite(lp) for t, lp in top} for _, top in logprobs
        ],
        "text_offset": offsets,
    }
