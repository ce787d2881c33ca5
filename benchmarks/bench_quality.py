"""Benchmark: draft QUALITY of this project's trainer against SpecForge 0.2.0's training step, on
the same shards with the same batches, steps, learning-rate schedule and TTT length
(BENCHMARKS.md, "Trainer against SpecForge on the same shards").

RUN holds data, hidden and vocab (the first stages of CONFIG, e.g. configs/smollm2_gpu.yaml) and
is not changed: each training writes under OUT (default RUN/bench_quality), in a run directory
whose data, hidden and vocab link to RUN's.

  ours       eagleforge.train.loop.train(cfg): the trainer as `make train` runs it.
  specforge  SpecForge's own step: LlamaForCausalLMEagle3 in OnlineEagle3Model (flex_attention on
             a GPU, sdpa on the CPU), its compact teacher from the target's last hidden states and
             FULL lm_head, its loss (sum_j decay^j x step loss), its BF16Optimizer with the
             trainer's lr, weight decay, clip and lr schedule; the trainer's batches
             (`step_schedule`, its ShardSource and read-ahead worker) fed as SpecForge's offline
             pipeline feeds its step (input ids and target states shifted left by one).
             --specforge-mask aligned (the default) shifts the loss mask left by two so SpecForge
             scores the trainer's rows (row t at TTT step j predicts token t+2+j; SpecForge reads
             its mask at t+j); `own` passes it as SpecForge's pipeline does. Exported in
             docs/export.md's format.
  Both start from the trainer's initial draft for train.seed (train/build.py): a seed pairs the
  recipes. --seeds S... trains each once per seed; --summarize prints per row the seeds, mean, sd
  and the paired difference to a --baseline row. draft.fc_norm=true trains EAGLE-3.1 on both sides.

Both exports are measured alike: the trainer's held-out simulated acceptance at k = eval.k of the
EXPORTED draft (Trainer.evaluate, as train/loop.py finish() does), `python -m eagleforge.eval`'s
measured acceptance (unless --no-eval), the loop's seconds and the call's wall time.

    make bench-quality RUN=runs/smollm2_gpu CONFIG=configs/smollm2_gpu.yaml
    python benchmarks/bench_quality.py --summarize A.json B.json --baseline "specforge 0.2.0"
    python benchmarks/bench_quality.py --tiny      # the CPU check: embedded SmolLM2, a 16-prompt run, a few steps

Without SpecForge its row says so and ours still runs. On the CPU (--tiny) SpecForge's Triton
loss kernel cannot run: its loss is the same formula in plain torch (PlainLogSoftmaxLoss).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_common import ROOT, import_eagleforge, write_json  # noqa: E402

import_eagleforge()  # a bare checkout runs without `pip install -e .`

from eagleforge.config import Config, load_config  # noqa: E402
from eagleforge.draft import Eagle3Config, Eagle3Draft, expected_tensors, save_draft  # noqa: E402
from eagleforge.layout import Layout  # noqa: E402
from eagleforge.train.batching import Batch  # noqa: E402
from eagleforge.train.prefetch import Prefetcher  # noqa: E402
from eagleforge.train.schedule import Position, Schedule, step_slots  # noqa: E402
from eagleforge.train.sources import ShardSource  # noqa: E402

log = logging.getLogger("bench_quality")

RUN_LINKS = ("data", "hidden", "vocab")  # what a bench run directory borrows from RUN
# The --tiny run: the embedded SmolLM2-135M on the CPU, a run small enough for minutes.
TINY_PREPARE = ["data.num_prompts=16", "data.max_new_tokens=24", "vocab.draft_vocab_size=512", "train.holdout_samples=4"]
TINY_TRAIN = ["train.max_steps=6", "train.batch_tokens=1024", "train.holdout_samples=4", "train.ttt_steps=3",
              "train.save_every=0", "eval.n_prompts=2", "eval.max_new_tokens=16",
              "eval.k=3", "eval.reuse_ngram=false"]


# ----------------------------------------------------------------------------------------------
# The batches: one pure function of the run for both trainings
# ----------------------------------------------------------------------------------------------


def step_schedule(lengths, train_ids, batch_tokens: int, seed: int, epochs: int, max_steps: int,
                  batches_per_step: int) -> list[list[list[int]]]:
    """The trainer's optimizer steps, each the list of its global batches (lists of sample ids),
    in order: the trainer's own Schedule (train/schedule.py) of one process with grad_accum =
    batches_per_step."""
    if not train_ids:
        raise ValueError("step_schedule: no training samples")
    schedule = Schedule(lengths, train_ids, batch_tokens, seed, 1, batches_per_step, epochs, max_steps)
    return [step.batches for step in schedule.steps(Position(), 0, schedule.total_steps)]


# ----------------------------------------------------------------------------------------------
# SpecForge's side: the draft, its inputs, its weights in our export format
# ----------------------------------------------------------------------------------------------


class PlainLogSoftmaxLoss:
    """SpecForge's LogSoftmaxLoss (a Triton kernel, GPU only) as plain torch, for the CPU: its
    own reference formula (specforge.core.loss._compute_loss): -sum_v mask x p x log_softmax,
    averaged over all B x T rows. logits [B, T, Vd], target_p [B, T, Vd], position_mask [B, T, 1]."""

    @staticmethod
    def apply(logits: torch.Tensor, target_p: torch.Tensor, position_mask: torch.Tensor) -> torch.Tensor:
        return -(position_mask * target_p * F.log_softmax(logits.float(), dim=-1)).sum(-1).mean()


def use_plain_specforge_loss() -> None:
    """Make SpecForge's EAGLE-3 step run on the CPU (see PlainLogSoftmaxLoss)."""
    import specforge.algorithms.eagle3.model as sf_model

    sf_model.LogSoftmaxLoss = PlainLogSoftmaxLoss


def build_specforge_draft(initial: Eagle3Draft, d2t: torch.Tensor, t2d: torch.Tensor, embed_tokens: torch.Tensor,
                          attention_backend: str):
    """SpecForge's LlamaForCausalLMEagle3 of our draft's shape (its config built from our export
    config.json, Eagle3Config.to_hf_dict; `fc_norm` for EAGLE-3.1), starting from the trainer's
    initial weights `initial` (train/build.py, drawn under train.seed: both trainers start from the
    same draft, so a seed pairs recipes, not random draws), with the target's frozen input
    embedding [V, H] and RUN/vocab's d2t [Vd] / t2d [V]."""
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
    from transformers import LlamaConfig

    config = initial.config
    hf = config.to_hf_dict()
    llama = LlamaConfig(**{k: v for k, v in hf.items() if k not in ("architectures", "model_type")})
    llama.draft_vocab_size = config.draft_vocab_size
    llama.target_hidden_size = config.target_hidden_size
    llama.fc_norm = config.fc_norm  # SpecForge's EAGLE-3.1: a norm per aux state before fc
    # SpecForge 0.2.0 has no norm_before_residual, and reads norm_output otherwise than the engines
    # (a missing key: standard EAGLE-3): it would train another draft than ours.
    if config.norm_before_residual or config.norm_output:
        raise ValueError("SpecForge 0.2.0 cannot train draft.norm_before_residual / draft.norm_output drafts")
    llama.norm_output = True  # its meaning: logits from the normed state, the next step fed the un-normed one
    if config.num_aux_layers != 3:
        raise ValueError(f"SpecForge's draft reads 3 aux layers; this run's draft has {config.num_aux_layers}")
    draft = LlamaForCausalLMEagle3(llama, attention_backend=attention_backend)
    trained = specforge_export_tensors({**initial.state_dict(), "embed_tokens.weight": embed_tokens}, config)
    with torch.no_grad():
        missing, unexpected = draft.load_state_dict(trained, strict=False)
        assert not unexpected and set(missing) <= {"embed_tokens.weight", "d2t", "t2d"}, (missing, unexpected)
        draft.embed_tokens.weight.copy_(embed_tokens)
        draft.d2t.copy_(d2t.long())
        draft.t2d.copy_(t2d.bool())
    draft.embed_tokens.weight.requires_grad_(False)
    return draft


def specforge_export_tensors(state: dict[str, torch.Tensor], config: Eagle3Config) -> dict[str, torch.Tensor]:
    """SpecForge draft state dict -> this project's trained tensors (docs/export.md names).

    SpecForge's LlamaForCausalLMEagle3 uses the same names as the export (fc, midlayer.*, norm,
    lm_head); embed_tokens (the target's, not exported) and its own d2t/t2d buffers are left out
    (the export takes RUN/vocab's). Any other tensor (fc_norm, a second layer) has no place in
    the export: an error naming it."""
    expected = expected_tensors(config)
    wanted = {n for n in expected if n not in ("d2t", "t2d")}
    extra = set(state) - wanted - {"embed_tokens.weight", "d2t", "t2d"}
    missing = wanted - set(state)
    if extra or missing:
        raise ValueError(f"SpecForge draft: tensors without an export name {sorted(extra)}, missing {sorted(missing)}")
    out = {}
    for name in sorted(wanted):
        shape = expected[name][0]
        if tuple(state[name].shape) != shape:
            raise ValueError(f"SpecForge draft: {name} has shape {tuple(state[name].shape)}, the export needs {shape}")
        out[name] = state[name].detach()
    return out


def specforge_to_draft(state: dict[str, torch.Tensor], config: Eagle3Config, d2t: torch.Tensor,
                       t2d: torch.Tensor) -> Eagle3Draft:
    """Our Eagle3Draft (fp32, CPU) holding SpecForge's trained weights and RUN/vocab's map."""
    draft = Eagle3Draft(config)
    result = draft.load_state_dict({k: v.float().cpu() for k, v in specforge_export_tensors(state, config).items()},
                                   strict=False)
    assert set(result.missing_keys) <= {"embed_tokens.weight", "d2t", "t2d"}, result.missing_keys
    draft.set_vocab_map(d2t.cpu(), t2d.cpu())
    return draft


def specforge_inputs(batch: Batch, all_positions: bool, mask_mode: str) -> dict:
    """A padded Batch (on the device) -> SpecForge OnlineEagle3Model's keyword inputs, as its
    offline pipeline makes them (normalize_offline_sample + TargetHead.preprocess): input ids and
    the target's last states shifted left by one, the loss mask [B, T, 1] unshifted with each
    sample's last token zeroed (mask_mode "own"), or shifted left by two ("aligned": the rows the
    trainer scores). all_positions: every real position carries a loss (train.loss_positions=all)."""
    from specforge.utils import padding

    b, t = batch.input_ids.shape
    real = torch.arange(t, device=batch.input_ids.device)[None] < batch.lengths[:, None]  # [B, T]
    mask = real if all_positions else batch.loss_mask.bool() & real
    if mask_mode == "aligned":
        mask = F.pad(mask[:, 2:], (0, 2), value=False)
    elif mask_mode == "own":
        last = (batch.lengths - 1).clamp_min(0)
        mask = mask.clone()
        mask[torch.arange(b, device=mask.device), last] = False
    else:
        raise ValueError(f"specforge mask mode {mask_mode!r}: aligned | own")
    return {"input_ids": padding(batch.input_ids, left=False), "attention_mask": real,
            "loss_mask": mask[..., None].float(), "hidden_states": batch.aux_hidden_states,
            "target_hidden_for_compact": padding(batch.last_hidden_state, left=False), "target": None}


# ----------------------------------------------------------------------------------------------
# The two trainings
# ----------------------------------------------------------------------------------------------


def bench_run_dir(run: Path, source: Path) -> Path:
    """A fresh run directory whose data, hidden and vocab are links to `source`'s."""
    import shutil

    shutil.rmtree(run, ignore_errors=True)
    run.mkdir(parents=True)
    for name in RUN_LINKS:
        if (source / name).exists():
            (run / name).symlink_to((source / name).resolve(), target_is_directory=True)
    return run


def run_config(config_file: str | None, run: Path, overrides: list[str]) -> Config:
    return load_config(config_file, [*overrides, f"run_dir={run}", "train.resume=false"])


def train_ours(cfg: Config) -> dict:
    """The trainer end to end (train(cfg)); loop seconds from its own count (train_summary.json)."""
    from eagleforge.train.loop import train

    t0 = time.perf_counter()
    summary = train(cfg)
    wall = time.perf_counter() - t0
    rate = summary.get("train_tokens_per_s")
    return {"draft": str(cfg.run / "draft"), "steps": summary["steps"], "train_tokens": summary["train_tokens"],
            "train_s": summary["train_tokens"] / rate if rate else None, "wall_s": wall}


def train_specforge(cfg: Config, attention_backend: str, mask_mode: str) -> dict:
    """SpecForge's step over step_schedule's batches; exports cfg.run/draft in our format."""
    from specforge.algorithms.eagle3.model import OnlineEagle3Model
    from specforge.optimizer import BF16Optimizer

    from eagleforge.target.loading import target_path
    from eagleforge.train.build import build_draft
    from eagleforge.train.loop import MIN_LR_RATIO, WEIGHT_DECAY, lr_lambda
    from eagleforge.train.ttt_loss import STEP_WEIGHT_DECAY
    from eagleforge.vocab import load_target_head, load_vocab_map, read_target_head, training_sample_count

    t_start = time.perf_counter()
    tc = cfg.train
    device = torch.device("cuda" if tc.device in ("auto", "cuda") and torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # SpecForge trains bf16 weights on GPUs
    source = ShardSource(cfg.run / "hidden", Layout(device=device), tc.skip_corrupt_shards)
    vocab, head = load_vocab_map(cfg.run), load_target_head(cfg.run)
    initial = build_draft(cfg, source.manifest, vocab, head)  # the trainer's initial draft for train.seed
    config = initial.config
    full_head, _ = read_target_head(target_path(cfg.target), cfg.target)  # [V, Ht]: SpecForge's teacher
    n_train = training_sample_count(len(source), tc.holdout_samples, str(cfg.run / "hidden"))
    steps = step_schedule(source.sample_lengths(), list(range(n_train)), tc.batch_tokens, tc.seed, tc.epochs,
                          tc.max_steps, max(1, tc.grad_accum))

    draft = build_specforge_draft(initial, vocab["d2t"], vocab["t2d"], head["embed_tokens"], attention_backend)
    draft = draft.to(device, dtype)
    model = OnlineEagle3Model(draft, length=tc.ttt_steps, attention_backend=attention_backend)
    opt = BF16Optimizer(draft, lr=tc.lr, weight_decay=WEIGHT_DECAY, max_grad_norm=tc.grad_clip,
                        total_steps=len(steps), warmup_ratio=tc.warmup_ratio)
    for group in opt.optimizer.param_groups:  # the trainer's schedule in place of SpecForge's own
        group["lr"] = tc.lr
        group.pop("initial_lr", None)
    opt.scheduler = torch.optim.lr_scheduler.LambdaLR(opt.optimizer, lr_lambda(len(steps), tc.warmup_ratio, MIN_LR_RATIO))
    head_weight = full_head.to(device, dtype)
    all_positions = tc.loss_positions == "all"
    # read and padded a step ahead on one worker, as the trainer's feed does
    feed = Prefetcher(source.load, (slot for step in steps for slot in step_slots(step, 1)), max(1, tc.grad_accum), device)
    model.train()
    tokens, losses = 0, []
    t0 = time.perf_counter()
    try:
        for n, step_batches in enumerate(steps):
            step_loss = 0.0
            for ids in step_batches:
                slot, batch = feed.get()
                assert list(slot.read_of(0, 1)) == ids, (slot, ids)
                batch = batch.to(device, dtype)
                out = model(**specforge_inputs(batch, all_positions, mask_mode), target_head_weight=head_weight)
                loss = sum(STEP_WEIGHT_DECAY**j * step for j, step in enumerate(out[0])) / len(step_batches)
                loss.backward()
                step_loss += float(loss.detach()) if n % tc.log_every == 0 else 0.0
                tokens += batch.num_tokens
            opt.step()
            if n % tc.log_every == 0:
                losses.append(round(step_loss, 4))
                log.info("specforge step %d/%d: loss %.4f", n + 1, len(steps), step_loss)
        if device.type == "cuda":
            torch.cuda.synchronize()
        train_s = time.perf_counter() - t0
    finally:
        feed.close()
    ours = specforge_to_draft(draft.state_dict(), config, vocab["d2t"], vocab["t2d"])
    if ours.nonfinite_tensors():
        raise RuntimeError(f"SpecForge's trained draft holds NaN/Inf in {ours.nonfinite_tensors()[:4]}")
    save_draft(ours, cfg.run / "draft")
    return {"draft": str(cfg.run / "draft"), "steps": len(steps), "train_tokens": tokens, "train_s": train_s,
            "wall_s": time.perf_counter() - t_start, "losses_every_log_step": losses}


# ----------------------------------------------------------------------------------------------
# Measuring an export: held-out simulated acceptance, then the eval stage
# ----------------------------------------------------------------------------------------------


def heldout_acceptance(cfg: Config) -> dict:
    """Trainer.evaluate (train/loop.py finish()) on the held-out samples with the weights of the
    export cfg.run/draft; writes cfg.run/train_summary.json's held-out keys for the eval stage."""
    from safetensors.torch import load_file

    from eagleforge.atomic import write_json_atomic
    from eagleforge.train.loop import SUMMARY_NAME, Trainer

    tensors = load_file(str(cfg.run / "draft" / "model.safetensors"))
    trainer = Trainer(cfg)
    try:
        with torch.no_grad():
            trainer.draft.load_state_dict({k: v for k, v in tensors.items() if k not in ("d2t", "t2d")}, strict=False)
        stats = trainer.evaluate(trainer.heldout_ids)
    finally:
        trainer.close()
    k = min(cfg.eval.k, cfg.train.ttt_steps)
    heldout = {"tokens": stats.tokens, "accuracy_per_step": stats.accuracy_per_step(),
               "simulated_acceptance_length_by_k": {str(i): stats.acceptance_length(i) for i in range(1, cfg.train.ttt_steps + 1)}}
    path = cfg.run / SUMMARY_NAME
    summary = json.loads(path.read_text()) if path.is_file() else {"ttt_steps": cfg.train.ttt_steps}
    summary.update(heldout=heldout, simulated_acceptance_length=stats.acceptance_length(k), simulated_acceptance_length_k=k)
    write_json_atomic(path, summary, indent=1)
    return {"simulated_acceptance_length": stats.acceptance_length(k), "k": k, "heldout_tokens": stats.tokens,
            "accuracy_per_step": [round(a, 4) for a in stats.accuracy_per_step()]}


def eval_stage(config_file: str | None, run: Path, overrides: list[str], python: str) -> dict:
    """`python -m eagleforge.eval` on run/draft (its own process: the target loads and leaves)."""
    cmd = [python, "-m", "eagleforge.eval", *(["--config", config_file] if config_file else []), *overrides,
           f"run_dir={run}", f"eval.draft_path={run / 'draft'}"]
    log.info("%s", " ".join(cmd))
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))})
    results = json.loads((run / "eval" / "results.json").read_text())
    return {"acceptance_length": results["acceptance_length"], "k": results["k"], "n_prompts": results["n_prompts"],
            "ngram_acceptance_length": results["ngram_acceptance_length"], "eval_s": time.perf_counter() - t0}


# ----------------------------------------------------------------------------------------------


def fmt(value, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def print_table(rows: list[dict]) -> None:
    k = next((r.get("k") for r in rows if r.get("k")), "k")
    print(f"\n| row | seed | acceptance at k={k} (HumanEval) | simulated acceptance (held-out) | train s | wall s | steps |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['name']} | {r.get('seed', '-')} | {r['error']} | | | | |")
            continue
        print(f"| {r['name']} | {r.get('seed', '-')} | {fmt(r.get('acceptance_length'))} | {fmt(r.get('simulated_acceptance_length'))} | "
              f"{fmt(r.get('train_s'), '.1f')} | {fmt(r.get('wall_s'), '.1f')} | {r.get('steps', '-')} |")


def summarize(paths: list[Path], baseline: str | None, key: str = "simulated_acceptance_length") -> list[dict]:
    """One line per row label over the JSON reports at `paths`: each seed's figure, mean and sd,
    and the paired difference to `baseline` (the same seed's figure of that row), printed as a
    table; returns the lines."""
    import statistics

    by_row: dict[str, dict[int, float]] = {}
    for path in paths:
        for r in json.loads(Path(path).read_text())["rows"]:
            if r.get(key) is not None:
                by_row.setdefault(r["name"], {})[int(r.get("seed", 0))] = float(r[key])
    seeds = sorted({s for row in by_row.values() for s in row})
    base = by_row.get(baseline, {}) if baseline else {}
    lines = []
    print(f"\n| row | {' | '.join(f'seed {s}' for s in seeds)} | mean (sd) | paired vs {baseline or '-'} |")
    print(f"|---|{'---|' * len(seeds)}---|---|")
    for name, values in by_row.items():
        vals = [values[s] for s in seeds if s in values]
        mean = statistics.mean(vals)
        sd = statistics.stdev(vals) if len(vals) > 1 else None
        paired = [values[s] / base[s] - 1 for s in seeds if s in values and s in base]
        line = {"row": name, "by_seed": values, "mean": mean, "sd": sd,
                "paired": statistics.mean(paired) if paired and name != baseline else None}
        lines.append(line)
        cells = " | ".join(fmt(values.get(s)) for s in seeds)
        diff = "" if line["paired"] is None else f"{line['paired']:+.1%} ({', '.join(f'{p:+.1%}' for p in paired)})"
        print(f"| {name} | {cells} | {mean:.3f} ({fmt(sd)}) | {diff} |")
    return lines


def prepare_tiny_run(run: Path, python: str) -> None:
    """The data, extract and vocab stages of the embedded default at TINY_PREPARE's size (once)."""
    if (run / "vocab").is_dir() and (run / "hidden" / "manifest.json").is_file():
        return
    for stage in ("data", "extract", "vocab"):
        subprocess.run([python, "-m", f"eagleforge.{stage}", f"run_dir={run}", *TINY_PREPARE], check=True, cwd=ROOT)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=None, help="the run's config file (the one its stages ran with)")
    ap.add_argument("--run", type=Path, default=None, help="RUN holding data, hidden, vocab (not changed)")
    ap.add_argument("--out", type=Path, default=None, help="where the trainings go (default RUN/bench_quality)")
    ap.add_argument("--only", nargs="+", choices=["ours", "specforge"], default=["ours", "specforge"])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0], help="train.seed of each training (a seed pairs the "
                    "trainers: the same initial draft and batch order)")
    ap.add_argument("--label", default=None, help="the row's name in the report (default: eagleforge / specforge 0.2.0)")
    ap.add_argument("--specforge-attention", default=None, help="SpecForge's attention backend "
                    "(default flex_attention on a GPU, sdpa on the CPU)")
    ap.add_argument("--specforge-mask", choices=["aligned", "own"], default="aligned")
    ap.add_argument("--no-eval", action="store_true", help="skip the eval stage (speculative decoding)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--summarize", type=Path, nargs="+", default=None, help="print the table of these JSON reports "
                    "(per row label: each seed, mean, sd, paired difference to --baseline) and exit")
    ap.add_argument("--baseline", default=None, help="with --summarize: the row label the others are paired with")
    ap.add_argument("--tiny", action="store_true", help="CPU check of the script: embedded SmolLM2 on a tiny run")
    ap.add_argument("overrides", nargs="*", help="section.key=value for both trainings and evals")
    args = ap.parse_args(argv)
    if args.summarize:
        return {"lines": summarize(args.summarize, args.baseline)}
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    python = sys.executable
    overrides = list(args.overrides)
    if args.tiny:
        args.run = (args.run or Path("runs/bench_quality_tiny")).resolve()
        prepare_tiny_run(args.run, python)
        overrides = [*TINY_TRAIN, "train.device=cpu", "target.device=cpu", *overrides]
    if args.run is None:
        raise SystemExit("bench_quality: --run RUN is needed (a run holding data, hidden and vocab)")
    args.run = args.run.resolve()  # the stages below run from the repository root
    if args.config:
        args.config = str(Path(args.config).resolve())
    for name in ("hidden", "vocab"):
        if not (args.run / name).is_dir():
            raise SystemExit(f"bench_quality: {args.run / name} is missing; run the extract and vocab stages first")
    out = args.out or args.run / "bench_quality"
    report = {"run": str(args.run), "config": args.config, "overrides": overrides, "rows": []}

    for seed in args.seeds:
        for name in args.only:
            run = bench_run_dir(out / name / f"seed{seed}", args.run)
            cfg = run_config(args.config, run, [*overrides, f"train.seed={seed}"])
            label = args.label or ("eagleforge" if name == "ours" else "specforge 0.2.0")
            row = {"name": label if len(args.only) == 1 or args.label is None else f"{label} {name}", "seed": seed}
            try:
                if name == "ours":
                    row.update(train_ours(cfg))
                else:
                    try:
                        import specforge  # noqa: F401
                    except ImportError as err:
                        raise RuntimeError(f"specforge not installed ({err})") from None
                    on_gpu = torch.cuda.is_available() and cfg.train.device in ("auto", "cuda")
                    if not on_gpu:
                        use_plain_specforge_loss()
                    backend = args.specforge_attention or ("flex_attention" if on_gpu else "sdpa")
                    row.update(train_specforge(cfg, backend, args.specforge_mask), attention_backend=backend,
                               mask=args.specforge_mask)
                row.update(heldout_acceptance(cfg))
                if not args.no_eval:
                    row.update(eval_stage(args.config, run, overrides, python))
            except Exception as err:  # noqa: BLE001 - recorded; the other rows still run
                log.exception("%s failed", row["name"])
                row["error"] = repr(err)[:300]
            report["rows"].append(row)
            write_json(args.json, report)
    print_table(report["rows"])
    return report


if __name__ == "__main__":
    main()
