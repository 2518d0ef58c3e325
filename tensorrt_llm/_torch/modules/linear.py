"""Linear layers split over the tensor-parallel ranks (Megatron's column / row split).

Each holds this rank's shard of the checkpoint's full weight; ``tp_dim`` says which dimension of
the full ``[out_features, in_features]`` weight was split, and ``load_state_dict_into``
(``models/checkpoint.py``) cuts the shard with ``shard_weight``.

- ``ColumnParallelLinear``: output features split (a QKV projection's heads, an MLP's gate and
  up columns, an LM head's vocabulary); ``gather_output`` concatenates the ranks' outputs.
- ``RowParallelLinear``: input features split (an output projection, an MLP's down projection);
  the ranks' partial sums are all-reduced, so every rank ends with the full output. On a GPU in
  bf16/fp16 the partial sums stay fp32 through the all-reduce and are rounded once, as one rank's
  GEMM rounds its fp32 accumulator once (``torch.mm(..., out_dtype=torch.float32)``): rounding each
  partial sum first put TP2's logits 2.0e-2 (relative RMS) from TP1's on the benchmark model,
  fp32 partial sums 1.4e-2.

With one rank (``Mapping()``) both are plain ``nn.Linear``.

FP8 block scales (``fp8/``): ``to_fp8_block()`` turns the weight into ``float8_e4m3fn`` with a
``weight_scale_inv`` buffer (the loader fills both), and the forward runs the Triton block-scaled
GEMM (CUDA). ``fp8_block`` says how the loader treats the weight: ``"store"`` (FP8 storage),
``"grid"`` (kept in the model dtype, its values rounded to the FP8 grid: the CPU's form of a model
quantized at load) or None.
"""

from __future__ import annotations

import torch
from torch import nn

from tensorrt_llm._torch.distributed.communicator import all_gather_last_dim, all_reduce
from tensorrt_llm._torch.distributed.mapping import Mapping
from tensorrt_llm._torch.modules.fp8.block import FP8, scale_shape


class Fp8BlockLinear(nn.Linear):
    """``nn.Linear`` whose weight may be FP8 with 128 x 128 block scales (the module docstring)."""

    fp8_block: str | None = None

    def to_fp8_block(self) -> None:
        weight = self.weight
        self.weight = nn.Parameter(torch.empty_like(weight, dtype=FP8), requires_grad=False)
        scales = torch.empty(scale_shape(*weight.shape), dtype=torch.float32, device=weight.device)
        self.register_buffer("weight_scale_inv", scales)
        self.fp8_block = "store"

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight.dtype == FP8:
            from tensorrt_llm._torch.modules.fp8.ops import fp8_block_linear

            return fp8_block_linear(x, self.weight, self.weight_scale_inv)
        return super().forward(x)


class ColumnParallelLinear(Fp8BlockLinear):
    tp_dim = 0

    def __init__(
        self,
        in_features: int,
        out_features: int,
        mapping: Mapping,
        what: str,
        gather_output: bool = False,
        shards: tuple[int, int] | None = None,
    ) -> None:
        """``shards``: ``(number, index)`` of the output slice this rank holds when it is not
        one of ``attn_tp_size`` equal parts (a KV head replicated over several ranks)."""
        self.tp_size, self.tp_rank = mapping.attn_tp_size, mapping.attn_tp_rank
        self.num_shards, self.shard_index = shards or (self.tp_size, self.tp_rank)
        local = mapping.shard(out_features, what) if shards is None else out_features // shards[0]
        super().__init__(in_features, local, bias=False)
        self.gather_output = gather_output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.matmul(x)
        if self.gather_output and self.tp_size > 1:
            out = all_gather_last_dim(out, self.tp_size)
        return out


class RowParallelLinear(Fp8BlockLinear):
    tp_dim = 1

    def __init__(self, in_features: int, out_features: int, mapping: Mapping, what: str) -> None:
        super().__init__(mapping.shard(in_features, what), out_features, bias=False)
        self.tp_size, self.tp_rank = mapping.attn_tp_size, mapping.attn_tp_rank
        self.num_shards, self.shard_index = self.tp_size, self.tp_rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1 or self.weight.dtype == FP8:  # FP8: partial sums in x's dtype
            out = self.matmul(x)
            return out if self.tp_size == 1 else all_reduce(out)
        if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16):
            partial = torch.mm(x.reshape(-1, x.shape[-1]), self.weight.t(), out_dtype=torch.float32)
            return all_reduce(partial).to(x.dtype).reshape(*x.shape[:-1], partial.shape[-1])
        return all_reduce(super().forward(x))


def shard_weight(module: nn.Module, full: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``full`` for ``module`` (``full`` itself for a module not split)."""
    if not isinstance(module, ColumnParallelLinear | RowParallelLinear) or module.num_shards == 1:
        return full
    return full.chunk(module.num_shards, dim=module.tp_dim)[module.shard_index].contiguous()
