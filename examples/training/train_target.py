"""Train the bundled MiniMax-M3 target on the task mix (gsm8k-tiny, multiturn-copy, long-prompt).

    python examples/training/train_target.py --out examples/models/m3-tiny/target [--device cuda]

The published architecture (``target_config``), tiny. Sparse layers train densely for the first
``--dense-fraction`` of the steps while the indexer learns from the attention's block mass, then
sparsely; the MoE's score-correction bias is balanced without an auxiliary loss
(``ExpertBalance``). Deterministic for a seed on a given device.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).parent))
from common import (  # noqa: E402
    Batches,
    apply_preset,
    build_tokenizer,
    mixed_precision,
    save_tokenizer,
    set_lr,
    write_training_record,
)
from warm_start import target_source, warm_start  # noqa: E402

from tensorrt_llm._torch.models.checkpoint import random_model, save_pretrained  # noqa: E402
from tensorrt_llm._torch.models.configuration_minimaxm3 import (  # noqa: E402
    FULL,
    SPARSE,
    VL_ARCHITECTURE,
    MiniMaxM3Config,
)
from tensorrt_llm._torch.modules.moe import MiniMaxM3SparseMoeBlock, route  # noqa: E402
from tensorrt_llm._torch.training import use_training_backend  # noqa: E402


def target_config(vocab_size: int, eos_id: int, args) -> MiniMaxM3Config:
    """The published architecture, tiny: layers 1 and 3 sparse (the indexer), layer 0 a dense MLP
    and layers 1-3 an MoE of 8 experts (top-2) and a shared expert; GQA 4:2, RoPE on half of
    each head. Saved as the hub's VL checkpoints are (``text_config`` nested)."""
    hidden = args.hidden
    return MiniMaxM3Config.from_dict(
        {
            "architectures": [VL_ARCHITECTURE],
            "model_type": "minimax_m3_vl",
            "dtype": "bfloat16",
            "text_config": {
                "vocab_size": vocab_size,
                "hidden_size": hidden,
                "num_hidden_layers": 4,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": hidden // 4,
                "rope_parameters": {
                    "rope_type": "default",
                    "rope_theta": 10000.0,
                    "partial_rotary_factor": 0.5,
                },
                "max_position_embeddings": 2048,
                "layer_types": [FULL, SPARSE, FULL, SPARSE],
                "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"],
                "dense_intermediate_size": 3 * hidden,
                "intermediate_size": hidden // 2,
                "shared_intermediate_size": hidden,
                "num_local_experts": 8,
                "num_experts_per_tok": 2,
                "routed_scaling_factor": 2.0,
                "index_n_heads": 2,
                "index_head_dim": hidden // 8,
                "index_block_size": 128,
                "index_topk_blocks": 3,
                "index_local_blocks": 1,
                "bos_token_id": None,
                "eos_token_id": eos_id,
            },
        }
    )


class ExpertBalance:
    """Auxiliary-loss-free load balancing (as DeepSeek-V3 trains its ``e_score_correction_bias``):
    after each step, every MoE layer's bias moves by ``rate`` towards its under-used experts. The
    bias steers only the choice of experts, never their weights."""

    def __init__(self, model: torch.nn.Module, rate: float) -> None:
        self.rate = rate
        self.counts: dict[torch.nn.Module, torch.Tensor] = {}
        self.blocks = [m for m in model.modules() if isinstance(m, MiniMaxM3SparseMoeBlock)]
        for block in self.blocks:
            block.gate.register_forward_hook(self._count(block))

    def _count(self, block: MiniMaxM3SparseMoeBlock):
        def hook(module, inputs, logits) -> None:
            with torch.no_grad():
                _, ids = route(logits.detach(), block.e_score_correction_bias, block.top_k)
                self.counts[block] = torch.bincount(ids.flatten(), minlength=logits.shape[-1])

        return hook

    @torch.no_grad()
    def step(self) -> None:
        for block in self.blocks:
            counts = self.counts.pop(block).float()
            block.e_score_correction_bias += self.rate * torch.sign(counts.mean() - counts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("examples/models/m3-tiny/target"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--batch-tokens", type=int, default=None)
    parser.add_argument("--conversations", type=int, default=None)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--dense-fraction", type=float, default=0.6)
    parser.add_argument("--indexer-loss-weight", type=float, default=0.1)
    parser.add_argument("--bias-rate", type=float, default=1e-3)
    parser.add_argument("--device", default="auto")
    parser.add_argument(
        "--format", default="plain", choices=["plain", "m3"], help="the chat protocol taught"
    )
    parser.add_argument(
        "--init-from",
        type=Path,
        default=None,
        help="start from this trained target (another tokenizer allowed: warm_start.py)",
    )
    args = parser.parse_args()
    # an m3 batch trains fewer reply tokens (its prompts are longer), and the digits a reply copies
    # or computes are what a target learns last, slower in the m3 format than in the plain one for
    # as many seen (``corpus_stats.py``): its GPU batch holds about twice the plain format's
    # trained digits (1129 against 612 per batch; a larger batch rather than more steps, to fit
    # one GPU session)
    gpu_batch = 49152 if args.format == "m3" else 12288
    device = apply_preset(args, {"cpu": (320, 8192, 20000), "gpu": (5000, gpu_batch, 80000)})

    torch.manual_seed(args.seed)
    tokenizer = build_tokenizer(args.format)
    eos = "[e~[" if args.format == "m3" else "<|end|>"
    config = target_config(tokenizer.get_vocab_size(), tokenizer.token_to_id(eos), args)
    model = random_model(config, seed=args.seed, std=0.02)
    if args.init_from is not None:
        counts = warm_start(model, tokenizer, target_source(args.init_from), args.init_from)
        print(f"from {args.init_from}: vocabulary rows {counts}")
    model = model.to(device).train()
    print(f"target: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters on {device}")
    batches = Batches(
        tokenizer,
        args.seed,
        args.conversations,
        args.batch_tokens,
        long_min_chars=700,
        chat_format=args.format,
    )
    balance = ExpertBalance(model, args.bias_rate)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01
    )
    autocast = mixed_precision(device)
    start = time.time()
    bar = tqdm(range(args.steps), desc="target", mininterval=2.0)
    with use_training_backend(model, train_indexer=True) as backend:
        for step in bar:
            backend.msa_sparse = step >= args.dense_fraction * args.steps
            set_lr(optimizer, step, args)
            ids, mask = batches.sample()
            ids, mask = ids.to(device), mask.to(device)
            with autocast:
                hidden, _ = model(ids)
                logits = model.compute_logits(hidden[:, :-1])
            ce = F.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none"
            )
            loss = (ce * mask[:, 1:].reshape(-1)).sum() / mask[:, 1:].sum()
            indexer = backend.indexer_loss
            total = loss + args.indexer_loss_weight * indexer
            optimizer.zero_grad(set_to_none=True)
            total.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            balance.step()
            if step % 25 == 0:
                bar.set_postfix(
                    loss=f"{loss.item():.3f}",
                    indexer=f"{float(indexer.detach()) if torch.is_tensor(indexer) else 0.0:.3f}",
                    sparse=backend.msa_sparse,
                )
    model.eval()
    save_pretrained(model.to(torch.bfloat16), config, args.out)
    write_training_record(args, device, "train_target.py", batches)
    save_tokenizer(tokenizer, args.out, args.format)
    print(
        f"saved {args.out} after {args.steps} steps in {time.time() - start:.0f}s (final loss {loss.item():.4f})"
    )


if __name__ == "__main__":
    main()
