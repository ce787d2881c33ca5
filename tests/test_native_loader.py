"""The native loader checks what a rank will read against the checkpoint before reading any of it.

A tiny Kimi-K2.5-layout checkpoint (INT4 experts, two safetensors files and an index) is damaged
the ways a half-copied or hand-edited checkpoint is: a tensor taken out of its file while the
index still names that file, a tensor of another shape or dtype, a file cut short, an index
naming a path outside the checkpoint. Each must be one UserInputError line naming the tensor and
the file, raised while no tensor has been read: `safe_open` is replaced by a counting wrapper,
which counts the tensors read from the intact checkpoint too, so the count is known to work.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from eagleforge.errors import UserInputError
from eagleforge.extract.native import loader
from eagleforge.extract.native.loader import build_model, check_reads, load_weights, plan_reads, read_checkpoint_info, read_safetensors_header
from eagleforge.extract.native.parallel import TensorParallel, split_range

N_EXPERTS = 9  # over tp 2 in the ep layout: experts 0..4 on rank 0, 5..8 on rank 1


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from test_native_fixtures import write_tiny_kimi

    path = tmp_path_factory.mktemp("kimi_tiny")
    write_tiny_kimi(path, seed=11, n_routed_experts=N_EXPERTS, num_hidden_layers=3)
    return path


@pytest.fixture
def copy(tiny, tmp_path):
    path = tmp_path / "ckpt"
    shutil.copytree(tiny, path)
    return path


class CountingOpen:
    """safe_open that counts every tensor read through it (get_tensor, get_slice)."""

    def __init__(self):
        self.reads = 0

    def __call__(self, *args, **kwargs):
        handle = safe_open(*args, **kwargs)
        counter = self

        class Handle:
            def __getattr__(self, name):
                if name in ("get_tensor", "get_slice"):
                    counter.reads += 1
                return getattr(handle, name)

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return False

        return Handle()


def index_file_of(path, name: str) -> str:
    return json.loads((path / "model.safetensors.index.json").read_text())["weight_map"][name]


def rewrite_file(path, file: str, edit) -> None:
    """Rewrite one safetensors file of the checkpoint with `edit(tensors)` applied; the index stays."""
    with safe_open(str(path / file), framework="pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    edit(tensors)
    save_file(tensors, str(path / file), metadata={"format": "pt"})


def load_counting(path, monkeypatch, tp: TensorParallel = TensorParallel()):
    """load_weights on `path` with safe_open counted; returns (counter, error or None)."""
    info = read_checkpoint_info(path)
    model = build_model(info, tp, "ep", torch.float32, torch.device("cpu"))
    counter = CountingOpen()
    monkeypatch.setattr(loader, "safe_open", counter)
    try:
        load_weights(model, info, show_progress=False)
    except UserInputError as err:
        return counter, err
    return counter, None


def test_the_counter_sees_every_read_of_an_intact_checkpoint(tiny, monkeypatch):
    counter, err = load_counting(tiny, monkeypatch)
    assert err is None
    info = read_checkpoint_info(tiny)
    # every tensor of the text model except the vision stub is read once at tp 1
    expected = sum(1 for name in info.weight_map if name.startswith("language_model."))
    assert counter.reads == expected > 100


def test_a_tensor_missing_from_its_file_is_named_before_any_read(copy, monkeypatch):
    name = f"language_model.model.layers.2.mlp.experts.{N_EXPERTS - 1}.up_proj.weight_packed"
    file = index_file_of(copy, name)
    rewrite_file(copy, file, lambda t: t.pop(name))
    counter, err = load_counting(copy, monkeypatch)
    assert err is not None and counter.reads == 0
    message = str(err)
    assert "\n" not in message
    assert message.startswith(f"{copy / file}: tensor {name} is missing")
    assert "model.safetensors.index.json names this file for it" in message


def test_only_the_rank_that_reads_a_missing_expert_fails(copy):
    """ep layout at tp 2: the last expert belongs to rank 1 alone; rank 0's check passes."""
    name = f"language_model.model.layers.1.mlp.experts.{N_EXPERTS - 1}.down_proj.weight_scale"
    rewrite_file(copy, index_file_of(copy, name), lambda t: t.pop(name))
    info = read_checkpoint_info(copy)
    outcome = {}
    for rank in range(2):
        model = build_model(info, TensorParallel(size=2, rank=rank), "ep", torch.float32, torch.device("cpu"))
        assert model.model.layers[1].mlp.experts.start == split_range(N_EXPERTS, rank, 2)[0]
        try:
            check_reads(info, [read for _, reads in plan_reads(model, info) for read in reads])
            outcome[rank] = None
        except UserInputError as err:
            outcome[rank] = str(err)
    assert outcome[0] is None
    assert name in outcome[1] and "is missing" in outcome[1]


def test_a_tensor_of_another_shape_or_dtype_is_named_before_any_read(copy, monkeypatch):
    name = "language_model.model.layers.1.self_attn.o_proj.weight"
    file = index_file_of(copy, name)
    with safe_open(str(copy / file), framework="pt") as f:
        shape = list(f.get_slice(name).get_shape())
    rewrite_file(copy, file, lambda t: t.__setitem__(name, torch.zeros(shape[0] + 1, shape[1], dtype=torch.bfloat16)))
    counter, err = load_counting(copy, monkeypatch)
    assert err is not None and counter.reads == 0
    assert str(err) == (f"{copy / file}: tensor {name} has shape {[shape[0] + 1, shape[1]]}, "
                        f"expected {shape} from {copy / 'config.json'}")

    rewrite_file(copy, file, lambda t: t.__setitem__(name, torch.zeros(shape, dtype=torch.int32)))
    counter, err = load_counting(copy, monkeypatch)
    assert err is not None and counter.reads == 0
    assert str(err) == f"{copy / file}: tensor {name} is I32, expected BF16 or F16 or F32"

    packed = "language_model.model.layers.1.mlp.experts.0.gate_proj.weight_packed"
    packed_file = index_file_of(copy, packed)
    rewrite_file(copy, packed_file, lambda t: t.__setitem__(packed, t[packed].to(torch.int64)))
    counter, err = load_counting(copy, monkeypatch)
    assert err is not None and counter.reads == 0
    # the first problem in reading order (layer 1's attention before its experts) is named, the other counted
    assert str(err) == (f"{copy / file}: tensor {name} is I32, expected BF16 or F16 or F32 "
                        "(and 1 more problems in the tensors this rank reads)")
    rewrite_file(copy, file, lambda t: t.__setitem__(name, torch.zeros(shape, dtype=torch.bfloat16)))
    counter, err = load_counting(copy, monkeypatch)
    assert err is not None and counter.reads == 0
    assert str(err) == f"{copy / packed_file}: tensor {packed} is I64, expected I32"


def test_a_cut_file_and_a_file_the_index_names_but_that_is_gone(copy, monkeypatch):
    file = "model-00002-of-00002.safetensors"
    data = (copy / file).read_bytes()
    (copy / file).write_bytes(data[: len(data) - 1000])
    counter, err = load_counting(copy, monkeypatch)
    assert err is not None and counter.reads == 0
    assert str(err).startswith(f"{copy / file}: tensor ") and "the file has" in str(err)

    (copy / file).unlink()
    counter, err = load_counting(copy, monkeypatch)
    assert err is not None and counter.reads == 0
    assert str(err).startswith(f"{copy / file}: no such file (model.safetensors.index.json names it for tensor ")


def test_an_index_naming_a_path_outside_the_checkpoint_is_refused(copy):
    index = copy / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    name = "language_model.model.norm.weight"
    for outside in ("../outside.safetensors", "/etc/hostname", "sub/../../x.safetensors"):
        data["weight_map"][name] = outside
        index.write_text(json.dumps(data))
        with pytest.raises(UserInputError, match=rf"tensor {name} is mapped to '{outside}', not a file name inside"):
            read_checkpoint_info(copy)


@pytest.mark.parametrize("header", [b"\xff" * 8, (20).to_bytes(8, "little") + b"{not json           "])
def test_a_damaged_header_is_one_line(tmp_path, header):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(header + b"\0" * 64)
    with pytest.raises(UserInputError, match=r"bad\.safetensors: (not a safetensors file|damaged safetensors header)"):
        read_safetensors_header(path)


def test_the_header_reader_agrees_with_safetensors(tiny):
    """Names, dtypes and shapes from the 8-byte length + JSON header equal safe_open's view."""
    dtype_names = {torch.bfloat16: "BF16", torch.float32: "F32", torch.int32: "I32", torch.int64: "I64"}
    for file in sorted({f for f in json.loads((tiny / "model.safetensors.index.json").read_text())["weight_map"].values()}):
        header = read_safetensors_header(tiny / file)
        with safe_open(str(tiny / file), framework="pt") as f:
            assert sorted(header) == sorted(f.keys())
            for name in f.keys():
                tensor = f.get_tensor(name)
                assert header[name]["shape"] == list(tensor.shape)
                assert header[name]["dtype"] == dtype_names[tensor.dtype]


@pytest.mark.parametrize("edit,message", [
    (lambda q: q.update(quant_method="fp8"), "quant_method = 'fp8' is not supported"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(num_bits=8), "config_groups.group_0"),
    (lambda q: q["config_groups"]["group_0"].update(input_activations={"num_bits": 8}), "quantizes activations"),
    (lambda q: q.update(config_groups=["group_0"]), "not a mapping with config_groups"),
])
def test_an_unsupported_quantization_config_is_one_line(copy, edit, message):
    config = json.loads((copy / "config.json").read_text())
    edit(config["text_config"]["quantization_config"])
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserInputError, match=message) as caught:
        read_checkpoint_info(copy)
    assert str(caught.value).startswith(f"{copy / 'config.json'}: ") and "\n" not in str(caught.value)


def edit_text_config(path, **values) -> None:
    config = json.loads((path / "config.json").read_text())
    config["text_config"].update(values)
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("values,named", [
    ({"num_hidden_layers": 1_000_000}, "num_hidden_layers = 1000000 is outside [1, 1024]"),
    ({"num_hidden_layers": 9}, "num_hidden_layers = 9 but {index} names tensors of layers 0-2 (3 in all), none of layer 3"),
    ({"hidden_size": 10**9}, "hidden_size = 1000000000 is outside [1, 65536]"),
    ({"vocab_size": 2**40}, "vocab_size = 1099511627776 is outside [1, 4194304]"),
    ({"num_experts_per_tok": N_EXPERTS + 1}, f"num_experts_per_tok = {N_EXPERTS + 1} is more than n_routed_experts = {N_EXPERTS}"),
    ({"first_k_dense_replace": 4}, "first_k_dense_replace = 4 is more than num_hidden_layers = 3"),
    ({"n_routed_experts": 10**7}, "n_routed_experts = 10000000 is outside [1, 4096]"),
    ({"vocab_size": 500}, "{embed}: tensor language_model.model.embed_tokens.weight has shape [250, 64] but {config} gives "
                          "vocab_size x hidden_size = [500, 64]"),
])
def test_config_numbers_are_checked_against_the_headers_and_their_bounds_before_any_work(copy, values, named):
    """config.json's sizes are checked against the layers the index holds, the embedding's header
    and the range of a model's sizes, before anything loops over them or allocates by them
    (before: a million claimed layers reached the pipeline cut's quadratic search, a billion-wide
    hidden size the model build)."""
    edit_text_config(copy, **values)
    index = json.loads((copy / "model.safetensors.index.json").read_text())["weight_map"]
    named = named.format(index=copy / "model.safetensors.index.json", config=copy / "config.json",
                         embed=copy / index["language_model.model.embed_tokens.weight"])
    with pytest.raises(UserInputError) as caught:
        read_checkpoint_info(copy)
    message = str(caught.value)
    assert named in message and "\n" not in message, message


def test_the_extract_stage_refuses_a_million_claimed_layers_at_once(copy, tmp_path):
    """`python -m eagleforge.extract` on a 3-layer checkpoint whose config.json claims 1,000,000
    layers: one error line naming the key and its bound, exit 2, in seconds (before: the
    pipeline cut's search over a million layers gave no answer in 300 s)."""
    import os
    import subprocess
    import sys

    edit_text_config(copy, num_hidden_layers=1_000_000)
    source = tmp_path / "tokens.jsonl"
    source.write_text("".join(json.dumps({"input_ids": [5, 6, 7, 8], "loss_mask": [0, 1, 1, 1]}) + "\n" for _ in range(3)))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    env.pop("CONFIG", None)
    args = [f"run_dir={tmp_path / 'run'}", f"target.path={copy}", "target.backend=native", "target.device=cpu",
            "target.dtype=float32", f"data.source={source}", "data.regenerate=false"]
    proc = subprocess.run([sys.executable, "-m", "eagleforge.extract", *args], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0] == (f"error: {copy / 'config.json'}: num_hidden_layers = 1000000 is outside [1, 1024], the range of a "
                        "model's sizes (eagleforge.config.MODEL_SIZE_BOUNDS); a mistyped or damaged config?"), lines[0]
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("rope_key", ["rope_scaling", "rope_parameters"])
def test_two_different_rope_thetas_are_refused_by_the_native_backend(copy, rope_key):
    """text_config.rope_theta and the RoPE dict's rope_theta disagree: one line naming both values
    (transformers 5 would take the dict's silently, the native backend took the top level's)."""
    config = json.loads((copy / "config.json").read_text())
    yarn = {"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 512, "beta_fast": 32.0, "beta_slow": 1.0,
            "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0}
    config["text_config"].update({"rope_theta": 50000.0, "rope_scaling": None, rope_key: yarn})
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserInputError) as caught:
        read_checkpoint_info(copy).args
    assert str(caught.value).startswith(f"{copy / 'config.json'}: rope_theta = 50000.0 but {rope_key}.rope_theta = 10000.0: "
                                        "the RoPE base is given twice with different values")
    yarn["rope_theta"] = 50000.0  # agreeing values: read, with the yarn settings
    (copy / "config.json").write_text(json.dumps(config))
    args = read_checkpoint_info(copy).args
    assert args.rope_theta == 50000.0 and args.rope_scaling["factor"] == 8.0
