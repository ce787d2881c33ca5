"""Shard writer/reader (DESIGN section 4): round trip, integrity checks, atomic writes, parts."""

import json
import os

import pytest
import torch

from eagleforge.config import UserInputError
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
            assert got[key].dtype == storage
            ref = want[key]
            if storage == torch.float8_e4m3fn:
                ref = ref.clamp(-448, 448)  # the writer saturates instead of producing NaN
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
