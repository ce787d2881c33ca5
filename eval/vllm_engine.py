"""eval.engine=vllm: the exported draft measured by vLLM itself (docs/eval-results.md, "vLLM").

vLLM pins its own torch and transformers, so it lives in an environment of its own (`make vllm-env`
makes .venv-vllm) and never in eagleforge's. This module runs eval/vllm_worker.py with that
environment's Python in a subprocess: the request (target directory, draft directory, k, the eval's
prompts as token ids, its stop ids, dtype) goes in as JSON, vLLM's outputs and spec-decode counters
come back as JSON, and `vllm_metrics` turns them into the eval's acceptance figures (the same
definition as the project's engine: acceptance length = 1 + accepted / rounds).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from eagleforge.config import Config
from eagleforge.errors import UserInputError
from eagleforge.readers import read_json_object

log = logging.getLogger(__name__)

WORKER = Path(__file__).with_name("vllm_worker.py")
PYTHON_ENV = "EAGLEFORGE_VLLM_PYTHON"
DEFAULT_VENV = Path(".venv-vllm")
LOG_FILE = "vllm.log"


class VllmError(UserInputError):
    """vLLM is missing or failed: one line naming the cause and the log."""


def vllm_python(cfg: Config) -> str:
    """The Python of vLLM's environment: eval.vllm_python, else $EAGLEFORGE_VLLM_PYTHON, else
    .venv-vllm/bin/python in the working directory (what `make vllm-env` makes), else this Python
    when it imports vllm."""
    for where, value in (("eval.vllm_python", cfg.eval.vllm_python), (PYTHON_ENV, os.environ.get(PYTHON_ENV, ""))):
        if value:
            if not Path(value).is_file():
                raise VllmError(f"{where}: no such Python: {value} (make vllm-env makes {DEFAULT_VENV}/bin/python)")
            return value
    default = DEFAULT_VENV / "bin" / "python"
    if default.is_file():
        return str(default.absolute())
    if _vllm_importable():
        return sys.executable
    raise VllmError(f"eval.engine=vllm needs vLLM in its own environment: `make vllm-env` makes {DEFAULT_VENV} "
                    f"(or set eval.vllm_python=PATH to a Python that imports vllm)")


def _vllm_importable() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def stop_ids_of(target_dir: Path, tokenizer) -> list[int]:
    """The ids that end an answer, as the project's engine takes them (eval/specdec.py
    eos_token_ids): generation_config.json's eos_token_id, else the tokenizer's eos."""
    path = Path(target_dir) / "generation_config.json"
    ids = None
    if path.is_file():
        ids = read_json_object(path, "a generation config").get("eos_token_id")
    if ids is None:
        ids = tokenizer.eos_token_id
    if ids is None:
        return []
    return sorted({int(i) for i in ids} if isinstance(ids, (list, tuple)) else {int(ids)})


def run_worker(python: str, request: dict, log_path: Path, timeout_s: float | None = None) -> dict:
    """Run vllm_worker.py with `python` on `request`; its answer. vLLM's output goes to log_path.

    The worker starts in an empty temporary directory with -I (no script directory, working
    directory or PYTHONPATH on sys.path: vLLM's environment alone), in a session of its own, so that the whole process group (vLLM's engine core and
    workers) is ended if this process is interrupted or the timeout passes.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="eagleforge-vllm-") as tmp:
        request_path, answer_path = Path(tmp) / "request.json", Path(tmp) / "answer.json"
        request_path.write_text(json.dumps(request), encoding="utf-8")
        with open(log_path, "wb") as out:
            process = subprocess.Popen([python, "-I", str(WORKER), str(request_path), str(answer_path)], cwd=tmp,
                                       stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                code = process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                end_process_group(process)
                raise VllmError(f"vLLM did not finish within {timeout_s:g} s (log: {log_path})") from None
            except BaseException:
                end_process_group(process)
                raise
        if code != 0 or not answer_path.is_file():
            raise VllmError(f"vLLM exited with code {code}: {_last_error(log_path)} (log: {log_path})")
        return json.loads(answer_path.read_text(encoding="utf-8"))


def end_process_group(process: subprocess.Popen, first: int = signal.SIGTERM, grace_s: float = 20) -> None:
    """`first` to the process's group (started with start_new_session; SIGTERM lets the vLLM
    worker shut its engine down, SIGINT does the same for `vllm serve`), SIGKILL after `grace_s`."""
    for sig, wait in ((first, grace_s), (signal.SIGKILL, 10)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _last_error(log_path: Path) -> str:
    """The log's last line that names an error (a Python exception's last line), else its last line."""
    try:
        lines = [line.strip() for line in log_path.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip()]
    except OSError:
        return "no log"
    for line in reversed(lines):
        if "Error" in line.split(":", 1)[0] or line.startswith(("error", "ERROR")):
            return line[:400]
    return lines[-1][:400] if lines else "no output"


def request_for(cfg: Config, target_dir: Path, draft_path: Path, prompts: list[dict], stop_ids: list[int]) -> dict:
    k, max_new = cfg.eval.k, cfg.eval.max_new_tokens
    longest = max(len(p["input_ids"]) for p in prompts)
    return {
        "target": str(Path(target_dir).absolute()), "draft": str(Path(draft_path).absolute()), "k": k,
        "max_new_tokens": max_new, "prompts": [p["input_ids"] for p in prompts], "stop_token_ids": stop_ids,
        "dtype": cfg.target.dtype, "max_model_len": longest + max_new + 2 * k + 16, "max_num_seqs": cfg.eval.vllm_batch,
    }


def rates_from_histogram(histogram: list[int], k: int) -> tuple[float, list[float], int, int]:
    """(acceptance length, per-position rates, rounds, accepted) from rounds counted by how many
    drafts they accepted (histogram[j], j = 0..k)."""
    rounds = sum(histogram)
    accepted = sum(j * n for j, n in enumerate(histogram))
    per_pos = [sum(histogram[i + 1:]) / rounds if rounds else 0.0 for i in range(k)]
    return (1.0 + accepted / rounds if rounds else 1.0), per_pos, rounds, accepted


def vllm_metrics(answer: dict, k: int) -> dict:
    """The eval's metrics (acceptance_metrics' fields) from vLLM's spec-decode counters: over the
    rounds that had a draft (num_drafts), acceptance length = 1 + accepted / rounds and the rate of
    position i = (rounds that accepted position i) / rounds."""
    c = answer["counters"]
    rounds, accepted = c["num_drafts"], c["num_accepted_tokens"]
    per_pos = [n / rounds if rounds else 0.0 for n in (c["num_accepted_tokens_per_pos"] + [0] * k)[:k]]
    generated = sum(len(o) for o in answer["outputs"])
    per_prompt = None
    if answer.get("per_prompt"):
        per_prompt = [rates_from_histogram(p["histogram"], k)[0] for p in answer["per_prompt"]]
    return {
        "acceptance_length": 1.0 + accepted / rounds if rounds else 1.0,
        "per_position_acceptance": per_pos,
        "rounds": rounds,
        "draft_tokens": c["num_draft_tokens"],
        "accepted_tokens": accepted,
        "draft_acceptance_rate": accepted / c["num_draft_tokens"] if c["num_draft_tokens"] else 0.0,
        "per_prompt_acceptance_length": per_prompt,
        "generated_tokens": generated,
        "wall_s": answer["wall_s"],
        "load_s": answer["load_s"],
        "tokens_per_s": generated / answer["wall_s"] if answer["wall_s"] > 0 else None,
        "vllm_version": answer["vllm_version"],
        "torch_version": answer["torch_version"],
        "device": answer["device"],
    }


def token_agreement(outputs: list[list[int]], reference: list[list[int]]) -> dict:
    """How far two engines' greedy outputs agree, prompt by prompt: `identical` rows, `positions`
    (share of token positions, over the longer of each pair, holding the same id), `prefix`
    (share of the reference's tokens before the first difference) and `first_difference` (token
    index per row, null where the rows are identical)."""
    positions = agreed = prefix = ref_tokens = 0
    first = []
    for out, ref in zip(outputs, reference, strict=True):
        positions += max(len(out), len(ref))
        agreed += sum(a == b for a, b in zip(out, ref))
        same = next((i for i, (a, b) in enumerate(zip(out, ref)) if a != b), min(len(out), len(ref)))
        first.append(None if out == ref else same)
        prefix += same
        ref_tokens += len(ref)
    return {"identical": sum(f is None for f in first), "rows": len(first), "positions": agreed / positions if positions else 1.0,
            "prefix": prefix / ref_tokens if ref_tokens else 1.0, "first_difference": first}


def measure(cfg: Config, target_dir: Path, draft_path: Path, prompts: list[dict], stop_ids: list[int], out_dir: Path,
            timeout_s: float | None = None) -> dict:
    """vLLM's speculative decoding of the eval's prompts with the exported draft: the metrics
    (vllm_metrics) and its outputs ("outputs"), vLLM's log in out_dir/vllm.log."""
    if cfg.target.gguf_file:
        raise VllmError("eval.engine=vllm needs target.path to be a plain HF directory, not a GGUF file (target.gguf_file): "
                        "convert it once with transformers' from_pretrained(..., gguf_file=...) and save_pretrained")
    python = vllm_python(cfg)
    log_path = out_dir / LOG_FILE
    request = request_for(cfg, target_dir, draft_path, prompts, stop_ids)
    print(f"eval vllm: {len(prompts)} prompts, k={cfg.eval.k}, {cfg.target.dtype}, by {python} (log: {log_path})", flush=True)
    start = time.perf_counter()
    answer = run_worker(python, request, log_path, timeout_s)
    metrics = vllm_metrics(answer, cfg.eval.k)
    metrics.update(dtype=cfg.target.dtype, batch=cfg.eval.vllm_batch, total_s=time.perf_counter() - start, log=str(log_path))
    print(f"eval vllm: acceptance length {metrics['acceptance_length']:.3f} ({metrics['rounds']} rounds), vLLM {answer['vllm_version']} "
          f"on {answer['device']}, {metrics['total_s']:.0f} s with its start", flush=True)
    return {"metrics": metrics, "outputs": answer["outputs"], "finish_reasons": answer["finish_reasons"]}
