"""The eval stage end to end on a tiny setup: SmolLM2 target, a random exported draft, two
HumanEval prompts, a few new tokens. Checks results.json (every field docs/eval-results.md requires,
and their arithmetic), the PNGs, the greedy-equality record, prompt loading and the CLI errors."""

from __future__ import annotations

import csv
import gzip
import json
import os
import subprocess
import sys

import pytest
import torch

from eagleforge.config import load_config

REQUIRED = (
    "acceptance_length", "k", "n_prompts", "max_new_tokens", "per_position_acceptance",
    "ngram_acceptance_length", "ngram_per_position_acceptance", "simulated_acceptance_length",
    "acceptance_gap_measured_minus_simulated", "target", "draft", "wall_s", "tokens_per_s",
    "ngram_wall_s", "ngram_tokens_per_s",
)
HELDOUT_ACC = [0.7, 0.55, 0.5, 0.4, 0.3, 0.2, 0.1]  # 7 TTT steps


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Decoding is many tiny forwards: one thread beats two on a shared 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def private_ngram_cache(tmp_path, monkeypatch):
    """Each test its own n-gram result store (never the user's ~/.cache)."""
    from eagleforge.eval import evaluate

    monkeypatch.setattr(evaluate, "ngram_cache_dir", lambda: tmp_path / "ngram-cache")
    return tmp_path / "ngram-cache"


def test_ngram_baseline_is_reused_only_for_the_same_inputs(smollm2, private_ngram_cache, caplog):
    from eagleforge.eval.evaluate import load_prompts, ngram_baseline
    from eagleforge.eval.specdec import eos_token_ids

    model, tokenizer = smollm2
    prompts = load_prompts("humaneval", 2, tokenizer)
    eos = eos_token_ids(model, tokenizer)

    def run(*overrides):
        cfg = load_config(None, ["target.device=cpu", "target.dtype=float32", "eval.max_new_tokens=6", "eval.k=2", *overrides])
        return ngram_baseline(cfg, model, prompts, eos)

    first = run()
    assert "cached_from" not in first["metrics"] and len(list(private_ngram_cache.glob("*.json"))) == 1
    again = run()
    assert again["metrics"].pop("cached_from").startswith(str(private_ngram_cache))
    assert again == json.loads(json.dumps(first))  # the same metrics and outputs, as stored
    other_k = run("eval.k=3")  # another k: computed, stored beside the first
    assert "cached_from" not in other_k["metrics"] and len(list(private_ngram_cache.glob("*.json"))) == 2
    assert "cached_from" not in run("eval.reuse_ngram=false")["metrics"]
    for path in private_ngram_cache.glob("*.json"):
        path.write_text("{not json")
    with caplog.at_level("WARNING"):
        redone = run()
    assert "cached_from" not in redone["metrics"] and "unreadable n-gram result" in caplog.text
    assert redone["outputs"] == first["outputs"]


def _export_random_draft(model, out_dir, draft_vocab_size=5003):
    from eagleforge.draft import Eagle3Config, Eagle3Draft, save_draft

    torch.manual_seed(0)
    config = Eagle3Config.from_target_config(model.config, draft_vocab_size, [1, 14, 26])
    draft = Eagle3Draft(config)
    ids = torch.randperm(config.vocab_size)[:draft_vocab_size].sort().values
    t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    draft.set_vocab_map(ids - torch.arange(draft_vocab_size), t2d)
    save_draft(draft, out_dir)


def _write_training_outputs(run_dir):
    """A train_summary.json and train_log.csv shaped like the trainer's (train/loop.py)."""
    summary = {"steps": 30, "ttt_steps": 7, "heldout": {"accuracy_per_step": HELDOUT_ACC}, "simulated_acceptance_length": 9.9,
               "simulated_acceptance_length_k": 3}
    (run_dir / "train_summary.json").write_text(json.dumps(summary))
    columns = ["step", "epoch", "loss", "lr", "grad_norm", "tokens_per_s", "simulated_acceptance_length"]
    columns += [f"acc_{j}" for j in range(7)] + [f"loss_{j}" for j in range(7)]
    with open(run_dir / "train_log.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        for step in range(10, 40, 10):
            row = {"step": step, "epoch": 0, "loss": 9.0 / step, "lr": 1e-4, "grad_norm": 0.4, "tokens_per_s": 100.0,
                   "simulated_acceptance_length": 1 + step / 40}
            row.update({f"acc_{j}": step / 50 / (j + 1) for j in range(7)})
            row.update({f"loss_{j}": 5.0 / step + j for j in range(7)})
            writer.writerow(row)


def _assert_png(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 2000, path


def test_eval_stage_end_to_end(smollm2, tmp_path):
    from eagleforge.eval.evaluate import main

    model, _ = smollm2
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    _export_random_draft(model, run_dir / "draft")
    _write_training_outputs(run_dir)
    cfg = load_config(None, [f"run_dir={run_dir}", "target.device=cpu", "eval.n_prompts=2", "eval.max_new_tokens=7", "eval.k=3"])
    cfg.eval.check_greedy = True  # not an EvalConfig field yet: read with getattr
    main(cfg)

    results = json.loads((run_dir / "eval" / "results.json").read_text())
    missing = [key for key in REQUIRED if key not in results]
    assert not missing, missing
    assert results["k"] == 3 and results["n_prompts"] == 2 and results["max_new_tokens"] == 7
    for prefix in ("", "ngram_"):
        rates = results[f"{prefix}per_position_acceptance"]
        assert len(rates) == 3 and all(0.0 <= r <= 1.0 for r in rates)
        assert rates == sorted(rates, reverse=True)  # position i+1 accepted only after position i
        assert results[f"{prefix}acceptance_length"] == pytest.approx(1 + sum(rates))
        assert results[f"{prefix}tokens_per_s"] > 0
    a = HELDOUT_ACC
    expected_sim = 1 + a[0] + a[0] * a[1] + a[0] * a[1] * a[2]
    assert results["simulated_acceptance_length"] == pytest.approx(expected_sim)
    assert results["acceptance_gap_measured_minus_simulated"] == pytest.approx(results["acceptance_length"] - expected_sim)
    for forced in results["teacher_forced"].values():  # the draft on the eval's own outputs
        assert forced["rounds"] > 0 and len(forced["per_position_acceptance"]) == 3
        assert forced["acceptance_length"] == pytest.approx(1 + sum(forced["per_position_acceptance"]))
    assert results["draft"] == str(run_dir / "draft")
    assert results["equals_greedy"] is True
    assert results["eagle_mismatched_prompts"] == [] and results["ngram_mismatched_prompts"] == []
    assert results["eagle"]["generated_tokens"] == results["ngram"]["generated_tokens"] <= 2 * 7
    for drafter in ("eagle", "ngram"):  # the copyable / novel split partitions the rounds
        kinds = results[drafter]["by_position_kind"]
        assert kinds["copyable"]["rounds"] + kinds["novel"]["rounds"] == results[drafter]["rounds"]
        assert kinds["copyable"]["share_of_rounds"] + kinds["novel"]["share_of_rounds"] == pytest.approx(1.0)
    assert (run_dir / "config.yaml").is_file()
    _assert_png(run_dir / "eval" / "acceptance_per_position.png")
    _assert_png(run_dir / "eval" / "training_curves.png")
    _assert_png(run_dir / "eval" / "acceptance_curve.png")
    names = ("acceptance_per_position.png", "training_curves.png", "acceptance_curve.csv", "acceptance_curve.png")
    assert sorted(results["plots"]) == sorted(str(run_dir / "eval" / n) for n in names)


def test_humaneval_prompts_through_chat_template(smollm2):
    from eagleforge.eval.evaluate import humaneval_path, load_prompts

    _, tokenizer = smollm2
    prompts = load_prompts("humaneval", 3, tokenizer)
    with gzip.open(humaneval_path(), "rt") as f:
        rows = [json.loads(line) for line in f]
    assert len(rows) == 164 and [p["id"] for p in prompts] == [r["task_id"] for r in rows[:3]]
    reference = tokenizer.apply_chat_template(
        [{"role": "user", "content": rows[1]["prompt"]}], add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    assert prompts[1]["input_ids"] == list(reference)


def test_prompt_jsonl_rows_and_errors(smollm2, tmp_path):
    from eagleforge.errors import UserInputError
    from eagleforge.eval.evaluate import chat_prompt_ids, load_prompts

    _, tokenizer = smollm2
    path = tmp_path / "prompts.jsonl"
    rows = [
        {"prompt": "Say hi."},
        {"conversations": [{"from": "human", "value": "Add 2 and 3."}, {"from": "gpt", "value": "5"}]},
        {"input_ids": [1, 2, 3, 4]},
        {"prompt": "never read: n_prompts=3"},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    prompts = load_prompts(str(path), 3, tokenizer)
    assert [p["input_ids"] for p in prompts] == [
        chat_prompt_ids(tokenizer, [{"role": "user", "content": "Say hi."}]),
        chat_prompt_ids(tokenizer, [{"role": "user", "content": "Add 2 and 3."}]),  # assistant turn cut
        [1, 2, 3, 4],
    ]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"text": "no prompt key"}\n')
    with pytest.raises(UserInputError, match=r"bad.jsonl:2"):
        load_prompts(str(bad), 5, tokenizer)
    with pytest.raises(FileNotFoundError, match="eval.prompts"):
        load_prompts(str(tmp_path / "missing.jsonl"), 1, tokenizer)


def test_cli_missing_draft_is_one_line_exit_2(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "eagleforge.eval", f"run_dir={tmp_path}", "target.device=cpu"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("error: run_dir: no exported draft at")
    assert "Traceback" not in proc.stderr


def _rewrite_config(draft_dir, edit) -> None:
    path = draft_dir / "config.json"
    path.write_text(json.dumps(edit(json.loads(path.read_text()))))


def test_eval_checks_the_draft_against_the_engines_first(tmp_path):
    """The eval stage runs `python -m eagleforge.export check` first: a draft that an engine would
    run on other layers (here the ids only in eagle_config, which vLLM 0.32 reads as layer inputs)
    is one error line and exit 2 before the target is loaded."""
    from transformers import AutoConfig

    from eagleforge.draft import Eagle3Config, Eagle3Draft, save_draft
    from eagleforge.target.loading import embedded_target_dir

    config = Eagle3Config.from_target_config(AutoConfig.from_pretrained(embedded_target_dir()), 64, [1, 14, 26])
    draft = tmp_path / "run" / "draft"
    save_draft(Eagle3Draft(config), draft)
    _rewrite_config(draft, lambda hf: {k: v for k, v in hf.items() if k != "eagle_aux_hidden_state_layer_ids"})
    proc = subprocess.run(
        [sys.executable, "-m", "eagleforge.eval", f"run_dir={tmp_path / 'run'}", "target.device=cpu"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: {draft}: vLLM 0.32.0 captures the inputs of layers [1, 14, 26] (no top-level ids: eagle_config's, as layer "
        "inputs) but the draft was trained on the outputs of [1, 14, 26], the inputs of [2, 15, 27]; write top-level "
        f"eagle_aux_hidden_state_layer_ids [2, 15, 27]; not evaluated (python -m eagleforge.export check {draft} --target "
        f"{embedded_target_dir() / 'config.json'})")
    assert "Traceback" not in proc.stderr


def test_eval_stage_runs_a_draft_naming_no_aux_layers(smollm2, tmp_path):
    """A draft naming no aux layers (as vLLM's example drafts ship; the engines capture the
    target's defaults, here the layers it was made for) and without t2d is evaluated."""
    from safetensors.torch import load_file, save_file

    from eagleforge.eval.evaluate import main

    model, _ = smollm2
    draft = tmp_path / "run" / "draft"
    _export_random_draft(model, draft)
    _rewrite_config(draft, lambda hf: {k: v for k, v in hf.items() if k not in ("eagle_aux_hidden_state_layer_ids", "eagle_config")})
    tensors = load_file(str(draft / "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if k != "t2d"}, str(draft / "model.safetensors"), metadata={"format": "pt"})
    cfg = load_config(None, [f"run_dir={tmp_path / 'run'}", "target.device=cpu", "eval.n_prompts=1", "eval.max_new_tokens=4", "eval.k=2"])
    results = main(cfg)
    assert results["eagle"]["rounds"] > 0 and results["draft"] == str(draft)


def test_acceptance_curve_per_epoch(tmp_path):
    """Last logged row of each epoch -> 1 + sum_j prod_{i<=j} acc_i, tokens = step * tokens/step."""
    import random

    from eagleforge.eval.plots import acceptance_curve

    rng = random.Random(3)
    rows, expected = [], {}
    for step in range(7, 7 * 11, 7):  # 10 logged rows over 3 epochs
        epoch = (step - 1) // 25
        acc = [rng.random() for _ in range(6)]
        rows.append([step, epoch] + acc)
        length, running = 1.0, 1.0
        for a in acc[:4]:
            running *= a
            length += running
        expected[epoch] = (step, length)
    path = tmp_path / "train_log.csv"
    path.write_text("step,epoch," + ",".join(f"acc_{j}" for j in range(6)) + "\n"
                    + "".join(",".join(map(str, r)) + "\n" for r in rows), encoding="utf-8")
    curve = acceptance_curve(path, train_tokens=9100, steps=70, k=4)
    assert [c["epoch"] for c in curve] == sorted(expected)
    for c in curve:
        step, length = expected[c["epoch"]]
        assert c["step"] == step and c["training_tokens"] == step * 130
        assert abs(c["simulated_acceptance_length_k4"] - length) < 1e-12
    assert acceptance_curve(path, None, None, k=7) == []  # the log has only 6 TTT steps
    assert acceptance_curve(tmp_path / "missing.csv", None, None, k=4) == []
