"""Runtime configuration of the executor and its KV cache managers: frozen, plain, owned by ``_torch``.

The user layer (``LLM`` and its options) validates what a user typed and translates it into these
once, at the creation site; nothing under ``_torch`` or ``runtime`` reads the user's pydantic models.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tensorrt_llm._torch.distributed.mapping import Mapping
from tensorrt_llm._torch.speculative.interface import Eagle3SpecConfig

KV_DTYPES = ("float32", "float16", "bfloat16", "fp8")
# The element dtype each KV dtype stores; "fp8" rows carry a float32 scale per token and head.
KV_STORAGE_DTYPES = {"fp8": "float8_e4m3fn"}


@dataclass(frozen=True)
class BatchWait:
    """Upstream's batch waiting (0 disables each): while requests decode, the prompts of a step
    wait until ``timeout_iters`` steps have passed, or (``max_tokens_ratio``) until the step's
    tokens reach that share of ``max_num_tokens``; then they all go in one step. Prefill then
    joins decode in fewer steps (a step of more prompts than a mixed CUDA graph takes runs
    eagerly)."""

    timeout_iters: int = 0
    max_tokens_ratio: float = 0.0

    def __post_init__(self) -> None:
        if self.timeout_iters < 0 or not 0.0 <= self.max_tokens_ratio <= 1.0:
            raise ValueError(
                f"batch_wait_timeout_iters={self.timeout_iters} must be >= 0 and "
                f"batch_wait_max_tokens_ratio={self.max_tokens_ratio} in [0, 1]"
            )


@dataclass(frozen=True)
class KvCacheLayer:
    """What one layer keeps per token: K and V of ``num_kv_heads x head_dim``, and on an MSA layer
    one index-K head of ``index_head_dim`` (0: none). ``is_draft`` marks a one-model draft layer,
    whose KV at position i depends on token i + 1 (the drafter boundary rule)."""

    num_kv_heads: int
    head_dim: int
    index_head_dim: int = 0
    is_draft: bool = False

    def __post_init__(self) -> None:
        if self.num_kv_heads <= 0 or self.head_dim <= 0 or self.index_head_dim < 0:
            raise ValueError(f"{self}: head counts and dims must be positive")


@dataclass(frozen=True)
class KvCacheOptions:
    """How the KV cache is sized and reused (``KvCacheConfig`` resolved: ``dtype`` is concrete).

    The pool holds ``max_tokens`` tokens when given; otherwise, on a GPU,
    ``free_gpu_memory_fraction`` of the free device memory; on a CPU, enough for every row of the
    batch at ``max_seq_len``.
    """

    tokens_per_block: int = 128
    dtype: str = "bfloat16"
    max_tokens: int | None = None
    free_gpu_memory_fraction: float = 0.9
    enable_block_reuse: bool = True

    def __post_init__(self) -> None:
        tpb = self.tokens_per_block
        if tpb <= 0 or tpb & (tpb - 1):
            raise ValueError(f"tokens_per_block={tpb} must be a power of two")
        if self.dtype not in KV_DTYPES:
            raise ValueError(f"KV cache dtype={self.dtype!r}: expected one of {KV_DTYPES}")


@dataclass(frozen=True)
class KVCacheManagerV2Config:
    """One KV cache manager: the layer stack it serves and how its pool is sized.

    ``layers`` is the whole stack, layer id = index: the target's layers, then the one-model draft
    layers (``is_draft``). ``local_layer_ids`` are the layers this manager holds (all when None):
    with a separate draft manager the target's manager holds the target layers and the draft
    manager (``is_draft``) holds the draft layers. ``max_draft_len`` (0: no speculation) sizes the
    positions a step may hold past a sequence's length.
    """

    layers: tuple[KvCacheLayer, ...]
    max_seq_len: int
    max_batch_size: int
    options: KvCacheOptions = field(default_factory=KvCacheOptions)
    max_draft_len: int = 0
    local_layer_ids: tuple[int, ...] | None = None
    is_draft: bool = False
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.max_seq_len <= 0 or self.max_batch_size <= 0:
            raise ValueError(
                f"max_seq_len={self.max_seq_len} and max_batch_size={self.max_batch_size} must be "
                "positive"
            )
        if not self.layers:
            raise ValueError("a KV cache needs at least one layer")
        drafts = [layer.is_draft for layer in self.layers]
        if drafts != sorted(drafts):
            draft_ids = [i for i, is_draft in enumerate(drafts) if is_draft]
            raise ValueError(
                f"draft layers must follow every target layer; draft layer ids {draft_ids} of "
                f"{len(drafts)} layers"
            )
        local = self.local_layer_ids
        if local is not None and (not local or not set(local) <= set(range(len(self.layers)))):
            raise ValueError(f"local_layer_ids={local} must name some of {len(self.layers)} layers")

    @property
    def tokens_per_block(self) -> int:
        return self.options.tokens_per_block

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def num_draft_layers(self) -> int:
        return sum(layer.is_draft for layer in self.layers)

    @property
    def num_target_layers(self) -> int:
        return self.num_layers - self.num_draft_layers

    @property
    def layer_ids(self) -> tuple[int, ...]:
        """The layers this manager holds, ascending."""
        if self.local_layer_ids is None:
            return tuple(range(self.num_layers))
        return tuple(sorted(self.local_layer_ids))

    @property
    def num_extra_kv_tokens(self) -> int:
        """Positions a sequence may hold beyond its length within one step: the verify window
        (``max_draft_len`` drafts) plus the draft chain run after acceptance (up to
        ``max_draft_len - 1`` more positions past the accepted tokens)."""
        return 2 * self.max_draft_len

    @property
    def max_blocks_per_seq(self) -> int:
        tpb = self.tokens_per_block
        return -(-(self.max_seq_len + self.num_extra_kv_tokens) // tpb)


@dataclass(frozen=True)
class CudaGraphOptions:
    """CUDA graphs for generation steps, and for one prompt beside them (``cuda_graph_runner.py``)."""

    batch_sizes: tuple[int, ...]  # the captured batch sizes, ascending
    enable_padding: bool = True  # run a batch in the smallest captured size that holds it
    # False: run the captured step's ops eagerly on the same static buffers (no graph): the CPU
    # form of the path, for tests.
    capture: bool = True
    # A step with up to ``max_prompts`` prompts (their last chunks) beside the decodes, or alone,
    # replays a mixed graph too (``mixed_bucket.py``) when their chunks fit this many tokens per
    # prompt row; 0: such steps run eagerly.
    mixed_prompt_tokens: int = 0
    max_prompts: int = 4

    def __post_init__(self) -> None:
        sizes = self.batch_sizes
        if not sizes or list(sizes) != sorted(set(sizes)) or sizes[0] < 1:
            raise ValueError(
                f"cuda graph batch_sizes={list(sizes)} must be positive, ascending and distinct"
            )
        if self.mixed_prompt_tokens < 0 or self.max_prompts < 1:
            raise ValueError(
                f"mixed_prompt_tokens={self.mixed_prompt_tokens} must be >= 0 and "
                f"max_prompts={self.max_prompts} >= 1"
            )


@dataclass(frozen=True)
class PyExecutorConfig:
    """The executor's runtime configuration, translated once from the user's options."""

    max_batch_size: int
    max_num_tokens: int
    max_seq_len: int
    kv_cache: KvCacheOptions
    enable_chunked_prefill: bool = True
    batch_wait: BatchWait = field(default_factory=BatchWait)
    speculative: Eagle3SpecConfig | None = None
    attn_backend: str = "VANILLA"
    device: str = "cpu"
    cuda_graph: CudaGraphOptions | None = None  # None: every step runs eagerly
    # the host prepares step n+1 while the device runs step n (``PyExecutor.step``)
    overlap_scheduler: bool = False
    mapping: Mapping = field(default_factory=Mapping)  # this rank, and how the ranks split work
    load_format: str = "auto"  # "dummy": random weights, no file read (the drafter's too)
    # a disaggregated server's: its KV transceiver, and how long held KV waits for a pull (None:
    # no transceiver)
    kv_transfer_timeout_s: float | None = None
    guided_decoding_backend: str | None = None  # (``grammar_matcher.BACKENDS``; None: none)
