"""Every shipped config's training recipe makes every trainable tensor learn.

For each config in configs/ (and the built-in default): the tiny real pipeline (random Llama
target -> shards -> vocab) trained a few steps with that config's learning rate, schedule,
AdamW betas, weight decay, clipping and the parameter dtype CUDA resolves it to (run on the CPU
through the same code: bf16 weights, the GEMM-accumulated bf16 gradients, the optimizer's exact
fp32 masters), against the same steps with fp32 parameters. Every trainable tensor, RMSNorm gains
included, must move, and in the direction the fp32 run moves it. bf16 weights with bf16 AdamW
moments (the recipe before) left the norm gains at 1.0 and at the Kimi configs' lr 5e-5 most
weights where they started.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_train_distributed import _clone_run, _configure
from test_vocab import build_tiny_run

pytestmark = pytest.mark.usefixtures("one_torch_thread")

REPO = Path(__file__).resolve().parents[1]
SHIPPED = [None, "configs/smollm2_gpu.yaml", "configs/kimi_k25_pilot.yaml", "configs/kimi_k25_b300.yaml"]
RECIPE_KEYS = ("lr", "warmup_ratio", "adam_beta2", "grad_clip", "bf16")
STEPS = 4


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    from transformers import LlamaConfig

    from eagleforge.vocab import main as vocab_main

    config = LlamaConfig(vocab_size=157, hidden_size=40, intermediate_size=72, num_hidden_layers=7, num_attention_heads=5,
                         num_key_value_heads=1, head_dim=8, max_position_embeddings=256, rms_norm_eps=1e-5,
                         tie_word_embeddings=False, pad_token_id=0, eos_token_id=2, bos_token_id=1)
    cfg, _, _ = build_tiny_run(tmp_path_factory.mktemp("recipes"), config, n_samples=20, with_argmax=True, seed=7)
    _configure(cfg)
    vocab_main(cfg)
    return cfg


def _masters_after(cfg, steps: int) -> tuple[dict, dict]:
    """({name: fp32 weight} before and after `steps` optimizer steps of the Trainer): for bf16
    parameters the optimizer's fp32 master (the weight joined with its remainder)."""
    from eagleforge.kernels.master_adamw import join_master
    from eagleforge.train.loop import Trainer

    trainer = Trainer(cfg)
    try:
        named = [(n, p) for n, p in trainer.draft.named_parameters() if p.requires_grad]
        before = {n: p.detach().float().clone() for n, p in named}
        for _ in range(steps):
            trainer.train_step()
        after = {}
        for name, param in named:
            state = trainer.optimizer.state[param]
            after[name] = join_master(param.detach(), state["master_remainder"]) if "master_remainder" in state else param.detach().float()
        return before, after
    finally:
        trainer.close()


@pytest.mark.parametrize("config_file", SHIPPED, ids=lambda f: Path(f).stem if f else "default")
def test_shipped_recipe_moves_every_tensor_like_fp32(config_file, base, tmp_path):
    from eagleforge.config import load_config
    from eagleforge.train.step_plan import resolve_param_dtype

    shipped = load_config(str(REPO / config_file) if config_file else None, []).train
    recipe = {key: getattr(shipped, key) for key in RECIPE_KEYS}
    on_cuda = str(resolve_param_dtype(shipped, torch.device("cuda"), "none")).removeprefix("torch.")
    runs = {}
    for label, dtype in (("shipped", on_cuda), ("fp32", "float32")):
        cfg = _clone_run(base, f"{Path(config_file or 'default').stem}-{label}", **recipe, param_dtype=dtype, epochs=1,
                         max_steps=STEPS, device="cpu")
        runs[label] = _masters_after(cfg, STEPS)
    (start, shipped_end), (fp32_start, fp32_end) = runs["shipped"], runs["fp32"]
    assert any("norm" in name for name in start) and "fc.weight" in start and "lm_head.weight" in start
    for name in start:
        moved = shipped_end[name] - start[name]
        reference = fp32_end[name] - fp32_start[name]
        changed = float((moved != 0).float().mean())
        assert changed > 0.99, f"{config_file}: {name}: only {changed:.1%} of its elements moved at lr {recipe['lr']}"
        cosine = float(torch.nn.functional.cosine_similarity(moved.flatten(), reference.flatten(), dim=0))
        assert cosine > 0.9, f"{config_file}: {name}: its update points elsewhere than fp32's (cosine {cosine:.3f})"
