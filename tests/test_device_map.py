"""target.device_map (hf backend): a target spread by accelerate over devices captures the same
states as the same target loaded whole on one device.

On the CPU the split is the CPU and disk (a max_memory smaller than the model: the first modules
stay in memory, the rest are offloaded to the checkpoint on disk and streamed in per forward);
on two GPUs the layers are balanced over both. Fresh random inputs of odd lengths each time.
"""

import json

import pytest
import torch

from eagleforge.config import TargetConfig, load_config, parse_max_memory
from eagleforge.errors import ConfigError, UserInputError
from eagleforge.target.capture import HiddenStateCapture
from eagleforge.target.loading import decoder_layers, final_norm, load_target

pytestmark = pytest.mark.usefixtures("one_torch_thread")

AUX = [1, 3, 5]
# The tiny Llama below holds ~70 KB per layer in fp32 and ~40 KB of embedding: 300 KiB of "cpu"
# keeps the embedding and a layer or two in memory and sends the rest (the aux layers 3 and 5,
# the final norm, the head) to disk.
CPU_BUDGET = "cpu:300KiB"


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    """A tiny random LlamaForCausalLM saved as safetensors with the embedded tokenizer."""
    from tiny_runs import write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("devmap") / "tiny-llama")


def _random_samples(count: int = 5) -> list[list[int]]:
    lengths = torch.randint(1, 40, (count,)).tolist()  # unseeded: fresh inputs each run
    return [torch.randint(3, 211, (n,)).tolist() for n in lengths]


def _capture(model, samples, device) -> dict[str, torch.Tensor]:
    from eagleforge.target.hf import forward_batch

    with HiddenStateCapture(decoder_layers(model), AUX, final_norm(model)) as capture:
        return forward_batch(model, capture, samples, 0, device, True)


def _assert_same_rows(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for key in ("aux_hidden_states", "last_hidden_state"):
        assert got[key].device == want[key].device
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-5)
    assert torch.equal(got["target_argmax"], want["target_argmax"])


def test_cpu_and_disk_offload_captures_the_plain_models_states(tiny_target):
    plain, _ = load_target(TargetConfig(path=str(tiny_target), device="cpu", dtype="float32"))
    mapped, _ = load_target(TargetConfig(path=str(tiny_target), device="cpu", dtype="float32",
                                         device_map="auto", max_memory=[CPU_BUDGET]), torch.device("cpu"))
    placement = mapped.hf_device_map
    assert set(placement.values()) == {"cpu", "disk"}, placement
    # The split cuts through the capture: an aux layer in memory, aux layers, norm and head offloaded.
    assert placement.get("model.layers.1") == "cpu" and placement["model.layers.5"] == "disk", placement
    assert mapped.model.layers[5].mlp.up_proj.weight.device.type == "meta"  # streamed in per forward
    samples = _random_samples()
    _assert_same_rows(_capture(mapped, samples, torch.device("cpu")), _capture(plain, samples, torch.device("cpu")))


def test_extract_stage_with_device_map_writes_the_plain_runs_states(tiny_target, tmp_path):
    """The whole stage (load, capture, writer) with the map, against the stage without it."""
    from eagleforge.extract.__main__ import main
    from eagleforge.shards import ShardReader

    rows = [{"id": i, "input_ids": ids, "loss_mask": [1] * len(ids)} for i, ids in enumerate(_random_samples(7))]
    common = [f"target.path={tiny_target}", "target.device=cpu", "target.dtype=float32", "extract.samples_per_shard=3",
              "extract.batch_tokens=64", "extract.storage_dtype=float32", f"extract.aux_layers={AUX}"]
    states = {}
    for name, extra in (("plain", []), ("mapped", ["target.device_map=sequential", f"target.max_memory=[{CPU_BUDGET}]"])):
        run = tmp_path / name
        (run / "data").mkdir(parents=True)
        (run / "data" / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        main(load_config(None, [*common, *extra, f"run_dir={run}"]))
        reader = ShardReader(run / "hidden", verify_checksums=True)
        states[name] = {sample_id: reader[i] for i, sample_id in enumerate(reader.sample_ids())}
    assert sorted(states["mapped"]) == list(range(7))
    for sample_id, want in states["plain"].items():
        got = states["mapped"][sample_id]
        for key in ("aux_hidden_states", "last_hidden_state"):
            torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-5)
        assert torch.equal(got["target_argmax"], want["target_argmax"])


def test_online_target_with_device_map_matches_the_plain_one(tiny_target, tmp_path):
    """Online training's target (eagleforge/target/hf.py HFTarget, the same as extraction's) loads through the same map."""
    from eagleforge.layout import Layout
    from eagleforge.target.hf import HFTarget

    rows = [{"id": 0, "input_ids": [5, 6, 7], "loss_mask": [1, 1, 1]}]
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "samples.jsonl").write_text(json.dumps(rows[0]) + "\n")
    base = [f"target.path={tiny_target}", "target.device=cpu", "target.dtype=float32", f"extract.aux_layers={AUX}",
            f"run_dir={tmp_path}"]
    plain = HFTarget(load_config(None, base), Layout(), write_target_argmax=True)
    mapped = HFTarget(load_config(None, [*base, "target.device_map=auto", f"target.max_memory=[{CPU_BUDGET}]"]), Layout(),
                      write_target_argmax=True)
    try:
        assert "disk" in mapped.model.hf_device_map.values()
        samples = _random_samples()
        _assert_same_rows(mapped.forward(samples), plain.forward(samples))
    finally:
        plain.close()
        mapped.close()


def test_device_map_is_refused_under_torchrun_before_loading(monkeypatch, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", "2")
    # tmp_path holds no model: the refusal comes before any read.
    cfg = TargetConfig(path=str(tmp_path), device="cpu", device_map="balanced")
    with pytest.raises(UserInputError, match=r"^target.device_map=balanced under torchrun \(WORLD_SIZE=2\): each rank would spread"):
        load_target(cfg, torch.device("cpu"))


def test_device_map_is_refused_by_the_decoding_stages(tiny_target):
    """Data regeneration and eval load without naming a device: their decoding loops keep caches
    and row indices on one device, so the map is refused there, naming the fix."""
    from eagleforge.data.regenerate import regenerate

    cfg = load_config(None, [f"target.path={tiny_target}", "target.device=cpu", "target.device_map=auto"])
    with pytest.raises(UserInputError, match=r"^target.device_map=auto is for extraction and online training; .* target.device_map=none"):
        load_target(cfg.target)
    with pytest.raises(UserInputError, match="target.device_map=auto is for extraction"):
        regenerate(cfg, [], tiny_target, None)


def test_max_memory_is_parsed_into_accelerates_form():
    assert parse_max_memory(["0:70GiB", "1: 1.5GB", "cpu:200KiB", "disk:1TB"]) == {
        0: 70 * 2**30, 1: 1_500_000_000, "cpu": 200 * 2**10, "disk": 10**12}
    cfg = load_config(None, ["target.device_map=balanced", "target.max_memory=[0:70GiB, cpu:100GB]"])
    assert cfg.target.max_memory == ["0:70GiB", "cpu:100GB"]


@pytest.mark.parametrize("overrides,message", [
    (["target.device_map=all"], r"'target.device_map' must be one of \['none', 'auto'"),
    (["target.device_map=auto", "target.max_memory=[1:30]"], r"item 90: expected a string 'DEVICE:SIZE'"),  # YAML's sexagesimal 90
    (["target.device_map=auto", "target.max_memory=[gpu0:1GB]"], r"item 'gpu0:1GB': device 'gpu0' must be a GPU index"),
    (["target.device_map=auto", "target.max_memory=[0:70]"], r"item '0:70': size '70' must be a number > 0 with a unit"),
    (["target.device_map=auto", "target.max_memory=[0:-1GiB]"], r"size '-1GiB' must be a number > 0"),
    (["target.device_map=auto", "target.max_memory=[0:0GiB]"], r"size .0GiB. must be a number > 0"),
    (["target.device_map=auto", "target.max_memory=[0:1e-30B]"], r"size .1e-30B. must be a number > 0"),
    (["target.device_map=auto", "target.max_memory=[0:1GiB, 0:2GiB]"], r"item '0:2GiB': device '0' appears twice"),
    (["target.max_memory=[0:1GiB]"], r"'target.max_memory' is set but target.device_map is none"),
    (["target.offload_folder=/tmp/x"], r"'target.offload_folder' is set but target.device_map is none"),
    (["target.backend=native", "target.device_map=auto"], r"'target.device_map' = 'auto' is for the hf backend; the native backend"),
    (["target.pp=3"], r"'target.pp' = 3 is for the native backend \(target.backend=native\); the hf backend spreads"),
])
def test_bad_device_map_keys_are_one_line_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs to balance the layers over")
def test_two_gpus_balanced_captures_the_plain_models_states(tiny_target):
    cuda = torch.device("cuda", 0)
    plain, _ = load_target(TargetConfig(path=str(tiny_target), device="cuda:0", dtype="float32"))
    mapped, _ = load_target(TargetConfig(path=str(tiny_target), device="cuda:0", dtype="float32", device_map="balanced"), cuda)
    placement = mapped.hf_device_map
    assert {0, 1} <= set(placement.values()), placement
    assert mapped.model.layers[1].mlp.up_proj.weight.device != mapped.model.layers[5].mlp.up_proj.weight.device
    samples = _random_samples()
    _assert_same_rows(_capture(mapped, samples, cuda), _capture(plain, samples, cuda))
