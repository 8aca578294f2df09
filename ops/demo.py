"""`python -m ops.demo`: one W4A8 GEMM end to end on this machine, no GPU needed.

Builds a Kimi-like W4A8 problem (int8 per-token activations x Quark reorder-packed int4
per-channel weights), prints the Triton that kdsl generates for `gemm_w4a8`, runs it through the
current target (the Triton interpreter on CPU) against the float64 torch reference, and prints the
ahead-of-time compile reports for gfx942 (MI300X) and gfx950 (MI355X)."""
from __future__ import annotations

import time

import torch

import kdsl as kd
from kdsl import aot
from ops import gemm as G
from ops import quant as Q
from ops.packing import pack_int4, quantize_int4_per_channel


def main() -> None:
    t0 = time.time()
    target = kd.current_target()
    M, N, K = 4, 96, 512  # small enough for the interpreter; the reports use the Kimi example shape
    g = torch.Generator().manual_seed(0)
    x = torch.randn(M, K, generator=g).to(torch.bfloat16)
    w = torch.randn(N, K, generator=g) * 0.05
    q, w_scale = quantize_int4_per_channel(w)
    w_packed = pack_int4(q, "quark_reorder")

    kern = G.gemm_w4a8_kernel
    print(f"== generated Triton for {kern.name} (gfx942, default config), first 40 lines ==")
    print("\n".join(kern.source(None, "gfx942").splitlines()[:40]))

    print(f"\n== run on {target.name}: M={M} N={N} K={K} ==")
    cfg = {"BLOCK_M": 4, "BLOCK_N": 32, "BLOCK_K": 128} if target.backend == "interpret" else None
    xq, xs = Q.quantize_int8(x)
    y = G.gemm_w4a8(xq, xs, w_packed, w_scale, pack="quark_reorder", config=cfg)
    ref = (xq.double() @ q.double().T) * xs.double()[:, None] * w_scale.double()[None, :]
    err = (y.double() - ref).abs().max().item()
    print(f"max |kernel - float64 reference| = {err:.3e}   (max |ref| = {ref.abs().max().item():.3e}; "
          f"bf16 output, 1 ulp allowed)")
    full = x.double() @ w.double().T
    print(f"max |kernel - unquantized bf16 x f32 w| = {(y.double() - full).abs().max().item():.3e}  "
          f"(quantization error of W4A8)")

    for arch in ("gfx942", "gfx950"):
        print(f"\n== AOT report {arch} ==")
        print(aot.report(kern, arch).text())
    print(f"\n(demo took {time.time() - t0:.1f} s)")


if __name__ == "__main__":
    main()
