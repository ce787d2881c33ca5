"""Fused kernels for draft training (installed as `eagleforge.kernels`).

Each op lives in its own file beside its plain-torch reference and a CPU path:
- `soft_ce`: the EAGLE-3 fused linear soft cross-entropy (docs/training.md).
- `int4_moe`: the W4A16 routed experts of the native extraction (and its slot combine).
- `rms_norm`: RMSNorm in one pass for the native extraction.
"""

from eagleforge.kernels.soft_ce import (
    fused_soft_cross_entropy,
    fused_soft_cross_entropy_ttt,
    reference_soft_cross_entropy,
    reference_soft_cross_entropy_ttt,
    reference_teacher_logsumexp,
    teacher_logsumexp,
)

__all__ = [
    "fused_soft_cross_entropy",
    "fused_soft_cross_entropy_ttt",
    "reference_soft_cross_entropy",
    "reference_soft_cross_entropy_ttt",
    "reference_teacher_logsumexp",
    "teacher_logsumexp",
]
