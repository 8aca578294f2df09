"""Building blocks shared by the target and draft: linear over every weight format, norms, MLP.

Backends:
- "torch": plain float math in the model's compute dtype (float32 by default), from weights
  dequantized once at build time (models.formats.dequantize). This is the reference path: routing
  is fragile (REFERENCE §1), so comparisons are done in float32.
- "triton": the kdsl kernels in ops/ (interpreter on CPU), bf16 activations:
  dense -> ops.gemm.gemm_bf16; int4 compressed-tensors group 32 -> ops.gemm.linear_w4a16;
  int4 Quark per-channel -> ops.gemm.linear_w4a8 (per-token int8 activations); fp8 -> ops.gemm.linear_fp8.
"""
from __future__ import annotations

from dataclasses import dataclass

from typing import Optional

import torch

from models.formats import QuantLinear, Weight, dequantize

__all__ = ["BACKENDS", "check_backend", "Linear", "RMSNorm", "MLP", "act_dtype", "concat_weights"]

BACKENDS = ("torch", "triton")


def check_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return backend


def act_dtype(backend: str, dtype: torch.dtype) -> torch.dtype:
    """Activation dtype the backend computes in: kernels take bf16; torch uses the model dtype."""
    return torch.bfloat16 if backend == "triton" else dtype


class Linear:
    """y = x @ W^T for W dense or a QuantLinear, dispatched per format and backend."""

    def __init__(self, name: str, w: Weight, backend: str = "torch", dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu"):
        self.name, self.backend, self.dtype = name, check_backend(backend), dtype
        self.device = torch.device(device)
        self.raw = w
        if isinstance(w, QuantLinear):
            self.out_features, self.in_features = w.shape
        else:
            if w.dim() != 2:
                raise ValueError(f"{name}: a linear weight must be 2-D, got {tuple(w.shape)}")
            self.out_features, self.in_features = w.shape
        self.dense: Optional[torch.Tensor] = None
        self.packed: Optional[torch.Tensor] = None
        self.scale: Optional[torch.Tensor] = None
        if backend == "torch":
            self.dense = dequantize(w, torch.float32).to(dtype).to(self.device)
        elif not isinstance(w, QuantLinear):
            self.dense = w.to(torch.bfloat16).contiguous().to(self.device)
        else:                                  # kernel operands on the device, scales in the dtype each GEMM reads
            self.packed = w.packed.to(self.device)
            sdt = torch.bfloat16 if (w.kind == "int4" and w.group == 32) else torch.float32
            self.scale = w.scale.to(sdt).to(self.device)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"{self.name}: input width {x.shape[-1]} != weight in_features {self.in_features}")
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if self.backend == "torch":
            y = x2.to(self.dtype) @ self.dense.T
        else:
            y = self._triton(x2.to(torch.bfloat16).contiguous())
        return y.reshape(*lead, self.out_features)

    def _triton(self, x: torch.Tensor) -> torch.Tensor:
        from ops import gemm

        if x.shape[0] == 0:
            return torch.zeros(0, self.out_features, dtype=torch.bfloat16, device=x.device)
        w = self.raw
        if not isinstance(w, QuantLinear):
            return gemm.gemm_bf16(x, self.dense, backend="triton")
        if w.kind == "int4" and w.pack == "ct" and w.group == 32:
            return gemm.linear_w4a16(x, self.packed, self.scale, backend="triton")
        if w.kind == "int4" and w.group == 0 and w.pack in ("quark_reorder", "quark_order"):
            return gemm.linear_w4a8(x, self.packed, self.scale, pack=w.pack, backend="triton")
        if w.kind == "fp8":
            return gemm.linear_fp8(x, self.packed, self.scale, backend="triton")
        raise NotImplementedError(f"{self.name}: no triton linear for {w.kind}/{w.pack}/group {w.group} "
                                  f"({w.source}) yet")


def concat_weights(ws: list[Weight]) -> Optional[Weight]:
    """Stack linear weights along N (one GEMM for projections that read the same input), or None when
    their formats differ (then they stay separate GEMMs)."""
    if all(not isinstance(w, QuantLinear) for w in ws):
        return torch.cat([w for w in ws], 0)
    if not all(isinstance(w, QuantLinear) for w in ws):
        return None
    a = ws[0]
    if any((w.kind, w.pack, w.group, w.source, w.shape[1], w.scale.dtype, w.scale.dim()) !=
           (a.kind, a.pack, a.group, a.source, a.shape[1], a.scale.dtype, a.scale.dim()) or w.input_scale is not None
           or w.scale.shape[0] != w.shape[0] or w.packed.shape[0] != w.shape[0] for w in ws):
        return None                            # only per-row data (scales per output row) stacks along N
    from dataclasses import replace

    return replace(a, packed=torch.cat([w.packed for w in ws], 0), scale=torch.cat([w.scale for w in ws], 0),
                   shape=(sum(w.shape[0] for w in ws), a.shape[1]))


def is_partials(x: torch.Tensor, residual: torch.Tensor) -> bool:
    """x is a layer output given as f32 split-K partials [S, *residual.shape] (an output GEMM split
    along K, ops.gemm.gemm_bf16_splitk), not the output itself."""
    return x.dtype == torch.float32 and x.dim() == residual.dim() + 1 and x.shape[1:] == residual.shape


def _norm_input(x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """What the triton residual-add norms read: split-K partials as they are, else bf16 rows."""
    return x if is_partials(x, residual) else x.to(torch.bfloat16).contiguous()


@dataclass(frozen=True)
class NormTail:
    """How an output GEMM may hand its residual-add norm to its own last programs: the call site's
    ticket counters (zeroed once, left at 0 by every launch) and `fuse`: True, False or "auto"
    (ops.splitk_norm.fused_pays: by the tuned files, one answer for every decode and verify size)."""
    counters: torch.Tensor
    fuse: bool | str = "auto"


class PendingGemm:
    """An output GEMM not run yet: rows x [T, K] bf16 @ w [D, K]^T (o_proj at world size 1). The
    residual-add norm that reads it (RMSNorm.add_norm / add_norm_quant) runs it: in one launch with
    its own tail (ops.splitk_norm.gemm_splitk_add_norm, "the last program finishes") where `fuse`
    says so, else as gemm_bf16_splitk partials and the partials' norm (the two-launch chain, the same
    bits on the interpreter), as `tail` (NormTail) says."""

    def __init__(self, x: torch.Tensor, w: torch.Tensor, tail: NormTail):
        self.x, self.w, self.counters, self.fuse = x, w, tail.counters, tail.fuse

    def fused(self, quant: bool) -> bool:
        from ops.splitk_norm import counters_needed, fused_config, fused_pays

        M, K = self.x.shape
        D = self.w.shape[0]
        if self.fuse is False or M < 1:
            return False
        if self.fuse == "auto":
            from kdsl.targets import current_target

            if not fused_pays(current_target().name, D, K, quant, M):
                return False
        return counters_needed(M, D, fused_config(M, D, K, quant)) <= self.counters.numel()

    def partials(self) -> torch.Tensor:
        from ops.gemm import gemm_bf16_splitk

        return gemm_bf16_splitk(self.x, self.w)

    def add_norm(self, norm: "RMSNorm", residual: torch.Tensor, quant: bool) -> Optional[tuple]:
        """The fused launch's tuple (that of rms_norm(_quant) with `residual`), or None: run the chain."""
        if not self.fused(quant):
            return None
        from ops.splitk_norm import gemm_splitk_add_norm

        return gemm_splitk_add_norm(self.x, self.w, residual.to(torch.bfloat16), norm.w, norm.eps, self.counters,
                                    quant, backend="triton")


class RMSNorm:
    def __init__(self, w: torch.Tensor, eps: float, backend: str = "torch", dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu"):
        self.backend, self.eps = check_backend(backend), float(eps)
        self.w = w.to(torch.float32 if backend == "torch" else torch.bfloat16).to(device)
        self.dtype = dtype

    def __call__(self, x: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """norm(x); `out` (x's shape, any row stride): written and returned, e.g. one half of a wider
        row buffer (on triton the launch writes it: no concatenation launch)."""
        if self.backend == "torch":
            xf = x.float()
            y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.w).to(self.dtype)
            return y if out is None else out.copy_(y)
        from ops.norm import rms_norm

        xb = x.to(torch.bfloat16)
        if xb.numel() == 0:
            return xb if out is None else out
        return rms_norm(xb.contiguous(), self.w, self.eps, backend="triton", out=out)

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x): the residual add fused into the norm on triton
        (ops.norm.rms_norm with `residual`, the rmsnorm_add kernel); the sum is rounded to the
        residual's dtype either way. `residual` is only read: carry the returned sum on (on triton
        the launch writes it to a new tensor, no copy launch). On triton x may be the f32 split-K
        partials [S, *residual.shape] of the layer's output GEMM (`is_partials`): the launch adds them
        in split order and rounds to bf16 first; or a `PendingGemm`, run here."""
        if isinstance(x, PendingGemm):
            done = x.add_norm(self, residual, quant=False)
            if done is not None:
                return done
            x = x.partials()
        if self.backend == "torch" or x.numel() == 0:
            if is_partials(x, residual):
                from ops.gemm import splitk_sum_ref

                x = splitk_sum_ref(x)
            r = residual + x.to(residual.dtype)
            return self(r), r
        from ops.norm import rms_norm

        return rms_norm(_norm_input(x, residual), self.w, self.eps, residual=residual.to(torch.bfloat16),
                        backend="triton")

    def add_norm_quant(self, x: torch.Tensor, residual: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Triton only: (int8 q, f32 scale, normed bf16, residual + x) of `add_norm(x, residual)` in
        one launch (ops.norm.rms_norm_quant, the rmsnorm_add_quant kernel): the per-token int8
        activations a W4A8 consumer reads, bit-equal to quantizing the normed rows (x may be split-K
        partials or a `PendingGemm`, as in `add_norm`)."""
        from ops.norm import rms_norm_quant

        if isinstance(x, PendingGemm):
            done = x.add_norm(self, residual, quant=True)
            if done is not None:
                return done
            x = x.partials()

        return rms_norm_quant(_norm_input(x, residual), self.w, self.eps, residual=residual, backend="triton")


class MLP:
    """SwiGLU MLP: down(silu(gate(x)) * up(x)); gate and up run as one GEMM over their stacked
    weights (gate rows then up rows, the layout silu_and_mul reads) when their formats match. On
    triton with dense bf16 weights: the gate|up GEMM split along K (ops.gemm.gemm_bf16_splitk), then
    ops.swiglu.gemm_bf16_swiglu (the partials added, SiLU(gate)*up, the down GEMM); with a quantized
    down, ops.gemm.gemm_bf16_silu_mul (SiLU(gate)*up in the GEMM's epilogue) and the down GEMM. Gate
    and up are rounded to bf16 before SiLU*up on every path, as the unfused ops store them."""

    def __init__(self, gate: Linear, up: Linear, down: Linear, backend: str = "torch"):
        self.gate, self.up, self.down, self.backend = gate, up, down, backend
        self.gate_up: Optional[Linear] = None
        both = concat_weights([gate.raw, up.raw])
        if both is not None:
            self.gate_up = Linear(f"{gate.name}|up", both, backend, gate.dtype, gate.device)
            for lin in (gate, up):              # the stacked copy replaces theirs on the device
                lin.dense = lin.packed = lin.scale = None

    def splitk_weights(self) -> Optional[torch.Tensor]:
        """The stacked gate|up weight [2I, K] when the triton path runs the split-K gate|up GEMM and
        `down_of_partials` (dense bf16 gate|up and down), else None."""
        gu_w = self.gate_up.dense if self.gate_up is not None and self.backend == "triton" else None
        dw = self.down.dense
        if gu_w is None or gu_w.dtype != torch.bfloat16 or dw is None or dw.dtype != torch.bfloat16 \
                or dw.shape[1] * 2 != gu_w.shape[0]:
            return None
        return gu_w

    def down_of_partials(self, part: torch.Tensor) -> torch.Tensor:
        """down(SiLU(gate) * up) [M, N] from the gate|up split-K partials [S, M, 2I] (any strides,
        last dim contiguous: e.g. a view of a wider GEMM's partials): ops.swiglu.gemm_bf16_swiglu."""
        from ops.swiglu import gemm_bf16_swiglu

        return gemm_bf16_swiglu(part, self.down.dense, backend="triton")

    def down_combine_of_partials(self, part: torch.Tensor, partial: torch.Tensor, ids: torch.Tensor,
                                 res: torch.Tensor, n_experts: int) -> torch.Tensor:
        """A MoE layer's shared expert and the layer's end in one launch
        (ops.swiglu.gemm_bf16_swiglu_combine): `down_of_partials(part)` + the routed partial rows
        summed in k order, added into `res` in place; returns the new residual as f32 rows."""
        from ops.swiglu import gemm_bf16_swiglu_combine

        return gemm_bf16_swiglu_combine(part, self.down.dense, partial, ids, res, n_experts, backend="triton")

    def down_rank_of_partials(self, part: torch.Tensor, partial: torch.Tensor, ids: torch.Tensor,
                              n_experts: int) -> torch.Tensor:
        """A MoE layer's shared expert and a rank's share of the layer in one launch
        (ops.swiglu.gemm_bf16_swiglu_rank): `down_of_partials(part)` + the routed partial rows summed
        in k order, bf16: the all-reduce payload."""
        from ops.swiglu import gemm_bf16_swiglu_rank

        return gemm_bf16_swiglu_rank(part, self.down.dense, partial, ids, n_experts, backend="triton")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        gu_w = self.gate_up.dense if self.gate_up is not None and self.backend == "triton" else None
        if gu_w is not None and gu_w.dtype == torch.bfloat16 and x.shape[-1] == gu_w.shape[1]:
            x2 = x.reshape(-1, x.shape[-1]).to(torch.bfloat16).contiguous()
            if self.splitk_weights() is not None:
                # dense bf16 gate|up and down: the gate|up GEMM split along K (enough programs at
                # decode sizes), its partials added, SiLU(gate)*up applied and multiplied into down
                # by one kernel: two launches
                from ops.gemm import gemm_bf16_splitk

                y = self.down_of_partials(gemm_bf16_splitk(x2, gu_w, backend="triton"))
                return y.reshape(*x.shape[:-1], y.shape[-1])
            # a quantized down: SiLU(gate)*up in the gate|up GEMM's epilogue, then down
            from ops.gemm import gemm_bf16_silu_mul

            h = gemm_bf16_silu_mul(x2, gu_w, backend="triton")
            return self.down(h.reshape(*x.shape[:-1], h.shape[-1]))
        if self.gate_up is not None:
            gu = self.gate_up(x)
        else:
            gu = torch.cat([self.gate(x), self.up(x)], -1)
        if self.backend == "torch":
            g, u = gu.chunk(2, -1)
            h = torch.nn.functional.silu(g) * u
        else:
            from ops.norm import silu_and_mul

            h = silu_and_mul(gu.contiguous(), backend="triton") if gu.numel() else gu[..., :gu.shape[-1] // 2]
        return self.down(h)
