"""Benchmark: the EAGLE-3 soft cross-entropy, forward + backward, ours vs the peers, one run
(BENCHMARKS.md, "Fused EAGLE-3 loss"), at the Kimi-K2.5 draft shape (H = 7168, Vd = 32000) for
T = 8192 and 32768, the usual alternatives side by side in the same process:

    naive_torch                       public trainers' way: fp32 softmax of both [T, Vd] logits
    liger_fused_linear_jsd_beta0      Liger-Kernel's fused linear JSD, beta 0 (forward KL), one step
    *_ttt7                            K = 7 TTT steps with the teacher shared, per-step cost = ms / 7
                                      (naive: probabilities once + 7 steps; Liger KL: the same;
                                      ours: fused_soft_cross_entropy_ttt, teacher logits once)
    ours_ttt7_chunkC                  per step: K x (3 matmuls + row pass) per teacher chunk of C
    ours_ttt7_packed_chunkC           packed (the kernels' packed=True): the K steps' rows of a teacher chunk of C/K
                                      positions in ONE [C, H] x [H, Vd] matmul, one row pass, one
                                      grad-hidden matmul, one grad-head addmm (same buffer sizes)

Per case: median ms of forward + backward (do_bench), peak memory above the inputs (hidden
states, heads, a method's precomputed teacher probabilities or lse) with and without the gradient
outputs every method returns, and the loss relative to naive (a correctness check). The run's
bf16 matmul rate gives the floors (3 or 4 matmuls of 2 T H Vd).

    make bench-loss                                      # = python benchmarks/bench_loss.py
    python benchmarks/bench_loss.py --ttt-only --variants perstep packed   # our TTT forms only
    python benchmarks/bench_loss.py --cpu-check          # tiny shapes on the CPU: checks the script

The Liger rows need liger-kernel (`pip install liger-kernel`); without it they are skipped.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import sys
from pathlib import Path

import torch

log = logging.getLogger("bench_loss")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_common import device_name, matmul_tflops, median_ms, sync, write_json  # noqa: E402
from kimi_shaped import DraftShape  # noqa: E402  (imports eagleforge from a bare checkout)

from eagleforge.kernels import rows as row_kernels  # noqa: E402
from eagleforge.kernels import soft_ce, soft_ce_ttt  # noqa: E402
from eagleforge.train import loss as reference_loss  # noqa: E402


def peak_above_inputs(fn, device: torch.device) -> float | None:
    """GiB allocated at the peak of one call, above what was allocated before it."""
    if device.type != "cuda":
        fn()
        return None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def make_inputs(tokens: int, hidden: int, vocab: int, steps: int, device, dtype):
    """Random inputs at a trained model's scales, plus K draft hidden states for the TTT cases."""
    torch.manual_seed(0)
    hd = (torch.randn(tokens, hidden, device=device, dtype=dtype) * 0.5).requires_grad_()
    wd = (torch.randn(vocab, hidden, device=device, dtype=dtype) * hidden**-0.5).requires_grad_()
    ht = torch.randn(tokens, hidden, device=device, dtype=dtype) * 0.5
    wt = torch.randn(vocab, hidden, device=device, dtype=dtype) * hidden**-0.5
    hds = [(torch.randn(tokens, hidden, device=device, dtype=dtype) * 0.5).requires_grad_() for _ in range(steps)]
    return hd, wd, ht, wt, hds


def run_cases(tokens, hidden, vocab, steps, chunks, device, dtype, timer, with_liger, variants=("perstep", "packed"),
              ttt_only=False):
    hd, wd, ht, wt, hds = make_inputs(tokens, hidden, vocab, steps, device, dtype)
    params = [hd, wd, *hds]
    grad_gib = (hd.numel() * hd.element_size() + wd.numel() * wd.element_size()) / 2**30
    ones = torch.ones(tokens, device=device)
    mean_w = ones / tokens  # the loss is a mean over tokens
    ttt_w = zero_past_teacher_(torch.ones(steps, tokens, device=device) / tokens)
    results, losses = {}, {}

    def case(name, fn, n_steps=1, grad_outputs_gib=grad_gib):
        def step():
            for p in params:
                p.grad = None
            return fn()

        for p in params:
            p.grad = None
        peak = peak_above_inputs(step, device)
        out = step()
        if out is not None:
            losses[name] = float(out)
        ms = timer(step)
        row = {"ms": round(ms, 3), "ms_per_step": round(ms / n_steps, 3)}
        if peak is not None:
            row["peak_GiB_over_inputs"] = round(peak, 3)
            row["peak_GiB_over_inputs_and_grads"] = round(peak - grad_outputs_gib, 3)
        if name in losses and "naive_torch" in losses and n_steps == 1:
            row["loss_rel_to_naive"] = float(f"{losses[name] / losses['naive_torch'] - 1:.2e}")
        results[name] = row
        log.info("T=%d %-40s %s", tokens, name, row)

    def naive():
        with torch.no_grad():
            pt = torch.softmax((ht @ wt.T).float(), -1)
        logp = torch.log_softmax((hd @ wd.T).float(), -1)
        loss = -(pt * logp).sum(-1).mean()
        loss.backward()
        return loss.detach()

    if not ttt_only:
        case("naive_torch", naive)

    with torch.no_grad():
        lse = soft_ce.teacher_logsumexp(ht, wt)
    if with_liger and not ttt_only:
        try:
            from liger_kernel.transformers import LigerFusedLinearJSD

            jsd = LigerFusedLinearJSD(jsd_beta=0.0)

            def liger_jsd():
                loss = jsd(hd, wd, ht, wt, None)
                loss.backward()
                return loss.detach()

            case("liger_fused_linear_jsd_beta0", liger_jsd)
        except Exception as exc:  # report and go on: the peers must not stop our measurement
            results["liger_jsd_error"] = repr(exc)[:300]
            log.warning("liger JSD: %s", results["liger_jsd_error"])
        try:
            from liger_kernel.transformers import LigerFusedLinearKLDivLoss

            kl = LigerFusedLinearKLDivLoss()

            def liger_kl_ttt():  # probabilities computed once, shared by the K steps
                with torch.no_grad():
                    shared = torch.softmax((ht @ wt.T).float(), -1)
                total = 0.0
                for h in hds:
                    loss = kl(h, wd, shared)
                    loss.backward()
                    total += loss.detach()
                return total

            case(f"liger_kldiv_ttt{steps}_probs_once", liger_kl_ttt, n_steps=steps, grad_outputs_gib=steps_grad_gib(hds, wd))
        except Exception as exc:
            results["liger_kl_error"] = repr(exc)[:300]
            log.warning("liger KL-div: %s", results["liger_kl_error"])

    def naive_ttt():  # probabilities once, then K steps each with its own [T, Vd] fp32 graph
        with torch.no_grad():
            pt = torch.softmax((ht @ wt.T).float(), -1)
        loss = sum(-(pt * torch.log_softmax((h @ wd.T).float(), -1)).sum(-1).mean() for h in hds)
        loss.backward()
        return loss.detach()

    if not ttt_only:
        case(f"naive_torch_ttt{steps}_probs_once", naive_ttt, n_steps=steps, grad_outputs_gib=steps_grad_gib(hds, wd))

    # Old (per step) and new (packed) side by side, alternating per chunk size.
    for chunk in chunks:
        for variant in variants:
            def ours_ttt(chunk=chunk, packed=variant == "packed"):
                # as the trainer calls it: its weights are zero past the teacher by construction,
                # so no check (the check reads a device value back: a host sync per call)
                loss, _, _ = soft_ce_ttt.fused_soft_cross_entropy_ttt(hds, wd, ht, wt, ttt_w, chunk_tokens=chunk, packed=packed,
                                                                  check_weight=False)
                loss.backward()
                return loss.detach()

            name = f"ours_ttt{steps}_chunk{chunk}" if variant == "perstep" else f"ours_ttt{steps}_packed_chunk{chunk}"
            case(name, ours_ttt, n_steps=steps, grad_outputs_gib=steps_grad_gib(hds, wd))
    results["ours_vs_reference"] = check_ours(hds, wd, ht, wt, ttt_w, lse, hd, mean_w, chunks[0])
    return results


def steps_grad_gib(hds, wd) -> float:
    return sum(h.numel() * h.element_size() for h in hds) / 2**30 + wd.numel() * wd.element_size() / 2**30


def check_ours(hds, wd, ht, wt, ttt_w, lse, hd, mean_w, chunk) -> dict:
    """Relative loss differences: ours (both entry points) vs the plain-torch reference (fp32) on
    the first 1024 rows (the reference materializes [rows, Vd] in fp32)."""
    rows = min(1024, hd.shape[0])
    ttt = ([h[:rows] for h in hds], wd, ht[:rows], wt, ttt_fix(ttt_w, rows))
    with torch.no_grad():
        ref, _ = reference_loss.soft_cross_entropy(hd[:rows], wd, ht[:rows], wt, lse[:rows], mean_w[:rows])
        ours, _ = soft_ce.fused_soft_cross_entropy(hd[:rows], wd, ht[:rows], wt, lse[:rows], mean_w[:rows], chunk_tokens=chunk)
        ref_ttt = reference_loss.soft_cross_entropy_ttt(*ttt)[0]
        ours_ttt = soft_ce_ttt.fused_soft_cross_entropy_ttt(*ttt, chunk_tokens=chunk)[0]
        packed = soft_ce_ttt.fused_soft_cross_entropy_ttt(*ttt, chunk_tokens=chunk, packed=True)[0]
    return {"single_step_rel": float(f"{ours.item() / ref.item() - 1:.2e}"), "ttt_rel": float(f"{ours_ttt.item() / ref_ttt.item() - 1:.2e}"),
            "ttt_packed_rel": float(f"{packed.item() / ref_ttt.item() - 1:.2e}"), **check_packed_grads(hds, wd, ht, wt, ttt_w, chunk)}


def check_packed_grads(hds, wd, ht, wt, ttt_w, chunk) -> dict:
    """Packed vs per-step TTT gradients (hidden states and head) at the full T, relative norms."""
    grads = {}
    for packed in (False, True):
        for p in [wd, *hds]:
            p.grad = None
        loss, _, _ = soft_ce_ttt.fused_soft_cross_entropy_ttt(hds, wd, ht, wt, ttt_w, chunk_tokens=chunk, packed=packed)
        loss.backward()
        grads[packed] = [wd.grad.clone()] + [h.grad.clone() for h in hds]
    for p in [wd, *hds]:
        p.grad = None
    errs = [((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item() for a, b in zip(grads[True], grads[False])]
    return {"packed_vs_perstep_grad_head_rel": float(f"{errs[0]:.2e}"), "packed_vs_perstep_grad_hidden_max_rel": float(f"{max(errs[1:]):.2e}")}


def zero_past_teacher_(w: torch.Tensor) -> torch.Tensor:
    """TTT weight [K, rows], in place: step j's last 1 + j rows have no teacher, weight 0."""
    for j in range(w.shape[0]):
        w[j, w.shape[1] - 1 - j:] = 0
    return w


def ttt_fix(ttt_w, rows):
    """The TTT weight of a prefix of `rows` rows."""
    return zero_past_teacher_(ttt_w[:, :rows].clone())


def profile_ttt(tokens, hidden, vocab, steps, chunk, device, dtype, timer) -> dict:
    """Where one packed TTT call (forward + backward) spends its GPU time: the kernels by total
    time (printed), and each of a packed chunk's GEMMs timed alone at its own shape with its
    TFLOP/s (the grad-head addmm with beta 1, as the loop runs it after the first chunk)."""
    from torch.profiler import ProfilerActivity, profile

    hd, wd, ht, wt, hds = make_inputs(tokens, hidden, vocab, steps, device, dtype)
    ttt_w = zero_past_teacher_(torch.ones(steps, tokens, device=device) / tokens)

    def call():
        for x in [wd, *hds]:
            x.grad = None  # as the table's timing and a training step: no accumulation into .grad
        loss, _, _ = soft_ce_ttt.fused_soft_cross_entropy_ttt(hds, wd, ht, wt, ttt_w, chunk_tokens=chunk, packed=True,
                                                          check_weight=False)
        loss.backward()

    cuda = device.type == "cuda"
    for _ in range(2):
        call()
    sync(device)
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        call()
        sync(device)
    print(f"=== profile: one packed TTT call, T = {tokens}, chunk {chunk}, {steps} steps")
    averages = prof.key_averages()
    print(averages.table(sort_by="cuda_time_total" if cuda else "cpu_time_total", row_limit=25, max_name_column_width=90))
    out = {}
    if cuda:
        # the kernels' summed time against the wall time of calls run back to back (one sync at the
        # end, as a training loop runs them): the difference is the GPU waiting on the host
        out["kernels_ms_per_call"] = round(sum(e.self_device_time_total for e in averages) / 1e3, 3)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            call()
        end.record()
        torch.cuda.synchronize()
        out["back_to_back_ms_per_call"] = round(start.elapsed_time(end) / 5, 3)
        out["do_bench_ms_per_call"] = round(timer(call), 3)
        print("kernels summed / back to back / do_bench, ms per call:", out)
    t_chunk = chunk // steps
    p = t_chunk * steps
    h, z, g, acc = hds[0][:p].detach(), torch.empty(p, vocab, device=device, dtype=dtype), \
        torch.empty(p, hidden, device=device, dtype=dtype), torch.zeros(vocab, hidden, device=device, dtype=dtype)
    tb = torch.empty(t_chunk, vocab, device=device, dtype=dtype)
    w = wd.detach()
    gemms = {
        f"teacher [{t_chunk},H] x [H,Vd]": (lambda: torch.mm(ht[:t_chunk], wt.T, out=tb), t_chunk),
        f"draft logits [{p},H] x [H,Vd]": (lambda: torch.mm(h, w.T, out=z), p),
        f"grad hidden [{p},Vd] x [Vd,H]": (lambda: torch.mm(z, w, out=g), p),
        f"grad head += [Vd,{p}] x [{p},H] (beta 1)": (lambda: acc.addmm_(z.T, h, beta=1.0), p),
    }
    for name, (fn, rows) in gemms.items():
        ms = timer(fn)
        out[name] = {"ms": round(ms, 3), "TFLOPs": round(2 * rows * hidden * vocab / ms / 1e9, 1)}
        print(f"{name:<44} {ms:8.3f} ms {out[name]['TFLOPs']:7.1f} TFLOP/s")
    return out


def floors(tokens, hidden, vocab, steps, tflops) -> dict:
    one_ms = 2 * tokens * hidden * vocab / tflops / 1e9
    return {"floor_ms_4gemm": round(4 * one_ms, 3), "floor_ms_3gemm": round(3 * one_ms, 3),
            f"floor_ms_per_step_teacher_shared_{steps}": round((3 + 1 / steps) * one_ms, 3)}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768])
    kimi = DraftShape.kimi()
    parser.add_argument("--hidden", type=int, default=kimi.hidden)
    parser.add_argument("--vocab", type=int, default=kimi.draft_vocab)
    parser.add_argument("--steps", type=int, default=kimi.ttt, help="TTT steps sharing one teacher")
    parser.add_argument("--chunks", type=int, nargs="+", default=[2048, 4096], help="our chunk_tokens values to time")
    parser.add_argument("--rep-ms", type=int, default=300, help="do_bench measuring time per case")
    parser.add_argument("--no-liger", action="store_true")
    parser.add_argument("--variants", nargs="+", default=["perstep", "packed"], choices=["perstep", "packed"],
                        help="our TTT forms to time, side by side per chunk size")
    parser.add_argument("--ttt-only", action="store_true", help="time only our TTT rows (skip naive, Liger, single step)")
    parser.add_argument("--cpu-check", action="store_true", help="tiny shapes on the CPU, to check the script")
    parser.add_argument("--profile", action="store_true",
                        help="also profile one packed TTT call at the first T and chunk, and time its GEMMs alone")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    if args.cpu_check:
        device, dtype = torch.device("cpu"), torch.float32
        args.tokens, args.hidden, args.vocab, args.chunks = [96, 61], 40, 997, [32]
    else:
        if not torch.cuda.is_available():
            raise SystemExit("bench_loss.py needs a CUDA GPU (an H200 for BENCHMARKS.md's table); --cpu-check runs tiny shapes on the CPU")
        device, dtype = torch.device("cuda"), torch.bfloat16
    timer = functools.partial(median_ms, device=device, rep_ms=args.rep_ms, cpu_reps=5, warmup_ms=25)
    env = {"torch": torch.__version__, "device": device_name(device),
           "triton_path": row_kernels.resolve_backend("auto", device)}
    try:
        import liger_kernel  # noqa: F401

        env["liger_kernel"] = getattr(liger_kernel, "__version__", "installed")
        with_liger = device.type == "cuda" and not args.no_liger
    except ImportError:
        env["liger_kernel"] = None
        with_liger = False
        if device.type == "cuda" and not args.no_liger:
            log.warning("liger_kernel not importable: its rows are skipped (pip install liger-kernel to include them)")
    result = {"env": env, "shape": {"hidden": args.hidden, "vocab": args.vocab, "steps": args.steps}}
    tflops = matmul_tflops(device)
    result["matmul_tflops"] = round(tflops, 1)
    for tokens in args.tokens:
        table = run_cases(tokens, args.hidden, args.vocab, args.steps, args.chunks, device, dtype, timer, with_liger,
                          args.variants, args.ttt_only)
        table.update(floors(tokens, args.hidden, args.vocab, args.steps, tflops))
        result[f"T={tokens}"] = table
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.profile:
        result["profile_gemms"] = profile_ttt(args.tokens[0], args.hidden, args.vocab, args.steps, args.chunks[0], device,
                                              dtype, timer)
    print(json.dumps(result, indent=1))
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
