"""Train the bundled target's MTP module (MiniMax-M3's own draft head) against the trained target.

    python examples/training/train_mtp.py --target examples/models/m3-tiny/target \\
        --out examples/models/m3-tiny/target [--device cuda]

The target is frozen; a new module (``mtp.layers.0``: a sparse-attention MoE layer between the
embedding and hidden-state norms and the target's LM head) learns, as it drafts at inference,
over ``max_draft_len + 1`` chained steps from every position at once (``mtp_ttt_logits``), from
the target's next-token distribution (soft labels), later steps weighted by ``0.8 ** i``. Its
sparse layer trains densely for the first ``--dense-fraction`` of the steps while its indexer
learns from the attention's block mass. Saved as the hub keeps it: the target's weights and the
module's under ``language_model.model.mtp.layers.0.*``, ``num_mtp_modules: 1`` in the config;
the module's record in ``training_mtp.json`` (the target's stays in ``training.json``).
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
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

from tensorrt_llm._torch.models.checkpoint import load_model, random_model, save_pretrained  # noqa: E402
from tensorrt_llm._torch.training import use_training_backend  # noqa: E402
from tensorrt_llm._torch.training.mtp_ttt import ChainBackend, mtp_ttt_logits  # noqa: E402

# beside the weights of a new directory: the target's tokenizer, template and training record
TARGET_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "training.json")


def with_module(target_dir: Path, seed: int, device: torch.device, init_from: Path | None = None):
    """The target, frozen, with an MTP module to train: new (random, std 0.02), or the module of
    the checkpoint ``init_from`` (to train on; its target must be this one's)."""
    target = load_model(target_dir, torch.float32, device)
    config = dataclasses.replace(target.config, num_mtp_modules=1)
    model = random_model(config, seed=seed, std=0.02, num_mtp_modules=1).to(device)
    missing, unexpected = model.load_state_dict(target.state_dict(), strict=False)
    assert not unexpected and all(".mtp." in f".{name}" for name in missing), missing
    if init_from is not None:
        source = load_model(init_from, torch.float32, device, num_mtp_modules=1).state_dict()
        module = {k: v for k, v in source.items() if k.startswith("model.mtp.")}
        if not module:
            raise SystemExit(f"--init-from {init_from}: the checkpoint has no MTP module")
        model.load_state_dict(module, strict=False)
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith("model.mtp."))
    return model, config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    drafter_arguments(parser, "examples/models/m3-tiny/target", seed=2)
    parser.add_argument(
        "--init-from",
        type=Path,
        default=None,
        help="go on training the MTP module of this checkpoint (the same target's)",
    )
    parser.add_argument("--dense-fraction", type=float, default=0.5)
    parser.add_argument("--indexer-loss-weight", type=float, default=0.1)
    args = parser.parse_args()
    device = apply_preset(args, {"cpu": (300, 8192, 10000), "gpu": (6000, 8192, 40000)})

    torch.manual_seed(args.seed)
    model, config = with_module(args.target, args.seed, device, args.init_from)
    params = [p for p in model.parameters() if p.requires_grad]
    print(f"mtp: {sum(p.numel() for p in params) / 1e6:.2f}M parameters on {device}")
    batches = Batches(
        build_tokenizer(args.format),
        args.seed + 200,
        args.conversations,
        args.batch_tokens,
        long_min_chars=700,
        chat_format=args.format,
    )
    optimizer = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    autocast = mixed_precision(device)
    steps = args.max_draft_len + 1
    chain = ChainBackend(train_indexer=True)
    start = time.time()
    for step, bar in training_steps(args, "mtp"):
        set_lr(optimizer, step, args)
        ids, mask = batches.sample()
        ids, mask = ids.to(device), mask.to(device)
        with autocast:
            with torch.no_grad(), use_training_backend(model):
                hidden, _ = model(ids)
                target_probs = torch.softmax(model.compute_logits(hidden), dim=-1)  # [B, T, V]
            chain.msa_sparse = step >= args.dense_fraction * args.steps
            saved, model.attn_backend = model.attn_backend, chain
            try:
                outputs = mtp_ttt_logits(model, hidden, ids, steps, chain)
            finally:
                model.attn_backend = saved
        loss = chained_soft_loss(outputs, target_probs, mask)
        total = loss + args.indexer_loss_weight * chain.indexer_loss
        drafter_update(optimizer, params, total, "mtp", step)
        if step % 25 == 0:
            bar.set_postfix(loss=f"{loss.item():.3f}", sparse=chain.msa_sparse)
    model.eval()
    written = args.out.resolve() != args.target.resolve()
    save_pretrained(model.to(torch.bfloat16), config, args.out)
    if written:
        for name in TARGET_FILES:
            if (args.target / name).is_file():
                shutil.copy(args.target / name, args.out / name)
    write_training_record(args, device, "train_mtp.py", batches, "training_mtp.json")
    print(
        f"saved {args.out} after {args.steps} steps in {time.time() - start:.0f}s (final loss {loss.item():.4f})"
    )


if __name__ == "__main__":
    main()
