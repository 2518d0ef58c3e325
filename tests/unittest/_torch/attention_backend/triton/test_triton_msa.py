"""The MSA Triton kernels against the torch reference (``sparse/minimax_m3/msa.py``) on awkward
batches: mixed context chunks (cached prefixes included) and 1 + 3 token generation steps, lengths 1
to 1000+, GQA ratios 1 and 4, several KV groups (one index head each, selecting on its own), MSA key
blocks larger and smaller than the cache's pages, 0 to 2 forced local blocks, top-k above the number
of blocks.

The indexer inputs are multiples of 1/2, so every index score (a raw dot product) is exact in fp32
whatever the order of the sums: block scores and block selections are compared exactly, ties
(frequent with such inputs) included. Attention outputs are compared with a tolerance.
"""

import math
from dataclasses import dataclass

import pytest
import torch

pytest.importorskip("triton.language")

from tensorrt_llm._torch.attention_backend.interface import AttentionMetadata  # noqa: E402
from tensorrt_llm._torch.attention_backend.reference import (  # noqa: E402
    gather_paged,
    paged_attention,
    write_paged,
)
from tensorrt_llm._torch.attention_backend.sparse.minimax_m3.cache_manager import (  # noqa: E402
    MiniMaxM3KVCacheManagerV2,
)
from tensorrt_llm._torch.attention_backend.sparse.minimax_m3.msa import (  # noqa: E402
    MsaConfig,
    MsaInputs,
    index_block_scores,
    msa_paged_attention,
    select_blocks,
    write_msa_step,
)
from tensorrt_llm._torch.attention_backend.sparse.minimax_m3.triton_msa import (  # noqa: E402
    MsaSelection,
    PagedBatch,
    attention_tile_tokens,
    msa_block_scores,
    msa_select_blocks,
    msa_sparse_attention,
    triton_msa_attend,
)
from tensorrt_llm._torch.pyexecutor.config import (  # noqa: E402
    KvCacheLayer,
    KVCacheManagerV2Config,
    KvCacheOptions,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def triton_msa(layer_idx, q, k, v, msa, metadata, cfg, scale):
    """``msa_paged_attention``'s signature on Triton: the step's writes, then ``triton_msa_attend``."""
    write_msa_step(layer_idx, k, v, msa.index_k, metadata)
    return triton_msa_attend(layer_idx, q, msa, metadata, cfg, scale)


LAYER = 1  # layer 0 is dense, layer 1 sparse (has index-K)


def msa_config(
    num_kv_heads: int, block_size: int, topk: int, local: int = 1, index_dim: int = 16
) -> MsaConfig:
    """One index head per KV group, as in MiniMax-M3."""
    return MsaConfig(num_kv_heads, index_dim, block_size, topk, local)


@dataclass(frozen=True)
class Case:
    num_heads: int
    num_kv_heads: int
    msa: MsaConfig
    tokens_per_block: int
    head_dim: int = 8
    dtype: torch.dtype = torch.float32


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
    h, hkv, d, di = case.num_heads, case.num_kv_heads, case.head_dim, case.msa.index_head_dim
    x = {
        "q": torch.randn(n, h, d, generator=g),
        "k": torch.randn(n, hkv, d, generator=g),
        "v": torch.randn(n, hkv, d, generator=g),
        "index_q": halves((n, hkv, di), g),  # one index head per KV group
        "index_k": halves((n, 1, di), g),
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
        return MsaInputs(self.x["index_q"], self.x["index_k"])

    @property
    def scale(self) -> float:
        return 1 / math.sqrt(self.case.head_dim)

    def run(self, op) -> torch.Tensor:
        args = (self.x["q"], self.x["k"], self.x["v"], self.msa_inputs)
        return op(LAYER, *args, self.metadata, self.case.msa, self.scale)

    @property
    def batch(self) -> PagedBatch:
        return PagedBatch.from_metadata(self.metadata, self.manager.layer_pool_index(LAYER))

    def attend(self, selection: MsaSelection, num_splits: int = 1) -> torch.Tensor:
        """``msa_sparse_attention`` of the step's queries with ``selection`` (K, V written)."""
        k_pages, v_pages = self.manager.get_kv_pages(LAYER)
        bs = self.case.msa.block_size
        args = (selection, self.batch, bs, self.scale, num_splits)
        return msa_sparse_attention(self.x["q"], k_pages, v_pages, *args)


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


def select(step: Step) -> tuple[torch.Tensor, MsaSelection]:
    """The launchers' block scores ``[num_tokens, Hkv, num_key_blocks]`` and selection for the
    step (its K, V, index-K written), with the query tiles ``msa_sparse_attention`` visits."""
    batch, msa = step.batch, step.case.msa
    ik_pages = step.manager.get_index_k_pages(LAYER)
    scores = msa_block_scores(step.x["index_q"], ik_pages, batch, msa.block_size)
    group = step.case.num_heads // step.case.num_kv_heads
    tile_tokens = attention_tile_tokens(batch.max_q_len, group)
    return scores, msa_select_blocks(scores, batch, msa, tile_tokens)


def check_selection(step: Step) -> MsaSelection:
    """Block scores and selected blocks of every token and KV group equal the reference's,
    exactly; each query tile lists, per group, the union of its tokens' blocks. Returns the
    checked selection."""
    md, msa = step.metadata, step.case.msa
    pool = step.manager.layer_pool_index(LAYER)
    ik_pages = step.manager.get_index_k_pages(LAYER)
    scores, selection = select(step)
    num_key_blocks = -(-md.max_kv_len // msa.block_size)
    shape = (md.num_tokens, step.case.num_kv_heads, num_key_blocks)
    assert scores.shape == shape and selection.mask.shape == shape
    tile = selection.tile_tokens
    for seq in range(md.num_seqs):
        span = md.seq_token_slice(seq)
        pos = md.position_ids[span]
        ik_all = gather_paged(ik_pages, md, pool, 0, seq)[:, 0]  # [kv_len, Di]
        want_scores = index_block_scores(step.x["index_q"][span], ik_all, pos, msa.block_size)
        nb = want_scores.shape[-1]  # the sequence's blocks; the batch's later ones score -inf
        assert torch.equal(scores[span, :, :nb], want_scores), f"sequence {seq}"
        assert (scores[span, :, nb:] == float("-inf")).all()
        want_sel = select_blocks(want_scores, pos, msa)  # [n, Hkv, nb]
        assert torch.equal(selection.mask[span, :, :nb], want_sel), f"sequence {seq}"
        assert not selection.mask[span, :, nb:].any()
        for t, begin in enumerate(range(span.start, span.stop, tile)):
            tile_id = seq + span.start // tile + t
            union = selection.mask[begin : min(begin + tile, span.stop)].any(dim=0)  # [Hkv, nkb]
            for g, blocks in enumerate(union):
                count = int(selection.tile_counts[tile_id, g])
                got = selection.tile_blocks[tile_id, g, :count].tolist()
                assert got == blocks.nonzero()[:, 0].tolist(), f"sequence {seq} tile {t} group {g}"
    return selection


def check_outputs(step: Step, tol: float = 1e-4) -> torch.Tensor:
    """The public op equals the reference op (both write the same K, V, index-K first)."""
    want = step.run(msa_paged_attention)
    got = step.run(triton_msa)
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    return want


def blocks_of(mask: torch.Tensor) -> list[list[list[int]]]:
    """A selection mask ``[n, G, num_blocks]`` as the selected block ids per token and group."""
    return [[row.nonzero()[:, 0].tolist() for row in token] for token in mask.cpu()]


@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (4, 1)], ids=["gqa1", "gqa4"])
def test_a_mixed_batch_of_17_matches_the_reference(num_heads, num_kv_heads):
    case = Case(num_heads, num_kv_heads, msa_config(num_kv_heads, 8, topk=3), tokens_per_block=4)
    step = make_step(case, MIXED_17, num_contexts=8, seed=num_heads)
    check_outputs(step)
    check_selection(step)


@pytest.mark.parametrize(
    "block_size,tokens_per_block", [(4, 8), (8, 8), (12, 4)], ids=["block<page", "equal", "3pages"]
)
def test_key_blocks_and_pages_may_have_any_sizes(block_size, tokens_per_block):
    msa = msa_config(2, block_size, topk=4, local=2, index_dim=4)
    case = Case(6, 2, msa, tokens_per_block, head_dim=20)
    step = make_step(case, [(0, 61), (11, 30), (45, 4), (70, 4)], num_contexts=2, seed=block_size)
    check_outputs(step)
    check_selection(step)


@pytest.mark.parametrize("local", [0, 1, 2])
def test_forced_local_blocks_count_among_the_topk(local):
    msa = msa_config(2, 4, topk=3, local=local, index_dim=4)
    case = Case(4, 2, msa, tokens_per_block=8)
    step = make_step(case, [(0, 37), (20, 4), (2, 1)], num_contexts=1, seed=local)
    check_outputs(step)
    mask = check_selection(step).mask
    q_block = (step.metadata.position_ids // 4).tolist()
    for t, per_group in enumerate(blocks_of(mask)):
        forced = set(range(max(0, q_block[t] - local + 1), q_block[t] + 1))
        for blocks in per_group:
            assert forced <= set(blocks) and max(blocks) <= q_block[t]
            assert len(blocks) == min(3, q_block[t] + 1)  # k in all, the forced ones included


def test_a_topk_above_the_number_of_blocks_selects_everything_and_is_dense():
    msa = msa_config(2, 8, topk=20, local=2, index_dim=4)
    case = Case(4, 2, msa, tokens_per_block=4)
    step = make_step(case, [(0, 50), (90, 4), (7, 1)], num_contexts=1, seed=3)
    want = check_outputs(step)
    mask = check_selection(step).mask
    visible = torch.arange(mask.shape[-1]) <= (step.metadata.position_ids // 8)[:, None].cpu()
    assert torch.equal(mask.cpu(), visible[:, None, :].expand_as(mask))
    dense = paged_attention(LAYER, step.x["q"], step.x["k"], step.x["v"], step.metadata, step.scale)
    torch.testing.assert_close(want, dense, rtol=1e-5, atol=1e-5)


def test_a_long_chunked_prefill_and_a_long_generation_step_match_the_reference():
    msa = msa_config(1, 64, topk=4, local=2, index_dim=4)
    case = Case(4, 1, msa, tokens_per_block=16, head_dim=4)
    # a 1000-token chunk after 37 cached tokens (17 key blocks, 4 selected), and a verify step
    step = make_step(case, [(37, 1000), (1100, 4)], num_contexts=1, seed=11)
    want = step.run(msa_paged_attention)  # also writes the step's K, V, index-K
    selection = check_selection(step)  # layer by layer: the interpreter runs each kernel once
    torch.testing.assert_close(step.attend(selection), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("num_splits", [1, 2, 3, 7])
def test_split_blocks_give_the_unsplit_output(num_splits):
    # splits over each tile's selected blocks: more splits than a tile has blocks leaves some
    # empty; decode rows (one token) and a context chunk alike
    msa = msa_config(2, 8, topk=3, index_dim=4)
    case = Case(4, 2, msa, tokens_per_block=4, head_dim=8)
    step = make_step(case, [(0, 20), (45, 1), (97, 4), (3, 1)], num_contexts=1, seed=num_splits)
    want = step.run(msa_paged_attention)
    _, selection = select(step)
    torch.testing.assert_close(step.attend(selection, num_splits), want, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="num_splits=0"):
        step.attend(selection, 0)


def test_each_kv_group_attends_its_own_selection():
    # index-K of key j is e_(block(j) % 3): index head g (q = e_g) scores 1 on the blocks b with
    # b % 3 == g and 0 elsewhere, so the three groups pick disjoint blocks beyond the forced one
    msa = msa_config(3, 8, topk=3, local=1, index_dim=4)
    case = Case(6, 3, msa, tokens_per_block=4)
    step = make_step(case, [(0, 70), (60, 4)], num_contexts=1, seed=2)
    eye = torch.eye(4, device=DEVICE)
    ik_pages = step.manager.get_index_k_pages(LAYER)
    md, pool = step.metadata, step.manager.layer_pool_index(LAYER)
    for seq in range(md.num_seqs):  # every index-K, sequence 1's cached prefix included
        kv_len = int(md.kv_lens_cpu[seq])
        table = md.kv_cache_block_offsets[pool, seq, 0].long()
        keys = torch.arange(kv_len)
        ik_pages[table[keys // 4], keys % 4, 0] = eye[(keys // 8) % 3].to(ik_pages.dtype)
    step.x["index_q"].copy_(eye[:3].expand_as(step.x["index_q"]))
    step.x["index_k"].copy_(eye[(md.position_ids // 8) % 3][:, None])
    mask = check_selection(step).mask
    last = blocks_of(mask)[69]  # position 69, block 8: forced 8, then the group's best two
    assert last == [[0, 3, 8], [1, 4, 8], [2, 5, 8]]
    want = check_outputs(step)
    # the control: every group attending group 0's selection differs from the reference
    _, selection = select(step)
    for name in ("mask", "tile_blocks", "tile_counts"):
        t = getattr(selection, name)
        t.copy_(t[:, :1].expand_as(t).clone())
    wrong = step.attend(selection)
    assert not torch.allclose(wrong[:, 2:], want[:, 2:], rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(wrong[:, :2], want[:, :2], rtol=1e-4, atol=1e-4)  # group 0's heads


@pytest.mark.parametrize("local", [0, 1])
def test_tied_scores_go_to_the_earlier_block(local):
    msa = msa_config(2, 8, topk=3, local=local, index_dim=4)
    case = Case(2, 2, msa, tokens_per_block=4)
    step = make_step(case, [(0, 40), (36, 4)], num_contexts=1, seed=5)
    step.manager.get_index_k_pages(LAYER).fill_(1.0)  # the cached prefix of sequence 1 too
    for name in ("index_q", "index_k"):
        step.x[name].fill_(1.0)  # every visible key, hence every block, scores the same
    step.run(triton_msa)  # writes index-K
    per_group = blocks_of(select(step)[1].mask)
    assert all(groups[0] == groups[1] for groups in per_group)  # equal index heads
    blocks = [groups[0] for groups in per_group]
    # position 39 of sequence 0 (block 4): its own block forced, then blocks 0 and 1 win the tie
    own = [[0, 1, 4]] if local else [[0, 1, 2]]
    assert blocks[39] == own[0]
    assert blocks[9] == [0, 1]  # block 1: two blocks to choose from
    assert blocks[0] == [0]
    assert blocks[40:] == own * 4  # the verify tokens at positions 36..39
    check_selection(step)


def test_ties_among_many_equal_block_maxima_match_the_reference():
    msa = msa_config(2, 4, topk=3, local=1, index_dim=4)
    case = Case(4, 2, msa, tokens_per_block=4)
    step = make_step(case, [(0, 50), (30, 4)], num_contexts=1, seed=9)
    g = torch.Generator().manual_seed(0)
    for name in ("index_q", "index_k"):  # values in {0, 1}: many equal maxima
        step.x[name].copy_(torch.randint(0, 2, step.x[name].shape, generator=g))
    check_outputs(step)
    check_selection(step)


def test_bad_shapes_are_errors_naming_the_values():
    case = Case(3, 2, msa_config(2, 8, topk=3), tokens_per_block=4)
    step = make_step(case, [(0, 5)], num_contexts=1, seed=0)
    with pytest.raises(ValueError, match="num_heads=3 must be a multiple of num_kv_heads=2"):
        step.run(triton_msa)
    step.x["q"] = step.x["q"][:, None]
    with pytest.raises(ValueError, match=r"q of shape \(5, 1, 3, 8\)"):
        step.run(triton_msa)
    step.x["q"] = step.x["q"][:, 0, :2]  # 2 heads for 2 KV heads, but one index head
    step.x["index_q"] = step.x["index_q"][:, :1]
    with pytest.raises(
        ValueError, match=r"index_q of shape \(5, 1, 16\): expected \[num_tokens, 2"
    ):
        step.run(triton_msa)
    with pytest.raises(ValueError, match=r"index_q of shape \(5, 1, 16\)"):
        triton_msa_attend(LAYER, step.x["q"], step.msa_inputs, step.metadata, case.msa, 1.0)


def test_a_bf16_cache_matches_the_reference():
    msa = msa_config(2, 8, topk=3)
    case = Case(4, 2, msa, tokens_per_block=4, head_dim=16, dtype=torch.bfloat16)
    step = make_step(case, [(0, 40), (30, 4)], num_contexts=1, seed=1)
    check_outputs(step, tol=2e-2)
    check_selection(step)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_bf16_on_the_gpu_matches_the_reference():
    # M3's geometry (GQA 16, 128-dim heads and index heads, 128-token key blocks), fewer KV heads
    msa = msa_config(2, 128, topk=6, local=2, index_dim=128)
    case = Case(32, 2, msa, tokens_per_block=128, head_dim=128, dtype=torch.bfloat16)
    specs = [(0, 1500), (300, 700), (0, 1)] + [(p, 4) for p in (1, 127, 128, 1000, 2500)]
    step = make_step(case, specs, num_contexts=3, seed=1)
    check_outputs(step, tol=2e-2)
    check_selection(step)


def test_a_step_without_tokens_returns_an_empty_output():
    msa = msa_config(2, 8, topk=3)
    case = Case(4, 2, msa, tokens_per_block=4)
    step = make_step(case, [(0, 3)], num_contexts=1, seed=0)
    md = AttentionMetadata(step.manager, [], [], [], 0, DEVICE)
    empty = {name: t[:0] for name, t in step.x.items()}
    inputs = MsaInputs(empty["index_q"], empty["index_k"])
    out = triton_msa(LAYER, empty["q"], empty["k"], empty["v"], inputs, md, msa, 1.0)
    assert out.shape == (0, 4, 8)
