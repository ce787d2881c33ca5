"""eagleforge: standalone EAGLE-3 draft training (README.md; the module map in ARCHITECTURE.md).

Where the stage packages live. `eagleforge.draft`, `.extract`, `.train`, `.eval` and `.kernels`
are the folders draft/, extract/, train/, eval/ and kernels/: at the repository root in a source
checkout (an editable install), inside this package in an installed wheel. Those folders hold no
`__init__.py`. A folder with one is a top-level package (`kernels`, `train`, `eval`, ...) for
every Python started in the repository root, where the root comes first on sys.path, and would
hide an installed distribution of that name (transformers imports Hugging Face's `kernels`).
Without one, such a folder is at most a namespace portion, which any installed package or module
of the same name outranks. Each folder's package module (its docstring and public names) is its
`package.py`, loaded as `eagleforge.<folder>` by the finder below, which Python consults first
once `eagleforge` is imported (as it always is before any of its subpackages).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from pathlib import Path

STAGE_PACKAGES = ("draft", "extract", "train", "eval", "kernels")
_HERE = Path(__file__).resolve().parent


class StagePackageFinder(importlib.abc.MetaPathFinder):
    """Finds `eagleforge.<stage>` for the folders in STAGE_PACKAGES: the package module is the
    folder's package.py, its submodules the folder's files."""

    def find_spec(self, fullname, path=None, target=None):
        parent, _, name = fullname.rpartition(".")
        if parent != __name__ or name not in STAGE_PACKAGES:
            return None
        for folder in (_HERE / name, _HERE.parent / name):  # an installed wheel, a source checkout
            module = folder / "package.py"
            if module.is_file():
                return importlib.util.spec_from_file_location(fullname, module, submodule_search_locations=[str(folder)])
        return None


if not any(isinstance(finder, StagePackageFinder) for finder in sys.meta_path):
    sys.meta_path.insert(0, StagePackageFinder())
