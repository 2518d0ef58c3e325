"""MiniMax-M3's vision side (transformers' ``MiniMaxM3VLVisionModel`` and
``MiniMaxM3VLMultiModalProjector``): image patches in, one text-width embedding per merged patch out.

Per image of ``grid_thw = (t, h, w)`` patches (``image_processing.py`` makes them, block-major over
``merge x merge`` squares)::

    patches [t*h*w, C*T*P*P] -- embeddings.proj (a Conv3d whose stride is its kernel: a matmul)
    -> pre_layrnorm -> L x [ x + attn(layer_norm1(x)) ; x + fc2(act(fc1(layer_norm2(x)))) ]
    attention: q/k/v/out_proj with bias, bidirectional within each image, 3D axial RoPE on the
    leading 3*s channels of each head (s = 2 * (head_dim // 3 // 2); t, h and w get s/2
    frequencies each), the rest passed through
    projector: per patch linear_2(gelu(linear_1(x))) to the text width, then each merge*merge
    consecutive patches (one square) concatenated -> merge_linear_2(gelu(merge_linear_1(.)))

The tower is replicated on every rank (its weights are small beside the text model's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ACTIVATIONS = {
    "gelu": lambda x: F.gelu(x),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
}


@dataclass(frozen=True)
class MiniMaxM3VisionConfig:
    """``vision_config`` of a MiniMax-M3 VL checkpoint, with the outer keys the image path reads
    (transformers' defaults: the full model's)."""

    hidden_size: int = 1280
    intermediate_size: int = 5120
    num_hidden_layers: int = 32
    num_attention_heads: int = 16
    num_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    hidden_act: str = "gelu"
    layer_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    projector_hidden_size: int = 6144  # the outer config's
    text_hidden_size: int = 6144  # text_config.hidden_size
    image_token_id: int = 200025  # the outer config's image_token_index

    def __post_init__(self) -> None:
        where = "config.json: vision_config"
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"{where}: hidden_size={self.hidden_size} is not a multiple of "
                f"num_attention_heads={self.num_attention_heads}"
            )
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(
                f"{where}: hidden_act={self.hidden_act!r}; expected one of {sorted(ACTIVATIONS)}"
            )
        if self.rotary_dim < 2:
            raise ValueError(f"{where}: head_dim={self.head_dim} leaves no channel for 3D RoPE")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def rotary_dim(self) -> int:
        """Channels of each head the 3D RoPE rotates: 3 axes x ``s`` (``s`` even)."""
        return 3 * 2 * (self.head_dim // 3 // 2)

    @property
    def merge_area(self) -> int:
        return self.spatial_merge_size**2

    @classmethod
    def from_dict(cls, outer: dict[str, Any]) -> MiniMaxM3VisionConfig:
        """From the outer (VL) ``config.json``: its ``vision_config``, the projector keys and
        ``text_config.hidden_size``."""
        vision = outer["vision_config"]
        where = "config.json: vision_config"
        if not isinstance(vision, dict):
            raise ValueError(f"{where}={vision!r} must be an object")
        rope = dict(vision.get("rope_parameters") or {})
        if rope.get("rope_type", "axial") != "axial":
            raise ValueError(
                f"{where}: rope_parameters.rope_type={rope['rope_type']!r}; the vision tower's "
                "RoPE is 'axial'"
            )
        keys = (
            "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_channels", "patch_size", "temporal_patch_size", "spatial_merge_size",
            "hidden_act", "layer_norm_eps",
        )  # fmt: skip
        kwargs = {k: vision[k] for k in keys if vision.get(k) is not None}
        theta = rope.get("rope_theta", vision.get("rope_theta"))
        if theta is not None:
            kwargs["rope_theta"] = float(theta)
        for key, outer_key in (
            ("projector_hidden_size", "projector_hidden_size"),
            ("image_token_id", "image_token_index"),
        ):
            value = outer.get(outer_key, outer.get(key))
            if value is not None:
                kwargs[key] = value
        for key, value in kwargs.items():
            if key != "hidden_act" and (isinstance(value, bool) or not value > 0):
                raise ValueError(f"{where}: {key}={value!r} must be positive")
        text_hidden = (outer.get("text_config") or {}).get("hidden_size", cls.text_hidden_size)
        return cls(**kwargs, text_hidden_size=text_hidden)

    def to_dict(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """``(vision_config, outer keys)`` of a ``config.json`` transformers reads back."""
        vision = {
            k: getattr(self, k)
            for k in (
                "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_channels", "patch_size", "temporal_patch_size", "spatial_merge_size",
                "hidden_act", "layer_norm_eps",
            )
        }  # fmt: skip
        vision["model_type"] = "minimax_m3_vl_vision"
        vision["rope_parameters"] = {"rope_type": "axial", "rope_theta": self.rope_theta}
        outer = {
            "projector_hidden_size": self.projector_hidden_size,
            "image_token_index": self.image_token_id,
        }
        return vision, outer


def vision_positions(grid_thw: list[tuple[int, int, int]], merge: int) -> torch.Tensor:
    """``[num_patches, 3]`` (t, h, w) of every patch, in the processor's block-major order: each
    ``merge x merge`` square's patches are consecutive, squares row by row."""
    out = []
    for t, h, w in grid_thw:
        hh, ww = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        shape = (h // merge, merge, w // merge, merge)
        hh = hh.reshape(shape).transpose(1, 2).flatten()
        ww = ww.reshape(shape).transpose(1, 2).flatten()
        tt = torch.arange(t).repeat_interleave(h * w)
        out.append(torch.stack([tt, hh.repeat(t), ww.repeat(t)], dim=-1))
    return torch.cat(out)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


class VisionAttention(nn.Module):
    def __init__(self, cfg: MiniMaxM3VisionConfig) -> None:
        super().__init__()
        dim = cfg.hidden_size
        self.num_heads, self.head_dim = cfg.num_attention_heads, cfg.head_dim
        self.q_proj, self.k_proj = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.v_proj, self.out_proj = nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], lengths: list[int]
    ) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = (p(x).view(n, self.num_heads, self.head_dim) for p in (self.q_proj, self.k_proj, self.v_proj))  # fmt: skip
        cos, sin = (r[:, None, :] for r in rope)  # [n, 1, rotary_dim]
        rot = cos.shape[-1]
        q = torch.cat([q[..., :rot] * cos + rotate_half(q[..., :rot]) * sin, q[..., rot:]], -1)
        k = torch.cat([k[..., :rot] * cos + rotate_half(k[..., :rot]) * sin, k[..., rot:]], -1)
        outs = []
        for qi, ki, vi in zip(q.split(lengths), k.split(lengths), v.split(lengths), strict=True):
            o = F.scaled_dot_product_attention(  # one image: [1, heads, len, head_dim]
                *(t.transpose(0, 1)[None] for t in (qi, ki, vi)), scale=self.head_dim**-0.5
            )
            outs.append(o[0].transpose(0, 1))
        return self.out_proj(torch.cat(outs).reshape(n, -1))


class VisionEncoderLayer(nn.Module):
    def __init__(self, cfg: MiniMaxM3VisionConfig) -> None:
        super().__init__()
        self.self_attn = VisionAttention(cfg)
        self.layer_norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.layer_norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = nn.Module()
        self.mlp.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.mlp.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.act = ACTIVATIONS[cfg.hidden_act]

    def forward(self, x, rope, lengths: list[int]) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x), rope, lengths)
        return x + self.mlp.fc2(self.act(self.mlp.fc1(self.layer_norm2(x))))


class MiniMaxM3VisionModel(nn.Module):
    """The tower: ``forward(patches [N, C*T*P*P], grid_thw)`` -> ``[N, hidden]``."""

    def __init__(self, cfg: MiniMaxM3VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        kernel = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.embeddings = nn.Module()
        self.embeddings.proj = nn.Conv3d(
            cfg.num_channels, cfg.hidden_size, kernel, stride=kernel, bias=False
        )
        self.pre_layrnorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.layers = nn.ModuleList(VisionEncoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        s = cfg.rotary_dim // 3
        inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, s, 2, dtype=torch.float) / s)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """cos and sin ``[N, rotary_dim]``: each axis's frequencies, t h w, then the same again."""
        freqs = (positions[..., None].float() * self.inv_freq).flatten(1)  # [N, 3 * s/2]
        freqs = torch.cat([freqs, freqs], dim=-1)
        return freqs.cos().to(dtype), freqs.sin().to(dtype)

    def forward(self, patches: torch.Tensor, grid_thw: list[tuple[int, int, int]]) -> torch.Tensor:
        weight = self.embeddings.proj.weight  # [hidden, C, T, P, P]
        x = patches.to(weight.dtype) @ weight.flatten(1).t()  # [N, hidden]
        positions = vision_positions(grid_thw, self.cfg.spatial_merge_size).to(x.device)
        rope = self.rope(positions, x.dtype)
        lengths = [t * h * w for t, h, w in grid_thw]
        x = self.pre_layrnorm(x)
        for layer in self.layers:
            x = layer(x, rope, lengths)
        return x


class MiniMaxM3MultiModalProjector(nn.Module):
    """Vision width to text width per patch, then one token per ``merge x merge`` square."""

    def __init__(self, cfg: MiniMaxM3VisionConfig) -> None:
        super().__init__()
        hidden, text = cfg.projector_hidden_size, cfg.text_hidden_size
        self.merge_area = cfg.merge_area
        self.linear_1 = nn.Linear(cfg.hidden_size, hidden)
        self.linear_2 = nn.Linear(hidden, text)
        self.merge_linear_1 = nn.Linear(text * cfg.merge_area, hidden)
        self.merge_linear_2 = nn.Linear(hidden, text)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.linear_2(F.gelu(self.linear_1(x)))  # [N, text]
        x = x.reshape(x.shape[0] // self.merge_area, -1)  # [N / merge_area, merge_area * text]
        return self.merge_linear_2(F.gelu(self.merge_linear_1(x)))
