"""The TTT trainer on a tiny real pipeline: random Llama target -> shards -> vocab -> train -> export."""

import csv
import json
import math
import re
import shutil

import pytest
import torch
from test_vocab import build_tiny_run
from tiny_runs import configure, train_variants

from eagleforge.train.batching import collate
from eagleforge.train.loop import lr_lambda
from eagleforge.train.metrics import simulated_acceptance_length
from eagleforge.train.schedule import make_batches
from eagleforge.train.ttt_loss import target_argmax_from_hidden

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models: one thread is faster


def _configure(cfg, **train):
    return configure(cfg, **{"batch_tokens": 160, "warmup_ratio": 0.05, "holdout_samples": 4, **train})


def _log_rows(run):
    with open(run / "train_log.csv", newline="") as f:
        return list(csv.DictReader(f))


def test_batches_deterministic_bounded_and_complete():
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 90, (203,), generator=g).tolist()
    ids = list(range(180))  # the rest held out
    a = make_batches(lengths, ids, 256, seed=3, epoch=1)
    assert a == make_batches(lengths, ids, 256, seed=3, epoch=1)
    assert a != make_batches(lengths, ids, 256, seed=3, epoch=2)
    assert sorted(i for b in a for i in b) == ids
    assert all(max(lengths[i] for i in b) * len(b) <= 256 for b in a)
    # a sample longer than the budget forms its own batch
    lone = make_batches([5, 400, 7], [0, 1, 2], 64, seed=0, epoch=0)
    assert [1] in lone and sorted(i for b in lone for i in b) == [0, 1, 2]


def test_collate_pads_with_masked_zeros():
    s = [
        {"input_ids": torch.tensor([4, 5, 6], dtype=torch.int32), "loss_mask": torch.tensor([0, 1, 1], dtype=torch.uint8),
         "aux_hidden_states": torch.randn(3, 6).bfloat16(), "last_hidden_state": torch.randn(3, 2).bfloat16(),
         "target_argmax": torch.tensor([1, 2, 3], dtype=torch.int32)},
        {"input_ids": torch.tensor([7], dtype=torch.int32), "loss_mask": torch.tensor([1], dtype=torch.uint8),
         "aux_hidden_states": torch.randn(1, 6).bfloat16(), "last_hidden_state": torch.randn(1, 2).bfloat16(),
         "target_argmax": torch.tensor([9], dtype=torch.int32)},
    ]
    b = collate(s)
    assert b.input_ids.tolist() == [[4, 5, 6], [7, 0, 0]]
    assert b.loss_mask.tolist() == [[False, True, True], [True, False, False]]
    assert b.aux_hidden_states.dtype == torch.float32 and torch.all(b.aux_hidden_states[1, 1:] == 0)
    assert torch.equal(b.aux_hidden_states[0], s[0]["aux_hidden_states"].float())
    assert torch.equal(b.last_hidden_state[1, :1], s[1]["last_hidden_state"].float()) and not b.last_hidden_state[1, 1:].any()
    assert b.target_argmax.tolist() == [[1, 2, 3], [9, 0, 0]]
    assert b.lengths.tolist() == [3, 1] and b.num_tokens == 4
    # samples stored in different dtypes: the batch holds each exactly (no rounding to the first's)
    s[1]["aux_hidden_states"] = torch.randn(1, 6, dtype=torch.float64)
    assert torch.equal(collate(s, dtype=torch.float64).aux_hidden_states[1, :1], s[1]["aux_hidden_states"])


def test_lr_schedule_and_acceptance_formula():
    f = lr_lambda(100, 0.1, 0.1)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(10) == pytest.approx(1.0) and f(100) == pytest.approx(0.1)
    assert f(55) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert simulated_acceptance_length([0.5, 0.5, 1.0], 3) == pytest.approx(1 + 0.5 + 0.25 + 0.25)
    assert simulated_acceptance_length([0.9, 0.8], 1) == pytest.approx(1.9)


def test_target_argmax_fallback_matches_target(tmp_path, tiny_llama_config):
    cfg, model, samples = build_tiny_run(tmp_path, tiny_llama_config, n_samples=3, with_argmax=True)
    last = torch.stack([s["last_hidden_state"][:9] for s in samples])  # [3, 9, H] fp32, exact
    got = target_argmax_from_hidden(last, model.lm_head.weight.detach())
    want = torch.stack([s["target_argmax"][:9] for s in samples]).long()
    assert torch.equal(got, want)


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """A run trained for 24 steps with checkpoints at 8, 16, 24, shared by the tests below. The
    shards lack target_argmax, so the trainer's fallback (full target head) is exercised too."""
    from transformers import LlamaConfig

    from eagleforge.train.__main__ import main as train_main
    from eagleforge.vocab import main as vocab_main

    config = LlamaConfig(  # conftest's tiny_llama_config (a function-scoped fixture)
        vocab_size=211, hidden_size=48, intermediate_size=80, num_hidden_layers=7,
        num_attention_heads=3, num_key_value_heads=1, head_dim=16, max_position_embeddings=256,
        rms_norm_eps=1e-5, tie_word_embeddings=False, pad_token_id=0, eos_token_id=2, bos_token_id=1,
    )
    tmp = tmp_path_factory.mktemp("trained")
    cfg, model, _ = build_tiny_run(tmp, config, n_samples=28, with_argmax=False)
    _configure(cfg, max_steps=24, save_every=8, keep_last=5)
    vocab_main(cfg)
    train_main(cfg)
    return cfg, model


def test_loss_falls_and_export_loads(trained_run):
    torch.manual_seed(0)
    from eagleforge.draft import EXPORT_TENSOR_NAMES, load_draft
    from eagleforge.vocab import load_target_head

    cfg, model = trained_run
    rows = _log_rows(cfg.run)
    assert [int(r["step"]) for r in rows] == list(range(1, 25))
    first = sum(float(r["loss"]) for r in rows[:4]) / 4
    last = sum(float(r["loss"]) for r in rows[-4:]) / 4
    assert last < 0.7 * first, (first, last)
    for key in ("lr", "grad_norm", "tokens_per_s", "simulated_acceptance_length", "acc_2", "loss_0"):
        assert key in rows[0]

    summary = json.loads((cfg.run / "train_summary.json").read_text())
    assert summary["steps"] == 24 and summary["heldout_samples"] == 4
    assert len(summary["heldout"]["accuracy_per_step"]) == 3
    acc = summary["heldout"]["accuracy_per_step"]
    assert summary["simulated_acceptance_length"] == pytest.approx(1 + acc[0] + acc[0] * acc[1])
    assert summary["simulated_acceptance_length_k"] == 2

    from safetensors import safe_open

    with safe_open(str(cfg.run / "draft" / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    # the default draft is EAGLE-3.1: the export's names plus a norm per aux state
    fc_norms = {f"fc_norm.{i}.weight" for i in range(3)}
    assert names <= set(EXPORT_TENSOR_NAMES) | fc_norms and fc_norms <= names
    assert "embed_tokens.weight" not in names and "d2t" in names
    embed = load_target_head(cfg.run)["embed_tokens"]
    draft = load_draft(cfg.run / "draft", embed_tokens=embed)
    assert draft.lm_head.weight.shape == (60, 48)
    # the export holds the trained weights (bf16-rounded) of the final checkpoint
    from eagleforge.train.checkpoint import load_model_weights

    ckpt = load_model_weights(cfg.run / "checkpoints" / "step-000024")
    torch.testing.assert_close(draft.fc.weight, ckpt["fc.weight"].bfloat16().float())
    assert torch.equal(draft.d2t, ckpt["d2t"])


def test_resume_gives_the_same_next_steps(trained_run, tmp_path):
    from eagleforge.train.loop import train

    cfg, _ = trained_run
    ckpts = sorted(p.name for p in (cfg.run / "checkpoints").iterdir())
    assert ckpts == ["step-000008", "step-000016", "step-000024"]
    saved = json.loads((cfg.run / "checkpoints" / "step-000008" / "state.json").read_text())
    assert saved["step"] == 8 and {"epoch", "batch_index", "scheduler"} <= set(saved)

    # A copy of the run as if it had been killed after the checkpoint at step 8.
    resumed = tmp_path / "resumed"
    shutil.copytree(cfg.run, resumed)
    for name in ("step-000016", "step-000024"):
        shutil.rmtree(resumed / "checkpoints" / name)
    shutil.rmtree(resumed / "draft")
    (resumed / "train_summary.json").unlink()
    original = cfg.run_dir
    cfg.run_dir = str(resumed)
    try:
        train(cfg)
    finally:
        cfg.run_dir = original
    full, again = _log_rows(cfg.run), _log_rows(resumed)
    assert [int(r["step"]) for r in again] == list(range(1, 25))
    for a, b in zip(full[8:], again[8:]):
        assert float(a["loss"]) == pytest.approx(float(b["loss"]), rel=1e-5, abs=1e-6), (a["step"], a["loss"], b["loss"])
        assert float(a["lr"]) == pytest.approx(float(b["lr"]), rel=1e-9)
    from eagleforge.train.checkpoint import load_model_weights

    wa = load_model_weights(cfg.run / "checkpoints" / "step-000024")
    wb = load_model_weights(resumed / "checkpoints" / "step-000024")
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], rtol=1e-5, atol=1e-6)


def test_train_errors_name_the_problem(tmp_path, tiny_llama_config):
    from eagleforge.train.loop import train

    cfg, _, _ = build_tiny_run(tmp_path, tiny_llama_config, n_samples=5)
    with pytest.raises(FileNotFoundError, match="vocab"):
        train(cfg)


def test_loss_positions_all_reads_every_real_position(tmp_path, tiny_llama_config):
    """train.loss_positions=all: a training batch's loss rows are every unpadded position with a
    token to predict (rows of step j = sum over samples of max(0, length - 2 - j));
    loss_positions=assistant reads the shards' loss_mask only, and held-out evaluation always does."""
    from eagleforge.train.loop import Trainer
    from eagleforge.vocab import main as vocab_main

    cfg, _, samples = build_tiny_run(tmp_path, tiny_llama_config, n_samples=10, with_argmax=True)
    _configure(cfg, epochs=1, device="cpu")
    vocab_main(cfg)
    counts = {}
    for mode in ("assistant", "all"):
        cfg.train.loss_positions = mode
        trainer = Trainer(cfg)
        batch = trainer.load_batch([0, 1, 2])
        counts[mode] = (trainer.batch_loss(batch, training=True)[1].n_valid, trainer.batch_loss(batch)[1].n_valid)
    lengths = [int(samples[i]["input_ids"].shape[0]) for i in (0, 1, 2)]
    masks = [samples[i]["loss_mask"].bool() for i in (0, 1, 2)]
    steps = cfg.train.ttt_steps
    assert counts["all"][0] == [sum(max(0, n - 2 - j) for n in lengths) for j in range(steps)]
    assert counts["assistant"][0] == [sum(int(m[2 + j:].sum()) for m in masks) for j in range(steps)]
    assert counts["all"][1] == counts["assistant"][1] == counts["assistant"][0]
    assert counts["all"][0][0] > counts["assistant"][0][0]  # the fixture's prompts are not all masked out


PLAIN_STEP = dict(activation_checkpoint="none", attention="reference", compile=False)


def _losses_of_step_options(tmp_path, target_config, common: dict, variants: dict) -> tuple:
    """One tiny run (14 samples of several lengths), trained 5 steps per variant of the step
    options from the same start: (the base run's path, {variant: [loss per step]})."""
    from eagleforge.vocab import main as vocab_main

    cfg, _, _ = build_tiny_run(tmp_path / "base", target_config, n_samples=14, with_argmax=True)
    _configure(cfg, max_steps=5, save_every=100, **common)
    vocab_main(cfg)
    base = cfg.run
    return base, train_variants(cfg, base, tmp_path, variants)


@pytest.mark.slow
def test_kimi_config_training_options_give_the_plain_losses(tmp_path, tiny_llama_config, compiled):
    """The Kimi configs' step options together (selective_all checkpointing, merged attention,
    dynamic-shape compile) through the real Trainer, fp32, batches of several lengths: the same
    losses step for step as the plain step (no checkpoint, reference attention, eager)."""
    base, losses = _losses_of_step_options(tmp_path, tiny_llama_config, dict(bf16=False, device="cpu"), {
        "plain": PLAIN_STEP, "kimi": dict(activation_checkpoint="selective_all", attention="merged", compile=True)})
    from eagleforge.shards import ShardReader

    assert len(set(ShardReader(base / "hidden").sample_lengths())) > 3  # several batch shapes
    from torch._dynamo.utils import counters

    assert counters["stats"]["unique_graphs"] > 0  # the kimi run did compile
    assert len(losses["plain"]) == 5
    assert losses["kimi"] == pytest.approx(losses["plain"], rel=1e-4), losses


@pytest.mark.gpu
def test_trainer_on_cuda_with_auto_attention_follows_the_plain_losses(tmp_path, tiny_llama_config):
    """The trainer on CUDA in bf16 with its defaults for attention (auto = merged_cudnn there)
    and the Kimi configs' checkpointing and dynamic compile, batches of several lengths: losses
    within bf16 noise of the plain step (reference attention, no checkpoint, eager), and cuDNN
    took every TTT attention shape (no fallback recorded)."""
    from eagleforge.draft.attention import _cudnn_refused

    _cudnn_refused.clear()
    _, losses = _losses_of_step_options(tmp_path, tiny_llama_config, dict(bf16=True, device="cuda"), {
        "plain": PLAIN_STEP, "auto": dict(activation_checkpoint="selective_all", attention="auto", compile=True)})
    assert len(losses["auto"]) == 5 and all(math.isfinite(x) for x in losses["auto"])
    assert losses["auto"] == pytest.approx(losses["plain"], rel=3e-2), losses
    assert not _cudnn_refused, f"cuDNN refused {_cudnn_refused}"


@pytest.mark.gpu
def test_train_step_on_cuda_makes_no_host_sync(tmp_path, tiny_llama_config):
    """A training step (load, collate, forward_ttt, fused loss, backward, clipping, optimizer)
    on CUDA runs with CUDA's sync debug mode set to raise: nothing in it waits for the GPU (the
    logger reads the window's numbers back once per window instead)."""
    from eagleforge.train.loop import Trainer
    from eagleforge.vocab import main as vocab_main

    cfg, _, _ = build_tiny_run(tmp_path, tiny_llama_config, n_samples=14, with_argmax=True)
    _configure(cfg, max_steps=6, save_every=100, bf16=True, device="cuda", activation_checkpoint="selective_all",
               attention="auto", compile=True)
    vocab_main(cfg)
    trainer = Trainer(cfg)
    for _ in range(2):  # first uses: compilation, cuDNN plans, the allocator's pools
        trainer.train_step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            stats, grad_norm = trainer.train_step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert math.isfinite(float(grad_norm)) and stats.n_valid[0] > 0


def test_next_steps_batches_are_read_ahead_on_the_worker(tmp_path, tiny_llama_config):
    """Shards are read and padded on the feed's worker: after a step, the next step's batches
    (as the schedule gives them, across an epoch boundary too) are read without the training
    thread asking, every sample read of the steps happened on the worker, and the batches the
    steps train equal collate's."""
    import collections
    import threading
    import time

    from eagleforge.train.loop import Trainer
    from eagleforge.train.prefetch import THREAD_NAME
    from eagleforge.vocab import main as vocab_main

    cfg, _, _ = build_tiny_run(tmp_path, tiny_llama_config, n_samples=14, with_argmax=True)
    _configure(cfg, epochs=3, grad_accum=2, device="cpu")
    vocab_main(cfg)
    trainer = Trainer(cfg)
    reads, trained = [], []
    reader = trainer.source.reader
    original = type(reader).__getitem__
    reader.__class__ = type("Recording", (type(reader),), {
        "__getitem__": lambda self, i: (reads.append((threading.current_thread().name, i)), original(self, i))[1]})
    rank_batches = trainer._rank_batches
    trainer._rank_batches = lambda slots, feed: ((trained.append((ids, batch)), (ids, batch))[1] for ids, batch in rank_batches(slots, feed))
    per_epoch = len(trainer.schedule.epoch_batches(0))
    wanted = collections.Counter()  # the samples of the steps taken and of the next one
    try:
        for _ in range(per_epoch):  # crosses into epoch 1
            wanted.update(i for ids in trainer.schedule.step_at(trainer.position, trainer.step + 1).batches for i in ids)
            trainer.train_step()
            wanted.update(i for ids in trainer.schedule.step_at(trainer.position, trainer.step + 1).batches for i in ids)
            deadline = time.monotonic() + 60
            while wanted - collections.Counter(i for _, i in reads):
                assert time.monotonic() < deadline, "the next step's batches were not read ahead"
                time.sleep(0.01)
            wanted.subtract(i for ids in trainer.schedule.step_at(trainer.position, trainer.step + 1).batches for i in ids)
        assert trainer.epoch == 1
        assert reads and {name for name, _ in reads} == {THREAD_NAME}, {name for name, _ in reads}
        reader.__class__ = type(reader).__mro__[1]  # the reference reads below are not the worker's
        for ids, batch in trained:
            expected = collate([reader[i] for i in ids])
            for name in ("input_ids", "loss_mask", "aux_hidden_states", "last_hidden_state", "target_argmax", "lengths"):
                assert torch.equal(getattr(batch, name), getattr(expected, name)), name
    finally:
        trainer.close()


def test_embedding_on_the_host_gives_the_same_losses(tmp_path, tiny_llama_config):
    """train.embed_device=host: the draft holds an empty embedding, each batch brings its rows
    (the target's embedding from RUN/vocab at input_ids padded with K zeros), and training gives
    the same losses step for step as with the embedding in the draft."""
    import torch.nn.functional as F

    from eagleforge.train.loop import Trainer
    from eagleforge.vocab import load_target_head

    _, losses = _losses_of_step_options(tmp_path, tiny_llama_config, dict(device="cpu"), {
        "device": dict(embed_device="device"), "host": dict(embed_device="host")})
    assert len(losses["host"]) == 5
    assert losses["host"] == pytest.approx(losses["device"], rel=1e-6), losses
    heldout = {name: json.loads((tmp_path / name / "train_summary.json").read_text())["heldout"] for name in losses}
    assert heldout["host"]["loss"] == pytest.approx(heldout["device"]["loss"], rel=1e-6)
    assert heldout["host"]["accuracy_per_step"] == pytest.approx(heldout["device"]["accuracy_per_step"], abs=1e-9)

    from eagleforge.vocab import main as vocab_main

    cfg, _, _ = build_tiny_run(tmp_path / "own", tiny_llama_config, n_samples=8, with_argmax=True)
    _configure(cfg, device="cpu", embed_device="host")
    vocab_main(cfg)
    trainer = Trainer(cfg)
    try:
        assert trainer.draft.embed_tokens.weight.numel() == 0
        ids = trainer.schedule.epoch_batches(0)[0]
        batch = trainer.load_batch(ids)
        embedding = load_target_head(cfg.run)["embed_tokens"].float()  # [V, H]
        want = F.embedding(F.pad(batch.input_ids, (0, cfg.train.ttt_steps)), embedding)  # [B, T + K, H]
        assert batch.input_embeds.shape == want.shape and torch.equal(batch.input_embeds, want)
    finally:
        trainer.close()


@pytest.mark.gpu
def test_embedding_on_the_host_on_cuda_gives_the_device_losses(tmp_path, tiny_llama_config):
    """On CUDA in bf16, the embedding rows gathered on the host into pinned memory and copied
    with the batch give the losses of the embedding kept on the GPU."""
    _, losses = _losses_of_step_options(tmp_path, tiny_llama_config, dict(bf16=True, device="cuda"), {
        "device": dict(embed_device="device"), "host": dict(embed_device="host")})
    assert len(losses["host"]) == 5 and all(math.isfinite(x) for x in losses["host"])
    assert losses["host"] == pytest.approx(losses["device"], rel=1e-3), losses


def test_embed_device_resolution():
    """auto keeps the embedding on the host on CUDA unless the draft takes the target's own tensor
    (online at native tp 1 and pp 1, or an hf target); online with stages or tp groups it is on
    the host too; explicit settings are kept."""
    from types import SimpleNamespace

    from eagleforge.train.step_plan import resolve_embed_device

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    auto, host, device = (SimpleNamespace(embed_device=m) for m in ("auto", "host", "device"))
    assert resolve_embed_device(auto, cuda) is True  # shards, or online without a shared tensor
    assert resolve_embed_device(auto, cpu) is False
    assert resolve_embed_device(auto, cuda, shared=True) is False  # the target's own tensor
    assert resolve_embed_device(host, cpu) is True
    assert resolve_embed_device(host, cuda, shared=True) is True
    assert resolve_embed_device(device, cuda) is False


def test_adam_beta2_reaches_the_optimizer_and_one_is_refused(tmp_path, tiny_llama_config):
    """train.adam_beta2 is the AdamW's beta2 (beta1 stays 0.9); 1.0 (no bias correction) is a
    config error naming the key."""
    from eagleforge.config import load_config
    from eagleforge.errors import ConfigError
    from eagleforge.train.loop import Trainer
    from eagleforge.vocab import main as vocab_main

    cfg, _, _ = build_tiny_run(tmp_path, tiny_llama_config, n_samples=8, with_argmax=True)
    _configure(cfg, device="cpu", adam_beta2=0.999)
    vocab_main(cfg)
    trainer = Trainer(cfg)
    try:
        assert [g["betas"] for g in trainer.optimizer.param_groups] == [(0.9, 0.999)] * len(trainer.optimizer.param_groups)
    finally:
        trainer.close()
    with pytest.raises(ConfigError, match="train.adam_beta2"):
        load_config(None, ["train.adam_beta2=1.0"])


@pytest.mark.parametrize("param_dtype", ["float32", "bfloat16"])
def test_selective_checkpointing_under_bf16_autocast_follows_the_plain_losses(tmp_path, tiny_llama_config, param_dtype):
    """bf16 autocast with selective checkpointing, fp32 masters (autocast's weight-cast cache would
    make a recomputed TTT step cast what the forward took from the cache, which the checkpoint
    refuses) and bf16 parameters: the plain step's losses within bf16 noise."""
    _, losses = _losses_of_step_options(tmp_path, tiny_llama_config, dict(bf16=True, device="cpu", param_dtype=param_dtype), {
        "plain": PLAIN_STEP, "selective": dict(activation_checkpoint="selective*2+selective_all", attention="merged")})
    assert len(losses["selective"]) == 5 and all(math.isfinite(x) for x in losses["selective"])
    assert losses["selective"] == pytest.approx(losses["plain"], rel=3e-2), losses


def test_draft_fc_norm_trains_an_eagle31_draft(tmp_path, tiny_llama_config):
    """draft.fc_norm=true on the command line: the trainer builds, trains and exports an EAGLE-3.1
    draft. Its fc_norm weights are trained (they leave 1) with fp32 masters and with bf16
    parameters (fused midlayer weight gradients, selective checkpointing, merged attention); the
    export has "fc_norm": true and fc_norm.{0,1,2}.weight, and loads with the checkpoint's weights."""
    from safetensors import safe_open

    from eagleforge.config import load_config, save_config
    from eagleforge.draft import expected_tensors, load_draft
    from eagleforge.train.checkpoint import load_model_weights
    from eagleforge.vocab import load_target_head
    from eagleforge.vocab import main as vocab_main

    cfg, _, _ = build_tiny_run(tmp_path / "base", tiny_llama_config, n_samples=12, with_argmax=True)
    _configure(cfg, max_steps=5, save_every=100, device="cpu")
    save_config(cfg, tmp_path / "config.yaml")
    cfg = load_config(tmp_path / "config.yaml", ["draft.fc_norm=true"])
    assert cfg.draft.fc_norm is True
    vocab_main(cfg)
    losses = train_variants(cfg, cfg.run, tmp_path, {
        "fp32": {}, "bf16": dict(bf16=True, param_dtype="bfloat16", activation_checkpoint="selective", attention="merged")})
    names = [f"fc_norm.{i}.weight" for i in range(3)]
    for variant, run_losses in losses.items():
        run = tmp_path / variant
        assert len(run_losses) == 5 and all(math.isfinite(x) for x in run_losses), (variant, run_losses)
        weights = load_model_weights(run / "checkpoints" / "step-000005")
        for name in names:
            assert weights[name].shape == (48,)
            assert (weights[name] - 1).abs().max() > 1e-4, f"{variant}: {name} never left 1"
        hf = json.loads((run / "draft" / "config.json").read_text())
        assert hf["fc_norm"] is True and not {"norm_output", "norm_before_residual"} & set(hf)
        draft = load_draft(run / "draft", embed_tokens=load_target_head(run)["embed_tokens"])
        assert draft.config.fc_norm and draft.config.num_aux_layers == 3
        with safe_open(str(run / "draft" / "model.safetensors"), framework="pt") as f:
            assert set(f.keys()) == set(expected_tensors(draft.config)) and set(names) <= set(f.keys())
        for name in names:
            torch.testing.assert_close(draft.state_dict()[name], weights[name].bfloat16().float(), atol=0, rtol=0)


def test_warm_start_begins_at_the_loaded_drafts_heldout_figures(tmp_path, tiny_llama_config):
    """train.init_draft: a run started from a trained draft (one step at lr 0) has that draft's
    held-out figures, not a fresh draft's, from the export and from the same draft in SpecForge's
    form alike (ids only in eagle_config, its own embed_tokens, no t2d); a draft of another
    vocabulary map is refused, naming the first draft id that maps elsewhere."""
    from safetensors.torch import load_file, save_file

    from eagleforge.errors import UserInputError
    from eagleforge.vocab import load_target_head
    from eagleforge.vocab import main as vocab_main

    cfg, _, _ = build_tiny_run(tmp_path / "base", tiny_llama_config, n_samples=24, with_argmax=True)
    _configure(cfg, max_steps=200, save_every=1000, device="cpu")
    vocab_main(cfg)
    train_variants(cfg, cfg.run, tmp_path, {"trained": {}})
    trained = tmp_path / "trained" / "draft"
    specforge = tmp_path / "specforge-form"
    shutil.copytree(trained, specforge)
    hf = json.loads((specforge / "config.json").read_text())
    assert hf["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    del hf["eagle_aux_hidden_state_layer_ids"]
    (specforge / "config.json").write_text(json.dumps(hf))
    tensors = load_file(str(specforge / "model.safetensors"))
    tensors.pop("t2d")
    tensors["embed_tokens.weight"] = load_target_head(cfg.run)["embed_tokens"].bfloat16()
    save_file(tensors, str(specforge / "model.safetensors"), metadata={"format": "pt"})
    train_variants(cfg, cfg.run, tmp_path, {"fresh": {"max_steps": 1, "lr": 0.0}, "warm": {"init_draft": str(trained)},
                                            "warm-specforge": {"init_draft": str(specforge)}})
    held = {name: json.loads((tmp_path / name / "train_summary.json").read_text()) for name in ("trained", "fresh", "warm", "warm-specforge")}
    length = {name: s["simulated_acceptance_length"] for name, s in held.items()}
    acc = {name: s["heldout"]["accuracy_per_step"] for name, s in held.items()}
    assert held["warm"]["heldout"] == held["warm-specforge"]["heldout"]
    # the export is the trained draft rounded to bf16: the same figures but for a few near-ties
    assert length["warm"] == pytest.approx(length["trained"], abs=0.02), length
    assert acc["warm"] == pytest.approx(acc["trained"], abs=0.02), acc
    assert length["trained"] - length["fresh"] > 0.1 and acc["trained"][0] - acc["fresh"][0] > 0.1, (length, acc)

    other = tmp_path / "other-vocabulary"
    shutil.copytree(trained, other)
    tensors = load_file(str(other / "model.safetensors"))
    ids = torch.arange(60) + tensors["d2t"]
    unused = int((~tensors["t2d"]).nonzero()[-1])  # a target id outside the draft vocabulary
    new_ids = torch.cat([ids[:-1], torch.tensor([unused])]).sort().values
    first = int((new_ids != ids).nonzero()[0])
    tensors["d2t"] = new_ids - torch.arange(60)
    tensors["t2d"] = torch.zeros_like(tensors["t2d"]).index_fill_(0, new_ids, True)
    save_file(tensors, str(other / "model.safetensors"), metadata={"format": "pt"})
    cfg.train.init_draft = str(other)
    with pytest.raises(UserInputError, match=re.escape(
            f"train.init_draft={other}: its vocabulary map (d2t) is not this run's RUN/vocab: {int((new_ids != ids).sum())} of 60 "
            f"draft ids map to other target ids (draft id {first}: target id {int(new_ids[first])}, this run {int(ids[first])})")):
        train_variants(cfg, cfg.run, tmp_path, {"refused": {}})
