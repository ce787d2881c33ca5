"""bf16 parameters (train.param_dtype=bfloat16, the CUDA default): bf16 weights and gradients, the
midlayer's weight gradients accumulated by the GEMMs (train/weight_grads.py), and the optimizer's
exact fp32 masters (an int16 remainder per weight) and fp32 moments (train/optimizer.py). On the CPU with
gloo: one process against two FSDP2 ranks over the same global batches, against the fp32-master
run, and an interrupted run against an uninterrupted one (tiny real pipeline: random Llama
target -> shards -> vocab)."""

import json

import pytest
import torch
from test_train_distributed import WORLD, _clone_run, _configure, _export, _losses, _spawn
from test_vocab import build_tiny_run

pytestmark = pytest.mark.usefixtures("one_torch_thread")

STOP_AT = 4
MIDLAYER = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """fp32 (one process, fp32 masters), single (one process, bf16 parameters, grad_accum 2),
    fsdp (2 ranks, bf16 parameters), stopped (single, interrupted after STOP_AT and resumed)."""
    from transformers import LlamaConfig

    from eagleforge.train.loop import train
    from eagleforge.vocab import main as vocab_main

    config = LlamaConfig(
        vocab_size=173, hidden_size=40, intermediate_size=72, num_hidden_layers=7,
        num_attention_heads=5, num_key_value_heads=1, head_dim=8, max_position_embeddings=256,
        rms_norm_eps=1e-5, tie_word_embeddings=False, pad_token_id=0, eos_token_id=2, bos_token_id=1,
    )
    base, _, _ = build_tiny_run(tmp_path_factory.mktemp("bf16"), config, n_samples=22, with_argmax=True, seed=3)
    _configure(base, bf16=True, epochs=3)
    vocab_main(base)
    out = {
        "fp32": _clone_run(base, "fp32", grad_accum=2, param_dtype="float32"),
        "single": _clone_run(base, "single", grad_accum=2, param_dtype="bfloat16"),
        "fsdp": _clone_run(base, "fsdp", param_dtype="bfloat16", parallel="fsdp"),
        "stopped": _clone_run(base, "stopped", grad_accum=2, param_dtype="bfloat16"),
    }
    _spawn([(out["fsdp"], None)])
    for name in ("fp32", "single"):
        train(out[name])
    train(out["stopped"], STOP_AT)
    train(out["stopped"])
    return out


def test_bf16_state_is_bf16_and_exports(runs):
    """The checkpoint holds bf16 weights, their int16 master remainders and fp32 moments (14 bytes
    per trainable parameter with the gradient), the export reads the weights back exactly."""
    from eagleforge.train.checkpoint import latest_checkpoint, load_model_weights
    from eagleforge.train.checkpoint_integrity import safe_reader

    final = latest_checkpoint(runs["single"].run)
    entries = safe_reader(final).read_metadata().state_dict_metadata
    weights = {k: v for k, v in entries.items() if k.startswith("model.draft.") and k.endswith(".weight")}
    moments = {k: v for k, v in entries.items() if k.startswith("optim.") and k.endswith(("exp_avg", "exp_avg_sq"))}
    assert weights and moments
    assert {v.properties.dtype for v in weights.values()} == {torch.bfloat16}, weights
    assert {v.properties.dtype for v in moments.values()} == {torch.float32}
    remainders = {k: v for k, v in entries.items() if k.startswith("optim.") and k.endswith("master_remainder")}
    assert len(remainders) == len(moments) // 2 and {v.properties.dtype for v in remainders.values()} == {torch.int16}
    loaded = load_model_weights(final)
    exported = _export(runs["single"])
    for name, tensor in exported.items():
        if name in loaded:
            assert torch.equal(tensor, loaded[name].bfloat16()), name


def test_two_fsdp_ranks_match_one_process_in_bf16(runs):
    """Fused weight gradients under FSDP2: the reduce-scatter sees what the GEMMs accumulated.
    If it did not, the midlayer would not train on two ranks and the curves and weights part."""
    single, fsdp = _losses(runs["single"]), _losses(runs["fsdp"])
    assert [s for s, _, _ in single] == [s for s, _, _ in fsdp]
    for (step, a, _), (_, b, _) in zip(single, fsdp):
        assert b == pytest.approx(a, rel=2e-2), (step, a, b)
    by_epoch = [[loss for step, loss, _ in single if step in steps] for steps in (range(1, 4), range(len(single) - 2, len(single) + 1))]
    assert sum(by_epoch[1]) < 0.9 * sum(by_epoch[0]), f"the loss should fall: {by_epoch}"
    ea, eb = _export(runs["single"]), _export(runs["fsdp"])
    init = _initial_midlayer(runs["single"])
    for name in ea:
        diff = (eb[name].float() - ea[name].float()).norm() / ea[name].float().norm()
        assert diff < 0.03, f"{name}: relative difference {diff:.3g} between 1 process and 2 FSDP ranks"
    for name, weight in init.items():
        moved = (eb[name].float() - weight).norm() / weight.norm()
        assert moved > 0.05, f"{name}: moved only {moved:.3g} from its initial value on 2 FSDP ranks"
    summary = json.loads((runs["fsdp"].run / "train_summary.json").read_text())
    assert (summary["world_size"], summary["parallel"]) == (WORLD, "fsdp")


def test_bf16_parameters_track_fp32_masters(runs):
    """The same data and steps with fp32 parameters: the loss curve and the held-out accuracy stay
    close (the updates are the same up to the bf16 gradients' rounding)."""
    a, b = _losses(runs["fp32"]), _losses(runs["single"])
    for (step, la, _), (_, lb, _) in zip(a, b):
        assert lb == pytest.approx(la, rel=0.05), (step, la, lb)
    sa = json.loads((runs["fp32"].run / "train_summary.json").read_text())
    sb = json.loads((runs["single"].run / "train_summary.json").read_text())
    assert sb["heldout"]["loss"] == pytest.approx(sa["heldout"]["loss"], rel=0.03)


def test_bf16_resume_is_exact(runs):
    """bf16 weights, master remainders and moments round-trip through the checkpoint: the resumed
    run's losses and export equal the uninterrupted run's."""
    a, b = _losses(runs["single"]), _losses(runs["stopped"])
    assert len(a) > STOP_AT and [s for s, _, _ in b] == [s for s, _, _ in a]  # one log, appended after the resume
    for (step, la, _), (_, lb, _) in zip(a, b):
        assert lb == la, (step, la, lb)
    ea, eb = _export(runs["single"]), _export(runs["stopped"])
    for name in ea:
        assert torch.equal(ea[name], eb[name]), name


def test_bf16_parameters_refused_with_ddp_and_without_bf16(runs):
    from eagleforge.errors import UserInputError
    from eagleforge.train.step_plan import resolve_param_dtype

    tc = runs["single"].train
    with pytest.raises(UserInputError, match="not ddp"):
        resolve_param_dtype(tc, torch.device("cpu"), "ddp")
    tc = type(tc)(param_dtype="bfloat16", bf16=False)
    with pytest.raises(UserInputError, match="train.bf16=true"):
        resolve_param_dtype(tc, torch.device("cpu"), "none")
    assert resolve_param_dtype(type(tc)(), torch.device("cuda"), "none") == torch.bfloat16  # auto
    assert resolve_param_dtype(type(tc)(), torch.device("cpu"), "none") == torch.float32


def _initial_midlayer(cfg) -> dict:
    """The midlayer weights the trainer starts from (its seed), in fp32."""
    from eagleforge.train.loop import Trainer

    trainer = Trainer(cfg)
    return {f"midlayer.{part}.{name}.weight": getattr(getattr(trainer.draft.midlayer, part), name).weight.detach().float().clone()
            for part, names in (("self_attn", MIDLAYER[:4]), ("mlp", MIDLAYER[4:])) for name in names}


def test_resume_of_a_checkpoint_with_bf16_moments_is_refused(runs, tmp_path, monkeypatch):
    """A checkpoint of bf16 parameters stepped by AdamW with bf16 moments (what this trainer wrote
    before its optimizer kept fp32 masters) resumed now: one clear line, not a half-loaded
    optimizer state."""
    import copy
    import shutil

    from eagleforge.errors import UserInputError
    from eagleforge.train import loop

    cfg = copy.deepcopy(runs["single"])
    cfg.run_dir = str(tmp_path / "old")
    shutil.copytree(runs["single"].run / "hidden", cfg.run / "hidden")
    shutil.copytree(runs["single"].run / "vocab", cfg.run / "vocab")
    with monkeypatch.context() as patch:
        patch.setattr(loop, "build_optimizer", lambda params, dtype, lr, betas, wd:
                      torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=wd, fused=True))
        loop.train(cfg, 2)
    with pytest.raises(UserInputError, match="no master remainders.*train.param_dtype bfloat16"):
        loop.train(cfg)


def _worker_reduce(rank: int, world: int, jobs: list) -> None:
    """A rank (spawn_ranks: torchrun's environment) whose FSDP2 reduce-scatters gradients in the
    dtype each job names (fp32 or bf16), whatever its parameters' dtype."""
    import os

    import torch.distributed as dist
    from test_train_distributed import PROCESS_GROUP_TIMEOUT

    from eagleforge.train import loop

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=PROCESS_GROUP_TIMEOUT)
    try:
        for cfg, reduce_dtype in jobs:
            loop.reduce_dtype_of = lambda param_dtype, chosen=reduce_dtype: chosen
            loop.train(cfg)
        dist.barrier()  # leave together (a rank tearing its group down under another aborts it)
    finally:
        dist.destroy_process_group()


def test_bf16_gradient_reduce_equals_the_fp32_reduce_on_four_ranks(runs):
    """bf16 parameters reduce-scatter their (bf16) gradients in bf16 under FSDP2 (train/
    distributed.py reduce_dtype_of: no fp32 copy of every gradient at the end of the backward).
    On 4 gloo ranks, where a bf16 sum rounds at each of 3 additions, the run's per-step losses,
    held-out loss and export equal those of the same run reducing in fp32 within the online
    equality tests' tolerance (test_train_online.LOSS_REL)."""
    from procs import spawn_ranks
    from test_train_online import LOSS_REL

    from eagleforge.train.distributed import reduce_dtype_of

    assert reduce_dtype_of(torch.bfloat16) == torch.bfloat16 and reduce_dtype_of(torch.float32) == torch.float32
    cfgs = {dtype: _clone_run(runs["single"], f"fsdp4_reduce_{str(dtype)[6:]}", grad_accum=1, param_dtype="bfloat16",
                              parallel="fsdp", batch_tokens=60)
            for dtype in (torch.bfloat16, torch.float32)}
    spawn_ranks(_worker_reduce, ([(cfg, dtype) for dtype, cfg in cfgs.items()],), world=4)
    bf16, fp32 = _losses(cfgs[torch.bfloat16]), _losses(cfgs[torch.float32])
    assert [s for s, _, _ in bf16] == [s for s, _, _ in fp32] and len(fp32) > 3
    for (step, a, _), (_, b, _) in zip(bf16, fp32):
        assert a == pytest.approx(b, rel=LOSS_REL), (step, a, b)
    sa, sb = (json.loads((cfg.run / "train_summary.json").read_text()) for cfg in (cfgs[torch.bfloat16], cfgs[torch.float32]))
    assert sa["world_size"] == 4 and sa["heldout"]["loss"] == pytest.approx(sb["heldout"]["loss"], rel=LOSS_REL)
    ea, eb = _export(cfgs[torch.bfloat16]), _export(cfgs[torch.float32])
    for name in ea:
        diff = (ea[name].float() - eb[name].float()).norm() / max(eb[name].float().norm(), 1e-12)
        assert diff < 1e-2, f"{name}: relative difference {diff:.3g} between the bf16 and the fp32 reduce"


def test_states_kept_in_their_own_dtype_give_the_fp32_converted_losses(runs):
    """The trainer keeps a batch's states in the dtype the source made them (bf16 here, the
    shards' storage dtype) instead of converting them to fp32 for fp32 parameters: every reader
    casts them up where it computes, exactly, so the loss, the stats and every gradient equal
    those of the batch converted to fp32 first (bit for bit, fp32 parameters under bf16 autocast
    and in plain fp32)."""
    import copy

    from eagleforge.train.loop import Trainer

    for bf16 in (True, False):
        cfg = copy.deepcopy(runs["fp32"])
        cfg.train.bf16 = bf16
        trainer = Trainer(cfg)
        try:
            batch = trainer.load_batch(trainer.schedule.epoch_batches(0)[0])
            assert batch.aux_hidden_states.dtype == torch.bfloat16  # the shards' storage dtype, kept
            results = []
            for states in (batch, batch.to(trainer.device, torch.float32)):
                trainer.model.zero_grad(set_to_none=True)
                loss, stats = trainer.batch_loss(states, training=True)
                loss.backward()
                results.append((loss.detach(), stats.ce_sum, [p.grad.clone() for p in trainer.params]))
            (la, ca, ga), (lb, cb, gb) = results
            assert torch.equal(la, lb) and ca == cb, (bf16, la, lb)
            assert all(torch.equal(a, b) for a, b in zip(ga, gb)), bf16
        finally:
            trainer.close()
