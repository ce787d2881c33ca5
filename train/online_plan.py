"""Memory per GPU of online training: each stage of the resident target (extract/native/plan.py)
plus the draft under FSDP2 and the rows in flight, the checkpoint mode and the pipeline cut that
fit, and the largest train.batch_tokens that fits.

    make plan CONFIG=configs/kimi_k25_pilot.yaml OVERRIDES=train.source=online
    python -m eagleforge.extract.native.plan --config configs/kimi_k25_b300.yaml train.source=online

Every line is a buffer the code holds (train/online.py, extract/native/target.py, train/
distributed.py, the draft's step), for one rank of a stage; t = train.batch_tokens (padded
tokens of this rank's batch), T = extract.batch_tokens (tokens of one target forward), P = the
draft's trainable parameters, W = ranks of the world, row = the bytes of one token's captured
states as the target sends them: (k + 1) x Ht in the target's dtype (k aux layers) + a 4-byte
greedy token.

Held all along:
- the stage's target: its weights, its pipeline buffers (the next forward's receive posted
  ahead, two sends in flight: held through the draft's step too) and its runtime reserve
  (the CUDA context, NCCL, the allocator's cache over the target's activations);
- the draft's states over the W ranks: 14 bytes per trainable parameter with bf16 weights (the
  weight, its gradient, an int16 master remainder, fp32 moments), 16 with fp32;
- the teacher head [Vd, Ht] and the frozen embedding [V, H] (on the host: nothing here, the
  default on CUDA beside pipeline stages or tp groups; the target's own tensor at tp 1 and pp 1);
- on the last stage (the group's leader, pp > 1): the rows it sends to earlier stages, the sends
  of ROW_FORWARDS_IN_FLIGHT forwards, [T, row] each at most.
Then the largest of the phases of one slot, in line (the target's forwards and the draft's step
take turns on the GPU, the allocator reusing the one's memory for the other):
- forward: the target's activations (its plan's largest phase of one forward), its second send
  in flight and, on a stage before the last, this rank's rows of the slot arriving, [t, row] at
  most (rows of forwards run ahead for later slots are received only when their slot is made);
- making the batch: the received rows and their unpacked copy, then the unpacked rows and the
  padded batch (ids, mask and the greedy tokens in int64 too): 2 x [t, row] + 13 t bytes;
- gather: at the start of the draft's forward, FSDP2's all-gather output and the gathered bf16
  weights it is copied out into, 2 x 2P;
- step: the gathered bf16 weights (2P), the draft's activations at t tokens in the checkpoint
  mode (train/step_plan.py: measured, or derived from measured and counted points; the batch
  being trained is among them), and the allocator's cache over them (10%, the extraction
  loop's measured share, plan.py ALLOCATOR_SLACK);
- end of the backward: the bf16 gradients (2P), then the gathered weights (2P) until FSDP frees
  them, then the reduce-scatter copy in the reduce dtype (2P for bf16 parameters, 4P for fp32:
  train/distributed.py), and the batch.

train.activation_checkpoint=auto: the mode recomputing the least (step_plan.checkpoint_candidates)
for which some pipeline cut fits every stage; the stages are then cut by compute among the cuts
that fit (plan.stage_layers with each stage's bytes: the last stage also holds the head and the
rows it sends, the first the embedding). The GPU's size: target.gpu_memory_gib, else the
device's, else the common sizes are planned one by one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from eagleforge.config import Config
from eagleforge.errors import UserInputError
from eagleforge.train.step_plan import GIB, checkpoint_candidates, draft_activation_bytes_per_token, fixed_bytes, resolve_param_dtype, trainable_parameter_count

ROW_FORWARDS_IN_FLIGHT = 2  # extract/native/target.py: the leader's row sends of this many forwards
ALLOCATOR_SLACK = 0.10  # the allocator's cache beyond the draft step's peak, of its activations
BATCH_EXTRA_BYTES = 8 + 8 + 1  # per padded token: input id and greedy token in int64, loss mask bool
ROW_ARGMAX_BYTES = 4  # the greedy token of a row as sent, int32


@dataclass
class Line:
    """One planned buffer: bytes = fixed + per_token x t (t = train.batch_tokens)."""

    name: str
    fixed: float = 0.0
    per_token: float = 0.0

    def at(self, t: int) -> float:
        return self.fixed + self.per_token * t


@dataclass
class StagePlan:
    """One stage's lines: held all along, and per phase (the largest phase counts)."""

    target: object  # extract.native.plan.MemoryPlan of the stage
    held: list[Line] = field(default_factory=list)
    phases: dict[str, list[Line]] = field(default_factory=dict)  # phase -> its lines

    def phase_bytes(self, t: int) -> dict[str, float]:
        return {name: sum(line.at(t) for line in lines) for name, lines in self.phases.items()}

    def peak_phase(self, t: int) -> str:
        phases = self.phase_bytes(t)
        return max(phases, key=phases.get)

    def total_bytes(self, t: int) -> int:
        return int(sum(line.at(t) for line in self.held) + max(self.phase_bytes(t).values()))


@dataclass
class OnlinePlan:
    """Every stage's plan at `batch_tokens`, the checkpoint mode and the stages' layers."""

    stages: list[StagePlan]
    world: int
    batch_tokens: int
    checkpoint: str
    ranges: list[range]
    gpu_bytes: float | None = None  # the size the cut and the mode were chosen for (None: not by memory)

    @property
    def fullest(self) -> StagePlan:
        return max(self.stages, key=lambda stage: stage.total_bytes(self.batch_tokens))

    @property
    def target(self):
        """The fullest stage's target plan."""
        return self.fullest.target

    def total_bytes(self, batch_tokens: int | None = None) -> int:
        t = self.batch_tokens if batch_tokens is None else batch_tokens
        return max(stage.total_bytes(t) for stage in self.stages)

    def draft_bytes(self, batch_tokens: int | None = None) -> int:
        """The fullest stage's bytes besides what its target holds all along (weights, pipeline
        buffers, reserve): the draft, the rows, and the largest phase (the target's activations
        when that is the forward)."""
        t = self.batch_tokens if batch_tokens is None else batch_tokens
        stage = max(self.stages, key=lambda s: s.total_bytes(t))
        return stage.total_bytes(t) - _target_held(stage.target)

    def max_batch_tokens(self, gpu_bytes: float, multiple: int = 1024, limit: int = 1 << 20) -> int:
        """The largest train.batch_tokens (a multiple of `multiple`) that fits with this plan's
        stages and checkpoint mode; 0 when none does."""
        best, t = 0, multiple
        while t <= limit and self.total_bytes(t) <= gpu_bytes:
            best, t = t, t + multiple
        return best


def _target_activations(target) -> int:
    return target.components["activations"]


def _target_held(target) -> int:
    """The target's bytes held all along: all but its activations (a forward's transient)."""
    return target.total_bytes - _target_activations(target)


def _draft_parameters(cfg: Config, text_config: dict, aux_ids: list[int]):
    """(trainable parameters, frozen embedding elements, the draft's Eagle3Config) of the draft
    the trainer builds, counted on the meta device (no memory)."""
    import torch

    from eagleforge.draft import Eagle3Config, Eagle3Draft

    overrides = {f.name: getattr(cfg.draft, f.name) for f in dataclasses.fields(cfg.draft)}
    vd = min(cfg.vocab.draft_vocab_size, int(text_config["vocab_size"]))
    config = Eagle3Config.from_target_config(text_config, vd, aux_ids, **overrides)
    with torch.device("meta"):
        draft = Eagle3Draft(config)
    return trainable_parameter_count(draft), draft.embed_tokens.weight.numel(), config


class _Planner:
    """What every stage of cfg's layout holds, given the batch and the checkpoint mode."""

    def __init__(self, cfg: Config, world: int | None, args=None, quantized: bool = True):
        import torch

        from eagleforge.extract.native import plan as target_plan

        if args is None:
            args, quantized, _ = target_plan.target_args(cfg)
        self.cfg, self.a, self.quantized, self.tp_ = cfg, args, quantized, target_plan
        self.tp, self.pp = cfg.target.tp, cfg.target.pp
        self.aux = target_plan._aux_ids(cfg, args)
        text = {k: getattr(args, k) for k in ("vocab_size", "hidden_size", "num_attention_heads", "num_hidden_layers",
                                              "intermediate_size", "kv_lora_rank", "v_head_dim", "qk_nope_head_dim",
                                              "max_position_embeddings", "rms_norm_eps", "rope_theta") if hasattr(args, k)}
        self.trainable, embed, self.draft_config = _draft_parameters(cfg, text, self.aux)
        self.world = world or self.tp * self.pp
        tc = cfg.train
        self.param_dtype = resolve_param_dtype(tc, torch.device("cuda"), "fsdp")  # online runs the target on CUDA
        # the draft's frozen embedding: the target's own tensor at tp 1 and pp 1 (OnlineSource.shared_embedding),
        # else on the host on CUDA unless train.embed_device=device (step_plan.resolve_embed_device)
        place = "shared" if self.tp * self.pp == 1 else ("device" if tc.embed_device == "device" else "host")
        vd, ht = self.draft_config.draft_vocab_size, args.hidden_size
        self.fixed = fixed_bytes(self.trainable, embed, vd * ht, self.param_dtype, self.world, place)
        k, b = len(self.aux), target_plan._dtype_bytes(cfg)
        self.b = b
        self.row = (k + 1) * ht * b + ROW_ARGMAX_BYTES  # one token's captured states as sent
        self.batch_row = (k + 1) * ht * b + BATCH_EXTRA_BYTES  # one padded token of a Batch
        self.T = cfg.extract.batch_tokens
        self.reduce_bytes = 2 if self.param_dtype == torch.bfloat16 else 4
        self._targets: dict = {}

    def stage(self, layers: range, s: int, mode: str) -> StagePlan:
        tc, p = self.cfg.train, self.trainable
        key = (layers.start, layers.stop, s)
        if key not in self._targets:  # the cut tries many ranges, for every mode
            self._targets[key] = self.tp_.config_stage_plan(self.cfg, self.a, self.quantized, layers, s)
        target = self._targets[key]
        c = target.components
        weights = sum(v for name, v in c.items() if not name.startswith(("activations", "runtime", "pipeline")))
        held = [Line("target weights", weights)]
        receive, send = self.tp_.pipeline_message_bytes(self.a, self.b, self.T, self.aux, layers, s == 0, s == self.pp - 1)
        if self.pp > 1:  # NativeTarget.pause: through the draft's step one send stays in flight, not two
            held.append(Line("target pipeline buffers (next receive posted ahead, one send in flight)",
                             receive + send))
        held.append(Line("target runtime reserve (context, NCCL, cache over its activations)", c["runtime reserve (context, NCCL, cache)"]))
        held += [Line(name, value) for name, value in self.fixed.items()]
        last = s == self.pp - 1
        if last and self.pp > 1:
            held.append(Line(f"rows in flight to earlier stages ({ROW_FORWARDS_IN_FLIGHT} forwards of [T, row])",
                             ROW_FORWARDS_IN_FLIGHT * self.T * self.row))
        slope, label = _slope(self.draft_config, tc.ttt_steps, mode)
        forward = [Line("target activations (its largest phase of one forward)", _target_activations(target))]
        if send:
            forward.append(Line("target's second send in flight", send))
        if not last:
            forward.append(Line("this rank's rows of the slot arriving [t, row]", 0.0, self.row))
        phases = {
            "forward": forward,
            "making the batch": [Line("received rows and their unpacked copy, then the padded batch", 0.0,
                                      2 * self.row + BATCH_EXTRA_BYTES)],
            "gather": [Line("FSDP2's all-gather output and the gathered bf16 weights", 4 * p)],
            "step": [Line("gathered bf16 draft weights", 2 * p),
                     Line(f"draft activations ({label}) incl. the batch", 0.0, slope),
                     Line(f"allocator cache over them ({ALLOCATOR_SLACK:.0%})", 0.0, ALLOCATOR_SLACK * slope)],
            "end of the backward": [Line("bf16 gradients", 2 * p),
                                    Line(f"then gathered weights / reduce-scatter copy ({self.reduce_bytes} bytes)",
                                         max(2, self.reduce_bytes) * p),
                                    Line("the batch", 0.0, self.batch_row)],
        }
        return StagePlan(target, held, phases)

    def stages(self, ranges: list[range], mode: str) -> list[StagePlan]:
        return [self.stage(layers, s, mode) for s, layers in enumerate(ranges)]

    def compute_cut(self) -> list[range]:
        return self.tp_.config_stage_layers(self.cfg, self.a)

    def memory_cut(self, mode: str, t: int, gpu_bytes: float) -> list[range] | None:
        """The cut balanced by compute among those whose every stage fits `gpu_bytes`; None if none."""
        fits = lambda layers, s: self.stage(layers, s, mode).total_bytes(t) <= gpu_bytes  # noqa: E731
        ranges = self.tp_.stage_layers(self.a, self.pp, self.tp, min(self.cfg.data.max_length, self.T),
                                       self.tp_._splits_rows(self.cfg), self.cfg.extract.write_target_argmax, fits)
        return ranges if all(fits(r, s) for s, r in enumerate(ranges)) else None


def _slope(config, ttt_steps: int, mode: str) -> tuple[float, str]:
    """(bytes per token, the line's label) of the draft's activations in `mode`; a mode without a
    slope is planned with selective_all's, saying so."""
    try:
        return draft_activation_bytes_per_token(config.hidden_size, ttt_steps, mode), mode
    except ValueError:
        return draft_activation_bytes_per_token(config.hidden_size, ttt_steps, "selective_all"), \
            f"{mode}: no slope, selective_all's"


def plan_online(cfg: Config, world: int | None = None, args=None, quantized: bool = True,
                gpu_bytes: float | None = None) -> OnlinePlan:
    """The plan of cfg's layout (native backend; the target from `args` (ModelArgs), else from
    target.path, else the built-in Kimi-K2.5 config) for a GPU of `gpu_bytes` (None: the cut by
    compute and, on auto, selective_all)."""
    planner = _Planner(cfg, world, args, quantized)
    tc, t = cfg.train, cfg.train.batch_tokens
    modes = ([m for m, _ in checkpoint_candidates(planner.draft_config, tc.ttt_steps)]
             if tc.activation_checkpoint == "auto" else [tc.activation_checkpoint])
    chosen = None
    if gpu_bytes is not None:
        for mode in modes:
            ranges = planner.memory_cut(mode, t, gpu_bytes)
            if ranges is not None:
                chosen = (mode, ranges)
                break
    if chosen is None:  # nothing fits (the plan says by how much), or no size to fit
        mode = modes[0] if gpu_bytes is None else modes[-1]
        chosen = (mode, planner.compute_cut())
    mode, ranges = chosen
    return OnlinePlan(planner.stages(ranges, mode), planner.world, t, mode, ranges, gpu_bytes)


def _layout_name(cfg: Config) -> str:
    return f"target.tp = {cfg.target.tp}" + (f", target.pp = {cfg.target.pp}" if cfg.target.pp > 1 else "")


def format_online_plan(plan: OnlinePlan, gpu_bytes: float | None) -> str:
    """The fullest stage line by line, then every stage's total."""
    t = plan.batch_tokens
    stage = plan.fullest
    s = plan.stages.index(stage)
    width = 74
    where = f", stage {s} of {len(plan.stages)} (layers {stage.target.layers.start}-{stage.target.layers.stop - 1})" \
        if len(plan.stages) > 1 else ""
    lines = [f"online training, train.batch_tokens = {t} per rank, draft sharded over {plan.world} GPUs, "
             f"activation checkpoint {plan.checkpoint}; the fullest GPU{where}:"]
    for line in stage.held:
        lines.append(f"  {line.name:<{width}} {line.at(t) / GIB:9.2f} GiB")
    peak = stage.peak_phase(t)
    for name, phase_lines in stage.phases.items():
        lines.append(f"  phase: {name}" + ("  <- the peak" if name == peak else ""))
        for line in phase_lines:
            lines.append(f"    {line.name:<{width - 2}} {line.at(t) / GIB:9.2f} GiB")
    lines.append(f"  {'total (held + the largest phase, ' + peak + ')':<{width}} {stage.total_bytes(t) / GIB:9.2f} GiB "
                 f"({stage.total_bytes(t) / 1e9:.1f} GB)")
    if len(plan.stages) > 1:
        cut = "by compute among the cuts that fit" if plan.gpu_bytes is not None else "by compute"
        lines.append(f"  stages (cut {cut}):")
        for i, st in enumerate(plan.stages):
            r = st.target.layers
            lines.append(f"    stage {i}: layers {r.start}-{r.stop - 1} ({len(r)}): target {st.target.total_bytes / GIB:.2f} GiB, "
                         f"total {st.total_bytes(t) / GIB:.2f} GiB, peak phase {st.peak_phase(t)}")
    if gpu_bytes:
        spare = gpu_bytes - plan.total_bytes()
        verdict = f"fits, {spare / GIB:.1f} GiB spare" if spare >= 0 else f"does NOT fit: short by {-spare / GIB:.1f} GiB"
        lines.append(f"  on a {gpu_bytes / GIB:.1f} GiB GPU: {verdict}")
        best = plan.max_batch_tokens(gpu_bytes)
        if best:
            lines.append(f"  largest train.batch_tokens that fits (this cut and mode): {best}")
        else:
            short = plan.total_bytes(1024) - gpu_bytes
            lines.append(f"  no train.batch_tokens fits: at 1024 tokens per rank still short by {short / GIB:.1f} GiB "
                         f"(a larger target.tp or pp, or more GPUs to shard the draft over)")
    return "\n".join(lines)


def check_online_fits(cfg: Config, gpu_bytes: int, world: int) -> OnlinePlan:
    """The plan for this GPU; UserInputError, naming the shortfall and the batch that would fit,
    when the target plus the draft at train.batch_tokens do not fit `gpu_bytes`."""
    plan = plan_online(cfg, world, gpu_bytes=gpu_bytes)
    if plan.total_bytes() > gpu_bytes:
        best = plan.max_batch_tokens(gpu_bytes)
        hint = f"train.batch_tokens <= {best} fits" if best else "no train.batch_tokens fits at this layout"
        stage = plan.stages.index(plan.fullest)
        where = f" (stage {stage} of {len(plan.stages)})" if len(plan.stages) > 1 else ""
        raise UserInputError(
            f"online training, {_layout_name(cfg)}, train.batch_tokens = {cfg.train.batch_tokens}: needs "
            f"{plan.total_bytes() / GIB:.1f} GiB per GPU{where} (the target's weights, buffers and reserve "
            f"{_target_held(plan.target) / GIB:.1f}, the draft, rows and largest phase {plan.draft_bytes() / GIB:.1f}, activation "
            f"checkpoint {plan.checkpoint}) but the GPU has {gpu_bytes / GIB:.1f} GiB: short by "
            f"{(plan.total_bytes() - gpu_bytes) / GIB:.1f} GiB; {hint} "
            f"(see `make plan CONFIG=... OVERRIDES=train.source=online`)"
        )
    return plan


def print_online_plan(cfg: Config, gpu_bytes: float | None) -> None:
    """The plan for this GPU (target.gpu_memory_gib or the device's); without one, for the common
    sizes: the smallest in full, each one's verdict."""
    from eagleforge.extract.native.plan import GPU_SIZES_GB

    try:
        sizes = {f"a {gpu_bytes / GIB:.1f} GiB GPU": gpu_bytes} if gpu_bytes else GPU_SIZES_GB
        plans = {name: plan_online(cfg, gpu_bytes=size) for name, size in sizes.items()}
    except ValueError as err:
        raise UserInputError(f"online plan: {err}") from None
    print()
    first = next(iter(sizes))
    if not gpu_bytes:
        print(f"(no GPU here and no target.gpu_memory_gib: planned for {first}; then the verdict for each common size)")
    print(format_online_plan(plans[first], sizes[first]))
    if gpu_bytes:
        return
    for name, size in sizes.items():
        plan = plans[name]
        spare, best = size - plan.total_bytes(), plan.max_batch_tokens(size)
        verdict = f"fits, {spare / GIB:.1f} GiB spare" if spare >= 0 else f"short by {-spare / GIB:.1f} GiB"
        largest = f"largest train.batch_tokens that fits: {best}" if best else \
            f"no train.batch_tokens fits (at 1024: short by {(plan.total_bytes(1024) - size) / GIB:.1f} GiB)"
        print(f"  on {name}: {verdict} (activation checkpoint {plan.checkpoint}, stages "
              f"{', '.join(str(len(r)) for r in plan.ranges)} layers); {largest}")


# The draft's step rate a layout's projection scales by the stated matmul rate, and the bf16
# matmul rate of the GPU it was measured on: bench-train's trainer at 8192 tokens from shards with
# selective_all on one H200 (2026-12-02, with the bf16 AdamW moments of then), that H200's rate
# from bench-pipeline. The trainer's current measurement (an H100): BENCHMARKS.md, "The trainer".
DRAFT_TOKENS_PER_S_REF, DRAFT_REF_TFLOPS = 11822.0, 751.0


def project_online(target_tokens_per_s: float, gpus: int, matmul_tflops: float, recompute: float) -> float:
    """Training tokens/s of one group of `gpus` GPUs online, COMPUTED: a slot forwards the group's
    gpus batches of t tokens through the target (t x gpus / target_tokens_per_s: the stages never
    drain between slots, train/online.py) and each GPU then steps the draft on its t tokens
    (t / draft rate, the rate scaled from the measured one by the matmul rate and slowed by the
    checkpoint mode's recomputed share); the two take turns on the GPUs (forwards in line), so
    per token of the group 1 / target + 1 / (gpus x draft)."""
    draft = DRAFT_TOKENS_PER_S_REF * matmul_tflops / DRAFT_REF_TFLOPS / (1.0 + recompute)
    return 1.0 / (1.0 / target_tokens_per_s + 1.0 / (gpus * draft))


def choose_online_layout(cfg: Config, gpu_bytes: float | None, world: int | None = None, rates=None) -> tuple[int, int, str]:
    """target.layout=auto for online training: (tp, pp, the line saying so) of the split of
    target.tp x target.pp GPUs whose online plan fits `gpu_bytes` (None: any) and whose projected
    training tokens/s (project_online, the target's stages from preflight.project_ranges at the
    stated rates) is the highest; the configured split when none fits (the check then refuses it
    with its shortfall)."""
    from eagleforge.extract.native import plan as target_plan
    from eagleforge.extract.native.preflight import STATED_RATES, _pick, layout_splits, project_ranges

    rates = rates or STATED_RATES
    a, quantized, _ = target_plan.target_args(cfg)
    gpus = cfg.target.tp * cfg.target.pp
    seq = min(cfg.data.max_length, cfg.extract.batch_tokens)
    rows, modes = [], {}
    for tp, pp in layout_splits(a, gpus):
        trial = dataclasses.replace(cfg, target=dataclasses.replace(cfg.target, tp=tp, pp=pp))
        plan = plan_online(trial, world or gpus, a, quantized, gpu_bytes=gpu_bytes)
        target = project_ranges(a, tp, plan.ranges, rates, target_plan._dtype_bytes(cfg), seq, target_plan._aux_ids(cfg, a),
                                cfg.extract.write_target_argmax, target_plan._splits_rows(trial))
        draft_config = _Planner(trial, world or gpus, a, quantized).draft_config
        recompute = dict(checkpoint_candidates(draft_config, cfg.train.ttt_steps)).get(plan.checkpoint, 0.0)
        online = project_online(target["per_group"], gpus, rates.matmul_tflops, recompute)
        rows.append((tp, pp, gpu_bytes is None or plan.total_bytes() <= gpu_bytes, online))
        modes[(tp, pp)] = plan.checkpoint
    return _pick(cfg, rows, gpus, gpu_bytes, "the online plan", "training tokens/s a group",
                 detail=lambda tp, pp: f", the draft's {cfg.train.batch_tokens} tokens per rank with {modes[(tp, pp)]}")
