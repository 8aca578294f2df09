import torch, kdsl as kd

@kd.kernel
def gemm_test(x: kd.In["M", "K", kd.i8], xs: kd.In["M", kd.f32], w: kd.In["N", "K", kd.int4("quark_reorder")],
              ws: kd.In["N", kd.f32], out: kd.Out["M", "N", kd.bf16]):
    m, n = kd.grid("M", "N")
    acc = kd.fold("K", kd.zeros((m, n), kd.i32), lambda k, acc: acc + kd.dot(x[m, k], w[n, k]))
    out[m, n] = acc * xs[m] * ws[n]

