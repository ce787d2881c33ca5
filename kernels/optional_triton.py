"""Triton, where it is installed: `triton`, `tl` and HAS_TRITON for every kernel file here.

Triton is optional: the CPU path and CPU machines run without it (the kernel files define their
Triton kernels under `if HAS_TRITON:`); with it, TRITON_INTERPRET=1 runs those kernels on the CPU.
"""

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - depends on the machine
    triton = None
    tl = None
    HAS_TRITON = False

__all__ = ["HAS_TRITON", "tl", "triton"]
