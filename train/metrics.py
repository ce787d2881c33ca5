"""Training metrics: per-TTT-step sums kept on the device (TTTStats), summed over ranks,
the simulated acceptance length, and the log line / RUN/train_log.csv writer.
"""

from __future__ import annotations

import csv
import io
import logging
from pathlib import Path

import torch

from eagleforge.atomic import append_durably, write_text_atomic
from eagleforge.layout import Layout

log = logging.getLogger(__name__)

CSV_NAME = "train_log.csv"


class TTTStats:
    """Sums per TTT step, merged over batches: soft-CE sum and count (in-vocabulary rows),
    correct and valid counts (all loss-masked rows).

    The sums may also sit on the device (`add_device_sums`, [4, steps]: what ttt_loss_shared
    gives, so a batch costs no host sync); reading any of the four lists reads them back first
    (one sync), so a reader never sees a partial sum."""

    _NAMES = ("ce_sum", "n_loss", "n_correct", "n_valid")

    def __init__(self, steps: int, ce_sum=None, n_loss=None, n_correct=None, n_valid=None, tokens: int = 0):
        self.steps, self.tokens = steps, tokens
        self._lists = {"ce_sum": list(ce_sum) if ce_sum else [0.0] * steps}
        for name, values in (("n_loss", n_loss), ("n_correct", n_correct), ("n_valid", n_valid)):
            self._lists[name] = list(values) if values else [0] * steps
        self._device_sums: torch.Tensor | None = None

    def add_device_sums(self, sums: torch.Tensor) -> None:
        """sums [4, steps] (ce_sum, n_loss, n_correct, n_valid), float64 on any device: added lazily."""
        self._device_sums = sums if self._device_sums is None else self._device_sums + sums.to(self._device_sums.device)

    def pending_device_sums(self) -> torch.Tensor | None:
        return self._device_sums

    def host_lists(self) -> list[list]:
        """The four host-side lists as they are (pending device sums not added)."""
        return [self._lists[name] for name in self._NAMES]

    def _read_back(self) -> None:
        if self._device_sums is not None:
            rows, self._device_sums = self._device_sums.tolist(), None
            for name, row in zip(self._NAMES, rows):
                cast = float if name == "ce_sum" else round
                self._lists[name] = [a + cast(b) for a, b in zip(self._lists[name], row)]

    def _get(self, name: str) -> list:
        self._read_back()
        return self._lists[name]

    ce_sum = property(lambda self: self._get("ce_sum"))
    n_loss = property(lambda self: self._get("n_loss"))
    n_correct = property(lambda self: self._get("n_correct"))
    n_valid = property(lambda self: self._get("n_valid"))

    def merge(self, other: "TTTStats") -> None:
        for name in self._NAMES:
            self._lists[name] = [a + b for a, b in zip(self._lists[name], other._lists[name])]
        if other._device_sums is not None:
            self.add_device_sums(other._device_sums)
        self.tokens += other.tokens

    def loss_per_step(self) -> list[float]:
        return [c / n if n else 0.0 for c, n in zip(self.ce_sum, self.n_loss)]

    def accuracy_per_step(self) -> list[float]:
        return [c / n if n else 0.0 for c, n in zip(self.n_correct, self.n_valid)]

    def loss(self, step_weight_decay: float) -> float:
        return sum(step_weight_decay**j * l for j, l in enumerate(self.loss_per_step()))

    def acceptance_length(self, k: int | None = None) -> float:
        return simulated_acceptance_length(self.accuracy_per_step(), k or self.steps)


def simulated_acceptance_length(accuracy_per_step: list[float], k: int) -> float:
    """1 + sum_{j<k} prod_{i<=j} acc_i (docs/training.md; same definition as measured in eval)."""
    total, prod = 1.0, 1.0
    for acc in accuracy_per_step[:k]:
        prod *= acc
        total += prod
    return total


def reduce_stats(stats: TTTStats, layout: Layout, global_tokens: int | None = None) -> TTTStats:
    """The per-step sums of all ranks (one small all-reduce). One process: the stats as they
    are, their device sums not read back (the logger reads them once per window).

    Under torchrun with `global_tokens` (the step's token count over all ranks, which every rank
    knows on the host): one all-reduce of the [4, steps] sums on the device, no host sync. Every
    rank must take the same branch (a rank that ran only a zero-weight batch sends zeros)."""
    if not layout.distributed:
        return stats
    k = stats.steps
    if global_tokens is not None:
        sums = stats.pending_device_sums()
        sums = torch.zeros(4, k, dtype=torch.float64, device=layout.device) if sums is None else sums.to(layout.device)
        if any(any(v) for v in stats.host_lists()):  # the reference loss keeps its sums on the host (a copy)
            sums = sums + torch.tensor(stats.host_lists(), dtype=torch.float64).to(layout.device)
        summed = TTTStats(k, tokens=global_tokens)
        summed.add_device_sums(layout.all_reduce_tensor(sums))
        return summed
    flat = layout.all_reduce_sum(stats.ce_sum + stats.n_loss + stats.n_correct + stats.n_valid + [stats.tokens])
    whole = [round(x) for x in flat[k:]]
    return TTTStats(k, list(flat[:k]), whole[:k], whole[k : 2 * k], whole[2 * k : 3 * k], whole[3 * k])


# Keys a resume may change (and that then apply): how long to train and how often to log and
# save, where the run and the devices are, performance choices that compute the same loss, and
# the other stages' keys that leave the shards and the training as they are. Any other
# difference (lr, holdout, schedule, model, data, vocabulary, seed...) refuses the resume: the
# checkpoint's state (param groups' lr, data position, held-out split) belongs to its config.
# A changed train.max_steps / train.epochs recomputes the cosine schedule over the new length.
class MetricLogger:
    """One log line per window, the same numbers as rows of RUN/train_log.csv (and tensorboard
    when installed). On resume, rows past the resumed step are dropped (they will be redone)."""

    def __init__(self, run_dir: Path, ttt_steps: int, resumed_step: int = 0):
        self.path = Path(run_dir) / CSV_NAME
        self.columns = ["step", "epoch", "loss", "lr", "grad_norm", "tokens_per_s", "simulated_acceptance_length"]
        self.columns += [f"acc_{j}" for j in range(ttt_steps)] + [f"loss_{j}" for j in range(ttt_steps)]
        rows = []
        if resumed_step and self.path.is_file():
            with open(self.path, newline="", encoding="utf-8") as f:
                rows = [r for r in csv.DictReader(f) if int(r["step"]) <= resumed_step]
        write_text_atomic(self.path, self._csv(rows, header=True))  # a full disk: one line, the old log kept
        self.tensorboard = None
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(str(Path(run_dir) / "tensorboard"))
        except ImportError:
            pass

    def log(self, step: int, epoch: int, stats: TTTStats, decay: float, lr: float, grad_norm: float, tokens_per_s: float) -> None:
        acc = stats.accuracy_per_step()
        row = {
            "step": step, "epoch": epoch, "loss": stats.loss(decay), "lr": lr, "grad_norm": grad_norm,
            "tokens_per_s": tokens_per_s, "simulated_acceptance_length": stats.acceptance_length(),
            **{f"acc_{j}": a for j, a in enumerate(acc)}, **{f"loss_{j}": l for j, l in enumerate(stats.loss_per_step())},
        }
        log.info(
            "step %d | loss %.4f | acc %s | accept %.3f | lr %.2e | grad %.3f | %.0f tok/s",
            step, row["loss"], " ".join(f"{a:.3f}" for a in acc), row["simulated_acceptance_length"], lr, grad_norm, tokens_per_s,
        )
        append_durably(self.path, self._csv([row]).encode("utf-8"), kept="the log holds the rows before this step")
        if self.tensorboard is not None:
            for key, value in row.items():
                if key != "step":
                    self.tensorboard.add_scalar(f"train/{key}", value, step)

    def _csv(self, rows: list[dict], header: bool = False) -> str:
        text = io.StringIO(newline="")
        writer = csv.DictWriter(text, fieldnames=self.columns)
        if header:
            writer.writeheader()
        writer.writerows(rows)
        return text.getvalue()

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
