"""JSON under a schema on the bundled model, by the whitespace allowed between JSON tokens:
how many replies end of themselves (finish ``stop``) within ``max_tokens``, their mean and longest
length.

The bundled MiniMax-M3-tiny was trained on M3's protocol, never on JSON: under a schema, what it
scores highest among the tokens the grammar allows is often a blank, so the allowance decides
whether a reply ends. Each allowance writes every schema of the structured-output tests
(``tests/unittest/serve/test_structured_bundled.py``: the answer schema, ``SCHEMA`` and
``MORE_SCHEMAS``) for the first ``--questions`` gsm8k-tiny questions (reasoning disabled), greedy
and sampled (temperature 1, top-p 0.95, ``--seeds`` seeds). The allowances:

- ``compact``: no whitespace at all (a request's ``disable_any_whitespace``);
- ``N``: runs of at most N whitespace characters (xgrammar's ``max_whitespace_cnt``);
- ``unbounded``: any whitespace (xgrammar's ``any_whitespace`` without a bound);
- ``default``: ``GuidedDecodingParams(json=...)`` as the engine builds it (``MAX_WHITESPACE``).

Each but ``default`` is sent as the EBNF that xgrammar writes for the schema under it (the same
language the engine compiles from the schema). The ratio measured: replies ending ``stop`` of all
replies; tokens are the replies' own, the end token not counted. The figures count tokens, not time
(the machine is printed for the record).

    python benchmarks/bench_json_whitespace.py [--questions 8] [--seeds 4] [--max-tokens 400]
        [--allowances compact,1,2,4,8,16,unbounded,default]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import xgrammar as xgr
from bench_common import machine_name

from tensorrt_llm import LLM, GuidedDecodingParams, SamplingParams
from tensorrt_llm._torch.pyexecutor.grammar_matcher import MAX_WHITESPACE
from tensorrt_llm.bundled import bundled_prompt
from tensorrt_llm.evaluate.tasks import evaluation_problems
from tensorrt_llm.llmapi.llm_args import KvCacheConfig

TESTS = Path(__file__).resolve().parents[1] / "tests" / "unittest"
sys.path[:0] = [str(TESTS / "serve"), str(TESTS / "llmapi")]
from test_structured_bundled import SCHEMAS  # noqa: E402

ALLOWANCES = ["compact", 1, 2, 4, 8, 16, "unbounded", "default"]


def guide(schema: dict, allowance) -> GuidedDecodingParams:
    text = json.dumps(schema)
    if allowance == "default":
        return GuidedDecodingParams(json=text)
    if allowance == "compact":
        return GuidedDecodingParams(json=text, disable_any_whitespace=True)
    bound = None if allowance == "unbounded" else allowance
    return GuidedDecodingParams(
        grammar=str(xgr.Grammar.from_json_schema(text, max_whitespace_cnt=bound))
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=400)
    parser.add_argument("--allowances", default=",".join(map(str, ALLOWANCES)))
    args = parser.parse_args()
    allowances = [int(a) if a.isdigit() else a for a in args.allowances.split(",")]

    questions = [m[0]["content"] for m, _ in evaluation_problems("gsm8k-tiny", args.questions)]
    prompts = [bundled_prompt(q, thinking_mode="disabled") for q in questions]
    samplings = [{"temperature": 0}] + [
        {"temperature": 1.0, "top_p": 0.95, "seed": seed} for seed in range(1, args.seeds + 1)
    ]
    llm = LLM(
        device="cpu",
        guided_decoding_backend="xgrammar",
        max_batch_size=64,
        kv_cache_config=KvCacheConfig(max_tokens=64 * 640),
    )
    print(f"bundled M3-tiny, {machine_name('cpu')}; MAX_WHITESPACE = {MAX_WHITESPACE}")
    print(
        f"{len(SCHEMAS)} schemas x {len(prompts)} questions x {len(samplings)} samplings "
        f"(greedy + {args.seeds} seeds), max_tokens {args.max_tokens}\n"
    )
    print(f"{'allowance':>10} | {'stop':>9} | {'mean tokens':>11} | {'max tokens':>10}")
    try:
        for allowance in allowances:
            requests = [
                (p, SamplingParams(max_tokens=args.max_tokens, guided_decoding=g, **s))
                for g in (guide(schema, allowance) for schema in SCHEMAS)
                for p in prompts
                for s in samplings
            ]
            outs = llm.generate([p for p, _ in requests], [s for _, s in requests])
            replies = [o.outputs[0] for o in outs]
            lengths = [len(r.token_ids) - (r.finish_reason == "stop") for r in replies]
            ended = sum(r.finish_reason == "stop" for r in replies)
            print(
                f"{allowance!s:>10} | {ended:>4} / {len(replies):<3}"
                f" | {sum(lengths) / len(lengths):>11.1f} | {max(lengths):>10}",
                flush=True,
            )
    finally:
        llm.shutdown()


if __name__ == "__main__":
    main()
