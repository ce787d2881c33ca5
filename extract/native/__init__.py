"""Native extraction backend for the DeepSeek-V3 family (Kimi-K2.5 first), tensor parallel.

    model.py      forward math, communication-free (MLA + YaRN, dense MLP, noaux_tc MoE)
    parallel.py   parallel layers: the only communication
    loader.py     config.json + safetensors index, each rank reads only its slices
    int4.py       compressed-tensors pack-quantized INT4 dequantization (+ reference)
    plan.py       memory planner: `python -m eagleforge.extract.native.plan --config ...`
    preflight.py  a machine's link and matmul rates, projected extraction tokens/s
    target.py     NativeTarget: the backend as the extract stage (extract/driver.py) and online training see it
"""
