"""Distributed training on the CPU (gloo, 2 processes): FSDP2 and DDP against one process, and an
interrupted-and-resumed run against an uninterrupted one, on a tiny real pipeline (random
Llama target -> shards -> vocab; test_vocab.build_tiny_run)."""

import json
import shutil

import pytest
import torch
from procs import PROCESS_GROUP_TIMEOUT, spawn_ranks
from test_vocab import build_tiny_run
from tiny_runs import configure

from eagleforge.train.schedule import make_batches, rank_micro_batches

STOP_AT = 3  # the interrupted run stops (checkpoint, exit) after this step
WORLD = 2
SPAWN_TIMEOUT_S = 300


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models: one thread is faster


def _configure(cfg, **train):
    """fp32 everywhere (bf16=false) so that the comparisons can be tight."""
    return configure(cfg, **{"batch_tokens": 120, "warmup_ratio": 0.1, "holdout_samples": 5, "epochs": 2, "save_every": 0,
                             "keep_last": 2, "bf16": False, **train})


def _clone_run(base_cfg, name, **train):
    """A fresh run directory sharing the base run's shards and vocab, with its own train settings."""
    import copy

    cfg = copy.deepcopy(base_cfg)
    run = base_cfg.run.parent / name
    shutil.rmtree(run, ignore_errors=True)
    run.mkdir()
    for part in ("hidden", "vocab"):
        shutil.copytree(base_cfg.run / part, run / part)
    cfg.run_dir = str(run)
    for key, value in train.items():
        setattr(cfg.train, key, value)
    return cfg


def _worker(rank: int, world: int, jobs: list) -> None:
    """One rank: a gloo process group from env:// variables (as torchrun sets them: spawn_ranks),
    then the jobs in order: (cfg, stop_after_step) -> train(cfg, stop_after_step)."""
    import os

    import torch.distributed as dist

    from eagleforge.train.loop import train

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=PROCESS_GROUP_TIMEOUT)
    try:
        for cfg, stop_after in jobs:
            train(cfg, stop_after)
        dist.barrier()  # leave together: a gloo rank that tears its group down while another still
        # reads from it makes that one abort at exit (SIGABRT, 'terminate called without an active exception')
    finally:
        dist.destroy_process_group()


def _spawn(jobs: list) -> None:
    """Run `jobs` on WORLD gloo ranks; fails (and kills the ranks) on an error or a hang."""
    spawn_ranks(_worker, (jobs,), WORLD, timeout_s=SPAWN_TIMEOUT_S)


def _losses(cfg) -> list[tuple[int, float, float]]:
    import csv

    with open(cfg.run / "train_log.csv", newline="") as f:
        return [(int(r["step"]), float(r["loss"]), float(r["lr"])) for r in csv.DictReader(f)]


def _export(cfg) -> dict:
    from safetensors.torch import load_file

    return load_file(str(cfg.run / "draft" / "model.safetensors"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The base tiny run, then: fsdp (2 ranks, uninterrupted), fsdp_resumed (2 ranks, stopped
    after STOP_AT and resumed in fresh processes; the frozen embedding kept on the host,
    train.embed_device=host), ddp (2 ranks), single (1 process, grad_accum 2: the same global
    batches as 2 ranks x grad_accum 1)."""
    from transformers import LlamaConfig

    from eagleforge.vocab import main as vocab_main

    config = LlamaConfig(
        vocab_size=211, hidden_size=48, intermediate_size=80, num_hidden_layers=7,
        num_attention_heads=3, num_key_value_heads=1, head_dim=16, max_position_embeddings=256,
        rms_norm_eps=1e-5, tie_word_embeddings=False, pad_token_id=0, eos_token_id=2, bos_token_id=1,
    )
    tmp = tmp_path_factory.mktemp("dist")
    base, _, _ = build_tiny_run(tmp, config, n_samples=26, with_argmax=True)
    _configure(base)
    vocab_main(base)
    out = {
        "base": base,
        "fsdp": _clone_run(base, "fsdp"),
        "fsdp_resumed": _clone_run(base, "fsdp_resumed"),
        "ddp": _clone_run(base, "ddp"),
        "single": _clone_run(base, "single", grad_accum=2),
    }
    # train.parallel is read with getattr until TrainConfig has it: set it as an attribute.
    out["fsdp"].train.parallel = "fsdp"
    out["fsdp_resumed"].train.parallel = "fsdp"
    out["fsdp_resumed"].train.embed_device = "host"
    out["ddp"].train.parallel = "ddp"
    _spawn([(out["fsdp"], None), (out["fsdp_resumed"], STOP_AT), (out["ddp"], None)])
    stopped = {"log": _losses(out["fsdp_resumed"]), "checkpoints": sorted(p.name for p in (out["fsdp_resumed"].run / "checkpoints").iterdir())}
    _spawn([(out["fsdp_resumed"], None)])
    out["stopped"] = stopped
    from eagleforge.train.loop import train

    train(out["single"])
    return out


def test_rank_split_sees_each_sample_once_per_epoch():
    g = torch.Generator().manual_seed(5)
    lengths = torch.randint(1, 70, (157,), generator=g).tolist()
    ids = list(range(150))
    batches = make_batches(lengths, ids, 200, seed=1, epoch=4)
    for world, accum in ((2, 1), (3, 2), (4, 3)):
        seen = []
        per_step = world * accum
        for start in range(0, len(batches), per_step):
            step = batches[start : start + per_step]
            shares = [rank_micro_batches(step, r, world) for r in range(world)]
            assert len({len(s) for s in shares}) == 1, "every rank must run the same number of micro-batches"
            for share in shares:
                seen += [i for b in share if b is not None for i in b]
        assert sorted(seen) == ids, (world, accum)
    assert rank_micro_batches([[1], [2], [3]], 1, 2) == [[2], None]
    with pytest.raises(ValueError, match="rank 2"):
        rank_micro_batches([[1]], 2, 2)


def test_epoch_tail_exercised(runs):
    """The data gives an epoch with an odd number of batches: rank 1 ran a weight-0 batch."""
    from eagleforge.shards import ShardReader

    base = runs["base"]
    reader = ShardReader(base.run / "hidden")
    n_train = len(reader) - base.train.holdout_samples
    counts = [len(make_batches(reader.sample_lengths(), list(range(n_train)), base.train.batch_tokens, base.train.seed, e))
              for e in range(base.train.epochs)]
    assert any(c % WORLD for c in counts), counts
    steps = sum(-(-c // WORLD) for c in counts)
    assert [s for s, _, _ in _losses(runs["fsdp"])] == list(range(1, steps + 1))


def test_resumed_run_matches_uninterrupted(runs):
    full, resumed, stopped = runs["fsdp"], runs["fsdp_resumed"], runs["stopped"]
    assert stopped["checkpoints"] == [f"step-{STOP_AT:06d}"]
    assert [s for s, _, _ in stopped["log"]] == list(range(1, STOP_AT + 1))
    ckpt = resumed.run / "checkpoints" / f"step-{STOP_AT:06d}"
    if ckpt.exists():  # kept when keep_last allows; written by 2 ranks
        assert sorted(p.name for p in ckpt.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    a, b = _losses(full), _losses(resumed)
    assert [s for s, _, _ in a] == [s for s, _, _ in b]
    for (step, la, lra), (_, lb, lrb) in zip(a, b):
        assert lb == pytest.approx(la, rel=1e-6, abs=1e-6), (step, la, lb)
        assert lrb == pytest.approx(lra, rel=1e-9)
    ea, eb = _export(full), _export(resumed)
    assert ea.keys() == eb.keys()
    for name in ea:
        assert torch.equal(ea[name], eb[name]), name
    sa = json.loads((full.run / "train_summary.json").read_text())
    sb = json.loads((resumed.run / "train_summary.json").read_text())
    assert sa["world_size"] == 2 and sa["parallel"] == "fsdp"
    assert sb["heldout"]["loss"] == pytest.approx(sa["heldout"]["loss"], rel=1e-6)


def _assert_same_curve(a_cfg, b_cfg, rel):
    a, b = _losses(a_cfg), _losses(b_cfg)
    assert [s for s, _, _ in a] == [s for s, _, _ in b]
    for (step, la, _), (_, lb, _) in zip(a, b):
        assert lb == pytest.approx(la, rel=rel), (step, la, lb)
    assert b[-1][1] < 0.8 * a[0][1], "the loss should fall"
    ea, eb = _export(a_cfg), _export(b_cfg)
    for name in ea:
        torch.testing.assert_close(eb[name].float(), ea[name].float(), rtol=0.02, atol=2e-3)


def test_two_ranks_fsdp_match_one_process(runs):
    """Same global batch (2 ranks x grad_accum 1 vs 1 process x grad_accum 2): same loss curve."""
    _assert_same_curve(runs["single"], runs["fsdp"], rel=1e-5)
    single = json.loads((runs["single"].run / "train_summary.json").read_text())
    fsdp = json.loads((runs["fsdp"].run / "train_summary.json").read_text())
    assert fsdp["train_tokens"] == single["train_tokens"]
    assert fsdp["heldout"]["tokens"] == single["heldout"]["tokens"]
    assert fsdp["heldout"]["loss"] == pytest.approx(single["heldout"]["loss"], rel=1e-5)


def test_two_ranks_ddp_match_one_process(runs):
    _assert_same_curve(runs["single"], runs["ddp"], rel=1e-5)
    summary = json.loads((runs["ddp"].run / "train_summary.json").read_text())
    assert (summary["world_size"], summary["parallel"]) == (2, "ddp")


def test_two_rank_checkpoint_resumes_on_one_process(runs, tmp_path):
    """DCP reshards: the 2-rank checkpoint after STOP_AT resumes in one process (grad_accum 2)
    and continues the 2-rank loss curve; the export loads from the sharded checkpoint."""
    from eagleforge.train.checkpoint import export_checkpoint, load_model_weights
    from eagleforge.train.loop import train

    cfg = _clone_run(runs["base"], "one_from_two", grad_accum=2)
    source = runs["fsdp_resumed"].run
    final = sorted((source / "checkpoints").iterdir())[-1]
    weights = load_model_weights(final)
    assert "fc.weight" in weights and not any(k.startswith("draft.") for k in weights)
    export_checkpoint(final, tmp_path / "draft")
    from safetensors.torch import load_file

    exported = load_file(str(tmp_path / "draft" / "model.safetensors"))
    assert torch.equal(exported["fc.weight"], weights["fc.weight"].bfloat16())
    assert torch.equal(exported["fc.weight"], _export(runs["fsdp_resumed"])["fc.weight"])

    # resume the STOP_AT checkpoint of the 2-rank run on one process
    stopped = source / "checkpoints" / f"step-{STOP_AT:06d}"
    assert stopped.is_dir(), "keep_last=2 keeps the STOP_AT checkpoint beside the final one"
    shutil.copytree(stopped, cfg.run / "checkpoints" / stopped.name)
    train(cfg)
    a, b = _losses(runs["fsdp"]), _losses(cfg)
    assert [s for s, _, _ in b] == [s for s, _, _ in a[STOP_AT:]]  # a fresh log from the resumed step on
    for (step, la, _), (_, lb, _) in zip(a[STOP_AT:], b):
        assert lb == pytest.approx(la, rel=1e-5), (step, la, lb)


def _disk_full_on_one_rank(rank: int, world: int, run_dir: str, out_dir: str) -> None:
    """Rank 1's own file of a checkpoint hits ENOSPC; every rank must raise the same one line."""
    import dataclasses
    import datetime
    import errno
    import os

    import torch.distributed as dist

    from eagleforge.config import Config
    from eagleforge.errors import UserInputError
    from eagleforge.layout import Layout
    from eagleforge.train import checkpoint

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))  # a hang shows as a timeout, not as a pass

    @dataclasses.dataclass
    class Sizes:
        width: int = 4

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.draft = torch.nn.Linear(4, 3)
            self.draft.config = Sizes()

    if rank == 1:
        def no_room(path, env):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

        checkpoint._save_rng = no_room
    model = Model()
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    cfg = Config(run_dir=run_dir)
    try:
        checkpoint.save_checkpoint(cfg, 3, model, optimizer, scheduler, {}, Layout(world_size=world, rank=rank))
        outcome = "saved"
    except UserInputError as err:
        outcome = f"UserInputError: {err}"
    except Exception as err:  # noqa: BLE001 - reported to the test, which names it
        outcome = f"{type(err).__name__}: {err}"
    with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
        f.write(outcome)
    dist.barrier()
    dist.destroy_process_group()


def test_disk_full_on_one_rank_stops_every_rank_with_the_same_line(tmp_path):
    """A checkpoint write that fails on one rank only (its RNG file, after DCP's shards): both ranks
    reach the same collectives and raise the same one-line error instead of waiting at a barrier
    until the process-group timeout; the unfinished directory is removed."""
    run = tmp_path / "run"
    spawn_ranks(_disk_full_on_one_rank, (str(run), str(tmp_path)), world=2)
    outcomes = [(tmp_path / f"rank{r}.txt").read_text() for r in range(2)]
    assert outcomes[0] == outcomes[1], outcomes
    assert outcomes[0].startswith("UserInputError: ") and "step-000003: cannot write, no space left on device" in outcomes[0]
    assert list((run / "checkpoints").iterdir()) == []
