"""Tiny MiniMax-M3 configs and managers shared by the _torch tests."""

from tensorrt_llm._torch.models.modeling_minimaxm3 import MiniMaxM3Config
from tensorrt_llm._torch.pyexecutor._util import create_kv_cache_managers
from tensorrt_llm._torch.pyexecutor.config import KvCacheOptions, PyExecutorConfig
from tensorrt_llm._torch.pyexecutor.resource_manager import ResourceManagerType

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
