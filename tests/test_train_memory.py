"""CPU training over batches whose shape changes every step keeps its memory and its speed.

The train stage runs as `python -m eagleforge.train` in a fresh process (what `make train` runs),
a few hundred steps over samples of widely varying lengths, so nearly every batch has a new
shape. A wrapper records the process's anonymous resident memory and CPU time after each step.
Each new shape makes oneDNN compile kernels for it; at oneDNN's default cache capacities they
would stay cached (~0.45 MB each, up to 1024 per cache), the heap growing by about 1 GB here;
train/onednn.py bounds the caches.
"""

import json
import os
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

STEPS = 200
WARMUP = 40  # steps before the memory baseline: the draft, AdamW's moments, the caches' first fill
# Measured 2026-12-06 on the 2-core machine with another process busy on one core: 0.7 MB of growth
# and a CPU time per token 1.003x that after warm-up (unbounded oneDNN caches: about 1 GB of growth).
MAX_GROWTH_MB = 60  # anonymous resident memory from step WARMUP to the end
MAX_SLOWDOWN = 1.5  # CPU time per token of the last steps against the steps just after warm-up

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status (Linux)")

# Runs the train stage's command line in this process after wrapping Trainer.train_step to record,
# per step, RssAnon (kB) and the process's CPU seconds.
_RECORDER = textwrap.dedent("""
    import json, runpy, sys, time
    from eagleforge.train.loop import Trainer

    out, argv = sys.argv[1], sys.argv[2:]
    rows = []
    step = Trainer.train_step

    def recorded(self):
        start = time.process_time()
        result = step(self)
        float(result[1])  # the step's work done (its grad norm read back)
        with open("/proc/self/status") as f:
            anon = next(int(line.split()[1]) for line in f if line.startswith("RssAnon:"))
        rows.append({"rss_anon_kb": anon, "cpu_s": time.process_time() - start, "tokens": result[0].tokens})
        return result

    Trainer.train_step = recorded
    sys.argv = ["eagleforge.train", *argv]
    try:
        runpy.run_module("eagleforge.train", run_name="__main__")
    finally:
        with open(out, "w") as f:
            json.dump(rows, f)
""")


def _write_run(run: Path, n_samples: int = 400, seed: int = 0) -> None:
    """Shards of random hidden states for a small target config (no target weights needed: the
    manifest carries the config) and its vocabulary files; sample lengths 8..191."""
    from eagleforge.shards import ShardWriter
    from eagleforge.vocab import TARGET_HEAD, VOCAB_MAP, draft_to_target_ids, save_vocab_file, select_draft_vocab

    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
              "vocab_size": 512, "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0}
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    header = {"target": {"path": "none", "architecture": "LlamaForCausalLM", "num_layers": 8, "hidden_size": hidden,
                         "vocab_size": vocab, "config": config},
              "aux_layer_ids": [1, 3, 4], "tokenizer": "none", "chat_template": None, "max_length": 256,
              "has_target_argmax": True}
    writer = ShardWriter(run / "hidden", header, storage_dtype="bfloat16")
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(vocab, dtype=torch.int64)
    per_shard = 50
    for start in range(0, n_samples, per_shard):
        samples = []
        for _ in range(per_shard):
            n = int(torch.randint(8, 192, (1,), generator=g))
            ids = torch.randint(3, vocab, (n,), generator=g, dtype=torch.int32)
            mask = torch.ones(n, dtype=torch.uint8)
            counts += torch.bincount(ids.long(), minlength=vocab)
            samples.append({"input_ids": ids, "loss_mask": mask,
                            "aux_hidden_states": torch.randn(n, 3 * hidden, generator=g).bfloat16(),
                            "last_hidden_state": torch.randn(n, hidden, generator=g).bfloat16(),
                            "target_argmax": torch.cat([ids[1:], ids[:1]])})
        writer.write_shard(start // per_shard, samples, list(range(start, start + per_shard)))
    d2t, t2d = select_draft_vocab(counts, 128)
    head = torch.randn(vocab, hidden, generator=g) * 0.05
    meta = {"identity": "test", "format": "pt"}
    (run / "vocab").mkdir(parents=True)
    save_vocab_file({"d2t": d2t, "t2d": t2d, "counts": counts}, run / "vocab" / VOCAB_MAP, meta)
    save_vocab_file({"lm_head": head[draft_to_target_ids(d2t)], "embed_tokens": head}, run / "vocab" / TARGET_HEAD, meta)


def test_cpu_training_memory_and_speed_stay_flat_over_changing_shapes(tmp_path):
    run = tmp_path / "run"
    _write_run(run)
    out = tmp_path / "steps.json"
    script = tmp_path / "record.py"
    script.write_text(_RECORDER)
    # the product's defaults: no cache capacity from the caller's environment; one thread (tiny draft)
    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}
    env["OMP_NUM_THREADS"] = "1"
    args = [f"run_dir={run}", "train.device=cpu", f"train.max_steps={STEPS}", "train.batch_tokens=384",
            "train.ttt_steps=3", "train.holdout_samples=8", "train.log_every=50", "train.save_every=0",
            "launch.mode=none"]
    result = subprocess.run([sys.executable, str(script), str(out), *args], env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert len(rows) == STEPS

    anon_mb = [r["rss_anon_kb"] / 1024 for r in rows]
    growth = max(anon_mb[WARMUP:]) - anon_mb[WARMUP - 1]
    curve = " ".join(f"{s}:{anon_mb[s - 1]:.0f}" for s in range(WARMUP, STEPS + 1, 40))
    assert growth <= MAX_GROWTH_MB, f"anonymous RSS grew {growth:.0f} MB after step {WARMUP} (MB by step: {curve})"

    # CPU time per token of the steps just after warm-up against the last steps, each window's
    # 10th percentile: another process on the machine only adds time to a step (caches, memory
    # bandwidth, migrations), so the fast steps of a window are its own cost, while a median moves
    # with the neighbour's load, which may differ between the windows. A step that gets slower
    # (kernels compiled again and again) raises every step of the late window, its fast ones too.
    def fast(window):
        return statistics.quantiles([r["cpu_s"] / r["tokens"] for r in window], n=10)[0]

    early, late = fast(rows[WARMUP : WARMUP + 50]), fast(rows[-50:])
    print(f"anonymous RSS growth {growth:.1f} MB; CPU us per token {early * 1e6:.2f} -> {late * 1e6:.2f} ({late / early:.3f}x)")
    assert late <= MAX_SLOWDOWN * early, f"CPU us per token {early * 1e6:.2f} after warm-up, {late * 1e6:.2f} at the end"
