"""The multi-GPU preflight (extract/native/preflight.py) and the planner's per-token work it projects from.

- The planner's FLOPs and collective bytes per token against the native model itself: torch's
  FlopCounterMode around a forward + greedy head of a tiny Kimi-layout checkpoint, and the bytes
  every all-reduce / all-gather call moves, counted at tp 1 and at tp 2 over gloo (router and
  latents split over the ranks, and not).
- The preflight's mechanics over gloo at 2 and 3 processes: positive measurements, nccl-tests'
  busbw = algbw * 2(n-1)/n (1 at n = 2, 4/3 at n = 3), the projection equal to a hand computation
  from the measured rates, the link warning; and the CLI under torchrun.
"""

import json
import math
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from procs import PROCESS_GROUP_TIMEOUT, spawn_ranks

from eagleforge.config import load_config
from eagleforge.extract.native.plan import collective_bytes_per_token, flops_per_token
from eagleforge.extract.native.preflight import Link, bandwidth_warning, busbw_factor, link_from_smi, project_tokens_per_s

T = 24  # tokens of the tiny model's forward (even: the split rows are not padded)


# ---------------------------------------------------------------------------------------------- the planner vs the model


def _count_forward(model, split_min_tokens: int | None = None) -> dict:
    """FLOPs (torch's counter) and collective bytes of one forward + greedy head of T random tokens."""
    from torch.utils.flop_counter import FlopCounterMode

    counts = {"all_reduce": 0, "all_gather": 0}
    originals = dist.all_reduce, dist.all_gather, dist.all_gather_into_tensor

    def all_reduce(x, *args, **kwargs):
        counts["all_reduce"] += x.numel() * x.element_size()
        return originals[0](x, *args, **kwargs)

    def all_gather(parts, x, *args, **kwargs):  # the gathered output's bytes, as nccl-tests counts them
        counts["all_gather"] += sum(p.numel() * p.element_size() for p in parts)
        return originals[1](parts, x, *args, **kwargs)

    def all_gather_into_tensor(out, x, *args, **kwargs):
        counts["all_gather"] += out.numel() * out.element_size()
        return originals[2](out, x, *args, **kwargs)

    dist.all_reduce, dist.all_gather, dist.all_gather_into_tensor = all_reduce, all_gather, all_gather_into_tensor
    try:
        ids = torch.randint(0, model.args.vocab_size, (1, T))
        with torch.inference_mode(), FlopCounterMode(display=False) as counter:
            normed = model(ids)
            model.greedy_tokens(normed.reshape(-1, normed.shape[-1]))
    finally:
        dist.all_reduce, dist.all_gather, dist.all_gather_into_tensor = originals
    return dict(counts, flops=counter.get_total_flops())


def _build(path, tp):
    from eagleforge.extract.native.loader import build_model, load_weights, read_checkpoint_info

    info = read_checkpoint_info(path)
    # expert_layout tp: every routed slot on every rank (1/tp of its width), so the count does not
    # depend on where the router sends the tokens (ep: k/tp slots per rank only on average)
    model = build_model(info, tp, "tp", torch.float32, torch.device("cpu"))
    load_weights(model, info, show_progress=False)
    return model


def _counting_worker(rank: int, world: int, path: str, out_dir: str) -> None:
    from eagleforge.extract.native.parallel import tensor_parallel
    from eagleforge.layout import layout_of_world

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=PROCESS_GROUP_TIMEOUT)  # env:// from spawn_ranks
    try:
        tp = tensor_parallel(layout_of_world(world, 1, torch.device("cpu")))
        model = _build(path, tp)
        result = {}
        for split, min_tokens in (("split", 1), ("replicated", 1 << 30)):
            tp.split_rows_min_tokens = min_tokens
            result[split] = _count_forward(model)
        with open(f"{out_dir}/rank{rank}.json", "w") as f:
            json.dump(result, f)
        dist.barrier()  # leave together: a gloo rank that tears its group down while another still
        # reads from it makes that one abort at exit (SIGABRT, 'terminate called without an active exception')
    finally:
        dist.destroy_process_group()


def test_planner_flops_and_collective_bytes_match_the_native_model(tmp_path):
    from test_native_fixtures import tiny_text_config, write_tiny_kimi

    from eagleforge.extract.native.model import ModelArgs
    from eagleforge.extract.native.parallel import TensorParallel

    write_tiny_kimi(tmp_path / "ckpt", seed=3)
    a = ModelArgs.from_config(tiny_text_config())
    # The counter counts the full [T, T] scores of the causal attention: the planner's keys per
    # query (seq_len / 2 on average) are T at seq_len = 2T.
    one = _count_forward(_build(tmp_path / "ckpt", TensorParallel()))
    assert one == {"all_reduce": 0, "all_gather": 0, "flops": T * flops_per_token(a, 1, 2 * T, False)}
    spawn_ranks(_counting_worker, (str(tmp_path / "ckpt"), str(tmp_path)), world=2)
    for rank in range(2):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for mode, split in (("split", True), ("replicated", False)):
            want = {k: T * v for k, v in collective_bytes_per_token(a, 2, 4, split).items()}  # fp32: 4 bytes
            assert {k: got[mode][k] for k in want} == want, (rank, mode)
            assert got[mode]["flops"] == T * flops_per_token(a, 2, 2 * T, split), (rank, mode)
    # What the split saves: every rank repeats the latents and the router without it.
    assert flops_per_token(a, 2, 2 * T, True) == pytest.approx(flops_per_token(a, 1, 2 * T, False) / 2)
    assert flops_per_token(a, 2, 2 * T, False) > flops_per_token(a, 2, 2 * T, True)


# ---------------------------------------------------------------------------------------------- the preflight over gloo


def _preflight_worker(rank: int, world: int, overrides: list, out_file: str) -> None:
    from eagleforge.extract.native.preflight import run_preflight

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=PROCESS_GROUP_TIMEOUT)  # env:// from spawn_ranks
    try:
        pcie5 = Link("PCIe", "Gen5 x16", 63.0)
        report = run_preflight(load_config(None, overrides), torch.device("cpu"), sizes=[64 << 10, 1 << 20], iters=2,
                               matmul_n=64, link=pcie5)
        if rank == 0:
            with open(out_file, "w") as f:
                json.dump(report, f)
        dist.barrier()  # leave together (gloo's teardown)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_preflight_over_gloo_measures_and_projects(world, tmp_path):
    tp, tokens = 2, 2048
    overrides = ["target.backend=native", f"target.tp={tp}", "target.device=cpu", f"extract.batch_tokens={tokens}",
                 "data.max_length=1024"]
    spawn_ranks(_preflight_worker, (overrides, str(tmp_path / "report.json")), world)
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["world"] == world and report["backend"] == "gloo"
    assert [r["bytes"] for r in report["all_reduce"]] == [64 << 10, 1 << 20]
    for row in report["all_reduce"]:
        assert row["seconds"] > 0
        assert row["algbw_gbs"] == pytest.approx(row["bytes"] / row["seconds"] / 1e9)
        assert row["busbw_gbs"] == pytest.approx(row["algbw_gbs"] * 2 * (world - 1) / world)
    rates = report["matmul_tflops"]
    assert len(rates) == world and all(r > 0 for r in rates)

    # By hand: the built-in Kimi config (no target.path: H 7168, 64 heads, q_lora 1536, kv_lora 512,
    # rope 64, nope 128, v 128, dense MLP 18432, experts 2048 wide, 8 routed + 1 shared of 384, 61
    # layers of which 1 dense, vocabulary 163840), tp 2 (32 heads a rank), 2048 tokens (router and
    # latents split over the 2 ranks), sequences of 1024 (512 keys per query on average).
    # FLOPs per token, 2 x the multiply-adds of one rank:
    latents = 7168 * (1536 + 512 + 64) / 2  # q_a, kv_a: half the tokens
    q_b = 1536 * 32 * (128 + 64)
    kv_b = 512 * 32 * (128 + 128)
    core = 32 * 512 * ((128 + 64) + 128)  # q.k and p.v over 512 keys
    o_proj = 32 * 128 * 7168
    attention = latents + q_b + kv_b + core + o_proj  # 55,803,904
    dense = 3 * 7168 * 18432 / 2  # gate, up, down: half the width
    moe = 3 * 7168 * 2048 * (8 + 1) / 2 + 7168 * 384 / 2  # 8 routed + 1 shared slots, half the width; router: half the tokens
    head = 7168 * 163840 / 2  # the greedy head: half the vocabulary
    flops = 2 * (1 * (attention + dense) + 60 * (attention + moe) + head)
    assert flops == 32_325_697_536
    # bytes per token (bf16): an all-reduce of [H] after the embedding and after each attention and
    # MLP; all-gathers of the split latents (2112 values a layer), of the router's 8 slots (fp32
    # weight + int64 id) in the 60 MoE layers, and of each rank's best logit (fp32) and id (int64)
    traffic = {"all_reduce": (1 + 2 * 61) * 7168 * 2, "all_gather": 61 * 2112 * 2 + 60 * 8 * (4 + 8) + 2 * (4 + 8)}
    assert traffic == {"all_reduce": 1_763_328, "all_gather": 263_448}
    busbw = report["all_reduce"][-1]["busbw_gbs"]
    # the slowest rank's rate at 60%, the largest size's busbw; a ring all-reduce moves 2(n-1)/n of
    # the bytes, an all-gather (n-1)/n
    compute_s = flops / (min(rates) * 1e12 * 0.6)
    comm_s = (traffic["all_reduce"] * 2 * (tp - 1) / tp + traffic["all_gather"] * (tp - 1) / tp) / (busbw * 1e9)
    p = report["projection"]
    assert p["flops_per_token"] == flops and p["bytes_per_token"] == traffic and p["groups"] == world // tp
    assert p["compute_us"] == pytest.approx(compute_s * 1e6) and p["comm_us"] == pytest.approx(comm_s * 1e6)
    assert p["total"] == pytest.approx((world // tp) / (compute_s + comm_s))
    # gloo on a CPU is far below what a PCIe Gen5 x16 link gives: the warning names what to check
    assert report["warning"].startswith("warning: all-reduce bus bandwidth") and "NCCL_P2P_LEVEL" in report["warning"]


def test_preflight_cli_under_torchrun_prints_the_measurements_and_the_projection(tmp_path):
    import os

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "eagleforge.extract.native.preflight", "target.backend=native", "target.tp=2", "target.device=cpu",
           "extract.batch_tokens=64", f"run_dir={tmp_path}"]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "all-reduce over 2 ranks" in out and "busbw = algbw x 2(n-1)/n" in out, out
    lines = [line.split() for line in out.splitlines() if line.strip().endswith(tuple("0123456789")) and " MiB " in line]
    assert len(lines) == 3 and all(float(cols[-1]) > 0 for cols in lines), out  # 64 x 7168 x 2 bytes, 1 MiB, 16 MiB
    assert "bf16 matmul TFLOP/s per rank" in out and "tokens/s per group" in out, out


# ---------------------------------------------------------------------------------------------- pure parts


def test_projection_is_the_hand_computation():
    # 8 GFLOP and 1.75 MB all-reduced + 0.25 MB all-gathered per token, 500 TFLOP/s at 50%, 40 GB/s busbw, tp 8, 2 groups
    p = project_tokens_per_s(8e9, {"all_reduce": 1.75e6, "all_gather": 2.5e5}, 500.0, 40.0, tp=8, groups=2, mfu=0.5)
    compute_us = 8e9 / 250e12 * 1e6  # 32 us
    comm_us = (1.75e6 * 1.75 + 2.5e5 * 0.875) / 40e9 * 1e6  # 76.5625 + 5.46875 = 82.03125 us
    assert p["compute_us"] == pytest.approx(32.0) == pytest.approx(compute_us)
    assert p["comm_us"] == pytest.approx(82.03125) == pytest.approx(comm_us)
    assert p["per_group"] == pytest.approx(1e6 / 114.03125)
    assert p["total"] == pytest.approx(2e6 / 114.03125)
    assert project_tokens_per_s(8e9, {"all_reduce": 0, "all_gather": 0}, 500.0, math.nan, tp=1, groups=3, mfu=0.5)["comm_us"] == 0


def test_stage_projection_is_the_hand_computation_and_tp_only_agrees_with_the_tp_projection():
    from eagleforge.extract.native.model import ModelArgs
    from eagleforge.extract.native.plan import KIMI_K25_TEXT_CONFIG, collective_bytes_per_token, flops_per_token
    from eagleforge.extract.native.preflight import Rates, layout_projections, project_stages

    rates = Rates(matmul_tflops=500.0, busbw_gbs=20.0, p2p_gbs=10.0, mfu=0.5)
    # two stages: 4 and 6 GFLOP per token, stage 0 sends 30 KB per token (3 us at 10 GB/s: hidden under its 16 us)
    stages = [{"flops": 4e9, "all_reduce": 0, "all_gather": 0, "recv": 0, "send": 3e4},
              {"flops": 6e9, "all_reduce": 0, "all_gather": 0, "recv": 3e4, "send": 0}]
    p = project_stages(stages, tp=1, groups=3, rates=rates)
    assert [t["compute_us"] for t in p["stages"]] == pytest.approx([16.0, 24.0])
    assert p["slowest_stage"] == 1 and p["per_group"] == pytest.approx(1e6 / 24.0) and p["total"] == pytest.approx(3e6 / 24.0)
    slow_link = project_stages(stages, tp=1, groups=1, rates=Rates(500.0, 20.0, 1.0, 0.5))  # a 30 us hop outlasts the compute
    assert slow_link["per_group"] == pytest.approx(1e6 / 30.0)
    # one stage of tp 8: the tensor-parallel projection of the whole model
    a = ModelArgs.from_config(KIMI_K25_TEXT_CONFIG)
    rows = {(r["tp"], r["pp"]): r for r in layout_projections(a, 8, rates, 2, 2048, [1, 29, 57], batch_tokens=8192)}
    assert sorted(rows) == [(1, 8), (2, 4), (4, 2), (8, 1)]
    tp8 = project_tokens_per_s(flops_per_token(a, 8, 2048, True), collective_bytes_per_token(a, 8, 2, True), 500.0, 20.0,
                               tp=8, groups=1, mfu=0.5)
    assert rows[(8, 1)]["per_group"] == pytest.approx(tp8["per_group"], rel=1e-9)
    # PCIe-like rates: stages beat tensor parallelism by far (no all-reduce per layer)
    assert rows[(1, 8)]["per_group"] > 3 * rows[(8, 1)]["per_group"]
    # the recommendation skips layouts that do not fit
    best = layout_projections(a, 8, rates, 2, 2048, [1, 29, 57], fits=lambda tp, pp: tp == 8)
    assert [r["fits"] for r in best] == [r["tp"] == 8 for r in best] and best[0]["tp"] == 1


def test_busbw_factor_is_nccl_tests():
    assert [busbw_factor(n) for n in (2, 4, 8)] == [1.0, 1.5, 1.75]


def test_link_is_read_from_nvidia_smi_and_slow_bandwidth_warns():
    nvlink = "GPU 0: NVIDIA H200 (UUID: GPU-x)\n\t Link 0: 26.562 GB/s\n\t Link 1: 26.562 GB/s\n\t Link 2: <inactive>\n"
    link = link_from_smi(nvlink, "5, 16\n")
    assert (link.kind, link.detail) == ("NVLink", "2 links x 26.6 GB/s") and link.raw_gbs == pytest.approx(53.124)
    pcie = link_from_smi("", "5, 16\n")
    assert (pcie.kind, pcie.detail) == ("PCIe", "Gen5 x16") and pcie.raw_gbs == pytest.approx(63.008)
    assert link_from_smi("", "") is None and link_from_smi("", "[N/A], [N/A]") is None
    # ~22 GB/s: what 8 RTX PRO 6000 reached untuned, against ~50 expected from Gen5 x16
    line = bandwidth_warning(22.0, pcie)
    assert line.startswith("warning: all-reduce bus bandwidth 22.0 GB/s is under 50% of what PCIe Gen5 x16 should give (~50 GB/s)")
    assert "NCCL_P2P_LEVEL" in line and "\n" not in line
    assert bandwidth_warning(40.0, pcie) is None and bandwidth_warning(1.0, None) is None
    assert "nvidia-smi nvlink --status" in bandwidth_warning(10.0, link)
