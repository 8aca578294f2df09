"""Training and evaluation loops of the tiny pair (deterministic for a seed and a thread count).

Target: AdamW on random windows of the tokenized training files (a seeded torch.Generator picks them),
warmup then cosine decay, the MoE correction bias balanced after every step, the last `qat_frac` of the
steps with the experts fake-quantized to INT4 group 32 (straight-through), so what ships is what was
trained. Held-out loss and perplexity are reported in float32 and as the checkpoint computes them
(BF16 weights, INT4 experts).

Draft: data = the target's own greedy continuations (KV-cached) of prompts cut from the training text;
per batch the target (as exported) gives the aux states and its distribution, and the draft is trained
with the training-time test (`DraftNet.unroll`, k steps) on the soft cross-entropy to the target's next-
token distribution. The simulated chain acceptance on held-out continuations is what the engine's greedy
chain would accept (the rows there are the target's own tokens).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from models.train.export import (CAPTURE_IDS, DRAFT_SIZES, TARGET_SIZES, draft_config, export_draft, export_target,
                                 export_view, parse, target_config, weights_hash)
from models.train.nets import DraftNet, TargetNet

__all__ = ["TargetRun", "DraftRun", "train_target", "train_draft", "heldout_loss", "windows", "lr_at"]


@dataclass
class TargetRun:
    seed: int = 0
    steps: int = 240
    batch: int = 16
    seq: int = 256
    lr: float = 4e-3
    warmup: int = 20
    weight_decay: float = 0.1
    balance_rate: float = 1e-3
    qat_frac: float = 0.15
    eval_windows: int = 48
    sizes: Optional[dict[str, Any]] = None


@dataclass
class DraftRun:
    seed: int = 0
    steps: int = 400
    batch: int = 16
    ttt_steps: int = 3
    prompt_len: int = 32
    gen_len: int = 64
    sequences: int = 2048
    heldout_sequences: int = 32
    lr: float = 3e-3
    warmup: int = 10
    weight_decay: float = 0.0
    step_weights: tuple[float, ...] = (1.0, 1.0, 0.8)
    sizes: Optional[dict[str, Any]] = None


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warmup, then cosine decay to 10% of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def windows(ids: torch.Tensor, n: int, length: int, gen: torch.Generator) -> torch.Tensor:
    """n random windows [n, length] of the token stream."""
    starts = torch.randint(0, ids.numel() - length, (n,), generator=gen)
    return torch.stack([ids[s:s + length] for s in starts.tolist()])


def eval_windows(ids: torch.Tensor, n: int, length: int) -> torch.Tensor:
    """Up to n consecutive non-overlapping windows from the start of the held-out stream."""
    n = min(n, (ids.numel() - 1) // length)
    return ids[: n * length].view(n, length)


@torch.no_grad()
def heldout_loss(net: TargetNet, wins: torch.Tensor, batch: int = 16) -> float:
    """Mean next-token cross-entropy (nats) over the windows."""
    net.eval()
    tot, cnt = 0.0, 0
    for i in range(0, wins.shape[0], batch):
        w = wins[i:i + batch]
        logits, _ = net(w)
        tot += float(F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1),
                                     reduction="sum"))
        cnt += w[:, 1:].numel()
    return tot / max(cnt, 1)


def _adamw(params, lr: float, wd: float) -> torch.optim.AdamW:
    decay = [p for p in params if p.requires_grad and p.dim() >= 2]
    other = [p for p in params if p.requires_grad and p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": wd}, {"params": other, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95), eps=1e-8)


def train_target(train_ids: torch.Tensor, held_ids: torch.Tensor, vocab: int, bpe: int, out: Optional[Path],
                 run: TargetRun, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Train the target on the token stream; export to `out` (when given). Returns the report."""
    sizes = {**TARGET_SIZES, **(run.sizes or {})}
    cfg = target_config(vocab, bpe, sizes)
    c = parse(cfg)
    torch.manual_seed(run.seed)
    net = TargetNet(c, CAPTURE_IDS, max_len=max(run.seq, 1024))
    gen = torch.Generator().manual_seed(run.seed)
    opt = _adamw(list(net.parameters()), run.lr, run.weight_decay)
    held = eval_windows(held_ids, run.eval_windows, run.seq)
    qat_from = int(run.steps * (1 - run.qat_frac))
    t0 = time.perf_counter()
    first_loss = None
    for step in range(run.steps):
        net.train()
        for m in net.moes():
            m.quant_group = 32 if step >= qat_from else 0
        for g in opt.param_groups:
            g["lr"] = lr_at(step, run.steps, run.lr, run.warmup)
        w = windows(train_ids, run.batch, run.seq + 1, gen)
        logits, _ = net(w[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        for m in net.moes():
            m.balance(run.balance_rate)
        if first_loss is None:
            first_loss = float(loss.detach())
        if step % 10 == 0 or step == run.steps - 1:
            log(f"target step {step}/{run.steps} loss {float(loss.detach()):.4f} lr {opt.param_groups[0]['lr']:.2e} "
                f"({time.perf_counter() - t0:.0f} s)")
    train_s = time.perf_counter() - t0
    for m in net.moes():
        m.quant_group = 0
    net.eval()
    rep: dict[str, Any] = {"steps": run.steps, "tokens_seen": run.steps * run.batch * run.seq, "train_s": train_s,
                           "first_step_loss": first_loss, "heldout_tokens": int(held[:, 1:].numel())}
    lf = heldout_loss(net, held)
    lq = heldout_loss(export_view(net), held)
    rep.update(heldout_loss_float=lf, heldout_ppl_float=math.exp(lf), heldout_loss_int4=lq,
               heldout_ppl_int4=math.exp(lq), weights_sha256=weights_hash(net))
    log(f"held-out loss {lf:.4f} (ppl {math.exp(lf):.2f}) float32; {lq:.4f} (ppl {math.exp(lq):.2f}) as exported "
        f"(bf16, int4 experts)")
    if out is not None:
        export_target(net, cfg, out)
    rep["net"] = net
    rep["config"] = cfg
    return rep


def _prompts(ids: torch.Tensor, n: int, length: int, gen: torch.Generator) -> torch.Tensor:
    return windows(ids, n, length, gen)


@torch.no_grad()
def continuations(target: TargetNet, ids: torch.Tensor, n: int, run: DraftRun, gen: torch.Generator,
                  batch: int = 128) -> torch.Tensor:
    """n sequences [n, prompt_len + gen_len]: prompts from `ids`, continued greedily by the target."""
    out = []
    for i in range(0, n, batch):
        p = _prompts(ids, min(batch, n - i), run.prompt_len, gen)
        out.append(target.greedy(p, run.gen_len))
    return torch.cat(out)


def _draft_losses(draft: DraftNet, target: TargetNet, seqs: torch.Tensor, steps: int, lo: int
                  ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per TTT step, over rows p >= lo (row p: the draft of the token at p + 2): soft cross-entropy to the
    target's distribution [B, S-1-lo] and top-1 agreement with the target's argmax [B, S-1-lo]."""
    with torch.no_grad():
        logits, aux = target(seqs)
        p_t = logits[:, 1 + lo:].float().softmax(-1)
        pred = p_t.argmax(-1)
    ys = draft.unroll(seqs[:, 1:], aux[:, :-1], steps)
    ce, agree = [], []
    for y in ys:
        lg = draft.head(y[:, lo:]).float()
        ce.append(-(p_t * lg.log_softmax(-1)).sum(-1))
        agree.append(lg.argmax(-1) == pred)
    return ce, agree


def simulated_accept(agree: list[torch.Tensor], lo: int) -> tuple[float, list[float]]:
    """Chain acceptance over rows p >= lo: draft j (step j, row p + j - 1) is accepted when it and every
    earlier draft of the chain match the target. Returns (accept length incl. bonus, per-position rate)."""
    k = len(agree)
    S = agree[0].shape[1]
    rows = torch.arange(lo, S - k + 1)
    acc = torch.ones(agree[0].shape[0], rows.numel(), dtype=torch.bool)
    per = []
    for j in range(k):
        acc = acc & agree[j][:, rows + j]
        per.append(float(acc.float().mean()))
    return 1.0 + sum(per), per


def train_draft(target: TargetNet, train_ids: torch.Tensor, held_ids: torch.Tensor, target_cfg: dict[str, Any],
                out: Optional[Path], run: DraftRun, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Train the draft on `target` (already as exported: export_view); export to `out` when given."""
    cfg = draft_config(target_cfg, {**DRAFT_SIZES, **(run.sizes or {})})
    dc = parse(cfg)
    gen = torch.Generator().manual_seed(run.seed)
    t0 = time.perf_counter()
    data = continuations(target, train_ids, run.sequences, run, gen)
    held = continuations(target, held_ids, run.heldout_sequences, run, torch.Generator().manual_seed(run.seed + 1))
    gen_s = time.perf_counter() - t0
    log(f"draft data: {data.shape[0]} train and {held.shape[0]} held-out target continuations of "
        f"{run.prompt_len}+{run.gen_len} tokens ({gen_s:.0f} s)")
    torch.manual_seed(run.seed)
    draft = DraftNet(dc, target.embed_tokens.weight.detach(), max_len=max(1024, data.shape[1]))
    with torch.no_grad():
        # start from the target's features and head: fc passes the last aux state (the target's last
        # layer output) through, the midlayer's residual branches start at zero (o_proj, down_proj),
        # norm + lm_head are the target's
        H = target.c.hidden_size
        if CAPTURE_IDS[-1] == target.c.num_hidden_layers and dc.hidden_size == H:
            draft.fc.weight.zero_()
            draft.fc.weight[:, 2 * H:].copy_(torch.eye(H))
        draft.o_proj.weight.zero_()
        draft.mlp.down_proj.weight.zero_()
        draft.lm_head.weight.copy_(target.lm_head.weight)
        draft.norm.weight.copy_(target.norm.weight)
    opt = _adamw([p for p in draft.parameters() if p.requires_grad], run.lr, run.weight_decay)
    k = run.ttt_steps
    # trained rows: the draft of the token at p + 2 where p + 2 is a continuation token (the rows the
    # chain drafts at inference); every row still feeds the attention
    lo = max(0, run.prompt_len - 2)
    wts = list(run.step_weights[:k]) + [run.step_weights[-1]] * max(0, k - len(run.step_weights))
    t1 = time.perf_counter()
    for step in range(run.steps):
        draft.train()
        for g in opt.param_groups:
            g["lr"] = lr_at(step, run.steps, run.lr, run.warmup)
        idx = torch.randint(0, data.shape[0], (run.batch,), generator=gen)
        ce, agree = _draft_losses(draft, target, data[idx], k, lo)
        loss = sum(w * c.mean() for w, c in zip(wts, ce)) / sum(wts)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        if step % 10 == 0 or step == run.steps - 1:
            acc = " ".join(f"{float(a.float().mean()):.3f}" for a in agree)
            log(f"draft step {step}/{run.steps} loss {float(loss.detach()):.4f} top-1 per step {acc} "
                f"({time.perf_counter() - t1:.0f} s)")
    train_s = time.perf_counter() - t1
    draft.eval()
    view = export_view(draft)
    with torch.no_grad():
        agree_all: list[list[torch.Tensor]] = [[] for _ in range(k)]
        for i in range(0, held.shape[0], 16):
            _, agree = _draft_losses(view, target, held[i:i + 16], k, lo)
            for j in range(k):
                agree_all[j].append(agree[j])
        agree = [torch.cat(a) for a in agree_all]
    al, per = simulated_accept(agree, 0)
    log(f"held-out simulated chain k={k}: accept length {al:.3f}, per-position {' '.join(f'{x:.3f}' for x in per)}")
    if out is not None:
        export_draft(draft, cfg, out)
    return {"steps": run.steps, "sequences": run.sequences, "gen_s": gen_s, "train_s": train_s,
            "simulated_accept_length": al, "simulated_per_position": per, "weights_sha256": weights_hash(draft),
            "net": draft, "config": cfg}
