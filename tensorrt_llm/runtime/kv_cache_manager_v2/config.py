"""What the KV cache engine stores: layers, their buffers, and the storage knobs. torch-free.

A **buffer** is ``(layer_id, role)``: one role of one layer, holding ``tokens_per_block`` tokens of
``num_heads x head_dim`` elements of ``dtype`` per logical block. Its size in bytes per block is
``tokens_per_block * num_heads * head_dim * itemsize``. Each layer has a ``key`` and a ``value``
buffer of identical geometry, and optionally an ``index_key`` buffer (the MSA indexer's per-token key).

A buffer of a **scaled dtype** (``float8_e4m3fn``) stores each ``head_dim`` row of a token and head
divided by its float32 scale (``amax / 448``), and has a companion **scale buffer** (``key_scale``,
``value_scale``, ``index_key_scale``): ``num_heads x 1`` float32 per token, in the same slot, so
every move of a slot (reuse, eviction, transfer) moves the scales with their rows.

A **life cycle** is a set of layers allocated together; every layer of this engine retains all of its
blocks (full attention, the drafter included), so a life cycle is simply a named group that gets one
slot layout and one pool (see ``layout.py``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

# Bytes per element of every dtype a buffer may hold; names follow torch's dtype names.
DTYPE_SIZES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}

DEFAULT_LIFE_CYCLE = "full_attention"

# Element dtypes stored with a per-(token, head) scale, and the scales' dtype.
SCALED_DTYPES = frozenset({"float8_e4m3fn"})
SCALE_DTYPE = "float32"


def is_power_of_two(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


class DataRole(enum.StrEnum):
    KEY = "key"
    VALUE = "value"
    INDEX_KEY = "index_key"
    KEY_SCALE = "key_scale"
    VALUE_SCALE = "value_scale"
    INDEX_KEY_SCALE = "index_key_scale"

    @property
    def scale(self) -> DataRole:
        """The scale buffer of a data role (``KeyError`` for a scale role)."""
        return _SCALE_ROLES[self]

    @property
    def is_scale(self) -> bool:
        return self in _SCALE_ROLES.values()


_SCALE_ROLES = {
    DataRole.KEY: DataRole.KEY_SCALE,
    DataRole.VALUE: DataRole.VALUE_SCALE,
    DataRole.INDEX_KEY: DataRole.INDEX_KEY_SCALE,
}


@dataclass(frozen=True)
class BufferConfig:
    """One role of one layer: ``num_heads x head_dim`` elements of ``dtype`` per token."""

    role: DataRole
    num_heads: int
    head_dim: int
    dtype: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "role", DataRole(self.role))
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(
                f"buffer dtype={self.dtype!r} is not supported; use one of {sorted(DTYPE_SIZES)}"
            )
        for name in ("num_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(
                    f"buffer {self.role.value}: {name}={value!r} must be a positive int"
                )

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def bytes_per_token(self) -> int:
        return self.num_heads * self.head_dim * self.itemsize


def _scale_of(buf: BufferConfig) -> BufferConfig:
    """The scale buffer of a scaled-dtype buffer: one float32 per token and head."""
    return BufferConfig(buf.role.scale, buf.num_heads, 1, SCALE_DTYPE)


@dataclass(frozen=True)
class AttentionLayerConfig:
    """One attention layer: its buffers, its life cycle, and whether its KV depends on the next token.

    ``depends_on_next_token`` marks an Eagle3 draft layer: its KV at position i is computed from the
    target's hidden state at i and the embedding of token i+1, so a committed block's contents depend
    on the token that follows the block (the drafter boundary rule: ``kv_cache.py``).
    """

    layer_id: int
    buffers: tuple[BufferConfig, ...]
    life_cycle: str = DEFAULT_LIFE_CYCLE
    depends_on_next_token: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "buffers", tuple(self.buffers))
        if not isinstance(self.layer_id, int) or self.layer_id < 0:
            raise ValueError(f"layer_id={self.layer_id!r} must be a non-negative int")
        roles = [b.role for b in self.buffers]
        if len(set(roles)) != len(roles):
            raise ValueError(f"layer {self.layer_id}: roles repeat: {[r.value for r in roles]}")
        if DataRole.KEY not in roles or DataRole.VALUE not in roles:
            raise ValueError(f"layer {self.layer_id}: needs both a 'key' and a 'value' buffer")
        key, value = self.buffer(DataRole.KEY), self.buffer(DataRole.VALUE)
        if (key.num_heads, key.head_dim, key.dtype) != (
            value.num_heads,
            value.head_dim,
            value.dtype,
        ):
            raise ValueError(
                f"layer {self.layer_id}: key {key} and value {value} must have the same heads, head_dim and dtype"
            )
        for buf in self.buffers:
            if buf.role.is_scale:
                if not any(not b.role.is_scale and b.role.scale is buf.role for b in self.buffers):
                    raise ValueError(f"layer {self.layer_id}: {buf.role.value} scales no buffer")
                continue
            wanted = buf.dtype in SCALED_DTYPES
            if wanted != self.has(buf.role.scale):
                raise ValueError(
                    f"layer {self.layer_id}: {buf.role.value} of dtype {buf.dtype} "
                    + ("needs" if wanted else "takes no")
                    + f" {buf.role.scale.value!r} buffer"
                )
            if wanted and self.buffer(buf.role.scale) != _scale_of(buf):
                raise ValueError(
                    f"layer {self.layer_id}: {buf.role.scale.value} must be {_scale_of(buf)}"
                )

    @classmethod
    def kv(
        cls,
        layer_id: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: str,
        *,
        index_key: tuple[int, int, str] | None = None,
        life_cycle: str = DEFAULT_LIFE_CYCLE,
        depends_on_next_token: bool = False,
    ) -> AttentionLayerConfig:
        """A layer with K and V buffers, plus an index-K buffer ``(num_heads, head_dim, dtype)`` if
        given; each buffer of a scaled dtype with its scale buffer."""
        data = [
            BufferConfig(DataRole.KEY, num_kv_heads, head_dim, dtype),
            BufferConfig(DataRole.VALUE, num_kv_heads, head_dim, dtype),
        ]
        if index_key is not None:
            data.append(BufferConfig(DataRole.INDEX_KEY, *index_key))
        buffers = data + [_scale_of(b) for b in data if b.dtype in SCALED_DTYPES]
        return cls(layer_id, tuple(buffers), life_cycle, depends_on_next_token)

    def buffer(self, role: DataRole | str) -> BufferConfig:
        role = DataRole(role)
        for buf in self.buffers:
            if buf.role is role:
                return buf
        raise KeyError(f"layer {self.layer_id} has no {role.value!r} buffer")

    def has(self, role: DataRole | str) -> bool:
        return any(b.role is DataRole(role) for b in self.buffers)


@dataclass(frozen=True)
class KVCacheManagerConfig:
    """Everything the engine needs to plan storage and run the block life cycle.

    - ``tokens_per_block``: tokens per logical block (a power of two; 128 in production).
    - ``num_slots``: slots per pool (one slot holds one logical block of every layer of a life cycle).
    - ``enable_block_reuse``: commit full blocks to the radix tree and reuse them across sequences.
    - ``alignment_bytes``: every layer's K and every index-K starts at a multiple of this in the slot.
    - ``kernel_page_tokens``: the slot size is padded so that every buffer splits into kernel pages of
      this many tokens at a whole number of pages per slot (the draft sub-page view needs it);
      default ``min(32, tokens_per_block)``.
    """

    tokens_per_block: int
    layers: tuple[AttentionLayerConfig, ...]
    num_slots: int
    enable_block_reuse: bool = True
    alignment_bytes: int = 256
    kernel_page_tokens: int | None = None  # None: min(32, tokens_per_block)
    max_blocks_per_seq: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "layers", tuple(sorted(self.layers, key=lambda layer: layer.layer_id))
        )
        if not isinstance(self.tokens_per_block, int) or not is_power_of_two(self.tokens_per_block):
            raise ValueError(f"tokens_per_block={self.tokens_per_block!r} must be a power of two")
        if not isinstance(self.num_slots, int) or self.num_slots <= 0:
            raise ValueError(f"num_slots={self.num_slots!r} must be a positive int")
        if not self.layers:
            raise ValueError("layers is empty: a KV cache needs at least one layer")
        ids = [layer.layer_id for layer in self.layers]
        if len(set(ids)) != len(ids):
            raise ValueError(f"layer ids repeat: {ids}")
        if not is_power_of_two(self.alignment_bytes):
            raise ValueError(f"alignment_bytes={self.alignment_bytes!r} must be a power of two")
        max_item = max(DTYPE_SIZES[b.dtype] for layer in self.layers for b in layer.buffers)
        if self.alignment_bytes < max_item:
            raise ValueError(
                f"alignment_bytes={self.alignment_bytes} is smaller than an element ({max_item} bytes)"
            )
        if self.kernel_page_tokens is None:
            object.__setattr__(self, "kernel_page_tokens", min(32, self.tokens_per_block))
        if (
            not is_power_of_two(self.kernel_page_tokens)
            or self.tokens_per_block % self.kernel_page_tokens
        ):
            raise ValueError(
                f"kernel_page_tokens={self.kernel_page_tokens!r} must be a power of two dividing "
                f"tokens_per_block={self.tokens_per_block}"
            )
        if self.max_blocks_per_seq is not None and self.max_blocks_per_seq <= 0:
            raise ValueError(f"max_blocks_per_seq={self.max_blocks_per_seq!r} must be positive")

    @property
    def layer_ids(self) -> tuple[int, ...]:
        return tuple(layer.layer_id for layer in self.layers)

    @property
    def successor_aware(self) -> bool:
        """True when some layer's KV depends on the token after it (an Eagle3 draft layer)."""
        return any(layer.depends_on_next_token for layer in self.layers)

    def layer(self, layer_id: int) -> AttentionLayerConfig:
        for layer in self.layers:
            if layer.layer_id == layer_id:
                return layer
        raise KeyError(f"no layer {layer_id}; layers are {list(self.layer_ids)}")
