"""Hidden-state shards (docs/shards.md): a crash-safe writer and a memory-mapped reader.

A shard is one safetensors file holding many samples packed end to end, no padding:

    input_ids          int32          [N]
    loss_mask          uint8          [N]
    aux_hidden_states  storage dtype  [N, k*H]   the k aux layers concatenated, ascending order
    last_hidden_state  storage dtype  [N, H]     after the target's final norm
    sample_offsets     int64          [S+1]      sample i is rows offsets[i]:offsets[i+1]
    target_argmax      int32          [N]        optional: full-vocabulary greedy next token

Shard index = chunk index. The extractor cuts the samples (in id order) into fixed chunks of
`samples_per_shard`; chunk c becomes shard c, so a killed and resumed run, or a run with a
different number of processes, produces the same shards. A single process writes
`shard-{c:05d}.safetensors`; data-parallel group g writes `shard-g{g}-{c:05d}.safetensors`
(c is still the global chunk index, so a shard's name says which samples it holds).

Crash safety: a shard is written under `.tmp-<name>-<host>-<pid>/<name>` (eagleforge/atomic.py), fsynced, renamed, and only then listed in a
manifest, itself written as tmp + fsync + rename (+ fsync of the directory). A shard file that
no manifest lists is garbage from a killed run and is rewritten on resume.

Concurrency (the choice): a single process writes `manifest.json` after each shard. Group g
never touches `manifest.json`; it writes its own part `manifest-g{g}.json` after each shard, so
concurrent groups never clobber each other's records. At the end, under a barrier, rank 0
merges every part (and any shards already in `manifest.json`) into `manifest.json`. The reader
accepts `manifest.json`, the parts, or both (the union of their shards, each file once), so a
multi-group run killed before the merge is still readable and resumable. Parts are kept after
the merge: they are small and they are what resume reads.

manifest.json:

    {"format_version": 1,
     "target": {"path", "architecture", "num_layers", "hidden_size", "vocab_size"},
     "aux_layer_ids": [1, 14, 26], "aux_layer_convention": AUX_LAYER_CONVENTION,
     "vllm_aux_layer_ids": [2, 15, 27],
     "storage_dtype": "bfloat16", "has_target_argmax": true,
     "tokenizer": ..., "chat_template": ..., "max_length": 2048,
     "shards": [{"file", "index", "group", "samples", "tokens", "bytes", "sha256",
                 "sample_ids": [...], "skipped_ids": [...]}]}

`skipped_ids` are samples of the chunk that were not written (NaN/Inf states); the chunk is
complete when sample_ids + skipped_ids are exactly its ids.

fp8 storage (optional extension of the format; bf16 stays the default): with
storage_dtype "float8_e4m3fn" the two hidden-state tensors are stored as e4m3 values scaled per
token and per aux layer, plus their fp32 scales:

    aux_hidden_states        float8_e4m3fn  [N, k*H]   value / scale, saturated at +-448
    aux_hidden_states_scale  float32        [N, k]     amax over the layer's H columns / 448
    last_hidden_state        float8_e4m3fn  [N, H]
    last_hidden_state_scale  float32        [N, 1]

Bytes per token (k + 1) * (H + 4) instead of (k + 1) * 2H. ShardReader returns the dequantized
states as bfloat16 (value * scale), so a reader of a sample never sees the scales.

Integrity: a reader checks every shard's byte size (and sha256 on request); a failing shard is an
error naming the file, or, with `skip_corrupt`, left out with a warning and counted. File names
in a manifest must be plain shard file names (no directory part, no `..`): a manifest can never
make a reader or writer touch a file outside its directory.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
import os
import re
import threading
from pathlib import Path
from typing import Any, Iterable

import torch

from eagleforge.atomic import atomic_path, disk_full_errno, disk_full_error, write_json_atomic
from eagleforge.config import check_model_sizes
from eagleforge.errors import UserInputError
from eagleforge.readers import open_safetensors

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
AUX_LAYER_CONVENTION = (
    "output of 0-indexed decoder layer i = transformers hidden_states[i+1]; vLLM input-of-layer ids = i+1"
)
STORAGE_DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
}
# Header keys that must agree between a run and the shards already on disk (resume, parts).
_HEADER_KEYS = ("format_version", "target", "aux_layer_ids", "storage_dtype", "has_target_argmax")
_TENSORS = ("input_ids", "loss_mask", "aux_hidden_states", "last_hidden_state", "target_argmax")
_PART_RE = re.compile(r"^manifest-g(\d+)\.json$")
# What a manifest may name as a shard file: a plain name in the hidden directory, never a path.
_SHARD_FILE_RE = re.compile(r"^shard-(?:g\d+-)?\d+\.safetensors$")
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
SCALE_SUFFIX = "_scale"  # fp8 storage: aux_hidden_states_scale, last_hidden_state_scale
MAX_OPEN_SHARDS = 64  # per reader and process


def shard_name(index: int, group: int | None = None) -> str:
    return f"shard-{index:05d}.safetensors" if group is None else f"shard-g{group}-{index:05d}.safetensors"


def rows_sha256(rows: Iterable[dict]) -> str:
    """sha256 of the samples a chunk is made from (id, input_ids, loss_mask of each row, in
    order): recorded with the shard as `content_sha256`, so a resume keys on the samples' tokens,
    not only on their ids (a changed data source keeps the ids 0..n-1)."""
    digest = hashlib.sha256()
    for row in rows:
        digest.update(json.dumps([int(row["id"]), [int(t) for t in row["input_ids"]], [int(m) for m in row["loss_mask"]]],
                                 separators=(",", ":")).encode())
        digest.update(b"\n")
    return digest.hexdigest()


def file_sha256(path: Path, block_bytes: int = 1 << 24) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(block_bytes):
            digest.update(block)
    return digest.hexdigest()


def _umask() -> int:
    mask = os.umask(0o022)  # the only way to read it is to set it; put it straight back
    os.umask(mask)
    return mask




def _write_json_atomic(path: Path, data: dict) -> None:
    try:
        write_json_atomic(path, data, indent=1)  # on failure the old manifest stays as it was
    except OSError as err:
        code = disk_full_errno(err)
        if code is not None:
            raise disk_full_error(path, code) from None
        raise


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as err:
        raise UserInputError(f"{path}: not valid JSON ({type(err).__name__}: {str(err)[:200]})") from None
    if not isinstance(data, dict) or not isinstance(data.get("shards"), list):
        raise UserInputError(f"{path}: not a shard manifest (no 'shards' list)")
    _check_manifest_header(data, path)
    for position, entry in enumerate(data["shards"]):
        _check_entry(entry, position, path)
    return data


def _check_manifest_header(data: dict, path: Path) -> None:
    """The header fields readers use have the types the writer gives them."""
    def bad(key: str, want: str) -> UserInputError:
        return UserInputError(f"{path}: '{key}' must be {want}, got {data.get(key)!r:.80}")

    if "format_version" in data and data["format_version"] != FORMAT_VERSION:
        raise bad("format_version", str(FORMAT_VERSION))
    if "storage_dtype" in data and data["storage_dtype"] not in list(STORAGE_DTYPES):
        raise bad("storage_dtype", f"one of {list(STORAGE_DTYPES)}")
    aux = data.get("aux_layer_ids", [])
    if not isinstance(aux, list) or not all(type(i) is int for i in aux):
        raise bad("aux_layer_ids", "a list of integers")
    target = data.get("target", {})
    if not isinstance(target, dict) or not all(
            type(target[k]) is int and target[k] > 0 for k in ("num_layers", "hidden_size", "vocab_size") if k in target):
        raise bad("target", "an object with positive integer num_layers, hidden_size, vocab_size")
    # the vocab stage allocates [vocab_size] counts, the trainer sizes the draft by hidden_size
    check_model_sizes({"num_hidden_layers": target.get("num_layers"), "hidden_size": target.get("hidden_size"),
                       "vocab_size": target.get("vocab_size")}, f"{path}: target")


# Fields every manifest shard entry needs, and their types (bool is refused where int is asked).
_ENTRY_FIELDS = {"file": str, "index": int, "samples": int, "tokens": int, "bytes": int, "sha256": str,
                 "sample_ids": list}


def _check_entry(entry: object, position: int, path: Path) -> None:
    """A manifest shard entry is well formed and names a plain shard file (never a path)."""
    where = f"{path}: shards[{position}]"
    if not isinstance(entry, dict):
        raise UserInputError(f"{where} is {type(entry).__name__}, not an object")
    for key, typ in _ENTRY_FIELDS.items():
        value = entry.get(key)
        if not isinstance(value, typ) or isinstance(value, bool):
            raise UserInputError(f"{where}: '{key}' must be {typ.__name__}, got {value!r:.80}")
    name = entry["file"]
    if not _SHARD_FILE_RE.fullmatch(name) or Path(name).name != name:
        raise UserInputError(
            f"{where}: file {name!r:.80} is not a shard file name (shard-NNNNN.safetensors or "
            f"shard-gG-NNNNN.safetensors, no directory part); refusing to read or write outside {path.parent}"
        )
    skipped = entry.get("skipped_ids", [])
    if not isinstance(skipped, list) or not all(type(i) is int for i in entry["sample_ids"] + skipped):
        raise UserInputError(f"{where}: sample_ids / skipped_ids must be lists of integers")
    if len(entry["sample_ids"]) != entry["samples"] or min(entry["samples"], entry["tokens"], entry["bytes"]) < 0:
        raise UserInputError(
            f"{where}: {entry['samples']} samples but {len(entry['sample_ids'])} sample_ids "
            f"(tokens {entry['tokens']}, bytes {entry['bytes']})"
        )


def _check_header(expected: dict, found: dict, path: Path) -> None:
    for key in _HEADER_KEYS:
        if key in expected and key in found and expected[key] != found[key]:
            raise UserInputError(
                f"{path}: '{key}' is {found[key]!r} on disk but {expected[key]!r} in this run; "
                f"use a new run directory or delete {path.parent}"
            )


def load_manifest(hidden_dir: str | os.PathLike) -> dict:
    """manifest.json and/or the per-group parts merged: one header, the union of their shards.

    Shards are ordered by (chunk index, file name). Raises FileNotFoundError when there is no
    manifest at all and UserInputError when headers disagree or a sample id appears twice.
    """
    hidden_dir = Path(hidden_dir)
    paths = [hidden_dir / MANIFEST] if (hidden_dir / MANIFEST).is_file() else []
    paths += sorted(p for p in hidden_dir.glob("manifest-g*.json") if _PART_RE.match(p.name))
    if not paths:
        raise FileNotFoundError(f"{hidden_dir / MANIFEST}: no shard manifest (run the extract stage first)")
    merged: dict | None = None
    shards: dict[str, dict] = {}
    for path in paths:
        data = _read_json(path)
        if merged is None:
            merged = {k: v for k, v in data.items() if k != "shards"}
        _check_header(merged, data, path)
        for entry in data["shards"]:
            shards.setdefault(entry["file"], entry)
    assert merged is not None
    merged["shards"] = sorted(shards.values(), key=lambda e: (e["index"], e["file"]))
    _check_unique_ids(merged["shards"], hidden_dir)
    return merged


def _check_unique_ids(entries: list[dict], hidden_dir: Path) -> None:
    owner: dict[int, str] = {}
    for entry in entries:
        for sample_id in entry["sample_ids"]:
            if sample_id in owner:
                raise UserInputError(
                    f"{hidden_dir}: sample id {sample_id} is in both {owner[sample_id]} and {entry['file']} "
                    f"(shards of two different runs in one directory?)"
                )
            owner[sample_id] = entry["file"]


def merge_manifests(hidden_dir: str | os.PathLike) -> dict:
    """Rank 0, after a barrier: write manifest.json listing every shard of every group."""
    hidden_dir = Path(hidden_dir)
    merged = load_manifest(hidden_dir)
    _write_json_atomic(hidden_dir / MANIFEST, merged)
    return merged


def quantize_fp8(x: torch.Tensor, block: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, D] -> (e4m3 [N, D], fp32 scales [N, D / block]); block defaults to D (one scale a token).

    scale = amax(|x| over the block) / 448, so every block uses the full e4m3 range; all-zero
    blocks get scale 1 (stored zeros stay zeros). Non-finite inputs stay non-finite in the scale.
    """
    N, D = x.shape
    block = block or D
    if block < 1 or D % block:
        raise ValueError(f"quantize_fp8: {D} columns are not a multiple of the scale block {block}")
    blocks = x.float().reshape(N, D // block, block)
    amax = blocks.abs().amax(-1)  # [N, D/block]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    # A cast to float8 does not saturate (out-of-range values become NaN): clamp first.
    q = (blocks / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.reshape(N, D), scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """(e4m3 [N, D], fp32 [N, D / block]) -> dtype [N, D]: value * scale of its block, in fp32."""
    N, D = q.shape
    if scale.dim() != 2 or scale.shape[0] != N or scale.shape[1] < 1 or D % scale.shape[1]:
        raise ValueError(f"dequantize_fp8: scales {tuple(scale.shape)} do not fit values {tuple(q.shape)}")
    blocks = q.float().reshape(N, scale.shape[1], -1) * scale.float().unsqueeze(-1)
    return blocks.reshape(N, D).to(dtype)


class ShardWriter:
    """Writes shards of one process group and keeps its manifest (or manifest part) current.

    `header`: target (dict), aux_layer_ids (project convention), tokenizer, chat_template,
    max_length, has_target_argmax; the writer adds format_version, the convention, the vLLM ids
    and storage_dtype. `group`: None for a single process, else the data-parallel group id.
    Existing shards in `hidden_dir` are checked against the header (resume).
    """

    def __init__(self, hidden_dir: str | os.PathLike, header: dict, storage_dtype: str = "bfloat16",
                 group: int | None = None):
        if storage_dtype not in STORAGE_DTYPES:
            raise ValueError(f"storage_dtype must be one of {list(STORAGE_DTYPES)}, got {storage_dtype!r}")
        self.hidden_dir = Path(hidden_dir)
        self.hidden_dir.mkdir(parents=True, exist_ok=True)
        self.group = group
        self.storage_dtype = storage_dtype
        aux = sorted(int(i) for i in header["aux_layer_ids"])  # concatenation order of aux_hidden_states
        self.header = {
            "format_version": FORMAT_VERSION,
            **{k: v for k, v in header.items() if k != "shards"},
            "aux_layer_ids": aux,
            "aux_layer_convention": AUX_LAYER_CONVENTION,
            "vllm_aux_layer_ids": [i + 1 for i in aux],
            "storage_dtype": storage_dtype,
        }
        self.manifest_path = self.hidden_dir / (MANIFEST if group is None else f"manifest-g{group}.json")
        self.entries: list[dict] = []  # this writer's manifest (or part)
        self.known: dict[int, dict] = {}  # chunk index -> entry, from every manifest on disk
        self._load_existing()

    def _load_existing(self) -> None:
        if self.manifest_path.is_file():
            own = _read_json(self.manifest_path)
            _check_header(self.header, own, self.manifest_path)
            self.entries = [e for e in own["shards"] if self._on_disk(e)]
        try:
            everything = load_manifest(self.hidden_dir)
        except FileNotFoundError:
            return
        _check_header(self.header, everything, self.hidden_dir / MANIFEST)
        self.known = {e["index"]: e for e in everything["shards"] if self._on_disk(e)}

    def _on_disk(self, entry: dict) -> bool:
        path = self.hidden_dir / entry["file"]
        return path.is_file() and path.stat().st_size == entry["bytes"]

    def is_complete(self, index: int, sample_ids: Iterable[int], rows: list[dict] | None = None) -> bool:
        """True when chunk `index` is already on disk holding exactly `sample_ids` (resume) and,
        given the chunk's `rows` ({"id", "input_ids", "loss_mask"}), made from those very samples
        (rows_sha256 against the entry's content_sha256, when the shard records one)."""
        entry = self.known.get(index)
        if entry is None:
            return False
        on_disk = sorted(entry["sample_ids"] + entry.get("skipped_ids", []))
        if on_disk != sorted(int(i) for i in sample_ids):
            raise UserInputError(
                f"{self.hidden_dir / entry['file']}: holds sample ids {on_disk[:8]}... but chunk {index} of this "
                f"run's data is {sorted(sample_ids)[:8]}...; the data changed since extraction (use a new run directory)"
            )
        if rows is not None and entry.get("content_sha256") not in (None, rows_sha256(rows)):
            raise UserInputError(
                f"{self.hidden_dir / entry['file']}: made from other samples than chunk {index} of this run's data "
                f"(same sample ids, other tokens: content sha256 differs); the data changed since extraction "
                f"(use a new run directory or delete {self.hidden_dir})"
            )
        return True

    def write_shard(self, index: int, samples: list[dict[str, torch.Tensor]], sample_ids: list[int],
                    skipped_ids: Iterable[int] = (), content_sha256: str | None = None) -> dict:
        """Pack `samples` (dicts of [n] / [n, D] tensors) into shard `index`; returns its entry.
        `content_sha256`: rows_sha256 of the chunk's rows (written and skipped), for resume."""
        if len(samples) != len(sample_ids):
            raise ValueError(f"shard {index}: {len(samples)} samples but {len(sample_ids)} sample ids")
        tensors = self._pack(samples)
        name = shard_name(index, self.group)
        final = self.hidden_dir / name
        # One metadata key only: safetensors keeps metadata in a hash map whose order varies
        # between processes, and resumed runs must write byte-identical shards.
        self._save(tensors, final, {"format": "pt"})
        entry = {
            "file": name, "index": int(index), "group": self.group,
            "samples": len(samples), "tokens": int(tensors["input_ids"].numel()),
            "bytes": final.stat().st_size, "sha256": file_sha256(final),
            "sample_ids": [int(i) for i in sample_ids], "skipped_ids": [int(i) for i in skipped_ids],
        }
        if content_sha256 is not None:
            entry["content_sha256"] = content_sha256
        self.entries = [e for e in self.entries if e["index"] != index] + [entry]
        self.entries.sort(key=lambda e: e["index"])
        self.known[index] = entry
        _write_json_atomic(self.manifest_path, {**self.header, "shards": self.entries})
        return entry

    def _save(self, tensors: dict[str, torch.Tensor], path: Path, metadata: dict) -> None:
        from safetensors.torch import save_file

        try:
            with atomic_path(path) as tmp:  # never a partial shard under its final name
                save_file(tensors, str(tmp), metadata=metadata)
                # save_file creates the file 0600; give it the umask's usual permissions (readable
                # by the training job's user or group, like the manifest).
                os.chmod(tmp, 0o666 & ~_umask())
        except Exception as err:  # OSError, or safetensors' SafetensorError "(os error 28)"
            code = disk_full_errno(err)
            if code is not None:
                raise disk_full_error(path, code) from None
            raise

    def _pack(self, samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Concatenate samples end to end; cast hidden states to the storage dtype."""
        dtype = STORAGE_DTYPES[self.storage_dtype]
        with_argmax = bool(self.header.get("has_target_argmax", False))
        lengths = [int(s["input_ids"].numel()) for s in samples]
        for i, s in enumerate(samples):
            for key in ("aux_hidden_states", "last_hidden_state", "loss_mask"):
                if s[key].shape[0] != lengths[i]:
                    raise ValueError(f"sample {i}: {key} has {s[key].shape[0]} rows, input_ids has {lengths[i]}")
        offsets = torch.zeros(len(samples) + 1, dtype=torch.int64)
        offsets[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0)
        out = {
            "input_ids": self._cat(samples, "input_ids", torch.int32, (0,)),
            "loss_mask": self._cat(samples, "loss_mask", torch.uint8, (0,)),
            "aux_hidden_states": self._cat_hidden(samples, "aux_hidden_states", dtype),
            "last_hidden_state": self._cat_hidden(samples, "last_hidden_state", dtype),
            "sample_offsets": offsets,
        }
        if dtype == FP8_DTYPE:
            self._quantize(out)
        if with_argmax:
            out["target_argmax"] = self._cat(samples, "target_argmax", torch.int32, (0,))
        return out

    @staticmethod
    def _cat(samples: list[dict], key: str, dtype: torch.dtype, empty_shape: tuple) -> torch.Tensor:
        if not samples:
            return torch.zeros(empty_shape, dtype=dtype)
        return torch.cat([s[key].reshape(-1).to("cpu", dtype) for s in samples]).contiguous()

    def _cat_hidden(self, samples: list[dict], key: str, dtype: torch.dtype) -> torch.Tensor:
        if not samples:
            width = self.header.get("target", {}).get("hidden_size", 0)
            width *= len(self.header["aux_layer_ids"]) if key == "aux_hidden_states" else 1
            return torch.zeros((0, width), dtype=dtype)
        if dtype == FP8_DTYPE:
            dtype = torch.float32  # quantized as a whole by _quantize, with its scales
        return torch.cat([s[key].to("cpu", dtype) for s in samples]).contiguous()

    def _quantize(self, out: dict[str, torch.Tensor]) -> None:
        """fp8 storage: each token's aux layers (blocks of H columns) and its last state scaled
        to e4m3's range; the scales go beside the values as `<name>_scale` fp32 [N, blocks]."""
        k = len(self.header["aux_layer_ids"])
        for key, blocks in (("aux_hidden_states", k), ("last_hidden_state", 1)):
            width = out[key].shape[1]
            if width % blocks:
                raise ValueError(f"{key} has {width} columns, not a multiple of its {blocks} aux layers")
            out[key], out[key + SCALE_SUFFIX] = quantize_fp8(out[key], width // blocks if width else 1)


class ShardReader:
    """Random access to the samples of a hidden-state directory, memory-mapped.

    Checks on open that every shard named in the manifest exists with its recorded byte size
    (and sha256 when `verify_checksums`); raises UserInputError naming the file otherwise, or,
    with `skip_corrupt`, leaves the shard out with a warning naming it: `skipped_shards` lists
    their file names and `skipped_samples` counts the samples they held. Files are opened lazily
    with safetensors' safe_open (mmap) and rows are sliced, so only the requested sample is read.
    fp8 shards are dequantized to bfloat16 on read. Safe to use in DataLoader workers (handles
    are per process).
    """

    def __init__(self, hidden_dir: str | os.PathLike, verify_checksums: bool = False, skip_corrupt: bool = False):
        self.hidden_dir = Path(hidden_dir)
        self.manifest = load_manifest(self.hidden_dir)
        self.skipped_shards: list[str] = []
        self.skipped_samples = 0
        self.shards = []
        for entry in self.manifest["shards"]:
            problem = self._problem(entry, verify_checksums)
            if problem is None:
                self.shards.append(entry)
            elif skip_corrupt:
                log.warning("%s; skipping it and its %d samples (skip_corrupt)", problem, entry["samples"])
                self.skipped_shards.append(entry["file"])
                self.skipped_samples += entry["samples"]
            else:
                raise UserInputError(problem)
        if self.skipped_shards:
            log.warning("%s: skipped %d corrupt shards holding %d samples: %s", self.hidden_dir,
                        len(self.skipped_shards), self.skipped_samples, ", ".join(self.skipped_shards))
        counts = [e["samples"] for e in self.shards]
        self._starts = [0]
        for n in counts:
            self._starts.append(self._starts[-1] + n)
        self._handles: dict[int, Any] = {}
        self._offsets: dict[int, list[int]] = {}
        self._pid = os.getpid()
        self._lock = threading.RLock()  # the trainer reads ahead on a worker thread (train/batching.py)

    def _problem(self, entry: dict, verify_checksums: bool) -> str | None:
        """Why the shard of `entry` cannot be used (missing, wrong size, wrong sha256), or None."""
        path = self.hidden_dir / entry["file"]
        if not path.is_file():
            return f"{path}: shard listed in the manifest is missing"
        size = path.stat().st_size
        if size != entry["bytes"]:
            return f"{path}: shard is {size} bytes, the manifest records {entry['bytes']} (truncated?)"
        if verify_checksums:
            digest = file_sha256(path)
            if digest != entry["sha256"]:
                return f"{path}: sha256 {digest} does not match the manifest's {entry['sha256']} (corrupt)"
        return None

    def __len__(self) -> int:
        return self._starts[-1]

    def __getstate__(self) -> dict:  # spawned DataLoader workers: no open handles, a fresh lock
        state = dict(self.__dict__, _handles={})
        del state["_lock"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.RLock()

    def _handle(self, shard: int):
        with self._lock:
            return self._open(shard)

    def _open(self, shard: int):
        if os.getpid() != self._pid:  # forked worker: do not share the parent's mmaps
            self._handles, self._pid = {}, os.getpid()
        if shard not in self._handles:
            if len(self._handles) >= MAX_OPEN_SHARDS:  # bound open files and mappings: drop the oldest
                self._handles.pop(next(iter(self._handles)))
            path = self.hidden_dir / self.shards[shard]["file"]
            try:  # a damaged header that kept the file's size: named, before safetensors reads it
                self._handles[shard] = open_safetensors(path)
            except UserInputError as err:
                raise UserInputError(f"{err}; the train stage checks every shard's sha256 first and names each damaged one") from None
        return self._handles[shard]

    def _shard_offsets(self, shard: int) -> list[int]:
        with self._lock:
            return self._read_offsets(shard)

    def _read_offsets(self, shard: int) -> list[int]:
        if shard not in self._offsets:
            path = self.hidden_dir / self.shards[shard]["file"]
            try:
                offsets = self._handle(shard).get_tensor("sample_offsets").tolist()
            except UserInputError:
                raise
            except Exception as err:
                raise UserInputError(f"{path}: cannot read sample_offsets ({str(err)[:200]})") from None
            if len(offsets) != self.shards[shard]["samples"] + 1 or offsets != sorted(offsets) or offsets[0] != 0:
                raise UserInputError(
                    f"{path}: sample_offsets {offsets[:4]}... ({len(offsets) - 1} samples) do not fit "
                    f"the manifest's {self.shards[shard]['samples']} samples"
                )
            self._offsets[shard] = offsets
        return self._offsets[shard]

    def locate(self, i: int) -> tuple[int, int]:
        """(shard position, sample position within the shard) of global sample i."""
        if not -len(self) <= i < len(self):
            raise IndexError(f"sample {i} out of range for {len(self)} samples in {self.hidden_dir}")
        i %= len(self)
        shard = bisect.bisect_right(self._starts, i) - 1
        return shard, i - self._starts[shard]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        shard, j = self.locate(i)
        offsets = self._shard_offsets(shard)
        begin, end = offsets[j], offsets[j + 1]
        f = self._handle(shard)
        keys = set(f.keys())
        try:
            sample = {key: f.get_slice(key)[begin:end] for key in _TENSORS if key in keys}
            for key in ("aux_hidden_states", "last_hidden_state"):
                if key + SCALE_SUFFIX in keys:  # fp8 storage: values [n, D] times scales [n, blocks]
                    sample[key] = dequantize_fp8(sample[key], f.get_slice(key + SCALE_SUFFIX)[begin:end])
        except Exception as err:  # a slice past a damaged header's bounds, a wrong dtype
            raise UserInputError(f"{self.hidden_dir / self.shards[shard]['file']}: cannot read sample {j} "
                                 f"({type(err).__name__}: {str(err)[:200]})") from None
        self._check_token_ids(sample, shard, j)
        return sample

    def _check_token_ids(self, sample: dict[str, torch.Tensor], shard: int, j: int) -> None:
        """Token ids in [0, V): an id out of range would index another token's row (negative
        ids wrap around) and train on a wrong teacher. [n] int32 each: cheap next to the states."""
        vocab_size = self.manifest.get("target", {}).get("vocab_size")
        if not isinstance(vocab_size, int):
            return
        for key in ("input_ids", "target_argmax"):
            ids = sample.get(key)
            if ids is None or not ids.numel():
                continue
            low, high = (int(v) for v in ids.aminmax())
            if low < 0 or high >= vocab_size:
                bad = low if low < 0 else high
                entry = self.shards[shard]
                raise UserInputError(f"{self.hidden_dir / entry['file']}: sample {entry['sample_ids'][j]}: {key} holds "
                                     f"{bad}, outside the target's vocabulary [0, {vocab_size})")

    def nonfinite(self, i: int) -> str | None:
        """Why global sample i is unusable, naming its shard, when its hidden states hold NaN/Inf
        (the extractor leaves such samples out, so only damage puts one there); else None. A
        full pass over the sample: the trainer calls it only for steps whose loss or gradient
        was not finite, never per read."""
        sample = self[i]
        shard, j = self.locate(i)
        for key in ("aux_hidden_states", "last_hidden_state"):
            values = sample[key]
            if values.is_floating_point() and not bool(torch.isfinite(values).all()):
                entry = self.shards[shard]
                row = int((~torch.isfinite(values)).any(-1).nonzero()[0, 0]) if values.dim() > 1 else 0
                return (f"{self.hidden_dir / entry['file']}: sample {entry['sample_ids'][j]} holds NaN/Inf in {key} "
                        f"(token {row})")
        return None

    def sample_lengths(self) -> list[int]:
        lengths: list[int] = []
        for shard in range(len(self.shards)):
            offsets = self._shard_offsets(shard)
            lengths += [b - a for a, b in zip(offsets[:-1], offsets[1:])]
        return lengths

    def sample_ids(self) -> list[int]:
        return [i for entry in self.shards for i in entry["sample_ids"]]

    def close(self) -> None:
        self._handles.clear()
