"""The removed config keys (eagleforge.config.REMOVED_KEYS): naming one in a config file or on the
command line is the unknown-key error saying what it became and what to do; each value in the
table is the constant that replaced it; a checkpoint written with another value of a key that
shaped its training is not resumed."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from eagleforge.config import REMOVED_KEYS, TrainConfig, config_to_dict, load_config
from eagleforge.errors import ConfigError, UserInputError

# What each key's value was before its removal (its default then), as an old run's config.yaml holds it.
OLD_DEFAULTS = {"train.loss_chunk_tokens": 0, "train.loss_packed": False, "train.lk_variant": "lambda",
                "train.lk_kl_scale": 1.0, "train.lk_kl_decay": 3.0, "train.max_nonfinite_steps": 3,
                "train.step_weight_decay": 0.8, "train.min_lr_ratio": 0.1, "train.weight_decay": 0.0,
                "train.verify_checksums": True, "train.prefetch": 0, "target.split_rows_min_tokens": 1024,
                "target.overlap_min_rows": 4096}


def test_train_config_has_fewer_than_30_keys():
    assert len(dataclasses.fields(TrainConfig)) < 30
    assert sorted(REMOVED_KEYS) == sorted(OLD_DEFAULTS)
    assert not {key.split(".")[1] for key in REMOVED_KEYS if key.startswith("train.")} & {f.name for f in dataclasses.fields(TrainConfig)}


@pytest.mark.parametrize("key", sorted(OLD_DEFAULTS))
def test_a_removed_key_is_one_line_saying_what_to_do(key, tmp_path):
    _, why, todo = REMOVED_KEYS[key]
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"{key}={OLD_DEFAULTS[key]}"])
    assert str(err.value) == f"command line: unknown config key {key!r}: {key} was removed ({why}): {todo}"
    path = tmp_path / "old.yaml"
    section, leaf = key.split(".")
    path.write_text(yaml.safe_dump({section: {leaf: OLD_DEFAULTS[key]}}))
    with pytest.raises(ConfigError) as err:
        load_config(path, [])
    message = str(err.value)
    assert message.startswith(f"{path}: unknown config key {key!r}: {key} was removed (") and "delete it" in message
    assert "\n" not in message


def test_the_prefetch_message():
    with pytest.raises(ConfigError, match=r"train\.prefetch was removed \(online forwards always run in line\): delete it$"):
        load_config(None, ["train.prefetch=1"])


def test_each_removed_value_is_the_constant_that_replaced_it():
    from eagleforge.extract.native.parallel import OVERLAP_MIN_ROWS, SPLIT_ROWS_MIN_TOKENS
    from eagleforge.train import loop, sources, ttt_loss
    from eagleforge.train.loss import LK_OPTIONS

    now = {"train.loss_chunk_tokens": ttt_loss.LOSS_CHUNK_TOKENS or 0, "train.loss_packed": ttt_loss.LOSS_PACKED,
           "train.lk_variant": LK_OPTIONS["variant"], "train.lk_kl_scale": LK_OPTIONS["kl_scale"],
           "train.lk_kl_decay": LK_OPTIONS["kl_decay"], "train.max_nonfinite_steps": loop.MAX_NONFINITE_STEPS,
           "train.step_weight_decay": ttt_loss.STEP_WEIGHT_DECAY, "train.min_lr_ratio": loop.MIN_LR_RATIO,
           "train.weight_decay": loop.WEIGHT_DECAY, "train.verify_checksums": sources.VERIFY_CHECKSUMS,
           "train.prefetch": loop.ONLINE_PREFETCH, "target.split_rows_min_tokens": SPLIT_ROWS_MIN_TOKENS,
           "target.overlap_min_rows": OVERLAP_MIN_ROWS}
    assert {key: value for key, (value, _, _) in REMOVED_KEYS.items()} == now == OLD_DEFAULTS


def _old_checkpoint(tmp_path, **train):
    """A checkpoint directory whose config.yaml is the defaults' plus the removed keys at their old
    defaults, `train` (leaf: value) over them."""
    saved = config_to_dict(load_config(None, []))
    saved["train"].update({key.split(".")[1]: value for key, value in OLD_DEFAULTS.items()}, **train)
    checkpoint = tmp_path / "step-000002"
    checkpoint.mkdir()
    (checkpoint / "config.yaml").write_text(yaml.safe_dump(saved, sort_keys=False))
    return checkpoint


def test_resume_refuses_a_checkpoint_trained_with_another_removed_value(tmp_path):
    """An old run's checkpoint resumes when its removed keys held the values they always have now,
    or differ only in one that changed nothing a resume trains (prefetch, checksums, the loss's
    chunks, the non-finite limit), or in the LK loss's options of a run not trained with it; one
    trained with another step weight, lr floor, weight decay or LK option is refused in one line."""
    from eagleforge.train.checkpoint import check_resume_config

    cfg = load_config(None, [])
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    check_resume_config(cfg, _old_checkpoint(tmp_path / "a"))
    check_resume_config(cfg, _old_checkpoint(tmp_path / "b", prefetch=2, verify_checksums=False, loss_chunk_tokens=512,
                                             loss_packed=True, max_nonfinite_steps=10, lk_kl_decay=1.0))
    for train, words in ((dict(step_weight_decay=0.9), "train.step_weight_decay: 0.9 in the checkpoint, removed and always 0.8 now"),
                         (dict(weight_decay=0.01), "train.weight_decay: 0.01 in the checkpoint"),
                         (dict(min_lr_ratio=0.0), "train.min_lr_ratio: 0.0 in the checkpoint"),
                         (dict(loss="lk", lk_variant="alpha"), "train.lk_variant: 'alpha' in the checkpoint")):
        name = "_".join(train)
        (tmp_path / name).mkdir()
        with pytest.raises(UserInputError) as err:
            check_resume_config(load_config(None, [f"train.loss={train.get('loss', 'auto')}"]), _old_checkpoint(tmp_path / name, **train))
        assert words in str(err.value) and "Removed config keys" in str(err.value) and "\n" not in str(err.value)
