"""Plain Triton helpers that kernels in my_kernels.py call through `kd.triton_call` (the escape hatch
for what the DSL does not say). They receive Triton tensors (already broadcast-compatible) and scalars,
see no masks, and must be interpretable by Triton's interpreter to run on CPU tensors."""
import triton
import triton.language as tl


@triton.jit
def softplus(x, beta):
    """log(1 + exp(beta x)) / beta, linear above a threshold (as torch.nn.functional.softplus)."""
    bx = x * beta
    return tl.where(bx > 20.0, x, tl.log(1.0 + tl.exp(bx)) / beta)
