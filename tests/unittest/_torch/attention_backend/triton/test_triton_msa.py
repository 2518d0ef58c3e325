"""The MSA Triton kernels against the torch reference (``sparse/minimax_m3/msa.py``) on awkward
batches: mixed context chunks (cached prefixes included) and 1 + 3 token generation steps, lengths 1
to 1000+, GQA ratios 1 and 4, MSA key blocks larger and smaller than the cache's pages.

The indexer inputs are multiples of 1/2 and ``index_head_dim`` is a square, so every index score is
exact in fp32 whatever the order of the sums: block scores and block selections are compared
exactly, ties (frequent with such inputs) included. Attention outputs are compared with a tolerance.
"""

import math
from dataclasses import dataclass

import pytest
import torch

pytest.importorskip("triton.language")

from tensorrt_llm._torch.attention_backend.interface import AttentionMetadata  # noqa: E402
from tensorrt_llm._torch.attention_backend.reference import gather_paged, write_paged  # noqa: E402
from tensorrt_llm._torch.attention_backend.sparse.minimax_m3.cache_manager import (  # noqa: E402
    MiniMaxM3KVCacheManagerV2,
)
from tensorrt_llm._torch.attention_backend.sparse.minimax_m3.msa import (  # noqa: E402
    MsaConfig,
    MsaInputs,
    index_scores,
    msa_paged_attention,
    select_blocks,
)
from tensorrt_llm._torch.attention_backend.sparse.minimax_m3.triton_msa import (  # noqa: E402
    MsaSelection,
    PagedBatch,
    attention_tile_tokens,
    msa_block_scores,
    msa_select_blocks,
    msa_sparse_attention,
    triton_msa_paged_attention,
)
from tensorrt_llm._torch.pyexecutor.config import (  # noqa: E402
    KvCacheLayer,
    KVCacheManagerV2Config,
    KvCacheOptions,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
LAYER = 1  # layer 0 is dense, layer 1 sparse (has index-K)


@dataclass(frozen=True)
class Case:
    num_heads: int
    num_kv_heads: int
    msa: MsaConfig
    tokens_per_block: int
    head_dim: int = 8
    dtype: torch.dtype = torch.float32


SMALL = MsaConfig(index_n_heads=2, index_head_dim=16, topk_blocks=2, block_size=8)
# [(num_cached_tokens, num_new_tokens)] per sequence: 8 context chunks (4 of them after a cached
# prefix), then 9 generation steps of 1 + 3 query tokens.
MIXED_17 = [(0, 1), (0, 97), (0, 33), (0, 8), (40, 57), (13, 3), (64, 1), (5, 16)]
MIXED_17 += [(p, 4) for p in (1, 5, 8, 9, 31, 64, 96, 97, 123)]


def make_manager(case: Case, max_seq_len: int, num_seqs: int) -> MiniMaxM3KVCacheManagerV2:
    heads = (case.num_kv_heads, case.head_dim)
    dtype = str(case.dtype).removeprefix("torch.")
    config = KVCacheManagerV2Config(
        layers=(KvCacheLayer(*heads), KvCacheLayer(*heads, index_head_dim=case.msa.index_head_dim)),
        max_seq_len=max_seq_len,
        max_batch_size=num_seqs,
        options=KvCacheOptions(case.tokens_per_block, dtype, max_seq_len * num_seqs),
        device=str(DEVICE),
    )
    return MiniMaxM3KVCacheManagerV2(config)


def halves(shape, g, scale=2.0):
    """Random multiples of 1/2 (exact in bf16 and fp32; their products sum exactly)."""
    return (torch.randn(shape, generator=g) * scale).round() / 2


def random_tokens(n: int, case: Case, g: torch.Generator) -> dict[str, torch.Tensor]:
    msa, h, hkv, d = case.msa, case.num_heads, case.num_kv_heads, case.head_dim
    x = {
        "q": torch.randn(n, h, d, generator=g),
        "k": torch.randn(n, hkv, d, generator=g),
        "v": torch.randn(n, hkv, d, generator=g),
        "index_q": halves((n, msa.index_n_heads, msa.index_head_dim), g),
        "index_w": halves((n, msa.index_n_heads), g),
        "index_k": halves((n, 1, msa.index_head_dim), g),
    }
    return {name: t.to(DEVICE, case.dtype) for name, t in x.items()}


@dataclass
class Step:
    """One batch step after its sequences' cached prefixes were written."""

    case: Case
    manager: MiniMaxM3KVCacheManagerV2
    metadata: AttentionMetadata
    x: dict[str, torch.Tensor]

    @property
    def msa_inputs(self) -> MsaInputs:
        return MsaInputs(self.x["index_q"], self.x["index_w"], self.x["index_k"])

    def run(self, op) -> torch.Tensor:
        scale = 1 / math.sqrt(self.case.head_dim)
        args = (self.x["q"], self.x["k"], self.x["v"], self.msa_inputs)
        return op(LAYER, *args, self.metadata, self.case.msa, scale)


def make_step(case: Case, specs: list[tuple[int, int]], num_contexts: int, seed: int) -> Step:
    """Sequences ``specs = [(num_cached, num_new)]``: the cached prefixes are written with random
    K, V and index-K, then the step of the new tokens is returned (contexts first)."""
    g = torch.Generator().manual_seed(seed)
    max_len = max(c + n for c, n in specs)
    manager = make_manager(case, max_seq_len=max_len, num_seqs=len(specs))
    for rid, (cached, new) in enumerate(specs):
        manager.add_sequence(rid, [rid * 100_000 + i for i in range(cached + new)])
        assert manager.resize_sequence(rid, cached + new)
    prefixed = [rid for rid, (cached, _) in enumerate(specs) if cached]
    if prefixed:
        lens = [specs[rid][0] for rid in prefixed]
        md = AttentionMetadata(manager, prefixed, lens, [0] * len(lens), len(lens), DEVICE)
        prefix = random_tokens(sum(lens), case, g)
        pool = manager.layer_pool_index(LAYER)
        for pages, lane, name in (
            (manager.get_kv_pages(LAYER)[0], 0, "k"),
            (manager.get_kv_pages(LAYER)[1], 1, "v"),
            (manager.get_index_k_pages(LAYER), 0, "index_k"),
        ):
            write_paged(pages, md, pool, lane, prefix[name])
    rids = list(range(len(specs)))
    md = AttentionMetadata(
        manager, rids, [n for _, n in specs], [c for c, _ in specs], num_contexts, DEVICE
    )
    return Step(case, manager, md, random_tokens(md.num_tokens, case, g))


def select(step: Step):
    """The launchers' block scores and selection for the step (its K, V, index-K written)."""
    md, msa, x = step.metadata, step.case.msa, step.x
    batch = PagedBatch.from_metadata(md, step.manager.layer_pool_index(LAYER))
    ik_pages = step.manager.get_index_k_pages(LAYER)
    scores = msa_block_scores(x["index_q"], x["index_w"], ik_pages, batch, msa.block_size)
    group = step.case.num_heads // step.case.num_kv_heads
    tile_tokens = attention_tile_tokens(batch.max_q_len, group)
    return scores, msa_select_blocks(scores, batch, msa, tile_tokens)


def check_selection(step: Step) -> MsaSelection:
    """Block scores and selected blocks of every token equal the reference's, exactly; each query
    tile lists the union of its tokens' blocks. Returns the checked selection."""
    md, msa, x = step.metadata, step.case.msa, step.x
    pool = step.manager.layer_pool_index(LAYER)
    ik_pages = step.manager.get_index_k_pages(LAYER)
    scores, selection = select(step)  # [num_tokens, num_key_blocks] each
    bs, tile = msa.block_size, selection.tile_tokens
    for seq in range(md.num_seqs):
        span, pos = md.seq_token_slice(seq), md.position_ids[md.seq_token_slice(seq)]
        ik_all = gather_paged(ik_pages, md, pool, 0, seq)[:, 0]  # [kv_len, Di]
        token_scores = index_scores(x["index_q"][span], x["index_w"][span], ik_all)  # [n, L]
        num_blocks = -(-ik_all.shape[0] // bs)
        want_sel = select_blocks(token_scores, pos, msa)  # [n, num_blocks]
        assert torch.equal(selection.mask[span, :num_blocks], want_sel), f"sequence {seq}"
        assert not selection.mask[span, num_blocks:].any()
        padded = torch.full((len(pos), num_blocks * bs), float("-inf"), device=DEVICE)
        padded[:, : ik_all.shape[0]] = token_scores
        keys = torch.arange(num_blocks * bs, device=DEVICE)
        padded = padded.masked_fill(keys[None, :] > pos[:, None], float("-inf"))
        want_scores = padded.view(len(pos), num_blocks, bs).amax(dim=-1)
        assert torch.equal(scores[span, :num_blocks], want_scores), f"sequence {seq}"
        assert (scores[span, num_blocks:] == float("-inf")).all()
        for t, begin in enumerate(range(span.start, span.stop, tile)):
            tile_id = seq + span.start // tile + t
            union = selection.mask[begin : min(begin + tile, span.stop)].any(dim=0)
            count = int(selection.tile_counts[tile_id])
            assert selection.tile_blocks[tile_id, :count].tolist() == union.nonzero()[:, 0].tolist()
    return selection


def check_outputs(step: Step, tol: float = 1e-4) -> None:
    want = step.run(msa_paged_attention)  # writes K, V, index-K; the op writes the same values
    got = step.run(triton_msa_paged_attention)
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (4, 1)], ids=["gqa1", "gqa4"])
def test_a_mixed_batch_of_17_matches_the_reference(num_heads, num_kv_heads):
    case = Case(num_heads, num_kv_heads, SMALL, tokens_per_block=4)
    step = make_step(case, MIXED_17, num_contexts=8, seed=num_heads)
    check_outputs(step)
    check_selection(step)


@pytest.mark.parametrize(
    "block_size,tokens_per_block", [(4, 8), (8, 8), (12, 4)], ids=["block<page", "equal", "3pages"]
)
def test_key_blocks_and_pages_may_have_any_sizes(block_size, tokens_per_block):
    msa = MsaConfig(index_n_heads=3, index_head_dim=4, topk_blocks=3, block_size=block_size)
    case = Case(6, 2, msa, tokens_per_block, head_dim=20)
    step = make_step(case, [(0, 61), (11, 30), (45, 4), (70, 4)], num_contexts=2, seed=block_size)
    check_outputs(step)
    check_selection(step)


def test_a_long_chunked_prefill_and_a_long_generation_step_match_the_reference():
    msa = MsaConfig(index_n_heads=2, index_head_dim=4, topk_blocks=3, block_size=64)
    case = Case(4, 1, msa, tokens_per_block=16, head_dim=4)
    # a 1000-token chunk after 37 cached tokens (17 key blocks, 5 selected), and a verify step
    step = make_step(case, [(37, 1000), (1100, 4)], num_contexts=1, seed=11)
    want = step.run(msa_paged_attention)  # also writes the step's K, V, index-K
    selection = check_selection(step)  # layer by layer: the interpreter runs each kernel once
    k_pages, v_pages = step.manager.get_kv_pages(LAYER)
    batch = PagedBatch.from_metadata(step.metadata, step.manager.layer_pool_index(LAYER))
    got = msa_sparse_attention(step.x["q"], k_pages, v_pages, selection, batch, 64, 0.5)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("num_splits", [1, 2, 3, 7])
def test_split_blocks_give_the_unsplit_output(num_splits):
    # splits over each tile's selected blocks: more splits than a tile has blocks leaves some
    # empty; decode rows (one token) and a context chunk alike
    msa = MsaConfig(index_n_heads=2, index_head_dim=4, topk_blocks=3, block_size=8)
    case = Case(4, 1, msa, tokens_per_block=4, head_dim=8)
    step = make_step(case, [(0, 20), (45, 1), (97, 4), (3, 1)], num_contexts=1, seed=num_splits)
    want = step.run(msa_paged_attention)
    _, selection = select(step)
    k_pages, v_pages = step.manager.get_kv_pages(LAYER)
    batch = PagedBatch.from_metadata(step.metadata, step.manager.layer_pool_index(LAYER))
    q, scale = step.x["q"], 1 / math.sqrt(case.head_dim)
    got = msa_sparse_attention(q, k_pages, v_pages, selection, batch, 8, scale, num_splits)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="num_splits=0"):
        msa_sparse_attention(q, k_pages, v_pages, selection, batch, 8, scale, 0)


def test_tied_scores_go_to_the_earlier_block():
    msa = MsaConfig(index_n_heads=1, index_head_dim=4, topk_blocks=2, block_size=8)
    case = Case(2, 2, msa, tokens_per_block=4)
    step = make_step(case, [(0, 40), (36, 4)], num_contexts=1, seed=5)
    step.manager.get_index_k_pages(LAYER).fill_(1.0)  # the cached prefix of sequence 1 too
    for name in ("index_q", "index_k", "index_w"):
        step.x[name].fill_(1.0)  # every visible key, hence every block, scores the same
    step.run(triton_msa_paged_attention)  # writes index-K
    mask = select(step)[1].mask.cpu()
    blocks = [row.nonzero()[:, 0].tolist() for row in mask]  # selected blocks per token
    # position 39 of sequence 0 (block 4): blocks 0 and 1 win the tie, its own block is local
    assert blocks[39] == [0, 1, 4]
    assert blocks[9] == [0, 1]  # block 1: one earlier block to choose from
    assert blocks[0] == [0]
    assert blocks[40:] == [[0, 1, 4]] * 4  # the verify tokens at positions 36..39
    check_selection(step)


def test_ties_among_many_equal_block_maxima_match_the_reference():
    msa = MsaConfig(index_n_heads=2, index_head_dim=4, topk_blocks=3, block_size=4)
    case = Case(2, 1, msa, tokens_per_block=4)
    step = make_step(case, [(0, 50), (30, 4)], num_contexts=1, seed=9)
    g = torch.Generator().manual_seed(0)
    for name in ("index_q", "index_k", "index_w"):  # values in {0, 1}: many equal maxima
        step.x[name].copy_(torch.randint(0, 2, step.x[name].shape, generator=g))
    check_outputs(step)
    check_selection(step)


def test_bad_shapes_are_errors_naming_the_values():
    case = Case(3, 2, SMALL, tokens_per_block=4)
    step = make_step(case, [(0, 5)], num_contexts=1, seed=0)
    with pytest.raises(ValueError, match="num_heads=3 must be a multiple of num_kv_heads=2"):
        step.run(triton_msa_paged_attention)
    step.x["q"] = step.x["q"][:, None]
    with pytest.raises(ValueError, match=r"q of shape \(5, 1, 3, 8\)"):
        step.run(triton_msa_paged_attention)


def test_a_bf16_cache_matches_the_reference():
    case = Case(4, 2, SMALL, tokens_per_block=4, head_dim=16, dtype=torch.bfloat16)
    step = make_step(case, [(0, 40), (30, 4)], num_contexts=1, seed=1)
    check_outputs(step, tol=2e-2)
    check_selection(step)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_bf16_on_the_gpu_matches_the_reference():
    msa = MsaConfig(index_n_heads=4, index_head_dim=64, topk_blocks=4, block_size=128)
    case = Case(8, 2, msa, tokens_per_block=128, head_dim=128, dtype=torch.bfloat16)
    specs = [(0, 1500), (300, 700), (0, 1)] + [(p, 4) for p in (1, 127, 128, 1000, 2500)]
    step = make_step(case, specs, num_contexts=3, seed=1)
    check_outputs(step, tol=2e-2)
    check_selection(step)


def test_a_step_without_tokens_returns_an_empty_output():
    case = Case(4, 2, SMALL, tokens_per_block=4)
    step = make_step(case, [(0, 3)], num_contexts=1, seed=0)
    md = AttentionMetadata(step.manager, [], [], [], 0, DEVICE)
    empty = {name: t[:0] for name, t in step.x.items()}
    msa = MsaInputs(empty["index_q"], empty["index_w"], empty["index_k"])
    out = triton_msa_paged_attention(LAYER, empty["q"], empty["k"], empty["v"], msa, md, SMALL, 1.0)
    assert out.shape == (0, 4, 8)
