"""Fused kernels for draft training (installed as `eagleforge.kernels`).

Each op lives in its own file with a CPU path; its plain-torch reference is beside it in the
tests (the loss's is eagleforge.train.loss, which the trainer can also run):
- `soft_ce`: the EAGLE-3 fused linear soft cross-entropy, one step (docs/training.md), and the
  teacher's logsumexp; `soft_ce_ttt`: all TTT steps at once, the teacher shared.
- `lk`: the acceptance-aware LK loss in the same two forms.
  Each loss file holds its row pass (the Triton kernel, its launcher, the CPU path) and, per op,
  the autograd Function whose forward computes the gradients (rows' backward scales them).
- `rows`: helpers those losses share: input checks, the chunk loops around a row pass, the
  row kernels' launcher, the teacher's lse, the backward's scaling.
- `int4_moe`: the W4A16 routed experts of the native extraction (and its slot combine).
- `rms_norm`: RMSNorm in one pass for the native extraction.
- `optional_triton`: triton, tl and HAS_TRITON for all of them (Triton is optional).
"""

from eagleforge.kernels.lk import fused_lk_loss, fused_lk_loss_ttt
from eagleforge.kernels.soft_ce import fused_soft_cross_entropy, teacher_logsumexp
from eagleforge.kernels.soft_ce_ttt import fused_soft_cross_entropy_ttt

__all__ = ["fused_lk_loss", "fused_lk_loss_ttt", "fused_soft_cross_entropy", "fused_soft_cross_entropy_ttt",
           "teacher_logsumexp"]
