"""Benchmark: one Kimi-K2.5 MoE layer (384 experts, 8 active, H 7168, I 2048, + shared expert), one GPU.

Issue 6 point 2, with the anchor (../shared/anchors/anchor_moe.py) run side by side in the same
process, all on the SAME weights: random INT4 experts, dequantized to bf16 for the bf16 rows.

    hf_deepseekv3_bf16        transformers' DeepseekV3MoE as shipped (bf16 experts)
    grouped_mm_bf16           anchor (b): sort by expert + torch._grouped_mm, bf16 (speed of light)
    int4_triton               ours: router + Triton W4A16 grouped kernels + shared expert
    int4_dequant_grouped_mm   dequantize all experts to bf16 per call, then grouped_mm
    *_experts_only            routed experts alone, routing precomputed

FLOPs (anchor's count): 2 T (k + 1) 3 H I + 2 T H E. MFU against the bf16 8192^3 matmul rate of
the same run. Correctness: each output against grouped_mm_bf16 (relative L2).

    python3 benchmarks/bench_moe.py --tokens 4096 16384 --json $OUT/bench_moe.json
    python3 benchmarks/bench_moe.py --cpu-check     # toy shapes, CPU, Triton under TRITON_INTERPRET=1
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import sys

if "--cpu-check" in sys.argv:  # must precede the first triton import
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench_common import import_eagleforge, matmul_tflops, median_ms  # noqa: E402

import_eagleforge()
from eagleforge.kernels import int4_moe  # noqa: E402

log = logging.getLogger("bench_moe")


def build(H, I, E, K, device, seed=0):
    """(HF DeepseekV3MoE in bf16, INT4 expert tensors) holding the same numbers."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    cfg = DeepseekV3Config(hidden_size=H, moe_intermediate_size=I, n_routed_experts=E, num_experts_per_tok=K,
                           n_shared_experts=1, n_group=1, topk_group=1, routed_scaling_factor=2.827, norm_topk_prob=True)
    gen = torch.Generator(device=device).manual_seed(seed)
    packs = {}
    for proj, (rows, cols) in {"gate": (I, H), "up": (I, H), "down": (H, I)}.items():
        packs[f"{proj}_packed"] = torch.randint(-2**31, 2**31 - 1, (E, rows, cols // 8), generator=gen, device=device,
                                                dtype=torch.int64).to(torch.int32)
        packs[f"{proj}_scale"] = (torch.rand(E, rows, cols // 32, generator=gen, device=device) * 0.2 + 0.9).mul(0.02 / 4.6).to(torch.bfloat16)
    with torch.device(device):
        moe = DeepseekV3MoE(cfg).to(torch.bfloat16).eval().requires_grad_(False)
    with torch.no_grad():
        for name, p in moe.named_parameters():
            if "experts." in name and "shared" not in name:
                continue
            p.normal_(0, 0.02, generator=gen) if p.dtype != torch.float32 or p.dim() > 1 else p.normal_(0, 1e-3, generator=gen)
        for e in range(0, E, 32):  # dequantize in slices: the bf16 copy is the only full-size buffer
            sl = slice(e, e + 32)
            g = int4_moe._dequantize(packs["gate_packed"][sl], packs["gate_scale"][sl], torch.bfloat16)
            u = int4_moe._dequantize(packs["up_packed"][sl], packs["up_scale"][sl], torch.bfloat16)
            moe.experts.gate_up_proj[sl] = torch.cat([g, u], 1)
            moe.experts.down_proj[sl] = int4_moe._dequantize(packs["down_packed"][sl], packs["down_scale"][sl], torch.bfloat16)
    return moe, packs


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--cpu-check", action="store_true")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--skip-dequant", action="store_true")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if a.cpu_check:
        device, (H, I, E, K), tokens = torch.device("cpu"), (256, 64, 16, 4), [37, 101]
    else:
        device, (H, I, E, K), tokens = torch.device("cuda"), (7168, 2048, 384, 8), a.tokens
    res = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
           "shape": dict(H=H, I=I, E=E, K=K)}
    res["matmul_TFLOPs"] = round(matmul_tflops(device), 1)
    log.info("matmul %.1f TFLOP/s", res["matmul_TFLOPs"])
    moe, packs = build(H, I, E, K, device)
    pk = [packs[n] for n in ("gate_packed", "gate_scale", "up_packed", "up_scale", "down_packed", "down_scale")]
    xs = {T: torch.randn(T, H, device=device, dtype=torch.bfloat16) for T in tokens}
    rows = {T: {} for T in tokens}

    def flops(T):
        return 2 * T * (K + 1) * 3 * H * I + 2 * T * H * E

    def record(T, name, ms, out=None, ref=None, expert_flops=False):
        f = 2 * T * K * 3 * H * I if expert_flops else flops(T)
        r = {"ms": round(ms, 3), "TFLOPs": round(f / ms / 1e9, 1), "MFU": round(f / ms / 1e9 / res["matmul_TFLOPs"], 3)}
        if out is not None and ref is not None:
            r["rel_err_vs_grouped_bf16"] = float((out.float() - ref.float()).norm() / ref.float().norm())
        rows[T][name] = r
        log.info("T=%d %-32s %s", T, name, r)

    with torch.no_grad():
        if not a.skip_hf:  # (a) transformers as shipped
            for T in tokens:
                try:
                    record(T, "hf_deepseekv3_bf16", median_ms(lambda: moe(xs[T][None]), device, rep_ms=200))
                except torch.OutOfMemoryError as err:
                    rows[T]["hf_deepseekv3_bf16"] = {"error": repr(err)[:200]}
                torch.cuda.empty_cache() if device.type == "cuda" else None
        # (b) the anchor's grouped_mm reference; the HF expert weights are replaced by its layout
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
            out = (int4_moe.int4_moe(x, w, idx, *pk) + moe.shared_experts(x)).to(x.dtype)
            record(T, "int4_triton", median_ms(lambda: (int4_moe.int4_moe(x, *route(x), *pk) + moe.shared_experts(x)).to(x.dtype), device), out, ref)
            record(T, "grouped_mm_bf16_experts_only", median_ms(lambda: int4_moe.bf16_grouped_mm_moe(x, w, idx, gu_t, dn_t), device), expert_flops=True)
            record(T, "int4_triton_experts_only", median_ms(lambda: int4_moe.int4_moe(x, w, idx, *pk), device), expert_flops=True)
            record(T, "router_only", median_ms(lambda: route(x), device))
            record(T, "shared_expert_only", median_ms(lambda: moe.shared_experts(x), device))
        if not a.skip_dequant:
            del gu_t, dn_t
            gc.collect()
            torch.cuda.empty_cache() if device.type == "cuda" else None
            for T in tokens:
                x = xs[T]
                w, idx = route(x)
                ref_out = (int4_moe.int4_moe(x, w, idx, *pk) + moe.shared_experts(x)).to(x.dtype)
                out = int4_moe.int4_moe_grouped_mm(x, w, idx, *pk) + moe.shared_experts(x)
                rows[T]["int4_triton_vs_dequant_rel"] = float((out.float() - ref_out.float()).norm() / out.float().norm())
                record(T, "int4_dequant_grouped_mm", median_ms(lambda: int4_moe.int4_moe_grouped_mm(x, *route(x), *pk) + moe.shared_experts(x), device))
    res.update({f"T={T}": rows[T] for T in tokens})
    res["kernel_configs"] = {str(k): v for k, v in int4_moe._CHOSEN.items()}
    if a.cpu_check:
        for T in tokens:
            err = rows[T]["int4_triton"]["rel_err_vs_grouped_bf16"]
            assert err < 2e-2, f"T={T}: int4_triton differs from grouped_mm_bf16 by {err}"
        log.info("cpu-check passed")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    print(json.dumps(res))
    return res


if __name__ == "__main__":
    main()
