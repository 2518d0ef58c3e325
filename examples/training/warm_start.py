"""Start a target from a trained checkpoint of the same architecture but another tokenizer
(``train_target.py --init-from DIR``): the bundled plain-format target already copies digit strings
and does the tasks' arithmetic, which a target in MiniMax-M3's format learns last from scratch.

Every weight but the vocabulary's is copied. The embedding and the LM head keep, for each token of
the new vocabulary that the old one has (the characters both alphabets share), the old row; a token
named in ``ALIASES`` takes its counterpart's rows (M3's end of turn is the plain format's
``<|end|>``); any other token's embedding is the mean of the old rows of the characters it is
written with (a phrase token starts where its text would be), its LM head row stays as initialised.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

from tensorrt_llm._torch.models.checkpoint import load_model

# new token -> tokens of the source vocabulary whose rows it takes (mean)
ALIASES = {"[e~[": ["<|end|>"], "]~b]": ["<|user|>", "<|assistant|>"], "]~!b[": ["<|user|>"]}
EMBED, HEAD = "embed_tokens.weight", "lm_head.weight"


def target_source(source: Path) -> tuple[dict[str, torch.Tensor], Tokenizer]:
    """A trained target's weights (by parameter name) and its tokenizer."""
    old = load_model(source, torch.float32, torch.device("cpu"))
    return old.state_dict(), Tokenizer.from_file(str(source / "tokenizer.json"))


def eagle3_source(source: Path, target: Path) -> tuple[dict[str, torch.Tensor], Tokenizer]:
    """A trained Eagle3 drafter's weights (its checkpoint names are its parameter names) and the
    tokenizer of ``target``, the target it drafted for."""
    state = {k: v.float() for k, v in load_file(str(source / "model.safetensors")).items()}
    return state, Tokenizer.from_file(str(target / "tokenizer.json"))


@torch.no_grad()
def warm_start(
    model: torch.nn.Module,
    tokenizer: Tokenizer,
    old: tuple[dict[str, torch.Tensor], Tokenizer],
    source: Path,
    keep: tuple[str, ...] = (),
) -> dict[str, int]:
    """Copy ``old`` (``target_source``, ``eagle3_source``) into ``model``, whose tokenizer is
    ``tokenizer``; parameters named in ``keep`` stay as they are (a drafter's shared embedding, its
    draft-to-target offsets). Returns how many vocabulary rows were copied, aliased, composed from
    characters, or left as initialised."""
    old_state, old_tokenizer = old
    state = {k: v for k, v in model.state_dict().items() if k not in keep}
    if old_state.keys() - set(keep) != state.keys():
        differ = sorted((old_state.keys() - set(keep)) ^ state.keys())[:4]
        raise SystemExit(f"--init-from {source}: not the same architecture (differs at {differ})")
    vocab_rows = {name for name in state if name.endswith((EMBED, HEAD))}
    for name, tensor in state.items():
        if name in vocab_rows:
            continue
        if old_state[name].shape != tensor.shape:
            raise SystemExit(
                f"--init-from {source}: {name} is {tuple(old_state[name].shape)} there, "
                f"{tuple(tensor.shape)} here (same --hidden?)"
            )
        tensor.copy_(old_state[name])
    counts = {"copied": 0, "aliased": 0, "composed": 0, "initialised": 0}
    old_vocab = old_tokenizer.get_vocab()
    for token, new_id in tokenizer.get_vocab().items():
        if token in old_vocab:
            kind, rows = "copied", [old_vocab[token]]
        elif token in ALIASES:
            kind, rows = "aliased", [old_vocab[t] for t in ALIASES[token]]
        else:
            unknown = old_vocab["<unk>"]
            ids = old_tokenizer.encode(token, add_special_tokens=False).ids
            kind, rows = "composed", [i for i in ids if i != unknown]
        if not rows:
            counts["initialised"] += 1
            continue
        counts[kind] += 1
        for name in vocab_rows:
            if kind == "composed" and name.endswith(HEAD):
                continue
            state[name][new_id] = old_state[name][rows].mean(0).to(state[name].dtype)
    return counts
