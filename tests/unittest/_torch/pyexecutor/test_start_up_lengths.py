"""The start-up warm-up's prompt lengths: Triton compiles a kernel per tile size and per integer
class (a multiple of 16 or not), so a first request after start-up compiles nothing only if every
tile class the step can take was run in both integer classes. Checked on the rule's own terms:
the power-of-two classes of a prompt, and the MoE's row-block classes (``moe_tiles``)."""

import pytest

from tensorrt_llm._torch.modules.fused_moe.ops import moe_tiles, tile_limits
from tensorrt_llm._torch.pyexecutor.warm_up import LONGEST, kv_room, prompt_lengths


def test_every_tile_class_is_run_in_both_integer_classes():
    experts, top_k = 8, 2  # the bundled model's MoE
    limits = tile_limits(experts, top_k)
    lengths = prompt_lengths(8192, limits)

    def block_m(tokens: int) -> int:
        return moe_tiles(tokens * top_k, experts, 2, False).block_m

    assert [block_m(n) for n in (limits[0], limits[0] + 1, limits[1], limits[1] + 1)] == [
        16,
        32,
        32,
        64,
    ]  # the limits are where the row blocks change
    seen = {(block_m(n), n % 16 == 0) for n in lengths}
    assert seen == {(m, aligned) for m in (16, 32, 64) for aligned in (True, False)}
    prompt_classes = {(n - 1).bit_length() for n in lengths if 16 < n <= LONGEST}
    for k in prompt_classes:  # (2**(k-1), 2**k]: a multiple of 16 and one that is not
        inside = [n for n in lengths if 2 ** (k - 1) < n <= 2**k]
        assert {n % 16 == 0 for n in inside} == {True, False}, inside
    # the published model's MoE (128 experts, top 8): its limits are run too
    assert {256, 257, 768, 769} <= set(prompt_lengths(8192, tile_limits(128, 8)))


def test_lengths_stay_within_a_steps_room():
    assert max(prompt_lengths(100, tile_limits(8, 2))) == 100
    assert min(prompt_lengths(100, [])) == 1


class _Cache:
    """A stand-in executor whose KV cache holds prompts up to ``longest`` tokens."""

    def __init__(self, longest: int) -> None:
        self.longest = longest

    def check_request(self, request) -> None:
        if request.prompt_len > self.longest:
            raise ValueError(f"request {request.request_id} needs more KV slots than the cache has")


@pytest.mark.parametrize("longest", [1, 2, 300, 1023, 1024, 5000])
def test_warm_up_prompts_fit_the_kv_cache(longest):
    # (a cache sized for a few requests: its warm-up once asked for prompts it could not hold)
    assert kv_room(_Cache(longest), 1024) == min(longest, 1024)


def test_a_cache_without_room_for_one_token_is_named():
    with pytest.raises(RuntimeError, match="KV cache"):
        kv_room(_Cache(0), 1024)
