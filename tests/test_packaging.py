"""pyproject.toml installs every package folder under the eagleforge namespace (a package left out
of `packages` is missing from a wheel while an editable install still finds it), and the wheel
imports its stage packages the way a checkout does (eagleforge/__init__.py's finder)."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib", reason="tomllib is Python 3.11's")

REPO = Path(__file__).resolve().parents[1]
# A package's module: __init__.py, or package.py in a stage folder (eagleforge/__init__.py says why)
PACKAGE_MODULES = ("__init__.py", "package.py")


def test_every_package_folder_is_listed():
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
    mapping, listed = setuptools["package-dir"], set(setuptools["packages"])
    found = set()
    for package, folder in mapping.items():
        root = REPO / folder
        for module in (m for name in PACKAGE_MODULES for m in root.rglob(name)):
            relative = module.parent.relative_to(root).parts
            name = ".".join((package, *relative))
            # a nested folder mapped on its own (extract/native) counts under its own mapping
            if not any(other != package and other.startswith(package + ".") and name.startswith(other) for other in mapping):
                found.add(name)
    assert "eagleforge.data" in found and "eagleforge.draft" in found  # the walk sees nested and stage packages
    assert found == listed, f"packages missing from pyproject: {sorted(found - listed)}; listed but absent: {sorted(listed - found)}"


@pytest.mark.slow
def test_wheel_imports_its_stage_packages(tmp_path):
    """The built wheel, installed to a folder and imported from elsewhere with no checkout on the path."""
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), str(REPO)],
                   check=True, capture_output=True, timeout=300)
    wheel = next(tmp_path.glob("eagleforge-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"eagleforge/draft/package.py", "eagleforge/train/__main__.py", "eagleforge/kernels/soft_ce.py"} <= names
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    # the editable install's finder dropped: only the wheel's files can answer
    code = (f"import sys; sys.path.insert(0, {str(site)!r}); "
            "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f).lower()]; "
            "from eagleforge.draft import Eagle3Draft; import eagleforge.train.loop as loop, eagleforge.extract.native.plan; "
            "print(loop.__file__)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert Path(proc.stdout.strip()) == site / "eagleforge" / "train" / "loop.py"
