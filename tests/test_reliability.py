"""Reliability: a user's bad input gives the project's own one-line errors, never a traceback.

(a) seeded-mutation fuzzing of the data stage's JSONL loader, (b) of config overrides and config
files, (c) the command line's exit code 2 and one stderr line, (d) run files from another
target refused by the trainer, (e) no unsafe deserialization in the package sources.
See RELIABILITY.md for the table of faults and the tests that keep each row true.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from eagleforge.config import Config, ConfigError, UserInputError, load_config
from eagleforge.data import Stats, _RowChecker, _read_local, _write_jsonl_atomic, load_records

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
        _write_jsonl_atomic(clean, (f for _, f in valid))
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


@FUZZ
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


# ----------------------------------------------------------------------------- (c) command line


def _cli(module: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "TRANSFORMERS_VERBOSITY": "error"}
    env.pop("CONFIG", None)
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("module,args,named", [
    ("eagleforge.train", ["run_dir={run}"], "manifest.json"),
    ("eagleforge.extract", ["--config", "{run}/missing.yaml"], "missing.yaml"),
    ("eagleforge.train", ["run_dir={run}", "train.no_such_key=1"], "train.no_such_key"),
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


# ----------------------------------------------------------------------------- (e) security

PACKAGE_DIRS = ("core", "extract", "draft", "train", "kernels")
UNSAFE = [
    (re.compile(r"\b(c?pickle|dill|joblib)\b"), "pickle-based (de)serialization"),
    (re.compile(r"torch\.load\((?![^)]*weights_only\s*=\s*True)[^)]*\)"), "torch.load without weights_only=True"),
    (re.compile(r"trust_remote_code\s*=\s*True"), "trust_remote_code=True literal"),
]


def test_no_unsafe_deserialization_in_package_sources():
    found = []
    files = [p for d in PACKAGE_DIRS for p in sorted((REPO / d).rglob("*.py"))]
    assert len(files) > 20, files  # the package really was scanned
    for path in files:
        text = path.read_text(encoding="utf-8")
        # torch.load( spanning lines: join the call's text before matching.
        flat = re.sub(r"\s*\n\s*", " ", text)
        for pattern, what in UNSAFE:
            for match in pattern.finditer(flat):
                found.append(f"{path.relative_to(REPO)}: {what}: {match.group(0)[:80]}")
    assert not found, "\n".join(found)
