"""Creation sites: the KV cache manager(s), the drafter and the executor, from validated LLM args.

With one-model Eagle3 the drafter's layer id is the target's layer count. Whether its KV gets a
separate manager is decided here, once (``_should_create_separate_draft_kv_cache``); everything
downstream trusts the registered resources (``resolve_draft_kv_cache_manager``).
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import TYPE_CHECKING

import torch

from tensorrt_llm._torch.disaggregation.coordinator import DisaggCoordinator
from tensorrt_llm._torch.disaggregation.parallel import hold_in_step, in_lockstep
from tensorrt_llm._torch.disaggregation.transceiver import KvCacheTransceiver
from tensorrt_llm._torch.distributed.moe_all_to_all import ExchangeSync
from tensorrt_llm._torch.models.registry import ModelConfig, get_model_classes
from tensorrt_llm._torch.pyexecutor.config import (
    KvCacheLayer,
    KVCacheManagerV2Config,
    PyExecutorConfig,
)
from tensorrt_llm._torch.pyexecutor.cuda_graph_runner import CUDAGraphRunner
from tensorrt_llm._torch.pyexecutor.executor import RankSync
from tensorrt_llm._torch.pyexecutor.grammar_matcher import GrammarCompiler
from tensorrt_llm._torch.pyexecutor.guided_decoder import GuidedDecoder
from tensorrt_llm._torch.pyexecutor.kv_cache_manager_v2 import KVCacheManagerV2
from tensorrt_llm._torch.pyexecutor.logits_processing import LogitsState
from tensorrt_llm._torch.pyexecutor.model_engine import PyTorchModelEngine, exchanging_moe
from tensorrt_llm._torch.pyexecutor.py_executor import PyExecutor
from tensorrt_llm._torch.pyexecutor.resource_manager import (
    ResourceManager,
    ResourceManagerType,
    get_pp_layers,
)
from tensorrt_llm._torch.pyexecutor.scheduler import GuaranteedNoEvictScheduler
from tensorrt_llm._torch.pyexecutor.seq_slot_manager import SeqSlotManager
from tensorrt_llm._torch.pyexecutor.warm_up import start_up
from tensorrt_llm._torch.speculative.draft_probs import DraftProbStore
from tensorrt_llm._torch.speculative.drafters import draft_kv_layer, layers_to_capture, load_drafter
from tensorrt_llm._torch.speculative.eagle3 import Eagle3OneModelWorker
from tensorrt_llm._torch.speculative.relaxed import with_markers
from tensorrt_llm._torch.speculative.utils import _should_create_separate_draft_kv_cache
from tensorrt_llm.logger import logger

if TYPE_CHECKING:
    from tensorrt_llm.tokenizer import TransformersTokenizer


def create_kv_cache_managers(
    config: ModelConfig,
    executor_config: PyExecutorConfig,
    draft_geometry: tuple[int, int] | KvCacheLayer | None = None,
    manager_cls: type[KVCacheManagerV2] | None = None,
) -> dict[ResourceManagerType, KVCacheManagerV2]:
    """The target manager, plus a separate draft manager when that mode is chosen: the one factory
    of the creation site and the tests.

    ``draft_geometry`` is the drafter's ``(num_kv_heads, head_dim)`` on this rank with one-model
    Eagle3, or its whole ``KvCacheLayer`` (an MTP module's: a sparse layer of the target's
    geometry); its layer follows the model's. Each rank's managers hold its own heads
    (``executor_config.mapping``). ``manager_cls`` defaults to the architecture's (``registry.py``).
    """
    if manager_cls is None:
        manager_cls = get_model_classes(config.architectures[0]).kv_cache_manager_class
    spec = executor_config.speculative if draft_geometry is not None else None
    layers = config.kv_cache_layers(executor_config.mapping)
    num_target = len(layers)
    if draft_geometry is not None:
        if not isinstance(draft_geometry, KvCacheLayer):
            draft_geometry = KvCacheLayer(*draft_geometry)
        layers += (dataclasses.replace(draft_geometry, is_draft=True),)
    attention_dp = executor_config.mapping.enable_attention_dp
    separate = _should_create_separate_draft_kv_cache(spec, manager_cls, attention_dp)
    mask = [True] * num_target + [False] * (len(layers) - num_target) if separate else None
    target_config = KVCacheManagerV2Config(
        layers=layers,
        max_seq_len=executor_config.max_seq_len,
        max_batch_size=executor_config.max_batch_size,
        options=executor_config.kv_cache,
        max_draft_len=spec.max_draft_len if spec is not None else 0,
        local_layer_ids=tuple(get_pp_layers(num_target, None, spec, mask)[0]),
        device=executor_config.device,
    )
    draft_config = None
    if separate:
        draft_config = dataclasses.replace(
            target_config, local_layer_ids=tuple(range(num_target, len(layers))), is_draft=True
        )
        target_config = _leave_room_for_draft_slots(target_config, draft_config, manager_cls)
    target = manager_cls(target_config)
    managers: dict[ResourceManagerType, KVCacheManagerV2] = {
        ResourceManagerType.KV_CACHE_MANAGER: target
    }
    if draft_config is not None:
        draft_options = dataclasses.replace(
            executor_config.kv_cache,
            enable_block_reuse=False,
            max_tokens=target.blocks_in_primary_pool * target.tokens_per_block,
        )
        draft_config = dataclasses.replace(draft_config, options=draft_options)
        managers[ResourceManagerType.DRAFT_KV_CACHE_MANAGER] = KVCacheManagerV2(draft_config)
        logger.info(
            "[unified-kv] draft layer %d uses a separate KV cache manager (no reuse, no transfer)",
            num_target,
        )
    return managers


def _leave_room_for_draft_slots(
    target_config: KVCacheManagerV2Config,
    draft_config: KVCacheManagerV2Config,
    manager_cls: type[KVCacheManagerV2],
) -> KVCacheManagerV2Config:
    """A separate draft manager gets as many slots as the target. When the target is sized from
    free GPU memory, it takes only its share of ``free_gpu_memory_fraction`` (target slot bytes /
    target + draft slot bytes), so the two together stay within the fraction."""
    options = target_config.options
    if options.max_tokens is not None or torch.device(target_config.device).type != "cuda":
        return target_config
    one_slot = dataclasses.replace(options, max_tokens=options.tokens_per_block)
    target_bytes, draft_bytes = (
        _bytes_per_block(cls(dataclasses.replace(config, options=one_slot)))
        for cls, config in ((manager_cls, target_config), (KVCacheManagerV2, draft_config))
    )
    share = options.free_gpu_memory_fraction * target_bytes / (target_bytes + draft_bytes)
    return dataclasses.replace(
        target_config, options=dataclasses.replace(options, free_gpu_memory_fraction=share)
    )


def _bytes_per_block(manager: KVCacheManagerV2) -> int:
    return sum(pool.slot_bytes for pool in manager.layout.pools)


def create_py_executor(
    model: torch.nn.Module,
    executor_config: PyExecutorConfig,
    rank_sync: RankSync | None = None,
    tokenizer: TransformersTokenizer | None = None,
) -> PyExecutor:
    """The rank's executor, built whole: its KV managers, engine, scheduler, drafter, CUDA graphs
    (captured here on CUDA), grammars' compiler, and a disaggregated server's KV transceiver.
    ``rank_sync``: rank 0's under tensor parallelism (``executors/ranks.py``); ``tokenizer``:
    the model's (guided decoding reads its vocabulary)."""
    config = model.config
    spec = executor_config.speculative
    device = torch.device(executor_config.device)
    draft_model = load_drafter(model, executor_config)
    draft_layer = None
    if draft_model is not None:
        draft_layer = draft_kv_layer(draft_model, executor_config.mapping)
    managers = create_kv_cache_managers(config, executor_config, draft_layer)
    resources = ResourceManager(managers)
    # admitted requests beyond a batch: prompts held back (batch waiting, chunks), KV loads
    seq_slots = SeqSlotManager(2 * executor_config.max_batch_size)
    resources.resource_managers[ResourceManagerType.SEQ_SLOT_MANAGER] = seq_slots
    resources.resource_managers[ResourceManagerType.LOGITS_STATE] = LogitsState(
        seq_slots, config.vocab_size, device
    )
    kv_cache_manager = managers[ResourceManagerType.KV_CACHE_MANAGER]
    capture_layers, exchange, worker = (), None, None
    if draft_model is not None:
        capture_layers = layers_to_capture(spec, draft_model, config.num_hidden_layers)
        relaxed = getattr(spec, "relaxed", None)
        resources.resource_managers[ResourceManagerType.SPEC_RESOURCE_MANAGER] = DraftProbStore(
            seq_slots,
            spec.max_draft_len,
            draft_model.draft_vocab_size,
            device,
            None if relaxed is None else with_markers(relaxed, tokenizer),
        )
        worker = Eagle3OneModelWorker(spec, draft_model, resources, config.vocab_size)
    if exchanging := exchanging_moe(model):  # a graph step's most tokens per rank: the
        if draft_model is not None:  # (the drafter's MoE exchanges again at each chain step)
            exchanging += draft_model.exchanging_blocks() * (spec.max_draft_len - 1)
        sizes = executor_config.cuda_graph.batch_sizes if executor_config.cuda_graph else ()
        width = 1 + (spec.max_draft_len if spec is not None else 0)  # exchange's fixed rows
        capacity = max((executor_config.max_batch_size, *sizes)) * width
        exchange = ExchangeSync(exchanging, capacity)
    engine = PyTorchModelEngine(model, kv_cache_manager, device, capture_layers, exchange)
    scheduler = GuaranteedNoEvictScheduler(
        executor_config.max_batch_size,
        executor_config.max_num_tokens,
        kv_cache_manager,
        executor_config.enable_chunked_prefill,
        executor_config.batch_wait,
    )
    guided = _guided_decoder(executor_config, tokenizer, config.vocab_size, config.eos_token_ids)
    runner = None
    if executor_config.cuda_graph is not None:
        runner = CUDAGraphRunner(
            engine, resources, executor_config.cuda_graph, config.vocab_size, worker, guided
        )
    disagg, transceiver = _disaggregation(executor_config, resources, kv_cache_manager)
    executor = PyExecutor(
        engine,
        resources,
        scheduler,
        executor_config.max_seq_len,
        spec_worker=worker,
        cuda_graph_runner=runner,
        overlap=executor_config.overlap_scheduler,
        disagg=disagg,
        transceiver=transceiver,
        rank_sync=rank_sync,
        lockstep=in_lockstep(executor_config.mapping),
        guided=guided,
    )
    start_up(executor, config.vocab_size)  # (on CUDA: kernels compiled, every graph captured)
    return executor


def _guided_decoder(
    executor_config: PyExecutorConfig,
    tokenizer: TransformersTokenizer | None,
    vocab_size: int,
    eos_token_ids: list[int],
) -> GuidedDecoder | None:
    """The grammars' decoder of ``guided_decoding_backend`` (None without one)."""
    if executor_config.guided_decoding_backend is None:
        return None
    if tokenizer is None:
        raise ValueError("guided_decoding_backend needs a tokenizer (skip_tokenizer_init=False)")
    compiler = GrammarCompiler(tokenizer.tokenizer, vocab_size, list(eos_token_ids))
    return GuidedDecoder(compiler)


def _disaggregation(
    executor_config: PyExecutorConfig, resources: ResourceManager, kv_cache_manager
) -> tuple[DisaggCoordinator | None, KvCacheTransceiver | None]:
    """A disaggregated server's coordinator and KV transceiver (None, None elsewhere)."""
    timeout = executor_config.kv_transfer_timeout_s
    if timeout is None:
        return None, None
    mapping = executor_config.mapping
    transceiver = KvCacheTransceiver(
        kv_cache_manager,
        f"trtllm-{uuid.uuid4().hex[:12]}-rank{mapping.rank}",
        parallel=mapping.describe(),
        rank=mapping.rank,
    )
    coordinator = DisaggCoordinator(resources, timeout, hold_in_step(transceiver, mapping))
    return coordinator, transceiver
