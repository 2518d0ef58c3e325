"""The collectives: ``torch.distributed`` over the ranks of one ``Mapping``.

Model collectives (``all_reduce``, ``all_gather``) run on the world group: NCCL on GPUs (so they
can be captured in CUDA graphs), gloo on the CPU. The control plane (``broadcast_bytes``,
``gather_json``: which requests to start or cancel, what the other ranks produced) runs on a gloo
group of its own, on host memory, as JSON: nothing is unpickled from another process.
"""

from __future__ import annotations

import json
from datetime import timedelta

import torch
import torch.distributed as dist

from tensorrt_llm._torch.distributed.mapping import Mapping

_control_group: dist.ProcessGroup | None = None


def init_distributed(
    mapping: Mapping, init_method: str, device_type: str, timeout_s: float = 600.0
) -> None:
    """Join the ranks of ``mapping`` (every rank calls this with the same ``init_method``)."""
    global _control_group
    if dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is already initialised in this process: one multi-rank LLM per "
            "process (shut the other down first)"
        )
    backend = "nccl" if device_type == "cuda" else "gloo"
    dist.init_process_group(
        backend,
        init_method=init_method,
        world_size=mapping.world_size,
        rank=mapping.rank,
        timeout=timedelta(seconds=timeout_s),
    )
    _control_group = dist.new_group(backend="gloo") if backend != "gloo" else dist.group.WORLD


def shutdown_distributed() -> None:
    global _control_group
    if dist.is_initialized():
        dist.destroy_process_group()
    _control_group = None


def all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """Sum ``tensor`` over the ranks, in place; returns it."""
    dist.all_reduce(tensor)
    return tensor


def all_gather_last_dim(tensor: torch.Tensor, world_size: int) -> torch.Tensor:
    """``[..., n]`` on each rank -> ``[..., world_size * n]``, rank r's part at ``r*n:(r+1)*n``."""
    tensor = tensor.contiguous()
    if tensor.device.type == "cuda":
        stacked = torch.empty((world_size, *tensor.shape), dtype=tensor.dtype, device=tensor.device)
        dist.all_gather_into_tensor(stacked, tensor)
        parts = stacked.unbind(0)
    else:
        parts = [torch.empty_like(tensor) for _ in range(world_size)]
        dist.all_gather(parts, tensor)
    return torch.cat(parts, dim=-1)


def broadcast_bytes(data: bytes | None) -> bytes:
    """Rank 0's ``data`` on every rank (the others pass ``None``): its length, then (unless
    empty) the bytes, over the control group."""
    size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
    dist.broadcast(size, 0, group=_control_group)
    if not int(size):
        return b""
    if data is not None:
        buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    else:
        buffer = torch.empty(int(size), dtype=torch.uint8)
    dist.broadcast(buffer, 0, group=_control_group)
    return buffer.numpy().tobytes()


def gather_json(obj: object, world_size: int) -> list[object]:
    """Every rank's ``obj``, in rank order, on every rank."""
    data = json.dumps(obj).encode()
    size = torch.tensor([len(data)], dtype=torch.int64)
    sizes = [torch.empty_like(size) for _ in range(world_size)]
    dist.all_gather(sizes, size, group=_control_group)
    longest = max(int(s) for s in sizes)
    buffer = torch.zeros(longest, dtype=torch.uint8)
    buffer[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    buffers = [torch.empty_like(buffer) for _ in range(world_size)]
    dist.all_gather(buffers, buffer, group=_control_group)
    return [json.loads(b[: int(s)].numpy().tobytes()) for b, s in zip(buffers, sizes)]


def max_over_ranks(values: list[int]) -> list[int]:
    """Each of ``values``' largest over the ranks, on every rank (control group)."""
    tensor = torch.tensor(values, dtype=torch.int64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=_control_group)
    return tensor.tolist()


def control_barrier() -> None:
    """Wait until every rank reaches this point (control group)."""
    dist.barrier(group=_control_group)
