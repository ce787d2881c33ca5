"""Benchmark: pipeline stages of the native target on one GPU (`make bench-pipeline`),
BENCHMARKS.md "Pipeline stages": the Kimi-shaped model of benchmarks/kimi_shaped.py (real K2.5 dimensions,
random INT4 experts, 1 dense + 3 MoE layers by default) at tp 1, three parts:

1. The extraction loop at pp 1 against the plain forward it wraps: extract/driver.py
   `forward_batches` through the NativeTarget (what `python -m eagleforge.extract` runs) against
   the same batches through `forward_batch` (the forward, capture and packed rows alone), rounds
   interleaved; the loop's own overhead in percent.
2. Two stages in one process, run in turn (one GPU cannot host two NCCL ranks): stage 0 (the
   embedding and the first layers) and stage 1 (the rest, the norm and the head) share the full
   model's modules and pass their messages through a queue in place of send/recv; every batch's
   rows against pp 1's (bf16: the same kernels on the same inputs, so equal) and finite.
3. The pilot's projection (8 x RTX PRO 6000, PCIe) per tp x pp layout (preflight.project_stages)
   from this GPU's layer times scaled by the stated matmul rates, and stated link rates. COMPUTED.

    python3 benchmarks/bench_pipeline.py --json $OUT/pipeline.json
    python3 benchmarks/bench_pipeline.py --cpu-check            # toy shapes on the CPU (checks the script)
"""

from __future__ import annotations

import argparse
import collections
import logging
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench_common import device_name, matmul_tflops, median_ms, sync, write_json  # noqa: E402
from kimi_shaped import KIMI_K25_TEXT, DraftShape, build_bench_model, kimi_args, random_rows, tiny_args  # noqa: E402  (imports eagleforge from a bare checkout)

from eagleforge.extract.driver import forward_batches  # noqa: E402
from eagleforge.extract.native.model import DeepseekV3ForExtraction, LayerStack  # noqa: E402
from eagleforge.extract.native.plan import stage_layers, stage_work_per_token  # noqa: E402
from eagleforge.extract.native.preflight import Rates, format_layouts, project_stages  # noqa: E402
from eagleforge.extract.native.target import NativeTarget, forward_batch  # noqa: E402
from eagleforge.extract.samples import batch_by_tokens  # noqa: E402
from eagleforge.layout import Layout  # noqa: E402

log = logging.getLogger("bench_pipeline")

# The pilot's stated rates (docs/kimi-k25.md): RTX PRO 6000 Blackwell bf16 dense matmul, and the
# all-reduce bus bandwidth and one-way P2P rate that 8 of them measured in public reports.
PILOT_TFLOPS = 500.0
PILOT_LINKS = {"untuned (22 GB/s busbw, 25 GB/s P2P)": (22.0, 25.0), "tuned (40 GB/s busbw, 54 GB/s P2P)": (40.0, 54.0)}


class QueueLink:
    """StageLink's interface over an in-process queue: stage 0's sends are stage 1's receives."""

    def __init__(self, messages: collections.deque):
        self.messages = messages

    def send(self, tensor: torch.Tensor) -> None:
        self.messages.append(tensor.contiguous())

    def recv(self, shape, dtype, device) -> torch.Tensor:
        message = self.messages.popleft()
        assert tuple(message.shape) == tuple(shape) and message.dtype == dtype, (message.shape, shape)
        return message

    def post_recv(self, shape, dtype, device) -> None:
        pass

    def drain(self, keep: int = 0) -> None:
        pass


def stage_view(full: DeepseekV3ForExtraction, layers: range, first: bool, last: bool) -> DeepseekV3ForExtraction:
    """A stage model holding `full`'s own modules for `layers` (no copy of any weight)."""
    with torch.device("meta"):
        stage = DeepseekV3ForExtraction(full.args, full.tp, full.layout, torch.bfloat16, full.quantized, range(0), first, last)
    stage.model.layers = LayerStack({str(i): full.model.layers[i] for i in layers})
    stage.model.embed_tokens = full.model.embed_tokens if first else None
    stage.model.norm = full.model.norm if last else None
    stage.model.inv_freq = full.model.inv_freq
    stage.lm_head = full.lm_head if last else None
    return stage


def loop_overhead(model, aux: list[int], rows: list[dict], tokens: int, device: torch.device, rounds: int) -> dict:
    """Part 1: the driver's loop at pp 1 against forward_batch alone, interleaved rounds."""
    target = NativeTarget(model, Layout(device=device), aux, write_target_argmax=True)
    batches = [(0, positions) for positions in batch_by_tokens([len(r["input_ids"]) for r in rows], tokens)]
    try:
        def plain():
            for _, positions in batches:
                forward_batch(model, target.capture, [rows[j]["input_ids"] for j in positions], device, True)

        def driver():
            forward_batches(target, [rows], batches)

        times = {"forward_batch": [], "driver loop": []}
        for fn in (plain, driver):  # warm-up
            fn()
        for _ in range(rounds):
            for name, fn in (("forward_batch", plain), ("driver loop", driver)):
                sync(device)
                start = time.perf_counter()
                fn()
                sync(device)
                times[name].append(time.perf_counter() - start)
    finally:
        target.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    n = sum(len(r["input_ids"]) for r in rows)
    return {"tokens": n, "forward_batch_tokens_per_s": round(n / med["forward_batch"]),
            "driver_tokens_per_s": round(n / med["driver loop"]),
            "loop_overhead": round(med["driver loop"] / med["forward_batch"] - 1, 4), "rounds": rounds}


@torch.inference_mode()
def two_stages(model, aux: list[int], rows: list[dict], tokens: int, device: torch.device) -> dict:
    """Part 2: stage 0 then stage 1 in turn through a queue, against pp 1 on the same batches."""
    a = model.args
    cut = stage_layers(a, 2)
    layouts = [Layout(world_size=2, rank=s, pp=2, device=device) for s in (0, 1)]
    messages: collections.deque = collections.deque()
    stages = [NativeTarget(stage_view(model, cut[s], s == 0, s == 1), layouts[s], aux, True, link=QueueLink(messages))
              for s in (0, 1)]
    whole = NativeTarget(model, Layout(device=device), aux, write_target_argmax=True)
    worst = {"aux_hidden_states": 0.0, "last_hidden_state": 0.0}
    argmax_equal, finite, batches = True, True, 0
    try:
        for positions in batch_by_tokens([len(r["input_ids"]) for r in rows], tokens):
            ids = [rows[j]["input_ids"] for j in positions]
            assert stages[0].forward(ids) is None
            got, want = stages[1].forward(ids), whole.forward(ids)
            for key in worst:
                finite &= bool(torch.isfinite(got[key]).all())
                worst[key] = max(worst[key], float((got[key].float() - want[key].float()).abs().max()))
            argmax_equal &= bool(torch.equal(got["target_argmax"], want["target_argmax"]))
            batches += 1
    finally:
        for target in (*stages, whole):
            target.close()
    return {"stages": [f"{r.start}-{r.stop - 1}" for r in cut], "batches": batches, "finite": finite,
            "max_abs_diff": worst, "target_argmax_equal": argmax_equal, "messages_left": len(messages)}


@torch.inference_mode()
def layer_times(model, tokens: int, device: torch.device) -> dict:
    """ms of one dense layer, one MoE layer and the greedy head at `tokens` tokens (tp 1)."""
    a = model.args
    x = torch.randn(1, tokens, a.hidden_size, device=device, dtype=next(model.parameters()).dtype)
    cos, sin = model.model.rope(tokens, x.dtype)
    dense, moe = model.model.layers[0], model.model.layers[a.first_k_dense_replace]
    return {"dense_layer": median_ms(lambda: dense(x, cos, sin), device, fixed_iters=20),
            "moe_layer": median_ms(lambda: moe(x, cos, sin), device, fixed_iters=20),
            "argmax_head": median_ms(lambda: model.greedy_tokens(x[0]), device, fixed_iters=20)}


def pilot_projection(ms: dict, tokens: int, measured_tflops: float, seq: int) -> dict:
    """Part 3: the 61-layer Kimi-K2.5 per tp x pp layout of 8 GPUs, from the measured layer times
    scaled by measured / stated matmul rate (at tp > 1 a layer's time divided by tp: an even
    split, its all-reduces added from the stated bus bandwidth)."""
    a = kimi_args(KIMI_K25_TEXT["num_hidden_layers"])
    scale = measured_tflops / PILOT_TFLOPS
    layer_s = [(ms["dense_layer"] if i < a.first_k_dense_replace else ms["moe_layer"]) / 1e3 / tokens * scale
               for i in range(a.num_hidden_layers)]
    head_s = ms["argmax_head"] / 1e3 / tokens * scale
    aux = list(DraftShape.kimi().aux_layers)
    out = {}
    for name, (busbw, p2p) in PILOT_LINKS.items():
        rows = []
        for tp in (8, 4, 2, 1):
            pp = 8 // tp
            ranges = stage_layers(a, pp, tp, seq, tp > 1)
            work = []
            for s, r in enumerate(ranges):
                w = stage_work_per_token(a, tp, r, s == 0, s == pp - 1, 2, seq, tp > 1, True, aux)
                w["compute_s"] = (sum(layer_s[i] for i in r) + (head_s if s == pp - 1 else 0.0)) / tp
                work.append(w)
            rows.append({"tp": tp, "pp": pp, "fits": True, "keys": f"target.tp={tp} target.pp={pp}",
                         **project_stages(work, tp, 1, Rates(PILOT_TFLOPS, busbw, p2p))})
        rows.sort(key=lambda r: -r["per_group"])
        out[name] = rows
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--tokens", type=int, default=8192, help="tokens per forward (extract.batch_tokens)")
    p.add_argument("--seq", type=int, default=2048, help="tokens per sample")
    p.add_argument("--batches", type=int, default=6)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--cpu-check", action="store_true")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cpu = a.cpu_check or not torch.cuda.is_available()
    device = torch.device("cpu" if cpu else "cuda")
    if cpu:
        args, a.tokens, a.seq, a.batches, a.rounds = tiny_args(a.layers), 96, 32, 3, 2
    else:
        args = kimi_args(a.layers)
    aux = sorted({1, max(1, args.num_hidden_layers // 2), args.num_hidden_layers - 1})
    model = build_bench_model(args, device, dtype=torch.float32 if cpu else torch.bfloat16)
    rows = random_rows(args.vocab_size, a.tokens, a.seq, a.batches)
    tflops = matmul_tflops(device)
    res = {"device": device_name(device), "torch": torch.__version__,
           "layers": args.num_hidden_layers, "tokens_per_forward": a.tokens, "seq": a.seq, "matmul_TFLOPs": round(tflops, 1)}
    res["pp1_loop"] = loop_overhead(model, aux, rows, a.tokens, device, a.rounds)
    log.info("pp 1 loop: %s", res["pp1_loop"])
    res["two_stages"] = two_stages(model, aux, rows, a.tokens, device)
    log.info("two stages in turn: %s", res["two_stages"])
    res["layer_ms"] = {k: round(v, 3) for k, v in layer_times(model, a.tokens, device).items()}
    projections = pilot_projection(res["layer_ms"], a.tokens, tflops, a.seq)
    res["pilot_projection"] = {name: [{k: r[k] for k in ("tp", "pp", "per_group", "slowest_stage", "compute_share")}
                                      for r in rows_] for name, rows_ in projections.items()}
    print(f"\n{res['device']}, Kimi-shaped, {args.num_hidden_layers} layers, {a.tokens} tokens per forward")
    print(f"pp 1: driver loop {res['pp1_loop']['driver_tokens_per_s']:,} tok/s, forward_batch alone "
          f"{res['pp1_loop']['forward_batch_tokens_per_s']:,} tok/s: loop overhead {res['pp1_loop']['loop_overhead']:+.2%}")
    t = res["two_stages"]
    print(f"two stages ({', '.join(t['stages'])}) in turn, {t['batches']} forwards: finite {t['finite']}, max |diff| vs pp 1 "
          f"aux {t['max_abs_diff']['aux_hidden_states']:.3g}, last {t['max_abs_diff']['last_hidden_state']:.3g}, "
          f"argmax equal {t['target_argmax_equal']}")
    print(f"layer times at {a.tokens} tokens (ms): {res['layer_ms']}; pilot projection (COMPUTED: measured layer times x "
          f"{tflops:.0f} / {PILOT_TFLOPS:.0f} TFLOP/s, stated links; 61 layers, 8 GPUs a group):")
    for name, rows_ in projections.items():
        print(f" {name}:")
        print(format_layouts(rows_))
    write_json(a.json, res)
    return res


if __name__ == "__main__":
    main()
