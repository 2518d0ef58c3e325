"""Creation sites: the KV cache manager(s), the drafter and the executor, from validated LLM args.

With one-model Eagle3 the drafter's layer id is the target's layer count. Whether its KV gets a
separate manager is decided here, once (``_should_create_separate_draft_kv_cache``); everything
downstream trusts the registered resources (``resolve_draft_kv_cache_manager``).
"""

from __future__ import annotations

import torch

from tensorrt_llm._torch.attention_backend.sparse.minimax_m3.cache_manager import (
    MiniMaxM3KVCacheManagerV2,
)
from tensorrt_llm._torch.models.checkpoint import load_eagle3
from tensorrt_llm._torch.models.modeling_minimaxm3 import MiniMaxM3Config, MiniMaxM3ForCausalLM
from tensorrt_llm._torch.models.modeling_speculative import default_layers_to_capture
from tensorrt_llm._torch.pyexecutor.kv_cache_manager_v2 import KVCacheManagerV2
from tensorrt_llm._torch.pyexecutor.model_engine import PyTorchModelEngine
from tensorrt_llm._torch.pyexecutor.py_executor import PyExecutor
from tensorrt_llm._torch.pyexecutor.resource_manager import ResourceManager, ResourceManagerType
from tensorrt_llm._torch.pyexecutor.sampler import TorchSampler
from tensorrt_llm._torch.pyexecutor.scheduler import GuaranteedNoEvictScheduler
from tensorrt_llm._torch.speculative.eagle3 import Eagle3OneModelWorker
from tensorrt_llm._torch.speculative.utils import _should_create_separate_draft_kv_cache
from tensorrt_llm.llmapi.llm_args import TorchLlmArgs
from tensorrt_llm.logger import logger


def create_kv_cache_managers(
    config: MiniMaxM3Config,
    args: TorchLlmArgs,
    max_seq_len: int,
    dtype: torch.dtype,
    device: torch.device,
    draft_geometry: tuple[int, int] | None = None,
) -> dict[ResourceManagerType, KVCacheManagerV2]:
    """The target manager, plus a separate draft manager when that mode is chosen.

    ``draft_geometry`` is the drafter's ``(num_kv_heads, head_dim)`` with one-model Eagle3.
    """
    kv = args.kv_cache_config
    kv_dtype = dtype if kv.dtype == "auto" else getattr(torch, kv.dtype)
    spec = args.speculative_config if draft_geometry is not None else None
    num_layers = config.num_hidden_layers
    heads = [config.num_key_value_heads] * num_layers
    head_dims = [config.head_dim] * num_layers
    if spec is not None:
        heads.append(draft_geometry[0])
        head_dims.append(draft_geometry[1])
    common = dict(
        num_layers=num_layers,
        num_kv_heads=heads,
        head_dim=head_dims,
        tokens_per_block=kv.tokens_per_block,
        max_seq_len=max_seq_len,
        max_batch_size=args.max_batch_size,
        dtype=kv_dtype,
        spec_config=spec,
        device=device,
    )
    separate = _should_create_separate_draft_kv_cache(spec, MiniMaxM3KVCacheManagerV2)
    msa = config.sparse_attention_config
    target = MiniMaxM3KVCacheManagerV2(
        kv,
        sparse_layer_ids=config.sparse_layer_ids,
        index_head_dim=msa.index_head_dim if msa else 0,
        num_one_model_draft_layers=1 if spec is not None else 0,
        layer_mask=[True] * num_layers + [False] if separate else None,
        **common,
    )
    managers: dict[ResourceManagerType, KVCacheManagerV2] = {
        ResourceManagerType.KV_CACHE_MANAGER: target
    }
    if separate:
        draft_kv = kv.model_copy(
            update={
                "enable_block_reuse": False,
                "max_tokens": target.blocks_in_primary_pool * kv.tokens_per_block,
            }
        )
        managers[ResourceManagerType.DRAFT_KV_CACHE_MANAGER] = KVCacheManagerV2(
            draft_kv, is_draft=True, layer_mask=[False] * num_layers + [True], **common
        )
        logger.info(
            "[unified-kv] draft layer %d uses a separate KV cache manager (no reuse, no transfer)",
            num_layers,
        )
    return managers


def create_py_executor(
    model: MiniMaxM3ForCausalLM,
    config: MiniMaxM3Config,
    args: TorchLlmArgs,
    max_seq_len: int,
    dtype: torch.dtype,
    device: torch.device,
    detokenize=None,
) -> PyExecutor:
    spec = args.speculative_config
    draft_model = None
    if spec is not None:
        if not spec.eagle3_one_model:
            raise ValueError(
                "speculative_config.eagle3_one_model=False: only one-model Eagle3 is supported"
            )
        if spec.speculative_model is None:
            raise ValueError(
                "speculative_config.speculative_model is required (the Eagle3 checkpoint directory)"
            )
        draft_model = load_eagle3(
            spec.speculative_model, model, config.num_hidden_layers, dtype, device
        )
    geometry = (
        None
        if draft_model is None
        else (draft_model.config.num_key_value_heads, draft_model.config.head_dim)
    )
    managers = create_kv_cache_managers(config, args, max_seq_len, dtype, device, geometry)
    resources = ResourceManager(managers)
    kv_cache_manager = managers[ResourceManagerType.KV_CACHE_MANAGER]
    engine = PyTorchModelEngine(model, kv_cache_manager, device)
    sampler = TorchSampler()
    worker = None
    if draft_model is not None:
        layers = spec.eagle3_layers_to_capture or draft_model.config.eagle3_layers_to_capture
        engine.capture_layers = tuple(layers or default_layers_to_capture(config.num_hidden_layers))
        if len(engine.capture_layers) != 3 or not all(
            0 <= i < config.num_hidden_layers for i in engine.capture_layers
        ):
            raise ValueError(
                f"eagle3_layers_to_capture={engine.capture_layers}: need three target layer ids in "
                f"[0, {config.num_hidden_layers})"
            )
        worker = Eagle3OneModelWorker(spec, draft_model, resources, sampler, config.vocab_size)
    return PyExecutor(
        engine,
        resources,
        GuaranteedNoEvictScheduler(
            args.max_batch_size, args.max_num_tokens, kv_cache_manager, args.enable_chunked_prefill
        ),
        sampler,
        max_seq_len,
        detokenize=detokenize,
        spec_worker=worker,
    )
