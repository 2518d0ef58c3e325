"""Write the training corpus as JSON lines (one conversation per line), deterministic by seed.

    python examples/training/make_corpus.py --seed 0 --count 1000 --out corpus.jsonl

The training scripts draw the same conversations in memory (``training_conversations``); this is
for reading them. The chat template renders each line exactly as training sees it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tensorrt_llm.evaluate.tasks import evaluation_questions, training_conversations

sys.path.insert(0, str(Path(__file__).parent))
from common import render  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--count", type=int, default=1000)
    parser.add_argument("--out", type=Path, default=Path("corpus.jsonl"))
    parser.add_argument(
        "--rendered", action="store_true", help="write the chat-template text instead"
    )
    args = parser.parse_args()
    with args.out.open("w") as f:
        convs, _ = training_conversations(args.seed, args.count, exclude=evaluation_questions())
        for conv in convs:
            record = (
                {"text": render(conv, add_generation_prompt=False)}
                if args.rendered
                else {"messages": conv}
            )
            f.write(json.dumps(record) + "\n")
    print(f"wrote {args.count} conversations to {args.out}")


if __name__ == "__main__":
    main()
