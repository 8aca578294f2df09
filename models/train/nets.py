"""Trainable torch modules with the inference classes' math (models.kimi, models.eagle3).

`TargetNet` is the DeepSeek-V3 / Kimi-K2.5 text model: MLA with q_lora and the latent KV (attention in
the non-absorbed form, which is the same function as the absorbed decode of models.kimi), interleaved
YaRN rope on the rope dims, layer 0 a dense SwiGLU MLP, later layers MoE with noaux_tc sigmoid routing
(top-k on scores + e_score_correction_bias, combine with the unbiased scores normalised and scaled by
routed_scaling_factor) plus a shared expert. The correction bias is not a parameter: it is moved after
each step towards equal expert load (DeepSeek-V3's auxiliary-loss-free balancing).

`DraftNet` is the EAGLE-3 Llama midlayer (fc over the three aux states, concat(embed, h), neox rope,
GQA, own lm_head), with `unroll`: the training-time test, k draft steps where step j > 1 runs on
the step j-1 outputs and attends to the real rows before it plus its own earlier speculative rows.

Every size comes from the parsed checkpoint config (models.config), so a trained net exports to exactly
what the loader expects (models.train.export).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from models.config import DeepseekV3Config, Eagle3Config
from models.kimi import rope_scaling_dict
from ops.rope import cos_sin

__all__ = ["TargetNet", "DraftNet", "fake_quant_int4", "rope_tables"]


def fake_quant_int4(w: torch.Tensor, group: int = 32) -> torch.Tensor:
    """Symmetric INT4 group quantization as exported (scale = absmax/7 rounded to bf16, q in [-8, 7]),
    dequantized; the straight-through gradient passes w's."""
    n, k = w.shape[-2:]
    g = w.detach().reshape(*w.shape[:-1], k // group, group)
    scale = (g.abs().amax(-1, keepdim=True) / 7.0).clamp_min(1e-8).to(torch.bfloat16).float()
    q = (g / scale).round().clamp(-8, 7)
    deq = (q * scale).reshape(w.shape)
    return w + (deq - w).detach()


def quant_int4(w: torch.Tensor, group: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [n, k] in [-8, 7], scale bf16 [n, k // group]) with fake_quant_int4's rounding."""
    n, k = w.shape
    g = w.detach().float().reshape(n, k // group, group)
    scale = (g.abs().amax(-1, keepdim=True) / 7.0).clamp_min(1e-8).to(torch.bfloat16)
    q = (g / scale.float()).round().clamp(-8, 7).to(torch.int8).reshape(n, k)
    return q, scale[..., 0]


def rope_tables(n: int, dim: int, theta: float, scaling) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [n, dim/2] for positions 0..n-1 (ops.rope.cos_sin: the inference tables)."""
    return cos_sin(torch.arange(n), dim, theta, rope_scaling_dict(scaling))


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str) -> torch.Tensor:
    """x [..., S, heads, R] rotated with cos/sin [S, R/2] (ops.rope.rope_ref's math, batched)."""
    c, s = cos[:, None, :], sin[:, None, :]
    if style == "neox":
        r2 = x.shape[-1] // 2
        x0, x1 = x[..., :r2], x[..., r2:]
        return torch.cat([x0 * c - x1 * s, x1 * c + x0 * s], -1)
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x0 * c - x1 * s, x1 * c + x0 * s], -1).flatten(-2)


class RMSNorm(nn.Module):
    def __init__(self, n: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class SwiGLU(nn.Module):
    def __init__(self, h: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(h, inter, bias=False)
        self.up_proj = nn.Linear(h, inter, bias=False)
        self.down_proj = nn.Linear(inter, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MLA(nn.Module):
    def __init__(self, c: DeepseekV3Config):
        super().__init__()
        self.c = c
        H, nh = c.hidden_size, c.num_attention_heads
        self.q_a_proj = nn.Linear(H, c.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(c.q_lora_rank, c.rms_norm_eps)
        self.q_b_proj = nn.Linear(c.q_lora_rank, nh * c.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(H, c.kv_lora_rank + c.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, c.rms_norm_eps)
        self.kv_b_proj = nn.Linear(c.kv_lora_rank, nh * (c.qk_nope_head_dim + c.v_head_dim), bias=False)
        self.o_proj = nn.Linear(nh * c.v_head_dim, H, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: Optional[list] = None) -> torch.Tensor:
        """x [B, S, H] at positions cos/sin rows; cache: [k, v] of earlier positions (extended in place)."""
        c = self.c
        B, S, _ = x.shape
        nh, nope, r, C = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.kv_lora_rank
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(B, S, nh, nope + r)
        kv = self.kv_a_proj_with_mqa(x)
        lat = self.kv_a_layernorm(kv[..., :C])
        k_pe = _rope(kv[..., C:].view(B, S, 1, r), cos, sin, "interleaved")
        q = torch.cat([q[..., :nope], _rope(q[..., nope:], cos, sin, "interleaved")], -1)
        kvb = self.kv_b_proj(lat).view(B, S, nh, nope + c.v_head_dim)
        k = torch.cat([kvb[..., :nope], k_pe.expand(B, S, nh, r)], -1)
        v = kvb[..., nope:]
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if cache is not None:
            if cache:
                k, v = torch.cat([cache[0], k], 2), torch.cat([cache[1], v], 2)
            cache[:] = [k, v]
        T = k.shape[2]
        if S == 1:
            o = F.scaled_dot_product_attention(q, k, v, scale=c.softmax_scale)
        elif T == S:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=c.softmax_scale)
        else:
            mask = torch.arange(T)[None, :] <= (T - S + torch.arange(S))[:, None]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=c.softmax_scale)
        return self.o_proj(o.transpose(1, 2).reshape(B, S, nh * c.v_head_dim))


class MoE(nn.Module):
    def __init__(self, c: DeepseekV3Config):
        super().__init__()
        self.c = c
        E, M, H = c.n_routed_experts, c.moe_intermediate_size, c.hidden_size
        self.gate = nn.Linear(H, E, bias=False)
        self.register_buffer("e_score_correction_bias", torch.zeros(E))
        self.w1 = nn.Parameter(torch.empty(E, M, H))     # experts.e.gate_proj
        self.w3 = nn.Parameter(torch.empty(E, M, H))     # experts.e.up_proj
        self.w2 = nn.Parameter(torch.empty(E, H, M))     # experts.e.down_proj
        for w, fan_in in ((self.w1, H), (self.w3, H), (self.w2, M)):
            nn.init.normal_(w, std=fan_in ** -0.5)
        self.shared_experts = SwiGLU(H, M * c.n_shared_experts)
        self.quant_group: int = 0                      # > 0: experts run fake-quantized (QAT / export view)
        self.load = torch.zeros(E)                     # tokens routed per expert since the last balance step

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.c
        scores = (x.float() @ self.gate.weight.float().T).sigmoid()
        ids = (scores.detach() + self.e_score_correction_bias).topk(c.num_experts_per_tok, -1).indices
        w = scores.gather(1, ids)
        if c.norm_topk_prob:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return ids, w * c.routed_scaling_factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        ids, w = self.route(x)
        if self.training:
            self.load += torch.bincount(ids.flatten(), minlength=self.c.n_routed_experts).float()
        q = self.quant_group
        w1, w3, w2 = ((fake_quant_int4(t, q) for t in (self.w1, self.w3, self.w2)) if q
                      else (self.w1, self.w3, self.w2))
        out = torch.zeros_like(x)
        flat = ids.flatten()
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.c.n_routed_experts).tolist()
        tok_all = order // ids.shape[1]
        wsel = w.flatten()[order]
        start = 0
        for e, n in enumerate(counts):
            if n:
                tok = tok_all[start:start + n]
                xe = x[tok]
                h = F.silu(xe @ w1[e].T) * (xe @ w3[e].T)
                out = out.index_add(0, tok, (h @ w2[e].T) * wsel[start:start + n, None])
            start += n
        return (out + self.shared_experts(x)).reshape(shape)

    @torch.no_grad()
    def balance(self, rate: float) -> None:
        """Move the correction bias towards equal load: +rate for under-loaded experts, -rate for over."""
        if self.load.sum() > 0:
            self.e_score_correction_bias += rate * torch.sign(self.load.mean() - self.load)
        self.load.zero_()


class Block(nn.Module):
    def __init__(self, c: DeepseekV3Config, i: int):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = MLA(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MoE(c) if c.is_moe_layer(i) else SwiGLU(c.hidden_size, c.intermediate_size)

    def forward(self, h, cos, sin, cache=None):
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class TargetNet(nn.Module):
    """The Kimi-K2.5 text model (module docstring); `forward` returns logits and the aux states."""

    def __init__(self, c: DeepseekV3Config, capture_ids: tuple[int, ...] = (), max_len: int = 4096):
        super().__init__()
        self.c, self.capture_ids = c, tuple(capture_ids)
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        nn.init.normal_(self.embed_tokens.weight, std=1.0)
        self.layers = nn.ModuleList(Block(c, i) for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        cos, sin = rope_tables(max_len, c.qk_rope_head_dim, c.rope_theta, c.rope_scaling)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def moes(self) -> list[MoE]:
        return [b.mlp for b in self.layers if isinstance(b.mlp, MoE)]

    def forward(self, ids: torch.Tensor, pos0: int = 0, cache: Optional[list] = None
                ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """ids [B, S] at positions pos0.. -> (logits [B, S, V], aux [B, S, len(capture_ids) * H] or None).
        cache: a list (one [k, v] per layer, filled on first use) for incremental decoding."""
        S = ids.shape[1]
        cos, sin = self.cos[pos0:pos0 + S], self.sin[pos0:pos0 + S]
        h = self.embed_tokens(ids)
        if cache is not None and not cache:
            cache.extend([] for _ in self.layers)
        caps = {}
        for i, blk in enumerate(self.layers):
            if i in self.capture_ids:
                caps[i] = h
            h = blk(h, cos, sin, None if cache is None else cache[i])
        if len(self.layers) in self.capture_ids:
            caps[len(self.layers)] = h
        aux = torch.cat([caps[i] for i in self.capture_ids], -1) if self.capture_ids else None
        return self.lm_head(self.norm(h)), aux

    @torch.no_grad()
    def greedy(self, ids: torch.Tensor, new: int) -> torch.Tensor:
        """Greedy continuation of equal-length prompts [B, P] by `new` tokens (KV-cached): [B, P + new]."""
        cache: list = []
        logits, _ = self(ids, 0, cache)
        out = [ids, logits[:, -1:].argmax(-1)]
        pos = ids.shape[1]
        for _ in range(new - 1):
            logits, _ = self(out[-1], pos, cache)
            pos += 1
            out.append(logits[:, -1:].argmax(-1))
        return torch.cat(out, 1)


class DraftNet(nn.Module):
    """EAGLE-3 Llama midlayer draft (models.eagle3 math) with the training-time-test unroll."""

    def __init__(self, c: Eagle3Config, embed: torch.Tensor, max_len: int = 4096):
        super().__init__()
        self.c = c
        H, nh, kvh, hd = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.embed_tokens = nn.Embedding.from_pretrained(embed.clone(), freeze=True)
        self.fc = nn.Linear(3 * c.target_hidden_size, H, bias=False)
        self.hidden_norm = RMSNorm(H, c.rms_norm_eps)
        self.input_layernorm = RMSNorm(H, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(H, c.rms_norm_eps)
        self.q_proj = nn.Linear(2 * H, nh * hd, bias=False)
        self.k_proj = nn.Linear(2 * H, kvh * hd, bias=False)
        self.v_proj = nn.Linear(2 * H, kvh * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, H, bias=False)
        self.mlp = SwiGLU(H, c.intermediate_size)
        self.norm = RMSNorm(H, c.rms_norm_eps)
        self.lm_head = nn.Linear(H, c.draft_vocab_size, bias=False)
        cos, sin = rope_tables(max_len, hd, c.rope_theta, c.rope_scaling)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def _qkv(self, tok: torch.Tensor, h: torch.Tensor):
        c = self.c
        B, S = tok.shape
        x = torch.cat([self.input_layernorm(self.embed_tokens(tok)), self.hidden_norm(h)], -1)
        cos, sin = self.cos[:S], self.sin[:S]
        q = _rope(self.q_proj(x).view(B, S, c.num_attention_heads, c.head_dim), cos, sin, "neox")
        k = _rope(self.k_proj(x).view(B, S, c.num_key_value_heads, c.head_dim), cos, sin, "neox")
        v = self.v_proj(x).view(B, S, c.num_key_value_heads, c.head_dim)
        g = c.num_attention_heads // c.num_key_value_heads
        return (q.transpose(1, 2), k.repeat_interleave(g, 2).transpose(1, 2), v.repeat_interleave(g, 2).transpose(1, 2))

    def _finish(self, h: torch.Tensor, att: torch.Tensor) -> torch.Tensor:
        B, nh, S, hd = att.shape
        r = h + self.o_proj(att.transpose(1, 2).reshape(B, S, nh * hd))
        return r + self.mlp(self.post_attention_layernorm(r))

    def head(self, y: torch.Tensor) -> torch.Tensor:
        """Draft-vocab logits of pre-norm states."""
        return self.lm_head(self.norm(y))

    def unroll(self, tok: torch.Tensor, aux: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Training-time test over rows p = 0..S-1 (row p: the token at p + 1 and the state of p, at rope
        position p). Step 1 runs on fc(aux); step j > 1 on step j-1's output of row p - 1 and attends
        to the step-1 rows <= p - j + 1 and to the step-i rows p - j + i (i = 2..j): what the chain draft
        sees at inference. Returns each step's pre-norm states [B, S, H] (logits: `head`; rows p < j - 1
        are meaningless)."""
        h = self.fc(aux)
        scale = self.c.head_dim ** -0.5
        ks, vs, out = [], [], []
        S = tok.shape[1]
        for j in range(1, steps + 1):
            q, k, v = self._qkv(tok, h)
            ks.append(k)
            vs.append(v)
            s1 = torch.einsum("bhqd,bhkd->bhqk", q, ks[0]) * scale
            vis = torch.arange(S)[None, :] <= (torch.arange(S) - (j - 1))[:, None]
            s1 = s1.masked_fill(~vis, float("-inf"))
            diag = [(q * _shift(ks[i - 1], j - i)).sum(-1, keepdim=True) * scale for i in range(2, j + 1)]
            p = torch.cat([s1] + diag, -1).softmax(-1)
            att = p[..., :S] @ vs[0]
            for n, i in enumerate(range(2, j + 1)):
                att = att + p[..., S + n:S + n + 1] * _shift(vs[i - 1], j - i)
            y = self._finish(h, att)
            out.append(y)
            h = _shift(y, 1)
        return out


def _shift(t: torch.Tensor, n: int) -> torch.Tensor:
    """t[..., p, :] <- t[..., p - n, :] along the sequence dim (-2), zeros in front."""
    if n == 0:
        return t
    pad = torch.zeros_like(t[..., :n, :])
    return torch.cat([pad, t[..., :-n, :]], -2)
