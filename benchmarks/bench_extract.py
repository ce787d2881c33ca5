"""Benchmark: native extraction throughput on a Kimi-K2.5-shaped model (issue 6, `make bench-extract`).

The model is built in memory (extract/native/bench_model.py): real K2.5 dimensions, random
weights, INT4 experts, default 1 dense + 3 MoE layers. Per prompt length T (one sequence of T
tokens per forward):

- forward only, and forward + capture (3 aux layers + final norm) + full-vocabulary argmax +
  overlapped write (pinned copies on a side stream, a writer thread writing safetensors files
  with fsync, then deleting them): tokens/s per GPU, and how long the GPU loop waited on the disk;
- each component timed alone on the same input: attention (MLA), router, routed experts, shared
  expert, dense MLP, all-reduce of [T, H] (tp > 1), head argmax; and whole layers;
- MFU: model FLOPs / time / the bf16 matmul rate measured in the same run;
- projection to the full 61-layer model on 8 GPUs from the measured per-layer times (an
  ESTIMATE: it assumes the work of a layer splits evenly over 8 GPUs at the efficiency given by
  --scaling-efficiency, by default the measured 1 -> 2 GPU efficiency when known);
- fp8 storage error of the captured states (these are random-weight states: see test_writer for
  real SmolLM2 states).

    python3 benchmarks/bench_extract.py --json $OUT/bench_extract.json                # tp 1
    torchrun --nproc-per-node 2 benchmarks/bench_extract.py --json $OUT/tp2.json      # tp 2
    python3 benchmarks/bench_extract.py --cpu-check                                     # toy shapes
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench_common import import_eagleforge, matmul_tflops, median_ms  # noqa: E402

import_eagleforge()
from eagleforge.extract.capture import HiddenStateCapture  # noqa: E402
from eagleforge.extract.native import model as native_model  # noqa: E402
from eagleforge.extract.native.bench_model import build_bench_model, kimi_args, tiny_args  # noqa: E402
from eagleforge.extract.native.parallel import init_parallel, shutdown  # noqa: E402
from eagleforge.extract.writer import OverlappedWriter, fp8_error  # noqa: E402

log = logging.getLogger("bench_extract")


def layer_flops(args, T: int, tp: int, moe: bool) -> float:
    """Matmul FLOPs of one decoder layer for one sequence of T tokens, this rank's share."""
    H, n = args.hidden_size, args.num_attention_heads
    proj = H * args.q_lora_rank + H * (args.kv_lora_rank + args.qk_rope_head_dim)  # replicated
    proj += (args.q_lora_rank * n * args.qk_head_dim + args.kv_lora_rank * n * (args.qk_nope_head_dim + args.v_head_dim)
             + n * args.v_head_dim * H) / tp
    attn_core = n / tp * (T / 2) * (args.qk_head_dim + args.v_head_dim)  # causal: T/2 keys per query on average
    if moe:
        mlp = 3 * H * args.moe_intermediate_size * (args.num_experts_per_tok + args.n_shared_experts) / tp + H * args.n_routed_experts
    else:
        mlp = 3 * H * args.intermediate_size / tp
    return 2 * T * (proj + attn_core + mlp)


def cuda_ms(fn, device, reps: int) -> float:
    """Median wall ms of fn() with a device sync at the end of each call (the whole loop's cost)."""
    times = []
    for i in range(reps + 1):
        torch.cuda.synchronize() if device.type == "cuda" else None
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize() if device.type == "cuda" else None
        if i:  # the first call warms up
            times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def file_sink(directory: str):
    """Write each item as a safetensors file, fsync it, then delete it (disk cost without filling it)."""
    from safetensors.torch import save_file

    def sink(meta, tensors):
        path = os.path.join(directory, f"bench-{meta}.safetensors")
        save_file({k: v.contiguous() for k, v in tensors.items()}, path)
        with open(path, "rb+") as f:
            os.fsync(f.fileno())
        os.unlink(path)

    return sink


def bench_length(model, args, state, T, reps, aux_layers, write_dir, matmul):
    device, tp = state.device, state.tp
    ids = torch.randint(0, args.vocab_size, (1, T), device=device)
    r = {}
    with torch.inference_mode():
        r["forward_ms"] = cuda_ms(lambda: model(ids), device, reps)
        n_items = [0]
        with HiddenStateCapture(model.model.layers, aux_layers, model.model.norm) as capture, \
                OverlappedWriter(file_sink(write_dir), max_pending=2) as writer:
            def forward_capture_write():
                capture.clear()
                model(ids)
                aux, last = capture.aux_hidden_states[0], capture.last_hidden_state[0]
                argmax = model.greedy_tokens(last)
                if state.is_group_leader:
                    writer.submit({"aux_hidden_states": aux, "last_hidden_state": last, "target_argmax": argmax}, n_items[0])
                n_items[0] += 1
                capture.clear()

            t0 = time.perf_counter()
            r["forward_capture_write_ms"] = cuda_ms(forward_capture_write, device, reps)
            stats = writer.close()
            loop_s = time.perf_counter() - t0
        r["writer"] = {"items": stats.items, "GB": round(stats.bytes / 1e9, 3), "submit_blocked_s": round(stats.submit_blocked_s, 3),
                       "sink_s": round(stats.sink_s, 3), "disk_GB_per_s": round(stats.bytes / max(stats.sink_s, 1e-9) / 1e9, 2),
                       "loop_s": round(loop_s, 3)}
        r["argmax_ms"] = median_ms(lambda: model.greedy_tokens(torch.randn(T, args.hidden_size, device=device, dtype=torch.bfloat16)), device)
        # components, each alone on the same kind of input
        x = torch.randn(1, T, args.hidden_size, device=device, dtype=torch.bfloat16)
        flat = x[0]
        positions = torch.arange(T, device=device, dtype=torch.float32)
        angles = positions[:, None] * model.model.inv_freq.float()[None, :]
        cos, sin = (angles.cos() * model.model.rope_scale).to(x.dtype), (angles.sin() * model.model.rope_scale).to(x.dtype)
        dense, moe_layer = model.model.layers[0], model.model.layers[args.first_k_dense_replace]
        moe = moe_layer.mlp
        w, e = moe.gate(flat)
        comp = {
            "attention": median_ms(lambda: moe_layer.self_attn(x, cos, sin), device),
            "router": median_ms(lambda: moe.gate(flat), device),
            "routed_experts": median_ms(lambda: native_model.routed_experts_forward(flat, w, e, moe.experts), device),
            "shared_expert": median_ms(lambda: moe.shared_experts(flat), device),
            "dense_mlp": median_ms(lambda: dense.mlp(x), device),
            "moe_layer": median_ms(lambda: moe_layer(x, cos, sin), device),
            "dense_layer": median_ms(lambda: dense(x, cos, sin), device),
        }
        if tp.size > 1:
            y = torch.randn(T, args.hidden_size, device=device, dtype=torch.bfloat16)
            comp["all_reduce"] = median_ms(lambda: tp.all_reduce(y), device)
        r["components_ms"] = {k: round(v, 3) for k, v in comp.items()}
        aux = None
        with HiddenStateCapture(model.model.layers, aux_layers, model.model.norm) as capture:
            model(ids)
            aux = capture.aux_hidden_states[0]
        r["fp8_vs_bf16"] = fp8_error(aux, block=args.hidden_size)
    n_moe = args.num_hidden_layers - args.first_k_dense_replace
    flops = layer_flops(args, T, tp.size, False) * args.first_k_dense_replace + layer_flops(args, T, tp.size, True) * n_moe
    flops += 2 * T * args.hidden_size * args.vocab_size / tp.size  # head (argmax)
    r["tokens_per_s_forward"] = round(T / r["forward_ms"] * 1e3, 1)
    r["tokens_per_s_with_capture_write"] = round(T / r["forward_capture_write_ms"] * 1e3, 1)
    r["MFU_forward_plus_head"] = round(flops / ((r["forward_ms"] + r["argmax_ms"]) / 1e3) / 1e12 / matmul, 3)
    r["MFU_moe_layer"] = round(layer_flops(args, T, tp.size, True) / (comp["moe_layer"] / 1e3) / 1e12 / matmul, 3)
    r["capture_write_overhead_ms"] = round(r["forward_capture_write_ms"] - r["forward_ms"], 3)
    return r


def project_full_model(r: dict, T: int, gpus: int, efficiency: float, layers: int = 61, dense: int = 1) -> dict:
    """Tokens/s of the full model on `gpus` GPUs from one GPU's per-layer times (an estimate)."""
    c = r["components_ms"]
    one_gpu_ms = dense * c["dense_layer"] + (layers - dense) * c["moe_layer"] + r["argmax_ms"]
    full_ms = one_gpu_ms / gpus / efficiency
    return {"one_gpu_equivalent_ms": round(one_gpu_ms, 1), "projected_ms_per_forward": round(full_ms, 1),
            "projected_tokens_per_s": round(T / full_ms * 1e3, 0), "gpus": gpus, "efficiency_assumed": efficiency,
            "capture_write_overhead_share": round(r["capture_write_overhead_ms"] / full_ms, 4)}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[8192, 16384, 32768])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--scaling-efficiency", type=float, default=None, help="for the 8-GPU projection (default: 1.0 at tp 1)")
    p.add_argument("--write-dir", default=None)
    p.add_argument("--cpu-check", action="store_true")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    state = init_parallel(world, "cpu" if a.cpu_check else "cuda")
    try:
        if a.cpu_check:
            args, tokens = tiny_args(a.layers), [33, 70]
        else:
            args, tokens = kimi_args(a.layers), a.tokens
        aux_layers = sorted({1, max(1, args.num_hidden_layers // 2), args.num_hidden_layers - 1})
        t0 = time.perf_counter()
        model = build_bench_model(args, state.device, tp=state.tp)
        res = {"device": torch.cuda.get_device_name() if state.device.type == "cuda" else "cpu", "tp": state.tp.size,
               "layers": args.num_hidden_layers, "aux_layers": aux_layers, "build_s": round(time.perf_counter() - t0, 1),
               "matmul_TFLOPs": round(matmul_tflops(state.device), 1),
               "moe_backend": native_model.MOE_BACKEND}
        if state.device.type == "cuda":
            res["memory_GiB_after_build"] = round(torch.cuda.memory_allocated() / 2**30, 1)
        log.info("%s", res)
        write_dir = a.write_dir or tempfile.mkdtemp(prefix="bench_extract_")
        eff = a.scaling_efficiency or 1.0
        for T in tokens:
            try:
                r = bench_length(model, args, state, T, a.reps, aux_layers, write_dir, res["matmul_TFLOPs"])
                r["projection_61_layers_8_gpus"] = project_full_model(r, T, 8, eff)
            except torch.OutOfMemoryError as err:
                r = {"error": repr(err)[:300]}
                torch.cuda.empty_cache()
            res[f"T={T}"] = r
            if state.is_main:
                log.info("T=%d %s", T, json.dumps(r))
        if a.cpu_check:
            for T in tokens:
                assert "error" not in res[f"T={T}"], res[f"T={T}"]
                assert res[f"T={T}"]["writer"]["items"] == a.reps + 1, res[f"T={T}"]["writer"]
            log.info("cpu-check passed")
        if state.is_main:
            if a.json:
                with open(a.json, "w") as f:
                    json.dump(res, f, indent=1)
            print(json.dumps(res))
        return res
    finally:
        shutdown(state)


if __name__ == "__main__":
    main()
