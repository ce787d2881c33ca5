"""The draft's training activations per token under each checkpoint mode, counted on the CPU
(BENCHMARKS.md, "Activations per checkpoint mode"); train/step_plan.py takes the modes' ratios from here.

    python benchmarks/draft_activation_memory.py --div 8 --tokens 1024 1536 --json $OUT/act.json

One training step of the draft (forward_ttt over 7 TTT steps, the trainer's TTT loss, backward),
bf16, eager (dynamo refuses to trace under the counting mode), at 1/div of the Kimi-shaped
draft's widths: every tensor of the step is [T, c x H] or per head, so the slope between the two
batch sizes times div is the Kimi draft's bytes per token. Counted: the bytes of every storage
an aten op creates (a TorchDispatchMode sees each op's outputs) until it dies, the peak of their
sum; storages made before (weights, batch) are not, so the weights' gradients drop out of the slope.

Modes: selective_all, selective, step, none, and the mixes step*m + selective_all*(7 - m) (the
first m TTT steps recompute whole; the backward frees the later steps first, so they come last).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench_common import import_eagleforge, write_json  # noqa: E402

import_eagleforge()

from torch.multiprocessing.reductions import StorageWeakRef  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_flatten  # noqa: E402

KIMI = dict(hidden=7168, heads=64, head_dim=128, inter=18432, vd=32000, vocab=163840, aux=3)
TTT_STEPS = 7
# The loss's [C, Vd] logits chunk: fixed below both batch sizes, so it is the same at both and drops
# out of the slope (the GPU's measured slope is between 8K and 32K tokens, past its own chunk size).
LOSS_CHUNK_TOKENS = 256


class LiveBytes(TorchDispatchMode):
    """The bytes of the storages made by aten ops and still alive, and their peak. `known`: data
    pointers of storages made before (weights, inputs), never counted."""

    def __init__(self, known: set[int]):
        super().__init__()
        self.known, self.live, self.now, self.peak = known, {}, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # the storages freed by now first: a new one may sit at a freed one's address
        for key in [k for k, (ref, _) in self.live.items() if ref.expired()]:
            self.now -= self.live.pop(key)[1]
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key and key not in self.live and key not in self.known:
                    self.live[key] = (StorageWeakRef(storage), storage.nbytes())
                    self.now += storage.nbytes()
        self.peak = max(self.peak, self.now)
        return out


def build(div: int):
    from eagleforge.draft import Eagle3Config, Eagle3Draft

    h, vd, vocab = KIMI["hidden"] // div, KIMI["vd"] // div, KIMI["vocab"] // div
    config = Eagle3Config(hidden_size=h, num_attention_heads=KIMI["heads"] // div, num_key_value_heads=KIMI["heads"] // div,
                          head_dim=KIMI["head_dim"], intermediate_size=KIMI["inter"] // div, vocab_size=vocab, draft_vocab_size=vd,
                          target_hidden_size=h, aux_layer_ids=[1, 29, 57], rms_norm_eps=1e-5, rope_theta=50000.0,
                          max_position_embeddings=131072)
    torch.manual_seed(0)
    draft = Eagle3Draft(config).to(torch.bfloat16)
    draft.embed_tokens.weight.requires_grad_(False)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[:vd] = True
    draft.set_vocab_map(torch.zeros(vd, dtype=torch.long), t2d)
    head = (torch.randn(vd, h) * 0.05).to(torch.bfloat16)
    return draft, head


def peak_bytes(draft, head, mode: str, tokens: int) -> int:
    """The counted peak of one training step of one sample of `tokens` tokens."""
    from eagleforge.train.ttt_loss import TTTLoss

    h, vd, vocab = draft.config.hidden_size, draft.config.draft_vocab_size, draft.config.vocab_size
    loss = TTTLoss(head, torch.device("cpu"), ttt_steps=TTT_STEPS, loss="auto", bf16=True, attention="auto", checkpoint=mode,
                   chunk_tokens=LOSS_CHUNK_TOKENS)
    aux = torch.randn(1, tokens, KIMI["aux"] * h).to(torch.bfloat16)
    last = torch.randn(1, tokens, h).to(torch.bfloat16)
    ids = torch.randint(0, vocab, (1, tokens))
    mask = torch.ones(1, tokens, dtype=torch.bool)
    argmax = torch.randint(0, vd, (1, tokens))
    draft.zero_grad(set_to_none=True)
    known = {t.untyped_storage().data_ptr() for t in [*draft.parameters(), *draft.buffers(), head, aux, last, ids, mask, argmax]}
    counter = LiveBytes(known)
    with counter:
        value, _ = loss(draft, aux, ids, last, mask, argmax)
        value.backward()
    draft.zero_grad(set_to_none=True)
    return counter.peak


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--div", type=int, default=8, help="widths are Kimi's draft's / div")
    parser.add_argument("--tokens", type=int, nargs=2, default=[1024, 1536], help="the two batch sizes of the slope")
    parser.add_argument("--modes", nargs="*", default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    modes = args.modes or ["selective_all", "selective", "step", "none",
                           *[f"step*{m}+selective_all*{TTT_STEPS - m}" for m in range(1, TTT_STEPS)]]
    draft, head = build(args.div)
    t0, t1 = args.tokens
    rows = {}
    print(f"draft at 1/{args.div} of Kimi-K2.5's widths, {TTT_STEPS} TTT steps, bf16, eager; peaks at {t0} and {t1} tokens")
    for mode in modes:
        start = time.perf_counter()
        p0, p1 = peak_bytes(draft, head, mode, t0), peak_bytes(draft, head, mode, t1)
        slope = (p1 - p0) / (t1 - t0) * args.div  # bytes per token of the full-width draft
        rows[mode] = {"peak_bytes": [p0, p1], "kib_per_token_full_width": slope / 1024}
        print(f"  {mode:<28} {p0 / 2**20:8.1f} {p1 / 2**20:8.1f} MiB   {slope / 1024:8.1f} KiB/token x{args.div}"
              f"   ({time.perf_counter() - start:.0f} s)", flush=True)
    base = rows.get("selective_all")
    if base:
        for mode, row in rows.items():
            row["ratio_to_selective_all"] = row["kib_per_token_full_width"] / base["kib_per_token_full_width"]
        print("  ratios to selective_all: " + ", ".join(f"{m} {r['ratio_to_selective_all']:.3f}" for m, r in rows.items()))
    result = {"div": args.div, "tokens": args.tokens, "ttt_steps": TTT_STEPS, "modes": rows}
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
