"""Toy Triton kernels for tests/test_compile_check.py: a tensor-core tile (clean at 64 x 64; at 256 x 256 with 512-wide
feature blocks its operand buffers exceed every GPU's shared memory) and one that does not compile (an unsupported
product shape). Imported by the compile check
in a subprocess, outside the interpreter."""

import triton
import triton.language as tl


@triton.jit
def _dot_kernel(x_ptr, y_ptr, out_ptr, d, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr):
    """A 64 x 64 tile of X Y^T (four warps) over a pipelined loop of feature blocks: what a GEMM-quality tile compiles to."""
    rows = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
    for k in range(0, d, BLOCK_D):
        feats = k + tl.arange(0, BLOCK_D)
        x = tl.load(x_ptr + rows[:, None] * d + feats[None, :], mask=feats[None, :] < d, other=0.0)
        y = tl.load(y_ptr + rows[:, None] * d + feats[None, :], mask=feats[None, :] < d, other=0.0)
        acc = tl.dot(x, tl.trans(y), acc)
    tl.store(out_ptr + rows[:, None] * BLOCK + rows[None, :], acc)


@triton.jit
def _unsupported_kernel(x_ptr, out_ptr, BLOCK: tl.constexpr):
    """A product of 4-wide blocks: below the compiler's smallest matrix shape, so it does not compile."""
    rows = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + rows[:, None] * BLOCK + rows[None, :])
    tl.store(out_ptr + rows[:, None] * BLOCK + rows[None, :], tl.dot(x, x))

