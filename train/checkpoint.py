"""Resumable training state: RUN/checkpoints/step-{step:06d}/.

    model.safetensors   the draft's trainable weights and buffers (not the frozen embed_tokens,
                        which the vocab stage keeps in RUN/vocab/target_head.safetensors)
    optimizer.pt        optimizer.state_dict(), torch.save; loaded with weights_only=True
    rng.safetensors     torch CPU (and CUDA) generator states
    state.json          step, data position (epoch, next batch), scheduler state, metrics
    config.yaml         the resolved config of the run that wrote it

A checkpoint is written to `.tmp-step-...` and renamed when complete, so a directory named
`step-*` is always whole; only the last `keep_last` are kept. Single process for now: under
FSDP2 this becomes torch.distributed.checkpoint with the same stateful pieces (model,
optimizer, scheduler, data position, step).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from eagleforge.config import Config, UserInputError, save_config

log = logging.getLogger(__name__)

_STEP_RE = re.compile(r"^step-(\d{6,})$")
FROZEN_KEYS = ("embed_tokens.weight",)


def checkpoint_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "checkpoints"


def list_checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = checkpoint_dir(run_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_RE.match(p.name))]
    return [p for _, p in sorted(found)]


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def save_checkpoint(cfg: Config, step: int, model: torch.nn.Module, optimizer, scheduler, state: dict) -> Path:
    """Write RUN/checkpoints/step-{step:06d}/ atomically, then prune to cfg.train.keep_last."""
    root = checkpoint_dir(cfg.run)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:06d}"
    tmp = root / f".tmp-{final.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    weights = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items() if k not in FROZEN_KEYS}
    save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt", "step": str(step)})
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng.update({f"cuda{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    save_file(rng, str(tmp / "rng.safetensors"))
    payload = {"step": step, "scheduler": _jsonable(scheduler.state_dict()), **state}
    (tmp / "state.json").write_text(json.dumps(payload, indent=1), encoding="utf-8")
    save_config(cfg, tmp / "config.yaml")
    for file in tmp.iterdir():
        with open(file, "rb") as f:
            os.fsync(f.fileno())
    if final.exists():  # the same step saved again (e.g. the final save after a periodic one)
        shutil.rmtree(final)
    os.replace(tmp, final)
    _prune(cfg.run, cfg.train.keep_last)
    log.info("checkpoint %s", final)
    return final


def _jsonable(state: dict) -> dict:
    """A scheduler state_dict without its function references (LambdaLR keeps None for them)."""
    return {k: v for k, v in state.items() if isinstance(v, (int, float, str, bool, list, type(None)))}


def _prune(run_dir: Path, keep_last: int) -> None:
    if keep_last < 1:
        return
    for old in list_checkpoints(run_dir)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(path: str | os.PathLike, model: torch.nn.Module, optimizer, scheduler) -> dict:
    """Restore model, optimizer, scheduler and RNG from `path`; returns state.json's dict."""
    path = Path(path)
    for name in ("model.safetensors", "optimizer.pt", "state.json"):
        if not (path / name).is_file():
            raise UserInputError(f"{path / name}: missing from the checkpoint (delete {path} to start over)")
    weights = load_file(str(path / "model.safetensors"), device=str(next(model.parameters()).device))
    missing, unexpected = model.load_state_dict(weights, strict=False)
    missing = [k for k in missing if k not in FROZEN_KEYS]
    if missing or unexpected:
        raise UserInputError(f"{path / 'model.safetensors'}: missing keys {missing}, unexpected keys {unexpected}")
    optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True, map_location="cpu"))
    state = json.loads((path / "state.json").read_text(encoding="utf-8"))
    scheduler.load_state_dict({**scheduler.state_dict(), **state["scheduler"]})
    rng_file = path / "rng.safetensors"
    if rng_file.is_file():
        rng = load_file(str(rng_file))
        torch.set_rng_state(rng["cpu"])
        cuda = [rng[k] for k in sorted(rng) if k.startswith("cuda")]
        if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)
    return state
