"""Grammars for guided decoding, with xgrammar: the tokenizer's vocabulary as xgrammar reads it, a
compiler that works off the step (one worker thread, compiled grammars cached by their text), and
a matcher per request. A front end has the engine compile a constraint before it submits the
request (``LLM.compile_guide``): the request then finds it compiled.

A token's bit in a mask row is set when the grammar allows it next. Control (special) tokens
are never allowed, save the stop tokens once the grammar is complete; ids past the tokenizer's
vocabulary (a model's padded rows) never."""

from __future__ import annotations

import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

from tensorrt_llm.sampling_params import GuidedDecodingParams

if TYPE_CHECKING:
    import torch
    from tokenizers import Tokenizer

BACKENDS = ("xgrammar",)
CACHED_GRAMMARS = 256  # compiled grammars kept, the most recently used,
CACHE_BYTES = 512 << 20  # and at most this much of them (a vocabulary of 200K makes large ones)
COMPILE_TIMEOUT_S = 30.0  # a request whose grammar takes longer ends with an error
COMPILE_THREADS = 4  # grammars compiled at once (a server's gate lets as many in)
MAX_WHITESPACE = 4
"""JSON's whitespace between tokens (a schema's, ``json_layout``; the JSON in a structural tag and
the tool-call markup's): at most this many characters in a row. Room for ``json.dumps``'s
``", "`` and ``": "`` and a newline with a short indent; a model that scores blanks high still
ends. On the bundled model (never trained on JSON; a character vocabulary: a blank is a token),
every schema of the structured-output tests over 8 questions, greedy and 4 seeds, max_tokens 400
(``python benchmarks/bench_json_whitespace.py``; replies ending ``stop`` of 240, their tokens):

    allowance   compact   1     2     4     8     16    unbounded
    stop        240       240   240   240   240   240   153
    mean        28.9      41.0  49.1  63.9  89.4  129.6 219.3
    longest     70        96    120   161   246   388   400

At 16 (the earlier default) the longest reply is 97% of max_tokens, and replies to other prompts
ran out; at 4 it is 40%. vLLM and SGLang leave xgrammar's whitespace unbounded by default
(``any_whitespace=True``, no ``max_whitespace_cnt``: vLLM's ``disable_any_whitespace=False`` in
``StructuredOutputsConfig``, read by ``backend_xgrammar.py``; SGLang's
``--constrained-json-disable-any-whitespace`` off, passed to ``XGrammarGrammarBackend``). A
request asks for none with ``disable_any_whitespace``."""
# a step's mask rows at one position filled on xgrammar's threads past this many (vLLM's
# threshold for its thread pool, 128, is of the same order)
PARALLEL_FILL_ROWS = 128
ANY_OBJECT = '{"type": "object"}'  # json_object


def _xgrammar():
    try:
        import xgrammar
    except ImportError:
        raise ValueError(
            "guided_decoding_backend='xgrammar' needs the xgrammar package (pip install xgrammar)"
        ) from None
    return xgrammar


def check_backend(backend: str | None) -> None:
    """A ``ValueError`` for a backend this engine does not have."""
    if backend is not None and backend not in BACKENDS:
        raise ValueError(
            f"guided_decoding_backend={backend!r}: expected one of {', '.join(BACKENDS)} (or None)"
        )
    if backend is not None:
        _xgrammar()


def json_layout(compact: bool) -> dict:
    """xgrammar's whitespace arguments of a JSON schema: none at all (``compact``, the
    ``disable_any_whitespace`` of a request), or runs of up to ``MAX_WHITESPACE``."""
    if compact:
        return {"any_whitespace": False, "separators": (",", ":")}
    return {"max_whitespace_cnt": MAX_WHITESPACE}


def json_schema_ebnf(schema: str) -> str:
    """A JSON schema's compact grammar as EBNF (where a structural tag holds it)."""
    return str(_xgrammar().Grammar.from_json_schema(schema, **json_layout(True)))


def tokenizer_info(tokenizer: Tokenizer, vocab_size: int, stop_token_ids: list[int]):
    """``xgrammar.TokenizerInfo`` of a ``tokenizers.Tokenizer`` for a model of ``vocab_size``
    logits: its kind (byte-level, byte-fallback or raw text) read as xgrammar reads a Hugging Face
    tokenizer, each token's own text, control tokens as none (never allowed)."""
    xgr = _xgrammar()
    from transformers import PreTrainedTokenizerFast

    detected = xgr.TokenizerInfo.from_huggingface(
        PreTrainedTokenizerFast(tokenizer_object=tokenizer),
        vocab_size=vocab_size,
        stop_token_ids=stop_token_ids or None,  # (none: as xgrammar finds them)
    )
    special = {t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special}
    size = tokenizer.get_vocab_size()
    vocab = [tokenizer.id_to_token(i) or "" for i in range(size)]
    vocab = ["" if t in special else t for t in vocab]
    return xgr.TokenizerInfo(
        vocab,
        detected.vocab_type,
        vocab_size=max(vocab_size, size),
        stop_token_ids=stop_token_ids or detected.stop_token_ids,
        add_prefix_space=detected.add_prefix_space,
    )


class GrammarCompiler:
    """Compiles constraints for one tokenizer on ``COMPILE_THREADS`` worker threads (xgrammar
    leaves the interpreter's lock while it builds); the same constraint compiles once
    (``CACHED_GRAMMARS`` and ``CACHE_BYTES`` kept)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: list[int]) -> None:
        xgr = _xgrammar()
        self.info = tokenizer_info(tokenizer, vocab_size, stop_token_ids)
        self.vocab_size = vocab_size
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="grammar")
        self._cache: OrderedDict[tuple[str, str, bool], Future] = OrderedDict()
        self._serial = xgr.BatchGrammarMatcher(max_threads=1)
        self._parallel = xgr.BatchGrammarMatcher()  # (half the hardware threads)

    def submit(self, guide: GuidedDecodingParams) -> Future:
        """The compiled grammar of ``guide``, as a future (done at once when cached)."""
        key = (guide.kind, guide.text, guide.disable_any_whitespace)
        future = self._cache.get(key)
        if future is not None and not (future.done() and future.exception() is not None):
            self._cache.move_to_end(key)
            return future
        future = self._pool.submit(self._compile, *key)
        self._cache[key] = future
        while len(self._cache) > CACHED_GRAMMARS or self._cached_bytes() > CACHE_BYTES:
            self._cache.popitem(last=False)
        return future

    def _cached_bytes(self) -> int:
        done = (f for f in self._cache.values() if f.done() and f.exception() is None)
        return sum(f.result().memory_size_bytes for f in done)

    def _compile(self, kind: str, text: str, compact: bool):
        compiler = self._compiler
        if kind in ("json", "json_object"):
            schema = text if kind == "json" else ANY_OBJECT
            return compiler.compile_json_schema(schema, **json_layout(compact))
        if kind == "regex":
            return compiler.compile_regex(text)
        if kind == "grammar":
            return compiler.compile_grammar(text)
        return compiler.compile_structural_tag(text)

    def matcher(self, compiled, stop_token_ids: list[int] | None):
        """A new matcher of a compiled grammar, which ends at one of ``stop_token_ids`` (None:
        the tokenizer's; it takes back any number of tokens: a step's drafts)."""
        xgr = _xgrammar()
        return xgr.GrammarMatcher(compiled, override_stop_tokens=stop_token_ids)

    def fill_rows(self, matchers: list, mask: torch.Tensor, rows: list[int]) -> None:
        """Each matcher's next-token mask into its row of ``mask``, in one call: on this thread
        up to ``PARALLEL_FILL_ROWS`` rows, on xgrammar's threads beyond (a call on its threads
        starts them, which costs more than a few hundred cheap rows)."""
        batch = self._parallel if len(matchers) > PARALLEL_FILL_ROWS else self._serial
        batch.batch_fill_next_token_bitmask(matchers, mask, rows)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class Pending:
    """A request's grammar being compiled, since when, and the state its request resumes once it
    is ready (None: the request did not wait)."""

    def __init__(self, future: Future) -> None:
        self.future = future
        self.started = time.monotonic()
        self.resume = None

    @property
    def timed_out(self) -> bool:
        return not self.future.done() and time.monotonic() - self.started > COMPILE_TIMEOUT_S
