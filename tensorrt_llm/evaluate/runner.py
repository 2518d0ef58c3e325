"""Running the tasks against an ``LLM``, and the acceptance-length (AL) table.

Every task is greedy. AL is ``avg_decoded_tokens_per_iter``: tokens per generation step (accepted
drafts + 1), averaged over a turn's requests; 1.0 without speculation. A reply is scored, and kept
in a conversation's history, by its content as a chat client reads it (``reply_content``): a
MiniMax-M3 model's reasoning block split off.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tensorrt_llm.evaluate.tasks import evaluation_problems, parse_answer
from tensorrt_llm.llmapi.reasoning_parser import ReasoningParserFactory
from tensorrt_llm.logger import logger
from tensorrt_llm.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=128, temperature=0)


@dataclass
class TurnResult:
    al: float
    exact: float  # fraction of replies equal to the reference
    reused_tokens: int
    token_ids: list[list[int]] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)


def reply_content(text: str, prompt: str | None = None) -> str:
    """The content of a reply as ``trtllm-serve --reasoning_parser minimax_m3`` returns it: a
    ``<mm:think>`` block or a bare ``</mm:think>`` split off (where the reply starts read from the
    rendered ``prompt`` when given); text without the markers (a plain-format model's, or content
    a server has parsed already) is unchanged."""
    parser = ReasoningParserFactory.create_reasoning_parser("minimax_m3", prompt=prompt)
    return parser.parse(text).content


def mean_al(outputs) -> float:
    values = [o.outputs[0].avg_decoded_tokens_per_iter or 1.0 for o in outputs]
    return sum(values) / len(values)


def warn_unless_held_out(*model_dirs: str | Path | None) -> None:
    """A warning for each checkpoint whose ``training.json`` does not say its corpus held out the
    evaluation problems (``tasks.held_out_record``): its scores may count training problems."""
    for model_dir in model_dirs:
        path = Path(model_dir) / "training.json" if model_dir else None
        if path is not None and path.is_file() and "held_out" not in json.loads(path.read_text()):
            logger.warning(
                "%s records no held-out evaluation problems: the corpus it names may hold some",
                path,
            )


def run_gsm8k(llm, count: int, progress: Callable[[str], None] = print) -> dict:
    problems = evaluation_problems("gsm8k-tiny", count)
    prompts = [llm.tokenizer.apply_chat_template(messages[:1]) for messages, _ in problems]
    outputs = llm.generate(prompts, GREEDY)
    correct = [
        parse_answer(reply_content(o.outputs[0].text, p)) == answer
        for p, o, (_, answer) in zip(prompts, outputs, problems, strict=True)
    ]
    result = {
        "accuracy": sum(correct) / len(correct),
        "al": mean_al(outputs),
        "num_samples": len(correct),
        "token_ids": [o.outputs[0].token_ids for o in outputs],
        "texts": [o.outputs[0].text for o in outputs],
    }
    progress(f"gsm8k-tiny: {sum(correct)}/{len(correct)} correct, AL {result['al']:.3f}")
    return result


def run_long_prompt(llm, count: int, progress: Callable[[str], None] = print) -> dict:
    items = evaluation_problems("long-prompt", count)
    prompts = [llm.tokenizer.apply_chat_template(messages[:1]) for messages, _ in items]
    outputs = llm.generate(prompts, GREEDY)
    correct = [
        f"The secret code is {code}." == reply_content(o.outputs[0].text, p)
        for p, o, (_, code) in zip(prompts, outputs, items, strict=True)
    ]
    lengths = [len(llm.tokenizer.encode(p)) for p in prompts]
    result = {
        "accuracy": sum(correct) / len(correct),
        "al": mean_al(outputs),
        "num_samples": len(correct),
        "min_prompt_tokens": min(lengths),
        "token_ids": [o.outputs[0].token_ids for o in outputs],
    }
    progress(
        f"long-prompt: {sum(correct)}/{len(correct)} correct (prompts of {min(lengths)}+ tokens), AL {result['al']:.3f}"
    )
    return result


def run_multiturn_copy(
    llm, count: int, progress: Callable[[str], None] = print
) -> list[TurnResult]:
    """Four turns per conversation; each turn's prompt is the whole history with the model's own
    earlier replies, so turns 2-4 find turn 1..n-1 in the prefix cache."""
    convs = evaluation_problems("multiturn-copy", count)
    histories: list[list[dict]] = [[] for _ in convs]
    turns = []
    for t in range(4):
        for history, conv in zip(histories, convs, strict=True):
            history.append(conv[2 * t])
        before = llm.get_stats()["num_reused_tokens"]
        prompts = [llm.tokenizer.apply_chat_template(h) for h in histories]
        outputs = llm.generate(prompts, GREEDY)
        replies = [
            reply_content(o.outputs[0].text, p) for p, o in zip(prompts, outputs, strict=True)
        ]
        exact = [r == c[2 * t + 1]["content"] for r, c in zip(replies, convs, strict=True)]
        turn = TurnResult(
            al=mean_al(outputs),
            exact=sum(exact) / len(exact),
            reused_tokens=llm.get_stats()["num_reused_tokens"] - before,
            token_ids=[o.outputs[0].token_ids for o in outputs],
            texts=[o.outputs[0].text for o in outputs],
        )
        turns.append(turn)
        progress(
            f"multiturn-copy turn {t + 1}: AL {turn.al:.3f}, exact {turn.exact:.2f}, reused {turn.reused_tokens} tokens"
        )
        for history, reply in zip(histories, replies, strict=True):
            history.append({"role": "assistant", "content": reply})
    return turns


def run_gsm8k_http(url: str, count: int, progress: Callable[[str], None] = print) -> dict:
    """gsm8k-tiny through an OpenAI-compatible endpoint (a disaggregated router, say)."""
    from tensorrt_llm.evaluate.deployment import chat_many

    problems = evaluation_problems("gsm8k-tiny", count)
    replies = chat_many(url, [messages[:1] for messages, _ in problems], GREEDY.max_tokens)
    correct = [
        parse_answer(reply_content(r["text"])) == answer
        for r, (_, answer) in zip(replies, problems, strict=True)
    ]
    result = {
        "accuracy": sum(correct) / len(correct),
        "al": sum(r["al"] for r in replies) / len(replies),
        "num_samples": len(correct),
        "texts": [r["text"] for r in replies],
    }
    progress(f"gsm8k-tiny via {url}: {sum(correct)}/{len(correct)} correct, AL {result['al']:.3f}")
    return result


def run_multiturn_copy_http(
    url: str, count: int, reuse_url: str, progress: Callable[[str], None] = print
) -> list[TurnResult]:
    """multiturn-copy through an endpoint; ``reuse_url``'s /metrics counts prefix-cache hits."""
    from tensorrt_llm.evaluate.deployment import chat_many, metric

    convs = evaluation_problems("multiturn-copy", count)
    histories: list[list[dict]] = [[] for _ in convs]
    turns = []
    for t in range(4):
        for history, conv in zip(histories, convs, strict=True):
            history.append(conv[2 * t])
        before = metric(reuse_url, "trtllm_prefix_reused_tokens_total")
        replies = chat_many(url, histories, GREEDY.max_tokens)
        contents = [reply_content(r["text"]) for r in replies]
        exact = [r == c[2 * t + 1]["content"] for r, c in zip(contents, convs, strict=True)]
        turn = TurnResult(
            al=sum(r["al"] for r in replies) / len(replies),
            exact=sum(exact) / len(exact),
            reused_tokens=int(metric(reuse_url, "trtllm_prefix_reused_tokens_total") - before),
            texts=[r["text"] for r in replies],
        )
        turns.append(turn)
        progress(
            f"multiturn-copy turn {t + 1} via {url}: AL {turn.al:.3f}, exact {turn.exact:.2f}, reused {turn.reused_tokens} tokens"
        )
        for history, content in zip(histories, contents, strict=True):
            history.append({"role": "assistant", "content": content})
    return turns
