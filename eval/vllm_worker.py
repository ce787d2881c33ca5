"""vLLM's side of `eval.engine=vllm`: speculative decoding of token-id prompts by vLLM's offline
engine (`LLM`, the `eagle3` method), greedy, answered as JSON. Needs only vllm and the standard
library, because it runs in vLLM's own environment (`make vllm-env`: .venv-vllm), never in
eagleforge's; eval/vllm_engine.py starts it and reads its answer.

    python -I vllm_worker.py REQUEST.json ANSWER.json

REQUEST.json (every key required unless noted):

    target          a plain HF directory (config.json, safetensors, tokenizer)
    draft           an exported EAGLE-3 draft directory (docs/export.md), or null: the target alone
    k               num_speculative_tokens
    max_new_tokens  per prompt (SamplingParams.max_tokens)
    prompts         list of prompts, each a list of token ids (no tokenization here)
    stop_token_ids  ids that end an answer (the stop token is part of the answer, as in the project's eval)
    dtype           float32 | bfloat16 | float16
    max_model_len   the engine's context (prompt + answer + k fits)
    max_num_seqs    optional: requests decoded at once (1 = one at a time, as the project's engine); default 16
    enforce_eager   optional: no graph capture or compilation; default true on a CPU build, false elsewhere

ANSWER.json:

    vllm_version, torch_version, device ("cpu" | "cuda"), load_s, wall_s
    outputs         per prompt, the generated ids (the stop token included when it ended the answer)
    finish_reasons  per prompt, "stop" | "length"
    counters        the engine's spec-decode counters over the whole run: num_drafts, num_draft_tokens,
                    num_accepted_tokens, num_accepted_tokens_per_pos (list of k); null without a draft
    per_prompt      per prompt, {"histogram": rounds by accepted drafts 0..k, "num_draft_tokens"}
                    (vLLM's per-request spec-decode metrics), or null where vLLM has none

Run with `-I` from an empty directory: neither this script's folder (eval/, whose module names such
as evaluate.py could stand for installed distributions) nor the working directory, nor the user's
PYTHONPATH, comes before vLLM's own environment on sys.path.
"""

from __future__ import annotations

import json
import os
import sys
import time

COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


def spec_decode_counters(metrics) -> dict:
    """{num_drafts, num_draft_tokens, num_accepted_tokens, num_accepted_tokens_per_pos} from
    `LLM.get_metrics()` (counters summed over engines and label sets)."""
    out = {name: 0 for name in COUNTERS}
    per_pos: list[int] = []
    for metric in metrics:
        name = metric.name.removeprefix("vllm:spec_decode_").removesuffix("_total")
        if name in COUNTERS:
            out[name] += int(metric.value)
        elif name == "num_accepted_tokens_per_pos":
            values = list(metric.values)
            per_pos = [a + b for a, b in zip(per_pos, values)] + values[len(per_pos):] if per_pos else values
    out["num_accepted_tokens_per_pos"] = [int(v) for v in per_pos]
    return out


def _engine(request: dict):
    from vllm import LLM
    from vllm.platforms import current_platform

    cpu = current_platform.device_type == "cpu"
    kwargs = dict(
        model=request["target"], tokenizer=request["target"], dtype=request["dtype"],
        max_model_len=int(request["max_model_len"]), max_num_seqs=int(request.get("max_num_seqs") or 16),
        enforce_eager=bool(request.get("enforce_eager", cpu)), seed=0, disable_log_stats=False,
    )
    if request.get("draft"):
        kwargs["speculative_config"] = {"method": "eagle3", "model": request["draft"], "num_speculative_tokens": int(request["k"])}
        kwargs["per_request_spec_decode_metrics"] = "summary"
    return LLM(**kwargs), ("cpu" if cpu else "cuda")


def run(request: dict) -> dict:
    from importlib.metadata import version

    import vllm
    from vllm import SamplingParams, TokensPrompt

    start = time.perf_counter()
    llm, device = _engine(request)
    load_s = time.perf_counter() - start
    params = SamplingParams(temperature=0.0, max_tokens=int(request["max_new_tokens"]), stop_token_ids=list(request["stop_token_ids"]),
                            detokenize=False)
    prompts = [TokensPrompt(prompt_token_ids=list(ids)) for ids in request["prompts"]]
    start = time.perf_counter()
    results = llm.generate(prompts, params, use_tqdm=True)
    wall_s = time.perf_counter() - start
    outputs, reasons, per_prompt = [], [], []
    for result in results:
        completion = result.outputs[0]
        outputs.append([int(t) for t in completion.token_ids])
        reasons.append(completion.finish_reason)
        metrics = getattr(completion, "spec_decode_metrics", None)
        per_prompt.append(None if metrics is None else {"histogram": list(metrics.histogram), "num_draft_tokens": int(metrics.num_draft_tokens)})
    return {
        "vllm_version": vllm.__version__, "torch_version": version("torch"), "device": device,
        "load_s": load_s, "wall_s": wall_s, "outputs": outputs, "finish_reasons": reasons,
        "counters": spec_decode_counters(llm.get_metrics()) if request.get("draft") else None,
        "per_prompt": per_prompt if request.get("draft") and all(p is not None for p in per_prompt) else None,
    }


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(f"usage: {argv[0]} REQUEST.json ANSWER.json", file=sys.stderr)
        return 2
    with open(argv[1], encoding="utf-8") as f:
        request = json.load(f)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on a CPU build (its default takes 4+)
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    answer = run(request)
    tmp = argv[2] + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(answer, f)
    os.replace(tmp, argv[2])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
