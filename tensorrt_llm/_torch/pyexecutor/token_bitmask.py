"""Masking logits by a token bitmask (guided decoding): ``-inf`` on every token whose bit is 0.

A mask row is ``ceil(V / 32)`` int32 words; token ``t``'s bit is bit ``t % 32`` of word
``t // 32`` (xgrammar's layout). A row of all ones (-1) changes nothing. On CUDA one Triton
program per row and block of the vocabulary, which reads only its row's words and writes only
the tokens refused; elsewhere the same in torch operations."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BITMASK_BLOCK = 4096  # tokens per program


@torch.inference_mode()  # the logits are inference tensors
def apply_token_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, kernel: bool | None = None
) -> None:
    """``logits [R, V]`` in place: ``-inf`` where ``bitmask [R, W]`` (int32) has a 0 bit."""
    num_rows, vocab = logits.shape
    if kernel if kernel is not None else logits.is_cuda:
        grid = (num_rows, triton.cdiv(vocab, BITMASK_BLOCK))
        _bitmask_kernel[grid](
            logits, logits.stride(0), bitmask, bitmask.stride(0), vocab, BLOCK=BITMASK_BLOCK
        )
        return
    allowed = token_allowed(bitmask, vocab)
    logits.masked_fill_(~allowed, float("-inf"))


def token_allowed(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[R, V]`` bool: each token's bit of ``bitmask [R, W]``."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask[:, :, None] >> shifts) & 1  # [R, W, 32]
    return bits.flatten(1)[:, :vocab].bool()


@triton.jit
def _bitmask_kernel(logits_ptr, logits_stride, mask_ptr, mask_stride, vocab, BLOCK: tl.constexpr):
    """Row ``program_id(0)``, vocabulary block ``program_id(1)``: ``-inf`` where the row's bit
    of the token is 0."""
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < vocab
    words = tl.load(mask_ptr + row * mask_stride + offs // 32, mask=inside, other=-1)
    refused = ((words >> (offs % 32)) & 1) == 0
    tl.store(
        logits_ptr + row * logits_stride + offs,
        tl.full([BLOCK], float("-inf"), tl.float32).to(logits_ptr.dtype.element_ty),
        mask=inside & refused,
    )
