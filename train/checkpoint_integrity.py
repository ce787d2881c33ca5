"""What makes a checkpoint directory safe to read: it may come from elsewhere (a shared disk, a
download), so nothing in it may run code, name a file outside it, or be silently corrupt.

Three checks, each before torch.distributed.checkpoint (DCP) reads any tensor:

1. `.metadata` is DCP's one pickle. It is read by `MetadataUnpickler`, which builds only DCP's
   metadata classes, torch dtypes/sizes/layouts and paths: any other global (code) is refused.
2. Even built from allowed classes, the metadata could steer DCP into unsafe reads:
   `check_metadata` accepts only tensor entries (a `BytesStorageMetadata` entry makes DCP's load
   planner call `torch.load(weights_only=False)` on the bytes it points at) stored in DCP's own
   file names (`__{rank}_{n}.distcp`, a plain name inside the directory: no path, no link) with
   no stream transforms (extensions DCP would load by name).
3. `checksums.json` lists every other file of the checkpoint with its byte size and sha256, written
   when the checkpoint is saved; `verify_checksums` refuses a missing, extra, resized or changed
   file (a flipped byte in an optimizer state resumes into garbage otherwise).

Every refusal is a `UserInputError` naming the file.
"""

from __future__ import annotations

import contextlib
import json
import pickle  # only for the restricted unpickler of DCP's .metadata (MetadataUnpickler)
import re
from pathlib import Path

import torch

from eagleforge.atomic import write_json_atomic
from eagleforge.errors import UserInputError
from eagleforge.shards import file_sha256

CHECKSUMS_FILE = "checksums.json"
_DCP_DATA_FILE = re.compile(r"__\d+_\d+\.distcp")

# The globals a DCP .metadata pickle names (torch 2.11-2.13), module -> names, listed one by one.
# A name is looked up as that module's own attribute only: pickle's protocol 4 would follow a
# dotted name ("torch.os.system") from an allowed module to anything it imports.
_METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "MetadataIndex", "TensorStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "StorageMeta", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING",  # bytes entries are refused by check_metadata
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
}


class MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if "." not in name:
            if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
                return getattr(torch, name)
            if name in _METADATA_GLOBALS.get(module, ()):
                found = super().find_class(module, name)
                if getattr(found, "__module__", None) == module:  # defined there, not imported into it
                    return found
        raise pickle.UnpicklingError(f"global {module}.{name} is not part of a checkpoint's metadata")


def check_metadata(metadata, checkpoint: Path) -> None:
    """Refuse metadata that would make DCP unpickle bytes, read outside `checkpoint` or load a
    stream transform; `metadata` is a DCP Metadata built by MetadataUnpickler."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    where = checkpoint / ".metadata"

    def refuse(why: str):
        raise UserInputError(f"{where}: {why}; this is not a checkpoint this project wrote (delete {checkpoint} to start over)")

    def table(what: str) -> dict:
        value = getattr(metadata, what)
        if not isinstance(value, dict):
            refuse(f"{what} is a {type(value).__name__}, not a dict")
        return value

    for name, entry in table("state_dict_metadata").items():
        if not isinstance(name, str) or not isinstance(entry, TensorStorageMetadata):
            refuse(f"entry {name!r} is a {type(entry).__name__}, not a tensor (only tensors are ever saved)")
    for index, info in table("storage_data").items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo):
            refuse(f"storage entry {index!r} is a {type(info).__name__}, not a file range")
        name = info.relative_path
        if not isinstance(name, str) or not _DCP_DATA_FILE.fullmatch(name):
            refuse(f"storage entry {index.fqn!r} names the file {name!r}, not a checkpoint data file inside the checkpoint")
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (info.offset, info.length)):
            refuse(f"storage entry {index.fqn!r} has the byte range {info.offset!r}+{info.length!r}")
        if info.transform_descriptors:
            refuse(f"storage entry {index.fqn!r} asks for stream transforms {info.transform_descriptors!r}")
        file = checkpoint / name
        if file.is_symlink() or not file.is_file():
            refuse(f"storage entry {index.fqn!r} names {name}, which is not a file of the checkpoint")


def describe_files(paths: list[Path]) -> dict[str, dict]:
    """{file name: {"bytes", "sha256"}} of `paths` (each rank describes the files it wrote)."""
    return {p.name: {"bytes": p.stat().st_size, "sha256": file_sha256(p)} for p in paths}


def write_checksums(checkpoint: Path, files: dict[str, dict]) -> None:
    missing = sorted(f.name for f in checkpoint.iterdir() if f.name != CHECKSUMS_FILE and f.name not in files)
    if missing:
        raise AssertionError(f"{checkpoint}: files written but not described: {missing}")
    write_json_atomic(checkpoint / CHECKSUMS_FILE, dict(sorted(files.items())), indent=1)


def verify_checksums(checkpoint: Path) -> None:
    """Every file of `checkpoint` is the one its checksums.json lists (size, then sha256)."""
    listing = checkpoint / CHECKSUMS_FILE
    hint = f"delete {checkpoint} to start over"
    if not listing.is_file():
        raise UserInputError(f"{listing}: missing from the checkpoint ({hint})")
    try:
        files = json.loads(listing.read_text(encoding="utf-8"))
        if not isinstance(files, dict):
            raise ValueError(f"a {type(files).__name__}, not an object")
        expected = {str(name): (int(v["bytes"]), str(v["sha256"])) for name, v in files.items()}
    except (ValueError, TypeError, KeyError, UnicodeDecodeError) as err:
        raise UserInputError(f"{listing}: not a checkpoint's checksum list ({err}; {hint})") from None
    present = {f.name for f in checkpoint.iterdir()} - {CHECKSUMS_FILE}
    for name in sorted(present - expected.keys()):
        raise UserInputError(f"{checkpoint / name}: not listed in {CHECKSUMS_FILE} ({hint})")
    for name, (size, digest) in sorted(expected.items()):
        file = checkpoint / name
        if "/" in name or name in ("", ".", "..") or name not in present:
            raise UserInputError(f"{checkpoint / name}: listed in {CHECKSUMS_FILE} but missing ({hint})")
        if file.is_symlink() or not file.is_file():
            raise UserInputError(f"{file}: not a plain file ({hint})")
        if file.stat().st_size != size:
            raise UserInputError(f"{file}: {file.stat().st_size} bytes, {CHECKSUMS_FILE} says {size} (corrupt; {hint})")
        if file_sha256(file) != digest:
            raise UserInputError(f"{file}: sha256 does not match {CHECKSUMS_FILE} (corrupt; {hint})")


def safe_reader(path: Path):
    """A DCP FileSystemReader for `path` whose read_metadata uses the restricted unpickler."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    class SafeMetadataReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs) -> Metadata:
            file = Path(self.path) / ".metadata"
            try:
                with open(file, "rb") as f:
                    metadata = MetadataUnpickler(f).load()
            except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, TypeError, ValueError) as err:
                self.refused = f"{file}: not a checkpoint's metadata ({err}); delete {path} to start over"
                raise UserInputError(self.refused) from None
            if not isinstance(metadata, Metadata):
                self.refused = f"{file}: holds a {type(metadata).__name__}, not a checkpoint's metadata; delete {path} to start over"
                raise UserInputError(self.refused)
            try:
                check_metadata(metadata, Path(self.path))
            except UserInputError as err:
                self.refused = str(err)
                raise
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    reader = SafeMetadataReader(str(path))
    reader.refused = None  # set when read_metadata refused the file (DCP wraps the error in its own)
    return reader


@contextlib.contextmanager
def dcp_errors(reader, path: Path):
    """DCP re-raises a rank's error as CheckpointException (a BaseException): turn a refused
    .metadata into the UserInputError it was."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as err:
        if reader.refused:
            raise UserInputError(reader.refused) from None
        raise UserInputError(f"{path}: cannot read the checkpoint ({str(err).strip().splitlines()[-1][:300]}); delete {path} to start over") from None
