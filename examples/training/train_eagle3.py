"""Train the bundled Eagle3 drafter against the trained target (training-time test, soft labels).

    python examples/training/train_eagle3.py --target examples/models/m3-tiny/target \\
        --out examples/models/m3-tiny/eagle3 [--device cuda]

Each step runs ``max_draft_len + 1`` chained draft steps from every position at once
(``ttt_logits``) and minimises the cross-entropy from the target's next-token distribution (soft
labels) at the position each step predicts, weighting later steps by ``0.8 ** i``. ``fc`` starts
scaled to the target's feature RMS (``feature_rms``).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import (  # noqa: E402
    Batches,
    apply_preset,
    build_tokenizer,
    chained_soft_loss,
    drafter_arguments,
    drafter_update,
    mixed_precision,
    set_lr,
    training_steps,
    write_training_record,
)
from warm_start import eagle3_source, warm_start  # noqa: E402

from tensorrt_llm._torch.models.checkpoint import load_model, random_eagle3, save_pretrained  # noqa: E402
from tensorrt_llm._torch.models.modeling_speculative import (  # noqa: E402
    Eagle3Config,
    default_layers_to_capture,
)
from tensorrt_llm._torch.training import ttt_logits, use_training_backend  # noqa: E402
from tensorrt_llm.evaluate.tasks import TRAINING_MIX  # noqa: E402


def draft_config(tcfg, layers: tuple[int, ...], heads: int = 8) -> Eagle3Config:
    return Eagle3Config.from_dict(
        {
            "hidden_size": tcfg.hidden_size,
            "intermediate_size": 2 * tcfg.hidden_size,
            # 8 heads of 32 (4 of 64 copied from the context less well); more KV heads than the
            # target's 2: its blocks are sub-pages of the slot
            "num_attention_heads": heads,
            "num_key_value_heads": heads,
            "head_dim": tcfg.hidden_size // heads,
            "vocab_size": tcfg.vocab_size,
            "draft_vocab_size": tcfg.vocab_size,
            "target_hidden_size": tcfg.hidden_size,
            "rope_theta": tcfg.rope_theta,
            "eagle3_layers_to_capture": list(layers),
        }
    )


def feature_rms(target, batches: Batches, layers: tuple[int, ...], device) -> float:
    """The RMS of the captured target features (fc's input) over one batch."""
    ids, _ = batches.sample()
    with torch.no_grad(), use_training_backend(target):
        _, captured = target(ids.to(device), capture_layers=layers)
    return torch.cat(captured, dim=-1).float().pow(2).mean().sqrt().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    drafter_arguments(parser, "examples/models/m3-tiny/eagle3", seed=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument(
        "--capture-layers",
        type=lambda text: tuple(int(x) for x in text.split(",")),
        default=None,
        help="target layers whose outputs feed the drafter, e.g. 0,2,3 (default: low, middle, high)",
    )
    parser.add_argument(
        "--mix",
        type=lambda text: tuple(float(x) for x in text.split(",")),
        default=TRAINING_MIX,
        help="shares of gsm8k-tiny, multiturn-copy and long-prompt in the corpus (plain format)",
    )
    parser.add_argument(
        "--init-from",
        type=Path,
        default=None,
        help="start from this trained drafter (of --init-target; another tokenizer allowed)",
    )
    parser.add_argument(
        "--init-target",
        type=Path,
        default=Path("examples/models/m3-tiny/target"),
        help="the target --init-from drafted for (its tokenizer)",
    )
    args = parser.parse_args()
    device = apply_preset(args, {"cpu": (300, 8192, 10000), "gpu": (6000, 8192, 40000)})

    torch.manual_seed(args.seed)
    target = load_model(args.target, torch.float32, device)
    for p in target.parameters():
        p.requires_grad_(False)
    tcfg = target.config
    layers = args.capture_layers or default_layers_to_capture(tcfg.num_hidden_layers)
    config = draft_config(tcfg, layers, args.heads)
    draft = random_eagle3(config, tcfg.num_hidden_layers, seed=args.seed, std=0.02)
    tokenizer = build_tokenizer(args.format)
    if args.init_from is not None:
        old = eagle3_source(args.init_from, args.init_target)
        counts = warm_start(draft, tokenizer, old, args.init_from, keep=("d2t",))
        print(f"from {args.init_from}: vocabulary rows {counts}")
    draft = draft.to(device).train()
    draft.embed_tokens = target.model.embed_tokens
    print(
        f"eagle3: {sum(p.numel() for p in draft.parameters() if p.requires_grad) / 1e6:.2f}M parameters on {device}"
    )
    batches = Batches(
        tokenizer,
        args.seed + 100,
        args.conversations,
        args.batch_tokens,
        long_min_chars=700,
        mix=args.mix,
        chat_format=args.format,
    )
    if args.init_from is None:
        # fc starts at unit scale on the target's features: the published architecture's residual
        # stream is large (RMS ~60 on m3-tiny), and fc(features) is the drafter's residual, so at
        # the usual init it would dwarf the attention's output, the part that copies from context
        rms = feature_rms(target, batches, layers, device)
        with torch.no_grad():
            draft.fc.weight /= rms
        print(f"fc initialised for features of RMS {rms:.1f}")
    params = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    autocast = mixed_precision(device)
    steps = args.max_draft_len + 1
    start = time.time()
    for step, bar in training_steps(args, "eagle3"):
        set_lr(optimizer, step, args)
        ids, mask = batches.sample()
        ids, mask = ids.to(device), mask.to(device)
        with autocast:
            with torch.no_grad(), use_training_backend(target):
                hidden, captured = target(ids, capture_layers=layers)
                target_probs = torch.softmax(target.compute_logits(hidden), dim=-1)  # [B, T, V]
            outputs = ttt_logits(draft, captured, ids, steps)
        loss = chained_soft_loss(outputs, target_probs, mask)
        drafter_update(optimizer, params, loss, "eagle3", step)
        if step % 25 == 0:
            bar.set_postfix(loss=f"{loss.item():.3f}")
    draft.eval()
    draft.embed_tokens = None  # shared with the target, not saved
    save_pretrained(draft.to(torch.bfloat16), config, args.out)
    write_training_record(args, device, "train_eagle3.py", batches)
    print(
        f"saved {args.out} after {args.steps} steps in {time.time() - start:.0f}s (final loss {loss.item():.4f})"
    )


if __name__ == "__main__":
    main()
