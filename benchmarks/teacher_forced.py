"""Where a draft's acceptance is lost: the draft teacher-forced (eval/specdec.py
`teacher_forced_hits`) on two texts at the eval's answer length, with the same metrics:

    humaneval  the eval's prompts, the target's greedy answers (the text `make eval` measures on)
    heldout    the run's own held-out samples (the last train.holdout_samples of RUN/data, never
               trained on), answers cut to eval.max_new_tokens; split into bare function stubs
               (HumanEval's shape) and instruction prompts

Per text: `replayed` (the rounds chain speculative decoding runs on it: equals the measured
acceptance when the engine computes what training computed) and `every_row` (every answer row a
round start). Runs on the CPU in a few minutes for SmolLM2 drafts.

    python benchmarks/teacher_forced.py runs/g3 --json out.json [--texts heldout]
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_common import import_eagleforge  # noqa: E402

import_eagleforge()

from eagleforge.config import load_config  # noqa: E402
from eagleforge.eval.evaluate import draft_dir, load_eval_draft, load_prompts, on_own_outputs, run_greedy  # noqa: E402
from eagleforge.eval.specdec import eos_token_ids, teacher_forced_acceptance, teacher_forced_hits  # noqa: E402
from eagleforge.target.loading import load_target, use_cpu_attention  # noqa: E402


def heldout_rows(run: Path, holdout: int) -> list[dict]:
    """The trainer's held-out samples (the last `holdout` of the extracted shards, in their
    order), read from RUN/data/samples.jsonl(.gz)."""
    from eagleforge.shards import ShardReader

    if holdout <= 0:
        raise SystemExit(f"{run}: train.holdout_samples = {holdout}: the run has no held-out samples")
    path = run / "data" / "samples.jsonl"
    opener = open if path.is_file() else gzip.open
    if not path.is_file():
        path = path.with_suffix(".jsonl.gz")
    with opener(path, "rt", encoding="utf-8") as f:
        rows = {r["id"]: r for r in (json.loads(line) for line in f if line.strip())}
    return [rows[i] for i in ShardReader(run / "hidden").sample_ids()[-holdout:]]


def on_heldout(draft, target, tokenizer, rows: list[dict], answer_tokens: int, k: int) -> dict:
    groups: dict[str, tuple[list, list]] = {"stub": ([], []), "instruction": ([], [])}
    for row in rows:
        start = row["loss_mask"].index(1)  # the first answer token
        prompt, answer = row["input_ids"][:start], row["input_ids"][start:start + answer_tokens]
        # A bare stub's user turn starts with its `def` (eagleforge/data/prompts.py `_stub`); the rest ask in words.
        kind = "stub" if "user\ndef " in tokenizer.decode(prompt) else "instruction"
        groups[kind][0].append(teacher_forced_hits(draft, target, prompt + answer, k))
        groups[kind][1].append(len(prompt) - 1)
    hits = groups["stub"][0] + groups["instruction"][0]
    starts = groups["stub"][1] + groups["instruction"][1]
    out = {"all": {"samples": len(hits), **teacher_forced_acceptance(hits, starts, k)}}
    for kind, (h, s) in groups.items():
        out[kind] = {"samples": len(h), **teacher_forced_acceptance(h, s, k)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path)
    ap.add_argument("--texts", nargs="+", default=["humaneval", "heldout"], choices=["humaneval", "heldout"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)  # batch-1 forwards: one thread beats two on a shared 2-core machine
    cfg = load_config(args.run / "config.yaml", [f"run_dir={args.run}", f"target.device={args.device}"])
    target, tokenizer = load_target(cfg.target)
    use_cpu_attention(target)
    draft = load_eval_draft(draft_dir(cfg), target)
    k, new = cfg.eval.k, cfg.eval.max_new_tokens
    report = {"run": str(args.run), "k": k, "answer_tokens": new, "target_dtype": cfg.target.dtype}
    if "humaneval" in args.texts:
        prompts = load_prompts(cfg.eval.prompts, cfg.eval.n_prompts, tokenizer)
        greedy = run_greedy(target, prompts, new, eos_token_ids(target, tokenizer))
        report["humaneval"] = {"samples": len(prompts), **on_own_outputs(draft, target, prompts, greedy["outputs"], k)}
    if "heldout" in args.texts:
        rows = heldout_rows(args.run, cfg.train.holdout_samples)
        report["heldout"] = on_heldout(draft, target, tokenizer, rows, new, k)
    print(f"{'text':<22} {'samples':>7} {'replayed':>9} {'rounds':>7} {'every_row':>10} {'first token (replayed, every row)':>34}")
    for text in ("humaneval", "heldout"):
        parts = {text: report[text]} if text == "humaneval" and text in report else {
            f"heldout {kind}": v for kind, v in report.get(text, {}).items()}
        for name, v in parts.items():
            r, e = v["replayed"], v["every_row"]
            print(f"{name:<22} {v['samples']:>7} {r['acceptance_length']:>9.3f} {r['rounds']:>7} "
                  f"{e['acceptance_length']:>10.3f} {r['per_position_acceptance'][0]:>17.2f} {e['per_position_acceptance'][0]:>6.2f}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
