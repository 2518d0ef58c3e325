"""Creation sites: build the KV cache manager(s) and the executor from validated LLM args."""

from __future__ import annotations

import torch

from tensorrt_llm._torch.attention_backend.sparse.minimax_m3.cache_manager import (
    MiniMaxM3KVCacheManagerV2,
)
from tensorrt_llm._torch.models.modeling_minimaxm3 import MiniMaxM3Config
from tensorrt_llm._torch.pyexecutor.model_engine import PyTorchModelEngine
from tensorrt_llm._torch.pyexecutor.py_executor import PyExecutor
from tensorrt_llm._torch.pyexecutor.resource_manager import ResourceManager, ResourceManagerType
from tensorrt_llm._torch.pyexecutor.sampler import TorchSampler
from tensorrt_llm._torch.pyexecutor.scheduler import GuaranteedNoEvictScheduler
from tensorrt_llm.llmapi.llm_args import TorchLlmArgs


def create_kv_cache_manager(
    config: MiniMaxM3Config,
    args: TorchLlmArgs,
    max_seq_len: int,
    dtype: torch.dtype,
    device: torch.device,
) -> MiniMaxM3KVCacheManagerV2:
    kv = args.kv_cache_config
    kv_dtype = dtype if kv.dtype == "auto" else getattr(torch, kv.dtype)
    msa = config.sparse_attention_config
    return MiniMaxM3KVCacheManagerV2(
        kv,
        num_layers=config.num_hidden_layers,
        num_kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        tokens_per_block=kv.tokens_per_block,
        max_seq_len=max_seq_len,
        max_batch_size=args.max_batch_size,
        dtype=kv_dtype,
        sparse_layer_ids=config.sparse_layer_ids,
        index_head_dim=msa.index_head_dim if msa else 0,
        device=device,
    )


def create_py_executor(
    model: torch.nn.Module,
    config: MiniMaxM3Config,
    args: TorchLlmArgs,
    max_seq_len: int,
    dtype: torch.dtype,
    device: torch.device,
    detokenize=None,
) -> PyExecutor:
    kv_cache_manager = create_kv_cache_manager(config, args, max_seq_len, dtype, device)
    resources = ResourceManager({ResourceManagerType.KV_CACHE_MANAGER: kv_cache_manager})
    return PyExecutor(
        PyTorchModelEngine(model, kv_cache_manager, device),
        resources,
        GuaranteedNoEvictScheduler(
            args.max_batch_size, args.max_num_tokens, kv_cache_manager, args.enable_chunked_prefill
        ),
        TorchSampler(),
        max_seq_len,
        detokenize=detokenize,
    )
