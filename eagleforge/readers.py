"""Reading the files a user hands us: each fault is one UserInputError naming the file, never a
traceback from inside a reader (json's, safetensors' Rust code, transformers').

    read_json_object(path)          a JSON object: config.json, a manifest, a summary, state.json
    read_safetensors_header(path)   {name: {"dtype", "shape", "data_offsets"}} from the header alone
    open_safetensors(path)          safe_open of a file whose header passed that check
    check_safetensors_files(paths)  the header of each

A safetensors file is 8 bytes of little-endian header length N, N bytes of JSON, then the tensor
data. The header is checked here as the safetensors library checks it before it reads anything
(a length past the file or its limit, JSON that is not an object, metadata that is not strings,
an unknown dtype, a tensor whose byte range does not hold its shape, ranges that leave gaps,
overlap or run past the file), so that a crafted or cut file is named in one line.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from pathlib import Path

from eagleforge.errors import UserInputError, bounded_repr, bounded_text

# bits per element of each dtype the safetensors format knows (F4, F6_*: packed sub-byte types)
SAFETENSORS_DTYPE_BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E4M3": 8, "F8_E5M2": 8, "F8_E8M0": 8, "F8_E4M3FNUZ": 8,
                          "F8_E5M2FNUZ": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "I16": 16, "U16": 16, "F16": 16,
                          "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "C64": 64, "I64": 64, "U64": 64, "F64": 64}
SAFETENSORS_ITEMSIZE = {name: bits // 8 for name, bits in SAFETENSORS_DTYPE_BITS.items() if bits % 8 == 0}
MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit on the JSON header


@contextlib.contextmanager
def _read_errors(path: Path):
    """An OSError while reading `path` as a UserInputError naming it; a missing file stays a
    FileNotFoundError (its callers say what was expected there)."""
    try:
        yield
    except FileNotFoundError:
        raise
    except OSError as err:
        raise UserInputError(f"{path}: cannot read ({(err.strerror or str(err)).lower()})") from None


def read_json_object(path: str | os.PathLike, what: str = "") -> dict:
    """The JSON object in `path`, or a UserInputError naming the file: not readable, not UTF-8,
    not JSON, or JSON of another kind (a list, a string, a number) where an object is expected.
    `what` says what the file is in that last message ("a shard manifest", "a draft's config.json")."""
    path = Path(path)
    with _read_errors(path):
        raw = path.read_bytes()
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise UserInputError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") from None
    except json.JSONDecodeError as err:
        raise UserInputError(f"{path}: not valid JSON ({err.msg} at line {err.lineno} column {err.colno})") from None
    except (RecursionError, ValueError) as err:  # nesting past the stack, an integer of too many digits
        raise UserInputError(f"{path}: not usable JSON ({bounded_text(str(err) or type(err).__name__, 200)})") from None
    if not isinstance(data, dict):
        raise UserInputError(f"{path}: expected a JSON object{f' ({what})' if what else ''}, got a JSON {_kind(data)} "
                             f"({bounded_repr(data, depth=1)})")
    return data


def _kind(value) -> str:
    return {list: "list", str: "string", bool: "boolean", int: "number", float: "number", type(None): "null"}.get(type(value), type(value).__name__)


def read_safetensors_header(path: str | os.PathLike) -> dict[str, dict]:
    """{name: {"dtype", "shape", "data_offsets"}} of a safetensors file, from its first 8 + N
    bytes alone: no tensor data is read. Anything the safetensors library would refuse (module
    docstring), or a file that cannot be read, is a UserInputError naming the file."""
    path = Path(path)
    with _read_errors(path):
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            length = int.from_bytes(head, "little") if len(head) == 8 else -1
            if not 0 < length <= min(size - 8, MAX_HEADER_BYTES):
                raise UserInputError(f"{path}: not a safetensors file (header length {length}, file of {size} bytes)")
            raw = f.read(length)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError, ValueError) as err:
        raise UserInputError(f"{path}: damaged safetensors header ({type(err).__name__})") from None
    if not isinstance(header, dict):
        raise UserInputError(f"{path}: damaged safetensors header (not a JSON object)")
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        raise UserInputError(f"{path}: damaged safetensors header (__metadata__ is not a mapping of strings)")
    data_bytes = size - 8 - length
    for name, entry in header.items():
        ok = (isinstance(entry, dict) and isinstance(entry.get("dtype"), str) and isinstance(entry.get("shape"), list)
              and all(type(s) is int and s >= 0 for s in entry["shape"]) and isinstance(entry.get("data_offsets"), list)
              and len(entry["data_offsets"]) == 2 and all(type(o) is int and o >= 0 for o in entry["data_offsets"]))
        if not ok:
            raise UserInputError(f"{path}: damaged safetensors header (entry {bounded_repr(name)})")
        begin, end = entry["data_offsets"]
        if end > data_bytes:
            raise UserInputError(f"{path}: tensor {bounded_repr(name)} ends at byte {8 + length + end} but the file has "
                                 f"{size} bytes (cut short?)")
        bits = SAFETENSORS_DTYPE_BITS.get(entry["dtype"])
        if bits is None:
            raise UserInputError(f"{path}: tensor {bounded_repr(name)} has dtype {bounded_repr(entry['dtype'])}, "
                                 "not one of safetensors'")
        if end < begin or (end - begin) * 8 != math.prod(entry["shape"]) * bits:
            raise UserInputError(f"{path}: tensor {bounded_repr(name)} holds {end - begin} bytes, not the {entry['dtype']} "
                                 f"{bounded_repr(entry['shape'])} it declares")
    position = 0
    for name, entry in sorted(header.items(), key=lambda item: item[1]["data_offsets"]):
        begin, end = entry["data_offsets"]
        if begin != position:
            raise UserInputError(f"{path}: tensor {bounded_repr(name)} starts at data byte {begin}, not at {position} "
                                 "where the tensor before it ends (damaged header)")
        position = end
    if position != data_bytes:
        raise UserInputError(f"{path}: its tensors end at data byte {position} but the file holds {data_bytes} "
                             "(damaged header, or bytes appended)")
    return header


def open_safetensors(path: str | os.PathLike):
    """safe_open(path) (a context manager, framework "pt") once its header checks out
    (read_safetensors_header); anything safetensors still refuses is a UserInputError naming
    the file."""
    from safetensors import safe_open

    path = Path(path)
    read_safetensors_header(path)
    try:
        return safe_open(str(path), framework="pt")
    except Exception as err:  # noqa: BLE001 - SafetensorError and the OSErrors of the open
        raise UserInputError(f"{path}: not a readable safetensors file "
                             f"({bounded_text((str(err).splitlines() or [type(err).__name__])[0], 200)})") from None


def check_safetensors_files(paths) -> None:
    """read_safetensors_header of each path: the first bad file named, before a reader that
    would fail on it with a traceback (transformers' from_pretrained) opens any."""
    for path in paths:
        read_safetensors_header(path)
