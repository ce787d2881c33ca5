"""Extraction: hooks against transformers' own hidden states, kill-and-resume, 2-process gloo."""

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from eagleforge.config import load_config
from eagleforge.extract.capture import HiddenStateCapture
from eagleforge.shards import MANIFEST, ShardReader, load_manifest
from eagleforge.target import decoder_layers, default_aux_layers, final_norm

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
    from eagleforge.extract.hf import forward_batch

    model, tokenizer = smollm2
    num_layers = model.config.num_hidden_layers
    aux = default_aux_layers(num_layers) + [0]  # [1, 14, 26, 0]: ascending order is the capture's job
    samples = _smollm2_samples(tokenizer)
    assert len({len(s) for s in samples}) == len(samples)
    with HiddenStateCapture(decoder_layers(model), aux, final_norm(model)) as capture:
        # One right-padded batch of four different lengths, exactly as the extractor runs it.
        batched = forward_batch(model, capture, samples, tokenizer.pad_token_id, torch.device("cpu"), True)
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


# ---------------------------------------------------------------- tiny target and runs


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A tiny random Llama target on disk, 23 samples of odd lengths, and one in-process run."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from eagleforge.target import embedded_target_dir

    root = tmp_path_factory.mktemp("extract")
    target = root / "tiny-llama"
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=211, hidden_size=48, intermediate_size=80, num_hidden_layers=7, num_attention_heads=3,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=256, tie_word_embeddings=False,
        pad_token_id=0, eos_token_id=2, bos_token_id=1,
    )
    LlamaForCausalLM(config).save_pretrained(target)
    AutoTokenizer.from_pretrained(embedded_target_dir()).save_pretrained(target)
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
    import eagleforge.extract.hf as hf

    poisoned = tiny_run["rows"][5]
    real = hf.forward_batch

    def forward_with_nan(model, capture, input_ids, *args):
        states = real(model, capture, input_ids, *args)
        for ids, state in zip(input_ids, states):
            if ids == poisoned["input_ids"]:
                state["last_hidden_state"] = state["last_hidden_state"].clone()
                state["last_hidden_state"][-1, 3] = float("nan")
        return states

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
    from eagleforge.config import run_main
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
    assert (hidden / ".tmp-shard-00002.safetensors").is_file()  # the partial write the kill left

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


# ---------------------------------------------------------------- (c) two processes, gloo


def test_two_process_gloo_run_equals_one_process(tiny_run):
    run_dir = _make_run(tiny_run["root"] / "dp2", tiny_run["data"])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "eagleforge.extract", *tiny_run["overrides"], f"run_dir={run_dir}"]
    result = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-3000:]
    hidden = run_dir / "hidden"
    assert sorted(p.name for p in hidden.glob("manifest*.json")) == ["manifest-g0.json", "manifest-g1.json", MANIFEST]
    manifest = json.loads((hidden / MANIFEST).read_text())  # the merged manifest alone lists everything
    assert [e["file"] for e in manifest["shards"]] == [f"shard-g{c % 2}-{c:05d}.safetensors" for c in range(6)]
    ids = [i for e in manifest["shards"] for i in e["sample_ids"]]
    assert sorted(ids) == sorted(r["id"] for r in tiny_run["rows"]) and len(set(ids)) == len(ids)
    _assert_same_samples(run_dir, tiny_run["ref"])
