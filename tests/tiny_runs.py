"""Tiny training runs for the tests: variants of the train options, each trained from a copy of
the same base run (shards and vocab; build_tiny_run in test_vocab.py makes one), and a training
process killed at a checkpoint."""

import csv
import shutil
import signal
import time

TINY_TRAINING = dict(ttt_steps=3, lr=3e-3, log_every=1)  # what every tiny training run shares


def write_tiny_llama(path):
    """A tiny random Llama target (7 layers, hidden 48, vocab 211) with the embedded default's
    tokenizer, written as a Hugging Face directory at `path`; returns path."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from eagleforge.target.loading import embedded_target_dir

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=211, hidden_size=48, intermediate_size=80, num_hidden_layers=7, num_attention_heads=3,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=256, tie_word_embeddings=False,
        pad_token_id=0, eos_token_id=2, bos_token_id=1,
    )
    LlamaForCausalLM(config).save_pretrained(path)
    AutoTokenizer.from_pretrained(embedded_target_dir()).save_pretrained(path)
    return path


def configure(cfg, **train):
    """cfg set up for a tiny training run: a 60-id draft vocabulary, 3 TTT steps, k = 2, the
    shared train keys, then `train` (key: value) on top; returns cfg."""
    cfg.vocab.draft_vocab_size = 60
    cfg.eval.k = 2
    for key, value in {**TINY_TRAINING, **train}.items():
        setattr(cfg.train, key, value)
    return cfg


def train_variants(cfg, base, tmp_path, variants: dict) -> dict:
    """For each name -> {train key: value}: a copy of `base` at tmp_path / name (no checkpoints,
    draft or logs), cfg.train updated with those values (they stay set for the next variants),
    trained; -> {name: [train_log.csv's loss per row]}."""
    from eagleforge.train.loop import train

    losses = {}
    for name, options in variants.items():
        run = tmp_path / name
        shutil.copytree(base, run, ignore=shutil.ignore_patterns("checkpoints", "draft", "train_log.csv", "train_summary.json"))
        cfg.run_dir = str(run)
        for key, value in options.items():
            setattr(cfg.train, key, value)
        train(cfg)
        with open(run / "train_log.csv", newline="") as f:
            losses[name] = [float(r["loss"]) for r in csv.DictReader(f)]
    return losses


def wait_for_checkpoint(process, run, step: str, timeout_s: float) -> None:
    """Wait while `process` (a training started with stderr=PIPE) runs until the checkpoint `step`
    of `run` is published; fails with the end of its stderr if it exits first, or at the deadline."""
    deadline = time.monotonic() + timeout_s
    while not (run / "checkpoints" / step / "state.json").is_file():
        assert process.poll() is None, process.stderr.read()[-3000:]
        assert time.monotonic() < deadline, f"no checkpoint {step} written"
        time.sleep(0.005)


def sigkill_at_checkpoint(process, run, step: str, timeout_s: float) -> None:
    """SIGKILL `process` right after it publishes the checkpoint `step` (wherever it then is)."""
    try:
        wait_for_checkpoint(process, run, step, timeout_s)
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == -signal.SIGKILL
