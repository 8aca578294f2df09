"""EAGLE-3 draft (Llama midlayer, `LlamaForCausalLMEagle3`), exactly as REFERENCE §2.

One draft step for a row at position p (the row pairs the hidden state of position p with the token
at position p + 1 and predicts the token at p + 2):

    h      = fc(concat(aux_0, aux_1, aux_2))      # target aux rows; later steps: the carried h
    x      = concat(input_layernorm(embed(tok)), hidden_norm(h))       # embeddings first, 2H wide
    attn   = o_proj(attention(q(x), k(x), v(x)))  # neox rope at the draft positions, own paged KV
    r      = h + attn
    y      = r + mlp(post_attention_layernorm(r))
    logits = lm_head(norm(y)); carry y (pre-norm)

The lm_head is over the draft vocab; `to_target` maps draft ids with d2t (target = draft + d2t[draft]).
The MLA draft variant (`kind="mla"`, `Eagle3DeepseekV2ForCausalLM`) replaces the attention by an
MLA block (models.kimi's, q_a_proj / kv_a_proj_with_mqa taking the 2H input, interleaved YaRN rope)
over its own one-layer latent cache.

Entry points as for the target (models.kimi): `step(cache, tokens [B, q_len], hidden [B, q_len, W])`
is the device path (no host read, one batched attention launch); `forward(cache, [(slot, tokens,
hidden)], views)` is the ragged list API on top of it.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from models.config import Eagle3Config
from models.kimi import _dense, default_device, rope_scaling_dict
from models.kv_cache import LatentCache, MHACache
from models.layers import MLP, Linear, RMSNorm, act_dtype, check_backend
from models.loader import Checkpoint
from models.step import RopeTable, StepCtx, advance, begin_step, paged_rows, visibility

__all__ = ["Eagle3Draft"]


class Eagle3Draft:
    """The EAGLE-3 midlayer draft with its own paged MHA cache."""

    def __init__(self, ck: Checkpoint, target_embed: Optional[torch.Tensor] = None, target_hidden: Optional[int] = None,
                 backend: str = "torch", dtype: torch.dtype = torch.float32, device: Optional[str | torch.device] = None):
        cfg = ck.config
        if not isinstance(cfg, Eagle3Config):
            raise TypeError(f"Eagle3Draft needs a draft checkpoint, got {type(cfg).__name__}")
        if cfg.kind not in ("mha", "mla"):
            raise NotImplementedError(f"EAGLE-3 draft kind {cfg.kind!r} ({cfg.architecture}) is not implemented")
        self.cfg, self.backend, self.dtype = cfg, check_backend(backend), dtype
        self.device = dev = torch.device(device) if device is not None else default_device()
        self.adt = act_dtype(backend, dtype)
        eps = cfg.rms_norm_eps
        L = lambda n: Linear(n, ck[n + ".weight"], backend, dtype, dev)  # noqa: E731
        N = lambda n: RMSNorm(ck[n + ".weight"], eps, backend, dtype, dev)  # noqa: E731
        emb = ck.get("embed_tokens.weight")
        if emb is None:
            if target_embed is None:
                raise KeyError("draft has no 'embed_tokens.weight': pass the target's embedding")
            emb = target_embed
        self.embed = _dense(emb).to(self.adt).to(dev)
        self.fc = L("fc")
        self.target_hidden = target_hidden or cfg.target_hidden_size
        m = "midlayer."
        self.hidden_norm, self.input_norm, self.post_norm = N(m + "hidden_norm"), N(m + "input_layernorm"), \
            N(m + "post_attention_layernorm")
        a = m + "self_attn."
        if cfg.kind == "mla":
            from models.kimi import _MLA

            self.mla = _MLA(ck, 0, cfg, backend, dtype, prefix=a, device=dev)
        else:
            self.q, self.k, self.v, self.o = L(a + "q_proj"), L(a + "k_proj"), L(a + "v_proj"), L(a + "o_proj")
        self.mlp = MLP(L(m + "mlp.gate_proj"), L(m + "mlp.up_proj"), L(m + "mlp.down_proj"), backend=backend)
        self.norm = N("norm")
        self.lm_head = L("lm_head")
        d2t = ck.get("d2t")
        self.d2t = None if d2t is None else d2t.long().to(dev)
        if self.d2t is not None and self.d2t.shape != (cfg.draft_vocab_size,):
            raise ValueError(f"tensor 'd2t' must be [{cfg.draft_vocab_size}], got {tuple(self.d2t.shape)}")
        self.rope_scaling = rope_scaling_dict(cfg.rope_scaling)
        rdim = cfg.qk_rope_head_dim if cfg.kind == "mla" else cfg.head_dim
        self.rope = RopeTable(rdim, cfg.rope_theta, self.rope_scaling, dev)

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocab ids -> target ids (d2t offsets; identity for a full-vocab draft)."""
        return draft_ids if self.d2t is None else draft_ids + self.d2t[draft_ids]

    def new_cache(self, batch: int, max_tokens: int, page_size: int = 16):
        """MHACache (Llama midlayer) or a one-layer LatentCache (MLA midlayer), on the draft's device."""
        c = self.cfg
        if c.kind == "mla":
            cache = LatentCache.for_tokens(1, batch, max_tokens, page_size, c.kv_lora_rank + c.qk_rope_head_dim,
                                           self.adt, self.device)
        else:
            cache = MHACache.for_tokens(1, batch, max_tokens, page_size, c.num_key_value_heads, c.head_dim, self.adt,
                                        self.device)
        self.rope.ensure(cache.table.capacity)
        return cache

    def step(self, cache, tokens: torch.Tensor, hidden: torch.Tensor, seqs: Optional[torch.Tensor] = None,
             positions: Optional[torch.Tensor] = None, window: Optional[torch.Tensor] = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [B, q_len] (device, long), hidden [B, q_len, 3*H_target] aux rows or [B, q_len, H] carried
        states: append B*q_len rows at each slot's length (which grows by q_len on the device).
        Returns (float32 draft-vocab logits [B, q_len, Vd], pre-norm carry y [B, q_len, H]).

        positions [B, q_len] (tree drafting): explicit rope positions; window bool [B, q_len, TW]: row r
        sees every cached row before the last TW and those of the last TW marked in window[r] (the new
        rows are the last q_len). No device->host read happens here."""
        c = self.cfg
        B, QL = tokens.shape
        hid = hidden.reshape(B * QL, hidden.shape[-1])
        if hid.shape[-1] == 3 * self.target_hidden:
            h = self.fc(hid.to(self.adt)).to(self.adt)
        elif hid.shape[-1] == c.hidden_size:
            h = hid.to(self.adt)
        else:
            raise ValueError(f"draft forward: hidden width {hid.shape[-1]} is neither 3 x target hidden "
                             f"({3 * self.target_hidden}) nor the draft hidden ({c.hidden_size})")
        # both norms write their half of the attention's input row [norm(embedding) | norm(hidden)]
        H = c.hidden_size
        x = torch.empty(B * QL, 2 * H, dtype=self.adt if self.backend == "triton" else self.input_norm.dtype,
                        device=h.device)
        ctx, cos, sin, _, _ = begin_step(cache.table, tokens, self.rope, self.embed, self.backend, seqs,
                                         positions=positions, window=window, norm=self.input_norm, x_out=x[:, :H])
        self.hidden_norm(h, out=x[:, H:])
        if c.kind == "mla":
            attn_out = self.mla(x, cos, sin, cache, 0, ctx)
        else:
            attn_out = self._mha(x, cos, sin, cache, ctx)
        advance(cache.table, ctx)
        xn, r = self.post_norm.add_norm(attn_out, h)             # the residual adds fused into the norms
        yn, y = self.norm.add_norm(self.mlp(xn), r)
        logits = self.lm_head(yn).float()
        return logits.view(B, QL, -1), y.view(B, QL, -1)

    def _mha(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: MHACache, ctx: StepCtx) -> torch.Tensor:
        from ops.rope import apply_rope, rope_ref

        c = self.cfg
        T = x.shape[0]
        nh, kvh, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        q = self.q(x).view(T, nh, hd)
        k = self.k(x).view(T, kvh, hd)
        v = self.v(x).view(T, kvh, hd)
        if self.backend == "torch":
            q, k = rope_ref(q, cos, sin, "neox"), rope_ref(k, cos, sin, "neox")
        else:
            q = apply_rope(q.contiguous(), cos, sin, "neox", backend="triton")
            k = apply_rope(k.contiguous(), cos, sin, "neox", backend="triton")
        att = self._attend(q, k, v, cache, ctx)
        return self.o(att.reshape(T, nh * hd))

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: MHACache, ctx: StepCtx) -> torch.Tensor:
        """Append the new K/V rows at ctx.slots, then one batched paged attention over all B sequences."""
        c = self.cfg
        B, QL = ctx.B, ctx.QL
        nh, hd = c.num_attention_heads, c.head_dim
        scale = hd ** -0.5
        kc, vc = cache.k[0], cache.v[0]
        if self.backend == "torch":
            ps = kc.shape[1]
            kc[ctx.slots // ps, ctx.slots % ps] = k.to(kc.dtype)
            vc[ctx.slots // ps, ctx.slots % ps] = v.to(vc.dtype)
            g = nh // c.num_key_value_heads
            K = paged_rows(kc, ctx.bt).to(self.dtype).repeat_interleave(g, 2)     # [B, S, nh, hd]
            V = paged_rows(vc, ctx.bt).to(self.dtype).repeat_interleave(g, 2)
            s = torch.einsum("bqhd,bshd->bqhs", q.view(B, QL, nh, hd).to(self.dtype), K) * scale
            vis = visibility(ctx, K.shape[1])
            s = s.masked_fill(~vis[:, :, None, :], float("-inf"))
            o = torch.einsum("bqhs,bshd->bqhd", s.softmax(-1), V)
            return o.reshape(B * QL, nh, hd).to(q.dtype)
        from ops.mha import append_kv, paged_mha_decode
        from ops.mla import MAX_Q_LEN

        if ctx.window is not None and QL > MAX_Q_LEN:
            raise NotImplementedError(f"triton MHA: {QL} tree rows per sequence > the decode kernel's q_len limit "
                                      f"{MAX_Q_LEN}")
        append_kv(kc, vc, k.to(kc.dtype).contiguous(), v.to(vc.dtype).contiguous(), ctx.slots)
        tm = None if ctx.window is None else ctx.window.to(torch.int8).contiguous()
        qb = q.to(torch.bfloat16).view(B, QL, nh, hd)
        outs = []
        for j in range(0, QL, MAX_Q_LEN):       # prefill: causal chunks of the kernel's q_len limit (QL is static)
            e = min(QL, j + MAX_Q_LEN)
            sl = ctx.seq_lens if e == QL else ctx.seq_lens - (QL - e)
            outs.append(paged_mha_decode(qb[:, j:e].contiguous(), kc, vc, ctx.bt, sl, scale,
                                         backend="triton", tree_mask=tm))
        o = outs[0] if len(outs) == 1 else torch.cat(outs, 1)
        return o.reshape(B * QL, nh, hd).to(q.dtype)

    def forward(self, cache, batch: Sequence[tuple[int, Sequence[int], torch.Tensor]],
                views: Optional[Sequence[Optional[tuple]]] = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Ragged list API. For each (slot, tokens [n], hidden [n, 3*H_target] aux rows or [n, H] carried
        states): append n rows at the slot's next positions. Returns per entry (float32 draft-vocab logits
        [n, Vd], pre-norm carry y [n, H]).

        views[i] (tree drafting, optional): (positions [n], visible bool [n, len_b + n]): explicit rope
        positions and which cached rows (incl. the new ones) each new row attends to."""
        dev = self.device
        lens = list(cache.table.lengths)
        cap = cache.table.capacity
        chunk = 1 << 30                     # the triton attention chunks a long prefill inside the step
        prep = []          # (slot, tokens, hidden [n, W], positions or None, window [n, TW] or None)
        for i, (b, t, hid) in enumerate(batch):
            t = [int(x) for x in t]
            if hid.shape[0] != len(t):
                raise ValueError(f"draft forward: {len(t)} tokens but {hid.shape[0]} hidden rows (slot {b})")
            cache.table._check(b)
            start = lens[b]
            cache.table.reserve(b, start + len(t))
            vw = views[i] if views is not None else None
            pos = win = None
            if vw is not None:
                vis = vw[1].bool().cpu()
                n = len(t)
                if tuple(vis.shape) != (n, start + n):
                    raise ValueError(f"draft forward: view of slot {b} must be [{n}, {start + n}], got {tuple(vis.shape)}")
                hidden_cols = (~vis).any(0).nonzero()           # window: from the first column a row cannot see
                wb = min(start, int(hidden_cols[0])) if hidden_cols.numel() else start
                pos, win = [int(p) for p in vw[0]], vis[:, wb:]
            prep.append((b, t, hid, pos, win))
        # one step per group of entries with the same length and window width (tree steps of one depth)
        # chains right-padded to the longest (a padding row follows its sequence's real rows, so causal
        # attention never shows it to them; lengths are set to the real ones afterwards)
        groups: dict[tuple, list[int]] = {}
        repeated = len({p[0] for p in prep}) < len(prep)         # a slot twice: keep the call order, one by one
        P = max([len(p[1]) for p in prep if p[4] is None] or [0])
        pad_ok = all(lens[p[0]] + P <= cap for p in prep if p[4] is None)
        for i, (b, t, hid, pos, win) in enumerate(prep):
            n = len(t) if (win is not None or not pad_ok) else -1
            key = (n, None if win is None else win.shape[1], hid.shape[-1]) + ((i,) if repeated else ())
            groups.setdefault(key, []).append(i)
        res: list = [None] * len(prep)
        for (n, tw, *_), idx in groups.items():
            for part in _distinct_slots(idx, [prep[i][0] for i in idx]):
                seqs = torch.tensor([prep[i][0] for i in part], dtype=torch.long, device=dev)
                width = max(len(prep[i][1]) for i in part)
                if repeated:
                    lens = list(cache.table.lengths)
                for i in part:
                    cache.table.reserve(prep[i][0], lens[prep[i][0]] + width)
                toks = torch.tensor([prep[i][1] + [0] * (width - len(prep[i][1])) for i in part], dtype=torch.long,
                                    device=dev)
                hid = torch.stack([torch.cat([prep[i][2].to(dev), prep[i][2].new_zeros(width - len(prep[i][1]),
                                                                                         prep[i][2].shape[-1]).to(dev)])
                                   for i in part])
                if tw is not None:
                    pos = torch.tensor([prep[i][3] for i in part], dtype=torch.long, device=dev)
                    win = torch.stack([prep[i][4] for i in part]).to(dev)
                    lg, y = self.step(cache, toks, hid, seqs, pos, win)
                else:
                    outs = [self.step(cache, toks[:, j:j + chunk], hid[:, j:j + chunk], seqs)
                            for j in range(0, toks.shape[1], chunk)]
                    lg, y = torch.cat([o[0] for o in outs], 1), torch.cat([o[1] for o in outs], 1)
                    if any(len(prep[i][1]) < toks.shape[1] for i in part):
                        cache.table.lens[seqs] = torch.tensor([lens[prep[i][0]] + len(prep[i][1]) for i in part],
                                                              dtype=torch.int32, device=dev)
                for r, i in enumerate(part):
                    k = len(prep[i][1])
                    res[i] = (lg[r, :k], y[r, :k])
        return res


def _distinct_slots(idx: list[int], slots: list[int]) -> list[list[int]]:
    """Split idx (in order) so that no part holds one cache slot twice."""
    parts: list[list[int]] = [[]]
    seen: set = set()
    for i, b in zip(idx, slots):
        if b in seen:
            parts.append([])
            seen = set()
        parts[-1].append(i)
        seen.add(b)
    return parts
