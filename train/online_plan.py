"""Memory per GPU of online training: the resident target (extract/native/plan.py) plus the draft
under FSDP2, and the largest train.batch_tokens that fits.

    make plan CONFIG=configs/kimi_k25_pilot.yaml OVERRIDES=train.source=online
    python -m eagleforge.extract.native.plan --config configs/kimi_k25_b300.yaml train.source=online

Per GPU, on top of the target's plan (weights, the activations of one forward of
extract.batch_tokens tokens, the runtime reserve):
- draft states under FSDP2 over the world (W GPUs; planned at W = target.tp, one node: more nodes
  only shard these further): weights, gradients and AdamW's state (bf16 weights on CUDA by
  default, with int16 master remainders and fp32 moments: 14 bytes per trainable parameter / W;
  fp32 weights: 16);
- draft working copies (not sharded): the gathered bf16 parameters, their bf16 gradients and the
  fp32 copy FSDP reduce-scatters, 8 bytes per trainable parameter (one root unit:
  train/distributed.py);
- replicated tensors: the frozen embedding [V, H] and the teacher head [Vd, Ht], in the
  parameters' dtype;
- the draft's activations at train.batch_tokens tokens per rank: the measured slope of
  train/step_plan.py (selective_all unless train.activation_checkpoint is selective), an
  estimate from two measured points, not a measurement of this planner's total;
- the batches in flight: train.prefetch + 1 batches of captured states in fp32
  ((k + 1) x Ht x 4 bytes per token) and the group's union of states of one forward
  (target.tp batches in the target dtype).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from eagleforge.config import Config
from eagleforge.errors import UserInputError
from eagleforge.train.step_plan import AUTO_MODES, GIB, draft_activation_bytes_per_token, fixed_bytes, resolve_param_dtype, trainable_parameter_count


@dataclass
class OnlinePlan:
    """Bytes per GPU. The draft's peak is the larger of two phases: the start of the backward
    (gathered bf16 weights + all activations) and its end (gathered weights, their bf16
    gradients and the fp32 copy FSDP reduce-scatters, the activations freed)."""

    target: object  # extract.native.plan.MemoryPlan
    world: int
    batch_tokens: int
    fixed: dict = field(default_factory=dict)  # name -> bytes held all along
    gathered: int = 0  # bf16 weights gathered for the forward and backward
    grads: int = 0  # bf16 gradients + their fp32 reduce-scatter copy, at the end of the backward
    activations_per_token: float = 0.0  # the draft's activations, bytes per train token per rank
    in_flight_per_token: dict = field(default_factory=dict)  # states of queued batches, bytes per train token

    def _phases(self, t: int) -> tuple[float, float]:
        in_flight = t * sum(self.in_flight_per_token.values())
        return self.gathered + self.activations_per_token * t + in_flight, self.gathered + self.grads + in_flight

    def draft_bytes(self, batch_tokens: int | None = None) -> int:
        t = self.batch_tokens if batch_tokens is None else batch_tokens
        return int(sum(self.fixed.values()) + max(self._phases(t)))

    def total_bytes(self, batch_tokens: int | None = None) -> int:
        return self.target.total_bytes + self.draft_bytes(batch_tokens)

    def max_batch_tokens(self, gpu_bytes: float, multiple: int = 1024, limit: int = 1 << 20) -> int:
        """The largest train.batch_tokens (a multiple of `multiple`) that fits; 0 when none does."""
        best, t = 0, multiple
        while t <= limit and self.total_bytes(t) <= gpu_bytes:
            best, t = t, t + multiple
        return best


def _draft_parameters(cfg: Config, text_config: dict, aux_ids: list[int]) -> tuple[int, int, int, int]:
    """(trainable parameters, frozen embedding elements, draft hidden size, draft vocabulary) of
    the draft the trainer builds, counted on the meta device (no memory)."""
    from dataclasses import fields

    import torch

    from eagleforge.draft import Eagle3Config, Eagle3Draft

    overrides = {f.name: getattr(cfg.draft, f.name) for f in fields(cfg.draft)}
    vd = min(cfg.vocab.draft_vocab_size, int(text_config["vocab_size"]))
    config = Eagle3Config.from_target_config(text_config, vd, aux_ids, **overrides)
    with torch.device("meta"):
        draft = Eagle3Draft(config)
    return trainable_parameter_count(draft), draft.embed_tokens.weight.numel(), config.hidden_size, vd


def plan_online(cfg: Config, world: int | None = None, args=None, quantized: bool = True) -> OnlinePlan:
    """The plan of cfg's layout (native backend; the target from `args` (ModelArgs), else from
    target.path, else the built-in Kimi-K2.5 config)."""
    from eagleforge.extract.native import plan as target_plan

    if args is None:
        a, quantized, _ = target_plan.target_args(cfg)
    else:
        a = args
    aux = target_plan._aux_ids(cfg, a)
    tp, pp = cfg.target.tp, cfg.target.pp
    # the fullest pipeline stage (the whole target when target.pp = 1): every rank trains the draft beside it
    t = max(target_plan.config_stages(cfg, a, quantized), key=lambda stage: stage.total_bytes)
    text = {k: getattr(a, k) for k in ("vocab_size", "hidden_size", "num_attention_heads", "num_hidden_layers",
                                       "intermediate_size", "kv_lora_rank", "v_head_dim", "qk_nope_head_dim",
                                       "max_position_embeddings", "rms_norm_eps", "rope_theta") if hasattr(a, k)}
    trainable, embed, hidden, vd = _draft_parameters(cfg, text, aux)
    world = world or tp * pp
    ht, k, tc = a.hidden_size, len(aux), cfg.train
    plan = OnlinePlan(t, world, tc.batch_tokens)
    import torch

    param_dtype = resolve_param_dtype(tc, torch.device("cuda"), "fsdp")  # online runs the target on CUDA
    # at tp 1 and pp 1 the draft's frozen embedding is the target's own tensor (OnlineSource.shared_embedding)
    plan.fixed = fixed_bytes(trainable, embed, vd * ht, param_dtype, world, "shared" if tp * pp == 1 else "device")
    plan.gathered, plan.grads = 2 * trainable, 6 * trainable
    mode = tc.activation_checkpoint if tc.activation_checkpoint in AUTO_MODES else "selective_all"
    plan.activations_per_token = draft_activation_bytes_per_token(hidden, tc.ttt_steps, mode)
    row = (k + 1) * ht * target_plan._dtype_bytes(cfg)  # one token's captured states
    plan.in_flight_per_token = {
        f"captured states in flight (prefetch {tc.prefetch} + 1, fp32)": (tc.prefetch + 1) * (k + 1) * ht * 4,
        f"group union of one forward ({tp * pp} batches)": tp * pp * row,
    }
    if pp > 1:  # the slots whose forwards run while this one's rows come back from the last stage
        plan.in_flight_per_token[f"rows arriving from the last stage ({pp - 1} slots ahead)"] = (pp - 1) * row
    return plan


def format_online_plan(plan: OnlinePlan, gpu_bytes: float | None) -> str:
    t = plan.batch_tokens
    start, end = plan._phases(t)
    lines = [f"online training, train.batch_tokens = {t} per rank, draft sharded over {plan.world} GPUs:",
             f"  {'target (weights, activations, reserve)':<62} {plan.target.total_bytes / GIB:9.2f} GiB"]
    for name, value in plan.fixed.items():
        lines.append(f"  {name:<62} {value / GIB:9.2f} GiB")
    for name, value in plan.in_flight_per_token.items():
        lines.append(f"  {name:<62} {value * t / GIB:9.2f} GiB")
    lines.append(f"  {'gathered bf16 draft weights':<62} {plan.gathered / GIB:9.2f} GiB")
    lines.append(f"  {'draft activations (start of the backward)':<62} {plan.activations_per_token * t / GIB:9.2f} GiB")
    lines.append(f"  {'draft bf16 grads + fp32 reduce copy (end of the backward)':<62} {plan.grads / GIB:9.2f} GiB")
    lines.append(f"  {'draft peak phase':<62} {'start' if start >= end else 'end':>9}")
    lines.append(f"  {'total':<62} {plan.total_bytes() / GIB:9.2f} GiB ({plan.total_bytes() / 1e9:.1f} GB)")
    if gpu_bytes:
        spare = gpu_bytes - plan.total_bytes()
        verdict = f"fits, {spare / GIB:.1f} GiB spare" if spare >= 0 else f"does NOT fit: short by {-spare / GIB:.1f} GiB"
        lines.append(f"  on a {gpu_bytes / GIB:.1f} GiB GPU: {verdict}")
        best = plan.max_batch_tokens(gpu_bytes)
        if best:
            lines.append(f"  largest train.batch_tokens that fits: {best}")
        else:
            short = plan.total_bytes(1024) - gpu_bytes
            lines.append(f"  no train.batch_tokens fits: at 1024 tokens per rank still short by {short / GIB:.1f} GiB "
                         f"(a larger target.tp, or more GPUs to shard the draft over)")
    return "\n".join(lines)


def check_online_fits(cfg: Config, gpu_bytes: int, world: int) -> OnlinePlan:
    """Raise UserInputError, naming the shortfall and the batch that would fit, when the target
    plus the draft at train.batch_tokens do not fit `gpu_bytes`."""
    plan = plan_online(cfg, world)
    if plan.total_bytes() > gpu_bytes:
        best = plan.max_batch_tokens(gpu_bytes)
        hint = f"train.batch_tokens <= {best} fits" if best else "no train.batch_tokens fits at this layout"
        raise UserInputError(
            f"online training, target.tp = {cfg.target.tp}" + (f", target.pp = {cfg.target.pp}" if cfg.target.pp > 1 else "")
            + f", train.batch_tokens = {cfg.train.batch_tokens}: needs "
            f"{plan.total_bytes() / GIB:.1f} GiB per GPU (target {plan.target.total_bytes / GIB:.1f}, draft "
            f"{plan.draft_bytes() / GIB:.1f}) but the GPU has {gpu_bytes / GIB:.1f} GiB: short by "
            f"{(plan.total_bytes() - gpu_bytes) / GIB:.1f} GiB; {hint} (see `make plan CONFIG=... OVERRIDES=train.source=online`)"
        )
    return plan


def print_online_plan(cfg: Config, gpu_bytes: float | None) -> None:
    try:
        plan = plan_online(cfg)
    except ValueError as err:
        raise UserInputError(f"online plan: {err}") from None
    print()
    print(format_online_plan(plan, gpu_bytes))
    if gpu_bytes is None:  # no GPU here and no target.gpu_memory_gib: the common sizes
        from eagleforge.extract.native.plan import GPU_SIZES_GB

        for name, size in GPU_SIZES_GB.items():
            spare, best = size - plan.total_bytes(), plan.max_batch_tokens(size)
            verdict = f"fits, {spare / GIB:.1f} GiB spare" if spare >= 0 else f"short by {-spare / GIB:.1f} GiB"
            largest = f"largest train.batch_tokens that fits: {best}" if best else \
                f"no train.batch_tokens fits (at 1024: short by {(plan.total_bytes(1024) - size) / GIB:.1f} GiB)"
            print(f"  on {name}: {verdict}; {largest}")
