"""The published MiniMax-M3's ``config.json``, as transformers' ``minimax_m3_vl`` reads it.

Two forms hold the same text model:

- the VL checkpoints (``architectures: [MiniMaxM3SparseForConditionalGeneration]``, ``model_type:
  minimax_m3_vl``) nest it under ``text_config``, beside ``vision_config`` and the projector keys
  (``vision``: ``modeling_minimaxm3_vision.py``; a VL config without ``vision_config`` is text only);
- transformers' text-only save (``MiniMaxM3VLForCausalLM``, ``minimax_m3_vl_text``) is flat.

Inside, the hub's legacy names are mapped as transformers maps them: ``sparse_attention_config:
{sparse_num_index_heads, sparse_index_dim, sparse_block_size, sparse_topk_blocks,
sparse_local_block, sparse_attention_freq}`` to ``index_*`` and ``layer_types``; ``moe_layer_freq``
to ``mlp_layer_types``; top-level ``rope_theta`` / ``partial_rotary_factor`` into
``rope_parameters``. The rotary width is ``int(head_dim * partial_rotary_factor)``; transformers
ignores the ``rotary_dim`` key, and so do we. Missing keys take transformers' defaults (the full
model's). An unknown key gets one warning line; a value we cannot serve is an error naming it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from tensorrt_llm._torch.attention_backend.sparse.minimax_m3.msa import MsaConfig
from tensorrt_llm._torch.distributed.mapping import Mapping
from tensorrt_llm._torch.models.config_utils import (
    check_model_type,
    check_numbers,
    check_per_layer,
    checkpoint_dtype,
    read_config_json,
    read_generation_config,
    token_ids,
    warn_unknown,
)
from tensorrt_llm._torch.models.modeling_minimaxm3_vision import MiniMaxM3VisionConfig
from tensorrt_llm._torch.modules.moe import MoeConfig
from tensorrt_llm._torch.pyexecutor.config import KvCacheLayer
from tensorrt_llm.quantization import FP8_BLOCK_FORMAT, checkpoint_quantization

VL_ARCHITECTURE = "MiniMaxM3SparseForConditionalGeneration"
TEXT_ARCHITECTURE = "MiniMaxM3VLForCausalLM"
VL_MODEL_TYPE, TEXT_MODEL_TYPE = "minimax_m3_vl", "minimax_m3_vl_text"
FULL, SPARSE = "full_attention", "minimax_m3_sparse"  # layer_types
DENSE_MLP, MOE_MLP = "dense", "sparse"  # mlp_layer_types
DTYPES = ("float32", "float16", "bfloat16")

# Keys of the hub's sparse_attention_config, by the flat name transformers gives them.
LEGACY_INDEX_KEYS = {
    "index_n_heads": "sparse_num_index_heads",
    "index_head_dim": "sparse_index_dim",
    "index_block_size": "sparse_block_size",
    "index_topk_blocks": "sparse_topk_blocks",
    "index_local_blocks": "sparse_local_block",
}
# Keys a config may carry that change nothing we serve (training knobs, HF bookkeeping).
IGNORED_TEXT_KEYS = frozenset(
    {
        "attention_dropout", "initializer_range", "output_router_logits", "router_aux_loss_coef",
        "router_jitter_noise", "use_cache", "pad_token_id", "rotary_dim", "hidden_act",
        "transformers_version", "output_hidden_states", "output_attentions", "return_dict",
        "chunk_size_feed_forward", "is_encoder_decoder", "id2label", "label2id", "problem_type",
        "_name_or_path", "model_type", "architectures", "dtype", "torch_dtype", "rope_scaling",
        "rope_parameters", "rope_theta", "partial_rotary_factor", "sparse_attention_config",
        "moe_layer_freq", "num_experts", "tokenizer_class", "bos_token_id", "eos_token_id",
        "sparse_attention_freq", "quantization_config",
    }
)  # fmt: skip
# Top-level keys of the VL form besides text_config: the vision side's, videos', and bookkeeping.
IGNORED_VL_KEYS = frozenset(
    {
        "vision_config", "image_token_index", "video_token_index", "image_token_id",
        "video_token_id", "projector_hidden_size", "merged_hidden_size", "tie_word_embeddings",
        "text_config", "transformers_version", "architectures", "model_type", "dtype",
        "torch_dtype", "_name_or_path", "output_hidden_states", "output_attentions",
        "return_dict", "chunk_size_feed_forward", "is_encoder_decoder", "id2label", "label2id",
        "problem_type", "bos_token_id", "eos_token_id", "pad_token_id", "quantization_config",
    }
)  # fmt: skip


@dataclass(frozen=True)
class MiniMaxM3Config:
    """The text model of a MiniMax-M3 checkpoint, with transformers' defaults (the full model)."""

    vocab_size: int = 200064
    hidden_size: int = 6144
    num_hidden_layers: int = 60
    num_attention_heads: int = 64
    num_key_value_heads: int = 4
    head_dim: int = 128
    intermediate_size: int = 3072  # each routed expert's
    dense_intermediate_size: int = 12288
    shared_intermediate_size: int = 3072
    num_local_experts: int = 128
    num_experts_per_tok: int = 4
    routed_scaling_factor: float = 2.0
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    rms_norm_eps: float = 1e-6
    rope_theta: float = 5000000.0
    partial_rotary_factor: float = 1.0
    max_position_embeddings: int = 524288
    index_n_heads: int = 4
    index_head_dim: int = 128
    index_block_size: int = 128
    index_topk_blocks: int = 16
    index_local_blocks: int = 1
    layer_types: tuple[str, ...] = ()  # () -> every layer full attention
    mlp_layer_types: tuple[str, ...] = ()  # () -> every layer MoE
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 200034
    eos_token_ids: tuple[int, ...] = (200020,)
    torch_dtype: str = "float32"
    architectures: tuple[str, ...] = (VL_ARCHITECTURE,)
    quant_algo: str | None = None  # the checkpoint's (quantization_config): "FP8_BLOCK_SCALES"
    modules_to_not_convert: tuple[str, ...] = ()  # left unquantized by the checkpoint
    vision: MiniMaxM3VisionConfig | None = None  # the vision tower and projector, if any
    num_mtp_modules: int = 0  # the checkpoint's MTP draft modules (``modeling_minimaxm3_mtp.py``)

    def __post_init__(self) -> None:
        where = "config.json"
        check_numbers(self, where, may_be_zero=("index_local_blocks", "num_mtp_modules"))
        n = self.num_hidden_layers
        if not self.layer_types:
            object.__setattr__(self, "layer_types", (FULL,) * n)
        if not self.mlp_layer_types:
            object.__setattr__(self, "mlp_layer_types", (MOE_MLP,) * n)
        check_per_layer(where, "layer_types", self.layer_types, n, (FULL, SPARSE))
        check_per_layer(where, "mlp_layer_types", self.mlp_layer_types, n, (DENSE_MLP, MOE_MLP))
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"{where}: num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        rotary = self.rotary_dim
        if rotary % 2 or not 0 < rotary <= self.head_dim:
            raise ValueError(
                f"{where}: rope_parameters.partial_rotary_factor={self.partial_rotary_factor} "
                f"rotates {rotary} of head_dim={self.head_dim} channels; expected an even "
                "number in [2, head_dim]"
            )
        if self.num_experts_per_tok > self.num_local_experts:
            raise ValueError(
                f"{where}: num_experts_per_tok={self.num_experts_per_tok} exceeds "
                f"num_local_experts={self.num_local_experts}"
            )
        if self.torch_dtype not in DTYPES:
            raise ValueError(f"{where}: dtype={self.torch_dtype!r}; expected one of {DTYPES}")
        if self.sparse_layer_ids:
            self._check_indexer(where)

    def _check_indexer(self, where: str) -> None:
        if self.index_n_heads != self.num_key_value_heads:
            raise ValueError(
                f"{where}: index_n_heads={self.index_n_heads} must equal num_key_value_heads="
                f"{self.num_key_value_heads}: index head g selects the key blocks of KV group g"
            )
        if self.index_head_dim < self.rotary_dim:
            raise ValueError(
                f"{where}: index_head_dim={self.index_head_dim} is narrower than the "
                f"{self.rotary_dim} rotary channels the indexer's RoPE applies"
            )
        if not 0 <= self.index_local_blocks <= self.index_topk_blocks:
            raise ValueError(
                f"{where}: index_local_blocks={self.index_local_blocks} must be in [0, "
                f"index_topk_blocks={self.index_topk_blocks}]"
            )

    @property
    def rotary_dim(self) -> int:
        """The leading channels of each head that RoPE rotates."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def eos_token_id(self) -> int | None:
        """The first end-of-sequence id (any of ``eos_token_ids`` ends a sequence)."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def sparse_layer_ids(self) -> tuple[int, ...]:
        """Layers with the lightning indexer (and so an index-K in the cache), wherever they are."""
        return tuple(i for i, kind in enumerate(self.layer_types) if kind == SPARSE)

    @property
    def moe_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, kind in enumerate(self.mlp_layer_types) if kind == MOE_MLP)

    @property
    def msa(self) -> MsaConfig:
        return MsaConfig(
            num_index_heads=self.index_n_heads,
            index_head_dim=self.index_head_dim,
            block_size=self.index_block_size,
            topk_blocks=self.index_topk_blocks,
            local_blocks=self.index_local_blocks,
        )

    @property
    def moe(self) -> MoeConfig:
        return MoeConfig(
            num_experts=self.num_local_experts,
            top_k=self.num_experts_per_tok,
            intermediate_size=self.intermediate_size,
            shared_intermediate_size=self.shared_intermediate_size,
            routed_scaling_factor=self.routed_scaling_factor,
        )

    def kv_cache_layers(self, mapping: Mapping | None = None) -> tuple[KvCacheLayer, ...]:
        """What each layer caches per token on one rank: its share of the KV heads, plus one
        index-K head on sparse layers (the indexer is replicated, so every rank caches it)."""
        mapping = mapping or Mapping()
        num_kv_heads = mapping.kv_head_shard(self.num_key_value_heads, "num_key_value_heads")[0]
        sparse = set(self.sparse_layer_ids)
        return tuple(
            KvCacheLayer(
                num_kv_heads,
                self.head_dim,
                index_head_dim=self.index_head_dim if i in sparse else 0,
            )
            for i in range(self.num_hidden_layers)
        )

    # --- config.json -------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MiniMaxM3Config:
        """A parsed ``config.json`` of either form (the module docstring)."""
        architectures = tuple(data.get("architectures") or (VL_ARCHITECTURE,))
        text = data.get("text_config")
        unknown: set[str] = set()  # warned about in one line
        if text is not None:
            unknown |= set(data) - IGNORED_VL_KEYS
            if not isinstance(text, dict):
                raise ValueError(f"config.json: text_config={text!r} must be an object")
            check_model_type(data, VL_MODEL_TYPE)
            outer = data
        else:
            text, outer = data, {}
            check_model_type(data, TEXT_MODEL_TYPE, VL_MODEL_TYPE)
        where = "config.json" if text is data else "config.json: text_config"
        kwargs = _text_kwargs(text, where, unknown)
        quant = outer.get("quantization_config") or text.get("quantization_config")
        if quant is not None:
            algo, kwargs["modules_to_not_convert"] = checkpoint_quantization(quant, "config.json")
            kwargs["quant_algo"] = algo.value
        prefix = "" if text is data else "text_config."
        warn_unknown({k if k in data else prefix + k for k in unknown}, "config.json")
        kwargs["torch_dtype"] = checkpoint_dtype(outer, text)
        kwargs["architectures"] = architectures
        if outer.get("vision_config") is not None:
            kwargs["vision"] = MiniMaxM3VisionConfig.from_dict(outer)
        for key in ("bos_token_id", "eos_token_id"):  # the outer config's first, as transformers
            if key in text or key in outer:
                value = outer[key] if outer.get(key) is not None else text.get(key)
                if key == "bos_token_id":
                    kwargs[key] = value
                else:
                    kwargs["eos_token_ids"] = token_ids(value, f"config.json: {key}")
        if "tie_word_embeddings" in outer or "tie_word_embeddings" in text:
            kwargs["tie_word_embeddings"] = bool(
                text.get("tie_word_embeddings") or outer.get("tie_word_embeddings")
            )
        return cls(**kwargs)

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> MiniMaxM3Config:
        """``config.json`` of ``model_dir``, with ``generation_config.json``'s end ids when there is
        one (transformers' ``generate`` stops at those)."""
        config = cls.from_dict(read_config_json(model_dir, "model"))
        generation = read_generation_config(model_dir)
        if "eos_token_id" in generation:
            ids = token_ids(generation["eos_token_id"], "generation_config.json: eos_token_id")
            config = dataclasses.replace(config, eos_token_ids=ids)
        return config

    def to_dict(self) -> dict[str, Any]:
        """A ``config.json`` in the form ``architectures[0]`` names, with transformers' flat key
        names (transformers reads it back as the same model)."""
        text: dict[str, Any] = asdict(self)
        for key in (
            "architectures", "torch_dtype", "eos_token_ids", "rope_theta", "partial_rotary_factor",
            "quant_algo", "modules_to_not_convert", "vision",
        ):  # fmt: skip
            text.pop(key)
        if self.quant_algo is not None:
            text["quantization_config"] = {
                **FP8_BLOCK_FORMAT,
                "modules_to_not_convert": list(self.modules_to_not_convert),
            }
        text["rope_parameters"] = {
            "rope_type": "default",
            "rope_theta": self.rope_theta,
            "partial_rotary_factor": self.partial_rotary_factor,
        }
        text["layer_types"] = list(self.layer_types)
        text["mlp_layer_types"] = list(self.mlp_layer_types)
        text["eos_token_id"] = (
            self.eos_token_ids[0] if len(self.eos_token_ids) == 1 else list(self.eos_token_ids)
        )
        text["hidden_act"] = "swigluoai"
        if self.architectures[0] == TEXT_ARCHITECTURE:
            return {
                "architectures": list(self.architectures),
                "model_type": TEXT_MODEL_TYPE,
                "dtype": self.torch_dtype,
                **text,
            }
        vision, outer = self.vision.to_dict() if self.vision else (None, {})
        return {
            "architectures": list(self.architectures),
            "model_type": VL_MODEL_TYPE,
            "dtype": self.torch_dtype,
            "tie_word_embeddings": self.tie_word_embeddings,
            "text_config": {"model_type": TEXT_MODEL_TYPE, **text},
            **({"vision_config": vision, **outer} if vision else {}),
        }


def _text_kwargs(text: dict[str, Any], where: str, unknown: set[str]) -> dict[str, Any]:
    """The dataclass's kwargs from a text config; the keys it does not know go to ``unknown``."""
    names = {f.name for f in fields(MiniMaxM3Config)}
    direct = names - {
        "architectures", "torch_dtype", "eos_token_ids", "bos_token_id", "quant_algo",
        "modules_to_not_convert", "vision",
    }  # fmt: skip
    kwargs = {k: text[k] for k in direct if k in text and text[k] is not None}
    if "num_experts" in text and "num_local_experts" not in text:  # transformers' attribute_map
        kwargs["num_local_experts"] = text["num_experts"]
    act = text.get("hidden_act", "swigluoai")
    if act not in ("swigluoai", "silu"):
        raise ValueError(
            f"{where}: hidden_act={act!r}; MiniMax-M3's MLPs are SwiGLU-OAI ('swigluoai')"
        )
    kwargs.update(_rope_kwargs(text, where))
    kwargs.update(_legacy_kwargs(text, where, unknown))
    for key in ("layer_types", "mlp_layer_types"):
        if key in kwargs:
            if not isinstance(kwargs[key], list | tuple):
                raise ValueError(f"{where}: {key}={kwargs[key]!r} must be a list")
            kwargs[key] = tuple(kwargs[key])
    unknown |= set(text) - names - IGNORED_TEXT_KEYS
    return kwargs


def _rope_kwargs(text: dict[str, Any], where: str) -> dict[str, Any]:
    """``rope_theta`` and ``partial_rotary_factor`` from ``rope_scaling`` or ``rope_parameters``
    (transformers takes the former when both are there) or the legacy top-level keys. Only the
    default RoPE is served."""
    params = dict(text.get("rope_scaling") or text.get("rope_parameters") or {})
    for legacy in ("rope_theta", "partial_rotary_factor"):
        if legacy in text and legacy not in params:
            params[legacy] = text[legacy]
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ValueError(
            f"{where}: rope_parameters.rope_type={rope_type!r}; only the default RoPE is served"
        )
    out = {}
    if "rope_theta" in params:
        out["rope_theta"] = float(params["rope_theta"])
    if "partial_rotary_factor" in params:
        out["partial_rotary_factor"] = float(params["partial_rotary_factor"])
    return out


def _legacy_kwargs(text: dict[str, Any], where: str, unknown: set[str]) -> dict[str, Any]:
    """The hub's ``sparse_attention_config`` and ``moe_layer_freq``, as transformers maps them: a
    legacy index key wins over its flat name, flat ``layer_types`` / ``mlp_layer_types`` win over
    the legacy frequency lists."""
    out: dict[str, Any] = {}
    sparse = text.get("sparse_attention_config") or {}
    if not isinstance(sparse, dict):
        raise ValueError(f"{where}: sparse_attention_config={sparse!r} must be an object")
    for flat, legacy in LEGACY_INDEX_KEYS.items():
        if legacy in sparse:
            out[flat] = sparse[legacy]
    if text.get("layer_types") is None and "sparse_attention_freq" in sparse:
        out["layer_types"] = tuple(SPARSE if f else FULL for f in sparse["sparse_attention_freq"])
    extra = set(sparse) - set(LEGACY_INDEX_KEYS.values()) - {"sparse_attention_freq"}
    unknown |= {f"sparse_attention_config.{k}" for k in extra}
    freq = text.get("moe_layer_freq")
    if text.get("mlp_layer_types") is None and freq is not None:
        if not isinstance(freq, list):
            raise ValueError(f"{where}: moe_layer_freq={freq!r} must be a list of 0/1 per layer")
        out["mlp_layer_types"] = tuple(MOE_MLP if f else DENSE_MLP for f in freq)
    return out
