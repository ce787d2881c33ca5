"""pyproject.toml installs every package folder under the eagleforge namespace (a package left out
of `packages` is missing from a wheel while an editable install still finds it)."""

from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib", reason="tomllib is Python 3.11's")

REPO = Path(__file__).resolve().parents[1]


def test_every_package_folder_is_listed():
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
    mapping, listed = setuptools["package-dir"], set(setuptools["packages"])
    found = set()
    for package, folder in mapping.items():
        root = REPO / folder
        for init in root.rglob("__init__.py"):
            relative = init.parent.relative_to(root).parts
            name = ".".join((package, *relative))
            # a nested folder mapped on its own (extract/native) counts under its own mapping
            if not any(other != package and other.startswith(package + ".") and name.startswith(other) for other in mapping):
                found.add(name)
    assert "eagleforge.data" in found  # the walk sees nested packages
    assert found == listed, f"packages missing from pyproject: {sorted(found - listed)}; listed but absent: {sorted(listed - found)}"
