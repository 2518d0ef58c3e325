"""User-facing configuration (pydantic), with upstream TensorRT-LLM's key names.

Every model forbids unknown keys, so a typo in Python or in a YAML options file is an error that
names the key. Values are validated where they are declared.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tensorrt_llm._torch.disaggregation import DEFAULT_TRANSFER_TIMEOUT_S
from tensorrt_llm._torch.distributed.mapping import Mapping
from tensorrt_llm._torch.pyexecutor.config import (
    BatchWait,
    CudaGraphOptions,
    KvCacheOptions,
    PyExecutorConfig,
)
from tensorrt_llm._torch.pyexecutor.grammar_matcher import check_backend
from tensorrt_llm._torch.speculative.interface import (
    Eagle3SpecConfig,
    MTPSpecConfig,
    RelaxedAcceptance,
)
from tensorrt_llm.quantization import QuantAlgo


def default_attn_backend(device: str) -> str:
    """What ``attn_backend=None`` means on ``device`` ("cpu", "cuda", "cuda:1"): the Triton kernels
    on a CUDA device, the torch reference elsewhere."""
    return "TRITON" if device.startswith("cuda") else "VANILLA"


class StrictBaseModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


class KvCacheConfig(StrictBaseModel):
    """How the KV cache is sized and reused.

    The pool holds ``max_tokens`` tokens when given; otherwise, on a GPU,
    ``free_gpu_memory_fraction`` of the free device memory; on a CPU, enough for
    ``max_batch_size`` sequences of ``max_seq_len`` tokens.
    """

    enable_block_reuse: bool = True
    tokens_per_block: int = 128
    max_tokens: int | None = Field(default=None, gt=0)
    free_gpu_memory_fraction: float = Field(default=0.9, gt=0.0, le=1.0)
    # The KV cache's dtype (upstream's key): "auto" takes the model's; "fp8" keeps every row (K, V,
    # index keys, the drafter's) in float8_e4m3fn with a float32 scale per token and head.
    dtype: Literal["auto", "float32", "float16", "bfloat16", "fp8"] = "auto"

    @field_validator("tokens_per_block")
    @classmethod
    def _power_of_two(cls, value: int) -> int:
        if value <= 0 or value & (value - 1):
            raise ValueError(f"tokens_per_block={value} must be a power of two")
        return value


class QuantConfig(StrictBaseModel):
    """Quantization at load (upstream's name). ``quant_algo="FP8_BLOCK_SCALES"``: the attention
    projections, dense MLPs and experts in FP8 with 128 x 128 block scales (a bf16 checkpoint is
    quantized as it loads; an FP8 checkpoint says so itself and needs no QuantConfig). On the CPU
    the weights stay in the model's dtype, rounded to the FP8 grid."""

    quant_algo: QuantAlgo | None = None


class _DecodingConfig(StrictBaseModel):
    """A speculative config: its ``decoding_type`` always travels with it (a copy dumped with
    ``exclude_unset`` to another rank or process is read back as the same kind)."""

    @model_validator(mode="after")
    def _keep_kind(self):
        self.model_fields_set.add("decoding_type")
        return self


class Eagle3DecodingConfig(_DecodingConfig):
    """Eagle3 speculative decoding. One-model: the drafter runs inside the target's forward and, in
    this fork, keeps its KV in the target's KV cache manager (``draft_kv_cache="unified"``)."""

    decoding_type: Literal["Eagle3"] = "Eagle3"
    max_draft_len: int = Field(default=3, ge=1)
    speculative_model: str | None = None
    eagle3_one_model: bool = True
    num_eagle_layers: int = Field(default=1, ge=1)
    eagle3_layers_to_capture: tuple[int, ...] | None = None
    # Where the drafter keeps its KV: "unified" (in the target's slots, read through the sub-page
    # view) or "separate" (a second manager that mirrors requests, never reuses and is not
    # transferred; kept to measure what the unified cache buys).
    draft_kv_cache: Literal["unified", "separate"] = "unified"

    def to_runtime(self) -> Eagle3SpecConfig:
        """The runtime's speculative config; one-model Eagle3 with a drafter checkpoint only."""
        if not self.eagle3_one_model:
            raise ValueError(
                "speculative_config.eagle3_one_model=False: only one-model Eagle3 is supported"
            )
        if self.speculative_model is None:
            raise ValueError(
                "speculative_config.speculative_model is required (the Eagle3 checkpoint directory)"
            )
        return Eagle3SpecConfig(
            max_draft_len=self.max_draft_len,
            speculative_model=self.speculative_model,
            num_eagle_layers=self.num_eagle_layers,
            eagle3_layers_to_capture=self.eagle3_layers_to_capture,
            draft_kv_cache=self.draft_kv_cache,
        )


class MTPDecodingConfig(_DecodingConfig):
    """Multi-token prediction with the checkpoint's own MTP module (MiniMax-M3 carries one under
    ``mtp.layers.0``), replayed for every draft step as one-model Eagle3's drafter is. Its layer
    is one more sparse layer of the target's KV cache (``draft_kv_cache="unified"``).
    ``speculative_model``: a standalone MTP checkpoint instead of the target's ``mtp.*`` keys."""

    decoding_type: Literal["MTP"] = "MTP"
    max_draft_len: int = Field(default=3, ge=1)
    num_nextn_predict_layers: int = Field(default=1, ge=1)
    speculative_model: str | None = None
    # greedy rows inside a reasoning block accept a draft among the target's ``relaxed_topk``
    # most likely tokens within ``relaxed_delta`` of the top one's probability
    use_relaxed_acceptance_for_thinking: bool = False
    relaxed_topk: int = Field(default=1, ge=1)
    relaxed_delta: float = Field(default=0.0, ge=0.0)
    # the reasoning block's markers (None: the tokenizer's ``<mm:think>`` and ``</mm:think>``)
    begin_thinking_phase_token: int | None = Field(default=None, ge=0)
    end_thinking_phase_token: int | None = Field(default=None, ge=0)
    draft_kv_cache: Literal["unified", "separate"] = "unified"

    def to_runtime(self) -> MTPSpecConfig:
        relaxed = None
        if self.use_relaxed_acceptance_for_thinking:
            relaxed = RelaxedAcceptance(
                self.relaxed_topk,
                self.relaxed_delta,
                self.begin_thinking_phase_token,
                self.end_thinking_phase_token,
            )
        return MTPSpecConfig(
            max_draft_len=self.max_draft_len,
            num_nextn_predict_layers=self.num_nextn_predict_layers,
            speculative_model=self.speculative_model,
            draft_kv_cache=self.draft_kv_cache,
            relaxed=relaxed,
        )


SPECULATIVE_CONFIGS = {"Eagle3": Eagle3DecodingConfig, "MTP": MTPDecodingConfig}


class CudaGraphConfig(StrictBaseModel):
    """CUDA graphs for generation steps (the target forward, sampling, penalties and logprobs,
    and with Eagle3 the accept and the draft chain), per batch size, all captured at start-up;
    a step with a few short prompts beside them (or alone) replays a graph of its own too; other
    prefill and mixed batches run eagerly. They need a CUDA device and
    ``attn_backend="TRITON"``; ``cuda_graph_config=None`` turns them off."""

    # The captured batch sizes; None: 1, 2, 4, then multiples of 8, up to max_batch_size.
    batch_sizes: list[int] | None = None
    max_batch_size: int = Field(default=0, ge=0)  # 0: the LLM's max_batch_size
    enable_padding: bool = True  # run a batch in the smallest captured size that holds it
    # A step with up to ``mixed_max_prompts`` prompts beside the decodes (or alone) replays a
    # graph too when their chunks still to compute fit this many tokens per prompt (the graphs
    # of 1, 2, 4, ... prompts are padded to as many times this); 0: such steps run eagerly. The
    # padding sequence holds the KV of the largest one's padding (this times mixed_max_prompts,
    # lowered to fit max_seq_len).
    mixed_prompt_tokens: int = Field(default=256, ge=0)
    mixed_max_prompts: int = Field(default=4, ge=1)

    def to_runtime(self, llm_max_batch_size: int, max_seq_len: int) -> CudaGraphOptions:
        limit = self.max_batch_size or llm_max_batch_size
        if self.batch_sizes is not None:
            sizes = sorted(set(self.batch_sizes))
            if not sizes or sizes[0] < 1 or sizes[-1] > llm_max_batch_size:
                raise ValueError(
                    f"cuda_graph_config.batch_sizes={self.batch_sizes} must be in "
                    f"[1, max_batch_size={llm_max_batch_size}]"
                )
        else:
            limit = min(limit, llm_max_batch_size)
            sizes = sorted({b for b in (1, 2, 4, *range(8, limit + 1, 8)) if b <= limit} | {limit})
        return CudaGraphOptions(
            tuple(sizes),
            self.enable_padding,
            # (a mixed graph's padding is a sequence: its tokens fit one sequence's positions)
            mixed_prompt_tokens=min(
                self.mixed_prompt_tokens, max_seq_len // self.mixed_max_prompts
            ),
            max_prompts=self.mixed_max_prompts,
        )


class CacheTransceiverConfig(StrictBaseModel):
    """Makes a server a context or generation server of a disaggregated deployment."""

    backend: Literal["NIXL"] = "NIXL"
    transfer_timeout_s: float = Field(default=DEFAULT_TRANSFER_TIMEOUT_S, gt=0)
    # A context server refuses new context-only requests (429) while KV held for pulls that have
    # not come fills this fraction of its slots, so stuck or absent pulls cannot pin the cache.
    max_held_fraction: float = Field(default=0.5, gt=0.0, le=1.0)


class TorchLlmArgs(StrictBaseModel):
    """Everything ``LLM(...)`` accepts; the same keys load from a YAML options file."""

    model: str | None = None  # None: the bundled M3-tiny checkpoint
    tokenizer: str | None = None
    # The chat template (a Jinja file, or its text): in place of the checkpoint's
    # chat_template.jinja or tokenizer_config.json's (trtllm-serve --chat_template).
    chat_template: str | None = None
    # No tokenizer at all (upstream's key): prompts are token ids and outputs carry no text.
    skip_tokenizer_init: bool = False
    backend: Literal["pytorch"] = "pytorch"
    kv_cache_config: KvCacheConfig = Field(default_factory=KvCacheConfig)
    max_batch_size: int = Field(default=8, gt=0)
    max_num_tokens: int = Field(default=2048, gt=0)
    max_seq_len: int | None = Field(default=None, gt=1)
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    enable_chunked_prefill: bool = True
    # Batch waiting (upstream's keys; 0 disables): while requests decode, new prompts wait up to
    # batch_wait_timeout_iters steps for others to join them, or until the step's tokens reach
    # batch_wait_max_tokens_ratio * max_num_tokens, so that fewer steps mix prefill into decode.
    batch_wait_timeout_iters: int = Field(default=0, ge=0)
    batch_wait_max_tokens_ratio: float = Field(default=0.0, ge=0.0, le=1.0)
    speculative_config: Eagle3DecodingConfig | MTPDecodingConfig | None = None
    quant_config: QuantConfig | None = None
    # How weights load (upstream's key): "auto" reads the checkpoint; "dummy" reads only the
    # configs and makes random weights on the device (benchmarks of models without their files).
    load_format: Literal["auto", "dummy"] = "auto"
    cache_transceiver_config: CacheTransceiverConfig | None = None
    # The attention backend (upstream's key): "VANILLA" is the torch reference (the CPU path),
    # "TRITON" the GPU kernels; None: TRITON on a CUDA device, VANILLA on the CPU (LLM resolves it).
    attn_backend: Literal["VANILLA", "TRITON"] | None = None
    # CUDA graphs for decode steps (upstream's key); on by default where they can run (a CUDA
    # device with TRITON), None turns them off. Asked for explicitly where they cannot: an error.
    cuda_graph_config: CudaGraphConfig | None = Field(default_factory=CudaGraphConfig)
    # The overlap scheduler (upstream's key): the host schedules and prepares each step while the
    # device runs the one before; a stop then lands one step late (its extra token is dropped).
    disable_overlap_scheduler: bool = False
    # The engine core (scheduler, KV, steps, ranks) in a process of its own, the front side
    # (tokenizing, detokenizing, stop strings) in this one, joined by ZeroMQ: what trtllm-serve
    # runs. False: the core runs on a thread of this process (offline use).
    engine_process: bool = False
    # With engine_process: how long the engine core may go without finishing a step before the
    # front takes it as hung (a stuck kernel or collective, a stopped process): its requests end
    # (a 503 on a server), it is killed and another core starts. Longer than the longest step
    # that can happen (a long prompt's chunk, a first step that compiles a kernel).
    engine_core_deadline_s: float = Field(default=60.0, gt=0)
    # Ranks (one process and one GPU each) and how they split the work (upstream's keys): tensor
    # parallelism splits every layer's heads over them; with enable_attention_dp each rank runs
    # its own requests on replicated weights (see _torch/distributed/mapping.py).
    tensor_parallel_size: int = Field(default=1, ge=1)
    enable_attention_dp: bool = False
    # How the MoE layers' routed experts split over the same ranks (upstream's keys): whole
    # experts per rank (expert parallelism), or a slice of every expert (MoE tensor parallelism);
    # their product is tensor_parallel_size. None: derived from the other, else MoE TP over every
    # rank under TP attention and EP over every rank under attention DP.
    moe_expert_parallel_size: int | None = None
    moe_tensor_parallel_size: int | None = None
    # Guided decoding (upstream's key): requests' SamplingParams.guided_decoding (JSON schemas,
    # regexes, grammars) and the server's response_format are built with this backend; None:
    # requests that ask for one are refused.
    guided_decoding_backend: Literal["xgrammar"] | None = None

    @field_validator("speculative_config", mode="before")
    @classmethod
    def _speculative_kind(cls, value):
        """A mapping's ``decoding_type`` picks the config (Eagle3 when it names none)."""
        if isinstance(value, dict):
            kind = value.get("decoding_type", "Eagle3")
            if kind not in SPECULATIVE_CONFIGS:
                raise ValueError(
                    f"speculative_config.decoding_type={kind!r}: expected one of "
                    f"{sorted(SPECULATIVE_CONFIGS)}"
                )
            return SPECULATIVE_CONFIGS[kind](**value)
        return value

    @model_validator(mode="after")
    def _check_mapping(self) -> TorchLlmArgs:
        self.mapping()  # a layout that cannot be served fails here, naming the options
        check_backend(self.guided_decoding_backend)  # (its package installed)
        return self

    def mapping(self, rank: int = 0) -> Mapping:
        return Mapping(
            world_size=self.tensor_parallel_size,
            tp_size=self.tensor_parallel_size,
            rank=rank,
            enable_attention_dp=self.enable_attention_dp,
            moe_ep_size=self.moe_expert_parallel_size,
            moe_tp_size=self.moe_tensor_parallel_size,
        )

    @classmethod
    def from_kwargs(cls, extra_llm_api_options: str | Path | None = None, **kwargs) -> TorchLlmArgs:
        """Build from keyword arguments plus, optionally, a YAML file of the same keys. A key given
        both ways is an error (which one should win would be a guess)."""
        if extra_llm_api_options is not None:
            options = load_yaml_options(extra_llm_api_options)
            both = sorted(k for k in options if kwargs.get(k) is not None)
            if both:
                raise ValueError(
                    f"{extra_llm_api_options}: key(s) {both} are also given as arguments"
                )
            kwargs = {**{k: v for k, v in kwargs.items() if v is not None}, **options}
        return cls(**kwargs)

    def to_executor_config(
        self, max_seq_len: int, model_dtype: str, device: str, mapping: Mapping | None = None
    ) -> PyExecutorConfig:
        """Translate into the runtime's config, once, at the creation site. ``model_dtype`` is the
        resolved weight dtype (the KV cache's under ``kv_cache_config.dtype: auto``); ``mapping``
        is the rank's (rank 0's by default)."""
        kv = self.kv_cache_config
        attn_backend = self.attn_backend or default_attn_backend(device)
        return PyExecutorConfig(
            max_batch_size=self.max_batch_size,
            max_num_tokens=self.max_num_tokens,
            max_seq_len=max_seq_len,
            kv_cache=KvCacheOptions(
                tokens_per_block=kv.tokens_per_block,
                dtype=model_dtype if kv.dtype == "auto" else kv.dtype,
                max_tokens=kv.max_tokens,
                free_gpu_memory_fraction=kv.free_gpu_memory_fraction,
                enable_block_reuse=kv.enable_block_reuse,
            ),
            enable_chunked_prefill=self.enable_chunked_prefill,
            batch_wait=BatchWait(self.batch_wait_timeout_iters, self.batch_wait_max_tokens_ratio),
            speculative=(
                None if self.speculative_config is None else self.speculative_config.to_runtime()
            ),
            attn_backend=attn_backend,
            device=device,
            cuda_graph=self._cuda_graph_options(attn_backend, device, max_seq_len),
            overlap_scheduler=not self.disable_overlap_scheduler,
            mapping=mapping or self.mapping(),
            load_format=self.load_format,
            kv_transfer_timeout_s=(
                None
                if self.cache_transceiver_config is None
                else self.cache_transceiver_config.transfer_timeout_s
            ),
            guided_decoding_backend=self.guided_decoding_backend,
        )

    def _cuda_graph_options(
        self, attn_backend: str, device: str, max_seq_len: int
    ) -> CudaGraphOptions | None:
        graphs = self.cuda_graph_config
        if graphs is None:
            return None
        if device.startswith("cuda") and attn_backend == "TRITON":
            return graphs.to_runtime(self.max_batch_size, max_seq_len)
        if "cuda_graph_config" in self.model_fields_set:
            raise ValueError(
                f"cuda_graph_config needs device='cuda' and attn_backend='TRITON'; this LLM runs "
                f"on {device!r} with {attn_backend!r} (pass cuda_graph_config=None to run every "
                "step eagerly)"
            )
        return None


def load_yaml_options(path: str | Path) -> dict:
    """A YAML mapping of ``TorchLlmArgs`` keys (validated when the args are built)."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ValueError(f"options file {str(path)!r}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"options file {str(path)!r} is not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(
            f"options file {str(path)!r} must hold a mapping of options, not {type(data).__name__}"
        )
    return data
