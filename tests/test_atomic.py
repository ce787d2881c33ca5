"""Crash-safe writes (eagleforge/atomic.py) killed at their worst moments, in a child process
SIGKILLed there: the target is the old content or the whole new one, and what the kill left is
gone after the sweep at a stage's start or the next write (after tidy_checkpoints, for a run's
checkpoints)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagleforge.atomic import _owner_tag, atomic_dir, atomic_path, clear_leftovers, sweep_leftovers
from eagleforge.train.checkpoint import list_checkpoints, prune_checkpoints, tidy_checkpoints

REPO = Path(__file__).resolve().parents[1]


def _killed_child(script: str, *args: str) -> None:
    """Run `script` in a child that SIGKILLs itself where the script says."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script), *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]


def _listing(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def test_a_writer_killed_beside_its_own_temporary_file_leaves_one_known_name(tmp_path):
    # safetensors' save_file writes `.tmpXXXXXX` beside the name it is given, then renames it; a
    # kill in between used to leave that random name in the run's folder for good.
    target = tmp_path / "vocab.safetensors"
    target.write_bytes(b"old")
    _killed_child("""
        import os, signal, sys
        from eagleforge.atomic import atomic_path
        with atomic_path(sys.argv[1]) as tmp:
            (tmp.parent / ".tmpQ3xZ9a").write_bytes(b"half of a save")
            os.kill(os.getpid(), signal.SIGKILL)
    """, str(target))
    assert target.read_bytes() == b"old"
    (scratch,) = [p.name for p in tmp_path.iterdir() if p.is_dir()]
    assert scratch.startswith(".tmp-vocab.safetensors-") and _listing(tmp_path) == [scratch, f"{scratch}/.tmpQ3xZ9a", "vocab.safetensors"]

    sweep_leftovers(tmp_path)  # a stage's start: its writer is gone
    assert _listing(tmp_path) == ["vocab.safetensors"] and target.read_bytes() == b"old"
    tensors = {"x": torch.randn(3, 5), "y": torch.arange(7)}
    with atomic_path(target) as tmp:
        save_file(tensors, str(tmp))
    assert _listing(tmp_path) == ["vocab.safetensors"]
    got = load_file(target)
    assert all(torch.equal(got[k], v) for k, v in tensors.items())


def test_a_write_killed_after_its_rename_leaves_nothing_once_a_stage_starts(tmp_path):
    # A file written once (a vocab file found up to date on the rerun): nothing writes its name
    # again, so only the sweep at a stage's start can remove the empty scratch directory. The
    # sweep goes into the run's folders; a live writer's scratch and a checkpoint's own
    # temporary directory (tidy_checkpoints' job) are left alone.
    folder = tmp_path / "run" / "vocab"
    folder.mkdir(parents=True)
    _killed_child("""
        import os, signal, sys
        import eagleforge.atomic as atomic
        real_replace = os.replace
        def replace(src, dst):
            real_replace(src, dst)
            os.kill(os.getpid(), signal.SIGKILL)
        os.replace = replace
        atomic.write_text_atomic(sys.argv[1], "whole")
    """, str(folder / "vocab_map.json"))
    assert (folder / "vocab_map.json").read_text() == "whole"
    assert [p.name.rsplit("-", 2)[0] for p in folder.iterdir() if p.is_dir()] == [".tmp-vocab_map.json"]
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        live = folder / f".tmp-target_head.safetensors-{_owner_tag().rpartition('-')[0]}-{sleeper.pid}"
        live.mkdir()
        (tmp_path / "run" / "checkpoints" / ".tmp-step-000004").mkdir(parents=True)
        sweep_leftovers(tmp_path / "run")
        assert _listing(tmp_path / "run") == ["checkpoints", "checkpoints/.tmp-step-000004", "vocab", f"vocab/{live.name}",
                                              "vocab/vocab_map.json"]
    finally:
        sleeper.kill()
        sleeper.wait()


_SWAP = """
    import os, signal, sys
    from pathlib import Path
    import eagleforge.atomic as atomic
    target, when = Path(sys.argv[1]), sys.argv[2]
    if when == "between the two renames":  # a system without the exchange: two renames
        atomic._exchange = lambda a, b: False
        real_replace = os.replace
        def replace(src, dst):
            real_replace(src, dst)
            if Path(dst).name.startswith(".old-"):
                os.kill(os.getpid(), signal.SIGKILL)
        os.replace = replace
    else:  # after the exchange: the old export sits under the temporary name until removed
        real_rmtree = atomic.shutil.rmtree
        def rmtree(path, *args, **kwargs):
            if Path(path).name.startswith(".tmp-"):
                os.kill(os.getpid(), signal.SIGKILL)
            real_rmtree(path, *args, **kwargs)
        atomic.shutil.rmtree = rmtree
    with atomic.atomic_dir(target) as tmp:
        (tmp / "model.safetensors").write_text("new")
"""


@pytest.mark.parametrize("when", ["between the two renames", "after the exchange"])
def test_a_directory_swap_killed_half_way_is_whole_again_at_the_next_write(tmp_path, when):
    target = tmp_path / "draft"
    target.mkdir()
    (target / "model.safetensors").write_text("old")
    _killed_child(_SWAP, str(target), when)
    left = sorted(name.rsplit("-", 2)[0] for name in os.listdir(tmp_path) if name != "draft")
    if when == "between the two renames":
        assert not target.exists() and left == [".old-draft", ".tmp-draft"], left
        clear_leftovers(target)  # what the next write does first: the old export moved back
        assert (target / "model.safetensors").read_text() == "old" and os.listdir(tmp_path) == ["draft"]
    else:
        assert (target / "model.safetensors").read_text() == "new" and left == [".tmp-draft"], left
    with atomic_dir(target) as tmp:
        (tmp / "model.safetensors").write_text("newer")
    assert _listing(tmp_path) == ["draft", "draft/model.safetensors"]
    assert (target / "model.safetensors").read_text() == "newer"


def test_a_live_process_or_another_hosts_temporary_directory_is_left_alone(tmp_path):
    target = tmp_path / "smollm2"
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        host = _owner_tag().rpartition("-")[0]
        live = tmp_path / f".tmp-smollm2-{host}-{sleeper.pid}"  # another process converting now
        elsewhere = tmp_path / ".tmp-smollm2-otherhost-1"        # a process on another host, shared disk
        for folder in (live, elsewhere):
            folder.mkdir()
            (folder / "config.json").write_text("{}")
        with atomic_dir(target) as tmp:
            (tmp / "config.json").write_text("{}")
        assert sorted(os.listdir(tmp_path)) == sorted([live.name, elsewhere.name, "smollm2"])
    finally:
        sleeper.kill()
        sleeper.wait()
    clear_leftovers(target)  # its writer gone, the next one removes it
    assert sorted(os.listdir(tmp_path)) == sorted([elsewhere.name, "smollm2"])


def test_tidy_checkpoints_removes_what_a_killed_save_or_prune_left(tmp_path):
    root = tmp_path / "checkpoints"
    for name in ("step-000002", "step-000004", "step-000006", ".pruned-step-000001", ".tmp-step-000008"):
        (root / name).mkdir(parents=True)
        (root / name / "state.json").write_text(json.dumps({"run_id": "run", "name": name}))
    # A swap of step 6 on a system without the exchange, killed between its renames: step-000006
    # moved aside by a process that is gone.
    (root / "step-000006").rename(root / f".old-step-000006-{_owner_tag().rpartition('-')[0]}-{2**22 + 1}")
    tidy_checkpoints(tmp_path)
    assert sorted(os.listdir(root)) == ["step-000002", "step-000004", "step-000006"]
    prune_checkpoints(tmp_path, 2, "run")  # the resumed run's prune that the kill cut short
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-000004", "step-000006"]
    assert sorted(os.listdir(root)) == ["step-000004", "step-000006"]
    assert json.loads((root / "step-000006" / "state.json").read_text())["name"] == "step-000006"
