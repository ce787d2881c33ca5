"""Resumable training state: RUN/checkpoints/step-{step:06d}/, torch.distributed.checkpoint (DCP).

    .metadata, __{rank}_0.distcp   DCP: the model (trainable weights and buffers under the
                        prefix `draft.`, no frozen embed_tokens: RUN/vocab holds it) and the
                        optimizer's per-parameter state (exp_avg, exp_avg_sq, step), each rank
                        writing its own shards; a resume on another number of ranks reshards
    rng-{rank:05d}.safetensors  each rank's torch CPU (and current CUDA) generator state
    state.json          step, data position (epoch, global batch index), train_tokens, scheduler
                        state, the optimizer's param_groups (lr, betas, ...), world size, the
                        run's identity (run_id: pruning removes only its own run's checkpoints)
                        and the fingerprints of its data and RUN/vocab (inputs: a resume on
                        other ones is refused)
    draft_config.json   the Eagle3Config (to rebuild a plain draft for export)
    config.yaml         the resolved config of the run that wrote it

    checksums.json      every other file's byte size and sha256 (train/checkpoint_integrity.py)

Only tensors go through DCP. Its default planner stores any non-tensor value by torch.save and
reads it back with torch.load(weights_only=False); keeping the optimizer's param_groups in
state.json instead means no user data is ever unpickled. A checkpoint may come from elsewhere (a
shared disk, a download), so before DCP reads a tensor, resume and export check the checksums
and read `.metadata` through the restricted unpickler and structural check of
checkpoint_integrity.py: no code runs, no file outside the directory is read, no corrupt state
is loaded.

Atomic: every rank writes into `.tmp-step-...`; after a barrier rank 0 renames it to `step-*`,
so a directory named `step-*` is always whole; then the oldest of this run's checkpoints beyond
`keep_last` are removed (a checkpoint of another run, or one whose run is unknown, is never).
Multi-node runs need RUN on storage every node can write (each rank writes its own shard).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import shutil
import uuid
import warnings
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from eagleforge.atomic import clear_leftovers, disk_full_errno, disk_full_error, remove_path, replace_dir
from eagleforge.config import Config, save_config
from eagleforge.errors import UserInputError
from eagleforge.layout import Layout
from eagleforge.readers import read_json_object
from eagleforge.train.checkpoint_integrity import dcp_errors, describe_files, safe_reader, verify_checksums, write_checksums

log = logging.getLogger(__name__)

_STEP_RE = re.compile(r"^step-(\d{6,})$")
FROZEN_KEYS = ("embed_tokens.weight",)
MODEL_PREFIX = "draft."  # DraftWithLoss holds the draft as `draft`
STATE_FILE = "state.json"
DRAFT_CONFIG_FILE = "draft_config.json"
RUN_ID_KEY = "run_id"  # in state.json: the run that wrote the checkpoint
INPUTS_KEY = "inputs"  # in state.json: {"data" | "vocab": {"source": path, "sha256": ...}} the run trained on
SINGLE = Layout()


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


# ----------------------------------------------------------------------------- state dicts


def _state_dicts(model: torch.nn.Module, optimizer) -> tuple[dict, dict]:
    """(model state, optimizer state) keyed by parameter FQN, sharded tensors as DTensors; a
    fresh optimizer's state is created (zero-grad step at lr 0) so that it can be loaded into."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    return get_state_dict(model, optimizer, options=StateDictOptions(ignore_frozen_params=True))


@contextlib.contextmanager
def _single_process_ok():
    """DCP warns on every call without a process group that it assumes one process: that is the
    intent here (single-process runs and the export), so the warning is dropped."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is (disabled, )?unavailable or uninitialized")
        yield


def _check_tensors(tree, where: str) -> None:
    """Every leaf of what goes through DCP must be a tensor (see the module docstring)."""
    items = tree.items() if isinstance(tree, dict) else enumerate(tree)
    for key, value in items:
        if isinstance(value, (dict, list, tuple)):
            _check_tensors(value, f"{where}.{key}")
        elif not isinstance(value, torch.Tensor):
            raise TypeError(f"checkpoint: {where}.{key} is a {type(value).__name__}, not a tensor; it would be pickled")


def _param_groups_json(groups: list[dict]) -> list[dict]:
    return [{k: list(v) if isinstance(v, tuple) else v for k, v in g.items() if k != "params"} for g in groups]


def _jsonable(state: dict) -> dict:
    """A scheduler state_dict without its function references (LambdaLR keeps None for them)."""
    return {k: v for k, v in state.items() if isinstance(v, (int, float, str, bool, list, type(None)))}


# ----------------------------------------------------------------------------- save


def save_checkpoint(cfg: Config, step: int, model: torch.nn.Module, optimizer, scheduler, state: dict,
                    layout: Layout = SINGLE) -> Path:
    """Write RUN/checkpoints/step-{step:06d}/ (collective: every rank calls it), then prune to
    cfg.train.keep_last. `model` is the (possibly FSDP/DDP-wrapped) DraftWithLoss."""
    root = checkpoint_dir(cfg.run)
    final = root / f"step-{step:06d}"
    tmp = root / f".tmp-{final.name}"
    if layout.is_main:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    layout.barrier()
    model_state, optim_state = _state_dicts(model, optimizer)
    payload = {"model": model_state, "optim": optim_state["state"]}
    _check_tensors(payload, "state")
    # Every rank runs the same collectives whatever fails where: each phase turns this rank's
    # error into a line, and one collective after it decides for all (a rank that failed alone
    # must not leave the others waiting at a barrier until the process-group timeout).
    failure = _attempt(final, lambda: _write_files(tmp, cfg, step, model, scheduler, state, payload,
                                                   optim_state["param_groups"], layout))
    _raise_any(layout.all_gather_object(failure), tmp, layout)  # every rank's files are written
    described = {}

    def describe():
        described.update(describe_files(_fsync_own_files(tmp, layout)))  # each rank hashes what it wrote

    failure = _attempt(final, describe)
    results = layout.all_gather_object((failure, described))
    _raise_any([f for f, _ in results], tmp, layout)
    failure = None
    if layout.is_main:
        def publish():
            write_checksums(tmp, {name: v for _, files in results for name, v in files.items()})
            replace_dir(tmp, final)  # the same step saved again (the final save after a periodic one) replaces it
            prune_checkpoints(cfg.run, cfg.train.keep_last, state.get(RUN_ID_KEY))

        failure = _attempt(final, publish)
    _raise_any([layout.broadcast_object(failure)], tmp, layout)
    if layout.is_main:
        log.info("checkpoint %s", final)
    return final


def _write_files(tmp: Path, cfg: Config, step: int, model, scheduler, state: dict, payload: dict, param_groups: list,
                 layout: Layout) -> None:
    """This rank's share of a checkpoint: its DCP shards of `payload` (through DCP's own
    collectives), its RNG state, and on rank 0 state.json, draft_config.json and config.yaml."""
    import torch.distributed.checkpoint as dcp

    with _single_process_ok():
        dcp.save(payload, checkpoint_id=str(tmp), no_dist=not layout.distributed)
    _save_rng(tmp / f"rng-{layout.rank:05d}.safetensors", layout)
    if layout.is_main:
        record = {"step": step, "world_size": layout.world_size, "scheduler": _jsonable(scheduler.state_dict()),
                  "optimizer_param_groups": _param_groups_json(param_groups), **state}
        (tmp / STATE_FILE).write_text(json.dumps(record, indent=1), encoding="utf-8")
        draft = _inner_draft(model)
        (tmp / DRAFT_CONFIG_FILE).write_text(json.dumps(dataclasses.asdict(draft.config), indent=1), encoding="utf-8")
        save_config(cfg, tmp / "config.yaml")


def _attempt(final: Path, work) -> tuple[bool, str] | None:
    """Run `work`; None when it succeeds, else (a user error?, one line), so that every rank can
    still reach the collective that follows. Disk full is the user's (the checkpoint and the free
    space); anything else is logged with its traceback here and raised as a RuntimeError on every
    rank. Interrupts (Ctrl-C) pass through."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        work()
    except (Exception, CheckpointException) as err:  # CheckpointException is a BaseException
        full = _write_failure(final, err)
        if full is not None:
            return True, full
        log.exception("%s: writing the checkpoint failed", final)
        last = str(err).strip().splitlines()[-1][:300] if str(err).strip() else ""
        return False, f"{final}: cannot write the checkpoint ({type(err).__name__}: {last})"
    return None


def _raise_any(failures: list, tmp: Path, layout: Layout) -> None:
    """Every rank raises the first rank's failure, if any (rank 0 removes the unfinished directory)."""
    failures = [f for f in failures if f is not None]
    if failures:
        if layout.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        user_error, message = failures[0]
        raise (UserInputError if user_error else RuntimeError)(message)


def _fsync_own_files(tmp: Path, layout: Layout) -> list[Path]:
    """The files this rank wrote into `tmp` (DCP names a rank's data `__{rank}_{n}.distcp`; rank 0
    also writes the metadata and the JSON/YAML files), each fsynced."""
    own = [f for f in tmp.iterdir() if f.name.startswith(f"__{layout.rank}_") or f.name == f"rng-{layout.rank:05d}.safetensors"]
    if layout.is_main:
        own += [tmp / name for name in (".metadata", STATE_FILE, DRAFT_CONFIG_FILE, "config.yaml")]
    for file in own:
        with open(file, "rb") as f:
            os.fsync(f.fileno())
    return own


def _write_failure(final: Path, err: BaseException) -> str | None:
    """One line for a checkpoint write that failed for lack of room (DCP wraps each rank's error in
    a CheckpointException), or None for any other error (re-raised as it is)."""
    from torch.distributed.checkpoint.api import CheckpointException

    causes = [err]
    if isinstance(err, CheckpointException):
        causes += [exc for exc, _ in err.failures.values()]
    for cause in causes:
        while cause is not None:
            code = disk_full_errno(cause)
            if code is not None:
                return str(disk_full_error(final, code, kept="the unfinished checkpoint was removed, the last complete one kept"))
            cause = cause.__cause__ or cause.__context__
    return None


def _inner_draft(model: torch.nn.Module) -> torch.nn.Module:
    return getattr(model, "module", model).draft


def _save_rng(path: Path, layout: Layout) -> None:
    rng = {"cpu": torch.get_rng_state()}
    if layout.device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(layout.device)
    save_file(rng, str(path))


def new_run_id() -> str:
    """The identity of a run that starts afresh, recorded in every checkpoint it writes."""
    return uuid.uuid4().hex


def checkpoint_run_id(path: Path) -> str | None:
    """The run that wrote the checkpoint at `path`: state.json's run_id, None for a checkpoint
    written before runs recorded one, and a value no run has when state.json cannot be read."""
    try:
        state = json.loads((path / STATE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return "<unreadable state.json>"
    return state.get(RUN_ID_KEY) if isinstance(state, dict) else "<unreadable state.json>"


def prune_checkpoints(run_dir: str | os.PathLike, keep_last: int, run_id: str | None) -> None:
    """Remove run `run_id`'s checkpoints beyond its newest `keep_last` (rank 0). A checkpoint of
    another run is never touched: step numbers alone would let a run prune one it did not write."""
    if keep_last < 1:
        return
    own = [path for path in list_checkpoints(run_dir) if checkpoint_run_id(path) == run_id]
    for old in own[:-keep_last]:
        # Renamed first, removed after: a step-* name always holds a whole checkpoint, and what a
        # kill leaves half removed has a name tidy_checkpoints knows.
        doomed = old.with_name(f".pruned-{old.name}")
        remove_path(doomed)
        os.replace(old, doomed)
        shutil.rmtree(doomed, ignore_errors=True)


def tidy_checkpoints(run_dir: str | os.PathLike) -> None:
    """Remove what a killed save or prune left in RUN/checkpoints (rank 0, before a run looks for
    its resume point): a save's `.tmp-step-*` (a partial write, or the old copy after a swap), a
    prune's `.pruned-step-*`, a swap's `.old-step-*` (moved back where its step-* is missing).
    The prune the kill cut short is the resumed run's (prune_checkpoints, once its run is known:
    a rerun that resumes at its last step saves nothing, so no save would prune)."""
    root = checkpoint_dir(run_dir)
    if not root.is_dir():
        return
    for entry in sorted(root.iterdir()):
        if entry.name.startswith((".tmp-step-", ".pruned-step-")):
            remove_path(entry)
        elif m := re.match(r"\.old-(step-\d+)-", entry.name):
            clear_leftovers(root / m.group(1))


def refuse_a_fresh_run_over(checkpoint: Path) -> None:
    """train.resume=false where RUN/checkpoints holds a run's checkpoints: the fresh run would
    prune them by step number and mix its steps into train_log.csv; refused, naming what to do."""
    root = checkpoint.parent
    raise UserInputError(f"{root}: holds the checkpoints of an earlier run (the newest {checkpoint.name}) and train.resume=false: "
                         f"a fresh run here would mix with it; move {root} and {root.parent / 'train_log.csv'} aside (or delete "
                         "them) to start over, use a new run_dir, or set train.resume=true to continue that run")


# ----------------------------------------------------------------------------- load


def read_state(path: str | os.PathLike, layout: Layout = SINGLE) -> dict:
    """state.json of a checkpoint whose files all match their checksums (rank 0 verifies them, every
    rank gets the verdict); a one-line error when the directory is not a whole, intact checkpoint."""
    path = Path(path)
    failure = None
    if layout.is_main:
        try:
            for name in (".metadata", STATE_FILE):
                if not (path / name).is_file():
                    raise UserInputError(f"{path / name}: missing from the checkpoint (delete {path} to start over)")
            verify_checksums(path)
        except (UserInputError, OSError) as err:  # an unreadable file too: every rank gets the verdict
            failure = str(err)
    failure = layout.broadcast_object(failure)
    if failure is not None:
        raise UserInputError(failure)
    try:
        return read_json_object(path / STATE_FILE, "a checkpoint's state")
    except UserInputError as err:
        raise UserInputError(f"{err}; delete {path} to start over") from None


def load_checkpoint(path: str | os.PathLike, model: torch.nn.Module, optimizer, scheduler, layout: Layout = SINGLE) -> dict:
    """Restore model, optimizer, scheduler and this rank's RNG from `path` (collective); returns
    state.json's dict. The world size may differ from the one that wrote it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    path = Path(path)
    state = read_state(path, layout)
    model_state, optim_state = _state_dicts(model, optimizer)
    reader = safe_reader(path)
    _check_optimizer_kind(path, reader, optim_state)
    try:
        with _single_process_ok(), dcp_errors(reader, path):
            dcp.load({"model": model_state, "optim": optim_state["state"]}, storage_reader=reader, no_dist=not layout.distributed)
    except (RuntimeError, ValueError, KeyError) as err:
        raise UserInputError(f"{path}: cannot load the checkpoint into this draft ({str(err).splitlines()[0][:300]}); "
                             f"a changed model config? delete {path} to start over") from None
    groups = state.get("optimizer_param_groups")
    if groups is not None:
        if len(groups) != len(optim_state["param_groups"]):
            raise UserInputError(f"{path / STATE_FILE}: {len(groups)} optimizer param groups, this run has {len(optim_state['param_groups'])}")
        for saved, live in zip(groups, optim_state["param_groups"]):
            live.update({k: tuple(v) if k == "betas" else v for k, v in saved.items()})
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state,
                   options=StateDictOptions(ignore_frozen_params=True, strict=False))
    scheduler.load_state_dict({**scheduler.state_dict(), **state["scheduler"]})
    _load_rng(path / f"rng-{layout.rank:05d}.safetensors", layout)
    return state


def _check_optimizer_kind(path: Path, reader, optim_state: dict) -> None:
    """The optimizer state in the checkpoint is of this run's kind: bf16 parameters' fp32 master
    remainders (train/optimizer.py) are in it, or neither has them."""
    wanted = any("master_remainder" in entry for entry in optim_state["state"].values())
    with dcp_errors(reader, path):
        saved = any(key.endswith(".master_remainder") for key in reader.read_metadata().state_dict_metadata)
    if wanted != saved:
        have = "bf16 weights with fp32 master remainders" if saved else "no master remainders (fp32 weights, or bf16 AdamW moments)"
        raise UserInputError(f"{path}: its optimizer state holds {have}, this run trains with train.param_dtype "
                             f"{'bfloat16' if wanted else 'float32'}; set train.param_dtype to the run's, or start over in a new "
                             "run_dir")


def _load_rng(path: Path, layout: Layout) -> None:
    if not path.is_file():
        log.warning("%s: no RNG state for rank %d (the run had fewer ranks); keeping the current one", path, layout.rank)
        return
    rng = load_file(str(path))
    torch.set_rng_state(rng["cpu"])
    if "cuda" in rng and layout.device.type == "cuda":
        torch.cuda.set_rng_state(rng["cuda"], layout.device)


def find_resume_checkpoint(cfg: Config, layout: Layout = SINGLE) -> Path | None:
    """The newest complete checkpoint as rank 0 sees it (every rank gets the same answer)."""
    found = latest_checkpoint(cfg.run) if layout.is_main else None
    found = layout.broadcast_object(None if found is None else str(found))
    return None if found is None else Path(found)


# ----------------------------------------------------------------------------- export


def load_draft_from_checkpoint(path: str | os.PathLike, embed_tokens: torch.Tensor | None = None) -> torch.nn.Module:
    """A plain single-process Eagle3Draft (fp32, CPU) holding a checkpoint's weights, however many
    ranks wrote it: DCP reads the shards straight into the full tensors (no torch.save copy).
    Runs on one process even when a process group exists (no_dist)."""
    import torch.distributed.checkpoint as dcp

    from eagleforge.draft import Eagle3Config, Eagle3Draft

    path = Path(path)
    read_state(path)
    config_file = path / DRAFT_CONFIG_FILE
    if not config_file.is_file():
        raise UserInputError(f"{config_file}: missing from the checkpoint")
    try:
        sizes = read_json_object(config_file, "a draft's sizes")
    except UserInputError as err:
        raise UserInputError(f"{err}; delete {path} to start over") from None
    try:
        draft = Eagle3Draft(Eagle3Config(**sizes))
    except (TypeError, ValueError) as err:  # keys Eagle3Config does not have, values it refuses
        raise UserInputError(f"{config_file}: not a draft's sizes ({str(err).splitlines()[0][:200]}); delete {path} to start over") from None
    # state_dict() tensors share storage with the parameters and buffers: DCP loads in place.
    target = {MODEL_PREFIX + k: v for k, v in draft.state_dict().items() if k not in FROZEN_KEYS}
    reader = safe_reader(path)
    with _single_process_ok(), dcp_errors(reader, path):
        dcp.load({"model": target}, storage_reader=reader, no_dist=True)
    if embed_tokens is not None:
        draft.set_embed_tokens(embed_tokens)
    return draft


def load_model_weights(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """{name: tensor} of a checkpoint's draft weights (no prefix), full and on the CPU."""
    draft = load_draft_from_checkpoint(path)
    return {k: v for k, v in draft.state_dict().items() if k not in FROZEN_KEYS}


def export_checkpoint(path: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """RUN/draft (the vLLM/SGLang export format) from a checkpoint written by any number of ranks."""
    from eagleforge.draft import save_draft

    return save_draft(load_draft_from_checkpoint(path), out_dir)


# ----------------------------------------------------------------------------- resume


RESUME_MAY_CHANGE = (
    "run_dir", "train.max_steps", "train.epochs", "train.log_every", "train.save_every", "train.keep_last",
    "train.resume", "train.device", "train.parallel", "train.attention", "train.activation_checkpoint",
    "train.compile", "train.embed_device", "target.device", "target.tp", "target.pp", "target.gpu_memory_gib", "data.gen_batch_size",
    "extract.batch_tokens", "extract.overlap_writes", "target.prefill_attention", "target.moe_backend",
    "eval.",
    "train.cache_gb",  # online: the resumed run keeps what its cache still holds (train/state_cache.py settle)
)
# Removed keys (eagleforge.config.REMOVED_KEYS) that shaped the training: a checkpoint written with
# another value than the one each always has now is refused (the LK loss's only where it trained
# with the LK loss); the others changed nothing a resume would train differently.
RESUME_REMOVED_FIXED = ("train.step_weight_decay", "train.min_lr_ratio", "train.weight_decay", "train.lk_variant",
                        "train.lk_kl_scale", "train.lk_kl_decay")


def check_resume_inputs(checkpoint: Path, state: dict, inputs: dict | None, layout: Layout = SINGLE) -> None:
    """Refuse to resume from `checkpoint` when it was trained on other data or another vocabulary
    than this run has now (rank 0 compares state.json's fingerprints with `inputs`, every rank
    gets the verdict): training on would mix the two, and the export would belong to neither. A
    checkpoint written before fingerprints were recorded is not checked."""
    failure = None
    if layout.is_main:
        saved = state.get(INPUTS_KEY) if isinstance(state.get(INPUTS_KEY), dict) else {}
        changed = [f"{now['source']} (sha256 {str(saved[key].get('sha256'))[:12]}... when it was written, {now['sha256'][:12]}... now)"
                   for key, now in (inputs or {}).items()
                   if isinstance(saved.get(key), dict) and saved[key].get("sha256") != now["sha256"]]
        if changed:
            failure = (f"{checkpoint}: trained on other inputs than this run's: {'; '.join(changed)}; the data or the "
                       "vocabulary changed since it was written. Put them back to resume it, or start over in a new run_dir")
    failure = layout.broadcast_object(failure)
    if failure is not None:
        raise UserInputError(failure)


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _check_removed_keys(saved: dict, checkpoint: Path) -> None:
    """UserInputError where the checkpoint's config (flat) set a key of RESUME_REMOVED_FIXED to
    another value than the one it always has now."""
    from eagleforge.config import REMOVED_KEYS
    from eagleforge.modes import LK_LOSS_MODES

    fixed = [k for k in RESUME_REMOVED_FIXED if k in saved and saved[k] != REMOVED_KEYS[k][0]
             and (not k.startswith("train.lk_") or saved.get("train.loss") in LK_LOSS_MODES)]
    if fixed:
        diff = "; ".join(f"{k}: {saved[k]!r} in the checkpoint, removed and always {REMOVED_KEYS[k][0]!r} now" for k in fixed)
        raise UserInputError(f"{checkpoint}: cannot resume a run trained with a removed key's other value ({diff}; "
                             "CHANGELOG.md, \"Removed config keys\"): finish it with the version that wrote it, or use a "
                             "new run_dir to start over")


def check_resume_config(cfg: Config, checkpoint: Path, world_size: int = 1) -> None:
    """Refuse to resume from `checkpoint` when its config.yaml differs from `cfg` outside
    RESUME_MAY_CHANGE: one line with every differing key and both values. train.grad_accum may
    change with the number of ranks when world size x grad_accum (the batches of one optimizer
    step) stays the same: the checkpoint reshards, the steps are the same."""
    import yaml

    from eagleforge.config import config_to_dict

    file = checkpoint / "config.yaml"
    if not file.is_file():
        log.warning("%s: missing; cannot check that the resumed run has the same config", file)
        return
    try:
        saved = yaml.safe_load(file.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        raise UserInputError(f"{file}: not a readable config ({str(err).splitlines()[0][:200]}); delete {checkpoint} to start over") from None
    if not isinstance(saved, dict):
        raise UserInputError(f"{file}: not a config mapping; delete {checkpoint} to start over")
    saved, now = _flat(saved), _flat(config_to_dict(cfg))
    # A key only one side knows (written by another version) is not a difference.
    changed = [k for k in sorted(saved.keys() & now.keys()) if saved[k] != now[k]
               and not any(k == a or (a.endswith(".") and k.startswith(a)) for a in RESUME_MAY_CHANGE)]
    if "train.grad_accum" in changed:
        try:  # the world size only; load_checkpoint verifies every file right after this check
            saved_world = json.loads((checkpoint / STATE_FILE).read_text(encoding="utf-8")).get("world_size", 1)
        except (OSError, ValueError, AttributeError):
            saved_world = None
        if isinstance(saved_world, int) and isinstance(saved["train.grad_accum"], int) and \
                saved_world * saved["train.grad_accum"] == world_size * now["train.grad_accum"]:
            changed.remove("train.grad_accum")
    _check_removed_keys(saved, checkpoint)
    if changed:
        diff = "; ".join(f"{k}: {saved[k]!r} in the checkpoint, {now[k]!r} now" for k in changed)
        raise UserInputError(f"{checkpoint}: cannot resume with a changed config ({diff}); set the checkpoint's values, "
                             "or a new run_dir to start over (a resume may change only the run's length, "
                             "logging, saving, devices and performance keys: RESUME_MAY_CHANGE in eagleforge.train.checkpoint)")
