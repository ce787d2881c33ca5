"""Tiny training runs for the tests: variants of the train options, each trained from a copy of
the same base run (shards and vocab; build_tiny_run in test_vocab.py makes one)."""

import csv
import shutil


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
