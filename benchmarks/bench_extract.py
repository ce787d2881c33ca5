"""Benchmark: native extraction throughput on a Kimi-K2.5-shaped model (`make bench-extract`),
BENCHMARKS.md "Native extraction": benchmarks/kimi_shaped.py's model (real K2.5 dimensions,
random weights, INT4 experts, 1 dense + 3 MoE layers by default), one sequence of T tokens per
forward. Per T:

- forward only, and forward + capture (3 aux layers + final norm) + full-vocabulary argmax + the
  overlapped writer's pinned copies on a side stream into a sink that drops them: tokens/s per GPU;
- the captured states finite and, at tp > 1, equal on every rank (all ranks feed the same ids,
  drawn on the CPU: ids from each rank's own CUDA generator once gave a NaN at tp 2);
- each component timed alone (attention, router, routed and shared experts, dense MLP, the
  all-reduce of [T, H] at tp > 1, head argmax) and whole layers; MFU against the run's matmul rate;
- the full 61-layer model on 8 GPUs projected from the per-layer times (an ESTIMATE: 100%
  efficiency); with --baseline-json (a tp 1 run), this tp's scaling against it.

    python3 benchmarks/bench_extract.py --json $OUT/bench_extract.json                # tp 1
    torchrun --nproc-per-node 2 benchmarks/bench_extract.py --json $OUT/tp2.json      # tp 2
    python3 benchmarks/bench_extract.py --cpu-check                                     # toy shapes
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench_common import device_name, matmul_tflops, null_sink, sync, write_json  # noqa: E402
from _bench_common import median_ms as _median_ms  # noqa: E402
from kimi_shaped import KIMI_K25_TEXT, bench_layout, build_bench_model, kimi_args, tiny_args  # noqa: E402  (imports eagleforge from a bare checkout)

from eagleforge.extract.native import model as native_model  # noqa: E402
from eagleforge.extract.writer import OverlappedWriter  # noqa: E402
from eagleforge.target.capture import HiddenStateCapture  # noqa: E402

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


def pipelined_ms(step, device, warmup: int, reps: int) -> float:
    """Mean ms per step of `reps` steps run back to back with ONE device sync at the end.

    This is how extraction runs: forwards follow each other without a host sync, so the
    writer's device-to-host copies (side stream) overlap the next forward; the warm-up fills
    the writer's pinned-buffer pool, so no cudaHostAlloc falls inside the timing."""
    for _ in range(warmup):  # also fills the writer's pinned pool
        step()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        step()
    sync(device)
    return (time.perf_counter() - t0) * 1e3 / reps


def capture_modes(model, args, layout, ids, reps: int, aux_layers: list[int]) -> dict:
    """ms per forward of: forward, + head argmax, + capture, + the overlapped writer's copies (null sink)."""
    from eagleforge.extract.writer import BatchRows

    device = layout.device
    T = ids.shape[1]
    row = {"id": 0, "input_ids": ids[0].tolist(), "loss_mask": [1] * T}
    r, counter = {}, [0]
    warm = 4  # > the writer's max_pending + 1: the pinned pool is full before the timed steps
    r["forward_ms"] = pipelined_ms(lambda: model(ids), device, 1, reps)
    r["forward_head_ms"] = pipelined_ms(lambda: model.greedy_tokens(model(ids)[0]), device, 1, reps)
    with HiddenStateCapture(model.model.layers, aux_layers, model.model.norm) as capture:
        def captured():
            capture.clear()
            last = model(ids)[0]
            out = {"aux_hidden_states": capture.aux_hidden_states[0], "last_hidden_state": last,
                   "target_argmax": model.greedy_tokens(last)}
            capture.clear()
            return out

        r["forward_head_capture_ms"] = pipelined_ms(captured, device, 1, reps)
        # every rank runs every mode (the forwards hold collectives); only the group leader copies
        writer = OverlappedWriter(null_sink, max_pending=2) if layout.is_group_leader else None

        def step():
            out = captured()
            if writer is not None:
                counter[0] += 1  # a new chunk (shard) per forward
                writer.submit(out, BatchRows(chunk=counter[0], rows=[{**row, "id": counter[0]}], positions=[0]))

        r["forward_head_capture_copy_ms"] = pipelined_ms(step, device, warm, reps)
        if writer is not None:
            stats = writer.close()
            r["writer_copy"] = {"items": stats.items, "GB": round(stats.bytes / 1e9, 3),
                                "submit_blocked_s": round(stats.submit_blocked_s, 3)}
        # the captured states: finite, and under tensor parallelism the same on every rank
        out = captured()
        states = torch.cat([out["aux_hidden_states"], out["last_hidden_state"]], -1).float()
        r["capture_finite"] = bool(torch.isfinite(states).all())
        r["capture_max_diff_between_ranks"] = max(float((g - states).abs().max()) for g in model.tp.all_gather(states))
    head = r["forward_head_ms"]
    r["copy_overhead_vs_forward_head"] = round(r["forward_head_capture_copy_ms"] / head - 1, 4)
    r["capture_overhead_vs_forward_head"] = round(r["forward_head_capture_ms"] / head - 1, 4)
    r["bytes_per_token"] = (len(aux_layers) + 1) * args.hidden_size * 2 + 4
    return r


def components(model, args, layout, T: int) -> dict:
    """Each part alone on the same kind of input (medians of 20 calls between CUDA events, the
    same count at every tp so the tp 1 and tp 2 columns compare), ms; at tp > 1 the layers
    include their all-reduces, and every rank times the same number of calls (see median_ms)."""
    device, tp = layout.device, model.tp
    median_ms = functools.partial(_median_ms, fixed_iters=20)

    x = torch.randn(1, T, args.hidden_size, device=device, dtype=torch.bfloat16)
    cos, sin = model.model.rope(T, x.dtype)
    flat = x[0]
    dense, moe_layer = model.model.layers[0], model.model.layers[args.first_k_dense_replace]
    moe = moe_layer.mlp
    route = functools.partial(moe.tp.split_rows, moe.gate)  # as MoE.forward routes: 1/tp of the tokens per rank
    w, e = route(flat)
    comp = {
        "attention": median_ms(lambda: moe_layer.self_attn(x, cos, sin), device),
        "router": median_ms(lambda: route(flat), device),
        "routed_experts": median_ms(lambda: native_model.routed_experts_forward(flat, w, e, moe.experts), device),
        "shared_expert": median_ms(lambda: moe.shared_experts(flat), device),
        "dense_mlp": median_ms(lambda: dense.mlp(x), device),
        "moe_layer": median_ms(lambda: moe_layer(x, cos, sin), device),
        "dense_layer": median_ms(lambda: dense(x, cos, sin), device),
        "argmax_head": median_ms(lambda: model.greedy_tokens(flat), device),
    }
    if tp.size > 1:
        y = torch.randn(T, args.hidden_size, device=device, dtype=torch.bfloat16)
        comp["all_reduce"] = median_ms(lambda: tp.all_reduce(y), device)
        comp["all_reduces_per_moe_layer"] = 2 * comp["all_reduce"]  # after attention and after the MoE block
    return {k: round(v, 3) for k, v in comp.items()}


def bench_length(model, args, layout, T, reps, aux_layers, matmul):
    device, tp = layout.device, model.tp
    # the same ids on every rank (a tp group sees one batch): drawn on the CPU from a fixed seed,
    # not from each rank's own CUDA generator
    ids = torch.randint(0, args.vocab_size, (1, T), generator=torch.Generator().manual_seed(T)).to(device)
    with torch.inference_mode():
        r = capture_modes(model, args, layout, ids, reps, aux_layers)
        comp = components(model, args, layout, T)
        r["components_ms"] = comp
    n_moe = args.num_hidden_layers - args.first_k_dense_replace
    flops = layer_flops(args, T, tp.size, False) * args.first_k_dense_replace + layer_flops(args, T, tp.size, True) * n_moe
    flops += 2 * T * args.hidden_size * args.vocab_size / tp.size  # head (argmax)
    r["tokens_per_s_per_gpu_forward"] = round(T / r["forward_ms"] * 1e3 / tp.size, 1)
    r["tokens_per_s_per_gpu_forward_head"] = round(T / r["forward_head_ms"] * 1e3 / tp.size, 1)
    r["tokens_per_s_per_gpu_with_capture_copy"] = round(T / r["forward_head_capture_copy_ms"] * 1e3 / tp.size, 1)
    r["MFU_forward_plus_head"] = round(flops / (r["forward_head_ms"] / 1e3) / 1e12 / matmul, 3)
    r["MFU_moe_layer"] = round(layer_flops(args, T, tp.size, True) / (comp["moe_layer"] / 1e3) / 1e12 / matmul, 3)
    return r


def project_full_model(r: dict, T: int, gpus: int, tp: int) -> dict:
    """Tokens/s of Kimi-K2.5's full depth on `gpus` GPUs from this run's per-layer times (an
    ESTIMATE): its dense and MoE layers and the head at the measured times of this run's tp (at
    tp > 1 including the all-reduces), the GPU time spread evenly over `gpus` (100% efficiency).
    The capture + copy cost per forward is the measured one (the same bytes per token whatever
    the depth), as a share of the projected time."""
    c, dense = r["components_ms"], KIMI_K25_TEXT["first_k_dense_replace"]
    this_tp_ms = dense * c["dense_layer"] + (KIMI_K25_TEXT["num_hidden_layers"] - dense) * c["moe_layer"] + c["argmax_head"]
    ms = this_tp_ms * tp / gpus
    return {"time_this_tp_ms": round(this_tp_ms, 1), "gpus": gpus, "tp_measured": tp, "ms_per_forward": round(ms, 1),
            "tokens_per_s": round(T / ms * 1e3),
            "capture_copy_share_of_projected": round((r["forward_head_capture_copy_ms"] - r["forward_head_ms"]) / ms, 4)}


# Switches the interleaved A/B (--ab-off) may turn off: the TensorParallel thresholds every layer
# reads at each call (extract/native/parallel.py SPLIT_ROWS_MIN_TOKENS, OVERLAP_MIN_ROWS by default).
AB_SWITCHES = {"split_rows": "split_rows_min_tokens", "overlap_halves": "overlap_min_rows"}


def ab_forward(model, layout, T: int, switch: str, rounds: int, reps: int) -> dict:
    """Forward-only ms with `switch` on (its default) and off, INTERLEAVED: `rounds` rounds of
    (on, off), each `reps` pipelined forwards, so the machine's drift over the run (about 3% between
    runs of the tp 2 forward on an H200 pair) falls on both alike. Off = its threshold set past any batch."""
    module, name = model.tp, AB_SWITCHES[switch]
    default = getattr(module, name)
    ids = torch.randint(0, model.args.vocab_size, (1, T), generator=torch.Generator().manual_seed(T)).to(layout.device)
    times = {"on": [], "off": []}
    try:
        with torch.inference_mode():
            for _ in range(rounds):
                for mode in ("on", "off"):
                    setattr(module, name, default if mode == "on" else 1 << 62)
                    times[mode].append(pipelined_ms(lambda: model(ids), layout.device, 1, reps))
    finally:
        setattr(module, name, default)
    med = {m: statistics.median(v) for m, v in times.items()}
    return {"switch": switch, "T": T, "rounds_ms": {m: [round(t, 2) for t in v] for m, v in times.items()},
            "median_on_ms": round(med["on"], 2), "median_off_ms": round(med["off"], 2),
            "on_vs_off": round(med["on"] / med["off"] - 1, 4),
            "rounds_on_faster": sum(a < b for a, b in zip(times["on"], times["off"]))}


def summary(res: dict, tokens: list) -> None:
    """One line per T: forward, head, capture, components, MFU and the 8-GPU projection."""
    print(f"tp {res['tp']}, {res['layers']} layers, matmul {res['matmul_TFLOPs']} TFLOP/s, {res['device']}")
    for T in tokens:
        r = res.get(f"T={T}", {})
        if "error" in r or not r:
            print(f"T={T}: {r.get('error', 'not run')}")
            continue
        c, pr = r["components_ms"], r["projection_61_layers_8_gpus"]
        line = (f"T={T:>6}: fwd {r['forward_ms']:.1f} ms, {r['tokens_per_s_per_gpu_forward']:.0f} tok/s/GPU, +head "
                f"{r['tokens_per_s_per_gpu_forward_head']:.0f}, MFU {r['MFU_forward_plus_head']:.1%}; capture "
                f"{r['capture_overhead_vs_forward_head']:+.1%}, +copy {r['copy_overhead_vs_forward_head']:+.1%} (states finite "
                f"{r['capture_finite']}, ranks' max diff {r['capture_max_diff_between_ranks']}); "
                f"attn {c['attention']} router {c['router']} "
                f"experts {c['routed_experts']} shared {c['shared_expert']} all-reduce {c.get('all_reduce', 0)} head {c['argmax_head']} ms")
        if "scaling_efficiency_1_to_2" in r:
            line += f"; scaling 1->2 {r['scaling_efficiency_1_to_2']:.1%}"
        line += f"; 8 GPUs, {KIMI_K25_TEXT['num_hidden_layers']} layers: {pr['tokens_per_s']:.0f} tok/s"
        print(line)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[8192, 16384, 32768])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--baseline-json", default=None, help="a tp 1 run's --json: scaling efficiency of this run against it")
    p.add_argument("--cpu-check", action="store_true", help="toy shapes on the CPU (gloo under torchrun)")
    p.add_argument("--ab-off", choices=sorted(AB_SWITCHES), default=None,
                   help="only an interleaved A/B of the forward with this switch on and off (see ab_forward)")
    p.add_argument("--ab-rounds", type=int, default=6)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO if int(os.environ.get("RANK", "0")) == 0 else logging.WARNING, format="%(message)s")
    layout, tp = bench_layout(a.cpu_check)
    try:
        if a.cpu_check:
            args, tokens = tiny_args(a.layers), [33, 70]
            torch.set_num_threads(1)
        else:
            args, tokens = kimi_args(a.layers), a.tokens
        aux_layers = sorted({1, max(1, args.num_hidden_layers // 2), args.num_hidden_layers - 1})
        t0 = time.perf_counter()
        model = build_bench_model(args, layout.device, tp=tp)
        res = {"device": device_name(layout.device), "tp": tp.size,
               "layers": args.num_hidden_layers, "aux_layers": aux_layers, "build_s": round(time.perf_counter() - t0, 1),
               "matmul_TFLOPs": round(matmul_tflops(layout.device), 1), "moe_backend": model.args.moe_backend,
               "torch": torch.__version__}
        if layout.device.type == "cuda":
            res["memory_GiB_after_build"] = round(torch.cuda.memory_allocated() / 2**30, 2)
        log.info("%s", res)
        if a.ab_off:
            res["ab"] = [ab_forward(model, layout, T, a.ab_off, a.ab_rounds, a.reps) for T in tokens]
            if layout.is_main:
                print(json.dumps(res["ab"]))
                write_json(a.json, res)
            return res
        baseline = None
        if a.baseline_json:
            with open(a.baseline_json) as f:
                baseline = json.load(f)
        for T in tokens:
            try:
                if layout.device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                r = bench_length(model, args, layout, T, a.reps, aux_layers, res["matmul_TFLOPs"])
                if layout.device.type == "cuda":
                    r["peak_GiB"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
                base = (baseline or {}).get(f"T={T}", {})
                if "forward_ms" in base:
                    # tokens/s per GPU at this tp over tokens/s of one GPU: t1 / (tp * t_tp)
                    r["scaling_efficiency_1_to_2"] = round(base["forward_ms"] / (tp.size * r["forward_ms"]), 4)
                    r["scaling_efficiency_forward_head"] = round(base["forward_head_ms"] / (tp.size * r["forward_head_ms"]), 4)
                r["projection_61_layers_8_gpus"] = project_full_model(r, T, 8, tp.size)
            except torch.OutOfMemoryError as err:
                r = {"error": repr(err)[:300]}
                torch.cuda.empty_cache()
            res[f"T={T}"] = r
            if layout.is_main:
                log.info("T=%d %s", T, json.dumps(r))
        if a.cpu_check:
            for T in tokens:
                r = res[f"T={T}"]
                assert "error" not in r and r["capture_finite"] and r["capture_max_diff_between_ranks"] == 0, r
                if layout.is_group_leader:
                    assert r["writer_copy"]["items"] == a.reps + 4, r["writer_copy"]
            log.info("cpu-check passed (tp %d)", tp.size)
        if layout.is_main:
            write_json(a.json, res)
            summary(res, tokens)
        return res
    finally:
        layout.shutdown()


if __name__ == "__main__":
    main()
