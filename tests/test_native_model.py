"""Native backend vs transformers' own DeepseekV3ForCausalLM, at 1, 2 and 4 ranks (gloo, CPU).

Tiny checkpoints in the real Kimi-K2.5 layout (test_native_fixtures.write_tiny_kimi): INT4 routed
experts packed by compressed-tensors, bf16 elsewhere, fp32 correction bias, `language_model.`
prefix, stub vision tower. The reference holds the dequantized weights; both run in float64, so
the captured aux states, the final normed state and the greedy token must agree to ~1e-12 for
both expert layouts, with K2.5's YaRN (factor 64, beta_fast 32) in one checkpoint and grouped
routing (n_group 2) in the other. Ranks also report the bytes they read: each reads its slices only.
"""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
import torch.distributed as dist
from procs import PROCESS_GROUP_TIMEOUT, spawn_ranks
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from eagleforge.extract.native.loader import build_model, load_weights, read_checkpoint_info
from eagleforge.extract.native.parallel import TensorParallel, split_range, tensor_parallel
from eagleforge.layout import layout_of_world
from eagleforge.target.capture import HiddenStateCapture

AUX_LAYERS = [1, 2]
REFERENCES = {}  # case -> transformers reference model (float64), filled by the fixture
CASES = {
    "k25_yarn": dict(rope_scaling={"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096,
                                   "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
                     max_position_embeddings=262144),
    "grouped": dict(n_group=2, topk_group=1),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{case: (path, reference model, input_ids, reference aux, reference normed, reference greedy)}."""
    from test_native_fixtures import reference_states, write_tiny_kimi

    out = {}
    for seed, (case, overrides) in enumerate(CASES.items()):
        path = tmp_path_factory.mktemp(case)
        ref, _ = write_tiny_kimi(path, seed=seed, **overrides)
        torch.manual_seed(100 + seed)
        input_ids = torch.randint(0, 250, (3, 29))
        aux, normed, greedy = reference_states(ref, input_ids, AUX_LAYERS)
        out[case] = (path, input_ids, aux, normed, greedy)
        REFERENCES[case] = ref
    return out


def run_native(path, layout: str, tp: TensorParallel, input_ids: torch.Tensor, dtype=torch.float64,
               device=torch.device("cpu")) -> dict[str, torch.Tensor]:
    """This rank's captured states, greedy tokens and read statistics (tensors back on the CPU)."""
    info = read_checkpoint_info(path)
    model = build_model(info, tp, layout, dtype, device)
    input_ids = input_ids.to(device)
    stats = load_weights(model, info, show_progress=False)
    with HiddenStateCapture(model.model.layers, AUX_LAYERS, model.model.norm) as capture:
        normed = model(input_ids)
        aux, last = capture.aux_hidden_states, capture.last_hidden_state
    greedy = model.greedy_tokens(normed.reshape(-1, normed.shape[-1])).view(input_ids.shape)
    return {"aux": aux.cpu(), "last": last.cpu(), "normed": normed.cpu(), "greedy": greedy.cpu(),
            "bytes_read": torch.tensor(stats.bytes_read), "names": stats.names}


def _worker(rank: int, world: int, path: str, input_ids: torch.Tensor, out_dir: str, tp_options: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=PROCESS_GROUP_TIMEOUT)  # env:// from spawn_ranks
    try:
        tp = tensor_parallel(layout_of_world(world, 1, torch.device("cpu")))
        for name, value in tp_options.items():
            setattr(tp, name, value)
        for layout in ("ep", "tp"):
            result = run_native(path, layout, tp, input_ids)
            names = result.pop("names")
            save_file({k: v.clone().contiguous() for k, v in result.items()}, os.path.join(out_dir, f"{layout}-rank{rank}.safetensors"))
            with open(os.path.join(out_dir, f"{layout}-rank{rank}.names.json"), "w") as f:
                json.dump(names, f)
        dist.barrier()  # leave together: a gloo rank that tears its group down while another still
        # reads from it makes that one abort at exit (SIGABRT, 'terminate called without an active exception')
    finally:
        dist.destroy_process_group()


def run_world(path, world: int, input_ids: torch.Tensor, out_dir, **tp_options) -> dict:
    """{(layout, rank): (tensors, names read)} from `world` spawned gloo processes; tp_options set
    TensorParallel's thresholds (split_rows_min_tokens, overlap_min_rows)."""
    spawn_ranks(_worker, (str(path), input_ids, str(out_dir), tp_options), world)
    results = {}
    for layout in ("ep", "tp"):
        for rank in range(world):
            tensors = load_file(os.path.join(out_dir, f"{layout}-rank{rank}.safetensors"))
            names = json.loads(open(os.path.join(out_dir, f"{layout}-rank{rank}.names.json")).read())
            results[layout, rank] = (tensors, names)
    return results


# float64 activations, but RoPE's frequencies and cos/sin are fp32 (as in transformers, the
# reference, run on the CPU); fp32 transcendentals on CUDA may differ from the CPU's in the last
# bit, the likely source of the up to 8.7e-7 difference in the aux states seen on an H200
# (greedy tokens equal). The CPU runs agree to 1e-10.
CUDA_TOL = 1e-5


def assert_matches_reference(tensors, aux, normed, greedy, where: str, tol: float = 1e-10) -> None:
    torch.testing.assert_close(tensors["aux"], aux, rtol=tol, atol=tol, msg=lambda m: f"{where} aux: {m}")
    torch.testing.assert_close(tensors["last"], normed, rtol=tol, atol=tol, msg=lambda m: f"{where} final norm: {m}")
    torch.testing.assert_close(tensors["normed"], normed, rtol=tol, atol=tol)
    assert torch.equal(tensors["greedy"].long(), greedy), f"{where}: greedy tokens differ"


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("layout", ["ep", "tp"])
def test_one_rank_matches_transformers(checkpoints, case, layout):
    path, input_ids, aux, normed, greedy = checkpoints[case]
    result = run_native(path, layout, TensorParallel(), input_ids)
    assert_matches_reference(result, aux, normed, greedy, f"{case} {layout} 1 rank")
    assert not any(n.startswith(("vision_tower.", "mm_projector.")) for n in result["names"])


def _tensor_bytes(path) -> dict[str, int]:
    """name -> stored bytes of every tensor of the checkpoint (read from the files' headers)."""
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    sizes = {}
    for file in set(index.values()):
        with safe_open(str(path / file), framework="pt") as f:
            for name in f.keys():
                t = f.get_slice(name)
                numel = 1
                for s in t.get_shape():
                    numel *= s
                sizes[name] = numel * {"BF16": 2, "F32": 4, "F64": 8, "I32": 4, "I64": 8}[t.get_dtype()]
    return sizes


_REPLICATED = re.compile(r"(layernorm|norm\.weight|q_a_proj|kv_a_proj_with_mqa|mlp\.gate\.|weight_shape)")


def check_bytes_read(path, results: dict, world: int, layout: str, n_experts: int) -> None:
    """Sum over ranks = world x replicated + sharded once; each rank's experts are its own range."""
    sizes = {n: b for n, b in _tensor_bytes(path).items() if n.startswith("language_model.")}
    replicated = sum(b for n, b in sizes.items() if _REPLICATED.search(n))
    sharded = sum(sizes.values()) - replicated
    if layout == "ep":  # weight_shape of experts is read only by the rank owning the expert
        shapes = sum(b for n, b in sizes.items() if n.endswith("weight_shape"))
        replicated, sharded = replicated - shapes, sharded + shapes
    read = [int(results[layout, r][0]["bytes_read"]) for r in range(world)]
    assert sum(read) == world * replicated + sharded, (layout, read, replicated, sharded)
    for rank in range(world):
        names = results[layout, rank][1]
        assert not any(n.startswith(("vision_tower.", "mm_projector.")) for n in names)
        experts = {int(m.group(1)) for n in names if (m := re.search(r"\.experts\.(\d+)\.", n))}
        if layout == "ep":
            start, end = split_range(n_experts, rank, world)
            assert experts == set(range(start, end)), (rank, sorted(experts))
        else:
            assert experts == set(range(n_experts))
        assert read[rank] < replicated + sharded, "a rank read as much as the whole text model"


@pytest.mark.parametrize("world", [2, 4])
def test_tensor_parallel_matches_transformers(checkpoints, tmp_path, world):
    for case, (path, input_ids, aux, normed, greedy) in checkpoints.items():
        out_dir = tmp_path / case
        out_dir.mkdir()
        results = run_world(path, world, input_ids, out_dir)
        for (layout, rank), (tensors, _) in results.items():
            assert_matches_reference(tensors, aux, normed, greedy, f"{case} {layout} rank {rank}/{world}")
        for layout in ("ep", "tp"):
            check_bytes_read(path, results, world, layout, n_experts=10)


def _split_rows_worker(rank: int, world: int, n: int, out_dir: str) -> None:
    dist.init_process_group("gloo", timeout=PROCESS_GROUP_TIMEOUT)
    try:
        tp = tensor_parallel(layout_of_world(world, 1, torch.device("cpu")))
        x = torch.arange(n * 3, dtype=torch.float64).view(n, 3)
        seen = []

        def fn(rows):  # row-wise; records which rows this rank computed
            seen.append(rows[:, 0].long() // 3)
            return rows.sum(-1, keepdim=True), (rows[:, :2] * 2).long()

        total, doubled = tp.split_rows(fn, x)
        save_file({"total": total, "doubled": doubled, "seen": seen[0]}, os.path.join(out_dir, f"rank{rank}.safetensors"))
        dist.barrier()  # leave together (gloo's teardown)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("n", [7, 2])
def test_split_rows_gives_every_rank_all_rows_each_computed_once(tmp_path, n):
    """TensorParallel.split_rows over 3 gloo ranks: uneven rows (7 = 3 + 3 + 1) and fewer rows
    than ranks (2: the last rank computes none); every rank ends with fn(x) of all rows."""
    world = 3
    spawn_ranks(_split_rows_worker, (n, str(tmp_path)), world)
    x = torch.arange(n * 3, dtype=torch.float64).view(n, 3)
    seen = []
    for rank in range(world):
        out = load_file(os.path.join(tmp_path, f"rank{rank}.safetensors"))
        assert torch.equal(out["total"], x.sum(-1, keepdim=True)) and torch.equal(out["doubled"], (x[:, :2] * 2).long())
        seen.append(out["seen"])
    assert torch.equal(torch.cat(seen), torch.arange(n)), seen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_head_in_chunks_is_the_full_argmax_with_ties_to_the_lowest_id(dtype):
    """VocabParallelHead.argmax reuses one [chunk, V] logits buffer: chunks of 1, 5 (a partial last
    chunk of 3) and more than the rows give torch.argmax over the whole [N, V] logits, ties (two
    equal head rows) going to the lower token id."""
    from eagleforge.extract.native.parallel import VocabParallelHead

    torch.manual_seed(3)
    head = VocabParallelHead(37, 16, TensorParallel(), dtype)
    with torch.no_grad():
        head.weight.normal_()
        head.weight[11] *= 4  # token 11 wins most rows
        head.weight[30] = head.weight[11]  # and token 30 ties with it in every row: the lower id must win
    hidden = torch.randn(23, 16, dtype=dtype)
    full = (hidden @ head.weight.t()).argmax(-1)
    assert (full == 11).sum() > 5
    for chunk in (1, 5, 23, 1024):
        assert torch.equal(head.argmax(hidden, chunk_tokens=chunk).long(), full), chunk


def test_split_rows_match_transformers_to_fp32_rounding(checkpoints, tmp_path, monkeypatch):
    """Per-token work split over the ranks (forced down to one token; normally from 1024 tokens):
    each rank routes its rows and computes their attention latents (q_a, kv_a and their norms),
    and the outputs are gathered; and the row-parallel linears' all-reduces in two row halves
    (forced down to 2 rows; normally from 4096), the first overlapping the second's GEMM. A GEMM
    may sum in an order that depends on its row count, so the match is to fp32 rounding, and the
    greedy tokens and the ranks' states are identical."""
    path, input_ids, aux, normed, greedy = checkpoints["k25_yarn"]
    results = run_world(path, 2, input_ids, tmp_path, split_rows_min_tokens=1, overlap_min_rows=2)
    for (layout, rank), (tensors, _) in results.items():
        assert_matches_reference(tensors, aux, normed, greedy, f"split rows {layout} rank {rank}/2", tol=1e-5)
        assert torch.equal(tensors["aux"], results[layout, 0][0]["aux"]), "ranks disagree"


def test_bf16_error_is_of_the_order_of_transformers_own_bf16(checkpoints):
    """The production dtype: error vs the float64 reference comparable to transformers' own bf16.

    (A tiny random MoE is chaotic in bf16: rounding flips routing decisions, so both are several
    percent off; the native path must not be much worse than the reference implementation.)
    """
    import copy

    from test_native_fixtures import reference_states

    path, input_ids, aux, normed, _ = checkpoints["k25_yarn"]
    native = run_native(path, "ep", TensorParallel(), input_ids, dtype=torch.bfloat16)
    ref = copy.deepcopy(REFERENCES["k25_yarn"]).to(torch.bfloat16)
    for layer in ref.model.layers:  # transformers keeps the router in fp32 (_keep_in_fp32_modules_strict)
        if hasattr(layer.mlp, "gate"):
            layer.mlp.gate.float()
    _, ref_normed, _ = reference_states(ref, input_ids, AUX_LAYERS)
    native_err = float((native["normed"].double() - normed).norm() / normed.norm())
    hf_err = float((ref_normed.double() - normed).norm() / normed.norm())
    assert native["aux"].dtype == torch.bfloat16 and torch.isfinite(native["aux"]).all()
    assert native_err < 2 * hf_err + 0.02, (native_err, hf_err)


@pytest.mark.gpu
def test_cuda_matches_transformers(checkpoints):
    """Device placement of every buffer (INT4 shifts, YaRN frequencies, argmax): float64 on one GPU."""
    for case, (path, input_ids, aux, normed, greedy) in checkpoints.items():
        for layout in ("ep", "tp"):
            result = run_native(path, layout, TensorParallel(), input_ids, device=torch.device("cuda"))
            torch.testing.assert_close(result["aux"].cpu(), aux, rtol=CUDA_TOL, atol=CUDA_TOL)
            torch.testing.assert_close(result["last"].cpu(), normed, rtol=CUDA_TOL, atol=CUDA_TOL)
            assert torch.equal(result["greedy"].long().cpu(), greedy)


def _nccl_worker(rank: int, world: int, path: str, input_ids: torch.Tensor, out_dir: str) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", timeout=PROCESS_GROUP_TIMEOUT)
    try:
        tp = tensor_parallel(layout_of_world(world, 1, torch.device("cuda", rank)))
        for layout in ("ep", "tp"):
            result = run_native(path, layout, tp, input_ids, device=torch.device("cuda", rank))
            result.pop("names")
            save_file({k: v.clone().contiguous() for k, v in result.items()}, os.path.join(out_dir, f"{layout}-rank{rank}.safetensors"))
        dist.barrier()  # leave together (gloo's teardown)
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs for NCCL tensor parallelism")
def test_nccl_tensor_parallel_matches_transformers(checkpoints, tmp_path):
    world = 4 if torch.cuda.device_count() >= 4 else 2
    path, input_ids, aux, normed, greedy = checkpoints["k25_yarn"]
    spawn_ranks(_nccl_worker, (str(path), input_ids, str(tmp_path)), world)
    for layout in ("ep", "tp"):
        for rank in range(world):
            tensors = load_file(os.path.join(tmp_path, f"{layout}-rank{rank}.safetensors"))
            assert_matches_reference(tensors, aux, normed, greedy, f"nccl {layout} rank {rank}/{world}", tol=CUDA_TOL)
