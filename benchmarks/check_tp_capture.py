"""Check (not a benchmark): the Kimi-shaped bench model's captured states under tensor
parallelism on GPUs, bf16 and the fast kernels (cuDNN prefill attention, INT4 Triton MoE).

Run under torchrun. Every rank feeds the SAME ids (drawn on the CPU from a fixed seed) and must
hold the same replicated hidden states after each all-reduce: the script reports, per rank, the
captured states' finiteness and smallest token norm, and the largest difference between ranks.
(A capture whose ranks drew their ids from their own CUDA generators once showed a NaN fp8 error
and a near-zero token in bench-extract's tp 2 run.)

    torchrun --standalone --nproc-per-node 2 benchmarks/check_tp_capture.py --tokens 4096
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench_common import import_eagleforge  # noqa: E402

import_eagleforge()
from kimi_shaped import bench_layout, build_bench_model, kimi_args, tiny_args  # noqa: E402

from eagleforge.target.capture import HiddenStateCapture  # noqa: E402


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--cpu-check", action="store_true")
    a = ap.parse_args(argv)
    layout, tp = bench_layout(a.cpu_check)
    try:
        args = tiny_args(a.layers) if a.cpu_check else kimi_args(a.layers)
        tokens = 40 if a.cpu_check else a.tokens
        model = build_bench_model(args, layout.device, tp=tp,
                                  dtype=torch.float32 if a.cpu_check else torch.bfloat16)
        ids = torch.randint(0, args.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(1)).to(layout.device)
        aux_layers = list(range(1, args.num_hidden_layers))
        with torch.inference_mode(), HiddenStateCapture(model.model.layers, aux_layers, model.model.norm) as capture:
            model(ids)
            aux = capture.aux_hidden_states[0].float()  # [T, k*H]
            last = capture.last_hidden_state[0].float()
        per_layer = aux.view(tokens, len(aux_layers), -1)
        report = {
            "rank": layout.rank, "tp": tp.size, "tokens": tokens,
            "finite": bool(torch.isfinite(aux).all()),
            "min_token_norm_per_aux_layer": [round(float(per_layer[:, i].norm(dim=-1).min()), 6) for i in range(len(aux_layers))],
            "argmin_token_per_aux_layer": [int(per_layer[:, i].norm(dim=-1).argmin()) for i in range(len(aux_layers))],
            "max_abs": round(float(aux.abs().max()), 4),
        }
        report["last_finite"] = bool(torch.isfinite(last).all())
        if tp.size > 1:
            gathered = tp.all_gather(aux.contiguous())
            report["max_diff_between_ranks"] = max(float((g - aux).abs().max()) for g in gathered)
        print(json.dumps(report), flush=True)
        return report
    finally:
        layout.shutdown()


if __name__ == "__main__":
    main()
