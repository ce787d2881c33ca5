"""Native extraction backend for the DeepSeek-V3 family (Kimi-K2.5 first), tensor parallel.

    model.py     forward math, communication-free (MLA + YaRN, dense MLP, noaux_tc MoE)
    parallel.py  parallel layers and process groups: the only communication
    loader.py    config.json + safetensors index, each rank reads only its slices
    int4.py      compressed-tensors pack-quantized INT4 dequantization (+ reference)
    plan.py      memory planner: `python -m eagleforge.extract.native.plan --config ...`
    run.py       extract_native(cfg): the extract stage under torchrun

`python -m eagleforge.extract` calls `extract_native(cfg)` when target.backend = native.
"""

from __future__ import annotations


def extract_native(cfg):
    """See run.extract_native (imported lazily: the planner and the loader do not need it)."""
    from eagleforge.extract.native.run import extract_native as _extract_native

    return _extract_native(cfg)


__all__ = ["extract_native"]
