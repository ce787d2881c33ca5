"""The draft's training memory per GPU, and the step options `auto` picks from it.

    bytes = fixed states + activations per token x tokens per rank

Fixed states, per trainable parameter: weight, gradient and AdamW's state (16 bytes with fp32
parameters; 14 with bf16 ones: an int16 master remainder and fp32 moments), divided by the ranks
under FSDP2; the frozen embedding [V, H] (none when kept on the host, train.embed_device) and the
teacher head [Vd, Ht] in the parameters' dtype.

Activations per token: bench-train's Kimi-shaped step (hidden 7168, 7 TTT steps, one sample of
T tokens) peaked at two lengths with selective_all (MEASURED_PEAK_GIB): their difference, with
the fixed states taken out, is the selective_all slope. `selective` (gate/up recomputed) measured
SELECTIVE_SAVES_GIB_PER_1K less in the same benchmark. The other modes are derived:
benchmarks/draft_activation_memory.py counts, on the CPU, the bytes of every tensor one training
step of the draft makes (1/8 of Kimi's widths, eager elementwise work) under each mode, and a
mode's slope here is the measured selective_all slope less the count's difference between
selective_all and that mode (the count's difference for selective is within a few percent of the
GPU's). `step` (each TTT step rerun whole in the backward) then saves COUNTED_STEP_SAVES_KIB per
token, and the mixes step*m+selective_all*(K - m) (the first m steps rerun, the later ones keep
their matmul outputs) COUNTED_RERUN_STEP_SAVES_KIB per rerun step, at most what `step` saves (the
rerun step's own activations are in memory during its backward). These slopes are scaled by the
draft's hidden size and TTT steps against that draft's; they are estimates from measured and
counted points, not measurements of another shape. Measured, counted, and this plan against the
trainer's own peaks: BENCHMARKS.md, "Activations per checkpoint mode" and "The trainer". `none`
has no slope here: `auto` never picks it.

train.activation_checkpoint=auto and train.compile=auto resolve here: on the CPU, no
checkpointing and no compile (memory is the host's; the embedded default's numbers stay as
measured); on CUDA, compile on (bench-train's fastest rows all compile the elementwise work)
and, of the modes above, the one that recomputes the fewest matmul FLOPs (checkpoint_candidates:
selective_all none, a rerun step a third of its own, selective the gate/up share of every step)
whose activations fit the GPU's memory with a 10% reserve for the allocator and the loss's
chunks (online training: the room the online plan leaves the draft beside the target,
train/online_plan.py); `step` when none does, saying so.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from eagleforge.errors import UserInputError

log = logging.getLogger(__name__)

GIB = 1 << 30
KIB = 1 << 10
# bench-train, Kimi-shaped draft (hidden 7168, 7 TTT steps), selective_all: peaks at 8192 and 32768 tokens.
MEASURED_PEAK_GIB = {8192: 22.3, 32768: 62.7}
SELECTIVE_SAVES_GIB_PER_1K = 0.37  # selective against selective_all, the same benchmark
_REF_HIDDEN, _REF_TTT = 7168, 7
# benchmarks/draft_activation_memory.py (the CPU count, 1/8 widths x 8: the Kimi draft's KiB per
# token between 1024 and 2048 tokens, per mode: BENCHMARKS.md, "Activations per checkpoint mode").
COUNTED_STEP_SAVES_KIB = 1904.8 - 1135.0  # `step` against selective_all, per token
COUNTED_RERUN_STEP_SAVES_KIB = (1904.8 - 1163.5) / 5  # each step*m step up to m = 5, per token
RESERVE = 0.10  # of the GPU's memory: allocator fragmentation, the loss's chunks, cuDNN workspaces
AUTO_MODES = ("selective_all", "selective")  # measured on the GPU; checkpoint_candidates adds the derived ones


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


def resolve_embed_device(tc, device, shared: bool = False) -> bool:
    """train.embed_device: True = the frozen embedding stays on the host (its rows gathered per
    batch by the read-ahead worker, from shards or online). auto: on CUDA, unless the draft takes
    the target's own tensor (`shared`: online training on a rank that holds the target's whole
    input embedding, native tp 1 and pp 1 or an hf target), which costs no second copy; with
    tensor-parallel or pipeline stages a rank holds a part of the target's embedding or none,
    and the [V, H] copy (2.2 GiB for Kimi-K2.5) stays off the GPU."""
    if tc.embed_device == "auto":
        return device.type == "cuda" and not shared
    return tc.embed_device == "host"


def draft_activation_bytes_per_token(hidden: int, ttt_steps: int, mode: str = "selective_all") -> float:
    """Bytes of the draft's activations per training token per rank under `mode`: selective_all,
    selective, step, or step*m+selective_all*(ttt_steps - m), scaled from the reference draft
    (the module docstring says which are measured and which derived). ValueError for a mode
    without a slope (none, other mixes)."""
    (t0, p0), (t1, p1) = sorted(MEASURED_PEAK_GIB.items())
    slope = (p1 - p0) * GIB / (t1 - t0)  # bytes per token of the reference draft, selective_all
    scale = hidden / _REF_HIDDEN
    base = slope * scale * (ttt_steps / _REF_TTT)
    if mode == "selective_all":
        return base
    if mode == "selective":
        return base - SELECTIVE_SAVES_GIB_PER_1K * GIB / 1024 * scale * (ttt_steps / _REF_TTT)
    rerun = _rerun_steps(mode, ttt_steps)
    if rerun is None:
        raise ValueError(f"no activation slope for checkpoint mode {mode!r}")
    # each rerun step drops its matmul outputs; the last one's own activations return in its backward
    full = COUNTED_STEP_SAVES_KIB * KIB * scale * (ttt_steps / _REF_TTT)
    return base - min(rerun * COUNTED_RERUN_STEP_SAVES_KIB * KIB * scale, full)


def _rerun_steps(mode: str, ttt_steps: int) -> int | None:
    """m for `step` (all) or step*m+selective_all*(ttt_steps - m); None for other modes."""
    from eagleforge.modes import checkpoint_modes

    try:
        modes = checkpoint_modes(mode, ttt_steps)
    except ValueError:
        return None
    m = modes.count("step")
    if modes != ["step"] * m + ["selective_all"] * (ttt_steps - m):
        return None
    return m


def checkpoint_candidates(config, ttt_steps: int) -> list[tuple[str, float]]:
    """The modes `auto` chooses from, (mode, share of the step's matmul FLOPs recomputed), the
    fewest first: selective_all 0; step*m+selective_all*(K - m) m / 3K (a rerun step repeats its
    forward, a third of its forward and backward); selective, the gate/up GEMMs of every step
    (2 H I of a step's forward q/k/v 3 x 2H x heads*D, o heads*D x H, MLP 3 H I, over 3 for the
    backward: 10.9% for Kimi's draft); step 1/3. config: the draft's Eagle3Config."""
    h, i, qd = config.hidden_size, config.intermediate_size, config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    forward = 2 * h * (qd + 2 * kv) + qd * h + 3 * h * i  # per token of a TTT step
    out = [("selective_all", 0.0), ("selective", 2 * h * i / (3 * forward)), ("step", 1 / 3)]
    out += [(f"step*{m}+selective_all*{ttt_steps - m}", m / (3 * ttt_steps)) for m in range(1, ttt_steps)]
    return sorted(out, key=lambda c: (c[1], c[0]))


def choose_checkpoint(config, ttt_steps: int, batch_tokens: int, budget: float) -> str | None:
    """The candidate (checkpoint_candidates) recomputing the least whose activations at
    `batch_tokens` fit `budget` bytes; None when none does."""
    for mode, _ in checkpoint_candidates(config, ttt_steps):
        if draft_activation_bytes_per_token(config.hidden_size, ttt_steps, mode) * batch_tokens <= budget:
            return mode
    return None


def bytes_per_parameter(param_dtype) -> int:
    """Weight + gradient + AdamW's state per trainable parameter (train/optimizer.py): fp32 weight,
    gradient and moments (16); or a bf16 weight and gradient, its int16 master remainder and fp32
    moments (14)."""
    return 16 if param_dtype.itemsize == 4 else 2 + 2 + 2 + 8


@dataclass
class StepPlan:
    """The draft's memory per rank for one batch size, and the options auto resolved to."""

    fixed: dict  # name -> bytes held all along
    activations_per_token: float | None  # None: no slope for the mode (none, other mixes)
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
            out.append(f"  {what:<52} not planned (no slope for this mode)")
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
              embedding: str | None = None, planned_mode: str | None = None) -> StepPlan:
    """The checkpoint mode and compile setting for `tc` (TrainConfig) and `draft` (Eagle3Draft),
    auto resolved as the module docstring says; explicit settings are kept as they are.
    gpu_bytes: the device's memory (default: the current CUDA device's total). planned_mode: the
    mode another plan chose for auto (online training's, which knows the target beside the draft)."""
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
    if mode == "auto" and planned_mode is not None:
        mode = planned_mode
    if mode == "auto":
        usable = gpu_bytes * (1 - RESERVE)
        mode = choose_checkpoint(config, tc.ttt_steps, tc.batch_tokens, usable - sum(fixed.values()))
        if mode is None:
            mode = "step"
            log.warning("train.batch_tokens=%d does not fit this GPU (%.1f GiB) by the plan even checkpointing whole TTT "
                        "steps (train.activation_checkpoint=step); lower train.batch_tokens if it runs out of memory",
                        tc.batch_tokens, gpu_bytes / GIB)
    try:
        per_token = draft_activation_bytes_per_token(config.hidden_size, tc.ttt_steps, mode)
    except ValueError:
        per_token = None
    return StepPlan(fixed, per_token, tc.batch_tokens, gpu_bytes if cuda else None, mode, compile_on)
