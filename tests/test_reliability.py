"""Reliability: a user's bad input gives the project's own one-line errors, never a traceback.

(a) seeded-mutation fuzzing of the data stage's JSONL loader, (b) of config overrides and config
files, (c) the command line's exit code 2 and one stderr line, (d) run files from another
target refused by the trainer, (e) no unsafe deserialization in the package sources.
See RELIABILITY.md for the table of faults and the tests that keep each row true.
"""

from __future__ import annotations

import ast
import contextlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from eagleforge.atomic import write_jsonl_atomic
from eagleforge.config import Config, load_config
from eagleforge.data.sources import Stats, _read_local, _RowChecker, load_records
from eagleforge.errors import ConfigError, UserInputError

REPO = Path(__file__).resolve().parents[1]
FUZZ = settings(max_examples=250, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))


# ----------------------------------------------------------------------------- (a) data rows

_text = st.text(alphabet=st.characters(codec=None, exclude_categories=()), max_size=12)  # lone surrogates included
_scalar = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True), _text)
_json = st.recursive(_scalar, lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(_text, inner, max_size=4)),
                     max_leaves=12)
_role = st.one_of(st.sampled_from(["system", "user", "assistant", "human", "gpt", "tool", "", "USER"]), _json)
_turn = st.one_of(
    st.fixed_dictionaries({"role": _role, "content": st.one_of(_text, _json)}),
    st.fixed_dictionaries({"from": _role, "value": st.one_of(_text, _json)}),
    st.dictionaries(st.sampled_from(["role", "content", "from", "value", "x"]), _json, max_size=3),
    _json,
)
_ids = st.lists(st.one_of(st.integers(-5, 300), st.integers(-(2**64), 2**64), st.booleans(), st.floats(), _text), max_size=8)
_row = st.one_of(
    *[st.fixed_dictionaries({key: st.one_of(st.lists(_turn, max_size=4), _json)}) for key in ("messages", "conversations")],
    st.fixed_dictionaries({"prompt": st.one_of(_text, _json)}),
    st.fixed_dictionaries({"input_ids": st.one_of(_ids, _json)},
                          optional={"loss_mask": st.one_of(st.lists(st.sampled_from([0, 1, 2, -1, True, 0.5]), max_size=9), _json)}),
    st.dictionaries(_text, _json, max_size=3),
    _json,
)


@st.composite
def _line(draw) -> bytes:
    """One JSONL line: a random row, optionally mutated at the byte level (cut, flip, insert)."""
    data = json.dumps(draw(_row), ensure_ascii=draw(st.booleans())).encode("utf-8", "surrogatepass")
    mutation = draw(st.sampled_from(["none", "none", "cut", "flip", "insert", "bytes", "deep"]))
    if mutation == "cut" and data:
        data = data[: draw(st.integers(0, len(data) - 1))]
    elif mutation == "flip" and data:
        i = draw(st.integers(0, len(data) - 1))
        data = data[:i] + bytes([data[i] ^ (1 << draw(st.integers(0, 7)))]) + data[i + 1 :]
    elif mutation == "insert":
        i = draw(st.integers(0, len(data)))
        data = data[:i] + draw(st.binary(min_size=1, max_size=4)) + data[i:]
    elif mutation == "bytes":
        data = draw(st.binary(max_size=20))
    elif mutation == "deep":  # deeper than Python's recursion limit
        data = b"[" * 50_000 + b"]" * 50_000
    return data.replace(b"\n", b" ")


@FUZZ
@given(lines=st.lists(_line(), min_size=1, max_size=6), strict=st.booleans(), regenerate=st.booleans(),
       vocab_size=st.sampled_from([None, 1, 256]))
def test_fuzzed_jsonl_rows_give_only_project_errors(lines, strict, regenerate, vocab_size):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "in.jsonl"
        path.write_bytes(b"\n".join(lines) + b"\n")
        stats = Stats()
        checker = _RowChecker(f"data.source {path}", regenerate, strict, vocab_size, stats)
        try:
            valid = _read_local(path, checker)
        except UserInputError as err:
            assert str(path) in str(err) and "\n" not in str(err)
            return
        rows = sum(1 for line in lines if line.strip())
        assert len(valid) + stats.skipped_malformed == rows
        assert all(isinstance(m["line"], int) and m["reason"] for m in stats.malformed_lines)
        for _, fields in valid:
            if "input_ids" in fields:
                ids, mask = fields["input_ids"], fields["loss_mask"]
                assert len(ids) == len(mask) and any(mask) and set(mask) <= {0, 1}
                assert all(type(t) is int and (vocab_size is None or 0 <= t < vocab_size) for t in ids)
            else:
                assert all(m["role"] in ("system", "user", "assistant") and isinstance(m["content"], str) for m in fields["messages"])
        # Valid rows must survive the canonical rewrite (RUN/data/input.clean.jsonl) and read back equal.
        clean = Path(tmp) / "clean.jsonl"
        write_jsonl_atomic(clean, (f for _, f in valid))
        assert [json.loads(x) for x in clean.read_text(encoding="utf-8").splitlines()] == [f for _, f in valid]


def test_lone_surrogate_and_deep_nesting_are_skipped_rows(tmp_path):
    """Regression: '\\ud800' in a message crashed the clean rewrite with UnicodeEncodeError and
    100k nested '[' crashed json with RecursionError; both are now counted malformed rows."""
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join([
        json.dumps(good),
        '{"messages": [{"role": "user", "content": "a\\ud800"}, {"role": "assistant", "content": "b"}]}',
        "[" * 100_000,
        '{"prompt": "\\udfff"}',
    ]) + "\n")
    cfg = Config(run_dir=str(tmp_path / "run"))
    cfg.data.source, cfg.data.regenerate = str(path), False
    (tmp_path / "data").mkdir()
    stats = Stats()
    records = load_records(cfg, tmp_path / "data", 49152, stats)
    assert [r.id for r in records] == [0] and records[0].messages == good["messages"]
    assert [m["line"] for m in stats.malformed_lines] == [2, 3, 4]
    assert "surrogate" in stats.malformed_lines[0]["reason"] and "deep" in stats.malformed_lines[1]["reason"]
    cfg.data.strict = True
    with pytest.raises(UserInputError, match="line 2: .*surrogate"):
        load_records(cfg, tmp_path / "data", 49152, Stats())


# ----------------------------------------------------------------------------- (b) config


def _known_keys() -> list[str]:
    import dataclasses

    keys = []
    for f in dataclasses.fields(Config):
        sub = getattr(Config(), f.name)
        keys += [f"{f.name}.{g.name}" for g in dataclasses.fields(sub)] if dataclasses.is_dataclass(sub) else [f.name]
    return keys


_value_text = st.one_of(
    st.sampled_from(["", "[", "]", "{", "1e-4", "1e999", ".nan", "-1", "0", "true", "null", "~", "[1, 2]", "{a: 1}",
                     "!!python/object:os.system", "&a [*a]", "'", "\"", "a: b: c", "%YAML", "@", "`", "\t", "3.5"]),
    st.text(max_size=10),
)


def test_activation_checkpoint_per_step_is_checked_against_ttt_steps():
    cfg = load_config(None, ["train.ttt_steps=7", "train.activation_checkpoint=selective*3+selective_all*4"])
    assert cfg.train.activation_checkpoint == "selective*3+selective_all*4"
    for bad, what in (("selective*3+selective_all*3", "7 steps"), ("selective*3+quick*4", "unknown"),
                      ("sometimes", "must be one of")):
        with pytest.raises(ConfigError, match=what):
            load_config(None, ["train.ttt_steps=7", f"train.activation_checkpoint={bad}"])


def _numeric_fields() -> list[tuple[str, type]]:
    """("section.key", int or float) of every numeric field of every config section."""
    import dataclasses

    out = []
    for section in dataclasses.fields(Config):
        sub = getattr(Config(), section.name)
        if dataclasses.is_dataclass(sub):
            out += [(f"{section.name}.{f.name}", {"int": int, "float": float}[f.type])
                    for f in dataclasses.fields(sub) if f.type in ("int", "float")]
    return out


def test_every_numeric_key_has_its_range_checked():
    """Every int/float key of every section: its default passes, a value just outside its range
    (and NaN/inf for floats) is a one-line ConfigError naming the key and the value. Regression:
    train.log_every=0, train.batch_tokens=0, train.lr=-1, vocab.draft_vocab_size=0,
    data.max_new_tokens=0, data.gen_batch_size=0 crashed later with a traceback;
    train.warmup_ratio=-1, train.grad_accum=0 and extract.batch_tokens=-1 were accepted."""
    from eagleforge.config import RANGES

    numeric = _numeric_fields()
    assert len(numeric) >= 35, numeric  # the walk really saw the sections
    assert sorted(k for k, _ in numeric) == sorted(RANGES), "a numeric key without a range, or a range without a key"
    defaults = load_config(None, [])
    for key, typ in numeric:
        section, leaf = key.split(".")
        assert load_config(None, [f"{key}={getattr(getattr(defaults, section), leaf)}"]) is not None  # default in range
        low, high = RANGES[key]
        step = 1 if typ is int else 0.25
        bad = [v for v in (None if low is None else low - step, None if high is None else high + step) if v is not None]
        if typ is float:
            bad += [float("nan"), float("inf")]
        assert bad, key
        for value in bad:
            with pytest.raises(ConfigError) as err:
                load_config(None, [f"{key}={value!r}" if typ is int else f"{key}={value}"])
            message = str(err.value)
            assert repr(key) in message and "\n" not in message, message
            assert (str(value) if typ is int else ("nan" if value != value else "inf" if value == float("inf") else str(value))) in message
        # the bounds themselves are in range
        for value in (low, high):
            if value is not None:
                assert load_config(None, [f"{key}={value}"]) is not None


@pytest.mark.parametrize("override", [
    "train.log_every=0", "train.batch_tokens=0", "train.lr=-1e-3", "vocab.draft_vocab_size=0", "data.max_new_tokens=0",
    "data.gen_batch_size=0", "train.warmup_ratio=-0.1", "train.grad_accum=0",
    "extract.batch_tokens=-1", "eval.ngram_min=4",
])
def test_reported_bad_values_are_config_errors(override):
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, [override])


@FUZZ
@example(overrides=[("0\n0", "1", True)])  # found on the device run: the key was printed raw, newline and all
@given(overrides=st.lists(st.tuples(st.one_of(st.sampled_from(_known_keys()), st.text(max_size=12)), _value_text,
                                    st.booleans()), max_size=4))
def test_fuzzed_overrides_give_only_config_errors(overrides):
    items = [f"{k}={v}" if eq else f"{k}{v}" for k, v, eq in overrides]
    try:
        cfg = load_config(None, items)
    except ConfigError as err:
        assert "\n" not in str(err)
        return
    assert isinstance(cfg, Config)


@FUZZ
@given(text=st.one_of(st.text(max_size=60), st.sampled_from([
    "train: {lr: [}", "train: 3", "train: {1: 2}", "? [a]\n: 1", "- 1\n- 2", "data: {num_prompts: 0}",
    "!!python/object/apply:os.system ['true']", "train:\n  lr: &x [*x]", "run_dir: {a: 1}", "a: b: c",
])), raw=st.booleans(), junk=st.binary(max_size=8))
def test_fuzzed_config_files_give_only_config_errors(text, raw, junk):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "c.yaml"
        path.write_bytes(junk + b"\xff" if raw else text.encode("utf-8", "surrogatepass"))
        try:
            load_config(path)
        except ConfigError as err:
            assert "\n" not in str(err)


def test_a_key_or_section_given_twice_in_a_config_file_is_named_with_its_line(tmp_path):
    """PyYAML keeps the last of two equal keys: a second `train:` section dropped the first one's
    keys, a second `lr:` replaced the first, without a word. Now a ConfigError names the file,
    the line and the key; a command-line value's mapping is checked the same way."""
    section = tmp_path / "section.yaml"
    section.write_text("train:\n  lr: 1.0e-3\nvocab:\n  draft_vocab_size: 100\ntrain:\n  epochs: 3\n")
    with pytest.raises(ConfigError, match=rf"^{section}: line 5: key 'train' is given twice \(first on line 1\)"):
        load_config(section)
    key = tmp_path / "key.yaml"
    key.write_text("train:\n  lr: 1.0e-3\n  epochs: 2\n  lr: 2.0e-3\n")
    with pytest.raises(ConfigError, match=rf"^{key}: line 4: key 'train.lr' is given twice \(first on line 2\)"):
        load_config(key)
    with pytest.raises(ConfigError, match="key 'a' is given twice"):
        load_config(None, ["extract.aux_layers={a: 1, a: 2}"])
    merged = tmp_path / "merged.yaml"  # a merge key's values are overridden, as YAML means it
    merged.write_text("train:\n  <<: {lr: 1.0e-3, epochs: 2}\n  lr: 2.0e-3\n")
    assert load_config(merged).train.lr == 2e-3


def _alias_bomb(levels: int) -> str:
    """A YAML value of `levels` lists, each holding the one before it 9 times: a few hundred
    bytes that expand to 9**levels strings."""
    items = ['&l0 ["x","x","x","x","x","x","x","x","x"]']
    items += [f"&l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, levels)]
    return "[" + ", ".join(items) + "]"


@pytest.mark.parametrize("where", ["file", "command line"])
def test_an_alias_bomb_or_a_huge_list_gives_a_short_error_line(tmp_path, where):
    """A YAML alias bomb (9**7 strings from 600 bytes) or a 20,000-item list where a number or a
    short list belongs: before, the error line held the whole value (230 MB for the bomb's
    repr, 130 kB for the list). Now every error line is short, showing the value's start and
    how much more there was, and the bomb is refused before anything walks it."""
    import time

    values = {"train.lr": _alias_bomb(7), "train.epochs": "[" + ", ".join(map(str, range(20_000))) + "]",
              "extract.aux_layers": "[" + ", ".join(map(str, range(20_000))) + "]"}
    for key, value in values.items():
        section, leaf = key.split(".")
        if where == "file":
            path = tmp_path / f"{leaf}.yaml"
            path.write_text(f"{section}:\n  {leaf}: {value}\n")
            load = lambda: load_config(path)  # noqa: E731
        else:
            load = lambda: load_config(None, [f"{key}={value}"])  # noqa: E731
        start = time.monotonic()
        with pytest.raises(ConfigError) as err:
            load()
        message = str(err.value)
        assert len(message) < 400 and "\n" not in message, (key, len(message), message[:400])
        assert time.monotonic() - start < 10, key
        assert ("more than 100000 values" in message) if key == "train.lr" else ("(19994 more)" in message), message


def test_an_empty_run_dir_is_refused_instead_of_writing_into_the_current_directory(tmp_path):
    """`run_dir=` made Path(""), the current directory: the train stage wrote its config.yaml
    there (and would have written checkpoints and the export). Now one error line naming the
    key, exit 2, and nothing written."""
    proc = _cli("eagleforge.train", "run_dir=", cwd=tmp_path)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: config key 'run_dir' is empty"), proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    for blank in ("run_dir= ", "run_dir=\t"):
        with pytest.raises(ConfigError, match="'run_dir' is empty"):
            load_config(None, [blank])


# ----------------------------------------------------------------------------- (c) command line


def _cli(module: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "TRANSFORMERS_VERBOSITY": "error"}
    env.pop("CONFIG", None)
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("module,args,named", [
    ("eagleforge.train", ["run_dir={run}"], "manifest.json"),
    ("eagleforge.extract", ["--config", "{run}/missing.yaml"], "missing.yaml"),
    ("eagleforge.train", ["run_dir={run}", "train.no_such_key=1"], "train.no_such_key"),
    ("eagleforge.train", ["run_dir={run}", "train.lr=fast"], "'train.lr' expects float, got str 'fast'"),
    ("eagleforge.extract", ["run_dir={run}", "extract.storage_dtype=int4"], "extract.storage_dtype"),
])
def test_cli_user_mistakes_exit_2_with_one_line(tmp_path, module, args, named):
    run = tmp_path / "empty_run"
    run.mkdir()
    proc = _cli(module, *[a.format(run=run) for a in args], cwd=tmp_path)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("error: ") and named in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


# ----------------------------------------------------------------------------- (d) run files from another target


@pytest.fixture()
def vocab_run(tmp_path, tiny_llama_config):
    from test_vocab import build_tiny_run

    from eagleforge.vocab import main as vocab_main

    torch.set_num_threads(1)
    cfg, _, _ = build_tiny_run(tmp_path, tiny_llama_config, n_samples=5, samples_per_shard=5)
    cfg.vocab.draft_vocab_size = 40
    cfg.train.holdout_samples = 1
    cfg.train.max_steps = 1
    vocab_main(cfg)
    return cfg, tiny_llama_config


def test_vocab_map_of_another_vocabulary_refused(vocab_run):
    from safetensors.torch import load_file, save_file

    from eagleforge.train.loop import train

    cfg, llama = vocab_run
    path = cfg.run / "vocab" / "vocab_map.safetensors"
    vocab = load_file(str(path))
    extra = 7  # a vocabulary map built for a target with V + 7 ids (same draft ids)
    vocab["t2d"] = torch.cat([vocab["t2d"], torch.zeros(extra, dtype=vocab["t2d"].dtype)])
    vocab["counts"] = torch.cat([vocab["counts"], torch.zeros(extra, dtype=vocab["counts"].dtype)])
    save_file(vocab, str(path))
    with pytest.raises(UserInputError, match=rf"vocab.*{llama.vocab_size + extra}"):
        train(cfg)


def test_target_of_another_hidden_size_refused(vocab_run):
    from transformers import LlamaForCausalLM

    from eagleforge.train.loop import train
    from eagleforge.vocab import main as vocab_main

    cfg, llama = vocab_run
    other = llama.__class__(**{**llama.to_dict(), "hidden_size": llama.hidden_size + 3 * llama.head_dim})
    LlamaForCausalLM(other).save_pretrained(cfg.run.parent / "other_target", safe_serialization=True)
    cfg.target.path = str(cfg.run.parent / "other_target")
    # Regression: with the vocab stage rerun for the new target, only the shards' hidden size
    # disagreed and training died in Eagle3Draft.fuse with a ValueError traceback.
    for rerun_vocab in (False, True):
        if rerun_vocab:
            vocab_main(cfg)
        with pytest.raises(UserInputError, match=rf"hidden_size {llama.hidden_size} .*has {other.hidden_size}"):
            train(cfg)


def test_training_refuses_a_corrupt_shard_or_skips_it_when_configured(vocab_run, caplog):
    """sha256 at the start of training (always): a bit flip is an
    error naming the shard; with train.skip_corrupt_shards the run goes on without it and says
    how many samples it left out."""
    from eagleforge.shards import load_manifest
    from eagleforge.train.loop import train

    cfg, _ = vocab_run
    cfg.train.holdout_samples = 0
    hidden = cfg.run / "hidden"
    extra = torch.Generator().manual_seed(9)
    # a second shard to lose, written like the first (copy of shard 0's samples under new ids)
    from eagleforge.shards import ShardReader, ShardWriter

    reader = ShardReader(hidden)
    writer = ShardWriter(hidden, {k: v for k, v in reader.manifest.items() if k != "shards"}, reader.manifest["storage_dtype"])
    samples = [reader[i] for i in range(len(reader))]
    writer.write_shard(1, samples, [100 + i for i in range(len(samples))])
    path = hidden / load_manifest(hidden)["shards"][1]["file"]
    data = bytearray(path.read_bytes())
    data[len(data) - 1 - int(torch.randint(0, 64, (1,), generator=extra))] ^= 0x04
    path.write_bytes(bytes(data))
    with pytest.raises(UserInputError, match=rf"{path.name}: sha256 .* does not match"):
        train(cfg)
    cfg.train.skip_corrupt_shards = True
    with caplog.at_level("WARNING"):
        summary = train(cfg)
    assert summary["steps"] == 1 and summary["train_samples"] == len(samples)
    assert path.name in caplog.text and f"{len(samples)} samples" in caplog.text


@pytest.mark.parametrize("key,value,named", [
    ("num_key_value_heads", 2, "num_key_value_heads"),  # 3 heads are not a multiple of 2
    ("hidden_size", -4, "hidden_size"),
])
def test_draft_config_that_does_not_fit_is_a_one_line_error(vocab_run, key, value, named):
    from eagleforge.train.loop import train

    cfg, _ = vocab_run
    if key == "num_key_value_heads":
        cfg.draft.num_attention_heads = 3
    setattr(cfg.draft, key, value)
    try:
        train(cfg)
    except (UserInputError, ConfigError) as err:
        assert named in str(err) and "\n" not in str(err)
    else:
        pytest.fail(f"draft.{key}={value} was accepted")


def test_sizes_past_a_model_s_range_are_refused_before_anything_is_allocated(vocab_run):
    """A draft.* size or a size read from a file (the target's config.json, the shard manifest)
    past the range of a model's sizes: one line naming the key, the value and the range, before
    any tensor is allocated by it. Before: draft.hidden_size=10**7 was accepted, a target
    config.json claiming a trillion-token vocabulary made the trainer ask for a 192 TB embedding
    and the vocab stage for 8 TB of token counts (a RuntimeError from the allocator at best)."""
    from eagleforge.train.loop import train
    from eagleforge.vocab import main as vocab_main

    cfg, _ = vocab_run
    with pytest.raises(ConfigError, match=r"'draft.hidden_size' must be in \[0, 65536\], got 10000000$"):
        load_config(None, ["draft.hidden_size=10000000"])
    with pytest.raises(ConfigError, match=r"'vocab.draft_vocab_size' must be in \[1, 4194304\], got 4194305$"):
        load_config(None, ["vocab.draft_vocab_size=4194305"])

    config_file = Path(cfg.target.path) / "config.json"
    original = config_file.read_text()
    config_file.write_text(json.dumps({**json.loads(original), "vocab_size": 10**12}))
    with pytest.raises(UserInputError, match=r"vocab_size = 1000000000000 is outside \[1, 4194304\], the range of a model's sizes"):
        train(cfg)
    config_file.write_text(original)

    manifest = cfg.run / "hidden" / "manifest.json"
    data = json.loads(manifest.read_text())
    data["target"]["vocab_size"] = 2**40
    manifest.write_text(json.dumps(data))
    with pytest.raises(UserInputError, match=rf"^{manifest}: target: vocab_size = 1099511627776 is outside \[1, 4194304\]"):
        vocab_main(cfg)


def test_remote_code_is_not_run_unless_configured(tmp_path):
    """A target directory whose config asks for custom code: with the default
    target.trust_remote_code=false nothing of it runs and the load is a one-line error."""
    from eagleforge.config import TargetConfig
    from eagleforge.target.loading import load_target

    target, marker = tmp_path / "remote_target", tmp_path / "code_ran"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({
        "model_type": "eagleforge_remote_probe", "architectures": ["ProbeForCausalLM"],
        "auto_map": {"AutoConfig": "probe.ProbeConfig", "AutoModelForCausalLM": "probe.ProbeForCausalLM"}}))
    (target / "probe.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    assert TargetConfig().trust_remote_code is False and Config().target.trust_remote_code is False
    with pytest.raises(UserInputError, match=rf"target.path {target}: .*custom code"):
        load_target(TargetConfig(path=str(target), device="cpu"))
    assert not marker.exists()


class _OpenMarker:
    """A pickle payload: unpickling it creates the file `path` (stands for any code)."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_resuming_a_checkpoint_never_unpickles_its_files(vocab_run):
    """A checkpoint directory from elsewhere (a shared disk, a download): resuming from it must not
    run code hidden in it. torch.distributed.checkpoint reads its `.metadata` with pickle.load."""
    import pickle

    from eagleforge.train.loop import train

    cfg, _ = vocab_run
    cfg.train.holdout_samples = 0
    train(cfg)  # one step: RUN/checkpoints/step-000001/
    [ckpt] = [p for p in (cfg.run / "checkpoints").iterdir() if p.name.startswith("step-")]
    marker = cfg.run.parent / "code_ran"
    pickled = [f for f in ckpt.rglob("*") if f.is_file() and f.name in (".metadata", "optimizer.pt")]
    if not pickled:
        pytest.skip(f"{ckpt} holds no pickled file")
    for f in pickled:
        f.write_bytes(pickle.dumps(_OpenMarker(marker)))
    _restamp(ckpt)  # the checksums agree: what must stop the payload is the restricted unpickler
    cfg.train.max_steps = 2
    try:
        train(cfg)
    except (UserInputError, ConfigError, FileNotFoundError):
        pass
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as err:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        if not marker.exists():
            pytest.fail(f"a damaged checkpoint gave a traceback instead of a one-line error: {type(err).__name__}: {err}")
    assert not marker.exists(), f"{', '.join(f.name for f in pickled)} of {ckpt.name} was unpickled on resume"


def _trained_checkpoint(cfg) -> Path:
    from eagleforge.train.loop import train

    cfg.train.holdout_samples = 0
    train(cfg)  # one step: RUN/checkpoints/step-000001/
    [ckpt] = [p for p in (cfg.run / "checkpoints").iterdir() if p.name.startswith("step-")]
    return ckpt


def _restamp(ckpt: Path) -> None:
    """Rewrite checksums.json over the directory as it is now: a crafted checkpoint passes its own
    checksums, so what must stop it is the metadata check."""
    from eagleforge.train.checkpoint_integrity import CHECKSUMS_FILE, describe_files, write_checksums

    (ckpt / CHECKSUMS_FILE).unlink()
    write_checksums(ckpt, describe_files([f for f in ckpt.iterdir()]))


def _resume_and_export_refuse(cfg, ckpt: Path, marker: Path, why: str) -> None:
    from eagleforge.train.checkpoint import export_checkpoint
    from eagleforge.train.loop import train

    cfg.train.max_steps = 2
    for attempt in (lambda: train(cfg), lambda: export_checkpoint(ckpt, cfg.run / "exported")):
        with pytest.raises(UserInputError) as refused:
            attempt()
        assert str(ckpt) in str(refused.value) and why in str(refused.value), refused.value
        assert "\n" not in str(refused.value)
        assert not marker.exists(), "code from the checkpoint ran"


def _dotted_global_payload(module: str, dotted: str, argument) -> bytes:
    """A protocol-4 pickle calling the global `module`:`dotted` (a dotted name, which pickle's
    STACK_GLOBAL resolves attribute by attribute) with one argument: (module, name) pass any check
    on the module alone."""
    import pickle

    def text(value: str) -> bytes:
        data = value.encode()
        return pickle.SHORT_BINUNICODE + bytes([len(data)]) + data

    return (pickle.PROTO + bytes([4]) + text(module) + text(dotted) + pickle.STACK_GLOBAL
            + pickle.dumps((argument,), protocol=4)[2:-1] + pickle.REDUCE + pickle.STOP)


def _reachable(module: str, dotted: str):
    import importlib

    obj = importlib.import_module(module)
    for part in dotted.split("."):
        obj = getattr(obj, part, None)
    return obj


def test_checkpoint_metadata_naming_code_through_an_allowed_module_never_runs(vocab_run):
    """pickle resolves a dotted name from an allowed module through whatever that module imports:
    `torch.distributed.checkpoint.metadata` + `torch._strobelight....subprocess.Popen` is Popen.
    The unpickler looks a name up only as the module's own attribute: refused, nothing runs."""
    import pickle

    dotted = "torch._strobelight.cli_function_profiler.subprocess.Popen"
    module = "torch.distributed.checkpoint.metadata"
    if _reachable(module, dotted) is None:
        dotted = "torch.ctypes.CDLL"  # another class the module reaches (loading a library runs its code)
    cfg, _ = vocab_run
    ckpt = _trained_checkpoint(cfg)
    probe, marker = cfg.run.parent / "probe_ran", cfg.run.parent / "code_ran"
    if dotted.endswith("Popen"):  # the payload is live: plain pickle runs it
        pickle.loads(_dotted_global_payload(module, dotted, ["touch", str(probe)])).wait()
        assert probe.exists()
    (ckpt / ".metadata").write_bytes(_dotted_global_payload(module, dotted, ["touch", str(marker)]))
    _restamp(ckpt)
    _resume_and_export_refuse(cfg, ckpt, marker, "is not part of a checkpoint's metadata")
    assert not marker.exists()


def _craft_bytes_entry(ckpt: Path, metadata, fqn: str, marker: Path) -> None:
    """Mark `fqn` as bytes stored in `__7_0.distcp`, which holds a payload that creates `marker`."""
    import pickle

    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    payload = pickle.dumps(_OpenMarker(marker))
    (ckpt / "__7_0.distcp").write_bytes(payload)
    metadata.state_dict_metadata[fqn] = BytesStorageMetadata()
    metadata.storage_data = {k: v for k, v in metadata.storage_data.items() if k.fqn != fqn}
    metadata.storage_data[MetadataIndex(fqn)] = _StorageInfo("__7_0.distcp", 0, len(payload))


def test_checkpoint_metadata_of_allowed_classes_cannot_steer_dcp_into_unpickling(vocab_run):
    """A .metadata made only of DCP's own classes, one entry marked as bytes and pointing at a
    pickle payload in a file of the checkpoint: DCP's load planner would torch.load it with
    weights_only=False. Refused on resume and on export, before any read; the payload never runs."""
    import pickle

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    from eagleforge.train.checkpoint import _single_process_ok

    cfg, _ = vocab_run
    ckpt = _trained_checkpoint(cfg)
    with open(ckpt / ".metadata", "rb") as f:
        metadata = pickle.load(f)  # the test's own, freshly written file
    fqn = sorted(k for k in metadata.state_dict_metadata if k.startswith("model."))[0]

    # The crafted checkpoint is live: DCP's own reader, given the same metadata, runs the payload.
    probe = cfg.run.parent / "probe_ran"
    _craft_bytes_entry(ckpt, metadata, fqn, probe)

    class PlainReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            return metadata

    with _single_process_ok(), contextlib.suppress(BaseException):
        dcp.load({fqn: torch.zeros(1)}, storage_reader=PlainReader(str(ckpt)), no_dist=True)
    assert probe.exists(), "DCP did not unpickle a bytes entry: the crafted checkpoint tests nothing"

    marker = cfg.run.parent / "code_ran"
    _craft_bytes_entry(ckpt, metadata, fqn, marker)
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))
    _restamp(ckpt)
    _resume_and_export_refuse(cfg, ckpt, marker, "not a tensor")


@pytest.mark.parametrize("name", ["../outside.distcp", "/etc/hostname", "state.json", "__0_0.distcp/x", "__5_0.distcp"])
def test_checkpoint_metadata_naming_a_file_outside_the_checkpoint_is_refused(vocab_run, name):
    """A storage entry may name only a DCP data file of the checkpoint itself; `__5_0.distcp` is
    such a name but a symbolic link to a file outside."""
    import pickle

    from torch.distributed.checkpoint.filesystem import _StorageInfo

    cfg, _ = vocab_run
    ckpt = _trained_checkpoint(cfg)
    with open(ckpt / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    index, info = next(iter(metadata.storage_data.items()))
    metadata.storage_data[index] = _StorageInfo(name, info.offset, info.length)
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))
    why = "not a checkpoint data file inside the checkpoint"
    if name == "__5_0.distcp":
        outside = cfg.run.parent / "outside.distcp"
        outside.write_bytes((ckpt / "__0_0.distcp").read_bytes())
        (ckpt / name).symlink_to(outside)
        why = "not a plain file"
    _restamp(ckpt)
    _resume_and_export_refuse(cfg, ckpt, cfg.run.parent / "never", why)


def test_flipped_bytes_in_a_checkpoint_are_refused_on_resume_and_export(vocab_run):
    """64 bytes flipped in the middle of the tensor data (same size): the sha256 in checksums.json
    no longer matches; so do a deleted file, an added one and a damaged checksum list."""
    cfg, _ = vocab_run
    ckpt = _trained_checkpoint(cfg)
    data = ckpt / "__0_0.distcp"
    original = data.read_bytes()
    mid = len(original) // 2
    data.write_bytes(original[:mid] + bytes(b ^ 0xFF for b in original[mid:mid + 64]) + original[mid + 64:])
    _resume_and_export_refuse(cfg, ckpt, cfg.run.parent / "never", "sha256 does not match")
    data.write_bytes(original)
    (ckpt / "extra.bin").write_bytes(b"x")
    _resume_and_export_refuse(cfg, ckpt, cfg.run.parent / "never", "not listed in checksums.json")
    (ckpt / "extra.bin").unlink()
    (ckpt / "checksums.json").write_text("{\"__0_0.distcp\": 3}")
    _resume_and_export_refuse(cfg, ckpt, cfg.run.parent / "never", "not a checkpoint's checksum list")


def test_disk_full_during_a_checkpoint_is_one_line_and_keeps_the_last_one(vocab_run, monkeypatch):
    """ENOSPC inside DCP's writer at the second checkpoint (DCP wraps it in a CheckpointException
    whose text is a traceback per rank): one line naming the checkpoint and the free space; the
    unfinished directory is gone and the first checkpoint stays whole (it still resumes)."""
    import errno

    import torch.distributed.checkpoint.filesystem as dcp_fs

    from eagleforge.train.checkpoint import read_state
    from eagleforge.train.loop import train

    cfg, _ = vocab_run
    cfg.train.holdout_samples = 0
    cfg.train.max_steps, cfg.train.save_every = 2, 1
    real_write, calls = dcp_fs._write_item, []

    def write_item(*args, **kwargs):
        calls.append(1)
        if len(calls) > writes_per_checkpoint[0]:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(*args, **kwargs)

    writes_per_checkpoint = [10**9]
    monkeypatch.setattr(dcp_fs, "_write_item", write_item)
    cfg.train.max_steps = 1
    train(cfg)
    writes_per_checkpoint[0] = len(calls)  # the first checkpoint's writes pass, the next one's fail
    cfg.train.max_steps = 2
    with pytest.raises(UserInputError) as full:
        train(cfg)
    message = str(full.value)
    assert "step-000002: cannot write, no space left on device" in message and "GiB free there" in message, message
    assert "\n" not in message and "Traceback" not in message
    root = cfg.run / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step-000001"]
    assert read_state(root / "step-000001")["step"] == 1  # checksums intact


# ----------------------------------------------------------------------------- (f) SIGKILL during training

TRAIN_STEPS, SAVE_EVERY = 40, 5


def _train_overrides(cfg, run: Path) -> list[str]:
    return [f"run_dir={run}", f"target.path={cfg.target.path}", "target.device=cpu", "train.device=cpu",
            "vocab.draft_vocab_size=40", "train.ttt_steps=3", "train.batch_tokens=160", "train.lr=3e-3",
            "train.warmup_ratio=0.05", "train.holdout_samples=2", "train.log_every=1", "eval.k=2",
            f"train.max_steps={TRAIN_STEPS}", f"train.save_every={SAVE_EVERY}", "train.keep_last=2"]


def _train_cli(args: list[str]) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "TRANSFORMERS_VERBOSITY": "error"}
    env.pop("CONFIG", None)
    return subprocess.Popen([sys.executable, "-m", "eagleforge.train", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen) -> tuple[int, str]:
    _, stderr = proc.communicate(timeout=300)
    return proc.returncode, stderr


def _kill_after_checkpoint(run: Path, args: list[str], after: int) -> None:
    """Start training, SIGKILL it as soon as a checkpoint of step >= `after` exists."""
    import signal
    import time

    proc = _train_cli(args)
    deadline = time.monotonic() + 300
    try:
        while time.monotonic() < deadline:
            steps = [int(p.name.split("-")[1]) for p in (run / "checkpoints").glob("step-*")]
            if steps and max(steps) >= after:
                proc.send_signal(signal.SIGKILL)
                break
            if proc.poll() is not None:
                break
            time.sleep(0.005)
        code, stderr = _finish(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == -signal.SIGKILL, f"the run ended before it could be killed (rc {code}): {stderr[-2000:]}"


def _checkpoint_states(run: Path) -> dict:
    return {p.name: (p / "state.json").read_text() for p in sorted((run / "checkpoints").iterdir())}


def test_a_fresh_run_where_an_earlier_run_s_checkpoints_are_is_refused_and_touches_nothing(vocab_run):
    """train.resume=false in a run directory holding an earlier run's checkpoints (steps 2 and 4):
    the fresh run's step 2 replaced the earlier one's, its pruning by step number could remove its
    own newest checkpoint (then the export failed) and train_log.csv mixed the two runs. Now it is
    refused with one line naming the directory and what to do; nothing is changed."""
    from eagleforge.train.loop import train

    cfg, _ = vocab_run
    cfg.train.holdout_samples, cfg.train.max_steps, cfg.train.save_every, cfg.train.keep_last = 0, 4, 2, 2
    train(cfg)
    states, log_text = _checkpoint_states(cfg.run), (cfg.run / "train_log.csv").read_text()
    assert list(states) == ["step-000002", "step-000004"]
    cfg.train.resume, cfg.train.max_steps = False, 2
    with pytest.raises(UserInputError) as err:
        train(cfg)
    message = str(err.value)
    assert message.startswith(f"{cfg.run / 'checkpoints'}: holds the checkpoints of an earlier run (the newest step-000004) "
                              "and train.resume=false") and "\n" not in message, message
    assert f"move {cfg.run / 'checkpoints'} and {cfg.run / 'train_log.csv'} aside" in message
    assert _checkpoint_states(cfg.run) == states and (cfg.run / "train_log.csv").read_text() == log_text


def test_pruning_removes_only_the_checkpoints_of_the_run_that_prunes(vocab_run):
    """A checkpoint another run wrote (copied in, or left by an older version's fresh run) with a
    lower step than this run's: pruning by step number removed it. Each checkpoint now records
    its run's identity; a run prunes (at its saves and when it resumes) only its own."""
    import shutil

    from eagleforge.train.loop import train

    cfg, _ = vocab_run
    cfg.train.holdout_samples, cfg.train.save_every, cfg.train.keep_last = 0, 1, 1
    other = cfg.run.parent / "other_run"
    shutil.copytree(cfg.run, other)
    this_run = cfg.run
    cfg.run_dir, cfg.train.max_steps = str(other), 1
    train(cfg)  # another run's step-000001
    cfg.run_dir, cfg.train.max_steps = str(this_run), 4
    train(cfg, stop_after_step=2)  # this run, killed after its step 2's checkpoint (step 1's pruned)
    assert list(_checkpoint_states(cfg.run)) == ["step-000002"]
    shutil.copytree(other / "checkpoints" / "step-000001", cfg.run / "checkpoints" / "step-000001")
    foreign = (cfg.run / "checkpoints" / "step-000001" / "state.json").read_text()
    assert train(cfg)["steps"] == 4  # resumed at step 2: prunes at the resume and at steps 3 and 4
    states = _checkpoint_states(cfg.run)
    assert list(states) == ["step-000001", "step-000004"] and states["step-000001"] == foreign
    run_ids = {name: json.loads(text)["run_id"] for name, text in states.items()}
    assert run_ids["step-000001"] != run_ids["step-000004"] and None not in run_ids.values()


def test_a_resume_on_other_data_or_another_vocabulary_is_refused_at_its_start(vocab_run, tmp_path):
    """A checkpoint trained on RUN/hidden's shards and RUN/vocab, resumed after either was made
    again from other samples (the same sample ids): the resumed run trained on the mix, found
    only at the export (another d2t) or never (other shards). Each checkpoint now records a
    fingerprint of both; the resume is refused at once, naming what changed; nothing trained."""
    import shutil

    from test_vocab import build_tiny_run

    from eagleforge.train.loop import train
    from eagleforge.vocab import main as vocab_main

    cfg, llama_config = vocab_run
    ckpt = _trained_checkpoint(cfg)  # step 1 on this run's data and vocabulary
    other, _, _ = build_tiny_run(tmp_path / "other", llama_config, n_samples=5, seed=7, samples_per_shard=5)
    other.vocab.draft_vocab_size, other.train.holdout_samples = cfg.vocab.draft_vocab_size, 1
    vocab_main(other)
    cfg.train.max_steps = 3
    for name in ("hidden", "vocab"):
        mine = cfg.run / name
        shutil.move(mine, tmp_path / f"kept_{name}")
        shutil.copytree(other.run / name, mine)
        with pytest.raises(UserInputError) as err:
            train(cfg)
        what = mine / "manifest.json" if name == "hidden" else mine
        message = str(err.value)
        assert message.startswith(f"{ckpt}: trained on other inputs than this run's: {what} (sha256 ") and "\n" not in message, message
        assert sorted(p.name for p in (cfg.run / "checkpoints").iterdir()) == ["step-000001"]
        shutil.rmtree(mine)
        shutil.move(tmp_path / f"kept_{name}", mine)
    assert train(cfg)["steps"] == 3  # its own inputs back: it resumes


def test_sigkill_during_training_then_rerun_equals_uninterrupted(tmp_path, tiny_llama_config):
    """Through the CLI and the run files only (docs/run-directory.md): killed twice (right after the
    first checkpoint, then after a later one), rerun: every step logged once, the final step
    count and the exported draft equal an uninterrupted run's."""
    import csv
    import shutil

    from safetensors.torch import load_file
    from test_vocab import build_tiny_run

    from eagleforge.vocab import main as vocab_main

    torch.set_num_threads(1)
    cfg, _, _ = build_tiny_run(tmp_path, tiny_llama_config, n_samples=14, samples_per_shard=5)
    cfg.vocab.draft_vocab_size, cfg.train.holdout_samples = 40, 2
    vocab_main(cfg)
    killed, clean = tmp_path / "killed", tmp_path / "clean"
    shutil.copytree(cfg.run, killed)
    shutil.copytree(cfg.run, clean)

    ref = _train_cli(_train_overrides(cfg, clean))
    _kill_after_checkpoint(killed, _train_overrides(cfg, killed), after=SAVE_EVERY)
    code, stderr = _finish(ref)
    assert code == 0, stderr[-2000:]
    assert not (killed / "draft").exists()
    _kill_after_checkpoint(killed, _train_overrides(cfg, killed), after=4 * SAVE_EVERY)
    code, stderr = _finish(_train_cli(_train_overrides(cfg, killed)))
    assert code == 0, stderr[-2000:]
    assert "resumed from" in stderr and "Traceback" not in stderr

    def steps(run):
        with open(run / "train_log.csv", newline="") as f:
            return [int(row["step"]) for row in csv.DictReader(f)]

    assert steps(killed) == steps(clean) == list(range(1, TRAIN_STEPS + 1))  # none lost, none twice
    assert json.loads((killed / "train_summary.json").read_text())["steps"] == TRAIN_STEPS
    assert sorted(p.name for p in (killed / "checkpoints").iterdir() if not p.name.startswith(".")) == \
        sorted(p.name for p in (clean / "checkpoints").iterdir() if not p.name.startswith("."))
    got, want = load_file(str(killed / "draft" / "model.safetensors")), load_file(str(clean / "draft" / "model.safetensors"))
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)


# ----------------------------------------------------------------------------- (e) security

PACKAGE_DIRS = ("eagleforge", "extract", "draft", "train", "eval", "kernels")
PICKLERS = {"pickle", "cPickle", "_pickle", "dill", "joblib", "shelve", "marshal"}


def _unsafe_uses(tree: ast.AST) -> list[tuple[int, str]]:
    """Code (not comments or docstrings) that unpickles or runs remote code: imports of pickle-like
    modules, torch.load without weights_only=True, trust_remote_code=True,
    pickle-based loaders of numpy/pandas (allow_pickle=True, read_pickle)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, f"import {a.name}") for a in node.names if a.name.split(".")[0] in PICKLERS]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in PICKLERS:
            found.append((node.lineno, f"from {node.module} import ..."))
        elif isinstance(node, ast.Call):
            name = ast.unparse(node.func)
            keywords = {k.arg: k.value for k in node.keywords}
            safe_weights = isinstance(keywords.get("weights_only"), ast.Constant) and keywords["weights_only"].value is True
            if name == "torch.load" and not safe_weights:
                found.append((node.lineno, f"{name}(...) without weights_only=True"))
            if name.endswith("read_pickle") or name.split(".")[0] in PICKLERS:
                found.append((node.lineno, f"{name}(...)"))
            for key in ("trust_remote_code", "allow_pickle"):
                value = keywords.get(key)
                if isinstance(value, ast.Constant) and value.value is True:
                    found.append((node.lineno, f"{key}=True"))
    return found


# The one allowed use: train/checkpoint_integrity.py's restricted unpickler for DCP's .metadata (it builds
# only DCP's metadata classes; test_resuming_a_checkpoint_never_unpickles_its_files holds it to that).
ALLOWED_USES = {"train/checkpoint_integrity.py": {"import pickle", "pickle.UnpicklingError(...)"}}


def test_no_unsafe_deserialization_in_package_sources():
    files = [p for d in PACKAGE_DIRS for p in sorted((REPO / d).rglob("*.py"))]
    assert len(files) > 20, files  # the package really was scanned
    found = []
    for path in files:
        rel = path.relative_to(REPO).as_posix()
        found += [f"{rel}:{line}: {what}" for line, what in _unsafe_uses(ast.parse(path.read_text(encoding="utf-8")))
                  if what not in ALLOWED_USES.get(rel, ())]
    assert not found, "\n".join(found)


def test_the_unsafe_use_scanner_sees_what_it_must():
    """The scanner itself, on code it must flag and code (docstrings, comments, safe calls) it must not."""
    bad = """
import pickle
from dill import loads
import torch
x = torch.load(path)
y = torch.load(path, weights_only=False)
z = AutoModel.from_pretrained(p, trust_remote_code=True)
w = numpy.load(f, allow_pickle=True)
v = pandas.read_pickle(f)
"""
    good = '''
"""A docstring about pickle and torch.load(path)."""
import torch  # pickle in a comment
x = torch.load(path, weights_only=True, map_location="cpu")
z = AutoModel.from_pretrained(p, trust_remote_code=cfg.trust_remote_code)
'''
    assert [line for line, _ in _unsafe_uses(ast.parse(bad))] == [2, 3, 5, 6, 7, 8, 9]
    assert _unsafe_uses(ast.parse(good)) == []


# ----------------------------------------------------------------------------- (g) NaN/Inf anywhere


def _poison_batches(trainer, steps: set[int]):
    """Make the loss NaN in the optimizer steps `steps` (1-based), as a NaN input or a diverging
    update would; records the trainable weights after every step."""
    original, after = trainer.batch_loss, {}

    def batch_loss(batch, training=False):
        loss, stats = original(batch, training)
        return (loss * float("nan") if training and trainer.step + 1 in steps else loss), stats

    def train_step():
        out = step_fn()
        after[trainer.step] = [p.detach().clone() for p in trainer.params]
        return out

    step_fn, trainer.batch_loss, trainer.train_step = trainer.train_step, batch_loss, train_step
    after[0] = [p.detach().clone() for p in trainer.params]
    return after


def test_nonfinite_steps_are_skipped_counted_and_stop_the_run(vocab_run):
    """A step with a NaN loss leaves weights and optimizer state as they were (skipped on the
    device), is counted, and more than MAX_NONFINITE_STEPS (3) stop the run with one line; no
    draft is exported then. Regression: a NaN anywhere trained a NaN draft, exported with exit 0."""
    from eagleforge.train.loop import MAX_NONFINITE_STEPS, Trainer

    assert MAX_NONFINITE_STEPS == 3
    cfg, _ = vocab_run
    cfg.train.max_steps, cfg.train.log_every, cfg.train.save_every = 4, 2, 0
    trainer = Trainer(cfg)
    after = _poison_batches(trainer, {2})
    summary = trainer.run()
    assert summary["steps"] == 4 and trainer.nonfinite_steps() == 1
    changed = [any(not torch.equal(a, b) for a, b in zip(after[s - 1], after[s])) for s in (1, 2, 3, 4)]
    assert changed == [True, False, True, True]  # step 2 changed nothing, the others did
    assert all(int(s["step"]) == 3 for s in trainer.optimizer.state.values())  # Adam's step count too
    assert all(bool(torch.isfinite(p).all()) for p in trainer.params)
    assert (cfg.run / "draft" / "model.safetensors").is_file()

    import shutil

    shutil.rmtree(cfg.run / "checkpoints")
    shutil.rmtree(cfg.run / "draft")
    trainer = Trainer(cfg)
    _poison_batches(trainer, {1, 2, 3, 4})  # 2 at the first log step (a warning), 4 at the second
    with pytest.raises(UserInputError, match=r"4 steps had a NaN/Inf loss .*\(skipped; the last: 3, 4\), more than 3;") as err:
        trainer.run()
    assert "\n" not in str(err.value)
    assert not (cfg.run / "draft").exists()


def _write_extra_shard(cfg, mutate) -> Path:
    """Shard 1: a copy of shard 0's samples under new ids, `mutate(samples)` applied first."""
    from eagleforge.shards import ShardReader, ShardWriter

    hidden = cfg.run / "hidden"
    reader = ShardReader(hidden)
    writer = ShardWriter(hidden, {k: v for k, v in reader.manifest.items() if k != "shards"}, reader.manifest["storage_dtype"])
    samples = [reader[i] for i in range(reader.shards[0]["samples"])]
    mutate(samples)
    writer.write_shard(1, samples, [100 + i for i in range(len(samples))])
    return hidden / "shard-00001.safetensors"


def test_a_nan_in_a_shard_stops_training_naming_the_shard(vocab_run):
    """One NaN in one sample's states (written past the extractor, which drops such samples):
    the step is skipped and the error names the shard, the sample id and the tensor."""
    from eagleforge.train.loop import train

    cfg, _ = vocab_run
    cfg.train.holdout_samples, cfg.train.max_steps, cfg.train.log_every = 0, 3, 3

    def nan_in_second(samples):
        samples[1]["aux_hidden_states"][2, 5] = float("nan")

    path = _write_extra_shard(cfg, nan_in_second)
    with pytest.raises(UserInputError, match=rf"{path.name}: sample 101 holds NaN/Inf in aux_hidden_states \(token 2\)"):
        train(cfg)
    assert not (cfg.run / "draft").exists()


def test_a_nan_where_the_loss_never_looks_still_stops_training(vocab_run):
    """A NaN in the last token's final state (never a teacher: nothing follows it) leaves the loss
    and the gradients finite; the states' own device check skips the step and names the shard."""
    from eagleforge.train.loop import train

    cfg, _ = vocab_run
    cfg.train.holdout_samples, cfg.train.max_steps, cfg.train.log_every = 0, 3, 3

    def nan_in_last_token(samples):
        samples[0]["last_hidden_state"][-1, 3] = float("inf")

    path = _write_extra_shard(cfg, nan_in_last_token)
    with pytest.raises(UserInputError, match=rf"{path.name}: sample 100 holds NaN/Inf in last_hidden_state"):
        train(cfg)
    assert not (cfg.run / "draft").exists()


def test_target_argmax_out_of_range_is_named(vocab_run):
    """A shard whose target_argmax holds an id >= V (or < 0, which would wrap around and pick
    another token's teacher) is an error naming the shard and sample, at its first read."""
    from eagleforge.shards import ShardReader

    cfg, llama = vocab_run
    for bad in (llama.vocab_size, -3):
        def mutate(samples, bad=bad):
            samples[0]["target_argmax"][4] = bad

        path = _write_extra_shard(cfg, mutate)
        reader = ShardReader(cfg.run / "hidden")
        with pytest.raises(UserInputError, match=rf"{path.name}: sample 100: target_argmax holds {bad}, outside"):
            reader[reader.shards[0]["samples"]]
        assert reader[0] is not None  # shard 0 reads as before


def _resave(path: Path, change) -> None:
    """Rewrite a safetensors file with `change(tensors)` applied, keeping its metadata (and so
    its recorded sha256, which no longer matches)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), framework="pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    change(tensors)
    save_file(tensors, str(path), metadata=meta)


def test_a_nan_in_the_target_head_is_refused(vocab_run):
    from eagleforge.train.loop import train

    cfg, _ = vocab_run
    head = cfg.run / "vocab" / "target_head.safetensors"

    def nan(t):
        t["lm_head"][3, 1] = float("nan")

    _resave(head, nan)  # the recorded sha256 no longer matches
    with pytest.raises(UserInputError, match=rf"{head}: its tensors' sha256 does not match"):
        train(cfg)
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(head), framework="pt") as f:  # the same NaN with a matching (absent) sha256
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    save_file(tensors, str(head), metadata={"format": "pt"})
    with pytest.raises(UserInputError, match=rf"{head}: lm_head holds NaN/Inf"):
        train(cfg)


def test_a_nan_checkpoint_is_refused_on_resume_and_never_exported(vocab_run, tmp_path):
    from eagleforge.train.loop import Trainer, export_finite, train

    cfg, _ = vocab_run
    cfg.train.holdout_samples, cfg.train.max_steps = 0, 2
    trainer = Trainer(cfg)
    with torch.no_grad():
        trainer.draft.fc.weight[0, 0] = float("inf")
    ckpt = trainer.save()  # step 0: a checkpoint with an Inf weight
    with pytest.raises(UserInputError, match=rf"{ckpt}: the checkpoint holds NaN/Inf"):
        train(cfg)
    with pytest.raises(UserInputError, match=rf"{ckpt}: NaN/Inf in the draft's fc.weight; not exported"):
        export_finite(ckpt, tmp_path / "draft")
    assert not (tmp_path / "draft").exists()


def test_export_refuses_a_vocabulary_map_other_than_run_vocab(vocab_run, tmp_path):
    """The checkpoint's d2t must be RUN/vocab's: a draft id mapped to another target token makes
    every proposal wrong in vLLM/SGLang without an error. A map differing in one id is refused and
    nothing is exported; the same map is exported."""
    from eagleforge.train.loop import Trainer, export_finite
    from eagleforge.vocab import load_vocab_map

    cfg, _ = vocab_run
    cfg.train.holdout_samples = 0
    trainer = Trainer(cfg)
    ckpt = trainer.save()
    vocab = load_vocab_map(cfg.run)
    assert export_finite(ckpt, tmp_path / "draft", vocab).is_dir()
    other = {k: v.clone() for k, v in vocab.items()}
    last = len(other["d2t"]) - 1
    old_target, new_target = last + int(other["d2t"][last]), int((~other["t2d"]).nonzero()[0, 0])
    other["d2t"][last] = new_target - last  # the last draft id now names an unused target id
    other["t2d"][old_target], other["t2d"][new_target] = False, True
    with pytest.raises(UserInputError, match=rf"{ckpt}: its d2t differs from RUN/vocab's"):
        export_finite(ckpt, tmp_path / "other", other)
    assert not (tmp_path / "other").exists()


def test_eval_refuses_a_nan_draft(vocab_run):
    from transformers import AutoModelForCausalLM

    from eagleforge.eval.evaluate import load_eval_draft
    from eagleforge.train.loop import train

    cfg, _ = vocab_run
    cfg.train.holdout_samples = 0
    train(cfg)
    weights = cfg.run / "draft" / "model.safetensors"
    target = AutoModelForCausalLM.from_pretrained(cfg.target.path)
    assert load_eval_draft(cfg.run / "draft", target) is not None

    def nan(t):
        t["norm.weight"][0] = float("nan")

    _resave(weights, nan)
    with pytest.raises(UserInputError, match=rf"{weights}: NaN/Inf in the draft's norm.weight"):
        load_eval_draft(cfg.run / "draft", target)


@pytest.mark.parametrize("name,dtype", [("fc.weight", "int8"), ("lm_head.weight", "int32"), ("norm.weight", "bool"),
                                        ("d2t", "float32"), ("d2t", "bool"), ("t2d", "float16")])
def test_a_draft_tensor_of_a_dtype_the_format_does_not_allow_is_named(tmp_path, name, dtype):
    """An export whose tensor has the right shape but another kind of dtype (an int8 fc.weight, a
    float d2t): load_draft used to cast it and run a draft of other numbers. Now a ValueError
    names the file, the tensor and the dtype; the export as written loads."""
    from test_draft import make_config, make_draft

    from eagleforge.draft import load_draft, save_draft

    out = save_draft(make_draft(make_config(), seed=3), tmp_path / "draft")
    assert load_draft(out) is not None
    weights = out / "model.safetensors"

    def retype(tensors):
        tensors[name] = tensors[name].to(getattr(torch, dtype))

    _resave(weights, retype)
    with pytest.raises(ValueError, match=rf"{weights}: {name} is {dtype}, the format asks for"):
        load_draft(out)


# ----------------------------------------------------------------------------- (h) resume with a changed config


def test_resume_with_a_changed_config_is_refused_or_applied(vocab_run):
    """Regression: resuming with another train.holdout_samples trained on held-out samples and a
    new train.lr was silently replaced by the checkpoint's. Now every changed key outside the
    allow-list is refused in one line with both values; allowed keys (max_steps...) apply."""
    from eagleforge.train.loop import train

    cfg, _ = vocab_run
    cfg.train.holdout_samples, cfg.train.max_steps = 2, 1
    assert train(cfg)["steps"] == 1
    cfg.train.max_steps, cfg.train.lr, cfg.train.holdout_samples = 3, 2e-3, 1
    with pytest.raises(UserInputError) as err:
        train(cfg)
    message = str(err.value)
    assert "\n" not in message and "step-000001" in message
    assert "train.holdout_samples: 2 in the checkpoint, 1 now" in message
    assert "train.lr: 0.001 in the checkpoint, 0.002 now" in message
    assert "train.max_steps" not in message.split("(a resume")[0]
    cfg.train.lr, cfg.train.holdout_samples, cfg.train.log_every, cfg.train.keep_last = 1e-3, 2, 1, 1
    assert train(cfg)["steps"] == 3  # max_steps, log_every and keep_last changed: resumed and applied
    assert [p.name for p in (cfg.run / "checkpoints").iterdir() if p.name.startswith("step-")] == ["step-000003"]


# ----------------------------------------------------------------------------- (i) damaged vocabulary files


def _flip_bit(path: Path, position: int, bit: int) -> None:
    data = bytearray(path.read_bytes())
    data[position % len(data)] ^= 1 << bit
    path.write_bytes(bytes(data))


def _tensors_and_metadata(path: Path):
    """A safetensors file's metadata and tensors as comparable values (the header's key order
    may differ between two writes of the same content)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return f.metadata(), {k: (str(t.dtype), t.shape, t.reshape(-1).view(torch.uint8).tolist())
                              for k in sorted(f.keys()) for t in [f.get_tensor(k)]}


def test_damaged_vocab_files_are_rebuilt_by_the_stage_and_refused_by_the_trainer(vocab_run, caplog):
    """Regression: a truncated or bit-flipped vocabulary file was called up to date by the vocab
    stage (it read only the metadata) and gave a traceback in the trainer."""
    from eagleforge.train.loop import train
    from eagleforge.vocab import main as vocab_main

    cfg, _ = vocab_run
    vocab = cfg.run / "vocab"
    originals = {p.name: _tensors_and_metadata(p) for p in vocab.iterdir()}
    cut = r"ends at byte \d+ but the file has \d+ bytes \(cut short\?\); rerun the vocab stage"
    cases = [("vocab_map.safetensors", lambda p: p.write_bytes(p.read_bytes()[:-9]), cut),
             ("target_head.safetensors", lambda p: _flip_bit(p, -5, 6), "sha256 does not match"),
             ("vocab_map.safetensors", lambda p: _flip_bit(p, -3, 0), "sha256 does not match")]  # in the tensor data
    for name, damage, reason in cases:
        damage(vocab / name)
        with pytest.raises(UserInputError, match=rf"{vocab / name}: .*{reason}"):
            train(cfg)
        with caplog.at_level("WARNING"):
            vocab_main(cfg)  # not up to date: written again, equal to the original
        assert f"{vocab / name}" in caplog.text and "building the vocabulary files again" in caplog.text
        assert {p.name: _tensors_and_metadata(p) for p in vocab.iterdir()} == originals
        caplog.clear()


_VOCAB_MUTATIONS = st.sampled_from(["truncate", "flip", "insert", "nan", "inf", "negative_count", "d2t_out", "t2d_extra",
                                    "dtype", "shape", "drop_tensor", "identity"])


@settings(max_examples=80, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(which=st.sampled_from(["vocab_map.safetensors", "target_head.safetensors"]), mutation=_VOCAB_MUTATIONS,
       position=st.integers(0, 10**6), bit=st.integers(0, 7), keep_sha=st.booleans())
def test_fuzzed_vocab_files_give_tensors_or_one_line_errors(tiny_vocab_files, which, mutation, position, bit, keep_sha):
    """Byte-level damage (cut, flipped bit, inserted bytes) and content damage (NaN/Inf in the
    head, negative counts, d2t ids outside V, t2d not matching d2t, wrong dtype or shape, a
    missing tensor), saved with or without the recorded sha256: the readers give the original
    tensors or a one-line UserInputError naming the file; the vocab stage's up-to-date check never
    raises, and calls a changed file up to date only when its tensors are the original ones."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from eagleforge.vocab import check_vocab_files, load_target_head, load_vocab_map, vocab_up_to_date

    run, originals, identity = tiny_vocab_files
    with tempfile.TemporaryDirectory() as tmp:
        vocab = Path(tmp) / "vocab"
        vocab.mkdir()
        for name, data in originals.items():
            (vocab / name).write_bytes(data)
        path = vocab / which
        data = bytearray(path.read_bytes())
        if mutation == "truncate":
            path.write_bytes(bytes(data[: position % len(data)]))
        elif mutation == "flip":
            _flip_bit(path, position, bit)
        elif mutation == "insert":
            i = position % len(data)
            path.write_bytes(bytes(data[:i] + bytes([bit * 31 % 256]) + data[i:]))
        else:
            with safe_open(str(path), framework="pt") as f:
                meta, tensors = dict(f.metadata()), {k: f.get_tensor(k) for k in f.keys()}
            if not keep_sha:
                meta.pop("sha256")
            first = next(iter(sorted(tensors)))
            if mutation in ("nan", "inf") and "lm_head" in tensors:
                tensors["lm_head" if bit % 2 else "embed_tokens"].view(-1)[position % 50] = float(mutation)
            elif mutation == "negative_count" and "counts" in tensors:
                tensors["counts"][position % tensors["counts"].numel()] = -1 - bit
            elif mutation == "d2t_out" and "d2t" in tensors:
                tensors["d2t"][-1] += tensors["t2d"].numel()
            elif mutation == "t2d_extra" and "t2d" in tensors:
                tensors["t2d"] = torch.ones_like(tensors["t2d"])
            elif mutation == "dtype":
                tensors[first] = tensors[first].to(torch.int32 if tensors[first].is_floating_point() else torch.float32)
            elif mutation == "shape":
                tensors[first] = tensors[first][:-1]
            elif mutation == "drop_tensor":
                del tensors[first]
            elif mutation == "identity":
                meta["identity"] = "0" * 64
            save_file(tensors, str(path), metadata=meta)
        files = [vocab / "vocab_map.safetensors", vocab / "target_head.safetensors"]
        try:  # what the trainer reads: each file checked, then the two against each other
            got = {**load_vocab_map(Path(tmp)), **load_target_head(Path(tmp))}
            check_vocab_files(got, got, vocab)
        except UserInputError as err:
            assert str(path) in str(err) and "\n" not in str(err), str(err)
            assert not vocab_up_to_date(files, identity)
        else:
            want = {**load_vocab_map(run), **load_target_head(run)}
            assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), mutation
            with safe_open(str(path), framework="pt") as f:
                same_inputs = (f.metadata() or {}).get("identity") == identity
            assert vocab_up_to_date(files, identity) == same_inputs


@pytest.fixture(scope="module")
def tiny_vocab_files(tmp_path_factory):
    """A vocab stage's two files from a tiny run: (run dir, {name: bytes}, identity)."""
    from safetensors import safe_open
    from test_vocab import build_tiny_run
    from transformers import LlamaConfig

    from eagleforge.vocab import main as vocab_main

    llama = LlamaConfig(vocab_size=211, hidden_size=48, intermediate_size=80, num_hidden_layers=7, num_attention_heads=3,
                        num_key_value_heads=1, head_dim=16, max_position_embeddings=256, tie_word_embeddings=False)
    cfg, _, _ = build_tiny_run(tmp_path_factory.mktemp("vocabfuzz"), llama, n_samples=4, samples_per_shard=4)
    cfg.vocab.draft_vocab_size, cfg.train.holdout_samples = 40, 1
    vocab_main(cfg)
    files = {p.name: p.read_bytes() for p in (cfg.run / "vocab").iterdir()}
    with safe_open(str(cfg.run / "vocab" / "vocab_map.safetensors"), framework="pt") as f:
        identity = f.metadata()["identity"]
    return cfg.run, files, identity


_NUMERIC_KEYS = [k for k, _ in _numeric_fields()]


@FUZZ
@given(key=st.sampled_from(_NUMERIC_KEYS), value=st.one_of(
    st.integers(-(2**40), 2**40), st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0, 1, -1, 0.5, 1.5])))
def test_fuzzed_numeric_keys_are_range_checked(key, value):
    """Any number for any numeric key: a valid Config holding exactly that value when it is in
    the key's range (and finite), else a one-line ConfigError naming the key."""
    from eagleforge.config import RANGES

    typ = dict(_numeric_fields())[key]
    low, high = RANGES[key]
    text = repr(value) if not isinstance(value, float) or value == value and abs(value) != float("inf") else \
        {True: ".nan"}.get(value != value, ".inf" if value > 0 else "-.inf")
    if typ is int and isinstance(value, float):
        with pytest.raises(ConfigError, match=rf"'{key}' expects int"):
            load_config(None, [f"{key}={text}"])
        return
    fits = value == value and abs(value) != float("inf") and (low is None or value >= low) and (high is None or value <= high)
    fits = fits and not (key == "eval.ngram_min" and value > Config().eval.ngram_max)
    fits = fits and not (key == "eval.ngram_max" and value < Config().eval.ngram_min)
    # pipeline stages belong to the native backend; the default hf backend refuses target.pp > 1
    fits = fits and not (key == "target.pp" and value > 1 and Config().target.backend != "native")
    try:
        cfg = load_config(None, [f"{key}={text}"])
    except ConfigError as err:
        assert not fits, f"{key}={text} refused: {err}"
        assert key in str(err) and "\n" not in str(err)
    else:
        assert fits, f"{key}={text} accepted"
        section, leaf = key.split(".")
        assert getattr(getattr(cfg, section), leaf) == value


def test_a_diverging_run_exits_2_with_one_line_and_exports_nothing(vocab_run, tmp_path):
    """End to end through the CLI, no test hook: an lr of 1e30 blows the weights up after the
    first update, so every later step's loss is NaN. Those steps are skipped and counted, the run
    stops past MAX_NONFINITE_STEPS (3) with exit 2 and one line, and no draft is exported
    (was: exit 0 with a NaN draft in RUN/draft)."""
    cfg, _ = vocab_run
    proc = _cli("eagleforge.train", f"run_dir={cfg.run}", f"target.path={cfg.target.path}", "target.device=cpu",
                "train.device=cpu", "vocab.draft_vocab_size=40", "train.holdout_samples=1", "train.max_steps=8",
                "train.log_every=4", "train.lr=1e30", cwd=tmp_path)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error")]
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(lines) == 1 and "steps had a NaN/Inf loss" in lines[0] and "more than 3;" in lines[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and not (cfg.run / "draft").exists()
