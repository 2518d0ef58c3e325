"""The plain-PyTorch decoder ``bench_decode.py`` measures the engine's step against (its
``reference`` row): what a decode step costs with nothing around it.

It has the benchmark target's shapes (``bench_common.bench_target_config``): the vocabulary, the
embedding and the LM head, and per layer an RMSNorm, the fused QKV projection (64 query heads, 4
KV heads of 128), RoPE on the first ``partial_rotary_factor`` of each head, attention, the output
projection, an RMSNorm and a dense SwiGLU MLP of ``dense_intermediate_size``. It does not have the
sparse layers' indexer, nor the MoE: its row is for the all-dense variant (``--mlp dense``), whose
sparse layers the engine still runs through the indexer (with a 1024-token prompt and top-16
blocks of 128, every block is chosen, so the attention itself is the same).

The KV cache is static (``[layers, batch, kv_heads, max_len, head_dim]``), written at the step's
position and read whole under a mask by ``scaled_dot_product_attention``, as a static-cache
decoder does. The greedy next token and the position are fed back on the device, so on CUDA the
whole step is one CUDA graph, replayed back to back. Weights are random; the cache holds random
values for the prompt (the step's cost does not depend on them)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tensorrt_llm._torch.models.configuration_minimaxm3 import MiniMaxM3Config


class ReferenceDecoder:
    def __init__(
        self,
        config: MiniMaxM3Config,
        batch: int,
        prompt_len: int,
        max_len: int,
        device: str,
        dtype: torch.dtype,
        seed: int = 0,
    ) -> None:
        torch.manual_seed(seed)
        c = config
        self.heads, self.kv_heads, self.head_dim = (
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
        )
        hidden, inter = c.hidden_size, c.dense_intermediate_size
        qkv = (self.heads + 2 * self.kv_heads) * self.head_dim
        self.eps = c.rms_norm_eps

        def weight(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, device=device, dtype=dtype) * shape[-1] ** -0.5

        def ones() -> torch.Tensor:
            return torch.ones(hidden, device=device, dtype=dtype)

        self.layers = [
            (ones(), weight(qkv, hidden), weight(hidden, self.heads * self.head_dim), ones())
            + (weight(2 * inter, hidden), weight(hidden, inter))
            for _ in range(c.num_hidden_layers)
        ]
        self.embed, self.lm_head = weight(c.vocab_size, hidden), weight(c.vocab_size, hidden)
        self.final_norm = ones()
        rotary = int(self.head_dim * c.partial_rotary_factor)
        self.inv_freq = c.rope_theta ** -(
            torch.arange(0, rotary, 2, device=device, dtype=torch.float32) / rotary
        )
        shape = (c.num_hidden_layers, batch, self.kv_heads, max_len, self.head_dim)
        self.k = torch.randn(shape, device=device, dtype=dtype)
        self.v = torch.randn(shape, device=device, dtype=dtype)
        self.slots = torch.arange(max_len, device=device)
        self.prompt_len = prompt_len
        self.position = torch.full((1,), prompt_len, device=device, dtype=torch.long)
        self.tokens = torch.zeros(batch, device=device, dtype=torch.long)
        self.graph: torch.cuda.CUDAGraph | None = None

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(
            x.dtype
        ) * weight

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rotary = 2 * cos.shape[-1]
        rot, rest = x[..., :rotary].float(), x[..., rotary:]
        a, b = rot.chunk(2, dim=-1)
        turned = torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1).to(x.dtype)
        return torch.cat([turned, rest], dim=-1)

    def _step(self) -> None:
        """One greedy decode step of the whole batch; the next token and position stay here."""
        batch = self.tokens.shape[0]
        x = self.embed[self.tokens]
        angles = self.position.float()[:, None] * self.inv_freq  # [1, rotary / 2]
        cos, sin = angles.cos(), angles.sin()
        mask = (self.slots <= self.position)[None, None, None, :]
        q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        for i, (norm1, qkv_w, o_w, norm2, gate_up_w, down_w) in enumerate(self.layers):
            qkv = self._rms(x, norm1) @ qkv_w.T
            q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
            q = self._rope(q.view(batch, self.heads, 1, self.head_dim), cos, sin)
            k = self._rope(k.view(batch, self.kv_heads, 1, self.head_dim), cos, sin)
            self.k[i].index_copy_(2, self.position, k)
            self.v[i].index_copy_(2, self.position, v.view(batch, self.kv_heads, 1, self.head_dim))
            o = F.scaled_dot_product_attention(
                q, self.k[i], self.v[i], attn_mask=mask, enable_gqa=True
            )
            x = x + o.reshape(batch, q_size) @ o_w.T
            gate, up = (self._rms(x, norm2) @ gate_up_w.T).chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ down_w.T
        logits = self._rms(x, self.final_norm) @ self.lm_head.T
        self.tokens.copy_(logits.argmax(-1))
        self.position.add_(1)

    def prepare(self) -> None:
        """Compile and (on CUDA) capture the step; the position goes back to the prompt's end."""
        if self.tokens.device.type == "cuda":
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(3):
                    self._step()
            torch.cuda.current_stream().wait_stream(stream)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self._step()
        else:
            self._step()
        self.position.fill_(self.prompt_len)

    def step(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            self._step()
