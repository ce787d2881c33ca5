"""Ahead-of-time sm_90 builds of Triton kernels on a machine without a GPU (Triton's own ptxas).

The interpreter (TRITON_INTERPRET=1) runs a kernel as Python and does not see compile-time errors:
a kernel can pass every interpreted test and fail to build for the GPU. Tests compile the kernels
here as their launches configure them.
"""

from __future__ import annotations

import pytest


def build_sm90(kernel, consts: dict, ptr_types: dict | None = None, int_types: dict | None = None,
               num_warps: int = 4, num_stages: int = 1, gluon: bool = False, maxnreg: int | None = None):
    """Compile `kernel` for sm_90: constexpr arguments from consts, pointer arguments (names ending
    in _ptr) typed by ptr_types (default *bf16), other runtime arguments by int_types (default i32).
    gluon: a Gluon kernel, its pointers and integers marked divisible by 16 as a launch with
    aligned tensors specializes them (its cp.async needs the 16-byte alignment known).
    Returns the compiled kernel (its .asm holds the PTX and the cubin)."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    ptr_types, int_types = ptr_types or {}, int_types or {}
    sig = {n: "constexpr" if n in consts else ptr_types.get(n, "*bf16") if n.endswith("_ptr") else int_types.get(n, "i32")
           for n in kernel.arg_names}
    source = ASTSource(kernel, sig, consts)
    if gluon:
        from triton.experimental.gluon._runtime import GluonASTSource

        aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names) if sig[n] != "constexpr"}
        source = GluonASTSource(kernel, sig, consts, attrs=aligned)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, num_stages=num_stages,
                                                                                   **({"maxnreg": maxnreg} if maxnreg else {})))
