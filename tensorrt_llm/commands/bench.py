"""``trtllm-bench --url URL [--concurrency 1,4,16 | --request-rate 2,8] [--num-requests 64]``.

Measures serving latency and throughput of any OpenAI-compatible server (``trtllm-serve``, or
another): each level of the sweep sends the same fixed-seed workload, streamed, after a warm-up,
and reports TTFT, ITL and TPOT (p50 / p90 / p99), request throughput, output tokens/s and the mean
acceptance length. A table goes to stdout; ``--out`` writes every figure as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tqdm import tqdm

from tensorrt_llm.bench.serving import DATASETS, Workload, run_spread, summarize


def _numbers(kind):
    def parse(text: str):
        try:
            values = [kind(v) for v in text.split(",") if v.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list") from None
        if not values or any(v <= 0 for v in values):
            raise argparse.ArgumentTypeError(f"{text!r}: every value must be positive")
        return values

    return parse


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="trtllm-bench", description=__doc__.splitlines()[0])
    p.add_argument("--url", required=True, help="the server's base URL, e.g. http://localhost:8000")
    p.add_argument("--model", default=None, help="the model name to send (default: the server's)")
    sweep = p.add_mutually_exclusive_group()
    sweep.add_argument("--concurrency", type=_numbers(int), default=None, help="e.g. 1,4,16")
    sweep.add_argument("--request-rate", type=_numbers(float), default=None, help="requests/s")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--dataset", choices=DATASETS, default="gsm8k")
    p.add_argument("--input-len", type=int, default=128, help="words per random prompt")
    p.add_argument("--output-len", type=int, default=64, help="max_tokens of every request")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--warmup", type=int, default=4, help="requests sent before the sweep")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--api-key", default=None)
    p.add_argument(
        "--client-processes",
        type=int,
        default=1,
        help="client processes sharing each level, each with its share of the concurrency, all "
        "taking the next request from one queue (a single process can be the limit at high load)",
    )
    p.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    return p


def _row(label: str, s: dict) -> str:
    def ms(stats, key):
        v = stats[key]
        return "-" if v is None else f"{1000 * v:.1f}"

    al = "-" if s["mean_al"] is None else f"{s['mean_al']:.2f}"
    cells = [label, f"{s['requests'] - s['failed']}/{s['requests']}"]
    for name in ("ttft_s", "itl_s", "tpot_s"):
        cells += [ms(s[name], q) for q in ("p50", "p90", "p99")]
    cells += [f"{s['request_throughput']:.2f}", f"{s['output_tokens_per_s']:.1f}", al]
    return "| " + " | ".join(cells) + " |"


HEADER = (
    "| level | ok | TTFT p50 | p90 | p99 | ITL p50 | p90 | p99 | TPOT p50 | p90 | p99 "
    "| req/s | out tok/s | mean AL |\n|" + " --- |" * 14
)


def _bodies(args, model: str) -> list[dict]:
    workload = Workload(args.dataset, args.num_requests, args.input_len, args.output_len, args.seed)
    extra = {"model": model, "max_tokens": args.output_len, "temperature": 0, "stream": True}
    extra["stream_options"] = {"include_usage": True}
    if args.ignore_eos:
        extra["ignore_eos"] = True
    return [{**body, **extra} for body in workload.requests()]


def _model(args, headers) -> str:
    import httpx

    if args.model:
        return args.model
    reply = httpx.get(args.url.rstrip("/") + "/v1/models", headers=headers, timeout=30)
    reply.raise_for_status()
    return reply.json()["data"][0]["id"]


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    for flag in ("num_requests", "client_processes"):
        if getattr(args, flag) < 1:
            print(f"trtllm-bench: --{flag.replace('_', '-')} must be at least 1", file=sys.stderr)
            return 2
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        model = _model(args, headers)
    except Exception as exc:  # unreachable, not OpenAI-compatible, a bad key
        print(f"trtllm-bench: {args.url}/v1/models: {exc}", file=sys.stderr)
        return 2
    url = args.url.rstrip("/") + "/v1/chat/completions"
    bodies = _bodies(args, model)
    levels = [("concurrency", c) for c in args.concurrency or []]
    levels += [("request_rate", r) for r in args.request_rate or []]
    levels = levels or [("concurrency", 1)]
    if args.warmup:
        run_spread(url, bodies[: args.warmup], concurrency=args.warmup, headers=headers)
    report = {"url": args.url, "model": model, "workload": vars(args) | {"out": None}, "levels": []}
    print(HEADER)
    for kind, value in levels:
        with tqdm(total=len(bodies), desc=f"{kind}={value}", file=sys.stderr, leave=False) as bar:
            results, wall = run_spread(
                url,
                bodies,
                concurrency=value if kind == "concurrency" else None,
                request_rate=value if kind == "request_rate" else None,
                seed=args.seed,
                on_done=bar.update,
                headers=headers,
                processes=args.client_processes,
            )
        summary = summarize(results, wall)
        report["levels"].append({kind: value, **summary})
        print(_row(f"{kind}={value:g}", summary), flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=2, default=str))
    failed = sum(level["failed"] for level in report["levels"])
    if failed:
        print(f"trtllm-bench: {failed} requests failed", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
