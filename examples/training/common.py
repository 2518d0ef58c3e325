"""Shared by the training scripts: the tokenizer, the corpus as token batches, schedules."""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer
from tqdm import tqdm

from tensorrt_llm.evaluate.tasks import (
    TRAINING_MIX,
    evaluation_questions,
    held_out_record,
    training_conversations,
)
from tensorrt_llm.tokenizer import (
    CHAT_ALPHABET,
    CHAT_SPECIAL_TOKENS,
    END,
    PLAIN_CHAT_TEMPLATE,
    build_char_tokenizer,
    plain_tokenizer_config,
    render_chat_template,
)


def render(messages: list[dict], add_generation_prompt: bool = True) -> str:
    return render_chat_template(PLAIN_CHAT_TEMPLATE, messages, add_generation_prompt, eos_token=END)


def build_tokenizer(chat_format: str = "plain") -> Tokenizer:
    if chat_format == "m3":
        from m3_format import build_m3_tokenizer

        return build_m3_tokenizer()
    return build_char_tokenizer(CHAT_ALPHABET, CHAT_SPECIAL_TOKENS)


def save_tokenizer(tokenizer: Tokenizer, model_dir: Path, chat_format: str = "plain") -> None:
    if chat_format == "m3":
        from m3_format import save_m3_tokenizer

        save_m3_tokenizer(tokenizer, model_dir)
        return
    model_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(model_dir / "tokenizer.json"))
    config = plain_tokenizer_config()
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def encode_conversation(tokenizer: Tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """Token ids of the rendered conversation and a 0/1 loss mask: 1 on assistant content and its
    closing ``<|end|>`` (what the model is trained to produce)."""
    ids: list[int] = []
    mask: list[int] = []
    for message in messages:
        text = render([message], add_generation_prompt=False)
        piece = tokenizer.encode(text, add_special_tokens=False).ids
        ids += piece
        trained = message["role"] == "assistant"
        mask += [0] + [int(trained)] * (len(piece) - 1)  # the role tag is given, not predicted
    return ids, mask


class Batches:
    """Seeded batches of whole conversations, grouped by length (padding to a multiple of 64).

    The corpus is ``training_conversations(corpus_seed, ...)`` without the evaluation problems
    (``evaluation_questions``); ``record`` says so in ``training.json``."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        corpus_seed: int,
        num_conversations: int,
        batch_tokens: int,
        long_min_chars: int,
        mix: tuple[float, float, float] = TRAINING_MIX,
        chat_format: str = "plain",
    ):
        """``chat_format``: ``plain`` (the ``<|user|>`` format) or ``m3`` (MiniMax-M3's
        protocol, ``m3_format.py``: its own mix)."""
        if chat_format == "m3":
            from m3_format import M3_MIX, encode_m3, m3_conversations

            m3_convs, skipped = m3_conversations(
                corpus_seed, num_conversations, evaluation_questions(), long_min_chars
            )
            names = ("gsm8k-thinking", "tool-use", "multiturn-copy", "long-prompt")
            shares = dict(zip(names, M3_MIX))
            self.examples = [e for c in m3_convs for e in encode_m3(tokenizer, c)]
        else:
            convs, skipped = training_conversations(
                corpus_seed, num_conversations, long_min_chars, evaluation_questions(), mix
            )
            shares = dict(zip(("gsm8k-tiny", "multiturn-copy", "long-prompt"), mix))
            self.examples = [encode_conversation(tokenizer, c) for c in convs]
        self.record = {
            "corpus_seed": corpus_seed,
            "conversations": num_conversations,
            "chat_format": chat_format,
            "mix": shares,
            "long_min_chars": long_min_chars,
            "held_out": {**held_out_record(), "conversations_skipped": skipped},
        }
        self.examples.sort(key=lambda e: len(e[0]))
        self.pad_id = tokenizer.token_to_id("<pad>")
        self.batch_tokens = batch_tokens
        self.rng = random.Random(corpus_seed + 1)

    def sample(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``input_ids [B, T]`` and ``loss_mask [B, T]`` (mask[t] = 1 when token t is trained)."""
        start = self.rng.randrange(len(self.examples))
        length = math.ceil(len(self.examples[start][0]) / 64) * 64
        count = max(1, self.batch_tokens // length)
        lo = max(0, min(start, len(self.examples) - count))
        chosen = self.examples[lo : lo + count]
        length = math.ceil(max(len(ids) for ids, _ in chosen) / 64) * 64
        ids = torch.full((len(chosen), length), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(chosen), length), dtype=torch.float32)
        for row, (tokens, trained) in enumerate(chosen):
            ids[row, : len(tokens)] = torch.tensor(tokens)
            mask[row, : len(trained)] = torch.tensor(trained, dtype=torch.float32)
        return ids, mask


def chained_soft_loss(
    outputs: list[torch.Tensor], target_probs: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """A drafter's loss over its chained steps (``outputs[i] [B, T, V]``: step ``i`` at row ``s``
    predicts token ``s + i + 2``): the cross-entropy from the target's distribution at position
    ``s + i + 1`` (soft labels, ``target_probs [B, T, V]``), inside assistant replies (``mask``),
    later steps weighted by ``0.8 ** i``."""
    length = target_probs.shape[1]
    loss = 0.0
    for i, logits in enumerate(outputs):
        valid = length - i - 1
        labels = target_probs[:, i + 1 : i + 1 + valid]
        weight = mask[:, i + 1 : i + 1 + valid]
        ce = -(labels * torch.log_softmax(logits[:, :valid].float(), dim=-1)).sum(-1)
        loss = loss + 0.8**i * (ce * weight).sum() / weight.sum().clamp(min=1)
    return loss


def cosine_lr(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def apply_preset(args, presets: dict[str, tuple[int, int, int]]) -> torch.device:
    """Fill ``steps``, ``batch_tokens`` and ``conversations`` left unset from the device's preset.
    The "gpu" preset made the bundled checkpoint; "cpu" fits about 15 minutes on 2 cores and gives
    a weaker model. Returns the device."""
    device = pick_device(args.device)
    steps, batch_tokens, conversations = presets["gpu" if device.type == "cuda" else "cpu"]
    args.steps = args.steps or steps
    args.batch_tokens = args.batch_tokens or batch_tokens
    args.conversations = args.conversations or conversations
    return device


def set_lr(optimizer: torch.optim.Optimizer, step: int, args) -> None:
    """The cosine schedule's rate at ``step`` of ``args.steps`` (peak ``args.lr``, 50 warm-up)."""
    for group in optimizer.param_groups:
        group["lr"] = cosine_lr(step, args.steps, args.lr, warmup=50)


def schedule_steps(args, done: int, elapsed: float, since: tuple[int, float]) -> bool:
    """Shorten ``args.steps`` to what fits ``args.minutes``, at the rate measured from ``since``
    (a step and its time, past the first steps' warm-up) to ``done`` (the cosine schedule then
    ends on time). Returns whether it shortened it."""
    if args.minutes is None:
        return False
    budget = args.minutes * 60 - elapsed
    rate = (done - since[0]) / (elapsed - since[1])
    fits = done + int(budget * rate)
    if fits >= args.steps:
        return False
    args.steps = max(fits, done + 1)
    return True


def training_steps(args, what: str):
    """Yield ``(step, progress bar)`` for steps 0 .. ``args.steps`` - 1; under ``--minutes`` the
    count may shrink once, early (``schedule_steps``: the rate of steps 10 to 40, past the warm-up),
    so read ``args.steps`` inside the loop."""
    start, since = time.time(), (0, 0.0)
    bar = tqdm(total=args.steps, desc=what, mininterval=2.0)
    step = 0
    while step < args.steps:
        yield step, bar
        step += 1
        bar.update()
        if step == 10:
            since = (step, time.time() - start)
        if step == 40 and schedule_steps(args, step, time.time() - start, since):
            bar.total = args.steps
            print(f"{what}: {args.steps} steps fit --minutes {args.minutes}", flush=True)
    bar.close()


def drafter_update(
    optimizer: torch.optim.Optimizer, params: list, loss: torch.Tensor, what: str, step: int
) -> None:
    """One update of a drafter from ``loss`` (clipped at norm 1); a loss that is not finite stops
    the script with a message naming ``what``."""
    if not torch.isfinite(loss):
        raise SystemExit(f"{what}: loss is {loss.item()} at step {step}; try a lower --lr")
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    optimizer.step()


def mixed_precision(device: torch.device):
    """The training forward's autocast: bf16 on CUDA, none (fp32) on the CPU."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


def drafter_arguments(parser: argparse.ArgumentParser, out: str, seed: int) -> None:
    """The options the drafter scripts share (``--target``, ``--out`` defaulting to ``out``, the
    schedule, ``--format``)."""
    parser.add_argument("--target", type=Path, default=Path("examples/models/m3-tiny/target"))
    parser.add_argument("--out", type=Path, default=Path(out))
    parser.add_argument("--seed", type=int, default=seed)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--batch-tokens", type=int, default=None)
    parser.add_argument("--conversations", type=int, default=None)
    parser.add_argument("--max-draft-len", type=int, default=3)
    # 2e-3 diverged (NaN) past ~800-1700 steps of a 6000-7000-step Eagle3 schedule
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--device", default="auto")
    parser.add_argument(
        "--minutes",
        type=float,
        default=None,
        help="fit the schedule into this wall-clock budget: after the first steps, fewer steps "
        "(never more) if the measured rate would overrun it",
    )
    parser.add_argument(
        "--format", default="plain", choices=["plain", "m3"], help="the target's chat protocol"
    )


def write_training_record(
    args, device: torch.device, script: str, batches: Batches, name: str = "training.json"
) -> None:
    """``training.json`` (or ``name``) beside the weights: what made them, the corpus
    (``batches.record``: its seed and the evaluation problems it holds out) included."""
    record = {
        "script": f"examples/training/{script}",
        "seed": args.seed,
        **batches.record,
        "steps": args.steps,
        **({"minutes": args.minutes} if getattr(args, "minutes", None) else {}),
        "lr": args.lr,
        "batch_tokens": args.batch_tokens,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
    }
    if getattr(args, "init_from", None) is not None:
        record["init_from"] = started_from(args.init_from, name)
    (args.out / name).write_text(json.dumps(record, indent=2) + "\n")


def started_from(model_dir: Path, name: str = "training.json") -> dict:
    """What a warm start began from: the checkpoint's path and its own ``training.json`` (so a
    record names every corpus its weights have seen, stage by stage)."""
    path = Path(model_dir) / name
    record = json.loads(path.read_text()) if path.is_file() else None
    return {"path": str(model_dir), "training": record}


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)
