"""What a training batch of the target's corpus holds, and (``--model``) how well a trained target
predicts its trained tokens, digits apart from the rest, teacher-forced on fresh batches.

    python examples/training/corpus_stats.py --format m3 [--batch-tokens 12288] [--model DIR]

Digits are what the bundled tasks turn on (the numbers a reply copies from the question, the
column working, a tool call's arguments): a target that predicts the rest of its replies but not
the digits has seen too few of them, which this shows per format at a given batch size.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import Batches, build_tokenizer  # noqa: E402

from tensorrt_llm._torch.models.checkpoint import load_model  # noqa: E402
from tensorrt_llm._torch.training import use_training_backend  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--format", default="plain", choices=["plain", "m3"])
    parser.add_argument("--batch-tokens", type=int, default=12288)
    parser.add_argument("--conversations", type=int, default=5000)
    parser.add_argument("--batches", type=int, default=300, help="batches sampled")
    parser.add_argument("--seed", type=int, default=0, help="the corpus seed")
    parser.add_argument("--model", type=Path, help="a trained target of that format")
    parser.add_argument("--model-batches", type=int, default=4, help="batches run through it")
    args = parser.parse_args()

    tokenizer = build_tokenizer(args.format)
    batches = Batches(
        tokenizer, args.seed, args.conversations, args.batch_tokens, 700, chat_format=args.format
    )
    digits = torch.tensor([tokenizer.token_to_id(c) for c in "0123456789"])
    totals = torch.zeros(3)  # tokens (not padding), trained, trained digits
    for _ in range(args.batches):
        ids, mask = batches.sample()
        totals += torch.tensor(
            [(ids != batches.pad_id).sum(), mask.sum(), (torch.isin(ids, digits) * mask).sum()]
        )
    tokens, trained, trained_digits = (totals / args.batches).tolist()
    print(
        f"{args.format}, batches of {args.batch_tokens} tokens: {tokens:.0f} tokens, "
        f"{trained:.0f} trained, {trained_digits:.0f} trained digits per batch"
    )
    if args.model is None:
        return
    model = load_model(args.model, torch.float32, torch.device("cpu"))
    right = torch.zeros(2)  # digits, the rest
    count = torch.zeros(2)
    with torch.no_grad(), use_training_backend(model, train_indexer=False):
        for _ in range(args.model_batches):
            ids, mask = batches.sample()
            hidden, _ = model(ids)
            hit = model.compute_logits(hidden[:, :-1]).argmax(-1) == ids[:, 1:]
            trained, is_digit = mask[:, 1:] > 0, torch.isin(ids[:, 1:], digits)
            for k, kind in enumerate((is_digit, ~is_digit)):
                right[k] += (hit & trained & kind).sum()
                count[k] += (trained & kind).sum()
    accuracy = (right / count.clamp(min=1)).tolist()
    print(
        f"{args.model}: teacher-forced accuracy on trained digits {accuracy[0]:.3f} "
        f"({count[0]:.0f}), on the other trained tokens {accuracy[1]:.3f} ({count[1]:.0f})"
    )


if __name__ == "__main__":
    main()
