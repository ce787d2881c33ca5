"""No folder of the repository hides an installed distribution from a Python started in its root.

Python puts the working directory first on sys.path (`python -m`, `python -c`, pytest under
`python -m pytest`, every torchrun worker), so a root folder with an `__init__.py` is the
top-level package of that name there. transformers (5.25 on) imports Hugging Face's `kernels`
from `transformers.activations`; a root `kernels/` package broke every stage. The stage folders
hold no `__init__.py` (eagleforge/__init__.py says how they load); these tests run what a user
runs, in the root, with the real `kernels` distribution installed (the test extra declares it)
and stand-in distributions named like the other stage folders.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from eagleforge import STAGE_PACKAGES

REPO = Path(__file__).resolve().parents[1]
ENTRY_MODULES = ("eagleforge.data.__main__", "eagleforge.extract.__main__", "eagleforge.vocab", "eagleforge.train.__main__",
                 "eagleforge.eval.__main__", "eagleforge.extract.native.plan", "eagleforge.extract.native.preflight")


@pytest.fixture
def stand_ins(tmp_path):
    """A folder of installed-looking packages `draft`, `extract`, `train` and `eval`, each with a
    marker naming itself (as a future dependency of that name would be), for PYTHONPATH."""
    site = tmp_path / "site"
    for name in STAGE_PACKAGES:
        if name == "kernels":  # the real distribution stands for itself
            continue
        (site / name).mkdir(parents=True)
        (site / name / "__init__.py").write_text(f"MARKER = 'installed {name}'\n")
    return site


def _run_in_root(args, site, timeout=300, **kw):
    env = dict(os.environ, PYTHONPATH=str(site), OMP_NUM_THREADS="1")
    env.pop("PYTHONSAFEPATH", None)  # the root first on sys.path, as Python 3.10 always has it
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout, **kw)


def test_no_root_folder_is_a_package():
    packages = sorted(p.parent.name for p in REPO.glob("*/__init__.py"))
    assert packages == ["eagleforge"], f"root folders with an __init__.py shadow distributions of their name: {packages}"


def test_installed_distributions_win_in_the_root(stand_ins):
    kernels_dist = pytest.importorskip("importlib.metadata").distribution("kernels")  # raises if the test extra is missing
    code = textwrap.dedent(f"""
        import importlib, json, sys
        import transformers.activations  # imports Hugging Face's `kernels` (transformers >= 5.25)
        from transformers import AutoModelForCausalLM, LlamaConfig
        AutoModelForCausalLM.from_config(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                                     num_attention_heads=2, num_key_value_heads=1))
        import kernels
        found = {{"kernels": kernels.__file__}}
        for name in {[n for n in STAGE_PACKAGES if n != "kernels"]!r}:
            found[name] = importlib.import_module(name).MARKER
        for name in {ENTRY_MODULES!r}:
            importlib.import_module(name)
        from eagleforge.draft import Eagle3Draft
        from eagleforge.kernels import fused_soft_cross_entropy
        found["stages"] = {{n: importlib.import_module("eagleforge." + n).__file__ for n in {STAGE_PACKAGES!r}}}
        print(json.dumps(found))
    """)
    proc = _run_in_root(["-c", code], stand_ins)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert Path(found["kernels"]).is_relative_to(Path(kernels_dist.locate_file(""))), found["kernels"]
    assert not Path(found["kernels"]).is_relative_to(REPO / "kernels")
    for name in STAGE_PACKAGES:
        if name != "kernels":
            assert found[name] == f"installed {name}"
        assert Path(found["stages"][name]) == REPO / name / "package.py"


def test_first_stage_runs_in_the_root(tmp_path, stand_ins):
    """The tiny CPU pipeline's first stage (three prompts answered by the embedded target) as
    `python -m eagleforge.data` in the root, beside the stand-ins."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("Name a color.", "Add 2 and 3.", "Say hi.")))
    run = tmp_path / "run"
    proc = _run_in_root(["-m", "eagleforge.data", f"run_dir={run}", f"data.source={prompts}", "target.device=cpu",
                         "data.max_new_tokens=4", "data.gen_batch_size=3"], stand_ins)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "data" / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all(sum(r["loss_mask"]) > 0 for r in rows)
