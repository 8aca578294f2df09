"""The kernels, written in kdsl. Each op module holds its DSL kernels, a plain-torch reference
of the same math, and a torch-facing function with a `backend="triton" | "torch"` switch that
looks up its tuned config (autotune) by problem and M bucket."""
