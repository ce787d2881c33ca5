"""benchmarks/bench_quality.py: both trainings get the trainer's batches in the trainer's order, and a
SpecForge draft mapped into the export format computes SpecForge's own logits."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from test_vocab import build_tiny_run

pytestmark = pytest.mark.usefixtures("one_torch_thread")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_quality  # noqa: E402


@pytest.mark.parametrize("grad_accum,epochs,max_steps", [(1, 2, 0), (2, 3, 0), (3, 1, 7)])
def test_step_schedule_is_the_trainers(tmp_path, tiny_llama_config, grad_accum, epochs, max_steps, test_seed):
    """The steps the SpecForge side trains on are the ones Trainer.train_step takes, in order (the
    trainer's own schedule is the reference), across epochs and with max_steps past one epoch."""
    from eagleforge.train.loop import Trainer
    from eagleforge.train.schedule import Position
    from eagleforge.vocab import main as vocab_main

    cfg, _, _ = build_tiny_run(tmp_path, tiny_llama_config, n_samples=30)
    cfg.vocab.draft_vocab_size = 60
    cfg.train.batch_tokens = 90
    cfg.train.holdout_samples = 5
    cfg.train.grad_accum = grad_accum
    cfg.train.epochs = epochs
    cfg.train.max_steps = max_steps
    cfg.train.seed = test_seed % 1000
    vocab_main(cfg)
    trainer = Trainer(cfg)
    try:
        expected = [step.batches for step in trainer.schedule.steps(Position(), 0, trainer.total_steps)]
        lengths, train_ids = trainer.source.sample_lengths(), trainer.train_ids
    finally:
        trainer.close()
    got = bench_quality.step_schedule(lengths, train_ids, cfg.train.batch_tokens, cfg.train.seed, epochs, max_steps,
                                      grad_accum)
    assert got == expected, f"train.seed {cfg.train.seed}"
    if max_steps:
        assert len(got) == max_steps
    else:  # every training sample once per epoch
        assert sorted(i for step in got for b in step for i in b) == sorted(train_ids * epochs)


@pytest.mark.skipif(importlib.util.find_spec("specforge") is None, reason="specforge is not installed (pip install "
                    "--no-deps specforge; not a dependency of the project)")
def test_specforge_draft_in_our_export_gives_specforge_logits(tmp_path, test_seed):
    """Random SpecForge LlamaForCausalLMEagle3 (bf16-exact weights, norms not 1, target hidden !=
    draft hidden, rope_theta not the default) -> specforge_to_draft -> save_draft -> load_draft:
    our forward_ttt's logits at every TTT step equal those SpecForge's own OnlineEagle3Model
    computes on the same padded batch (its sdpa backend, its input shift)."""
    from specforge.algorithms.eagle3.model import OnlineEagle3Model

    from eagleforge.draft import Eagle3Config, load_draft, save_draft
    from eagleforge.train.batching import collate

    bench_quality.use_plain_specforge_loss()
    torch.manual_seed(test_seed)
    v, vd, h, ht, steps = 300, 100, 64, 40, 3
    config = Eagle3Config(hidden_size=h, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96,
                          vocab_size=v, draft_vocab_size=vd, target_hidden_size=ht, aux_layer_ids=[1, 3, 5],
                          rms_norm_eps=1e-5, rope_theta=50000.0, max_position_embeddings=512)
    used = torch.sort(torch.randperm(v)[:vd]).values
    d2t, t2d = used - torch.arange(vd), torch.zeros(v, dtype=torch.bool)
    t2d[used] = True
    embed = torch.randn(v, h).bfloat16().float()
    sf = bench_quality.build_specforge_draft(bench_quality.Eagle3Draft(config), d2t, t2d, embed, "sdpa")
    with torch.no_grad():
        for name, p in sf.named_parameters():
            if name != "embed_tokens.weight":  # norms away from 1; every weight exact in bf16 (the export's dtype)
                p.copy_((p + 0.3 * torch.randn_like(p) if p.dim() == 1 else p * 8).bfloat16().float())

    lengths = [23, 17]
    samples = [{"input_ids": torch.randint(0, v, (n,)), "loss_mask": torch.ones(n, dtype=torch.bool),
                "aux_hidden_states": torch.randn(n, 3 * ht), "last_hidden_state": torch.randn(n, ht)} for n in lengths]
    batch = collate(samples)
    logits = []
    compute_logits = sf.compute_logits
    sf.compute_logits = lambda hidden: logits.append(compute_logits(hidden)) or logits[-1]
    model = OnlineEagle3Model(sf, length=steps, attention_backend="sdpa")
    with torch.no_grad():
        model(**bench_quality.specforge_inputs(batch, True, "aligned"), target_head_weight=torch.randn(v, ht))
    assert len(logits) == steps

    save_draft(bench_quality.specforge_to_draft(sf.state_dict(), config, d2t, t2d), tmp_path / "draft")
    ours = load_draft(tmp_path / "draft", embed_tokens=embed)
    assert torch.equal(ours.d2t, d2t) and torch.equal(ours.t2d, t2d)
    with torch.no_grad():
        normed = ours.forward_ttt(batch.aux_hidden_states, batch.input_ids, steps, attention="reference")
    for j in range(steps):
        ref, got = logits[j], ours.logits(normed[j])  # [B, T, Vd]
        for row, n in enumerate(lengths):  # real positions (padding rows attend differently by design)
            torch.testing.assert_close(got[row, :n], ref[row, :n].float(), rtol=1e-4, atol=1e-4, msg=lambda m: f"seed {test_seed}: {m}")
        assert ref.abs().max() > 1.0  # not a vacuous match of near-zero logits


def test_specforge_export_tensors_refuses_unknown_and_missing_names():
    from eagleforge.draft import Eagle3Draft

    config = bench_quality.Eagle3Config(hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                        intermediate_size=48, vocab_size=80, draft_vocab_size=40, target_hidden_size=32,
                                        aux_layer_ids=[0, 1, 2])
    from eagleforge.draft import EXPORT_TENSOR_NAMES

    state = {k: t for k, t in Eagle3Draft(config).state_dict().items()}
    assert set(bench_quality.specforge_export_tensors(state, config)) == {n for n in EXPORT_TENSOR_NAMES if n not in ("d2t", "t2d")}
    with pytest.raises(ValueError, match="fc_norm.0.weight"):
        bench_quality.specforge_export_tensors({**state, "fc_norm.0.weight": torch.ones(32)}, config)
    # EAGLE-3.1 (SpecForge's fc_norm): the three norms are the export's too
    config31 = bench_quality.Eagle3Config(**{**config.__dict__, "fc_norm": True})
    state31 = Eagle3Draft(config31).state_dict()
    assert {f"fc_norm.{i}.weight" for i in range(3)} <= set(bench_quality.specforge_export_tensors(state31, config31))
    state.pop("norm.weight")
    with pytest.raises(ValueError, match="missing \\['norm.weight'\\]"):
        bench_quality.specforge_export_tensors(state, config)


def test_summary_pairs_rows_by_seed(tmp_path, capsys):
    """--summarize: per row each seed's figure, mean and sd, and the mean of the per-seed ratios to
    the baseline row's same seed, minus 1 (worked by hand below)."""
    import json

    def report(name, values):
        return {"rows": [{"name": name, "seed": s, "simulated_acceptance_length": v} for s, v in values.items()]}

    (tmp_path / "a.json").write_text(json.dumps(report("ours", {0: 3.3, 1: 3.0, 2: 3.15})))
    (tmp_path / "b.json").write_text(json.dumps(report("peer", {0: 3.0, 1: 3.0, 2: 3.0})))
    lines = {line["row"]: line for line in bench_quality.summarize([tmp_path / "a.json", tmp_path / "b.json"], "peer")}
    assert lines["ours"]["mean"] == pytest.approx(3.15) and lines["ours"]["sd"] == pytest.approx(0.15)
    assert lines["ours"]["paired"] == pytest.approx((0.1 + 0.0 + 0.05) / 3)  # 3.3/3 - 1, 3.0/3 - 1, 3.15/3 - 1
    assert lines["peer"]["paired"] is None
    assert "+5.0% (+10.0%, +0.0%, +5.0%)" in capsys.readouterr().out


@pytest.mark.skipif(importlib.util.find_spec("specforge") is None, reason="specforge is not installed (pip install "
                    "--no-deps specforge; not a dependency of the project)")
def test_both_trainers_start_from_the_trainers_initial_draft(tmp_path, tiny_llama_config, test_seed):
    """A seed pairs the trainers: SpecForge's draft starts with the weights the Trainer starts with
    under that seed (EAGLE-3.1's fc_norm included)."""
    from eagleforge.train.build import build_draft
    from eagleforge.train.loop import Trainer
    from eagleforge.vocab import load_target_head, load_vocab_map
    from eagleforge.vocab import main as vocab_main

    cfg, _, _ = build_tiny_run(tmp_path, tiny_llama_config, n_samples=12)
    cfg.vocab.draft_vocab_size, cfg.train.holdout_samples, cfg.draft.fc_norm = 60, 3, True
    cfg.train.seed = test_seed % 1000
    vocab_main(cfg)
    trainer = Trainer(cfg)
    try:
        start = {n: p.detach().float().clone() for n, p in trainer.draft.named_parameters() if p.requires_grad}
        manifest = trainer.source.manifest
    finally:
        trainer.close()
    vocab, head = load_vocab_map(cfg.run), load_target_head(cfg.run)
    specforge = bench_quality.build_specforge_draft(build_draft(cfg, manifest, vocab, head), vocab["d2t"], vocab["t2d"],
                                                    head["embed_tokens"], "sdpa")
    theirs = specforge.state_dict()
    assert "fc_norm.0.weight" in start
    for name, tensor in start.items():
        assert torch.equal(theirs[name].float(), tensor), name
