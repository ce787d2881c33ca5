"""eval.engine=vllm: the exported draft measured by vLLM (eval/vllm_engine.py, eval/vllm_worker.py).

Without vLLM: the metrics' arithmetic from vLLM's counters, the worker's request and answer as
the eval stage exchanges them (a stand-in worker), results.json's fields, the errors. With vLLM
(`make test-vllm`: its own environment, .venv-vllm, and a trained draft): the embedded default's
draft measured by vLLM and by the project's engine on the same 10 HumanEval prompts, and a small
EAGLE-3.1 (fc_norm) export, written by the test, run by both engines alike.
"""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from eagleforge.config import load_config
from eagleforge.errors import ConfigError
from eagleforge.eval import vllm_engine
from eagleforge.eval.vllm_worker import spec_decode_counters

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def private_ngram_cache(tmp_path, monkeypatch):
    from eagleforge.eval import evaluate

    monkeypatch.setattr(evaluate, "ngram_cache_dir", lambda: tmp_path / "ngram-cache")


def test_metrics_from_vllm_counters_follow_the_project_definition():
    """acceptance length = 1 + accepted / rounds = 1 + sum of the per-position rates; per-prompt
    figures from vLLM's per-request histograms add up to the counters."""
    histograms = [[3, 1, 0, 2], [0, 0, 1, 1], [5, 0, 0, 0]]  # rounds by accepted drafts 0..3
    rounds = sum(map(sum, histograms))
    per_pos = [sum(sum(h[i + 1:]) for h in histograms) for i in range(3)]
    accepted = sum(j * n for h in histograms for j, n in enumerate(h))
    answer = {"counters": {"num_drafts": rounds, "num_draft_tokens": 3 * rounds, "num_accepted_tokens": accepted,
                           "num_accepted_tokens_per_pos": per_pos},
              "outputs": [[1, 2, 3], [4], []], "wall_s": 2.0, "load_s": 5.0, "vllm_version": "0.32.0",
              "torch_version": "2.13.0+cpu", "device": "cpu",
              "per_prompt": [{"histogram": h, "num_draft_tokens": 3 * sum(h)} for h in histograms]}
    m = vllm_engine.vllm_metrics(answer, 3)
    assert m["rounds"] == rounds == 13 and m["accepted_tokens"] == accepted == 7 + 5
    assert m["acceptance_length"] == pytest.approx(1 + accepted / rounds) == pytest.approx(1 + sum(m["per_position_acceptance"]))
    assert m["per_position_acceptance"] == pytest.approx([5 / 13, 4 / 13, 3 / 13])
    assert m["draft_acceptance_rate"] == pytest.approx(accepted / (3 * rounds))
    assert m["per_prompt_acceptance_length"] == pytest.approx([1 + 7 / 6, 1 + 5 / 2, 1.0])
    assert m["generated_tokens"] == 4 and m["tokens_per_s"] == 2.0
    length, rates, n, acc = vllm_engine.rates_from_histogram([0, 0, 0, 0], 3)
    assert (length, rates, n, acc) == (1.0, [0.0, 0.0, 0.0], 0, 0)


def test_spec_decode_counters_from_get_metrics():
    """LLM.get_metrics() lists Counter (value) and Vector (values) objects; summed per name."""
    metric = lambda name, **kw: SimpleNamespace(name=name, labels={}, **kw)  # noqa: E731
    metrics = [metric("vllm:num_requests_running", value=0), metric("vllm:spec_decode_num_drafts", value=10),
               metric("vllm:spec_decode_num_drafts", value=2), metric("vllm:spec_decode_num_draft_tokens", value=60),
               metric("vllm:spec_decode_num_accepted_tokens", value=9),
               metric("vllm:spec_decode_num_accepted_tokens_per_pos", values=[5, 3, 1, 0, 0]),
               metric("vllm:spec_decode_num_accepted_tokens_per_pos", values=[0, 0, 0, 0, 0])]
    assert spec_decode_counters(metrics) == {"num_drafts": 12, "num_draft_tokens": 60, "num_accepted_tokens": 9,
                                             "num_accepted_tokens_per_pos": [5, 3, 1, 0, 0]}


def test_token_agreement():
    out = [[1, 2, 3, 4], [5, 6], [7, 8, 9], []]
    ref = [[1, 2, 3, 4], [5, 0], [7, 8], []]
    a = vllm_engine.token_agreement(out, ref)
    assert (a["identical"], a["rows"]) == (2, 4)
    assert a["first_difference"] == [None, 1, 2, None]
    assert a["positions"] == pytest.approx((4 + 1 + 2) / (4 + 2 + 3))
    assert a["prefix"] == pytest.approx((4 + 1 + 2) / (4 + 2 + 2))


def _stand_in_worker(tmp_path: Path, exit_code: int = 0) -> Path:
    """An executable that stands where vLLM's Python is: called as `PYTHON -I vllm_worker.py REQ ANS`,
    it keeps the request and answers with counters of 2 rounds per prompt (one accepting 1 draft,
    one accepting none) and, as outputs, the first 3 prompt tokens."""
    script = tmp_path / "fake_worker.py"
    script.write_text(f"""
import json, sys, os
assert sys.argv[1] == "-I" and sys.argv[2].endswith("vllm_worker.py"), sys.argv
request = json.load(open(sys.argv[3]))
json.dump(dict(request, cwd=os.getcwd()), open({str(tmp_path / "request_seen.json")!r}, "w"))
if {exit_code}:
    print("Traceback (most recent call last):\\nRuntimeError: Engine core initialization failed", file=sys.stderr)
    sys.exit({exit_code})
n, k = len(request["prompts"]), request["k"]
json.dump({{"vllm_version": "0.0-test", "torch_version": "x", "device": "cpu", "load_s": 1.0, "wall_s": 0.5,
           "outputs": [p[:3] for p in request["prompts"]], "finish_reasons": ["length"] * n,
           "counters": {{"num_drafts": 2 * n, "num_draft_tokens": 2 * n * k, "num_accepted_tokens": n,
                         "num_accepted_tokens_per_pos": [n] + [0] * (k - 1)}},
           "per_prompt": [{{"histogram": [1, 1] + [0] * (k - 1), "num_draft_tokens": 2 * k}}] * n}}, open(sys.argv[4], "w"))
""")
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\nexec {sys.executable} {script} \"$@\"\n")
    python.chmod(python.stat().st_mode | stat.S_IEXEC)
    return python


def _random_draft(target_dir, out_dir):
    from transformers import AutoConfig

    from eagleforge.draft import Eagle3Config, Eagle3Draft, save_draft

    torch.manual_seed(0)
    config = Eagle3Config.from_target_config(AutoConfig.from_pretrained(target_dir), 1000, [1, 14, 26])
    draft = Eagle3Draft(config)
    ids = torch.randperm(config.vocab_size)[:1000].sort().values
    t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    draft.set_vocab_map(ids - torch.arange(1000), t2d)
    save_draft(draft, out_dir)


def test_eval_stage_with_engine_vllm_exchanges_the_request_and_answer(tmp_path):
    """The stage sends vLLM's worker the project's prompts (token ids), stop ids, k, dtype and
    directories, from an empty working directory, and results.json gets vLLM's figures beside the
    project's (whose fields stay as they were) and how the outputs agree."""
    from eagleforge.eval.evaluate import load_prompts, main
    from eagleforge.target.loading import embedded_target_dir, load_tokenizer

    target = embedded_target_dir()
    run = tmp_path / "run"
    _random_draft(target, run / "draft")
    python = _stand_in_worker(tmp_path)
    cfg = load_config(None, [f"run_dir={run}", "target.device=cpu", "target.dtype=float32", "eval.n_prompts=2",
                             "eval.max_new_tokens=4", "eval.k=3", "eval.engine=vllm", f"eval.vllm_python={python}"])
    results = main(cfg)
    seen = json.loads((tmp_path / "request_seen.json").read_text())
    prompts = load_prompts("humaneval", 2, load_tokenizer(cfg.target))
    assert seen["prompts"] == [p["input_ids"] for p in prompts]
    assert (seen["k"], seen["max_new_tokens"], seen["stop_token_ids"], seen["dtype"]) == (3, 4, [2], "float32")
    assert seen["target"] == str(target) and seen["draft"] == str(run / "draft") and seen["max_num_seqs"] == 1
    assert seen["max_model_len"] >= max(len(p["input_ids"]) for p in prompts) + 4 + 3
    assert not Path(seen["cwd"]).is_relative_to(REPO) and not os.path.exists(seen["cwd"])  # a temporary directory, removed
    written = json.loads((run / "eval" / "results.json").read_text())
    assert written["engine"] == "vllm" and written["acceptance_length"] == results["eagle"]["acceptance_length"]
    v = written["vllm"]
    assert v["acceptance_length"] == written["vllm_acceptance_length"] == pytest.approx(1.5)
    assert v["per_position_acceptance"] == written["vllm_per_position_acceptance"] == pytest.approx([0.5, 0.0, 0.0])
    assert written["acceptance_gap_vllm_minus_project"] == pytest.approx(1.5 - written["acceptance_length"])
    assert v["rounds"] == 4 and v["per_prompt_acceptance_length"] == [1.5, 1.5] and v["vllm_version"] == "0.0-test"
    agreement = v["outputs_vs_project"]
    assert agreement["rows"] == 2 and agreement["identical"] == 0 and len(agreement["mismatched_prompts"]) == 2
    assert v["log"] == str(run / "eval" / "vllm.log")


def test_engine_vllm_errors_are_one_line(tmp_path, monkeypatch):
    from eagleforge.eval.vllm_engine import VllmError, run_worker, vllm_python

    with pytest.raises(ConfigError, match=r"'eval.engine' must be one of \['project', 'vllm'\]"):
        load_config(None, ["eval.engine=sglang"])
    with pytest.raises(ConfigError, match=r"'eval.vllm_batch' must be in"):
        load_config(None, ["eval.vllm_batch=0"])
    monkeypatch.delenv(vllm_engine.PYTHON_ENV, raising=False)
    monkeypatch.chdir(tmp_path)  # no .venv-vllm here
    monkeypatch.setattr(vllm_engine, "_vllm_importable", lambda: False)
    with pytest.raises(VllmError, match=r"^eval.engine=vllm needs vLLM in its own environment: `make vllm-env`"):
        vllm_python(load_config(None, ["eval.engine=vllm"]))
    with pytest.raises(VllmError, match=r"^eval.vllm_python: no such Python: /nowhere/python"):
        vllm_python(load_config(None, ["eval.vllm_python=/nowhere/python"]))
    python = _stand_in_worker(tmp_path, exit_code=3)
    with pytest.raises(VllmError) as err:
        run_worker(str(python), {"prompts": [[1]], "k": 1}, tmp_path / "eval" / "vllm.log")
    assert str(err.value) == (f"vLLM exited with code 3: RuntimeError: Engine core initialization failed "
                              f"(log: {tmp_path / 'eval' / 'vllm.log'})")


# ------------------------------------------------------------------------------------------------
# With vLLM


def _vllm_python_or_skip() -> str:
    python = os.environ.get("EAGLEFORGE_VLLM_PYTHON", "")
    if not python or not Path(python).is_file():
        pytest.skip("runs vLLM, minutes on a CPU: `make test-vllm` makes vLLM's environment (.venv-vllm) and runs it "
                    f"(EAGLEFORGE_VLLM_PYTHON={python or 'unset'})")
    return python


def _trained_run_or_skip() -> Path:
    run = Path(os.environ.get("EAGLEFORGE_TEST_RUN") or REPO / "runs" / "default")
    if not (run / "draft" / "config.json").is_file():
        pytest.skip(f"no trained draft at {run / 'draft'}: `make test-vllm` trains the embedded default's first "
                    "(make extract train), or set EAGLEFORGE_TEST_RUN to a run directory with one")
    return run


@pytest.mark.slow
def test_vllm_measures_the_trained_draft_as_the_project_does(tmp_path, capsys):
    """The embedded default's trained draft (RUN/draft) through vLLM's eagle3 method and through
    the project's engine on the same 10 HumanEval prompts, float32, k = 5: vLLM's acceptance length
    within 7% of the project's, and vLLM's greedy output the target's greedy output (the project's
    engine's output equals plain greedy decoding, tests/test_specdec.py) token for token."""
    from eagleforge.eval.evaluate import main

    python, run = _vllm_python_or_skip(), _trained_run_or_skip()
    cfg = load_config(None, [f"run_dir={tmp_path / 'run'}", f"eval.draft_path={run / 'draft'}", "target.device=cpu",
                             "target.dtype=float32", "eval.n_prompts=10", "eval.k=5", "eval.engine=vllm", f"eval.vllm_python={python}"])
    results = main(cfg)
    project, v = results["eagle"], results["vllm"]
    agreement = v["outputs_vs_project"]
    with capsys.disabled():
        print(f"\nvLLM {v['vllm_version']} vs project on {run / 'draft'} (10 HumanEval prompts, k=5, float32): acceptance length "
              f"{v['acceptance_length']:.3f} vs {project['acceptance_length']:.3f} ({v['rounds']} vs {project['rounds']} rounds), "
              f"per position {[round(r, 3) for r in v['per_position_acceptance']]} vs "
              f"{[round(r, 3) for r in project['per_position_acceptance']]}; outputs identical on {agreement['identical']}/10 prompts "
              f"({agreement['positions']:.1%} of positions); vLLM {v['total_s']:.0f} s with its start, project {project['wall_s']:.0f} s")
    assert project["acceptance_length"] > 1.1  # a trained draft: the comparison means something
    assert abs(v["acceptance_length"] - project["acceptance_length"]) <= 0.07 * project["acceptance_length"]
    assert v["generated_tokens"] == project["generated_tokens"]
    assert agreement["identical"] == 10, agreement


def _eagle31_draft(target_dir, prompts: list[list[int]], out_dir, vocab: int = 64) -> None:
    """A small random EAGLE-3.1 export for the target: "fc_norm": true, fc_norm.{0,1,2}.weight
    far from 1 (each aux state's scale decides the proposals), and a draft vocabulary of the
    `vocab` most frequent ids of `prompts` (random proposals among them are sometimes accepted,
    so the acceptance counters compare the two engines' proposals)."""
    from safetensors import safe_open
    from transformers import AutoConfig

    from eagleforge.draft import Eagle3Config, Eagle3Draft, save_draft

    config = Eagle3Config.from_target_config(AutoConfig.from_pretrained(target_dir), vocab, [1, 14, 26], fc_norm=True)
    counts = torch.bincount(torch.tensor([i for p in prompts for i in p]), minlength=config.vocab_size)
    ids = counts.topk(vocab).indices.sort().values
    torch.manual_seed(0)
    draft = Eagle3Draft(config)
    draft.reset_parameters(std=0.05)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for norm in draft.fc_norm:
            norm.weight.copy_(0.2 + 2 * torch.rand(config.target_hidden_size, generator=g))
    t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    draft.set_vocab_map(ids - torch.arange(vocab), t2d)
    save_draft(draft, out_dir)
    assert json.loads((out_dir / "config.json").read_text())["fc_norm"] is True
    with safe_open(str(out_dir / "model.safetensors"), framework="pt") as f:
        assert {f"fc_norm.{i}.weight" for i in range(3)} <= set(f.keys())


@pytest.mark.slow
def test_vllm_runs_an_eagle31_fc_norm_draft_as_the_project_does(tmp_path, capsys):
    """An EAGLE-3.1 export (fc_norm) written here for the embedded target: vLLM loads it unchanged
    (its loader refuses fc_norm weights unless config.json says "fc_norm": true) and its
    speculative decoding gives the project's engine's output token for token (the target's
    greedy output) and the same acceptance counters: the same proposals accepted at the same
    positions, which a draft run without its fc_norm weights would not give. 10 HumanEval
    prompts, float32, k = 3."""
    from eagleforge.eval.evaluate import load_prompts, main
    from eagleforge.target.loading import embedded_target_dir, load_tokenizer

    python = _vllm_python_or_skip()
    cfg = load_config(None, [f"run_dir={tmp_path / 'run'}", f"eval.draft_path={tmp_path / 'draft'}", "target.device=cpu",
                             "target.dtype=float32", "eval.n_prompts=10", "eval.k=3", "eval.max_new_tokens=48",
                             "eval.engine=vllm", f"eval.vllm_python={python}"])
    prompts = [p["input_ids"] for p in load_prompts(cfg.eval.prompts, cfg.eval.n_prompts, load_tokenizer(cfg.target))]
    _eagle31_draft(embedded_target_dir(), prompts, tmp_path / "draft")
    results = main(cfg)
    project, v = results["eagle"], results["vllm"]
    agreement = v["outputs_vs_project"]
    with capsys.disabled():
        print(f"\nvLLM {v['vllm_version']} vs project on an EAGLE-3.1 (fc_norm) draft (10 HumanEval prompts, k=3, float32): "
              f"accepted {v['accepted_tokens']} vs {project['accepted_tokens']} tokens in {v['rounds']} vs {project['rounds']} "
              f"rounds, per position {[round(r, 4) for r in v['per_position_acceptance']]} vs "
              f"{[round(r, 4) for r in project['per_position_acceptance']]}; outputs identical on {agreement['identical']}/10")
    assert agreement["identical"] == 10, agreement
    assert project["accepted_tokens"] > 0  # some proposals accepted: the counters compare proposals
    assert (v["rounds"], v["accepted_tokens"]) == (project["rounds"], project["accepted_tokens"])
    assert v["per_position_acceptance"] == pytest.approx(project["per_position_acceptance"], abs=1e-12)
