"""Extraction: hooks against transformers' own hidden states, kill-and-resume, 2-process gloo."""

import json
import os
import shlex
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from eagleforge.config import load_config
from eagleforge.shards import MANIFEST, ShardReader, load_manifest
from eagleforge.target.capture import HiddenStateCapture
from eagleforge.target.loading import decoder_layers, default_aux_layers, final_norm, padding_id

TINY_AUX = [4, 0, 2]  # unsorted on purpose; stored ascending
SUBPROCESS_TIMEOUT_S = 180


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    """One intra-op thread: on a shared 2-core machine two spinning OpenMP threads per process
    make small forwards 10-30x slower; the subprocess runs use OMP_NUM_THREADS=1 too, so all
    runs use the same kernels and produce the same bits."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---------------------------------------------------------------- (a) hooks vs transformers


def _smollm2_samples(tokenizer):
    """Real text of four different lengths (odd, not multiples of anything)."""
    texts = [json.dumps.__doc__, os.path.join.__doc__, sorted.__doc__, str.split.__doc__]
    lengths = [19, 5, 13, 8]
    return [tokenizer(t)["input_ids"][:n] for t, n in zip(texts, lengths)]


def test_capture_matches_transformers_hidden_states(smollm2):
    from eagleforge.extract.writer import split_rows
    from eagleforge.target.hf import forward_batch

    model, tokenizer = smollm2
    num_layers = model.config.num_hidden_layers
    aux = default_aux_layers(num_layers) + [0]  # [1, 14, 26, 0]: ascending order is the capture's job
    samples = _smollm2_samples(tokenizer)
    assert len({len(s) for s in samples}) == len(samples)
    with HiddenStateCapture(decoder_layers(model), aux, final_norm(model)) as capture:
        # One right-padded batch of four different lengths, exactly as the extractor runs it.
        packed = forward_batch(model, capture, samples, padding_id(tokenizer), torch.device("cpu"), True)
    batched = split_rows(packed, [len(s) for s in samples])  # rows of the samples, end to end
    with torch.inference_mode():
        for ids, got in zip(samples, batched):
            # Reference: transformers' own hidden states for this sample alone (no padding at all).
            out = model(torch.tensor([ids]), output_hidden_states=True)
            hidden = out.hidden_states  # L + 1 states: embeddings, then each layer's output
            assert len(hidden) == num_layers + 1
            want_aux = torch.cat([hidden[i + 1][0] for i in sorted(aux)], dim=-1)  # [n, 4H]
            want_last = hidden[-1][0]
            # transformers' hidden_states[-1] for Llama is the final NORMED state: the lm_head's
            # input (the logits below come from it), not the raw output of the last layer.
            torch.testing.assert_close(model.lm_head(want_last), out.logits[0])
            assert not torch.allclose(hidden[num_layers - 1][0], want_last)
            assert got["aux_hidden_states"].shape == (len(ids), len(aux) * model.config.hidden_size)
            torch.testing.assert_close(got["aux_hidden_states"], want_aux, rtol=1e-4, atol=2e-3)
            torch.testing.assert_close(got["last_hidden_state"], want_last, rtol=1e-4, atol=2e-4)
            assert torch.equal(got["target_argmax"].long(), out.logits[0].argmax(-1))


def test_capture_tuple_outputs_and_errors():
    # A layer returning a tuple (older transformers, custom models): the first element is kept.
    class TupleLayer(torch.nn.Module):
        def forward(self, x):
            return (x * 2, "cache")

    layers = torch.nn.ModuleList([TupleLayer(), TupleLayer()])
    norm = torch.nn.LayerNorm(5)
    x = torch.randn(2, 3, 5)
    with HiddenStateCapture(layers, [1, 0], norm) as capture:
        norm(layers[1](layers[0](x)[0])[0])
        torch.testing.assert_close(capture.aux_hidden_states, torch.cat([x * 2, x * 4], dim=-1))
        torch.testing.assert_close(capture.last_hidden_state, norm(x * 4))
        capture.clear()
        with pytest.raises(RuntimeError, match="no output captured"):
            capture.aux_hidden_states
    assert not layers[0]._forward_hooks and not norm._forward_hooks  # removed on exit
    with pytest.raises(ValueError, match="out of range"):
        HiddenStateCapture(layers, [2], norm)


# ---------------------------------------------------------------- bad sample rows


@pytest.mark.parametrize("row,named", [
    ({"id": "7", "input_ids": [1], "loss_mask": [1]}, "sample id '7' is not an integer"),
    ({"id": True, "input_ids": [1], "loss_mask": [1]}, "sample id True"),
    ({"id": 3, "input_ids": [], "loss_mask": []}, "sample 3: input_ids must be a non-empty list"),
    ({"id": 3, "input_ids": [5, 211], "loss_mask": [1, 1]}, r"sample 3: token id 211 is not in the target's vocabulary \[0, 211\)"),
    ({"id": 3, "input_ids": [5, -1], "loss_mask": [1, 1]}, "token id -1"),
    ({"id": 3, "input_ids": [5, 2.0], "loss_mask": [1, 1]}, "token id 2.0"),
    ({"id": 3, "input_ids": [5, 6], "loss_mask": [1]}, "sample 3: loss_mask must be 2 values of 0 or 1"),
    ({"id": 3, "input_ids": [5, 6], "loss_mask": [1, 2]}, "loss_mask must be 2 values"),
    ({"id": 0, "input_ids": [5], "loss_mask": [1]}, "sample id 0 appears twice"),
])
def test_bad_sample_rows_are_named_before_any_forward(row, named):
    from eagleforge.errors import UserInputError
    from eagleforge.extract.samples import check_samples

    good = {"id": 0, "input_ids": [4, 5], "loss_mask": [0, 1]}
    with pytest.raises(UserInputError, match="samples.jsonl: .*" + named):
        check_samples([good, row], "RUN/data/samples.jsonl", 211, 64)


def test_samples_over_max_length_are_truncated_or_dropped(caplog):
    from eagleforge.extract.samples import check_samples

    rows = [{"id": 9, "input_ids": list(range(10)), "loss_mask": [0] * 4 + [1] * 6},
            {"id": 2, "input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]},
            {"id": 5, "input_ids": list(range(7)), "loss_mask": [1] * 7}]
    with caplog.at_level("WARNING"):
        cut = check_samples(rows, "in.jsonl", 211, 6, "truncate")
    assert [r["id"] for r in cut] == [2, 5, 9]
    assert cut[2]["input_ids"] == list(range(6)) and cut[2]["loss_mask"] == [0] * 4 + [1] * 2
    assert "2 samples longer than data.max_length=6 truncated, 0 dropped" in caplog.text
    kept = check_samples(rows, "in.jsonl", 211, 6, "drop")
    assert [r["id"] for r in kept] == [2]
    assert check_samples(rows, "in.jsonl", 211, 10) == sorted(rows, key=lambda r: r["id"])  # at the limit: untouched


def test_extract_cli_target_mistakes_exit_2_with_one_line(tiny_run, tmp_path):
    """A missing target, a directory that holds no model, a model without a tokenizer: exit 2, the
    last stderr line names target.path, no traceback."""
    import shutil

    no_tokenizer = tmp_path / "no_tokenizer"
    no_tokenizer.mkdir()
    for f in tiny_run["target"].iterdir():
        if f.name in ("config.json", "model.safetensors", "generation_config.json"):
            shutil.copy(f, no_tokenizer / f.name)
    (tmp_path / "empty").mkdir()
    cases = [(tmp_path / "missing", "no such file or directory"), (tmp_path / "empty", "cannot load a causal LM"),
             (no_tokenizer, "cannot load a tokenizer")]
    for target, says in cases:
        run_dir = _make_run(tmp_path / f"run_{target.name}", tiny_run["data"])
        args = [*tiny_run["overrides"], f"target.path={target}", f"run_dir={run_dir}"]
        proc = subprocess.run([sys.executable, "-m", "eagleforge.extract", *args], env=_env(),
                              capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)
        last = [line for line in proc.stderr.splitlines() if line.strip()][-1]
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        assert last.startswith("error: target.path") and str(target) in last and says in last, last
        assert not (run_dir / "hidden" / MANIFEST).exists()


# ---------------------------------------------------------------- tiny target and runs


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A tiny random Llama target on disk, 23 samples of odd lengths, and one in-process run."""
    from tiny_runs import write_tiny_llama

    root = tmp_path_factory.mktemp("extract")
    target = write_tiny_llama(root / "tiny-llama")
    gen = torch.Generator().manual_seed(1)
    ids = torch.randperm(1000, generator=gen)[:23].tolist()  # sparse ids, written out of order
    rows = []
    for sample_id in ids:
        n = int(torch.randint(1, 41, (1,), generator=gen))
        rows.append({"id": sample_id, "input_ids": torch.randint(3, 211, (n,), generator=gen).tolist(),
                     "loss_mask": torch.randint(0, 2, (n,), generator=gen).tolist()})
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    overrides = [f"target.path={target}", "target.device=cpu", "target.dtype=float32", "extract.samples_per_shard=4",
                 "extract.batch_tokens=64", "extract.storage_dtype=float32", "extract.aux_layers=[4, 0, 2]"]
    ref = _make_run(root / "ref", data)
    _run_in_process(ref, overrides)
    return {"root": root, "target": target, "data": data, "rows": rows, "overrides": overrides, "ref": ref}


def _make_run(run_dir: Path, data: Path) -> Path:
    (run_dir / "data").mkdir(parents=True)
    (run_dir / "data" / "samples.jsonl").write_text(data.read_text())
    return run_dir


def _run_in_process(run_dir, overrides):
    from eagleforge.extract.__main__ import main

    main(load_config(None, [*overrides, f"run_dir={run_dir}"]))


def _env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def _by_id(run_dir):
    reader = ShardReader(run_dir / "hidden", verify_checksums=True)
    return {sample_id: reader[i] for i, sample_id in enumerate(reader.sample_ids())}


def _assert_same_samples(run_dir, ref_dir):
    got, want = _by_id(run_dir), _by_id(ref_dir)
    assert sorted(got) == sorted(want)
    for sample_id, sample in want.items():
        assert sample.keys() == got[sample_id].keys()
        for key, tensor in sample.items():
            assert torch.equal(got[sample_id][key], tensor), (sample_id, key)


def test_reference_run_matches_the_model(tiny_run):
    """Every sample once, in id order, states equal to transformers' on the sample alone."""
    from transformers import LlamaForCausalLM

    rows = {r["id"]: r for r in tiny_run["rows"]}
    reader = ShardReader(tiny_run["ref"] / "hidden", verify_checksums=True)
    assert reader.sample_ids() == sorted(rows)
    manifest = reader.manifest
    assert [e["file"] for e in manifest["shards"]] == [f"shard-{c:05d}.safetensors" for c in range(6)]
    assert manifest["aux_layer_ids"] == [0, 2, 4] and manifest["vllm_aux_layer_ids"] == [1, 3, 5]
    assert manifest["target"]["num_layers"] == 7 and manifest["target"]["hidden_size"] == 48
    assert manifest["target"]["vocab_size"] == 211 and manifest["storage_dtype"] == "float32"
    model = LlamaForCausalLM.from_pretrained(tiny_run["target"], dtype=torch.float32).eval()
    with torch.inference_mode():
        for i, sample_id in enumerate(reader.sample_ids()):
            got, row = reader[i], rows[sample_id]
            assert got["input_ids"].tolist() == row["input_ids"] and got["loss_mask"].tolist() == row["loss_mask"]
            out = model(torch.tensor([row["input_ids"]]), output_hidden_states=True)
            want_aux = torch.cat([out.hidden_states[j + 1][0] for j in (0, 2, 4)], dim=-1)
            torch.testing.assert_close(got["aux_hidden_states"], want_aux, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got["last_hidden_state"], out.hidden_states[-1][0], rtol=1e-5, atol=1e-5)
            assert torch.equal(got["target_argmax"].long(), out.logits[0].argmax(-1))


def test_nan_samples_are_skipped_and_counted(tiny_run, monkeypatch, capsys):
    import eagleforge.target.hf as hf

    poisoned = tiny_run["rows"][5]
    real = hf.forward_batch

    def forward_with_nan(model, capture, input_ids, *args):
        packed = real(model, capture, input_ids, *args)
        start = 0
        for ids in input_ids:  # the samples' rows are packed end to end
            start += len(ids)
            if ids == poisoned["input_ids"]:
                packed["last_hidden_state"] = packed["last_hidden_state"].clone()
                packed["last_hidden_state"][start - 1, 3] = float("nan")  # the sample's last row
        return packed

    monkeypatch.setattr(hf, "forward_batch", forward_with_nan)
    monkeypatch.setattr(hf, "ARGMAX_CHUNK_ELEMENTS", 211 * 5)  # target_argmax in chunks of 5 rows
    run_dir = _make_run(tiny_run["root"] / "nan", tiny_run["data"])
    _run_in_process(run_dir, tiny_run["overrides"])
    assert "1 samples skipped for NaN/Inf" in capsys.readouterr().out
    reader = ShardReader(run_dir / "hidden")
    assert poisoned["id"] not in reader.sample_ids() and len(reader) == 22
    assert sum(len(e["skipped_ids"]) for e in reader.manifest["shards"]) == 1
    ref = _by_id(tiny_run["ref"])
    for i, sample_id in enumerate(reader.sample_ids()):  # the others are untouched
        assert all(torch.equal(t, ref[sample_id][k]) for k, t in reader[i].items()), sample_id
    # A rerun treats the chunk as complete (the skipped sample is accounted for).
    before = (run_dir / "hidden" / MANIFEST).read_text()
    _run_in_process(run_dir, tiny_run["overrides"])
    assert (run_dir / "hidden" / MANIFEST).read_text() == before


def test_a_nan_weight_of_the_target_is_named_once_when_samples_skip_for_it(tiny_run, tmp_path, capsys, caplog):
    """One NaN in one weight of the target's model.safetensors (a damaged download): every
    sample's states are NaN, and extraction only counted the samples it skipped, shard after
    shard. Now the tensor is named once, with the first skipped samples, and in the last line."""
    import logging
    import shutil

    from safetensors import safe_open
    from safetensors.torch import save_file

    target = tmp_path / "damaged-llama"
    shutil.copytree(tiny_run["target"], target)
    weights, name = target / "model.safetensors", "model.layers.2.mlp.down_proj.weight"
    with safe_open(str(weights), framework="pt") as f:
        metadata, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    tensors[name][0, 5] = float("nan")
    save_file(tensors, str(weights), metadata=metadata)
    run_dir = _make_run(tmp_path / "run", tiny_run["data"])
    overrides = [o for o in tiny_run["overrides"] if not o.startswith("target.path=")] + [f"target.path={target}"]
    with caplog.at_level(logging.WARNING):
        _run_in_process(run_dir, overrides)
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert "23 samples skipped for NaN/Inf (23 this run; the target's model.layers.2.mlp.down_proj.weight holds NaN/Inf" in last, last
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert sum("skipped" in w and "chunk" in w for w in warnings) == 6  # every shard's samples skipped
    assert [w for w in warnings if name in w] == [f"the target's {name} holds NaN/Inf: every sample whose forward reads it "
                                                  "has NaN/Inf states and is skipped; the checkpoint is damaged (check that "
                                                  "tensor in target.path)"]


# ---------------------------------------------------------------- overlapped writing, fp8 storage


def _run_with(tiny_run, name, overlap, *extra):
    from eagleforge.extract.__main__ import main

    run_dir = _make_run(tiny_run["root"] / name, tiny_run["data"])
    cfg = load_config(None, [*tiny_run["overrides"], *extra, f"run_dir={run_dir}"])
    cfg.extract.overlap_writes = overlap  # read with getattr(cfg.extract, "overlap_writes", True)
    main(cfg)
    return run_dir


def test_overlapped_writing_gives_the_same_bytes_as_inline_writing(tiny_run):
    """The writer thread (copies, queue, shard assembly from length-sorted batches) changes no
    byte: bf16 shards equal the inline writer's, sha256 for sha256."""
    overlapped = _run_with(tiny_run, "overlapped", True, "extract.storage_dtype=bfloat16")
    inline = _run_with(tiny_run, "inline", False, "extract.storage_dtype=bfloat16")
    got, want = load_manifest(overlapped / "hidden"), load_manifest(inline / "hidden")
    assert len(got["shards"]) == 6 and got["storage_dtype"] == "bfloat16"
    key = lambda m: [(e["file"], e["bytes"], e["sha256"], e["sample_ids"]) for e in m["shards"]]
    assert key(got) == key(want)
    # and bf16 storage is the fp32 reference rounded once
    ref = _by_id(tiny_run["ref"])
    for sample_id, sample in _by_id(overlapped).items():
        assert torch.equal(sample["aux_hidden_states"], ref[sample_id]["aux_hidden_states"].bfloat16())


def test_fp8_extraction_halves_the_bytes_and_reads_back_close(tiny_run):
    run_dir = _run_with(tiny_run, "fp8", True, "extract.storage_dtype=float8_e4m3fn")
    manifest = load_manifest(run_dir / "hidden")
    assert manifest["storage_dtype"] == "float8_e4m3fn"
    ref_manifest = load_manifest(tiny_run["ref"] / "hidden")  # float32 storage
    tokens = sum(e["tokens"] for e in manifest["shards"])
    H, k = 48, 3
    saved = sum(e["bytes"] for e in ref_manifest["shards"]) - sum(e["bytes"] for e in manifest["shards"])
    # fp32 states take (k+1)*4H bytes a token, fp8 (k+1)*(H+4); ids, mask, argmax and offsets alike
    assert abs(saved - tokens * (k + 1) * (4 * H - (H + 4))) < 6 * 400, saved  # safetensors headers differ
    ref = _by_id(tiny_run["ref"])
    got = _by_id(run_dir)
    assert sorted(got) == sorted(ref)
    for key in ("aux_hidden_states", "last_hidden_state"):
        a = torch.cat([got[i][key].float() for i in sorted(got)])
        b = torch.cat([ref[i][key] for i in sorted(ref)])
        assert got[sorted(got)[0]][key].dtype == torch.bfloat16
        rel = float((a - b).norm() / b.norm())
        assert rel < 0.04, (key, rel)  # e4m3 with per-token-per-layer scales: ~2-3% RMS
        assert float(torch.nn.functional.cosine_similarity(a, b, dim=-1).min()) > 0.998


# ---------------------------------------------------------------- (b) SIGKILL and resume

_KILL_AT_THIRD_SHARD = textwrap.dedent("""
    import os, signal, sys
    real_replace = os.replace
    renames = 0

    def replace(src, dst):
        # SIGKILL while the third shard is written and fsynced but not yet renamed.
        global renames
        if str(dst).endswith(".safetensors"):
            renames += 1
            if renames == 3:
                os.kill(os.getpid(), signal.SIGKILL)
        return real_replace(src, dst)

    os.replace = replace
    from eagleforge.cli import run_main
    from eagleforge.extract.__main__ import main
    run_main(main, "extract (killed)", sys.argv[1:])
""")


def test_sigkill_and_resume_reproduce_an_uninterrupted_run(tiny_run):
    run_dir = _make_run(tiny_run["root"] / "killed", tiny_run["data"])
    args = [*tiny_run["overrides"], f"run_dir={run_dir}"]
    killed = subprocess.run([sys.executable, "-c", _KILL_AT_THIRD_SHARD, *args], env=_env(),
                            capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    hidden = run_dir / "hidden"
    assert [e["file"] for e in load_manifest(hidden)["shards"]] == ["shard-00000.safetensors", "shard-00001.safetensors"]
    left = list(hidden.glob(".tmp-shard-00002.safetensors-*/shard-00002.safetensors"))
    assert len(left) == 1 and left[0].is_file()  # the partial write the kill left, named by its writer

    resumed = subprocess.run([sys.executable, "-m", "eagleforge.extract", *args], env=_env(),
                             capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "2 already done" in resumed.stderr
    assert not list(hidden.glob(".tmp-*"))
    got, want = load_manifest(hidden), load_manifest(tiny_run["ref"] / "hidden")
    strip = lambda m: [{k: e[k] for k in ("file", "samples", "tokens", "bytes", "sha256", "sample_ids")}
                       for e in m["shards"]]
    assert strip(got) == strip(want)  # byte-identical shards holding the same samples
    _assert_same_samples(run_dir, tiny_run["ref"])


_EXTRACT_UNDER_FSIZE_LIMIT = textwrap.dedent("""
    import resource, signal, sys
    from eagleforge.cli import run_main
    from eagleforge.extract.__main__ import main

    # A real full disk for this process: any write past the limit fails with EFBIG (SIGXFSZ
    # ignored, else the kernel kills the process instead), as ENOSPC would on a full disk.
    limit = int(sys.argv[1])
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    run_main(main, "extract (small disk)", sys.argv[2:])
""")


def test_full_disk_during_a_shard_write_then_rerun(tiny_run):
    """The write of shard c hits EFBIG: exit 2 with one error line naming the shard, shards
    0..c-1 kept and listed, no temp file; a rerun with room finishes byte-identical to the reference."""
    sizes = [e["bytes"] for e in load_manifest(tiny_run["ref"] / "hidden")["shards"]]
    limit = sizes[0]  # shard 0 fits exactly; the first larger one does not
    first_too_big = next(c for c, size in enumerate(sizes) if size > limit)
    assert first_too_big >= 1, sizes
    run_dir = _make_run(tiny_run["root"] / "full_disk", tiny_run["data"])
    args = [*tiny_run["overrides"], f"run_dir={run_dir}"]
    full = subprocess.run([sys.executable, "-c", _EXTRACT_UNDER_FSIZE_LIMIT, str(limit), *args], env=_env(),
                          capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)
    assert full.returncode == 2, full.stderr[-3000:]
    assert "Traceback" not in full.stderr
    last = [line for line in full.stderr.splitlines() if line.strip()][-1]
    name = f"shard-{first_too_big:05d}.safetensors"
    assert last.startswith("error: ") and f"{name}: cannot write, file too large" in last, full.stderr[-3000:]
    hidden = run_dir / "hidden"
    kept = [f"shard-{c:05d}.safetensors" for c in range(first_too_big)]
    assert sorted(p.name for p in hidden.iterdir()) == sorted([MANIFEST, *kept])  # no partial shard, no temp file
    assert [e["file"] for e in load_manifest(hidden)["shards"]] == kept

    resumed = subprocess.run([sys.executable, "-m", "eagleforge.extract", *args], env=_env(),
                             capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"{first_too_big} already done" in resumed.stderr
    strip = lambda m: [{k: e[k] for k in ("file", "bytes", "sha256", "sample_ids")} for e in m["shards"]]
    assert strip(load_manifest(hidden)) == strip(load_manifest(tiny_run["ref"] / "hidden"))


# ---------------------------------------------------------------- (c) two processes, gloo


@pytest.mark.parametrize("started", ["torchrun", "plain"])
def test_two_process_gloo_run_equals_one_process(tiny_run, started):
    """Two ranks under torchrun, and the same from a plain `python -m eagleforge.extract` whose
    config asks for two processes (launch.nproc=2): the stage re-runs itself under torchrun."""
    run_dir = _make_run(tiny_run["root"] / f"dp2-{started}", tiny_run["data"])
    args = [*tiny_run["overrides"], f"run_dir={run_dir}"]
    if started == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "eagleforge.extract", *args]
    else:
        cmd = [sys.executable, "-m", "eagleforge.extract", *args, "launch.nproc=2"]
    result = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-3000:]
    launched = [line for line in result.stdout.splitlines() if line.startswith("launch:")]
    assert launched == ([] if started == "torchrun" else
                        [f"launch: 2 processes (launch.nproc=2): torchrun --standalone --nnodes 1 --nproc-per-node 2 "
                         f"-m eagleforge.extract {shlex.join(args)} launch.nproc=2  (launch.mode=none runs one process)"])
    hidden = run_dir / "hidden"
    assert sorted(p.name for p in hidden.glob("manifest*.json")) == ["manifest-g0.json", "manifest-g1.json", MANIFEST]
    manifest = json.loads((hidden / MANIFEST).read_text())  # the merged manifest alone lists everything
    assert [e["file"] for e in manifest["shards"]] == [f"shard-g{c % 2}-{c:05d}.safetensors" for c in range(6)]
    ids = [i for e in manifest["shards"] for i in e["sample_ids"]]
    assert sorted(ids) == sorted(r["id"] for r in tiny_run["rows"]) and len(set(ids)) == len(ids)
    _assert_same_samples(run_dir, tiny_run["ref"])


def test_padding_id_falls_back_when_the_tokenizer_has_none():
    """SmolLM2's tokenizer under transformers 5.17 had no pad token (the device run's two
    failures): padding then uses eos, and 0 when there is neither; never None."""
    from types import SimpleNamespace

    assert padding_id(SimpleNamespace(pad_token_id=5, eos_token_id=2)) == 5
    assert padding_id(SimpleNamespace(pad_token_id=None, eos_token_id=2)) == 2
    assert padding_id(SimpleNamespace(pad_token_id=None, eos_token_id=None)) == 0
    assert padding_id(SimpleNamespace()) == 0


def test_changed_data_under_the_same_ids_is_refused_not_reused(tiny_run):
    """A new data source keeps the sample ids 0..n-1 (or, here, the same sparse ids) with other
    tokens. Regression: extract called every chunk done and the vocab stage its outputs up to
    date, so training used shards of the old data. Now both key on the samples' content."""
    import shutil

    from eagleforge.errors import UserInputError
    from eagleforge.vocab import check_shards_match_samples

    run_dir = tiny_run["root"] / "changed_data"
    shutil.copytree(tiny_run["ref"], run_dir)
    manifest = load_manifest(run_dir / "hidden")
    assert all("content_sha256" in e for e in manifest["shards"])
    check_shards_match_samples(run_dir)  # unchanged data: accepted
    rows = [dict(r) for r in tiny_run["rows"]]
    changed = sorted(rows, key=lambda r: r["id"])[5]  # one sample of the second chunk (4 per shard)
    changed["input_ids"] = [3 + (t - 2) % 208 for t in changed["input_ids"]]  # same length, other tokens
    (run_dir / "data" / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    second = manifest["shards"][1]["file"]
    with pytest.raises(UserInputError, match=rf"{second}: made from other samples than chunk 1"):
        _run_in_process(run_dir, tiny_run["overrides"])
    with pytest.raises(UserInputError, match=rf"{second}: its samples differ from .*samples.jsonl"):
        check_shards_match_samples(run_dir)
    assert load_manifest(run_dir / "hidden") == manifest  # nothing rewritten
