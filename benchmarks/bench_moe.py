"""Benchmark: one Kimi-K2.5 MoE layer (384 experts, 8 active, H 7168, I 2048, + shared expert), one GPU
(BENCHMARKS.md, "INT4 MoE layer"). All rows in one process on the SAME weights: random INT4
experts, dequantized to bf16 for the bf16 rows.

    grouped_mm_bf16           the reference: sort by expert + torch._grouped_mm, bf16 weights
    int4_v3                   our Triton W4A16 kernels (kernels/int4_moe.py) routed by transformers'
                              router, as the reference is, shared expert added in a separate pass
                              (a benchmark variant: the product runs int4_v3_native_layer)
    int4_v3_native_layer      the extraction model's own MoE layer on the same weights (what the
                              product runs): its router (a bf16 GEMM with fp32 output), the same
                              kernels, the shared expert added in the combine
                              (router_only / native_router_only: the two routers alone)
    *_experts_only            routed experts alone, routing precomputed

FLOPs: 2 T (k + 1) 3 H I + 2 T H E; MFU against the run's bf16 8192^3 matmul rate; "x_grouped" =
grouped_mm_bf16's ms / this row's ms; each output against grouped_mm_bf16 (relative L2). The
table is printed at the end, the full record (config search times, failed configs) goes to --json.

    python3 benchmarks/bench_moe.py --tokens 4096 16384 --json $OUT/bench_moe.json
    python3 benchmarks/bench_moe.py --cpu-check     # toy shapes, CPU, Triton under TRITON_INTERPRET=1
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import sys

if "--cpu-check" in sys.argv:  # must precede the first triton import
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench_common import device_name, matmul_tflops, median_ms, write_json  # noqa: E402
from kimi_shaped import KIMI_MOE, kimi_args  # noqa: E402  (imports eagleforge from a bare checkout)

from eagleforge.kernels import int4_moe  # noqa: E402

log = logging.getLogger("bench_moe")


def random_int4_experts(H, I, E, gen: torch.Generator) -> dict:
    """INT4 experts in the checkpoint layout, drawn from gen (on its device): gate/up/down packed
    int32 [E, out, in/8] (all 32 bits random) and bf16 scales per 32 columns giving weights of
    std ~0.02 (nibbles have std ~4.6)."""
    packs = {}
    for proj, (rows, cols) in {"gate": (I, H), "up": (I, H), "down": (H, I)}.items():
        packs[f"{proj}_packed"] = torch.randint(-2**31, 2**31 - 1, (E, rows, cols // 8), generator=gen, device=gen.device,
                                                dtype=torch.int64).to(torch.int32)
        packs[f"{proj}_scale"] = (torch.rand(E, rows, cols // 32, generator=gen, device=gen.device) * 0.2 + 0.9).mul(0.02 / 4.6).to(torch.bfloat16)
    return packs


def dequantized_slices(packs: dict, E: int, width: int = 32):
    """The experts in bf16, `width` at a time (no second full-size copy): (slice, gate [e, I, H],
    up [e, I, H], down [e, H, I])."""
    for e in range(0, E, width):
        sl = slice(e, e + width)
        yield sl, *(int4_moe._dequantize(packs[f"{proj}_packed"][sl], packs[f"{proj}_scale"][sl], torch.bfloat16)
                    for proj in ("gate", "up", "down"))


def build(H, I, E, K, device, seed=0):
    """(HF DeepseekV3MoE in bf16, INT4 expert tensors) holding the same numbers."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    cfg = DeepseekV3Config(hidden_size=H, moe_intermediate_size=I, n_routed_experts=E, num_experts_per_tok=K,
                           n_shared_experts=1, n_group=1, topk_group=1, routed_scaling_factor=2.827, norm_topk_prob=True)
    gen = torch.Generator(device=device).manual_seed(seed)
    packs = random_int4_experts(H, I, E, gen)
    with torch.device(device):
        moe = DeepseekV3MoE(cfg).to(torch.bfloat16).eval().requires_grad_(False)
    with torch.no_grad():
        for name, p in moe.named_parameters():
            if "experts." in name and "shared" not in name:
                continue
            p.normal_(0, 0.02, generator=gen) if p.dtype != torch.float32 or p.dim() > 1 else p.normal_(0, 1e-3, generator=gen)
        for sl, g, u, d in dequantized_slices(packs, E):  # the bf16 copy is the only full-size buffer
            moe.experts.gate_up_proj[sl] = torch.cat([g, u], 1)
            moe.experts.down_proj[sl] = d
    return moe, packs


def native_moe(moe, packs, H, I, E, K, device):
    """The extraction model's own MoE layer (extract/native/model.py, tp 1) on the same weights:
    its router (one bf16 GEMM with fp32 output; transformers' computes the logits in fp32), the
    Triton INT4 experts, and the shared expert added in the experts' combine pass."""
    from eagleforge.extract.native.model import MoE
    from eagleforge.extract.native.parallel import TensorParallel

    args = kimi_args(2, hidden_size=H, moe_intermediate_size=I, n_routed_experts=E, num_experts_per_tok=K)
    with torch.device(device):
        layer = MoE(args, TensorParallel(), "ep", torch.bfloat16, quantized=True).eval().requires_grad_(False)
    with torch.no_grad():
        layer.gate.weight.copy_(moe.gate.weight)
        layer.gate.e_score_correction_bias.copy_(moe.gate.e_score_correction_bias.float())
        for proj in ("gate_proj", "up_proj", "down_proj"):
            getattr(layer.shared_experts, proj).weight.copy_(getattr(moe.shared_experts, proj).weight)
            for part in ("packed", "scale"):
                getattr(layer.experts, f"{proj}_{part}").copy_(packs[f"{proj.split('_')[0]}_{part}"])
    return layer


def print_table(res: dict, tokens: list) -> None:
    print(f"{'T':>6} {'variant':<34} {'ms':>9} {'TFLOP/s':>8} {'MFU':>6} {'x_grouped':>9} {'rel_err':>8}")
    for T in tokens:
        for name, r in res[f"T={T}"].items():
            if not isinstance(r, dict) or "ms" not in r:
                continue
            err = r.get("rel_err_vs_grouped_bf16")
            print(f"{T:>6} {name:<34} {r['ms']:>9.3f} {r['TFLOPs']:>8.1f} {r['MFU']:>6.1%} {r.get('x_grouped', float('nan')):>9.2f} "
                  f"{'' if err is None else f'{err:.1e}':>8}")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--cpu-check", action="store_true")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if a.cpu_check:
        device, (H, I, E, K), tokens = torch.device("cpu"), (256, 128, 16, 4), [37, 101]
    else:
        device, (H, I, E, K), tokens = torch.device("cuda"), KIMI_MOE, a.tokens
    res = {"device": device_name(device), "torch": torch.__version__,
           "triton": getattr(int4_moe.triton, "__version__", None), "shape": dict(H=H, I=I, E=E, K=K)}
    res["matmul_TFLOPs"] = round(matmul_tflops(device), 1)
    log.info("matmul %.1f TFLOP/s", res["matmul_TFLOPs"])
    moe, packs = build(H, I, E, K, device)
    pk = [packs[n] for n in ("gate_packed", "gate_scale", "up_packed", "up_scale", "down_packed", "down_scale")]
    xs = {T: torch.randn(T, H, device=device, dtype=torch.bfloat16) for T in tokens}
    rows = {T: {} for T in tokens}

    def flops(T):
        return 2 * T * (K + 1) * 3 * H * I + 2 * T * H * E

    def record(T, name, ms, out=None, ref=None, expert_flops=False, peer=None):
        f = 2 * T * K * 3 * H * I if expert_flops else flops(T)
        r = {"ms": round(ms, 3), "TFLOPs": round(f / ms / 1e9, 1), "MFU": round(f / ms / 1e9 / res["matmul_TFLOPs"], 3)}
        peer = peer or ("grouped_mm_bf16_experts_only" if expert_flops else "grouped_mm_bf16")
        if peer in rows[T]:
            r["x_grouped"] = round(rows[T][peer]["ms"] / ms, 3)
        if out is not None and ref is not None:
            r["rel_err_vs_grouped_bf16"] = float((out.float() - ref.float()).norm() / ref.float().norm())
        rows[T][name] = r
        log.info("T=%d %-32s %s", T, name, r)

    def guarded(T, name, fn):
        """Run one row; a kernel that fails to build on this GPU becomes an error entry, not a dead run."""
        try:
            fn()
        except (RuntimeError, ValueError, torch.OutOfMemoryError) as err:
            rows[T][name] = {"error": f"{type(err).__name__}: {str(err)[:400]}"}
            log.error("T=%d %s failed: %s", T, name, err)

    with torch.no_grad():
        # the grouped_mm reference; the HF expert weights are replaced by its layout
        gu_t = moe.experts.gate_up_proj.data.transpose(1, 2).contiguous()  # [E, H, 2I]
        moe.experts.gate_up_proj.data = torch.empty(0, device=device)
        dn_t = moe.experts.down_proj.data.transpose(1, 2).contiguous()  # [E, I, H]
        moe.experts.down_proj.data = torch.empty(0, device=device)
        gc.collect()

        def route(x):
            _, w, idx = moe.gate(x)
            return w, idx

        for T in tokens:
            x = xs[T]
            w, idx = route(x)
            ref = int4_moe.bf16_grouped_mm_moe(x, w, idx, gu_t, dn_t) + moe.shared_experts(x)
            record(T, "grouped_mm_bf16", median_ms(lambda: int4_moe.bf16_grouped_mm_moe(x, *route(x), gu_t, dn_t) + moe.shared_experts(x), device))
            record(T, "grouped_mm_bf16_experts_only", median_ms(lambda: int4_moe.bf16_grouped_mm_moe(x, w, idx, gu_t, dn_t), device), expert_flops=True)

            def layer():
                out = (int4_moe.int4_moe(x, w, idx, *pk) + moe.shared_experts(x)).to(x.dtype)  # searches configs once
                record(T, "int4_v3", median_ms(lambda: (int4_moe.int4_moe(x, *route(x), *pk) + moe.shared_experts(x)).to(x.dtype), device), out, ref)
                record(T, "int4_v3_experts_only", median_ms(lambda: int4_moe.int4_moe(x, w, idx, *pk), device), expert_flops=True)
            guarded(T, "int4_v3", layer)
            if "int4_v3" in rows[T]:  # the layer as the extraction model runs it
                layer = native_moe(moe, packs, H, I, E, K, device)
                record(T, "int4_v3_native_layer", median_ms(lambda: layer(x), device), layer(x), ref)
                record(T, "native_router_only", median_ms(lambda: layer.gate(x), device), peer="-")
                ids_native = layer.gate(x)[1].sort(1).values
                # tokens whose 8 experts differ between the routers (fp32 logits' summation order at near-ties)
                rows[T]["native_vs_hf_routing_mismatch"] = float((ids_native != idx.sort(1).values).any(1).float().mean())
                del layer
            record(T, "router_only", median_ms(lambda: route(x), device), peer="-")
            record(T, "shared_expert_only", median_ms(lambda: moe.shared_experts(x), device), peer="-")
    res.update({f"T={T}": rows[T] for T in tokens})
    res["kernel_configs"] = {str(k): v for k, v in int4_moe._CHOSEN.items()}
    res["config_search_ms"] = {str(k): v for k, v in int4_moe._TIMES.items()}
    res["failed_configs"] = {str(k): v for k, v in int4_moe._FAILED.items()}
    if a.cpu_check:
        for T in tokens:
            err = rows[T]["int4_v3"]["rel_err_vs_grouped_bf16"]
            assert err < 2e-2, f"T={T}: int4_v3 differs from grouped_mm_bf16 by {err}"
            err = rows[T]["int4_v3_native_layer"]["rel_err_vs_grouped_bf16"]
            assert err < 2e-2 and rows[T]["native_vs_hf_routing_mismatch"] == 0, (err, rows[T]["native_vs_hf_routing_mismatch"])
        log.info("cpu-check passed")
    write_json(a.json, res)
    print_table(res, tokens)
    return res


if __name__ == "__main__":
    main()
