"""Vocabulary stage: the draft vocabulary and the target's head rows for it.

    python -m eagleforge.vocab [--config FILE] [section.key=value ...]

Counts the target token ids over the loss-masked tokens of the training samples in
RUN/hidden/ (the last train.holdout_samples samples are held out, as in training), keeps the
top Vd = min(vocab.draft_vocab_size, V) ids by count (ties broken by the lower id; when fewer
than Vd ids are seen, the lowest unseen ids fill the rest), sorted ascending, and writes

    RUN/vocab/vocab_map.safetensors    d2t int64 [Vd] (target_id = i + d2t[i]), t2d bool [V], counts int64 [V]
    RUN/vocab/target_head.safetensors  lm_head [Vd, H] (target head rows of the draft vocabulary),
                                       embed_tokens [V, H] (the target input embedding: the draft's frozen one)

The head and embedding are read by tensor name from the target's safetensors files (never the
whole model). Both files carry the identity of the shards, holdout and Vd in their metadata;
a second run with the same inputs returns at once.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from eagleforge.atomic import atomic_path
from eagleforge.cli import run_main
from eagleforge.config import Config, save_config
from eagleforge.errors import UserInputError
from eagleforge.readers import open_safetensors, read_json_object

log = logging.getLogger(__name__)

VOCAB_MAP = "vocab_map.safetensors"
TARGET_HEAD = "target_head.safetensors"

# Tensor names of the head / input embedding in HF checkpoints, most specific first
# (Kimi-K2.5 keeps its text weights under `language_model.`).
HEAD_NAMES = ("lm_head.weight", "language_model.lm_head.weight", "model.language_model.lm_head.weight")
EMBED_NAMES = (
    "model.embed_tokens.weight",
    "language_model.model.embed_tokens.weight",
    "model.language_model.embed_tokens.weight",
    "embed_tokens.weight",
    "transformer.wte.weight",
)


# ----------------------------------------------------------------------------- vocabulary logic


def count_tokens(token_batches, vocab_size: int) -> torch.Tensor:
    """Counts int64 [V] of the ids in an iterable of (input_ids [n], loss_mask [n]) pairs,
    loss-masked tokens only."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for input_ids, loss_mask in token_batches:
        ids = input_ids.to(torch.int64)[loss_mask.to(torch.bool)]
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
            raise UserInputError(f"token id {int(ids.max())} outside the target vocabulary of {vocab_size}")
        counts += torch.bincount(ids, minlength=vocab_size)
    return counts


def select_draft_vocab(counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t int64 [Vd], t2d bool [V]) from counts [V]: the top Vd ids by count, ties by lower id,
    unseen ids in ascending order after the seen ones (= padding with the lowest unused ids),
    then sorted ascending. Vd = min(draft_vocab_size, V)."""
    vocab_size = counts.shape[0]
    if draft_vocab_size < 1:
        raise ValueError(f"vocab.draft_vocab_size must be >= 1, got {draft_vocab_size}")
    vd = min(draft_vocab_size, vocab_size)
    # A stable sort on -count keeps equal counts in ascending id order.
    order = torch.sort(-counts.to(torch.int64), stable=True).indices
    draft_ids = torch.sort(order[:vd]).values  # [Vd] ascending target ids
    d2t = draft_ids - torch.arange(vd, dtype=torch.int64)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[draft_ids] = True
    return d2t, t2d


def draft_to_target_ids(d2t: torch.Tensor) -> torch.Tensor:
    """[Vd] target ids of the draft vocabulary (target_id = i + d2t[i])."""
    return torch.arange(d2t.shape[0], dtype=torch.int64, device=d2t.device) + d2t


def coverage(counts: torch.Tensor, t2d: torch.Tensor) -> float:
    """Share of the counted (loss-masked) tokens whose id is in the draft vocabulary."""
    total = int(counts.sum())
    return float(counts[t2d].sum()) / total if total else 0.0


# ----------------------------------------------------------------------------- target tensors


def _tensor_index(target_dir: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file of an HF checkpoint directory."""
    index = target_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json_object(index, "a safetensors index").get("weight_map", {})
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise UserInputError(f"{index}: weight_map is not a mapping of tensor names to file names")
        return {name: target_dir / file for name, file in weight_map.items()}
    names: dict[str, Path] = {}
    for file in sorted(target_dir.glob("*.safetensors")):
        with open_safetensors(file) as f:
            names.update({name: file for name in f.keys()})
    return names


def _tied(target_dir: Path) -> bool:
    config_file = target_dir / "config.json"
    if not config_file.is_file():
        return False
    config = read_json_object(config_file, "a model's config.json")
    text = config.get("text_config") or {}
    if not isinstance(text, dict):
        raise UserInputError(f"{config_file}: text_config is not a JSON object")
    return bool(text.get("tie_word_embeddings", config.get("tie_word_embeddings", False)))


def _read(index: dict[str, Path], name: str) -> torch.Tensor:
    with open_safetensors(index[name]) as f:
        if name not in f.keys():
            raise UserInputError(f"{index[name]}: no tensor {name} (the index names this file for it)")
        return f.get_tensor(name)


def read_target_head(target_dir: str | os.PathLike, target_cfg=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(lm_head [V, H], embed_tokens [V, H]) of the target, read by name from its safetensors
    files; the head falls back to the embedding when the target ties them or has no head.
    A target without safetensors files (a GGUF) is loaded on the CPU through `target_cfg`."""
    target_dir = Path(target_dir)
    index = _tensor_index(target_dir) if target_dir.is_dir() else {}
    if not index:
        if target_cfg is None:
            raise FileNotFoundError(f"{target_dir}: no *.safetensors files to read the target head from")
        return _head_from_model(target_cfg)
    embed_name = next((n for n in EMBED_NAMES if n in index), None)
    if embed_name is None:
        embed_name = next((n for n in index if n.endswith("embed_tokens.weight") and "vision" not in n), None)
    if embed_name is None:
        raise UserInputError(f"{target_dir}: no input embedding among the safetensors tensors (looked for {list(EMBED_NAMES)})")
    embed = _read(index, embed_name)
    head_name = next((n for n in HEAD_NAMES if n in index), None)
    if head_name is None or _tied(target_dir):
        log.info("target %s: lm_head tied to %s", target_dir, embed_name)
        return embed, embed
    return _read(index, head_name), embed


def _head_from_model(target_cfg) -> tuple[torch.Tensor, torch.Tensor]:
    """Fallback for a target without safetensors files (e.g. a GGUF): load it on the CPU."""
    from eagleforge.target.loading import load_target

    log.info("target.path %s holds no safetensors files: loading the target on the CPU to read its head", target_cfg.path)
    model, _ = load_target(target_cfg, torch.device("cpu"))
    embed = model.get_input_embeddings().weight.detach()
    head = model.get_output_embeddings().weight.detach()
    return head, embed


# ----------------------------------------------------------------------------- the stage


def _identity(manifest_file: Path, cfg: Config) -> str:
    """sha256 over what the outputs depend on: the shards (names, sizes, checksums), the
    holdout, Vd and the target."""
    manifest = read_json_object(manifest_file, "a shard manifest")
    key = {
        "shards": manifest.get("shards"),
        "target": manifest.get("target"),
        "holdout_samples": cfg.train.holdout_samples,
        "draft_vocab_size": cfg.vocab.draft_vocab_size,
        "target_path": cfg.target.path,
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()


def vocab_up_to_date(files: list[Path], identity: str) -> bool:
    """Both files present, whole (readable, their tensors' sha256 and contents check out) and
    made from these inputs. A damaged file is not up to date: the stage writes it again."""
    if not all(file.is_file() for file in files):
        return False
    map_file, head_file = files
    try:
        vocab, map_meta = _read_checked(map_file, _NAMES[VOCAB_MAP])
        head, head_meta = _read_checked(head_file, _NAMES[TARGET_HEAD])
        check_vocab_map(vocab, map_file)
        check_target_head(head, head_file)
        check_vocab_files(vocab, head, map_file.parent)
    except UserInputError as err:
        log.warning("%s; building the vocabulary files again", err)
        return False
    return map_meta.get("identity") == identity and head_meta.get("identity") == identity


def tensors_sha256(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over the tensors' names, dtypes, shapes and bytes (sorted by name): stored in the
    file's metadata and checked on every read, so a flipped bit in the data is seen."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        digest.update(f"{name}|{t.dtype}|{list(t.shape)}|".encode())
        if t.numel():
            digest.update(t.reshape(-1).view(torch.uint8).numpy())  # the buffer itself, no copy
    return digest.hexdigest()


def save_vocab_file(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata={**metadata, "sha256": tensors_sha256(tensors)})


# The tensors each vocabulary file holds.
_NAMES = {VOCAB_MAP: ("d2t", "t2d", "counts"), TARGET_HEAD: ("lm_head", "embed_tokens")}


def _read_checked(path: Path, names: tuple[str, ...]) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, metadata) of a vocabulary file, or a UserInputError naming it: not readable as
    safetensors, a tensor missing, or its tensors' sha256 not the one recorded at writing."""
    try:
        handle = open_safetensors(path)
    except UserInputError as err:
        raise UserInputError(f"{err}; rerun the vocab stage") from None
    try:
        with handle as f:
            metadata = f.metadata() or {}
            missing = [n for n in names if n not in f.keys()]
            if missing:
                raise UserInputError(f"{path}: no tensor {', '.join(missing)} (damaged; rerun the vocab stage)")
            tensors = {name: f.get_tensor(name) for name in names}
    except UserInputError:
        raise
    except Exception as err:  # SafetensorError from a damaged header, an OSError
        raise UserInputError(f"{path}: not a readable safetensors file ({str(err)[:200]}); rerun the vocab stage") from None
    recorded = metadata.get("sha256")
    if recorded is not None and recorded != tensors_sha256(tensors):
        raise UserInputError(f"{path}: its tensors' sha256 does not match the one recorded when it was written "
                             f"(damaged); rerun the vocab stage")
    return tensors, metadata


def check_vocab_map(vocab: dict[str, torch.Tensor], path: Path) -> None:
    """d2t int64 [Vd], t2d bool [V], counts int64 [V] >= 0, and d2t's target ids (i + d2t[i])
    strictly ascending in [0, V) and exactly the ids t2d marks."""
    d2t, t2d, counts = vocab["d2t"], vocab["t2d"], vocab["counts"]
    if d2t.dtype != torch.int64 or d2t.dim() != 1 or d2t.numel() < 1:
        raise UserInputError(f"{path}: d2t must be int64 [Vd >= 1], got {d2t.dtype} {tuple(d2t.shape)}")
    if t2d.dtype != torch.bool or t2d.dim() != 1 or counts.dtype != torch.int64 or tuple(counts.shape) != tuple(t2d.shape):
        raise UserInputError(f"{path}: t2d must be bool [V] and counts int64 [V], got {t2d.dtype} {tuple(t2d.shape)} "
                             f"and {counts.dtype} {tuple(counts.shape)}")
    if counts.numel() and int(counts.min()) < 0:
        raise UserInputError(f"{path}: counts holds a negative count {int(counts.min())}")
    ids = draft_to_target_ids(d2t)
    if int(ids.min()) < 0 or int(ids.max()) >= t2d.numel() or (ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all())):
        raise UserInputError(f"{path}: d2t gives target ids outside [0, {t2d.numel()}) or not ascending")
    if int(t2d.sum()) != d2t.numel() or not bool(t2d[ids].all()):
        raise UserInputError(f"{path}: t2d marks {int(t2d.sum())} ids, not the {d2t.numel()} target ids of d2t")


def check_target_head(head: dict[str, torch.Tensor], path: Path) -> None:
    """lm_head [Vd, H] and embed_tokens [V, H], floating point and finite (a NaN in the teacher's
    head makes every loss NaN)."""
    lm_head, embed = head["lm_head"], head["embed_tokens"]
    for name, t in (("lm_head", lm_head), ("embed_tokens", embed)):
        if not t.is_floating_point() or t.dim() != 2 or t.numel() == 0:
            raise UserInputError(f"{path}: {name} must be a non-empty 2-D float tensor, got {t.dtype} {tuple(t.shape)}")
        if not bool(torch.isfinite(t).all()):
            raise UserInputError(f"{path}: {name} holds NaN/Inf; rerun the vocab stage (or check the target's weights)")
    if lm_head.shape[1] != embed.shape[1]:
        raise UserInputError(f"{path}: lm_head {tuple(lm_head.shape)} and embed_tokens {tuple(embed.shape)} differ in width")


def check_vocab_files(vocab: dict[str, torch.Tensor], head: dict[str, torch.Tensor], vocab_dir: Path) -> None:
    """The two files agree: one head row per draft token, one embedding row per target token."""
    if head["lm_head"].shape[0] != vocab["d2t"].shape[0] or head["embed_tokens"].shape[0] != vocab["t2d"].shape[0]:
        raise UserInputError(
            f"{vocab_dir / TARGET_HEAD}: lm_head {tuple(head['lm_head'].shape)} / embed_tokens "
            f"{tuple(head['embed_tokens'].shape)} do not fit {vocab_dir / VOCAB_MAP} (Vd {vocab['d2t'].shape[0]}, "
            f"V {vocab['t2d'].shape[0]}); rerun the vocab stage")


def training_sample_count(num_samples: int, holdout_samples: int, source: str) -> int:
    """Samples used for training: all but the last `holdout_samples`."""
    if holdout_samples < 0 or holdout_samples >= num_samples:
        raise UserInputError(
            f"{source}: train.holdout_samples={holdout_samples} must be >= 0 and leave training samples out of {num_samples}"
        )
    return num_samples - holdout_samples


def _load_vocab_file(run_dir: str | os.PathLike, name: str, check) -> dict[str, torch.Tensor]:
    path = Path(run_dir) / "vocab" / name
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: run `python -m eagleforge.vocab` first")
    tensors, _ = _read_checked(path, _NAMES[name])
    check(tensors, path)
    return tensors


def vocab_fingerprint(run_dir: str | os.PathLike) -> str:
    """sha256 over RUN/vocab's two files' tensors (the sha256 each file records of them, checked
    at every read; computed for a file written without one): recorded in each checkpoint, so a
    resume with another vocabulary or target head is refused at its start."""
    digest = hashlib.sha256()
    for name in (VOCAB_MAP, TARGET_HEAD):
        path = Path(run_dir) / "vocab" / name
        with open_safetensors(path) as f:
            recorded = (f.metadata() or {}).get("sha256")
        digest.update(f"{name}:{recorded or tensors_sha256(_read_checked(path, _NAMES[name])[0])}\n".encode())
    return digest.hexdigest()


def load_vocab_map(run_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    """{"d2t", "t2d", "counts"} from RUN/vocab/vocab_map.safetensors."""
    return _load_vocab_file(run_dir, VOCAB_MAP, check_vocab_map)


def load_target_head(run_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    """{"lm_head" [Vd, H], "embed_tokens" [V, H]} from RUN/vocab/target_head.safetensors."""
    return _load_vocab_file(run_dir, TARGET_HEAD, check_target_head)


def build_vocab(cfg: Config) -> dict:
    """Compute and save the vocabulary files (or reuse them); returns a small summary dict."""
    from eagleforge.shards import ShardReader

    hidden_dir = cfg.run / "hidden"
    manifest_file = hidden_dir / "manifest.json"
    if not manifest_file.is_file():
        raise FileNotFoundError(f"{manifest_file} not found: run `python -m eagleforge.extract` first")
    check_shards_match_samples(cfg.run)
    out_dir = cfg.run / "vocab"
    map_file, head_file = out_dir / VOCAB_MAP, out_dir / TARGET_HEAD
    identity = _identity(manifest_file, cfg)
    if vocab_up_to_date([map_file, head_file], identity):
        vocab = load_vocab_map(cfg.run)
        cov = coverage(vocab["counts"], vocab["t2d"])
        log.info("%s is up to date with the shards (Vd=%d, coverage %.4f)", map_file, vocab["d2t"].shape[0], cov)
        return {"draft_vocab_size": int(vocab["d2t"].shape[0]), "coverage": cov, "reused": True}

    reader = ShardReader(hidden_dir)
    vocab_size = int(reader.manifest["target"]["vocab_size"])
    n_train = training_sample_count(len(reader), cfg.train.holdout_samples, str(manifest_file))
    counts = count_tokens(_training_tokens(reader, n_train), vocab_size)
    d2t, t2d, cov = write_vocab_files(cfg, counts, identity)
    seen = int((counts > 0).sum())
    log.info(
        "draft vocabulary: Vd=%d of V=%d (%d ids seen in %d loss-masked tokens of %d samples), coverage %.4f -> %s",
        d2t.shape[0], vocab_size, seen, int(counts.sum()), n_train, cov, out_dir,
    )
    return {"draft_vocab_size": int(d2t.shape[0]), "coverage": cov, "reused": False}


def write_vocab_files(cfg: Config, counts: torch.Tensor, identity: str) -> tuple[torch.Tensor, torch.Tensor, float]:
    """RUN/vocab from token counts [V] (the vocab stage's from the shards, online training's from
    the samples): the draft vocabulary, the target head's rows of it and the target's embedding,
    both files stamped with `identity`. -> (d2t, t2d, coverage)."""
    from eagleforge.target.loading import target_path

    vocab_size = counts.shape[0]
    d2t, t2d = select_draft_vocab(counts, cfg.vocab.draft_vocab_size)
    head, embed = read_target_head(target_path(cfg.target), cfg.target)
    if head.shape[0] < vocab_size or embed.shape[0] < vocab_size:
        raise UserInputError(f"target head {tuple(head.shape)} / embedding {tuple(embed.shape)} smaller than the vocab_size {vocab_size}")
    out_dir = cfg.run / "vocab"
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = {"identity": identity, "format": "pt"}
    save_vocab_file({"d2t": d2t, "t2d": t2d, "counts": counts}, out_dir / VOCAB_MAP, meta)
    save_vocab_file({"lm_head": head[draft_to_target_ids(d2t)], "embed_tokens": embed[:vocab_size]}, out_dir / TARGET_HEAD, meta)
    return d2t, t2d, coverage(counts, t2d)


def build_vocab_from_samples(cfg: Config, samples: list[dict], header: dict, samples_sha256: str | None = None) -> None:
    """RUN/vocab from the samples' loss-masked ids of the training samples (the vocab stage counts
    the same tokens from the shards); reused when the samples, holdout, Vd and target are unchanged.
    samples_sha256: rows_sha256(samples) when the caller has it (hashing many samples takes a while)."""
    from eagleforge.shards import rows_sha256

    out = cfg.run / "vocab"
    files = [out / VOCAB_MAP, out / TARGET_HEAD]
    key = {"samples": samples_sha256 or rows_sha256(samples),
           "holdout_samples": cfg.train.holdout_samples, "draft_vocab_size": cfg.vocab.draft_vocab_size,
           "target_path": cfg.target.path, "source": "online"}
    identity = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
    if vocab_up_to_date(files, identity):
        log.info("%s is up to date with the samples", out)
        return
    vocab_size = int(header["target"]["vocab_size"])
    n_train = training_sample_count(len(samples), cfg.train.holdout_samples, str(cfg.run / "data" / "samples.jsonl"))
    counts = count_tokens(((torch.tensor(s["input_ids"]), torch.tensor(s["loss_mask"])) for s in samples[:n_train]), vocab_size)
    d2t, _, cov = write_vocab_files(cfg, counts, identity)
    log.info("draft vocabulary from the samples: Vd=%d of V=%d, coverage %.4f -> %s", d2t.shape[0], vocab_size, cov, out)


def check_shards_match_samples(run_dir: Path) -> None:
    """The shards were made from the samples RUN/data/samples.jsonl holds now: each shard's
    recorded content_sha256 (rows_sha256 of its chunk, cut to the manifest's max_length as the
    extractor cuts them) against the same rows read from samples.jsonl. A changed data source
    keeps the ids, so without this the vocabulary (and the training) would silently use the old
    shards. Skipped when there is no samples.jsonl or the shards record no content hash."""
    from eagleforge.data.stage import load_samples
    from eagleforge.shards import load_manifest, rows_sha256

    manifest = load_manifest(run_dir / "hidden")
    entries = [e for e in manifest["shards"] if "content_sha256" in e]
    samples_file = run_dir / "data" / "samples.jsonl"
    if not entries or not samples_file.is_file():
        return
    by_id = {row["id"]: row for row in load_samples(run_dir)}
    max_length = manifest.get("max_length")
    for entry in entries:
        ids = sorted(entry["sample_ids"] + entry.get("skipped_ids", []))
        missing = [i for i in ids if i not in by_id]
        rows = [{"id": i, "input_ids": by_id[i]["input_ids"][:max_length], "loss_mask": by_id[i]["loss_mask"][:max_length]}
                for i in ids if i in by_id] if isinstance(max_length, int) else [by_id[i] for i in ids if i in by_id]
        if missing or rows_sha256(rows) != entry["content_sha256"]:
            what = f"sample ids {missing[:5]} are not in {samples_file}" if missing else f"its samples differ from {samples_file}'s"
            raise UserInputError(f"{run_dir / 'hidden' / entry['file']}: {what} (the data changed since extraction); "
                                 f"extract again into a new run directory")


def _training_tokens(reader, n_train: int):
    """(input_ids, loss_mask) of the first `n_train` samples, one shard at a time; reads only
    those two tensors (docs/shards.md), never the hidden states."""
    first = 0  # global index of the shard's first sample
    for entry in tqdm(reader.shards, desc="counting tokens", unit="shard", mininterval=2):
        if first >= n_train:
            break
        with open_safetensors(reader.hidden_dir / entry["file"]) as f:
            offsets = f.get_tensor("sample_offsets")  # [S+1]
            end = int(offsets[min(entry["samples"], n_train - first)])
            yield f.get_slice("input_ids")[:end], f.get_slice("loss_mask")[:end]
        first += entry["samples"]


def main(cfg: Config) -> None:
    if cfg.train.source == "online":  # `make train ... train.source=online`: the train stage counts them from the samples
        print("vocab: train.source=online: the train stage counts the draft vocabulary from the samples "
              "(vocab.build_vocab_from_samples)")
        return
    save_config(cfg, cfg.run / "config.yaml")
    summary = build_vocab(cfg)
    print(f"draft vocabulary: {summary['draft_vocab_size']} tokens, coverage {summary['coverage']:.4f} of loss-masked tokens")


if __name__ == "__main__":
    run_main(main, "Count tokens over the shards and choose the EAGLE-3 draft vocabulary.", sections=("target", "vocab", "train"))
