"""Token sampling on the device, as tensor operations over the whole batch: no loop over the
requests and no host sync, so the same code runs eagerly and inside a CUDA graph.

Each row has its own temperature (0: greedy), top-k (0: all), top-p (1: all) and seed. A row's
random numbers are a counter-based hash of ``(seed, counter, lane)``: the request's seed, its
sampling step (``LlmRequest.num_sampling_steps``) times ``COUNTER_STRIDE`` plus the position within
the step, and a lane per use (the target's token, the acceptance test, each draft). So a seeded
request draws the same tokens whatever else is in its batch, eagerly or replayed from a graph,
and no number is ever used twice::

    u = splitmix64(seed * A + counter * B + lane * C) >> 11, / 2**53        in [0, 1)

A token is drawn by inverse transform: the first index whose cumulative probability passes
``u`` (one random number per draw, whatever the vocabulary).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
from tensorrt_llm._torch.pyexecutor.nucleus import LANE_STRIDE, nucleus_kernel_sample, nucleus_torch
from tensorrt_llm._torch.pyexecutor.nucleus import ROUNDS as NUCLEUS_ROUNDS

COUNTER_STRIDE = 64  # positions per sampling step (1 + drafts), at most
LANE_TOKEN, LANE_ACCEPT, LANE_RESIDUAL, LANE_DRAFT = 0, 1, 2, 3  # drafts: LANE_DRAFT + k

_MASK64 = (1 << 64) - 1


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


_A, _B, _C = (_signed(0x9E3779B97F4A7C15), _signed(0xD1B54A32D192ED03), _signed(0x8CB92BA72F3D8DD7))
_M1, _M2 = _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's ``>>`` is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def uniform(seed: torch.Tensor, counter: torch.Tensor, lane: int | torch.Tensor) -> torch.Tensor:
    """``[...]`` float32 in [0, 1) from int64 ``seed`` and ``counter`` (broadcast) and ``lane``."""
    if isinstance(lane, int):  # a scalar operand: no host-to-device copy (CUDA graph capture)
        lane_term = _signed(lane * (_C & _MASK64) & _MASK64)
    else:
        lane_term = lane.to(torch.long) * _C
    x = seed * _A + counter * _B + lane_term  # int64, wrapping
    x = (x ^ _shift_right(x, 30)) * _M1
    x = (x ^ _shift_right(x, 27)) * _M2
    x = x ^ _shift_right(x, 31)
    return (_shift_right(x, 40).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


@dataclass
class SamplingTensors:
    """One row per sequence of a batch, on the device."""

    temperature: torch.Tensor  # [N] float32; 0: greedy
    top_k: torch.Tensor  # [N] int64; 0: every token
    top_p: torch.Tensor  # [N] float32; 1: every token
    seed: torch.Tensor  # [N] int64
    counter: torch.Tensor  # [N] int64: num_sampling_steps * COUNTER_STRIDE
    all_greedy: bool  # (host) no row samples: argmax only
    # (host) some row has a top-k: ``sample`` sorts; otherwise it draws by ``nucleus`` rejection
    uses_top_k: bool = True

    def select(self, rows: slice) -> SamplingTensors:
        """These rows only."""
        return SamplingTensors(
            self.temperature[rows],
            self.top_k[rows],
            self.top_p[rows],
            self.seed[rows],
            self.counter[rows],
            self.all_greedy,
            self.uses_top_k,
        )

    def expand(self, repeats: int) -> SamplingTensors:
        """Each row ``repeats`` times (a row per position of its step), counters stepping by 1."""
        step = torch.arange(repeats, device=self.seed.device)
        return SamplingTensors(
            self.temperature.repeat_interleave(repeats),
            self.top_k.repeat_interleave(repeats),
            self.top_p.repeat_interleave(repeats),
            self.seed.repeat_interleave(repeats),
            (self.counter[:, None] + step).flatten(),
            self.all_greedy,
            self.uses_top_k,
        )


def uses_top_k(requests: Sequence[LlmRequest]) -> bool:
    """Whether a sampled request of these has a top-k (its batch's draws sort)."""
    return any(not r.sampling_params.greedy and r.sampling_params.top_k for r in requests)


def filtered_probs(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """``logits [N, V]`` -> the probabilities each row samples from: temperature, then top-k, then
    top-p (the smallest prefix of the sorted tokens whose mass reaches it; the first always stays).
    Greedy rows come out at temperature 1 (their draws are not used)."""
    ordered, order, _, last = _sorted_kept(logits, st)
    rank = torch.arange(logits.shape[-1], device=logits.device)
    probs = ordered.masked_fill(rank[None, :] > last, 0.0)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    return torch.zeros_like(probs).scatter_(-1, order, probs)


def _sorted_kept(
    logits: torch.Tensor, st: SamplingTensors
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's probabilities after temperature and top-k, sorted descending, with their token
    ids, their running sum, and ``[N, 1]`` the last index top-p keeps (a token is kept while the
    mass ranked above it is short of top-p; the first always is)."""
    temperature = torch.where(st.temperature > 0, st.temperature, 1.0)
    # a temperature keeps the order: the logits are sorted as they come (bf16 keys sort faster)
    ordered, order = logits.sort(dim=-1, descending=True)
    scaled = ordered.float() / temperature[:, None]
    rank = torch.arange(scaled.shape[-1], device=scaled.device)
    keep = (st.top_k[:, None] <= 0) | (rank[None, :] < st.top_k[:, None])
    probs = torch.softmax(scaled.masked_fill(~keep, float("-inf")), dim=-1)
    cum = probs.cumsum(dim=-1)  # non-decreasing: the kept tokens are a prefix
    last = (cum[:, :-1] < st.top_p[:, None]).sum(dim=-1, keepdim=True)
    # the top-k mass may sum to just under top-p = 1: the zeros past top-k are never kept
    top_k = torch.where(st.top_k > 0, st.top_k, scaled.shape[-1])[:, None]
    return probs, order, cum, torch.minimum(last, top_k - 1)


def draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``[N]`` tokens, token ``t`` of row ``i`` with probability ``probs[i, t]`` for ``u`` uniform."""
    cdf = probs.cumsum(dim=-1)
    index = torch.searchsorted(cdf, _below(u[:, None], cdf[:, -1:]), right=True).squeeze(-1)
    return index.clamp_(max=probs.shape[-1] - 1)


def _below(u: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """``u * total``, strictly below ``total`` (``u`` near 1 can round up to it): the first
    running sum past it is then a token of nonzero probability."""
    return torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))


def sample(logits: torch.Tensor, st: SamplingTensors, lane: int = LANE_TOKEN) -> torch.Tensor:
    """``logits [N, V]`` -> tokens ``[N]``. Greedy rows take the argmax. A sampled row without a
    top-k draws by rejection against a rising pivot (``nucleus``: no sort; a Triton program per row
    on CUDA); one with a top-k by inverse transform over its kept tokens in sorted order
    (``filtered_probs``' distribution, without spreading it back over the vocabulary): one sort and
    one running sum, for the whole batch when any row has a top-k. Which way a row draws is its
    own, so a seeded request gets the same tokens whatever shares its batch."""
    if st.all_greedy:
        return logits.argmax(dim=-1)
    nucleus = _nucleus_sample(logits, st, lane)  # (greedy rows get their argmax there too)
    if not st.uses_top_k:
        return nucleus
    greedy = logits.argmax(dim=-1)
    _, order, cum, last = _sorted_kept(logits, st)
    total = cum.gather(1, last)
    target = _below(uniform(st.seed, st.counter, lane)[:, None], total)
    index = torch.minimum(torch.searchsorted(cum, target, right=True), last)
    drawn = torch.where(st.top_k > 0, order.gather(1, index).squeeze(-1), nucleus)
    return torch.where(st.temperature > 0, drawn, greedy)


def _nucleus_sample(logits: torch.Tensor, st: SamplingTensors, lane: int) -> torch.Tensor:
    if logits.is_cuda:
        return nucleus_kernel_sample(logits, st.temperature, st.top_p, st.seed, st.counter, lane)
    lanes = lane + torch.arange(NUCLEUS_ROUNDS, device=logits.device) * LANE_STRIDE
    u = uniform(st.seed[:, None], st.counter[:, None], lanes)  # [N, rounds]
    return nucleus_torch(logits, st.temperature, st.top_p, u)
