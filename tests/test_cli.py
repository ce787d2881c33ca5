"""Every stage's command line: --help lists the config keys the stage reads, with their defaults."""

import subprocess
import sys

import pytest

from eagleforge.config import Config

STAGES = {
    "eagleforge.data": ("target", "data"),
    "eagleforge.extract": ("target", "data", "extract", "launch"),
    "eagleforge.vocab": ("target", "vocab", "train"),
    "eagleforge.train": ("target", "data", "extract", "vocab", "draft", "train", "eval", "launch"),
    "eagleforge.eval": ("target", "eval"),
    "eagleforge.extract.native.plan": ("target", "data", "extract", "train"),
    "eagleforge.extract.native.preflight": ("target", "data", "extract"),
}


@pytest.mark.parametrize("module", list(STAGES))
def test_help_lists_the_stage_config_keys_with_defaults(module):
    result = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    listed = {line.split(" = ")[0].strip() for line in result.stdout.splitlines() if " = " in line}
    defaults = Config()
    for section in ("target", "data", "extract", "vocab", "draft", "train", "eval", "launch"):
        keys = {f"{section}.{name}" for name in vars(getattr(defaults, section))}
        if section in STAGES[module]:
            assert keys <= listed, f"{module} --help misses {sorted(keys - listed)}"
        else:
            assert not keys & listed, f"{module} --help lists {section}.* keys it does not read"
    assert f"target.dtype = {defaults.target.dtype!r}" in result.stdout  # the default beside each key
