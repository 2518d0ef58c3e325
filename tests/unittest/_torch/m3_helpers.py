"""Tiny MiniMax-M3 configs and managers shared by the _torch tests."""

from tensorrt_llm._torch.models.configuration_minimaxm3 import MiniMaxM3Config
from tensorrt_llm._torch.pyexecutor._util import create_kv_cache_managers
from tensorrt_llm._torch.pyexecutor.config import KvCacheOptions, PyExecutorConfig
from tensorrt_llm._torch.pyexecutor.resource_manager import ResourceManagerType

# The published architecture, tiny: a flat (transformers text) config.json. Layers 1 and 2 are
# sparse (8-token index blocks, top-3 with the local one), layer 1 an MoE of 4 experts (top-2).
TINY = dict(
    architectures=["MiniMaxM3VLForCausalLM"],
    model_type="minimax_m3_vl_text",
    vocab_size=64,
    hidden_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    intermediate_size=16,
    dense_intermediate_size=64,
    shared_intermediate_size=16,
    num_local_experts=4,
    num_experts_per_tok=2,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    layer_types=["full_attention", "minimax_m3_sparse", "minimax_m3_sparse"],
    mlp_layer_types=["dense", "sparse", "dense"],
    index_n_heads=2,
    index_head_dim=8,
    index_block_size=8,
    index_topk_blocks=3,
    index_local_blocks=1,
    max_position_embeddings=4096,
    dtype="float32",
)


def tiny_config(**overrides) -> MiniMaxM3Config:
    """``TINY`` with ``overrides``; another ``num_hidden_layers`` repeats the per-layer lists."""
    layers = overrides.get("num_hidden_layers", TINY["num_hidden_layers"])
    base = dict(TINY)
    for key in ("layer_types", "mlp_layer_types"):
        base[key] = [TINY[key][i % len(TINY[key])] for i in range(layers)]
    return MiniMaxM3Config.from_dict({**base, **overrides})


def executor_config(
    tokens_per_block=4, max_tokens=512, max_seq_len=128, max_batch_size=4, spec=None, **kv
) -> PyExecutorConfig:
    """A float32 CPU runtime config for tests (``kv``: more ``KvCacheOptions`` fields)."""
    return PyExecutorConfig(
        max_batch_size=max_batch_size,
        max_num_tokens=2048,
        max_seq_len=max_seq_len,
        kv_cache=KvCacheOptions(tokens_per_block, "float32", max_tokens, **kv),
        speculative=spec,
    )


def m3_manager(cfg: MiniMaxM3Config, **kw):
    """The target KV cache manager the creation site builds for ``cfg`` (see ``executor_config``)."""
    managers = create_kv_cache_managers(cfg, executor_config(**kw))
    return managers[ResourceManagerType.KV_CACHE_MANAGER]
