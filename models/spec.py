"""Speculative decoding engine with an EAGLE-3 draft (REFERENCE §4), and plain decoding through it.

Cache invariant per sequence slot b (between steps): the target and draft caches both hold L rows,
positions [0, L), where L = len(prompt) + len(generated) - 1; the last generated token (the "root")
is not yet cached. The draft's row at position p pairs the target aux hidden of p with the token at
p + 1 and predicts the token at p + 2 (the draft input is the sequence shifted by one).

Chain step (topk=1, k = steps):
1. draft: d1 comes from the last draft row (prefill / extend); d2..dk from k-1 single-token steps on
   the carried pre-norm state (rows L .. L+k-2, speculative).
2. verify: ONE target forward over [root, d1..dk] at positions L..L+k (causal among the new rows).
3. greedy acceptance: a = longest prefix with d_{j+1} == argmax(logits[j]); bonus = argmax(logits[a]);
   commit d1..da, bonus (cut at eos / max tokens).
4. KV bookkeeping: target length := L + a + 1 (rows of rejected drafts become invisible); draft
   length := L (its speculative rows are dropped), then the draft is extended over
   [d1..da, bonus] with the target aux rows of [root, d1..da] at positions L..L+a.

Sampled acceptance (temperature > 0, optional top-p), with the deterministic (argmax) draft: accept d_j
with probability p_target(d_j) (temperature / top-p applied to the target row); on the first
rejection sample from p_target with d_j zeroed and renormalised; if all k are accepted sample the bonus
from the last row. The committed tokens are then distributed exactly as the target's sampled decoding.

Tree (topk = K > 1): every draft step expands the K best frontier nodes to their top-K children
(score = sum of draft log-probs; the draft attends with a tree mask over its speculative rows); the
best N-1 nodes (N = draft_tokens, ancestors always included) plus the root are verified in ONE
target forward with positions L + depth and a tree mask (prefix + ancestors + self). Acceptance
walks from the root: greedy descends to the child equal to the target's argmax; sampled tries the
children best-first, accepting child x with probability p(x) under the current residual p and
zeroing + renormalising p on each rejection (the chain rule above, which is its one-child case);
without an accepted child the next token is drawn from the residual (at a leaf: the bonus from the
leaf's p). The accepted path's target KV rows are moved to positions L+1..L+a, the rest is truncated.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Optional, Sequence, Union

import torch

__all__ = ["SpecParams", "Metrics", "GenResult", "Engine", "target_probs", "sample_accept", "sample_tree_accept",
           "greedy_tree_accept", "request_generators", "sample_rows", "chain_accept"]


@dataclass
class SpecParams:
    """steps = k draft tokens per verify (chain); draft_tokens must be k + 1 for a chain."""
    steps: int = 3
    topk: int = 1
    draft_tokens: Optional[int] = None
    temperature: float = 0.0
    top_p: float = 1.0

    @property
    def num_draft_tokens(self) -> int:
        """Tokens per verify, root included (chain: steps + 1; tree default: 1 + steps * topk, capped)."""
        if self.draft_tokens is not None:
            return self.draft_tokens
        return self.steps + 1 if self.topk == 1 else min(1 + self.steps * self.topk,
                                                         1 + self.topk + (self.steps - 1) * self.topk ** 2)

    def validate(self) -> None:
        if self.steps < 1:
            raise ValueError(f"--steps must be >= 1, got {self.steps}")
        if self.topk < 1:
            raise ValueError(f"--topk must be >= 1, got {self.topk}")
        if self.temperature < 0:
            raise ValueError(f"--temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.topk > 1:
            most = 1 + self.topk + (self.steps - 1) * self.topk * self.topk
            if not 2 <= self.num_draft_tokens <= most:
                raise ValueError(f"--draft-tokens must be in [2, {most}] for a tree of topk {self.topk} and "
                                 f"{self.steps} steps (root included), got {self.num_draft_tokens}")
            return
        dt = self.num_draft_tokens
        if dt != self.steps + 1:
            raise ValueError(f"--draft-tokens must be steps + 1 = {self.steps + 1} for chain drafting (topk 1), got {dt}")


@dataclass
class Metrics:
    """Decode-step metrics (prefill-only steps excluded)."""
    mode: str
    steps: int = 0                     # per-sequence verify (or plain decode) steps
    batched_forwards: int = 0          # target forward calls after prefill
    committed: int = 0                 # tokens those steps added to the outputs (bonus included)
    verify_tokens: int = 0             # tokens the verify steps committed, before max_new_tokens cuts them
    accepted: int = 0                  # accepted draft tokens
    k: int = 0
    per_position: list[int] = field(default_factory=list)
    histogram: list[int] = field(default_factory=list)
    prefill_s: float = 0.0
    decode_s: float = 0.0
    generated: int = 0                 # all generated tokens (incl. the one from prefill)
    batch: int = 0

    @property
    def accept_length(self) -> float:
        """Tokens committed per verify step (accepted drafts + bonus), counted whole even when
        max_new_tokens truncates the output (the histogram's mean + 1)."""
        return self.verify_tokens / self.steps if self.steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / (self.k * self.steps) if self.steps and self.k else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        return [c / self.steps if self.steps else 0.0 for c in self.per_position]

    @property
    def target_forwards_per_token(self) -> float:
        return self.steps / self.committed if self.committed else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.committed / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def time_per_output_token_ms(self) -> float:
        """Decode wall time / mean committed tokens per sequence (each sequence's view)."""
        per_seq = self.committed / self.batch if self.batch else 0
        return 1000.0 * self.decode_s / per_seq if per_seq else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "accept_length": self.accept_length, "acceptance_rate": self.acceptance_rate,
                "per_position_acceptance": self.per_position_acceptance, "accept_histogram": self.histogram,
                "target_forwards_per_token": self.target_forwards_per_token, "tokens_per_s": self.tokens_per_s,
                "time_per_output_token_ms": self.time_per_output_token_ms, "verify_steps": self.steps,
                "batched_target_forwards": self.batched_forwards, "decode_tokens": self.committed,
                "generated_tokens": self.generated, "prefill_s": self.prefill_s, "decode_s": self.decode_s}


@dataclass
class GenResult:
    outputs: list[list[int]]           # generated tokens per prompt (eos included when hit)
    metrics: Metrics
    target_cache: Any = None
    draft_cache: Any = None


def target_probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Sampling distribution of one target row: softmax(logits / T), restricted to the top-p nucleus."""
    p = torch.softmax(logits.double() / temperature, -1)
    if top_p < 1.0:
        sp, idx = p.sort(descending=True)
        keep = (sp.cumsum(-1) - sp) < top_p          # smallest prefix whose mass reaches top_p
        sp = sp * keep
        p = torch.zeros_like(p).scatter_(-1, idx, sp)
    return p / p.sum(-1, keepdim=True)


def sample_tree_accept(logits: torch.Tensor, children: Sequence[Sequence[int]], tokens: Sequence[int],
                       temperature: float, top_p: float, gen: torch.Generator) -> tuple[list[int], int]:
    """Sampled acceptance over a draft tree with deterministic candidates: (accepted rows, next token).

    Row 0 is the root; children[r] lists row r's child rows in the order to try them, tokens[r] is
    the token of row r; logits[r] is the target's row r. At row r with target distribution p: try
    each child x in turn, accept with probability p(x); on rejection set p(x) = 0 and renormalise.
    The first accepted child becomes the current row; when none is accepted the next token is drawn
    from what is left of p (at a leaf: from p itself, the bonus). A chain is the tree whose rows
    each have one child. Every committed token is then distributed as in plain sampled decoding."""
    path: list[int] = []
    cur = 0
    while True:
        p = target_probs(logits[cur], temperature, top_p)
        nxt = None
        for c in children[cur]:
            x = tokens[c]
            if float(torch.rand((), generator=gen, dtype=torch.float64)) < float(p[x]):
                nxt = c
                break
            p[x] = 0.0
            p = p / p.sum()
        if nxt is None:
            return path, int(torch.multinomial(p, 1, generator=gen))
        path.append(nxt)
        cur = nxt


def sample_accept(logits: torch.Tensor, drafts: list[int], temperature: float, top_p: float,
                  gen: torch.Generator) -> tuple[int, int]:
    """Sampled chain acceptance for a deterministic draft: (accepted count a, next token)."""
    k = len(drafts)
    children = [[j + 1] for j in range(k)] + [[]]
    path, tok = sample_tree_accept(logits, children, [-1] + list(drafts), temperature, top_p, gen)
    return len(path), tok


def greedy_tree_accept(pred: Sequence[int], children: Sequence[Sequence[int]],
                       tokens: Sequence[int]) -> tuple[list[int], int]:
    """Greedy walk (pred[r] = target argmax at row r): descend to the child holding pred[cur] while
    one does; (accepted rows, bonus token pred[last row])."""
    path: list[int] = []
    cur = 0
    while True:
        nxt = next((c for c in children[cur] if tokens[c] == pred[cur]), None)
        if nxt is None:
            return path, int(pred[cur])
        path.append(nxt)
        cur = nxt


def request_generators(seed: int, n: int, device: Union[str, torch.device] = "cpu") -> list[torch.Generator]:
    """One generator per request, seeded from (seed, request index): a request's random stream does
    not depend on what else is in the batch."""
    return [torch.Generator(device=device).manual_seed((seed * 0x9E3779B1 + 0x632BE5AB * (i + 1)) % (1 << 63))
            for i in range(n)]


def _draw(gens: Sequence[torch.Generator], n: int, device: torch.device) -> torch.Tensor:
    """float64 [len(gens), n] uniforms, row i from gens[i] (n per request per step, whatever the batch)."""
    return torch.stack([torch.rand(n, generator=g, device=device, dtype=torch.float64) for g in gens])


def sample_rows(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling on the device: probs [..., V], uniforms u [...] in [0, 1) -> ids [...].
    A token of probability 0 is never picked (first index whose cumulative mass exceeds u * total)."""
    cdf = probs.cumsum(-1)
    x = (u * cdf[..., -1]).unsqueeze(-1).to(cdf.dtype)
    return torch.searchsorted(cdf.contiguous(), x.contiguous(), right=True).squeeze(-1).clamp(max=probs.shape[-1] - 1)


def chain_accept(logits: torch.Tensor, drafts: torch.Tensor, temperature: float, top_p: float,
                 u: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Chain acceptance for a batch on the device: logits [B, k+1, V], drafts [B, k] ->
    (accepted count a [B], committed tokens [B, k+1]: drafts 0..a-1 then the next token at a).

    Greedy: a = longest prefix with d_j == argmax(logits[j]); the next token argmax(logits[a]).
    Sampled (u [B, k+1] uniforms): accept d_j with probability p_j(d_j), on the first rejection draw
    from p_a with d_a removed (renormalised), after k acceptances the bonus from p_k (sample_accept)."""
    B, K1, V = logits.shape
    k = K1 - 1
    if temperature == 0:
        pred = logits.argmax(-1)
        a = torch.cumprod((drafts == pred[:, :k]).to(torch.int64), 1).sum(1) if k else pred.new_zeros(B)
        return a, pred
    p = target_probs(logits, temperature, top_p)                     # [B, k+1, V] float64
    if k:
        pd = p[:, :k].gather(2, drafts[:, :, None]).squeeze(-1)
        a = torch.cumprod((u[:, :k] < pd).to(torch.int64), 1).sum(1)
    else:
        a = torch.zeros(B, dtype=torch.long, device=logits.device)
    pa = p.gather(1, a[:, None, None].expand(B, 1, V)).squeeze(1)
    if k:
        rej = a < k
        dtok = drafts.gather(1, a.clamp(max=k - 1)[:, None])
        pa = torch.where(rej[:, None], pa.scatter(1, dtok, 0.0), pa)
        pa = pa / pa.sum(-1, keepdim=True)
    nxt = sample_rows(pa, u[:, k])
    toks = torch.cat([drafts, drafts.new_zeros(B, 1)], 1) if k else drafts.new_zeros(B, 1)
    toks = toks.scatter(1, a[:, None], nxt[:, None])
    return a, toks


class _ListTarget:
    """`step` over a model that only has the ragged list `forward` (test stubs): host reads allowed."""

    def __init__(self, m: Any):
        self.m = m

    def step(self, cache: Any, tokens: torch.Tensor, tree: Optional[tuple] = None) -> Any:
        rows = tokens.tolist()
        trees = None if tree is None else [(tree[0][b].tolist(), tree[1][b]) for b in range(len(rows))]
        out = self.m.forward(cache, [(b, r) for b, r in enumerate(rows)], trees=trees) if trees else \
            self.m.forward(cache, [(b, r) for b, r in enumerate(rows)])

        class Out:
            pass
        o = Out()
        o.logits = torch.stack([x.float() for x in out.logits])
        o.aux = None if out.aux[0] is None else torch.stack(list(out.aux))
        return o


class _ListDraft:
    def __init__(self, d: Any):
        self.d = d

    def step(self, cache: Any, tokens: torch.Tensor, hidden: torch.Tensor, seqs: Any = None,
             positions: Optional[torch.Tensor] = None, window: Optional[torch.Tensor] = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
        rows = tokens.tolist()
        views = None
        if window is not None:            # the list API's view: every cached row before the window visible
            lens = list(cache.table.lengths)
            views = [(positions[b].tolist(), torch.cat([torch.ones(window.shape[1], lens[b] + len(r) - window.shape[2],
                                                                   dtype=torch.bool), window[b].cpu()], 1))
                     for b, r in enumerate(rows)]
        res = self.d.forward(cache, [(b, r, hidden[b]) for b, r in enumerate(rows)], views)
        return torch.stack([lg.float() for lg, _ in res]), torch.stack([y for _, y in res])


class Engine:
    """Batched speculative decoding, chain or tree (mode "spec"), and plain decoding (mode "plain"),
    greedy or sampled.

    Plain, chain and tree decoding run on the models' device: tokens, lengths, draft trees (models.spec_tree),
    acceptance and eos / length checks are device tensors, each step reads back once (the committed
    tokens with their counts), and the decode / draft / verify steps go through `graphs`
    (models.graphs.StepGraphs mode: "off", "on" = CUDA graphs per padded batch bucket and step shape,
    "static" = the same buffers run eagerly, for CPU tests)."""

    def __init__(self, target: Any, draft: Any = None, page_size: int = 16, graphs: str = "off"):
        from models.graphs import MODES

        if graphs not in MODES:
            raise ValueError(f"graphs must be one of {MODES}, got {graphs!r}")
        self.target, self.draft, self.page_size, self.graphs = target, draft, page_size, graphs
        self.last_graphs: Any = None       # the StepGraphs of the last generate (captures / replays, tests)

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, mode: str = "spec",
                 params: Optional[SpecParams] = None, eos_id: Union[int, Collection[int], None] = None,
                 progress: Optional[Callable[[int], None]] = None, seed: int = 0) -> GenResult:
        """Decode every prompt to max_new_tokens (or an eos id: one id or a collection). Greedy when
        params.temperature == 0, else sampled: request i draws from its own generator seeded from
        (seed, i), so its output does not depend on the rest of the batch."""
        params = params or SpecParams()
        params.validate()
        if mode not in ("spec", "plain"):
            raise ValueError(f"mode must be 'spec' or 'plain', got {mode!r}")
        if mode == "spec" and self.draft is None:
            raise ValueError("spec mode needs a draft model")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        eos = frozenset() if eos_id is None else frozenset([eos_id] if isinstance(eos_id, int) else eos_id)
        return self._generate_chain(prompts, max_new_tokens, mode, params, eos, progress or (lambda n: None), seed)

    # ------------------------------------------------------------------------------------------
    # plain, chain and tree: device-resident

    def _generate_chain(self, prompts, max_new_tokens: int, mode: str, params: SpecParams, eos: frozenset,
                        tick: Callable[[int], None], seed: int) -> GenResult:
        from models.graphs import StepGraphs, bucket
        from models.spec_tree import accept, draft_tree, move_rows, pick_tree

        spec = mode == "spec"
        tree = spec and params.topk > 1
        tgt = self.target if hasattr(self.target, "step") else _ListTarget(self.target)
        drf = None if not spec else (self.draft if hasattr(self.draft, "step") else _ListDraft(self.draft))
        dev = torch.device(getattr(self.target, "device", "cpu"))
        k = params.steps if spec else 0
        K, N = params.topk, params.num_draft_tokens
        T, P = params.temperature, params.top_p
        B = len(prompts)
        native = hasattr(self.target, "step") and (not spec or hasattr(self.draft, "step"))
        graphs_mode = self.graphs if native else "off"          # stubs (list API only) run eagerly, unpadded
        Bp = bucket(B) if graphs_mode != "off" else B
        prompts = [list(p) for p in prompts] + [[0]] * (Bp - B)          # padding rows: inactive from the start
        ahead = max(k + 1, N, K * (k - 1)) if tree else k + 1      # speculative rows past the committed ones
        cap = max(len(p) for p in prompts) + max_new_tokens + ahead + 1
        tc = self.target.new_cache(Bp, cap, self.page_size)
        tc.table.reserve_all(cap)
        dc = None
        if spec:
            dc = self.draft.new_cache(Bp, cap, self.page_size)
            dc.table.reserve_all(cap)
        runner = StepGraphs(graphs_mode, [tc.table.lens] + ([dc.table.lens] if dc is not None else []))
        self.last_graphs = runner
        gens = request_generators(seed, Bp, dev) if T > 0 else []
        m = Metrics(mode, k=k, per_position=[0] * k, histogram=[0] * (k + 1), batch=B)
        gen: list[list[int]] = [[] for _ in range(B)]

        def pick(rows: torch.Tensor) -> torch.Tensor:
            if T == 0:
                return rows.argmax(-1)
            return sample_rows(target_probs(rows, T, P), _draw(gens, 1, dev)[:, 0])

        def t_step(tokens: torch.Tensor):
            o = tgt.step(tc, tokens)
            return o.logits, o.aux

        def t_tree(tokens: torch.Tensor, depths: torch.Tensor, mask: torch.Tensor):
            o = tgt.step(tc, tokens, tree=(depths, mask))
            return o.logits, o.aux

        def d_step(tokens: torch.Tensor, hidden: torch.Tensor):
            return drf.step(dc, tokens, hidden)

        def d_tree(tokens: torch.Tensor, hidden: torch.Tensor, pos: torch.Tensor, win: torch.Tensor):
            return drf.step(dc, tokens, hidden, None, pos, win)

        def tree_step(s: int, tokens, hidden, pos, win):
            return runner(("draft-tree", Bp, K, s), d_tree, tokens, hidden, pos, win)

        # ---- prefill (ragged: the list API), then the draft over the prompt shifted by one
        t0 = time.perf_counter()
        out = self.target.forward(tc, [(b, p) for b, p in enumerate(prompts)])
        root = _lockstep(self.target, pick(torch.stack([lg[-1].float().to(dev) for lg in out.logits])))
        first = root.tolist()
        done = [False] * Bp
        for b in range(Bp):
            if b >= B:
                done[b] = True
                continue
            gen[b].append(int(first[b]))
            tick(1)
            done[b] = int(first[b]) in eos or max_new_tokens <= 1
        nxt = carry = root_lg = None
        if spec:
            res = self.draft.forward(dc, [(b, prompts[b][1:] + [int(first[b])], out.aux[b]) for b in range(Bp)])
            root_lg = torch.stack([lg[-1].float() for lg, _ in res]).to(dev)        # the draft after the root
            nxt = self.draft.to_target(root_lg.argmax(-1))
            carry = torch.stack([y[-1] for _, y in res]).to(dev)
        m.prefill_s = time.perf_counter() - t0

        # ---- decode: device state, one read back per step
        active = torch.tensor([not d for d in done], dtype=torch.bool, device=dev)
        ngen = torch.tensor([len(g) for g in gen] + [0] * (Bp - B), dtype=torch.long, device=dev)
        eos_t = torch.tensor(sorted(eos) or [-1], dtype=torch.long, device=dev)
        cols = torch.arange(k + 1, device=dev)
        hist = torch.zeros(k + 1, dtype=torch.long, device=dev)
        posacc = torch.zeros(k, dtype=torch.long, device=dev)
        vtok = torch.zeros((), dtype=torch.long, device=dev)
        t0 = time.perf_counter()
        while not all(done):
            Lb = tc.table.lens.clone()
            was_active = active
            if not spec:
                logits, _ = runner(("target", Bp, 1), t_step, root[:, None])
                toks = _lockstep(self.target, pick(logits[:, 0])[:, None])
                a = torch.zeros(Bp, dtype=torch.long, device=dev)
                tc.table.lens.copy_(torch.where(active, Lb + 1, Lb))
            else:
                if tree:      # draft a tree, verify its best N - 1 nodes in one step, walk it
                    dt = draft_tree(tree_step, root_lg, carry, Lb, K, k, self.draft.to_target)
                    vt = pick_tree(dt, root, N, K, k)
                    logits, aux = runner(("target-tree", Bp, vt.tokens.shape[1]), t_tree, vt.tokens, vt.depths,
                                         vt.mask)
                    u = _draw(gens, (k + 1) * (K + 1), dev).view(Bp, k + 1, K + 1) if T > 0 else None
                    a, path, toks = accept(logits, vt, k, T, P, u)
                    both = _lockstep(self.target, torch.cat([a[:, None], path, toks], 1))   # ranks follow rank 0
                    a, path, toks = both[:, 0], both[:, 1:k + 1], both[:, k + 1:]
                    move_rows(tc, Lb, path, torch.where(active, a, torch.zeros_like(a)))
                    rows = torch.cat([torch.zeros_like(a)[:, None], path.clamp(min=0)], 1)   # root + accepted
                    ext_aux = aux.gather(1, rows[:, :, None].expand(Bp, k + 1, aux.shape[-1]))
                else:
                    drafts, c = [nxt], carry
                    for _ in range(k - 1):
                        lg, y = runner(("draft", Bp, 1), d_step, drafts[-1][:, None], c[:, None])
                        drafts.append(self.draft.to_target(lg[:, 0].argmax(-1)))
                        c = y[:, 0]
                    D = torch.stack(drafts, 1)
                    logits, ext_aux = runner(("target", Bp, k + 1), t_step, torch.cat([root[:, None], D], 1))
                    u = _draw(gens, k + 1, dev) if T > 0 else None
                    a, toks = chain_accept(logits, D, T, P, u)
                    a, toks = _lockstep(self.target, a), _lockstep(self.target, toks)   # ranks follow rank 0
                a32 = a.to(Lb.dtype)
                tc.table.lens.copy_(torch.where(active, Lb + a32 + 1, Lb))
                dc.table.lens.copy_(Lb)                       # drop the speculative draft rows
                lg, y = runner(("draft", Bp, k + 1), d_step, toks, ext_aux)
                dc.table.lens.copy_(torch.where(active, Lb + a32 + 1, Lb))
                sel = a[:, None, None]
                root_lg = torch.where(active[:, None], lg.gather(1, sel.expand(-1, 1, lg.shape[-1]))[:, 0].float(),
                                      root_lg)
                nxt = torch.where(active, self.draft.to_target(root_lg.argmax(-1)), nxt)
                carry = torch.where(active[:, None], y.gather(1, sel.expand(-1, 1, y.shape[-1]))[:, 0], carry)
            root = torch.where(active, toks.gather(1, a[:, None])[:, 0], root)
            # eos and length checks on the device
            n = a + 1
            valid = cols[None, :] < n[:, None]
            is_eos = torch.isin(toks, eos_t) & valid
            first_eos = torch.where(is_eos.any(1), is_eos.to(torch.int64).argmax(1) + 1, torch.full_like(n, k + 2))
            cut = torch.minimum(torch.minimum(n, first_eos), (max_new_tokens - ngen).clamp(min=0))
            cut = torch.where(active, cut, torch.zeros_like(cut))
            ngen = ngen + cut
            fin = active & ((is_eos & (cols[None, :] < cut[:, None])).any(1) | (ngen >= max_new_tokens))
            active = active & ~fin
            # metrics counters on the device (read once at the end)
            stepped = was_active.long()
            hist.index_add_(0, a, stepped)
            posacc += ((cols[None, :k] < a[:, None]).long() * stepped[:, None]).sum(0)
            vtok += ((a + 1) * stepped).sum()
            host = torch.cat([toks, cut[:, None], fin[:, None].long()], 1).tolist()   # the one read per step
            m.batched_forwards += 1
            for b in range(B):
                if done[b]:
                    continue
                row = host[b]
                cb, fb = row[k + 1], row[k + 2]
                gen[b].extend(int(t) for t in row[:cb])
                tick(cb)
                done[b] = bool(fb)
        counts = [int(x) for x in torch.cat([hist, posacc, vtok[None]]).tolist()]      # one read at the end
        m.histogram, m.per_position, m.verify_tokens = counts[:k + 1], counts[k + 1:2 * k + 1], counts[-1]
        m.steps = sum(m.histogram)
        m.accepted = sum(i * c for i, c in enumerate(m.histogram))
        m.committed = sum(len(g) for g in gen) - sum(1 for g in gen if g)      # after the prefill token
        m.decode_s = time.perf_counter() - t0
        m.generated = sum(len(g) for g in gen)
        return GenResult(gen, m, tc, dc)


def _lockstep(target: Any, t: torch.Tensor) -> torch.Tensor:
    """Rank 0's tokens / accept lengths on every tensor-parallel rank (models.parallel.Comm; the
    identity on one process): with sampling only rank 0's draw counts, so the ranks stay in lockstep."""
    comm = getattr(target, "comm", None)
    return t if comm is None or comm.world == 1 else comm.broadcast(t.clone())
