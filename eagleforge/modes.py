"""The one list of every mode a config key can name, and the parser of the per-step activation
checkpointing form. Plain Python with no imports, so that the config layer, the draft library
and the trainer all check against the same names without importing each other.
"""

from __future__ import annotations

from typing import Sequence

# train.attention: how the TTT attention (step-0 causal keys + a diagonal of later steps) runs;
# "auto" picks merged_cudnn on CUDA and fast elsewhere (draft/attention.py).
ATTENTION_MODES = ("auto", "reference", "fast", "sdpa", "merged", "merged_cudnn", "flex")

# train.activation_checkpoint, per TTT step:
#   none       keep every activation (most memory, no recompute)
#   step       keep only each step's inputs and outputs; the backward reruns the whole step
#   selective  keep the outputs of the matmuls whose inner dimension exceeds H and of the flash
#              attention kernel; recompute norms, RoPE, SiLU, the attention merge and gate/up
#   selective_all  the same, keeping every matmul output (gate/up too): no matmul recomputed
CHECKPOINT_MODES = ("none", "step", "selective", "selective_all")
COMPILE_MODES = (False, True, "dynamic")  # train.compile: off, static shapes (a graph per shape), dynamic
PARALLEL_MODES = ("auto", "none", "fsdp", "ddp")  # train.parallel (train/distributed.py)
# train.loss: the soft cross-entropy, plain torch or the fused Triton kernel (auto: fused on
# CUDA); or the acceptance-aware LK loss, fused (lk) or plain torch (lk_reference)
LOSS_MODES = ("auto", "reference", "fused", "lk", "lk_reference")
LK_LOSS_MODES = ("lk", "lk_reference")
PLAIN_LOSS_MODES = ("reference", "lk_reference")  # the per-step plain-torch losses (train/loss.py)
LOSS_POSITIONS = ("assistant", "all")  # train.loss_positions
# train.param_dtype: the draft's trainable weights, gradients and AdamW moments. float32 = fp32
# master weights under bf16 autocast; bfloat16 = all three in bf16 (8 bytes per parameter instead
# of 16, and fused weight gradients); auto = bfloat16 on CUDA with train.bf16, float32 elsewhere.
PARAM_DTYPES = ("auto", "float32", "bfloat16")
# train.embed_device: where the draft's frozen input embedding [V, H] lives in training: auto
# (the host when training from shards on CUDA, else the device) | device | host
EMBED_DEVICES = ("auto", "device", "host")
TRAIN_SOURCES = ("shards", "online")  # train.source: RUN/hidden, or the target run inside the train stage
TARGET_BACKENDS = ("hf", "native")  # target.backend
# target.device_map (hf backend): none, or transformers' device_map strategies (accelerate)
DEVICE_MAPS = ("none", "auto", "balanced", "balanced_low_0", "sequential")
EXPERT_LAYOUTS = ("ep", "tp")  # target.expert_layout: whole experts per rank, or each expert split
# target.layout (native): target.tp x target.pp as set, or the fastest split of those GPUs that fits
TARGET_LAYOUTS = ("fixed", "auto")
PREFILL_ATTENTION_MODES = ("auto", "cudnn", "flash", "flash_attn")  # target.prefill_attention (native)
MOE_BACKENDS = ("auto", "triton", "grouped_mm", "loop")  # target.moe_backend (native)
TARGET_DTYPES = ("float32", "bfloat16", "float16")
STORAGE_DTYPES = ("bfloat16", "float16", "float32", "float8_e4m3fn")  # extract.storage_dtype
OVERLONG_MODES = ("truncate", "drop")  # data.overlong
SPECIAL_TEXT_MODES = ("refuse", "encode")  # data.special_text (eagleforge/data/chat.py)
LAUNCH_MODES = ("auto", "none")  # launch.mode: re-run extract/train under torchrun when needed, or never
EVAL_ENGINES = ("project", "vllm")  # eval.engine: the engine here, or it and vLLM (eval/vllm_engine.py)


def checkpoint_modes(spec: str | Sequence[str], ttt_steps: int) -> list[str]:
    """One of CHECKPOINT_MODES per TTT step, from a mode for every step ("selective_all"), a list
    of ttt_steps modes, or the same list as a string, "*n" repeating a mode:
    "selective*3+selective_all*4" (the first 3 steps recompute gate/up, the last 4 keep them:
    between the two modes in memory and time)."""
    if isinstance(spec, str) and "+" not in spec and "*" not in spec:
        modes = [spec.strip()] * ttt_steps
    elif isinstance(spec, str):
        modes = []
        for part in spec.split("+"):
            mode, _, count = (p.strip() for p in part.partition("*"))
            if not (count == "" or (count.isdigit() and int(count) > 0)):
                raise ValueError(f"checkpoint {spec!r}: {part!r} is not MODE or MODE*N")
            modes += [mode] * int(count or 1)
    else:
        modes = list(spec)
    bad = [m for m in modes if m not in CHECKPOINT_MODES]
    if bad or len(modes) != ttt_steps:
        raise ValueError(f"checkpoint {spec!r}: need one of {CHECKPOINT_MODES} per TTT step ({ttt_steps} steps), "
                         f"as one mode, a list or 'MODE*N+MODE*M'; got {len(modes)} steps" + (f", unknown {bad}" if bad else ""))
    return modes
