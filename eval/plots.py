"""PNG plots of the evaluation: acceptance per draft position, and the training curves.

matplotlib with the Agg backend (no display); each function writes one PNG (whole or not at all:
eagleforge.atomic) and returns its path, or None when there is nothing to draw (no train log yet).
"""

from __future__ import annotations

import csv
import io
import logging
import math
import re
from pathlib import Path

from eagleforge.atomic import atomic_path, write_text_atomic

log = logging.getLogger(__name__)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> None:
    """Write `fig` as the PNG `path` whole or not at all (a full disk is one line naming it), and
    close it."""
    plt = _pyplot()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(path) as tmp:
            fig.savefig(tmp, dpi=110)
    finally:
        plt.close(fig)


def plot_per_position(results: dict, path: str | Path) -> Path:
    """Acceptance rate at each draft position for the EAGLE draft and the n-gram baseline.

    Position i's rate is the share of verification rounds whose draft token i was accepted
    (1 + the sum of the rates is the acceptance length, printed in the legend).
    """
    plt = _pyplot()
    path = Path(path)
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    series = [
        ("EAGLE-3 draft", results.get("per_position_acceptance"), results.get("acceptance_length")),
        ("n-gram (prompt lookup)", results.get("ngram_per_position_acceptance"), results.get("ngram_acceptance_length")),
    ]
    simulated = results.get("simulated_per_position_acceptance")
    if simulated:
        series.append(("simulated (held-out TTT)", simulated, results.get("simulated_acceptance_length")))
    for label, rates, length in series:
        if not rates:
            continue
        positions = list(range(1, len(rates) + 1))
        suffix = f" (acc. length {length:.2f})" if isinstance(length, (int, float)) else ""
        ax.plot(positions, rates, marker="o", label=label + suffix)
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate (share of rounds)")
    ax.set_ylim(0.0, 1.0)
    ax.set_xticks(list(range(1, int(results.get("k", 1)) + 1)))
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(f"k={results.get('k')}, {results.get('n_prompts')} prompts, {results.get('max_new_tokens')} new tokens")
    fig.tight_layout()
    _save(fig, path)
    return path


def read_train_log(path: str | Path) -> dict[str, list[float]]:
    """Columns of RUN/train_log.csv as float lists (non-numeric cells become NaN)."""
    path = Path(path)
    with path.open(newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        return {}
    columns: dict[str, list[float]] = {name: [] for name in rows[0] if name}
    for row in rows:
        for name in columns:
            columns[name].append(_as_float(row.get(name)))
    return columns


def _as_float(cell) -> float:
    try:
        return float(cell)
    except (TypeError, ValueError):
        return math.nan


def _split_columns(columns: dict[str, list[float]]) -> tuple[list[str], list[str], list[str]]:
    """Loss, accuracy and acceptance-length column names of the train log.

    The trainer writes `loss`, `loss_{j}`, `acc_{j}` (TTT step j) and
    `simulated_acceptance_length`; a `heldout_` prefix is accepted on each.
    """
    loss = [c for c in columns if re.fullmatch(r"(heldout_)?loss(_\d+)?", c)]
    acc = [c for c in columns if re.fullmatch(r"(heldout_)?acc(uracy)?(_\d+)?", c)]
    accept = [c for c in columns if re.fullmatch(r"(heldout_)?simulated_acceptance_length", c)]
    return loss, acc, accept


def plot_training_curves(train_log: str | Path, path: str | Path) -> Path | None:
    """Training loss, per-TTT-step top-1 accuracy and simulated acceptance length against the
    step, from RUN/train_log.csv. Returns None when the log is missing or has no rows."""
    train_log = Path(train_log)
    if not train_log.is_file():
        return None
    columns = read_train_log(train_log)
    x_name = next((c for c in ("step", "global_step", "iteration") if c in columns), None)
    if not columns or x_name is None:
        log.warning("%s: no rows or no 'step' column; skipping the training-curve plot", train_log)
        return None
    loss_cols, acc_cols, accept_cols = _split_columns(columns)
    plt = _pyplot()
    fig, (ax_loss, ax_acc, ax_accept) = plt.subplots(1, 3, figsize=(15.0, 4.0))
    steps = columns[x_name]
    for ax, names in ((ax_loss, loss_cols), (ax_acc, acc_cols), (ax_accept, accept_cols)):
        for name in names:
            _plot_finite(ax, steps, columns[name], name, bold=name in ("loss", "simulated_acceptance_length"))
    ax_loss.set_title("loss (weighted sum, and per TTT step)")
    ax_acc.set_title("top-1 accuracy per TTT step")
    ax_accept.set_title("simulated acceptance length (train window)")
    for ax in (ax_loss, ax_acc, ax_accept):
        ax.set_xlabel(x_name)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path = Path(path)
    _save(fig, path)
    return path


def _plot_finite(ax, xs: list[float], ys: list[float], label: str, bold: bool = False) -> None:
    """Plot only the rows where both values are numbers (held-out columns are sparse)."""
    pairs = [(x, y) for x, y in zip(xs, ys) if not (math.isnan(x) or math.isnan(y))]
    if pairs:
        ax.plot([p[0] for p in pairs], [p[1] for p in pairs], label=label,
                linewidth=2.2 if bold else 1.0, marker="." if len(pairs) < 30 else None)


def acceptance_curve(train_log: str | Path, train_tokens: float | None, steps: int | None, k: int) -> list[dict]:
    """Per epoch: training tokens seen so far and the simulated acceptance length for k drafts
    of that epoch's last logged window, from the per-TTT-step accuracies `acc_j` of
    RUN/train_log.csv: 1 + sum_{j<k} prod_{i<=j} acc_i (docs/eval-results.md).

    These accuracies are measured on training batches (a running window), so they show how
    far training went, not held-out quality. Tokens per step = train_tokens / steps (from
    RUN/train_summary.json); None when unknown. Empty when the log lacks acc_0..acc_{k-1}.
    """
    train_log = Path(train_log)
    if not train_log.is_file():
        return []
    columns = read_train_log(train_log)
    acc_cols = [f"acc_{j}" for j in range(k)]
    if not columns or "step" not in columns or "epoch" not in columns or any(c not in columns for c in acc_cols):
        return []
    last_row_of_epoch: dict[int, int] = {}
    for row, epoch in enumerate(columns["epoch"]):
        if not math.isnan(epoch):
            last_row_of_epoch[int(epoch)] = row
    tokens_per_step = train_tokens / steps if train_tokens and steps else None
    curve = []
    for epoch, row in sorted(last_row_of_epoch.items()):
        running, length = 1.0, 1.0
        for name in acc_cols:
            running *= columns[name][row]
            length += running
        step = int(columns["step"][row])
        curve.append({"epoch": epoch, "step": step,
                      "training_tokens": None if tokens_per_step is None else round(step * tokens_per_step),
                      f"simulated_acceptance_length_k{k}": length})
    return curve


def read_train_summary(run_dir: str | Path) -> dict:
    """RUN/train_summary.json as a dict; {} when there is none, or with a warning naming it when
    it is not a JSON object (damaged, or another file): the eval goes on without what it adds
    (the simulated acceptance length, the curve's token axis)."""
    from eagleforge.errors import UserInputError
    from eagleforge.readers import read_json_object

    path = Path(run_dir) / "train_summary.json"
    if not path.is_file():
        return {}
    try:
        return read_json_object(path, "the trainer's summary")
    except UserInputError as err:
        log.warning("%s; evaluating without it (no simulated acceptance length)", err)
        return {}


def write_acceptance_curve(run_dir: str | Path, k: int) -> Path | None:
    """RUN/eval/acceptance_curve.csv and .png from acceptance_curve(); None without a train log."""
    run_dir = Path(run_dir)
    summary = read_train_summary(run_dir)
    curve = acceptance_curve(run_dir / "train_log.csv", summary.get("train_tokens"), summary.get("steps"), k)
    if not curve:
        return None
    out = run_dir / "eval" / "acceptance_curve.csv"
    out.parent.mkdir(parents=True, exist_ok=True)
    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, fieldnames=list(curve[0]))
    writer.writeheader()
    writer.writerows(curve)
    write_text_atomic(out, text.getvalue())
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    xs = [row["training_tokens"] if row["training_tokens"] is not None else row["step"] for row in curve]
    ax.plot(xs, [row[f"simulated_acceptance_length_k{k}"] for row in curve], marker="o")
    for x, row in zip(xs, curve):
        ax.annotate(f"epoch {row['epoch']}", (x, row[f"simulated_acceptance_length_k{k}"]), fontsize=7)
    ax.set_xlabel("training tokens" if curve[0]["training_tokens"] is not None else "step")
    ax.set_ylabel(f"simulated acceptance length, k={k} (train batches)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    _save(fig, out.with_suffix(".png"))
    return out


if __name__ == "__main__":  # python -m eagleforge.eval.plots RUN [k]
    import sys

    written = write_acceptance_curve(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 5)
    print(written.read_text(encoding="utf-8") if written else f"{sys.argv[1]}: no train_log.csv with acc_j columns")
