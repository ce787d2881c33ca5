"""Hook extraction vs output_hidden_states=True on the embedded SmolLM2, CPU: tokens/s, memory.

    python benchmarks/bench_extract_cpu.py                       # make bench-extract-cpu
    python benchmarks/bench_extract_cpu.py --batch-size 8 --seq-len 256 --batches 4 --threads 2

Four ways to get the aux states [B, T, 3H] and the final state [B, T, H] of the same batches
(real text: standard-library docstrings, so the lengths differ and batches are right padded):

    hooks+argmax    the extractor's forward_batch: base model under HiddenStateCapture, then
                    target_argmax through the lm_head in row chunks, unpadded per sample
    hooks           the same without target_argmax
    ohs base        model.model(..., output_hidden_states=True): all L + 1 states kept, no argmax
    ohs full        model(..., output_hidden_states=True): what a user script does; full
                    [B, T, V] logits, argmax from them; all L + 1 states kept

Compare hooks+argmax with ohs full (both give the argmax) and hooks with ohs base (neither).
Each mode runs in its own subprocess so the memory numbers do not mix: `peak RSS` is the
process's high-water mark (ru_maxrss, includes the ~0.55 GB fp32 model and loading), `extra RSS`
is the largest RSS above the level before the timed forwards, sampled every 5 ms while they run
(the activations and outputs a mode keeps). tokens/s counts real (unpadded) tokens, per second of
wall time and per second of the process's CPU time: on a shared machine the wall time mostly
measures the neighbours, and the comparison ("vs ohs") uses CPU time.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import threading
import time

MODES = ("hooks+argmax", "hooks", "ohs base", "ohs full")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class RssSampler(threading.Thread):
    """Peak resident memory while running, sampled from /proc (torch ops release the GIL)."""

    def __init__(self, interval_s: float = 0.005):
        super().__init__(daemon=True)
        self.interval_s, self.peak, self.running = interval_s, _rss_bytes(), True

    def run(self):
        while self.running:
            self.peak = max(self.peak, _rss_bytes())
            time.sleep(self.interval_s)

    def stop(self) -> int:
        self.running = False
        self.join()
        return max(self.peak, _rss_bytes())


def make_batches(tokenizer, batch_size: int, seq_len: int, batches: int) -> list[list[list[int]]]:
    """Token lists from real docstrings, lengths between seq_len/2 and seq_len."""
    import builtins
    import collections
    import json as json_mod
    import pathlib

    modules = [json_mod, os, pathlib, collections, builtins, threading, subprocess]
    docs = [obj.__doc__ for m in modules for obj in vars(m).values() if isinstance(getattr(obj, "__doc__", None), str)]
    ids = tokenizer("\n\n".join(docs))["input_ids"]
    out, pos = [], 0
    for b in range(batches):
        batch = []
        for j in range(batch_size):
            n = seq_len - (j * 37 + b * 11) % (seq_len // 2)  # odd, different lengths
            batch.append(ids[pos : pos + n])
            pos += n
        out.append(batch)
    if pos > len(ids):
        raise SystemExit(f"not enough docstring text for {batches} x {batch_size} x {seq_len} tokens")
    return out


def _pad(batch, pad_id):
    import torch

    width = max(len(s) for s in batch)
    tokens = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for b, s in enumerate(batch):
        tokens[b, : len(s)] = torch.tensor(s)
        mask[b, : len(s)] = 1
    return tokens, mask


def run_mode(mode: str, args) -> dict:
    """One subprocess: load, one warm-up batch, time the rest; tokens/s and memory."""
    import torch

    from eagleforge.config import TargetConfig
    from eagleforge.target.capture import HiddenStateCapture
    from eagleforge.target.hf import forward_batch
    from eagleforge.target.loading import decoder_layers, default_aux_layers, final_norm, load_target

    torch.set_num_threads(args.threads)
    model, tokenizer = load_target(TargetConfig(device="cpu"))
    aux = default_aux_layers(model.config.num_hidden_layers)
    batches = make_batches(tokenizer, args.batch_size, args.seq_len, args.batches + 1)
    pad_id, cpu = tokenizer.pad_token_id, torch.device("cpu")
    capture = HiddenStateCapture(decoder_layers(model), aux, final_norm(model))

    def step(batch):
        if mode.startswith("hooks"):
            with capture:
                return forward_batch(model, capture, batch, pad_id, cpu, mode == "hooks+argmax")
        tokens, mask = _pad(batch, pad_id)
        with torch.inference_mode():
            runner = model.model if mode == "ohs base" else model
            out = runner(input_ids=tokens, attention_mask=mask, output_hidden_states=True, use_cache=False)
            hidden = out.hidden_states  # L + 1 states, all kept alive by `out`
            result = {"aux_hidden_states": torch.cat([hidden[i + 1] for i in aux], -1), "last": hidden[-1]}
            if mode == "ohs full":
                result["target_argmax"] = out.logits.argmax(-1)
            return out, result

    step(batches[0])  # warm-up: allocator, kernels, sdpa mask paths
    base_rss = _rss_bytes()
    sampler = RssSampler()
    sampler.start()
    tokens, start, start_cpu = 0, time.perf_counter(), time.process_time()
    for batch in batches[1:]:
        kept = step(batch)  # held until the next batch replaces it, as a writer would
        tokens += sum(len(s) for s in batch)
    elapsed_s, cpu_s = time.perf_counter() - start, time.process_time() - start_cpu
    del kept
    peak = sampler.stop()
    return {"mode": mode, "tokens_per_s": tokens / elapsed_s, "tokens_per_cpu_s": tokens / cpu_s, "tokens": tokens,
            "extra_rss_mib": (peak - base_rss) / 2**20,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batches", type=int, default=2, help="timed batches (plus one warm-up)")
    parser.add_argument("--rounds", type=int, default=2, help="repeat every mode; the best of each number is kept")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per subprocess")
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)  # internal: one subprocess
    args = parser.parse_args()
    if args.mode:
        print("RESULT " + json.dumps(run_mode(args.mode, args)), flush=True)
        return
    best: dict[str, dict] = {}
    passthrough = [f"--batch-size={args.batch_size}", f"--seq-len={args.seq_len}", f"--batches={args.batches}",
                   f"--threads={args.threads}"]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false"}
    for _ in range(args.rounds):
        for mode in MODES:  # interleaved rounds: background load hits every mode alike
            proc = subprocess.run([sys.executable, __file__, f"--mode={mode}", *passthrough], env=env,
                                  capture_output=True, text=True, check=False)
            lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
            if proc.returncode != 0 or not lines:
                raise SystemExit(f"mode {mode!r} failed:\n{proc.stderr[-3000:]}")
            result = json.loads(lines[-1][len("RESULT "):])
            previous = best.get(mode, result)
            best[mode] = {key: max(result[key], previous[key]) if key.startswith("tokens_per") else
                          min(result[key], previous[key]) if key.endswith("_mib") else result[key] for key in result}
    print(f"SmolLM2-135M fp32 CPU, {args.threads} thread(s), batches of {args.batch_size} x <= {args.seq_len} "
          f"tokens (right padded), {args.batches} timed batches, best of {args.rounds} round(s)")
    print(f"{'mode':<14} {'tokens/s':>9} {'tokens/CPU-s':>13} {'vs ohs':>7} {'extra RSS MiB':>14} {'peak RSS MiB':>13}")
    reference = {"hooks+argmax": "ohs full", "hooks": "ohs base"}
    for mode in MODES:
        r = best[mode]
        ratio = f"{r['tokens_per_cpu_s'] / best[reference[mode]]['tokens_per_cpu_s']:.2f}x" if mode in reference else ""
        print(f"{mode:<14} {r['tokens_per_s']:>9.1f} {r['tokens_per_cpu_s']:>13.1f} {ratio:>7} "
              f"{r['extra_rss_mib']:>14.1f} {r['peak_rss_mib']:>13.1f}")


if __name__ == "__main__":
    main()
