"""The draft's training memory per GPU, and the step options `auto` picks from it.

    bytes = fixed states + activations per token x tokens per rank

Fixed states, per trainable parameter: weight, gradient and AdamW's state (16 bytes with fp32
parameters; 14 with bf16 ones: an int16 master remainder and fp32 moments), divided by the ranks
under FSDP2; the frozen embedding [V, H] (none when kept on the host, train.embed_device) and the
teacher head [Vd, Ht] in the parameters' dtype.

Activations per token: bench-train's Kimi-shaped step (hidden 7168, 7 TTT steps, one sample of
T tokens; the step the benchmark assembled from the draft and the loss, 2026-11-30, in
BENCHMARKS.md's history) peaked at 22.3 GiB at 8K and 62.7 GiB at 32K
tokens with selective_all: 40.4 GiB per 24K tokens once the fixed states are taken out by the
difference. `selective` (gate/up recomputed) measured ~0.37 GiB less per 1K tokens in the same
benchmark. These slopes are scaled by the draft's hidden size and TTT steps against that
draft's; they are estimates from measured points, not measurements of another shape. The
trainer's own step (bench-train's trainer rows, the frozen embedding on the GPU) then peaked at
14.56, 24.56, 38.18 and 64.88 GiB at 2K, 8K, 16K and 32K tokens, where this plan says 14.85,
24.95, 38.42 and 65.35; with the embedding on the host, 22.40 GiB at 8K where it says 22.77. `none`
and `step` have no measured slope here: `auto` never picks `none` (selective_all keeps every
matmul output and was the fastest measured mode) and falls back to `step`, the least memory, only
when neither selective mode fits, saying so.

train.activation_checkpoint=auto and train.compile=auto resolve here: on the CPU, no
checkpointing and no compile (memory is the host's; the embedded default's numbers stay as
measured); on CUDA, compile on (bench-train's fastest rows all compile the elementwise work)
and the first of selective_all, selective that fits in the GPU's memory with a 10% reserve for
the allocator and the loss's chunks, else step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from eagleforge.config import UserInputError

log = logging.getLogger(__name__)

GIB = 1 << 30
# bench-train, Kimi-shaped draft (hidden 7168, 7 TTT steps), selective_all: peaks at 8192 and 32768 tokens.
MEASURED_PEAK_GIB = {8192: 22.3, 32768: 62.7}
SELECTIVE_SAVES_GIB_PER_1K = 0.37  # selective against selective_all, the same benchmark
_REF_HIDDEN, _REF_TTT = 7168, 7
RESERVE = 0.10  # of the GPU's memory: allocator fragmentation, the loss's chunks, cuDNN workspaces
AUTO_MODES = ("selective_all", "selective")  # tried in this order; `step` when neither fits


def resolve_param_dtype(tc, device, parallel: str):
    """train.param_dtype as a torch dtype: auto = bfloat16 on CUDA with train.bf16, else float32."""
    import torch

    name = tc.param_dtype
    if name == "auto":
        name = "bfloat16" if device.type == "cuda" and tc.bf16 else "float32"
    if name == "bfloat16" and not tc.bf16:
        raise UserInputError("train.param_dtype=bfloat16 needs train.bf16=true (bf16 weights run bf16 matmuls)")
    if name == "bfloat16" and parallel == "ddp":  # DDP hooks AccumulateGrad, which fused weight gradients bypass
        raise UserInputError("train.param_dtype=bfloat16 runs with train.parallel=fsdp or none, not ddp "
                             "(its fused weight gradients bypass DDP's reducer); set train.param_dtype=float32 for ddp")
    return getattr(torch, name)


def resolve_embed_device(tc, device, online: bool) -> bool:
    """train.embed_device: True = the frozen embedding stays on the host (its rows gathered per
    batch by the read-ahead worker). auto: on CUDA when training from shards; online batches
    come from the target on the device, so the draft looks its embeddings up there."""
    if tc.embed_device == "host" and online:
        raise UserInputError("train.embed_device=host needs train.source=shards: online batches are built on the "
                             "device by the target; set train.embed_device=device or auto")
    if tc.embed_device == "auto":
        return device.type == "cuda" and not online
    return tc.embed_device == "host"


def draft_activation_bytes_per_token(hidden: int, ttt_steps: int, mode: str = "selective_all") -> float:
    """Bytes of the draft's activations per training token per rank under `mode` (a selective
    mode), scaled from the measured reference draft."""
    (t0, p0), (t1, p1) = sorted(MEASURED_PEAK_GIB.items())
    slope = (p1 - p0) * GIB / (t1 - t0)  # bytes per token of the reference draft, selective_all
    if mode == "selective":
        slope -= SELECTIVE_SAVES_GIB_PER_1K * GIB / 1024
    elif mode != "selective_all":
        raise ValueError(f"no measured activation slope for checkpoint mode {mode!r}")
    return slope * (hidden / _REF_HIDDEN) * (ttt_steps / _REF_TTT)


def bytes_per_parameter(param_dtype) -> int:
    """Weight + gradient + AdamW's state per trainable parameter (train/optimizer.py): fp32 weight,
    gradient and moments (16); or a bf16 weight and gradient, its int16 master remainder and fp32
    moments (14)."""
    return 16 if param_dtype.itemsize == 4 else 2 + 2 + 2 + 8


@dataclass
class StepPlan:
    """The draft's memory per rank for one batch size, and the options auto resolved to."""

    fixed: dict  # name -> bytes held all along
    activations_per_token: float | None  # None: no measured slope for the mode (none, step, mixed)
    batch_tokens: int
    gpu_bytes: int | None  # None on the CPU
    activation_checkpoint: str
    compile: bool

    @property
    def total_bytes(self) -> int:
        """Fixed states plus the planned activations (fixed states only when the mode has no slope)."""
        return int(sum(self.fixed.values()) + (self.activations_per_token or 0.0) * self.batch_tokens)

    def lines(self) -> list[str]:
        out = [f"  {name:<52} {size / GIB:8.2f} GiB" for name, size in self.fixed.items()]
        what = f"activations ({self.activation_checkpoint}) x {self.batch_tokens} tokens"
        if self.activations_per_token is None:
            out.append(f"  {what:<52} not planned (no measured slope for this mode)")
        else:
            out.append(f"  {what:<52} {self.activations_per_token * self.batch_tokens / GIB:8.2f} GiB")
        usable = "" if self.gpu_bytes is None else f" of {self.gpu_bytes * (1 - RESERVE) / GIB:.1f} GiB usable"
        out.append(f"  {'total':<52} {self.total_bytes / GIB:8.2f} GiB{usable}")
        return out


def trainable_parameter_count(draft) -> int:
    """The draft's trained parameters: all but the frozen embed_tokens (a real or a meta draft)."""
    return sum(p.numel() for name, p in draft.named_parameters() if not name.startswith("embed_tokens"))


def fixed_bytes(trainable: int, embed_elements: int, head_elements: int, param_dtype, world: int = 1,
                embedding: str = "device") -> dict:
    """The draft's memory held all along. embedding: where the frozen [V, H] is: "device" (the
    draft's own copy), "host" (rows gathered per batch) or "shared" (online training on a target
    that holds the same tensor: the target's, counted with the target)."""
    size = param_dtype.itemsize
    label = {"device": "frozen embedding [V, H]", "host": "frozen embedding [V, H] (on the host)",
             "shared": "frozen embedding [V, H] (the target's own, shared)"}[embedding]
    return {
        f"weights + grads + AdamW state ({str(param_dtype).removeprefix('torch.')} weights, / {world} ranks)":
            bytes_per_parameter(param_dtype) * trainable // world,
        label: size * embed_elements if embedding == "device" else 0,
        "teacher head [Vd, Ht]": size * head_elements,
    }


def plan_step(tc, draft, param_dtype, device, world: int = 1, gpu_bytes: int | None = None,
              embedding: str | None = None) -> StepPlan:
    """The checkpoint mode and compile setting for `tc` (TrainConfig) and `draft` (Eagle3Draft),
    auto resolved as the module docstring says; explicit settings are kept as they are.
    gpu_bytes: the device's memory (default: the current CUDA device's total)."""
    import torch

    trainable = trainable_parameter_count(draft)
    config = draft.config
    embed = draft.embed_tokens.weight
    embedding = embedding or ("device" if embed.numel() else "host")
    fixed = fixed_bytes(trainable, config.vocab_size * config.hidden_size, config.draft_vocab_size * config.target_hidden_size,
                        param_dtype, world, embedding)
    cuda = device.type == "cuda"
    if cuda and gpu_bytes is None:
        gpu_bytes = torch.cuda.get_device_properties(device).total_memory
    compile_on = cuda if tc.compile == "auto" else bool(tc.compile)
    mode = tc.activation_checkpoint
    if mode == "auto" and not cuda:
        mode = "none"
    if mode == "auto":
        usable = gpu_bytes * (1 - RESERVE)
        for candidate in AUTO_MODES:
            per_token = draft_activation_bytes_per_token(config.hidden_size, tc.ttt_steps, candidate)
            if sum(fixed.values()) + per_token * tc.batch_tokens <= usable:
                mode = candidate
                break
        else:
            mode = "step"
            log.warning("train.batch_tokens=%d does not fit with selective checkpointing on this GPU (%.1f GiB) by the "
                        "plan: checkpointing whole TTT steps (train.activation_checkpoint=step); lower train.batch_tokens "
                        "if it runs out of memory", tc.batch_tokens, gpu_bytes / GIB)
    per_token = draft_activation_bytes_per_token(config.hidden_size, tc.ttt_steps, mode) if mode in AUTO_MODES else None
    return StepPlan(fixed, per_token, tc.batch_tokens, gpu_bytes if cuda else None, mode, compile_on)
