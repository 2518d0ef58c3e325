"""Tiny MiniMax-M3 configs and managers shared by the _torch tests."""

import torch

from tensorrt_llm._torch.attention_backend.sparse.minimax_m3.cache_manager import (
    MiniMaxM3KVCacheManagerV2,
)
from tensorrt_llm._torch.models.modeling_minimaxm3 import MiniMaxM3Config
from tensorrt_llm.llmapi.llm_args import KvCacheConfig

TINY = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    rotary_dim=4,
    sparse_attention_config=dict(
        index_n_heads=2,
        index_head_dim=8,
        topk_blocks=2,
        block_size=8,
        num_local_blocks=1,
        num_dense_layers=1,
    ),
)


def tiny_config(**overrides) -> MiniMaxM3Config:
    return MiniMaxM3Config.from_dict({**TINY, **overrides})


def m3_manager(
    cfg: MiniMaxM3Config,
    tokens_per_block=4,
    max_tokens=512,
    max_seq_len=128,
    max_batch_size=4,
    **kw,
):
    return MiniMaxM3KVCacheManagerV2(
        KvCacheConfig(max_tokens=max_tokens, **kw),
        num_layers=cfg.num_hidden_layers,
        num_kv_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        tokens_per_block=tokens_per_block,
        max_seq_len=max_seq_len,
        max_batch_size=max_batch_size,
        dtype=torch.float32,
        sparse_layer_ids=cfg.sparse_layer_ids,
        index_head_dim=cfg.sparse_attention_config.index_head_dim
        if cfg.sparse_attention_config
        else 0,
    )
