"""Benchmark: the extraction's prefill attention (MLA heads of Kimi-K2.5) by kernel.

One rank's heads at tp 1 (64 heads, q/k head dim 192 = 128 nope + 64 rope, v head dim 128), one
causal sequence of T tokens, forward only, bf16, through extract.native.model.prefill_attention:

    flash, chunks of 8192    FlashAttention-2 through SDPA (target.prefill_attention=flash), v
                             padded to 192, query chunks of 8192 (bottom-right causal masks)
    flash, one call          the same kernel over the whole prompt at once
    cudnn, v padded          SDPA with cuDNN's fused attention alone, v padded to 192
    auto (cudnn, v unpadded) the default: cuDNN on q, k [.., 192] and v [.., 128] (no wasted
                             PV work)

Each row: median ms (do_bench), TFLOP/s of the causal core (2 x n x T^2/2 x (192 + 128), the
unpadded math), and the largest error against a float64 softmax at T = 1031 (odd).

    python3 benchmarks/bench_prefill_attention.py --json $OUT/prefill_attention.json
    python3 benchmarks/bench_prefill_attention.py --cpu-check        # toy shapes: checks the script
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench_common import device_name, median_ms, write_json  # noqa: E402
from kimi_shaped import KIMI_K25_TEXT  # noqa: E402  (imports eagleforge from a bare checkout)

from eagleforge.extract.native.model import _cudnn_refused, prefill_attention  # noqa: E402

log = logging.getLogger("bench_prefill_attention")


def cudnn_padded(q, k, v, scale):
    """cuDNN alone, v zero-padded to q's head dim and cut back. q, k [B, T, n, 192], v [B, T, n, 128]."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    d_v = v.shape[-1]
    v = F.pad(v, (0, q.shape[-1] - d_v))
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=scale,
                                              is_causal=True).transpose(1, 2)[..., :d_v]


VARIANTS = {
    "flash, chunks of 8192": lambda q, k, v, s: prefill_attention(q, k, v, s, chunk_tokens=8192, backend="flash"),
    "flash, one call": lambda q, k, v, s: prefill_attention(q, k, v, s, backend="flash"),
    "cudnn, v padded": cudnn_padded,
    "auto (cudnn, v unpadded)": lambda q, k, v, s: prefill_attention(q, k, v, s, backend="auto"),
}


def inputs(tokens: int, heads: int, d_qk: int, d_v: int, device, dtype, seed: int):
    """q, k [1, T, n, d_qk] and v [1, T, n, d_v], drawn in that order on the CPU."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    return [torch.randn(1, tokens, heads, d, generator=g).to(device, dtype) for d in (d_qk, d_qk, d_v)]


def reference(q, k, v, scale):
    """float64 causal softmax(q k^T) v, [B, T, n, d_v]."""
    q, k, v = q.double(), k.double(), v.double()
    scores = torch.einsum("btnd,bsnd->bnts", q, k) * scale
    t = q.shape[1]
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return torch.einsum("bnts,bsnd->btnd", scores.softmax(-1), v)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192, 16384, 32768])
    ap.add_argument("--heads", type=int, default=KIMI_K25_TEXT["num_attention_heads"])
    ap.add_argument("--check-tokens", type=int, default=1031)
    ap.add_argument("--json", default=None)
    ap.add_argument("--cpu-check", action="store_true")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    d_qk, d_v = KIMI_K25_TEXT["qk_nope_head_dim"] + KIMI_K25_TEXT["qk_rope_head_dim"], KIMI_K25_TEXT["v_head_dim"]
    scale = d_qk**-0.5
    if args.cpu_check:
        device, dtype, args.tokens, args.heads, args.check_tokens = torch.device("cpu"), torch.float32, [64, 129], 3, 37
    elif torch.cuda.is_available():
        device, dtype = torch.device("cuda"), torch.bfloat16
    else:
        raise SystemExit("bench_prefill_attention: no CUDA device (use --cpu-check on a CPU machine)")
    rows = []
    q, k, v = inputs(args.check_tokens, args.heads, d_qk, d_v, device, dtype, seed=1)
    want = reference(q, k, v, scale)
    errors = {}
    for name, fn in VARIANTS.items():
        try:
            got = fn(q, k, v, scale)
            errors[name] = float((got.double() - want).abs().max() / want.abs().max())
        except Exception as err:  # noqa: BLE001 - a kernel that refuses the shapes is a result
            errors[name] = repr(err).splitlines()[0][:200]
    del q, k, v, want
    for tokens in args.tokens:
        q, k, v = inputs(tokens, args.heads, d_qk, d_v, device, dtype, seed=2)
        flops = 2 * args.heads * tokens * tokens / 2 * (d_qk + d_v)
        for name, fn in VARIANTS.items():
            row = {"tokens": tokens, "variant": name, "max_rel_err_T_check": errors[name],
                   "cudnn_refused_so_far": sorted(map(str, _cudnn_refused))}  # auto's fallbacks, if any
            if isinstance(errors[name], str):
                row["error"] = errors[name]
            else:
                try:
                    ms = median_ms(lambda fn=fn: fn(q, k, v, scale), device)  # noqa: F821 (bound above; deleted only after the call)
                    row.update(ms=round(ms, 3), TFLOPs=round(flops / ms / 1e9, 1))
                except Exception as err:  # noqa: BLE001
                    row["error"] = repr(err).splitlines()[0][:200]
            log.info("%s", row)
            rows.append(row)
        del q, k, v
    print(f"| T | kernel | ms | TFLOP/s (causal core, unpadded) | max rel err vs float64 at T = {args.check_tokens} |")
    print("|---|---|---|---|---|")
    for r in rows:
        err = r["max_rel_err_T_check"]
        err = f"{err:.1e}" if isinstance(err, float) else err
        print(f"| {r['tokens']} | {r['variant']} | {r.get('ms', r.get('error', ''))} | {r.get('TFLOPs', '')} | {err} |")
    write_json(args.json, {"device": device_name(device), "torch": torch.__version__, "rows": rows})
    return rows


if __name__ == "__main__":
    main()
