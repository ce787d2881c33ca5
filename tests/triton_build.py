"""Ahead-of-time sm_90 builds of Triton kernels on a machine without a GPU (Triton's own ptxas).

The interpreter (TRITON_INTERPRET=1) runs a kernel as Python and does not see compile-time errors:
a kernel can pass every interpreted test and fail to build for the GPU. Tests compile the kernels
here as their launches configure them.
"""

from __future__ import annotations

import pytest


def build_sm90(kernel, consts: dict, ptr_types: dict | None = None, int_types: dict | None = None,
               num_warps: int = 4, num_stages: int = 1, maxnreg: int | None = None):
    """Compile `kernel` for sm_90: constexpr arguments from consts, pointer arguments (names ending
    in _ptr) typed by ptr_types (default *bf16), other runtime arguments by int_types (default i32).
    Pointers, strides and the dims N and K are marked divisible by 16, as a launch with aligned
    tensors and such dims specializes them (without it the build differs from the launched one:
    v3's down took 255 registers and spilled, against 185 and none).
    maxnreg: the launch's register cap. Returns the compiled kernel (.asm: PTX and cubin)."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    ptr_types, int_types = ptr_types or {}, int_types or {}
    sig = {n: "constexpr" if n in consts else ptr_types.get(n, "*bf16") if n.endswith("_ptr") else int_types.get(n, "i32")
           for n in kernel.arg_names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names) if sig[n] != "constexpr"
               and (n.endswith("_ptr") or n.startswith("stride") or n in ("N", "K"))}
    source = ASTSource(kernel, sig, consts, aligned)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, num_stages=num_stages,
                                                                                   **({"maxnreg": maxnreg} if maxnreg else {})))


def resource_usage(compiled) -> dict:
    """{"REG": registers per thread, "STACK": spill stack bytes, ...} of a build_sm90 kernel, read
    by the cuobjdump that Triton's NVIDIA backend carries (skips the test where it has none)."""
    import os
    import re
    import subprocess
    import tempfile

    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        pytest.skip(f"this Triton has no cuobjdump at {tool}")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True, check=True).stdout
    return {k: int(v) for k, v in re.findall(r"\b([A-Z]+):(\d+)", out)}
