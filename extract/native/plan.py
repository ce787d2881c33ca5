"""Memory planner for the native backend: bytes per GPU by component, and whether it fits.

    make plan CONFIG=configs/kimi_k25_pilot.yaml
    python -m eagleforge.extract.native.plan --config configs/kimi_k25_b300.yaml target.tp=16

Reads the target's config.json (target.path); when that directory does not exist on this machine
(planning before downloading 595 GB), it plans the built-in Kimi-K2.5 text config of
docs/kimi-k25.md and says so. Prints the configured layout in detail, then the grid tp 4/8/16 x expert
layouts ep/tp against common GPU sizes. Extraction calls `check_fits` before loading anything and
refuses to start, saying by how much, when the largest rank's share does not fit.

Weights: what each rank holds (parallel.py): vocab-parallel embedding and head, heads split over
tp, q_a/kv_a/norms/router replicated, dense and shared MLPs split, routed experts INT4 packed
(0.5 byte per weight + a bf16 scale per 32) either as whole experts (ep, the rank with the most
experts counts) or sliced along the intermediate dim (tp). Activations: the largest phase of one
forward of `extract.batch_tokens` tokens (MoE, attention, dense MLP, the packing and greedy head
at the end), counted tensor by tensor and checked on the GPU against the extraction loop
(benchmarks/check_plan.py); and a runtime reserve (CUDA context, NCCL buffers at tp > 1, the
allocator's cache beyond the peak; `runtime_reserve`).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from eagleforge.cli import run_main
from eagleforge.config import Config
from eagleforge.errors import UserInputError
from eagleforge.extract.native import int4
from eagleforge.extract.native.model import ATTENTION_CHUNK_TOKENS, ModelArgs
from eagleforge.extract.native.parallel import ARGMAX_CHUNK_TOKENS, SPLIT_ROWS_MIN_TOKENS, split_range
from eagleforge.readers import read_json_object
from eagleforge.target.loading import default_aux_layers

log = logging.getLogger(__name__)

GIB = 1 << 30
# Memory besides the weights and the activations' peak: the CUDA context and libraries outside
# the allocator; NCCL's buffers on top of them at tp > 1 (measured at tp 2 only; more peers at tp 8
# are not measured); the allocator's cache beyond the allocated peak, a share of the activations.
# The constants below cover what was measured on an H200 with the expandable segments the native
# backend asks for (measured: BENCHMARKS.md, "Memory planner against the extraction loop").
CONTEXT_RESERVE_BYTES = 1 * GIB
NCCL_RESERVE_BYTES = 1 * GIB
ALLOCATOR_SLACK = 0.10  # of the activations
GPU_SIZES_GB = {"96 GB (RTX PRO 6000)": 96e9, "141 GB (H200)": 141e9, "288 GB (B300)": 288e9}

# The Kimi-K2.5 text_config (docs/kimi-k25.md), used when target.path is not on this machine.
KIMI_K25_TEXT_CONFIG = dict(
    model_type="deepseek_v3", vocab_size=163840, hidden_size=7168, intermediate_size=18432,
    moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=64, num_key_value_heads=64,
    n_shared_experts=1, n_routed_experts=384, num_experts_per_tok=8, n_group=1, topk_group=1,
    first_k_dense_replace=1, routed_scaling_factor=2.827, norm_topk_prob=True, scoring_func="sigmoid",
    topk_method="noaux_tc", q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
    v_head_dim=128, hidden_act="silu", rms_norm_eps=1e-5, rope_theta=50000.0, max_position_embeddings=262144,
    rope_scaling={"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                  "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
    tie_word_embeddings=False, attention_bias=False, num_nextn_predict_layers=0,
)


def count_parameters(a: ModelArgs) -> dict[str, int]:
    """Parameters of the language model by component (INT4 values count as parameters)."""
    H, heads = a.hidden_size, a.num_attention_heads
    q = (H * a.q_lora_rank + a.q_lora_rank + a.q_lora_rank * heads * a.qk_head_dim) if a.q_lora_rank else H * heads * a.qk_head_dim
    attention = q + H * (a.kv_lora_rank + a.qk_rope_head_dim) + a.kv_lora_rank \
        + a.kv_lora_rank * heads * (a.qk_nope_head_dim + a.v_head_dim) + heads * a.v_head_dim * H
    moe_layers = a.num_hidden_layers - a.first_k_dense_replace
    return {
        "embedding": a.vocab_size * H,
        "lm_head": 0 if a.tie_word_embeddings else a.vocab_size * H,
        "attention": a.num_hidden_layers * attention,
        "norms": a.num_hidden_layers * 2 * H + H,
        "dense_mlp": a.first_k_dense_replace * 3 * H * a.intermediate_size,
        "router": moe_layers * (a.n_routed_experts * H + a.n_routed_experts),
        "shared_experts": moe_layers * 3 * H * a.moe_intermediate_size * a.n_shared_experts,
        "routed_experts": moe_layers * a.n_routed_experts * 3 * H * a.moe_intermediate_size,
    }


def flops_per_token(a: ModelArgs, tp: int, seq_len: int, split_replicated: bool) -> float:
    """Matmul FLOPs of one token's forward on one rank of a tp group (what the rank computes, the
    FLOP count benchmarks/bench_extract.py's MFU uses): per layer the latents q_a/kv_a and the
    router (replicated, or 1/tp of the tokens each when `split_replicated`: from
    SPLIT_ROWS_MIN_TOKENS), this rank's heads of q_b/kv_b/o_proj, causal attention over
    seq_len / 2 keys on average, 1/tp of the dense MLP, shared expert and k routed slots (ep: k/tp
    slots on average; tp: every slot, 1/tp of its width); then 1/tp of the greedy head."""
    return sum(layer_flops_per_token(a, tp, seq_len, split_replicated)) + head_flops_per_token(a, tp)


def layer_flops_per_token(a: ModelArgs, tp: int, seq_len: int, split_replicated: bool) -> list[float]:
    """flops_per_token's per-layer terms, layer by layer (dense layers first, then MoE): the
    compute each layer costs one rank of a tp group, what pipeline stages are balanced by."""
    H, heads = a.hidden_size, a.num_attention_heads / tp
    split = tp if split_replicated else 1
    latents = H * ((a.q_lora_rank or 0) + a.kv_lora_rank + a.qk_rope_head_dim) / split
    q = (a.q_lora_rank or H) * heads * a.qk_head_dim
    kv_b = a.kv_lora_rank * heads * (a.qk_nope_head_dim + a.v_head_dim)
    core = heads * (seq_len / 2) * (a.qk_head_dim + a.v_head_dim)
    attention = latents + q + kv_b + core + heads * a.v_head_dim * H
    dense = 3 * H * a.intermediate_size / tp
    moe = 3 * H * a.moe_intermediate_size * (a.num_experts_per_tok + a.n_shared_experts) / tp + H * a.n_routed_experts / split
    return [2.0 * (attention + (dense if i < a.first_k_dense_replace else moe)) for i in range(a.num_hidden_layers)]


def head_flops_per_token(a: ModelArgs, tp: int) -> float:
    """The greedy head's matmul FLOPs per token on one rank (its 1/tp of the vocabulary)."""
    return 2.0 * a.hidden_size * a.vocab_size / tp


def cut_stages(costs: Sequence[float], pp: int, last_extra: float = 0.0,
               fits: Callable[[int, int, int], bool] | None = None) -> list[range] | None:
    """`pp` contiguous ranges of the layers 0..len(costs)-1, each non-empty, that make the largest
    stage cost (the sum of its layers' costs, plus `last_extra` on the last stage: the final norm
    and the greedy head) as small as it can be (exact, by dynamic programming over cut points;
    ties go to the earliest cuts, so the layout is deterministic).

    fits(start, stop, stage): whether stage `stage` holding layers start..stop-1 fits its GPU
    (its weights, buffers and whatever else that stage holds: the embedding on the first, the
    head on the last, online training's rows and draft): only cuts whose every stage fits are
    considered, so a stage with more to hold beside its layers gets fewer of them when the
    balance by cost would not fit. None when no cut fits (then only with `fits`)."""
    n = len(costs)
    if not 1 <= pp <= n:
        raise UserInputError(f"target.pp = {pp} must be between 1 and the {n} decoder layers (a stage holds at least one)")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[s][i]: the smallest largest-stage cost of layers 0..i-1 in s stages; cut[s][i]: where the last starts
    best = [[inf] * (n + 1) for _ in range(pp + 1)]
    cut = [[0] * (n + 1) for _ in range(pp + 1)]
    best[0][0] = 0.0
    for stages in range(1, pp + 1):
        extra = last_extra if stages == pp else 0.0
        for i in range(stages, n + 1):
            for j in range(stages - 1, i):
                if best[stages - 1][j] == inf or (fits is not None and not fits(j, i, stages - 1)):
                    continue
                value = max(best[stages - 1][j], prefix[i] - prefix[j] + (extra if i == n else 0.0))
                if value < best[stages][i] - 1e-9 * max(1.0, abs(value)):
                    best[stages][i], cut[stages][i] = value, j
    if best[pp][n] == inf:
        return None
    ranges, end = [], n
    for stages in range(pp, 0, -1):
        start = cut[stages][end]
        ranges.append(range(start, end))
        end = start
    return ranges[::-1]


def stage_layers(a: ModelArgs, pp: int, tp: int = 1, seq_len: int = 2048, split_replicated: bool = False,
                 greedy_head: bool = True, fits: Callable[[range, int], bool] | None = None) -> list[range]:
    """The layers of each pipeline stage, balanced by compute (layer_flops_per_token; the greedy
    head on the last stage when target_argmax is written). The embedding sits on the first
    stage, the final norm and the head on the last. fits(layers, stage): cut_stages' memory
    condition; when no cut meets it, the balance by compute alone (whose fullest stage the
    plans then report short)."""
    costs = layer_flops_per_token(a, tp, seq_len, split_replicated)
    head = head_flops_per_token(a, tp) if greedy_head else 0.0
    if fits is not None:
        memo: dict = {}

        def fits_at(start: int, stop: int, stage: int) -> bool:
            key = (start, stop, stage)
            if key not in memo:
                memo[key] = fits(range(start, stop), stage)
            return memo[key]

        ranges = cut_stages(costs, pp, head, fits_at)
        if ranges is not None:
            return ranges
    return cut_stages(costs, pp, head)


def collective_bytes_per_token(a: ModelArgs, tp: int, dtype_bytes: int, split_replicated: bool) -> dict[str, int]:
    """Bytes per token of each collective one rank of a tp group takes part in (extract/native/
    model.py, parallel.py): all-reduces of the [T, H] activations (the vocab-parallel embedding,
    then after each attention and each MLP/MoE block); all-gathers (their gathered output) of
    the split latents and router outputs (fp32 weight + int64 id per slot), and the head's
    per-rank best logit (fp32) and id (int64). 0 at tp = 1."""
    work = stage_work_per_token(a, tp, range(a.num_hidden_layers), True, True, dtype_bytes, 1, split_replicated)
    return {"all_reduce": work["all_reduce"], "all_gather": work["all_gather"]}


def stage_work_per_token(a: ModelArgs, tp: int, layers: range, first: bool, last: bool, dtype_bytes: int,
                         seq_len: int, split_replicated: bool, greedy_head: bool = True,
                         aux_layers: Sequence[int] = ()) -> dict[str, float]:
    """One rank's work per token in a pipeline stage holding `layers` (the embedding when `first`,
    the norm and greedy head when `last`): matmul FLOPs, bytes all-reduced and all-gathered in
    its tp group (collective_bytes_per_token's terms, 0 at tp 1), and the bytes it receives from
    the previous stage and sends to the next (the hidden state plus the aux states captured
    before: [1 + c] x H per token)."""
    H, b = a.hidden_size, dtype_bytes
    moe_layers = sum(1 for i in layers if i >= a.first_k_dense_replace)
    costs = layer_flops_per_token(a, tp, seq_len, split_replicated)
    flops = sum(costs[i] for i in layers) + (head_flops_per_token(a, tp) if last and greedy_head else 0.0)
    all_reduce = all_gather = 0
    if tp > 1:
        all_reduce = (2 * len(layers) + (1 if first else 0)) * H * b
        all_gather = 12 * tp if last and greedy_head else 0  # the head: each rank's best (fp32) and its index (int64)
        if split_replicated:
            all_gather += len(layers) * ((a.q_lora_rank or 0) + a.kv_lora_rank + a.qk_rope_head_dim) * b
            all_gather += moe_layers * a.num_experts_per_tok * 12
    carried_in = sum(1 for i in aux_layers if i < layers.start)
    carried_out = sum(1 for i in aux_layers if i < layers.stop)
    return {"flops": flops, "all_reduce": all_reduce, "all_gather": all_gather,
            "recv": 0 if first else (1 + carried_in) * H * b, "send": 0 if last else (1 + carried_out) * H * b}


@dataclass
class MemoryPlan:
    tp: int
    expert_layout: str
    components: dict = field(default_factory=dict)  # name -> bytes on the fullest rank
    stage: int = 0  # the pipeline stage this plan is for (of pp)
    pp: int = 1
    layers: range | None = None  # the decoder layers the stage holds (all when pp = 1)

    @property
    def where(self) -> str:
        """'stage s (layers a-b)' when there are stages, else ''."""
        if self.pp == 1 or self.layers is None:
            return ""
        return f"stage {self.stage} of {self.pp} (layers {self.layers.start}-{self.layers.stop - 1})"

    @property
    def weights_bytes(self) -> int:
        return sum(v for k, v in self.components.items() if not k.startswith(("activations", "runtime")))

    @property
    def total_bytes(self) -> int:
        return sum(self.components.values())


def _int4_bytes(rows: int, cols: int) -> int:
    # packed nibbles + one bf16 scale per group + the int64 [2] weight_shape
    return rows * cols // 2 + rows * (cols // int4.GROUP_SIZE) * 2 + 16


def plan_memory(a: ModelArgs, tp: int, expert_layout: str, quantized: bool = True, dtype_bytes: int = 2,
                batch_tokens: int = 8192, max_length: int = 2048, aux_layers: int | Sequence[int] = 3,
                layers: range | None = None, stage: int = 0, pp: int = 1) -> MemoryPlan:
    """Bytes per GPU by component for the rank holding the most (uneven expert ranges).
    aux_layers: the captured layer ids, or only their count (then planned as if apart and before
    the last layer, the most a forward can hold). layers, stage, pp: one pipeline stage's share
    (its layers; the embedding on stage 0, the final norm and head on the last; its pipeline
    buffers), default the whole model."""
    if a.num_attention_heads % tp:
        raise UserInputError(f"num_attention_heads = {a.num_attention_heads} cannot be split over tp = {tp}")
    layers = range(a.num_hidden_layers) if layers is None else layers
    first, last = stage == 0, stage == pp - 1
    H, b = a.hidden_size, dtype_bytes
    heads = a.num_attention_heads // tp
    dense_layers = sum(1 for i in layers if i < a.first_k_dense_replace)
    moe_layers = len(layers) - dense_layers
    vocab_rows = split_range(a.vocab_size, 0, tp)[1]  # rank 0 holds the largest range
    replicated_attn = H * (a.q_lora_rank or 0) + (a.q_lora_rank or 0) + H * (a.kv_lora_rank + a.qk_rope_head_dim) + a.kv_lora_rank
    q_out = heads * a.qk_head_dim * (a.q_lora_rank or H)
    split_attn = q_out + a.kv_lora_rank * heads * (a.qk_nope_head_dim + a.v_head_dim) + heads * a.v_head_dim * H
    if expert_layout == "ep":
        experts, inter = split_range(a.n_routed_experts, 0, tp)[1], a.moe_intermediate_size
    else:
        experts, inter = a.n_routed_experts, a.moe_intermediate_size // tp
    per_expert = (2 * _int4_bytes(inter, H) + _int4_bytes(H, inter)) if quantized else 3 * H * inter * b
    c = {
        "embedding": vocab_rows * H * b if first else 0,
        "lm_head": vocab_rows * H * b if last else 0,
        "attention (replicated q_a, kv_a, norms)": len(layers) * (replicated_attn + 2 * H) * b,
        "attention (split q_b, kv_b, o_proj)": len(layers) * split_attn * b,
        "dense MLP": dense_layers * 3 * H * (a.intermediate_size // tp) * b,
        "router (bf16 weight, fp32 bias)": moe_layers * a.n_routed_experts * (H * b + 4),
        "shared experts": moe_layers * 3 * H * (a.moe_intermediate_size * a.n_shared_experts // tp) * b,
        "routed experts (" + ("INT4" if quantized else "bf16") + ")": moe_layers * experts * per_expert,
    }
    c["activations"] = _activation_bytes(a, tp, expert_layout, b, batch_tokens, max_length, aux_layers, layers, first, last)
    if pp > 1:
        c["pipeline buffers (recv posted ahead, 2 sends in flight)"] = _pipeline_bytes(a, b, batch_tokens, aux_layers, layers, first, last)
    c["runtime reserve (context, NCCL, cache)"] = runtime_reserve(tp * pp, c["activations"])
    return MemoryPlan(tp, expert_layout, c, stage, pp, layers)


def plan_stages(a: ModelArgs, tp: int, pp: int, expert_layout: str, quantized: bool = True, dtype_bytes: int = 2,
                batch_tokens: int = 8192, max_length: int = 2048, aux_layers: int | Sequence[int] = 3,
                split_replicated: bool = False, greedy_head: bool = True) -> list[MemoryPlan]:
    """One MemoryPlan per pipeline stage of the tp x pp layout, the layers cut by stage_layers."""
    ranges = stage_layers(a, pp, tp, min(max_length, batch_tokens), split_replicated, greedy_head)
    return [plan_memory(a, tp, expert_layout, quantized, dtype_bytes, batch_tokens, max_length, aux_layers, layers, s, pp)
            for s, layers in enumerate(ranges)]


def _pipeline_bytes(a: ModelArgs, b: int, T: int, aux_layers: int | Sequence[int], layers: range, first: bool,
                    last: bool) -> int:
    """A stage's P2P buffers of one forward of T tokens: the next batch's receive posted ahead
    (hidden plus the aux rows captured before the stage) and up to two sends in flight (hidden
    plus the aux rows captured up to the stage's end), each [T, (1 + carried) H]."""
    receive, send = pipeline_message_bytes(a, b, T, aux_layers, layers, first, last)
    return receive + 2 * send


def pipeline_message_bytes(a: ModelArgs, b: int, T: int, aux_layers: int | Sequence[int], layers: range, first: bool,
                           last: bool) -> tuple[int, int]:
    """(one received message, one sent message) of a stage holding `layers`, for a forward of T
    tokens: [T, (1 + carried) H] each, 0 on the first stage (receives nothing) and the last."""
    ids = range(a.num_hidden_layers) if isinstance(aux_layers, int) else sorted(aux_layers)
    k_in = (aux_layers if isinstance(aux_layers, int) else sum(i < layers.start for i in ids))
    k_out = (aux_layers if isinstance(aux_layers, int) else sum(i < layers.stop for i in ids))
    row = T * a.hidden_size * b
    return (0 if first else (1 + k_in) * row), (0 if last else (1 + k_out) * row)


def runtime_reserve(tp: int, activations: int) -> int:
    """Bytes in use besides the weights and the activations' peak: see CONTEXT_RESERVE_BYTES."""
    return CONTEXT_RESERVE_BYTES + (NCCL_RESERVE_BYTES if tp > 1 else 0) + int(ALLOCATOR_SLACK * activations)


def _held_states(a: ModelArgs, aux_layers: int | Sequence[int], layers: range) -> int:
    """The most [T, H] states the capture and the layer input hold at once in any of `layers`: at
    layer l, the outputs of the aux layers before l, plus l's input unless that is one of them."""
    if isinstance(aux_layers, int):
        return aux_layers + 1
    aux = set(aux_layers)
    return max((sum(i < l for i in aux) + (l - 1 not in aux) for l in layers), default=0)


def _activation_bytes(a: ModelArgs, tp: int, layout: str, b: int, T: int, max_length: int,
                      aux_layers: int | Sequence[int], layers: range | None = None, first: bool = True,
                      last: bool = True) -> int:
    """Peak transient bytes of one forward of T tokens (extract.batch_tokens): the largest of the
    forward's phases, counted from the tensors each phase holds (benchmarks/check_plan.py measures
    them on the GPU with the extraction loop and lists the blocks live at the peak).

    Every phase holds the captured aux states and the layer input, up to (k + 1) x [T, H] (the
    capture keeps the layers' own outputs; the input of the layer after an aux layer is one of
    them): `_held_states` counts them per phase from the aux layer ids.
    - MoE, the peak on the GPU: the residual after attention, its norm, the shared expert's output,
      the activations with permuted columns (INT4 kernel v3) and the combined output, 5 more
      [T, H] (the input is freed once the residual is formed); the routed experts' intermediate
      [T*k, I_local] and per-slot outputs [T*k, H], sized for every slot in both layouts (a rank
      learns how many rows its experts get only on the GPU); the sort's index vectors.
    - attention: the normed input, the latents, q before and after rope, the kv projection, k, the
      output and o_proj's output (all of this rank's heads), and the fused kernel's row lse; on
      the CPU in fp32 the math kernel's scores for one query chunk instead.
    - dense MLP: gate, up, silu(gate) and the product [T, I/tp].
    - the end: the padded aux states, the final norm and their packed copies, (2k + 2) x [T, H];
      then the packed rows and the greedy head's one logits chunk.
    """
    H, heads = a.hidden_size, a.num_attention_heads // tp
    nh = T * H * b  # one [T, H] tensor
    k = aux_layers if isinstance(aux_layers, int) else len(aux_layers)
    all_layers = range(a.num_hidden_layers) if layers is None else layers
    dense_layers = [i for i in all_layers if i < a.first_k_dense_replace]
    moe_layers = [i for i in all_layers if i >= a.first_k_dense_replace]
    inter = a.moe_intermediate_size if layout == "ep" else a.moe_intermediate_size // tp
    slots = T * a.num_experts_per_tok
    moe = (_held_states(a, aux_layers, moe_layers) * nh + 5 * nh + slots * (inter + H) * b + slots * 20  # order int64, tokens/rows int32, weight fp32
           if moe_layers else 0)
    latents = T * ((a.q_lora_rank or 0) + a.kv_lora_rank + a.qk_rope_head_dim) * b
    per_head = 3 * a.qk_head_dim + (a.qk_nope_head_dim + a.v_head_dim) + a.v_head_dim  # q, q roped, k; kv; out
    if b <= 2:  # bf16/fp16 on CUDA: one fused call (model.prefill_attention), linear in T
        kernel = T * heads * 4
    else:  # unfused (CPU, fp32): query chunks of the math kernel's fp32 scores [n, chunk, L]
        kernel = T * min(min(max_length, T), ATTENTION_CHUNK_TOKENS) * heads * 4
    attention = _held_states(a, aux_layers, all_layers) * nh + 2 * nh + latents + T * heads * per_head * b + kernel
    dense = _held_states(a, aux_layers, dense_layers) * nh + 2 * nh + 4 * T * (a.intermediate_size // tp) * b if dense_layers else 0
    end = max((2 * k + 2) * nh, (k + 1) * nh + ARGMAX_CHUNK_TOKENS * math.ceil(a.vocab_size / tp) * b) if last else 0
    return max(moe, attention, dense, end)


def format_plan(plan: MemoryPlan, gpu_bytes: float | None = None) -> str:
    where = f", {plan.where}" if plan.where else ""
    lines = [f"tp = {plan.tp}, expert_layout = {plan.expert_layout}{where}: bytes per GPU (fullest rank)"]
    for name, value in plan.components.items():
        if value or plan.pp == 1:
            lines.append(f"  {name:<42} {value / GIB:9.2f} GiB")
    lines.append(f"  {'weights':<42} {plan.weights_bytes / GIB:9.2f} GiB")
    lines.append(f"  {'total':<42} {plan.total_bytes / GIB:9.2f} GiB ({plan.total_bytes / 1e9:.1f} GB)")
    if gpu_bytes:
        spare = gpu_bytes - plan.total_bytes
        verdict = f"fits, {spare / GIB:.1f} GiB spare" if spare >= 0 else f"does NOT fit: short by {-spare / GIB:.1f} GiB"
        lines.append(f"  on a {gpu_bytes / GIB:.1f} GiB GPU: {verdict}")
    return "\n".join(lines)


# The layouts the grid compares: tensor parallel only, and tensor parallel inside pipeline stages
# (8 GPUs a group: tp 8, tp 4 x pp 2, tp 2 x pp 4, pp 8; and 4 and 16).
GRID_LAYOUTS = ((4, 1), (8, 1), (16, 1), (4, 2), (2, 4), (1, 8))


def format_grid(a: ModelArgs, quantized: bool, dtype_bytes: int, batch_tokens: int, max_length: int,
                aux_layers: int | Sequence[int]) -> str:
    header = f"{'layout':<22}{'weights GiB':>12}{'total GiB':>11}" + "".join(f"{name:>24}" for name in GPU_SIZES_GB)
    lines = [header]
    for tp, pp in GRID_LAYOUTS:
        for layout in ("ep", "tp") if tp > 1 else ("ep",):  # at tp 1 a rank holds every expert either way
            name = f"tp {tp}" + (f" x pp {pp}" if pp > 1 else "") + (f" {layout}" if tp > 1 else "")
            try:
                plans = plan_stages(a, tp, pp, layout, quantized, dtype_bytes, batch_tokens, max_length, aux_layers)
            except ValueError as err:
                lines.append(f"{name:<22} not possible: {err}")
                continue
            plan = max(plans, key=lambda p: p.total_bytes)  # the fullest stage decides
            cells = "".join(f"{('fits, ' if size >= plan.total_bytes else 'short ') + f'{(size - plan.total_bytes) / GIB:+.1f}':>24}"
                            for size in GPU_SIZES_GB.values())
            lines.append(f"{name:<22}{plan.weights_bytes / GIB:>12.1f}{plan.total_bytes / GIB:>11.1f}{cells}")
    return "\n".join(lines)


def target_args(cfg: Config) -> tuple[ModelArgs, bool, str]:
    """(model args, quantized experts, where they came from) for the planner."""
    from eagleforge.extract.native.loader import check_quantization, text_config_of

    path = Path(cfg.target.path) if cfg.target.path else None
    if path is None or not (path / "config.json").is_file():
        note = f"{path}/config.json not found here: planning the built-in Kimi-K2.5 config (docs/kimi-k25.md)"
        return ModelArgs.from_config(KIMI_K25_TEXT_CONFIG, "built-in Kimi-K2.5 config"), True, note
    config = read_json_object(path / "config.json", "a model's config.json")
    text, _ = text_config_of(config, str(path / "config.json"))
    quantized = check_quantization(config, text, str(path / "config.json"))
    return ModelArgs.from_config(text, str(path / "config.json")), quantized, str(path / "config.json")


def _dtype_bytes(cfg: Config) -> int:
    return {"float32": 4, "bfloat16": 2, "float16": 2}[cfg.target.dtype]


def _aux_ids(cfg: Config, a: ModelArgs) -> list[int]:
    """The aux layers extraction will capture (extract.aux_layers, else the default of docs/aux-layers.md)."""
    return sorted(int(i) for i in cfg.extract.aux_layers) or default_aux_layers(a.num_hidden_layers)


def _splits_rows(cfg: Config) -> bool:
    """Whether the router and the latents split over the tp ranks at the config's batch size."""
    return cfg.target.tp > 1 and cfg.extract.batch_tokens >= SPLIT_ROWS_MIN_TOKENS


def config_stage_layers(cfg: Config, a: ModelArgs) -> list[range]:
    """The layers of each pipeline stage of the configured layout (one range when target.pp = 1):
    what the planner plans and what each rank builds and loads."""
    return stage_layers(a, cfg.target.pp, cfg.target.tp, min(cfg.data.max_length, cfg.extract.batch_tokens),
                        _splits_rows(cfg), cfg.extract.write_target_argmax)


def config_stages(cfg: Config, a: ModelArgs, quantized: bool, ranges: list[range] | None = None) -> list[MemoryPlan]:
    """The configured layout's plan, one MemoryPlan per pipeline stage (one when target.pp = 1);
    ranges: the stages' layers when cut otherwise than by config_stage_layers (online training
    cuts them by memory too: train/online_plan.py)."""
    return [config_stage_plan(cfg, a, quantized, layers, stage)
            for stage, layers in enumerate(ranges or config_stage_layers(cfg, a))]


def config_stage_plan(cfg: Config, a: ModelArgs, quantized: bool, layers: range, stage: int) -> MemoryPlan:
    """The plan of one stage of the configured layout holding `layers`."""
    return plan_memory(a, cfg.target.tp, cfg.target.expert_layout, quantized, _dtype_bytes(cfg), cfg.extract.batch_tokens,
                       cfg.data.max_length, _aux_ids(cfg, a), layers, stage, cfg.target.pp)


def check_fits(cfg: Config, a: ModelArgs, quantized: bool, gpu_bytes: int) -> list[MemoryPlan]:
    """The stages' plans; UserInputError naming the stage that is short, and by how much, when
    any does not fit `gpu_bytes` (before any weight is read)."""
    plans = config_stages(cfg, a, quantized)
    for plan in plans:
        if plan.total_bytes > gpu_bytes:
            where = f" {plan.where}" if plan.where else ""
            layout = f"target.tp = {cfg.target.tp}" + (f", target.pp = {cfg.target.pp}" if cfg.target.pp > 1 else "")
            raise UserInputError(
                f"{layout}, target.expert_layout = {cfg.target.expert_layout}:{where} needs "
                f"{plan.total_bytes / GIB:.1f} GiB per GPU ({plan.weights_bytes / GIB:.1f} GiB weights) but the GPU has "
                f"{gpu_bytes / GIB:.1f} GiB: short by {(plan.total_bytes - gpu_bytes) / GIB:.1f} GiB. Use a larger tp or pp, a "
                f"smaller extract.batch_tokens, or see `make plan CONFIG=...`"
            )
    return plans


def main(cfg: Config) -> None:
    a, quantized, source = target_args(cfg)
    print(f"target: {source}")
    params = count_parameters(a)
    print(f"language model parameters: {sum(params.values()) / 1e12:.3f}T "
          f"(routed experts {params['routed_experts'] / 1e12:.3f}T)")
    gpu_gib = cfg.target.gpu_memory_gib
    gpu_bytes = gpu_gib * GIB if gpu_gib else None
    if gpu_bytes is None:
        import torch

        gpu_bytes = torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None
    try:
        plans = config_stages(cfg, a, quantized)
    except ValueError as err:
        raise UserInputError(f"target.tp = {cfg.target.tp}, target.pp = {cfg.target.pp}: {err}") from None
    print(f"\nconfigured layout, {cfg.extract.batch_tokens} tokens per forward:")
    for plan in plans:
        print(format_plan(plan, gpu_bytes))
    split = _splits_rows(cfg)
    traffic = collective_bytes_per_token(a, cfg.target.tp, _dtype_bytes(cfg), split)
    print(f"  per token on each rank: {flops_per_token(a, cfg.target.tp, min(cfg.data.max_length, cfg.extract.batch_tokens), split) / 1e9:.2f} "
          f"GFLOP, {traffic['all_reduce'] / 1024:.0f} KiB all-reduced, {traffic['all_gather'] / 1024:.1f} KiB all-gathered "
          "(`make preflight` projects tokens/s from the GPUs' measured rates)")
    print("\nall layouts (total incl. activations and reserve; +spare / -short in GiB):")
    print(format_grid(a, quantized, _dtype_bytes(cfg), cfg.extract.batch_tokens, cfg.data.max_length, _aux_ids(cfg, a)))
    if cfg.target.layout == "auto":  # what the stage will choose at its start, for this GPU or the smallest common one
        from eagleforge.extract.native.preflight import choose_extract_layout

        size = gpu_bytes or min(GPU_SIZES_GB.values())
        print(f"\ntarget.layout=auto on {size / GIB:.1f} GiB GPUs, extraction: {choose_extract_layout(cfg, size)[2]}")
        if cfg.train.source == "online":
            from eagleforge.layout import world_size_from_env
            from eagleforge.train.online_plan import choose_online_layout

            print(f"online training: {choose_online_layout(cfg, size, max(world_size_from_env(), cfg.target.tp * cfg.target.pp))[2]}")
    if cfg.train.source == "online":  # the draft trains beside the resident target: its memory too
        from eagleforge.train.online_plan import print_online_plan

        print_online_plan(cfg, gpu_bytes)


if __name__ == "__main__":
    run_main(main, "Memory per GPU of the native extraction backend for a config and parallel layout.",
             sections=("target", "data", "extract", "train"), writes_run_dir=False)
