"""Shard writer/reader (docs/shards.md): round trip, integrity checks, atomic writes, parts."""

import json
import os
import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from eagleforge.errors import UserInputError
from eagleforge.shards import MANIFEST, ShardReader, ShardWriter, load_manifest, merge_manifests

H, K = 13, 3  # odd hidden size, three aux layers


def _header(with_argmax=True):
    return {
        "target": {"path": "/nowhere", "architecture": "LlamaForCausalLM", "num_layers": 7, "hidden_size": H,
                   "vocab_size": 211},
        "aux_layer_ids": [5, 1, 3],  # unsorted on purpose: the writer stores them ascending
        "tokenizer": "tok", "chat_template": None, "max_length": 64, "has_target_argmax": with_argmax,
    }


@torch.inference_mode()  # the extractor hands the writer inference tensors
def _random_samples(gen, lengths, with_argmax=True):
    samples = []
    for n in lengths:
        sample = {
            "input_ids": torch.randint(0, 211, (n,), generator=gen, dtype=torch.int64),
            "loss_mask": torch.randint(0, 2, (n,), generator=gen),
            "aux_hidden_states": torch.randn(n, K * H, generator=gen) * 30,
            "last_hidden_state": torch.randn(n, H, generator=gen),
        }
        if with_argmax:
            sample["target_argmax"] = torch.randint(0, 211, (n,), generator=gen)
        samples.append(sample)
    return samples


def _write(tmp_path, dtype="bfloat16", group=None, chunks=((0, [5, 1, 17]), (1, [9, 3])), with_argmax=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    writer = ShardWriter(tmp_path, _header(with_argmax), dtype, group=group)
    expected = {}
    for index, lengths in chunks:
        samples = _random_samples(gen, lengths, with_argmax)
        ids = [index * 100 + j for j in range(len(lengths))]
        writer.write_shard(index, samples, ids)
        expected.update(zip(ids, samples))
    return writer, expected


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "float8_e4m3fn"])
def test_round_trip(tmp_path, dtype):
    _, expected = _write(tmp_path, dtype, chunks=((0, [5, 1, 17]), (1, [9, 3]), (2, [31])))
    reader = ShardReader(tmp_path, verify_checksums=True)
    storage = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
               "float8_e4m3fn": torch.float8_e4m3fn}[dtype]
    assert len(reader) == 6
    assert reader.sample_ids() == [0, 1, 2, 100, 101, 200]
    assert reader.sample_lengths() == [5, 1, 17, 9, 3, 31]
    m = reader.manifest
    assert m["aux_layer_ids"] == [1, 3, 5] and m["vllm_aux_layer_ids"] == [2, 4, 6]
    assert m["storage_dtype"] == dtype and "hidden_states[i+1]" in m["aux_layer_convention"]
    assert [e["tokens"] for e in m["shards"]] == [23, 12, 31]
    for i, sample_id in enumerate(reader.sample_ids()):
        got, want = reader[i], expected[sample_id]
        assert got["input_ids"].dtype == torch.int32 and got["loss_mask"].dtype == torch.uint8
        assert torch.equal(got["input_ids"].long(), want["input_ids"])
        assert torch.equal(got["loss_mask"].long(), want["loss_mask"])
        assert torch.equal(got["target_argmax"].long(), want["target_argmax"])
        for key in ("aux_hidden_states", "last_hidden_state"):
            ref = want[key]
            if storage == torch.float8_e4m3fn:
                # Stored as e4m3 with one scale per token and aux layer, read back dequantized to
                # bf16: exactly the plain-torch formula below, rounded once to bf16.
                blocks = ref.float().view(ref.shape[0], -1, H)  # [n, k or 1, H]
                scale = blocks.abs().amax(-1, keepdim=True) / 448.0
                scale = torch.where(scale > 0, scale, torch.ones_like(scale))
                deq = ((blocks / scale).to(torch.float8_e4m3fn).float() * scale).view_as(ref)
                assert got[key].dtype == torch.bfloat16
                assert torch.equal(got[key], deq.bfloat16()), key
                rel = (got[key].float() - ref).norm() / ref.norm()
                assert rel < 0.04, (key, float(rel))  # e4m3: 3 mantissa bits, ~2-3% RMS
                continue
            assert got[key].dtype == storage
            # The stored tensor is exactly the reference rounded once to the storage dtype.
            assert torch.equal(got[key].float(), ref.to(storage).float()), key
    assert reader[-1]["input_ids"].shape == (31,)
    with pytest.raises(IndexError):
        reader[6]


def test_reader_bounds_open_files(tmp_path, monkeypatch):
    import eagleforge.shards as shards

    _, expected = _write(tmp_path, "float16", chunks=((0, [2, 3]), (1, [4]), (2, [5])))
    monkeypatch.setattr(shards, "MAX_OPEN_SHARDS", 2)
    reader = ShardReader(tmp_path)
    for i in [0, 2, 3, 1, 3, 0]:  # hops between three shards with room for two open files
        want = expected[reader.sample_ids()[i]]["last_hidden_state"].half()
        assert torch.equal(reader[i]["last_hidden_state"], want)
        assert len(reader._handles) <= 2


def test_without_argmax_and_empty_shard(tmp_path):
    _write(tmp_path, "float32", chunks=((0, [4]), (1, []), (2, [2, 7])), with_argmax=False)
    reader = ShardReader(tmp_path)
    assert reader.sample_lengths() == [4, 2, 7]
    assert "target_argmax" not in reader[0]
    assert [e["samples"] for e in reader.manifest["shards"]] == [1, 0, 2]


def _first_shard(tmp_path):
    return tmp_path / load_manifest(tmp_path)["shards"][0]["file"]


def test_missing_shard_is_named(tmp_path):
    _write(tmp_path)
    path = _first_shard(tmp_path)
    path.unlink()
    with pytest.raises(UserInputError, match=path.name + ".*missing"):
        ShardReader(tmp_path)


def test_truncated_shard_is_named(tmp_path):
    _write(tmp_path)
    path = _first_shard(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 7])
    with pytest.raises(UserInputError, match=path.name + ".*bytes"):
        ShardReader(tmp_path)


def test_bit_flip_detected_with_checksums(tmp_path):
    _write(tmp_path)
    path = _first_shard(tmp_path)
    data = bytearray(path.read_bytes())
    data[len(data) - 11] ^= 0x10  # inside the tensor data; the size is unchanged
    path.write_bytes(bytes(data))
    ShardReader(tmp_path)  # sizes match: only the checksum can tell
    with pytest.raises(UserInputError, match=path.name + ".*sha256"):
        ShardReader(tmp_path, verify_checksums=True)


def test_no_manifest(tmp_path):
    with pytest.raises(FileNotFoundError, match=MANIFEST):
        ShardReader(tmp_path)


def test_failed_write_leaves_no_partial_shard(tmp_path, monkeypatch):
    writer, _ = _write(tmp_path, chunks=((0, [3, 4]),))
    manifest_before = (tmp_path / MANIFEST).read_text()
    import safetensors.torch

    real_save = safetensors.torch.save_file

    def save_then_die(tensors, filename, metadata=None):
        real_save(tensors, filename, metadata=metadata)
        with open(filename, "r+b") as f:  # half the file is on disk when the "crash" happens
            f.truncate(os.path.getsize(filename) // 2)
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(safetensors.torch, "save_file", save_then_die)
    gen = torch.Generator().manual_seed(1)
    with pytest.raises(OSError, match="simulated"):
        writer.write_shard(1, _random_samples(gen, [6]), [100])
    assert sorted(p.name for p in tmp_path.iterdir()) == [MANIFEST, "shard-00000.safetensors"]
    assert (tmp_path / MANIFEST).read_text() == manifest_before
    assert ShardReader(tmp_path, verify_checksums=True).sample_ids() == [0, 1]
    monkeypatch.setattr(safetensors.torch, "save_file", real_save)
    writer.write_shard(1, _random_samples(gen, [6]), [100])  # the retry succeeds
    assert ShardReader(tmp_path, verify_checksums=True).sample_ids() == [0, 1, 100]


_WRITE_UNDER_FSIZE_LIMIT = """
import errno, json, resource, signal, sys
import torch
from eagleforge.errors import UserInputError
from eagleforge.shards import ShardWriter

hidden_dir, header, limit = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
writer = ShardWriter(hidden_dir, header, "bfloat16")
# A real full disk for this process: writes past `limit` bytes fail with EFBIG (SIGXFSZ ignored,
# else the kernel kills the process instead).
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
n, width = 2000, len(header["aux_layer_ids"]) * header["target"]["hidden_size"]
sample = {"input_ids": torch.zeros(n, dtype=torch.int32), "loss_mask": torch.ones(n, dtype=torch.uint8),
          "aux_hidden_states": torch.randn(n, width), "last_hidden_state": torch.randn(n, width // 3),
          "target_argmax": torch.zeros(n, dtype=torch.int32)}
try:
    writer.write_shard(1, [sample], [100])
except UserInputError as err:
    print(err)
    sys.exit(3)
"""


def test_real_file_size_limit_leaves_no_partial_shard(tmp_path):
    """A write that really fails (EFBIG from RLIMIT_FSIZE, the same path as ENOSPC): no partial
    shard, no temp file, manifest unchanged, and a one-line UserInputError naming the shard."""
    import subprocess
    import sys

    _write(tmp_path, chunks=((0, [3, 4]),))
    manifest_before = (tmp_path / MANIFEST).read_text()
    limit = 64 * 1024  # the new shard needs ~520 KB
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", _WRITE_UNDER_FSIZE_LIMIT, str(tmp_path), json.dumps(_header()), str(limit)],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 3, proc.stderr[-2000:]
    message = proc.stdout.strip()
    assert "\n" not in message and "shard-00001.safetensors: cannot write, file too large" in message, message
    assert "EFBIG" in message and "no space left / file too large" in message
    assert sorted(p.name for p in tmp_path.iterdir()) == [MANIFEST, "shard-00000.safetensors"]
    assert (tmp_path / MANIFEST).read_text() == manifest_before
    assert ShardReader(tmp_path, verify_checksums=True).sample_ids() == [0, 1]


def test_disk_full_on_the_manifest_keeps_the_old_one(tmp_path, monkeypatch):
    import errno
    import pathlib

    writer, _ = _write(tmp_path, chunks=((0, [3]),))
    before = (tmp_path / MANIFEST).read_text()
    real_write_bytes = pathlib.Path.write_bytes

    def half_then_enospc(self, data):  # the manifest's temporary file fills the disk halfway
        real_write_bytes(self, data[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(pathlib.Path, "write_bytes", half_then_enospc)
    gen = torch.Generator().manual_seed(2)
    with pytest.raises(UserInputError, match=r"manifest\.json: cannot write, no space left on device \(errno ENOSPC"):
        writer.write_shard(1, _random_samples(gen, [4]), [100])
    monkeypatch.setattr(pathlib.Path, "write_bytes", real_write_bytes)
    assert (tmp_path / MANIFEST).read_text() == before and not list(tmp_path.glob(".tmp-*"))
    # The shard written before the manifest failed is not listed: a rerun writes it again.
    again = ShardWriter(tmp_path, _header())
    assert again.is_complete(0, [0]) and not again.is_complete(1, [100])


def test_group_parts_and_merge(tmp_path):
    # Two groups write interleaved chunks into their own parts; the reader accepts the parts
    # before the merge, and manifest.json after it lists every shard once.
    _write(tmp_path, group=0, chunks=((0, [3]), (2, [5, 2])), seed=1)
    _write(tmp_path, group=1, chunks=((1, [4]), (3, [1])), seed=2)
    assert not (tmp_path / MANIFEST).exists()
    assert ShardReader(tmp_path).sample_ids() == [0, 100, 200, 201, 300]
    merged = merge_manifests(tmp_path)
    on_disk = json.loads((tmp_path / MANIFEST).read_text())
    assert [e["file"] for e in on_disk["shards"]] == [
        "shard-g0-00000.safetensors", "shard-g1-00001.safetensors", "shard-g0-00002.safetensors",
        "shard-g1-00003.safetensors"]
    assert on_disk == merged
    assert ShardReader(tmp_path, verify_checksums=True).sample_lengths() == [3, 4, 5, 2, 1]


def test_resume_checks(tmp_path):
    writer, _ = _write(tmp_path, chunks=((0, [3, 4]),))
    again = ShardWriter(tmp_path, _header(), "bfloat16")
    assert again.is_complete(0, [1, 0]) and not again.is_complete(1, [100])
    with pytest.raises(UserInputError, match="data changed"):
        again.is_complete(0, [0, 1, 2])
    with pytest.raises(UserInputError, match="storage_dtype"):
        ShardWriter(tmp_path, _header(), "float16")
    # A sample id in two shards (two runs mixed in one directory) is refused by the reader.
    gen = torch.Generator().manual_seed(3)
    ShardWriter(tmp_path, _header(), "bfloat16", group=4).write_shard(7, _random_samples(gen, [2]), [1])
    with pytest.raises(UserInputError, match="sample id 1"):
        ShardReader(tmp_path)


def test_resume_refuses_shards_of_another_target_or_aux_layers(tmp_path):
    _write(tmp_path, chunks=((0, [3]),))
    other_aux = {**_header(), "aux_layer_ids": [1, 3, 4]}
    with pytest.raises(UserInputError, match="aux_layer_ids"):
        ShardWriter(tmp_path, other_aux, "bfloat16")
    other_target = {**_header(), "target": {**_header()["target"], "hidden_size": H + 1}}
    with pytest.raises(UserInputError, match="'target'"):
        ShardWriter(tmp_path, other_target, "bfloat16")


# ----------------------------------------------------------------------------- fp8 storage


def test_fp8_shards_hold_scales_and_half_the_bytes(tmp_path):
    from safetensors import safe_open

    from eagleforge.shards import dequantize_fp8, quantize_fp8

    lengths = [6, 11, 2]
    _, expected = _write(tmp_path / "fp8", "float8_e4m3fn", chunks=((0, lengths),))
    _write(tmp_path / "bf16", "bfloat16", chunks=((0, lengths),))
    n = sum(lengths)
    with safe_open(str(tmp_path / "fp8" / "shard-00000.safetensors"), framework="pt") as f:
        assert f.get_slice("aux_hidden_states").get_dtype() == "F8_E4M3"
        scale_aux, scale_last = f.get_tensor("aux_hidden_states_scale"), f.get_tensor("last_hidden_state_scale")
        values_aux = f.get_tensor("aux_hidden_states")
    assert scale_aux.shape == (n, K) and scale_last.shape == (n, 1) and scale_aux.dtype == torch.float32
    # bytes per token: (k + 1) * (H + 4) for the states instead of (k + 1) * 2H, ids/mask/argmax alike
    fp8_bytes = load_manifest(tmp_path / "fp8")["shards"][0]["bytes"]
    bf16_bytes = load_manifest(tmp_path / "bf16")["shards"][0]["bytes"]
    assert abs((bf16_bytes - fp8_bytes) - n * (K + 1) * (2 * H - (H + 4))) < 600, (bf16_bytes, fp8_bytes)  # headers differ
    # The reader's dequantization is dequantize_fp8 of the stored values, bf16.
    reader = ShardReader(tmp_path / "fp8", verify_checksums=True)
    got = torch.cat([reader[i]["aux_hidden_states"] for i in range(len(reader))])
    assert torch.equal(got, dequantize_fp8(values_aux, scale_aux, torch.bfloat16))
    want = torch.cat([expected[i]["aux_hidden_states"] for i in reader.sample_ids()])
    q, s = quantize_fp8(want, H)
    assert torch.equal(q.view(torch.uint8), values_aux.view(torch.uint8)) and torch.equal(s, scale_aux)


def test_fp8_saturates_zeros_and_tiny_values(tmp_path):
    gen = torch.Generator().manual_seed(5)
    samples = [{k: v.clone() for k, v in _random_samples(gen, [4])[0].items()}]
    samples[0]["aux_hidden_states"][0] = 0.0  # an all-zero token: scale 1, zeros back
    samples[0]["aux_hidden_states"][1, :H] = 1e-30  # a layer of tiny values: its own scale keeps them
    samples[0]["last_hidden_state"][2, 0] = 1e6  # far beyond e4m3's 448: scaled, never NaN
    ShardWriter(tmp_path, _header(), "float8_e4m3fn").write_shard(0, samples, [0])
    got = ShardReader(tmp_path)[0]
    assert torch.isfinite(got["aux_hidden_states"]).all() and torch.isfinite(got["last_hidden_state"]).all()
    assert (got["aux_hidden_states"][0] == 0).all()
    torch.testing.assert_close(got["aux_hidden_states"][1, :H].float(), torch.full((H,), 1e-30), rtol=0.07, atol=0)
    assert float(got["last_hidden_state"][2, 0]) == pytest.approx(1e6, rel=0.01)


# ----------------------------------------------------------------------------- corruption, skip_corrupt


def _damage(path, how):
    if how == "missing":
        path.unlink()
    elif how == "truncated":
        path.write_bytes(path.read_bytes()[:-5])
    elif how == "bit flip":
        data = bytearray(path.read_bytes())
        data[-3] ^= 0x01
        path.write_bytes(bytes(data))


def test_skip_corrupt_leaves_out_damaged_shards_and_counts_them(tmp_path, caplog):
    chunks = ((0, [3, 4]), (1, [5]), (2, [2, 2, 6]), (3, [7]), (4, [1, 8]))
    _, expected = _write(tmp_path, chunks=chunks)
    entries = load_manifest(tmp_path)["shards"]
    damage = {1: "truncated", 2: "bit flip", 3: "missing"}
    for index, how in damage.items():
        _damage(tmp_path / entries[index]["file"], how)
    with pytest.raises(UserInputError, match="shard-00001.*truncated"):
        ShardReader(tmp_path, skip_corrupt=False)
    # Without checksums only size and presence are checked: the bit-flipped shard stays.
    reader = ShardReader(tmp_path, skip_corrupt=True)
    assert reader.skipped_shards == ["shard-00001.safetensors", "shard-00003.safetensors"]
    assert reader.skipped_samples == 2 and reader.sample_ids() == [0, 1, 200, 201, 202, 400, 401]
    caplog.clear()
    with caplog.at_level("WARNING", logger="eagleforge.shards"):
        reader = ShardReader(tmp_path, verify_checksums=True, skip_corrupt=True)
    assert reader.skipped_shards == [f"shard-0000{i}.safetensors" for i in (1, 2, 3)]
    assert reader.skipped_samples == 1 + 3 + 1
    assert reader.sample_ids() == [0, 1, 400, 401] and len(reader) == 4
    assert reader.sample_lengths() == [3, 4, 1, 8]
    for i, sample_id in enumerate(reader.sample_ids()):  # indices stay consistent over the gap
        assert torch.equal(reader[i]["input_ids"].long(), expected[sample_id]["input_ids"])
    text = caplog.text
    assert all(f"shard-0000{i}.safetensors" in text for i in (1, 2, 3)) and "5 samples" in text
    assert "sha256" in text and "missing" in text and "truncated" in text


def test_damaged_header_is_named_not_a_traceback(tmp_path):
    _write(tmp_path, chunks=((0, [3, 4]),))
    path = tmp_path / "shard-00000.safetensors"
    data = bytearray(path.read_bytes())
    data[10] = ord("}")  # inside the JSON header: same size, so only the checksum sees it
    path.write_bytes(bytes(data))
    reader = ShardReader(tmp_path)
    with pytest.raises(UserInputError, match="shard-00000.safetensors"):
        reader[0]


# ----------------------------------------------------------------------------- names from data files


@pytest.mark.parametrize("name", [
    "../../etc/passwd", "/etc/passwd", "sub/shard-00000.safetensors", "..", "shard-00000.safetensors/../../x",
    "..\\shard-00000.safetensors", "shard-00000.safetensors\x00", "manifest.json", "", "shard-00000.safetensors\n",
])
def test_manifest_naming_a_path_is_refused(tmp_path, name):
    _write(tmp_path / "hidden", chunks=((0, [3]),))
    manifest = json.loads((tmp_path / "hidden" / MANIFEST).read_text())
    manifest["shards"][0]["file"] = name
    (tmp_path / "hidden" / MANIFEST).write_text(json.dumps(manifest))
    for open_it in (lambda: ShardReader(tmp_path / "hidden"), lambda: ShardWriter(tmp_path / "hidden", _header())):
        with pytest.raises(UserInputError, match=r"manifest\.json: shards\[0\]: file .*not a shard file name"):
            open_it()


@pytest.mark.parametrize("edit,named", [
    (lambda e: e.pop("bytes"), "'bytes'"), (lambda e: e.update(samples="3"), "'samples'"),
    (lambda e: e.update(sample_ids=[0, "1"]), "sample_ids"), (lambda e: e.update(index=True), "'index'"),
    (lambda e: e.update(samples=5), "5 samples but 1 sample_ids"), (lambda e: e.update(skipped_ids={}), "skipped_ids"),
])
def test_malformed_manifest_entries_are_named(tmp_path, edit, named):
    _write(tmp_path, chunks=((0, [3]),))
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    edit(manifest["shards"][0])
    (tmp_path / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(UserInputError, match=r"manifest\.json: shards\[0\].*" + re.escape(named)):
        ShardReader(tmp_path)


_json_value = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-(2**40), 2**40), st.floats(), st.text(max_size=8)),
                           lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=5), inner, max_size=3)),
                           max_leaves=6)


@settings(max_examples=120, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(key=st.sampled_from(["file", "index", "group", "samples", "tokens", "bytes", "sha256", "sample_ids",
                            "skipped_ids", "shards", "target", "storage_dtype", "aux_layer_ids", "format_version"]),
       value=_json_value, shard_byte=st.one_of(st.none(), st.integers(0, 10**6)), bit=st.integers(0, 7),
       manifest_cut=st.one_of(st.none(), st.integers(0, 2000)), checksums=st.booleans())
def test_fuzzed_manifest_and_shard_bytes_give_only_project_errors(tmp_path_factory, key, value, shard_byte, bit,
                                                                  manifest_cut, checksums):
    """A mutated manifest field, a cut manifest, or one flipped bit anywhere in a shard: opening
    and reading every sample gives samples or the project's own errors, nothing else."""
    root = tmp_path_factory.mktemp("fuzz")
    _write(root, chunks=((0, [3, 5]), (1, [2])))
    manifest = json.loads((root / MANIFEST).read_text())
    if key in ("shards", "target", "storage_dtype", "aux_layer_ids", "format_version"):
        manifest[key] = value
    else:
        manifest["shards"][1][key] = value
    text = json.dumps(manifest)
    (root / MANIFEST).write_text(text if manifest_cut is None else text[:manifest_cut])
    if shard_byte is not None:
        path = root / "shard-00000.safetensors"
        data = bytearray(path.read_bytes())
        data[shard_byte % len(data)] ^= 1 << bit
        path.write_bytes(bytes(data))
    try:
        reader = ShardReader(root, verify_checksums=checksums)
        assert isinstance(reader.manifest.get("target", {}), dict)  # what the trainer reads
        assert all(type(i) is int for i in reader.manifest.get("aux_layer_ids", []))
        for i in range(len(reader)):
            sample = reader[i]
            assert sample["aux_hidden_states"].shape[1] == K * H
    except (UserInputError, FileNotFoundError) as err:
        assert "\n" not in str(err)
