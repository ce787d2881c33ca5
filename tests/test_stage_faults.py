"""Faults a user can cause, made for real against the stages run as `python -m eagleforge.<stage>`
(RELIABILITY.md): a file or a read-only file system as run_dir, a full disk, crafted or cut
safetensors files, a draft that does not fit its target, JSON of another kind where an object is
expected. Each ends in exactly one `error:` line on stderr naming the file, no traceback, exit
code 2; where the fault allows it, the rerun once it is fixed ends with the outputs of an
uninterrupted run (compared as the soak compares them, tests/soak/soak.py).

The file systems are real: a tmpfs filled to a chosen point with a filler file, a read-only bind
mount, a read-only tmpfs (root ignores chmod). Where mounting is refused (no CAP_SYS_ADMIN), a
full disk is a file-size limit on the stage's process instead (RLIMIT_FSIZE: EFBIG, the errno
the same path handles), a read-only directory chmod 555 (skipped as root, which ignores it).
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "soak"))
import soak  # noqa: E402

STAGES = ("data", "extract", "vocab", "train", "eval")
PAGE = os.sysconf("SC_PAGE_SIZE")  # tmpfs counts whole pages


# ----------------------------------------------------------------------------- running a stage


def run_stage(world, stage: str, run: Path, *extra: str, target: Path | None = None, fsize: int | None = None):
    """`python -m eagleforge.<stage>` on `run` with the tiny run's keys (soak.COMMON); fsize: a
    file-size limit on its process (SIGXFSZ ignored, so a write past it fails with EFBIG)."""
    args = [f"run_dir={run}", f"target.path={target or world['target']}", *soak.COMMON, *extra]
    env = {**soak.base_env(), "EAGLEFORGE_CACHE": str(world["cache"])}

    def limit():
        if fsize is not None:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))

    return subprocess.run([sys.executable, "-m", f"eagleforge.{stage}", *args], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=600, preexec_fn=limit)


def ok(result) -> None:
    assert result.returncode == 0, result.stderr[-3000:]


def one_error_line(result) -> str:
    """The stage's one `error:` line: exit code 2, no traceback, exactly one line of stderr that
    starts with `error:` (the log lines beside it are timestamped), and it is the last."""
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    assert result.returncode == 2 and "Traceback" not in result.stderr and len(errors) == 1 and lines[-1] == errors[0], \
        f"exit {result.returncode}, stderr:\n{result.stderr[-3000:]}"
    assert len(errors[0]) < 2100, errors[0][:3000]  # eagleforge.failures.MAX_LINE_CHARS and the count of the rest
    return errors[0]


def assert_outputs_equal(got: Path, want: Path, outputs: tuple[str, ...]) -> None:
    """Every path of `got` is one of `want`'s (nothing left behind: no temporary names, no
    half-written file), and under each path of `outputs` (what the stage writes) the same paths
    as the reference, each file equal to it by the soak's contract (JSON but for timings and the
    run directory, vocab files by tensors and metadata, the rest by sha256)."""
    have, ref = soak.names(got), soak.names(want)
    assert not have - ref, f"left behind: {sorted(have - ref)}"
    for prefix in outputs:
        mine = {rel for rel in have if rel == prefix or rel.startswith(prefix + os.sep)}
        theirs = {rel for rel in ref if rel == prefix or rel.startswith(prefix + os.sep)}
        assert mine == theirs, f"{prefix}: missing {sorted(theirs - mine)}"
        problems = [soak.compare_file(rel, got, want, got, want) for rel in sorted(mine) if not (got / rel).is_dir()]
        assert not [p for p in problems if p], [p for p in problems if p]


def copy_run(src: Path, dst: Path, without: tuple[str, ...] = ()) -> Path:
    """A copy of the run directory `src` at `dst`, less the paths `without` (relative to it)."""
    def ignore(folder, entries):
        return [e for e in entries if os.path.relpath(os.path.join(folder, e), src) in without]

    shutil.copytree(src, dst, symlinks=True, ignore=ignore, dirs_exist_ok=True)
    return dst


# ----------------------------------------------------------------------------- file systems


def _try_mount() -> bool:
    import tempfile

    point = Path(tempfile.mkdtemp(prefix="eagleforge-mount-check-"))
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(point)], capture_output=True)
        if done.returncode != 0:
            return False
        subprocess.run(["umount", str(point)], check=True)
        return True
    except (OSError, subprocess.CalledProcessError):
        return False
    finally:
        point.rmdir()


CAN_MOUNT = _try_mount()


class Mounts:
    """Mounts made for a test, unmounted (last first) at its teardown."""

    def __init__(self):
        self.points: list[Path] = []

    def _mount(self, *args: str) -> None:
        subprocess.run(["mount", *args], check=True, capture_output=True)

    def tmpfs(self, point: Path, size: int, ro: bool = False) -> Path:
        point.mkdir(parents=True, exist_ok=True)
        self._mount("-t", "tmpfs", "-o", f"size={size}" + (",ro" if ro else ""), "tmpfs", str(point))
        self.points.append(point)
        return point

    def bind_read_only(self, source: Path, point: Path) -> Path:
        point.mkdir(parents=True, exist_ok=True)
        self._mount("--bind", str(source), str(point))
        self.points.append(point)
        self._mount("-o", "remount,bind,ro", str(point))
        return point

    def remount(self, point: Path, options: str) -> None:
        self._mount("-o", f"remount,{options}", str(point))

    def close(self) -> None:
        for point in reversed(self.points):
            if subprocess.run(["umount", str(point)], capture_output=True).returncode != 0:
                subprocess.run(["umount", "-l", str(point)], capture_output=True)
        self.points.clear()


@pytest.fixture
def mounts():
    m = Mounts()
    yield m
    m.close()


def pages(n: int) -> int:
    return -(-n // PAGE)


class FullDisk:
    """A file system that fills at a chosen point. With mounts: a tmpfs of `size` bytes at
    `root`, then a filler file (outside the run directory) leaving `free` bytes; `fix` removes
    the filler, or grows the tmpfs to `grow` bytes. Without: `fsize` is the limit the stage runs
    under (`limit`), which `fix` lifts."""

    def __init__(self, mounts: Mounts | None, root: Path, size: int, fsize: int):
        self.mounts, self.root, self.fsize, self.fixed = mounts, root, fsize, False
        if mounts is not None:
            mounts.tmpfs(root, size)
        else:
            root.mkdir(parents=True)

    def fill(self, free: int) -> None:
        if self.mounts is None:
            return
        stat = os.statvfs(self.root)
        room = stat.f_bavail * stat.f_frsize - free
        assert room >= 0, f"the tmpfs holds {stat.f_bavail * stat.f_frsize} bytes free, fewer than {free}"
        fd = os.open(self.root / "filler", os.O_WRONLY | os.O_CREAT)
        try:
            if room:
                os.posix_fallocate(fd, 0, room)
        finally:
            os.close(fd)

    @property
    def limit(self) -> int | None:
        return None if self.mounts is not None or self.fixed else self.fsize

    def fix(self, grow: int | None = None) -> None:
        self.fixed = True
        if self.mounts is None:
            return
        (self.root / "filler").unlink(missing_ok=True)
        if grow is not None:
            self.mounts.remount(self.root, f"size={grow}")


@pytest.fixture
def full_disk(tmp_path, mounts):
    """FullDisk(root, size, fsize) on a real tmpfs, or a file-size limit where mounting is refused."""
    return lambda name, size, fsize: FullDisk(mounts if CAN_MOUNT else None, tmp_path / name, size, fsize)


# ----------------------------------------------------------------------------- the runs


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny target (soak.make_target) and an uninterrupted run: refs[stage] is the run
    directory once `stage` has run after the ones before it (each a copy of the one before)."""
    root = tmp_path_factory.mktemp("faults")
    soak.make_target(root / "target")
    w = {"root": root, "target": root / "target", "cache": root / "cache", "refs": {}}
    before = None
    for stage in STAGES:
        run = root / "ref" / stage
        if before is not None:
            copy_run(before, run)
        ok(run_stage(w, stage, run))
        w["refs"][stage] = before = run
    return w


# ----------------------------------------------------------------------------- 1. run_dir


@pytest.mark.parametrize("stage", STAGES)
def test_a_run_dir_that_is_a_file_is_one_line(world, tmp_path, stage):
    file = tmp_path / "run"
    file.write_text("not a directory\n")
    line = one_error_line(run_stage(world, stage, file))
    assert line == f"error: run_dir={file}: is a file, not a directory; give a directory (it is made if missing)"
    line = one_error_line(run_stage(world, stage, file / "sub" / "run"))
    assert line.startswith(f"error: run_dir={file / 'sub' / 'run'}: is under {file}, which is a file"), line
    assert file.read_text() == "not a directory\n"


@pytest.mark.parametrize("stage", STAGES)
def test_a_read_only_run_dir_is_one_line_and_left_as_it_was(world, tmp_path, mounts, stage):
    """The run of the stage before (or the stage's own outputs) on a read-only bind mount: one
    line naming run_dir and the read-only file system, before any work, every file as it was."""
    source = copy_run(world["refs"][stage], tmp_path / "source")
    before = {rel: soak.sha256(source / rel) for rel in soak.names(source) if (source / rel).is_file()}
    if CAN_MOUNT:
        run = mounts.bind_read_only(source, tmp_path / "mounted")
        why = "read-only file system (errno EROFS)"
    else:
        if os.geteuid() == 0:
            pytest.skip("mounting is refused and root ignores chmod: no read-only directory to test with")
        run = source
        os.chmod(run, 0o555)
        why = "permission denied (errno EACCES)"
    try:
        line = one_error_line(run_stage(world, stage, run))
    finally:
        os.chmod(source, 0o755)
    assert line == f"error: run_dir={run}: cannot write there: {why}"
    assert {rel: soak.sha256(source / rel) for rel in soak.names(source) if (source / rel).is_file()} == before


def test_a_run_dir_on_a_read_only_file_system_is_one_line_and_the_rerun_once_writable_completes(world, tmp_path, mounts):
    if not CAN_MOUNT:
        pytest.skip("mounting is refused: test_a_read_only_run_dir_is_one_line_and_left_as_it_was covers chmod 555")
    point = mounts.tmpfs(tmp_path / "fs", 64 << 20, ro=True)
    run = point / "runs" / "x"
    line = one_error_line(run_stage(world, "vocab", run))
    assert line == f"error: run_dir={run}: cannot write there: read-only file system ({point}) (errno EROFS)"
    assert not (point / "runs").exists()
    mounts.remount(point, "rw")  # fixed: the run of the extract stage is copied there and the stage reruns
    copy_run(world["refs"]["extract"], run)
    ok(run_stage(world, "vocab", run))
    assert_outputs_equal(run, world["refs"]["vocab"], ("vocab",))


# ----------------------------------------------------------------------------- 2. a full disk


def _sizes(run: Path, *rels: str) -> int:
    return sum(pages((run / rel).stat().st_size) for rel in rels) * PAGE


def test_a_full_disk_in_the_data_stage_keeps_the_answers_before_and_the_rerun_completes(world, full_disk):
    """The disk fills while regeneration appends a batch of answers to conversations.jsonl: one
    line naming the file and the full disk; the file holds whole rows only (the batch's part that
    landed is cut back), each one of the uninterrupted run's; once there is room, the rerun
    answers the rest and its outputs equal the uninterrupted run's."""
    ref = world["refs"]["data"]
    conversations = ref / "data" / "conversations.jsonl"
    assert pages(conversations.stat().st_size) >= 2
    disk = full_disk("disk", 2 << 20, fsize=PAGE)
    disk.fill(_sizes(ref, "config.yaml") + (pages(conversations.stat().st_size) - 1) * PAGE)
    run = disk.root / "run"
    line = one_error_line(run_stage(world, "data", run, fsize=disk.limit))
    assert line.startswith(f"error: {run / 'data' / 'conversations.jsonl'}: cannot write, ") and "errno E" in line, line
    assert ("no space left on device (errno ENOSPC" if CAN_MOUNT else "file too large (errno EFBIG") in line, line
    assert "answers of this write were not kept" in line, line
    written = (run / "data" / "conversations.jsonl").read_bytes()
    assert written and written.endswith(b"\n"), written[-200:]  # whole rows, none torn
    want = {json.loads(row)["id"]: row for row in conversations.read_text(encoding="utf-8").splitlines()}
    assert all(want[json.loads(row)["id"]] == row for row in written.decode().splitlines())
    disk.fix()
    ok(run_stage(world, "data", run, fsize=disk.limit))
    assert_outputs_equal(run, ref, ("data", "config.yaml"))


def test_a_full_disk_in_the_vocab_stage_is_one_line_and_the_rerun_completes(world, full_disk):
    """target_head.safetensors (9.4 MB) does not fit: one line naming it; vocab_map written whole,
    no temporary file left; once the file system is larger, the rerun writes both."""
    ref, extract = world["refs"]["vocab"], world["refs"]["extract"]
    room = sum((extract / rel).stat().st_size for rel in soak.names(extract) if (extract / rel).is_file())
    disk = full_disk("disk", room + (4 << 20), fsize=2 << 20)
    run = copy_run(extract, disk.root / "run")
    line = one_error_line(run_stage(world, "vocab", run, fsize=disk.limit))
    assert line.startswith(f"error: {run / 'vocab' / 'target_head.safetensors'}: cannot write, "), line
    assert "nothing partial was kept, free space and rerun to resume" in line, line
    assert sorted(p.name for p in (run / "vocab").iterdir()) == ["vocab_map.safetensors"]
    disk.fix(grow=room + (64 << 20))
    ok(run_stage(world, "vocab", run, fsize=disk.limit))
    assert_outputs_equal(run, ref, ("vocab", "config.yaml"))


def test_a_full_disk_at_the_export_is_one_line_and_the_rerun_exports(world, full_disk):
    """The trainer resumed at its last checkpoint has only the export left; the disk has room for
    half of it: one line naming RUN/draft, no draft and no temporary directory left; once there
    is room, the rerun exports the draft of the uninterrupted run, byte for byte."""
    ref = world["refs"]["train"]
    room = sum((ref / rel).stat().st_size for rel in soak.names(ref) if (ref / rel).is_file())
    disk = full_disk("disk", room + (4 << 20), fsize=64 << 10)
    run = copy_run(ref, disk.root / "run", without=("draft",))
    disk.fill(pages((ref / "draft" / "model.safetensors").stat().st_size) // 2 * PAGE)
    line = one_error_line(run_stage(world, "train", run, fsize=disk.limit))
    assert line.startswith(f"error: {run / 'draft'}: cannot write, "), line
    assert not (run / "draft").exists() and not [p for p in run.iterdir() if p.name.startswith(".")], sorted(os.listdir(run))
    disk.fix()
    ok(run_stage(world, "train", run, fsize=disk.limit))
    assert_outputs_equal(run, ref, ("draft", "train_summary.json", "train_log.csv", "config.yaml"))


def test_a_full_disk_in_the_eval_stage_is_one_line_and_the_rerun_completes(world, full_disk):
    """The disk fills at the training-curve plot (105 KB): one line naming it, no partial PNG;
    results.json is whole; once there is room, the rerun's outputs equal the uninterrupted run's."""
    ref = world["refs"]["eval"]
    inputs = ("draft", "train_log.csv", "train_summary.json")
    disk = full_disk("disk", 2 << 20, fsize=64 << 10)
    run = copy_run(ref, disk.root / "run", without=tuple(name for name in os.listdir(ref) if name not in inputs))
    disk.fill(_sizes(ref, "config.yaml", "eval/results.json", "eval/acceptance_per_position.png")
              + pages((ref / "eval" / "training_curves.png").stat().st_size) // 2 * PAGE)
    line = one_error_line(run_stage(world, "eval", run, fsize=disk.limit))
    assert line.startswith(f"error: {run / 'eval' / 'training_curves.png'}: cannot write, "), line
    assert sorted(p.name for p in (run / "eval").iterdir()) == ["acceptance_per_position.png", "results.json"]
    json.loads((run / "eval" / "results.json").read_text())
    disk.fix()
    ok(run_stage(world, "eval", run, fsize=disk.limit))
    assert_outputs_equal(run, ref, ("eval", "config.yaml"))


# ----------------------------------------------------------------------------- 3. crafted safetensors files


def craft(path: Path, kind: str) -> None:
    """Damage the safetensors file `path` as a user's copy, a crafted file or a cut download would."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header, data = json.loads(raw[8:8 + n]), raw[8 + n:]
    first = next(name for name in header if name != "__metadata__")

    def rewrite(edit) -> bytes:
        edit(header)
        text = json.dumps(header).encode()
        return len(text).to_bytes(8, "little") + text + data

    damaged = {
        "cut": lambda: raw[:8 + n + len(data) // 2],  # a download cut in the tensor data
        "cut_in_header": lambda: raw[:8 + n // 2],
        "huge_length": lambda: (2**62).to_bytes(8, "little") + raw[8:],
        "not_json": lambda: raw[:8] + b"{" * n + data,
        "a_list": lambda: raw[:8] + b"[" + b" " * (n - 2) + b"]" + data,
        "past_the_end": lambda: rewrite(lambda h: h[first]["data_offsets"].__setitem__(1, h[first]["data_offsets"][1] + 10**9)),
        "overlap": lambda: rewrite(lambda h: [e["data_offsets"].__setitem__(0, 0) for k, e in h.items() if k != "__metadata__"]),
        "metadata_not_strings": lambda: rewrite(lambda h: h.__setitem__("__metadata__", {"format": 1})),
        "unknown_dtype": lambda: rewrite(lambda h: h[first].__setitem__("dtype", "Q7")),
        # the same size as before (a shard's size is recorded in the manifest): I32 -> Q32
        "unknown_dtype_same_size": lambda: raw[:8] + raw[8:8 + n].replace(b'"I32"', b'"Q32"', 1) + data,
        "empty": lambda: b"",
    }[kind]()
    path.write_bytes(damaged)


KINDS = ["cut", "cut_in_header", "huge_length", "not_json", "a_list", "past_the_end", "overlap", "metadata_not_strings",
         "unknown_dtype", "empty"]


@pytest.mark.parametrize("kind", KINDS)
def test_the_header_check_refuses_what_safetensors_refuses_naming_the_file(tmp_path, kind):
    """Each damage is refused by safetensors itself (a SafetensorError naming no file) and by the
    header check (eagleforge.readers), as one UserInputError naming the file; an intact file,
    one of no tensors and one holding a zero-size tensor pass both."""
    from safetensors import safe_open

    from eagleforge.errors import UserInputError
    from eagleforge.readers import open_safetensors, read_safetensors_header

    tensors = {"a": torch.arange(6, dtype=torch.int32).reshape(2, 3), "b": torch.ones(5), "c": torch.zeros(0, 4)}
    for name, content in (("intact", tensors), ("none", {}), ("one", {"c": tensors["c"]})):
        save_file(content, str(tmp_path / name), metadata={"format": "pt"})
        assert sorted(read_safetensors_header(tmp_path / name)) == sorted(safe_open(str(tmp_path / name), "pt").keys())
    path = tmp_path / "damaged.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    craft(path, kind)
    with pytest.raises(Exception) as refused:
        safe_open(str(path), "pt")
    assert type(refused.value).__name__ == "SafetensorError" and str(path) not in str(refused.value)
    for read in (read_safetensors_header, open_safetensors):
        with pytest.raises(UserInputError, match=rf"^{path}: "):
            read(path)


@pytest.mark.parametrize("rel,stage,kind", [
    ("vocab/vocab_map.safetensors", "train", "metadata_not_strings"),
    ("vocab/target_head.safetensors", "train", "overlap"),
    ("hidden/shard-00001.safetensors", "train", "unknown_dtype_same_size"),
    ("hidden/shard-00001.safetensors", "vocab", "unknown_dtype_same_size"),
    ("draft/model.safetensors", "eval", "past_the_end"),
    ("draft/model.safetensors", "eval", "cut_in_header"),
])
def test_a_damaged_safetensors_file_of_the_run_is_one_line_naming_it(world, tmp_path, rel, stage, kind):
    """RUN/vocab's files read by the trainer, a shard (same size, so the manifest's byte count
    holds) read by the vocab stage and the trainer, the export read by eval."""
    before = "vocab" if stage == "train" else "extract" if stage == "vocab" else "eval"
    run = copy_run(world["refs"][before], tmp_path / "run", without=("checkpoints", "train_log.csv", "eval"))
    craft(run / rel, kind)
    line = one_error_line(run_stage(world, stage, run))
    assert line.startswith(f"error: {run / rel}: ") or line.startswith(f"error: {run / 'draft'}: {run / rel}: "), line


@pytest.mark.parametrize("stage,kind", [("data", "cut"), ("extract", "huge_length"), ("vocab", "not_json"),
                                        ("eval", "unknown_dtype")])
def test_a_damaged_weight_file_of_an_hf_target_is_one_line_naming_it(world, tmp_path, stage, kind):
    """The target's model.safetensors, read by transformers (data regeneration, extraction, eval)
    or by the vocab stage (the target's head): one line naming the file, before it is loaded."""
    target = shutil.copytree(world["target"], tmp_path / "target")
    craft(target / "model.safetensors", kind)
    before = {"data": None, "extract": "data", "vocab": "extract", "eval": "eval"}[stage]
    run = tmp_path / "run"
    if before is not None:
        copy_run(world["refs"][before], run, without=("vocab", "eval"))
    line = one_error_line(run_stage(world, stage, run, target=target))
    assert line.startswith(f"error: {target / 'model.safetensors'}: "), line


# ----------------------------------------------------------------------------- 4. a draft that does not fit its target


def _other_vocabulary(config, tensors):
    config["vocab_size"] += 5
    tensors["t2d"] = torch.cat([tensors["t2d"], torch.zeros(5, dtype=tensors["t2d"].dtype)])


def _d2t_past_the_vocabulary(config, tensors):
    tensors["d2t"][-1] += config["vocab_size"]


def _d2t_past_the_vocabulary_no_t2d(config, tensors):
    tensors["d2t"][-1] += config["vocab_size"]
    del tensors["t2d"]


def _aux_layers_past_the_depth(config, tensors):  # the project's ids [1, 3, 30] on a 7-layer target
    config["eagle_aux_hidden_state_layer_ids"] = [2, 4, 31]
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [1, 3, 30]


def _no_fc(config, tensors):
    del tensors["fc.weight"]


def _twenty_thousand_unknown_tensors(config, tensors):  # the line names a few and counts the rest
    tensors.update({f"extra.{i:05d}": torch.zeros(1) for i in range(20_000)})


def _twenty_thousand_aux_layers(config, tensors):  # the line is cut, with the count of the rest
    config["eagle_aux_hidden_state_layer_ids"] = list(range(2, 20_002))
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = list(range(1, 20_001))


@pytest.mark.parametrize("edit,says", [
    (_other_vocabulary, "the draft's vocab_size 49157 is not the target's 49152"),
    (_d2t_past_the_vocabulary, "model.safetensors: d2t maps draft id 63 to target id "),
    (_d2t_past_the_vocabulary_no_t2d, "model.safetensors: d2t maps draft id 63 to target id "),
    (_aux_layers_past_the_depth, "config.json: Eagle3Config.aux_layer_ids [1, 3, 30] exceed the target's 7 layers"),
    (_no_fc, "model.safetensors: unknown tensors [], missing tensors ['fc.weight']"),
    (_twenty_thousand_unknown_tensors, "model.safetensors: unknown tensors ['extra.00000', "),
    (_twenty_thousand_aux_layers, "config.json: Eagle3Config.aux_layer_ids [1, 2, 3, "),
])
def test_a_draft_that_does_not_fit_the_target_is_one_line_in_eval(world, tmp_path, edit, says):
    """eval.draft_path naming a draft of another vocabulary, one whose d2t points past the
    target's vocabulary (with its t2d, or without: load_draft derived t2d from it, an IndexError),
    one trained on aux layers the target does not have, one missing a tensor, one holding 20,000
    tensors of no draft or naming 20,000 aux layers: one line (of a bounded length) naming the
    draft's file and what differs, from the export check (eagleforge/export.py, which
    `python -m eagleforge.export check` prints the same) before anything is loaded."""
    from eagleforge.export import check_draft, read_target_config

    draft = copy_run(world["refs"]["eval"] / "draft", tmp_path / "draft")
    config, tensors = json.loads((draft / "config.json").read_text()), load_file(str(draft / "model.safetensors"))
    edit(config, tensors)
    (draft / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, str(draft / "model.safetensors"), metadata={"format": "pt"})
    line = one_error_line(run_stage(world, "eval", tmp_path / "run", f"eval.draft_path={draft}"))
    assert line.startswith(f"error: {draft}: ") and says in line and "not evaluated" in line, line
    assert says in check_draft(draft, read_target_config(world["target"])).errors[0]
    assert not (tmp_path / "run" / "eval").exists() or not any((tmp_path / "run" / "eval").iterdir())


# ----------------------------------------------------------------------------- 5. JSON of another kind


def _rechecksum(checkpoint: Path) -> None:
    """checksums.json rewritten to match the files (a user's edit that leaves the check silent)."""
    listing = json.loads((checkpoint / "checksums.json").read_text())
    for name in listing:
        listing[name] = {"bytes": (checkpoint / name).stat().st_size, "sha256": soak.sha256(checkpoint / name)}
    (checkpoint / "checksums.json").write_text(json.dumps(listing))


@pytest.mark.parametrize("stage,name,value", [
    ("data", "config.json", "[1, 2]"), ("extract", "config.json", '"llama"'), ("vocab", "config.json", "[]"),
    ("train", "config.json", "[1, 2]"), ("eval", "config.json", "[1, 2]"),
    ("data", "tokenizer_config.json", "[]"), ("eval", "generation_config.json", "[2]"),
])
def test_a_target_file_of_another_json_kind_is_one_line_naming_it(world, tmp_path, stage, name, value):
    """The hf target's config.json (read by every stage: transformers, the vocab stage's tie
    check, the trainer's draft sizes), tokenizer_config.json, generation_config.json holding a
    list or a string: one line naming the file, before transformers reads it (TypeError, 'list'
    object has no attribute 'get')."""
    target = shutil.copytree(world["target"], tmp_path / "target")
    (target / name).write_text(value)
    before = {"data": None, "extract": "data", "vocab": "extract", "train": "vocab", "eval": "eval"}[stage]
    run = tmp_path / "run"
    if before is not None:
        copy_run(world["refs"][before], run, without=("eval", "checkpoints", "train_log.csv", "draft") if stage != "eval" else ())
    line = one_error_line(run_stage(world, stage, run, target=target))
    assert line.startswith(f"error: {target / name}: expected a JSON object"), line


@pytest.mark.parametrize("stage,rel,value", [
    ("vocab", "hidden/manifest.json", "[]"),
    ("train", "hidden/manifest.json", '"shards"'),
    ("train", "checkpoints/step-000008/state.json", "[8]"),
    ("train", "checkpoints/step-000008/draft_config.json", '"draft"'),
    ("extract", "data/samples.jsonl", "[1, 2]"),
    ("eval", "draft/config.json", "[1, 2]"),
])
def test_a_run_file_of_another_json_kind_is_one_line_naming_it(world, tmp_path, stage, rel, value):
    """Files of the run holding a list or a string where an object is expected: the shard
    manifest, a checkpoint's state.json and draft_config.json (checksums rewritten to match),
    a samples.jsonl row, the export's config.json."""
    before = {"vocab": "extract", "train": "train", "extract": "data", "eval": "eval"}[stage]
    run = copy_run(world["refs"][before], tmp_path / "run", without=("vocab", "eval") if stage == "vocab" else ("eval",))
    file = run / rel
    if rel.endswith(".jsonl"):
        rows = file.read_text().splitlines()
        rows[1] = value
        file.write_text("\n".join(rows) + "\n")
    else:
        file.write_text(value)
    if rel.startswith("checkpoints/"):
        _rechecksum(file.parent)
        shutil.rmtree(run / "checkpoints" / "step-000006")  # the one to resume from
        shutil.rmtree(run / "draft")
    line = one_error_line(run_stage(world, stage, run))
    where = f"{file} line 2" if rel.endswith(".jsonl") else str(file)
    assert line.startswith(f"error: {where}: ") or line.startswith(f"error: {run / 'draft'}: {where}: "), line


def test_a_training_summary_of_another_json_kind_is_named_and_the_eval_completes(world, tmp_path):
    """RUN/train_summary.json holding a list: eval only reads it for the simulated acceptance
    length and the curve's token axis, so it says so in a warning naming the file and writes its
    results without them (before: AttributeError, 'list' object has no attribute 'get')."""
    run = copy_run(world["refs"]["eval"], tmp_path / "run", without=("eval",))
    (run / "train_summary.json").write_text("[1, 2]")
    result = run_stage(world, "eval", run)
    ok(result)
    assert f"{run / 'train_summary.json'}: expected a JSON object (the trainer's summary), got a JSON list" in result.stderr
    assert "Traceback" not in result.stderr
    results = json.loads((run / "eval" / "results.json").read_text())
    assert results["simulated_acceptance_length"] is None and results["acceptance_length"] >= 1
