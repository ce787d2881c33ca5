"""W4A16 grouped MoE: routed experts with INT4 weights, bf16 activations (Kimi-K2.5's layout).

Math, per token n with router ids e_1..e_k and weights w_1..w_k (DESIGN section 9):

    h_nj = silu(x_n @ Wg[e_j].T) * (x_n @ Wu[e_j].T)          [I]
    y_n  = sum_j w_j * (h_nj @ Wd[e_j].T)                        [H]
    W[o, i] = (nibble(o, i) - 8) * scale[o, i // 32]             INT4 "pack-quantized"

Weights stay packed: int32 [E, out, in/8] (eight nibbles per word, column 8j+n in nibble n) and
bf16 scales [E, out, in/32]. Three implementations, same numbers up to bf16 rounding:

- `moe_reference`: plain torch, one expert at a time, dequantize then matmul, any dtype (float64
  in tests). The ground truth.
- `int4_moe_grouped_mm`: dequantize every local expert to bf16, then torch._grouped_mm over the
  tokens sorted by expert (the "dequantize-then-grouped-matmul" alternative; 3 x E x I x H x 2
  bytes of transient weights per call).
- `int4_moe`: two Triton kernels. The (token, slot) pairs are sorted by expert so each expert's
  rows are one contiguous block; a tile table (tile -> expert, first row, end row), built on the
  device with no host sync, drives a grid over (N tiles, expert tiles). The K loop loads packed
  int32 [BLOCK_K, BLOCK_N] (each word read for the 8 columns it holds, from L1), unpacks nibbles
  with a shift and mask, scales per group of 32 and feeds tl.dot in bf16 with fp32 accumulation.
  Kernel 1 gathers the token rows of x itself (no [N*k, H] copy) and computes gate and up in
  one pass with the silu(g) * u epilogue -> h [N*k, I] bf16 in sorted order. Kernel 2 multiplies
  h by the down weights, scales by the router weight and scatters each row back to its
  (token, slot) place -> [N, k, H]; a sum over k finishes (deterministic, no atomics).

`bf16_grouped_mm_moe` is the speed-of-light reference of the same math with bf16 weights (the
anchor's sort-by-expert torch._grouped_mm), used by benchmarks/bench_moe.py.

Expert parallelism: the caller passes only its local experts and `expert_start`; pairs routed to
other ranks' experts fall into a dummy bucket that gets no tiles, so they contribute zero.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

try:  # Triton is optional: CPU machines use the torch paths.
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - depends on the machine
    triton = None
    tl = None
    HAS_TRITON = False

PACK_FACTOR = 8  # 4-bit values per int32
GROUP_SIZE = 32  # input columns sharing one scale
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


# ---------------------------------------------------------------------------- torch reference


def _dequantize(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int32 [..., out, in/8] + scale [..., out, in/32] -> dtype [..., out, in] (DESIGN section 9)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    q = ((packed.unsqueeze(-1) >> shifts) & 0xF) - 8  # [..., out, in/8, 8], nibble n = column 8j+n
    q = q.flatten(-2).to(dtype)  # [..., out, in]
    groups = q.unflatten(-1, (scale.shape[-1], q.shape[-1] // scale.shape[-1]))
    return (groups * scale.to(dtype).unsqueeze(-1)).flatten(-2)


def moe_reference(x, weights, ids, gate_packed, gate_scale, up_packed, up_scale, down_packed, down_scale,
                  expert_start: int = 0) -> torch.Tensor:
    """Plain torch, expert by expert, in x's dtype: x [N, H], weights/ids [N, k] -> [N, H] fp32 (or wider)."""
    acc = torch.promote_types(x.dtype, torch.float32)
    out = torch.zeros(x.shape, dtype=acc, device=x.device)
    for local in range(gate_packed.shape[0]):
        token, slot = (ids == expert_start + local).nonzero(as_tuple=True)
        if token.numel() == 0:
            continue
        h = x[token]
        g = F.linear(h, _dequantize(gate_packed[local], gate_scale[local], x.dtype))
        u = F.linear(h, _dequantize(up_packed[local], up_scale[local], x.dtype))
        y = F.linear(F.silu(g) * u, _dequantize(down_packed[local], down_scale[local], x.dtype))
        out.index_add_(0, token, y.to(acc) * weights[token, slot].unsqueeze(-1).to(acc))
    return out


# ---------------------------------------------------------------------------- routing plan


def sort_by_expert(ids: torch.Tensor, num_local: int, expert_start: int = 0):
    """Sort the N*k (token, slot) pairs by local expert, on the device, without a host sync.

    ids [N, k] global expert ids -> (order [N*k] int64: flat pair index of each sorted row,
    counts [num_local + 1] int64: rows per local expert, the last entry the pairs of other
    ranks' experts, which sort to the end). Stable, so rows keep token order inside an expert.
    """
    local = ids.flatten() - expert_start
    local = torch.where((local >= 0) & (local < num_local), local, num_local)  # foreign -> dummy
    order = local.argsort(stable=True)
    counts = torch.bincount(local, minlength=num_local + 1)
    return order, counts


def tile_table(counts: torch.Tensor, num_local: int, block_m: int, num_rows: int):
    """(tile_expert, tile_begin, tile_end) int32 [max_tiles]: expert tiles of <= block_m rows.

    max_tiles = ceil(rows / block_m) + num_local bounds the real count on the host without a
    sync; surplus tiles get begin = end = 0 and return at once. Rows of expert e are
    [offsets[e], offsets[e + 1]) of the sorted order.
    """
    counts = counts[:num_local]
    offsets = torch.zeros(num_local + 1, dtype=torch.int64, device=counts.device)
    offsets[1:] = counts.cumsum(0)
    tiles = (counts + block_m - 1) // block_m  # [E_l]
    tile_end = tiles.cumsum(0)  # [E_l]: one past each expert's last tile
    max_tiles = -(-num_rows // block_m) + num_local
    t = torch.arange(max_tiles, device=counts.device)
    expert = torch.searchsorted(tile_end, t, right=True)  # [max_tiles], num_local past the last tile
    valid = expert < num_local
    e = expert.clamp(max=num_local - 1)
    begin = offsets[e] + (t - (tile_end[e] - tiles[e])) * block_m
    end = torch.minimum(begin + block_m, offsets[e + 1])
    begin, end = torch.where(valid, begin, 0), torch.where(valid, end, 0)
    return e.to(torch.int32), begin.to(torch.int32), end.to(torch.int32)


# ---------------------------------------------------------------------------- Triton kernels

if HAS_TRITON:

    @triton.jit
    def _dequant_tile(words, scale, shifts, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
                      DOT_DTYPE: tl.constexpr):
        """words int32 [BN, BK/8], scale [BN, BK/GROUP] -> W.T tile [BK, BN] in DOT_DTYPE.

        [BN, BK/8, 8] nibbles (column 8j + n = nibble n of word j) -> [BN, BK/G, G] times the
        group's scale (q * scale in fp32, rounded once: the correctly rounded bf16 product, as
        dequantize_int4's bf16 multiply gives) -> [BN, BK] -> transposed for tl.dot.
        """
        q = ((words[:, :, None] >> shifts[None, None, :]) & 0xF) - 8  # [BN, BK/8, 8]
        q = tl.reshape(q, (BLOCK_N, BLOCK_K // GROUP, GROUP)).to(tl.float32)
        w = q * scale.to(tl.float32)[:, :, None]
        return tl.trans(tl.reshape(w.to(DOT_DTYPE), (BLOCK_N, BLOCK_K)))

    @triton.jit
    def _int4_grouped_gemm_kernel(
        a_ptr, a_rows_ptr, stride_am,  # A [*, K] bf16; sorted row r reads A[a_rows[r]] when GATHER_A
        b_ptr, s_ptr, b2_ptr, s2_ptr,  # packed int32 [E, N, K/8], scales bf16 [E, N, K/GROUP]; b2/s2: up
        c_ptr, c_rows_ptr, c_scale_ptr, stride_cm,  # C rows; SCATTER_C: row r -> C[c_rows[r]] * c_scale[c_rows[r]]
        tile_expert_ptr, tile_begin_ptr, tile_end_ptr,
        N, K,
        stride_be, stride_bn, stride_se, stride_sn,
        GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        GATHER_A: tl.constexpr, GATE_UP: tl.constexpr, SCATTER_C: tl.constexpr, DOT_DTYPE: tl.constexpr,
    ):
        # axis 0 (fastest) walks N tiles, so consecutive programs share one A tile and stream
        # one expert's weights; that expert's other M tiles follow and find them in L2.
        pid_n = tl.program_id(0)
        pid_t = tl.program_id(1)
        begin = tl.load(tile_begin_ptr + pid_t)
        end = tl.load(tile_end_ptr + pid_t)
        if begin < end:
            expert = tl.load(tile_expert_ptr + pid_t).to(tl.int64)
            offs_m = begin + tl.arange(0, BLOCK_M)
            m_mask = offs_m < end
            if GATHER_A:
                a_rows = tl.load(a_rows_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
            else:
                a_rows = offs_m.to(tl.int64)
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            n_mask = offs_n < N
            offs_w = tl.arange(0, BLOCK_K // 8)  # packed words of one K step
            offs_g = tl.arange(0, BLOCK_K // GROUP)  # scale groups of one K step
            shifts = tl.arange(0, 8) * 4  # nibble n of a word: bits 4n..4n+3
            offs_k = tl.arange(0, BLOCK_K)
            a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :]  # [BM, BK]
            # weights are read along K, where the packed words and the scales are contiguous:
            # words [BN, BK/8] and scales [BN, BK/GROUP] per step, each read once, vector loads
            b_off = expert * stride_be + offs_n[:, None].to(tl.int64) * stride_bn + offs_w[None, :]
            s_off = expert * stride_se + offs_n[:, None].to(tl.int64) * stride_sn + offs_g[None, :]
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                a = tl.load(a_ptrs + k0, mask=m_mask[:, None], other=0.0).to(DOT_DTYPE)
                words = tl.load(b_ptr + b_off + k0 // 8, mask=n_mask[:, None], other=0)
                scale = tl.load(s_ptr + s_off + k0 // GROUP, mask=n_mask[:, None], other=0.0)
                acc = tl.dot(a, _dequant_tile(words, scale, shifts, BLOCK_N, BLOCK_K, GROUP, DOT_DTYPE), acc)
                if GATE_UP:
                    words2 = tl.load(b2_ptr + b_off + k0 // 8, mask=n_mask[:, None], other=0)
                    scale2 = tl.load(s2_ptr + s_off + k0 // GROUP, mask=n_mask[:, None], other=0.0)
                    acc2 = tl.dot(a, _dequant_tile(words2, scale2, shifts, BLOCK_N, BLOCK_K, GROUP, DOT_DTYPE), acc2)
            if GATE_UP:
                acc = acc * tl.sigmoid(acc) * acc2  # silu(gate) * up
            c_mask = m_mask[:, None] & n_mask[None, :]
            if SCATTER_C:
                c_rows = tl.load(c_rows_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
                row_scale = tl.load(c_scale_ptr + c_rows, mask=m_mask, other=0.0)
                acc = acc * row_scale[:, None]
            else:
                c_rows = offs_m.to(tl.int64)
            c_ptrs = c_ptr + c_rows[:, None] * stride_cm + offs_n[None, :]
            tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


# Candidate launch configs (BLOCK_N, BLOCK_K, num_warps, num_stages); the first is used without
# timing under the interpreter. Measured on the first call per shape (see _pick_config).
GATE_UP_CONFIGS = [(128, 64, 8, 3), (64, 128, 4, 3), (128, 128, 8, 2), (64, 32, 4, 4)]
DOWN_CONFIGS = [(128, 128, 8, 3), (128, 64, 4, 4), (64, 128, 4, 3), (64, 32, 4, 4)]
_CHOSEN: dict = {}


def choose_block_m(rows: int, num_local: int) -> int:
    """Rows per expert tile: 128 when experts average >= 192 rows (16K tokens at 384 experts, k 8), else 64.

    Small tiles waste fewer rows on each expert's last partial tile; large ones reuse each
    dequantized weight tile over more rows (half the unpack work per FLOP).
    """
    if INTERPRET:
        return 16
    return 128 if rows >= 192 * num_local else 64


def _launch(config, a, a_rows, b, s, b2, s2, c, c_rows, c_scale, table, block_m, gather, gate_up, scatter):
    block_n, block_k, warps, stages = config
    n, k = b.shape[1], b.shape[2] * PACK_FACTOR
    grid = (triton.cdiv(n, block_n), table[0].shape[0])
    dummy = table[0]  # any int32 tensor: unused pointer arguments of a disabled branch
    _int4_grouped_gemm_kernel[grid](
        a, a_rows if a_rows is not None else dummy, a.stride(0),
        b, s, b2 if b2 is not None else b, s2 if s2 is not None else s,
        c, c_rows if c_rows is not None else dummy, c_scale if c_scale is not None else s, c.stride(0),
        table[0], table[1], table[2],
        n, k, b.stride(0), b.stride(1), s.stride(0), s.stride(1),
        GROUP=k // s.shape[2], BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        GATHER_A=gather, GATE_UP=gate_up, SCATTER_C=scatter,
        # the interpreter computes bf16 arithmetic on the raw 16-bit integers: give it fp32 (the same
        # values: every bf16 is exact in fp32, and w is rounded to bf16 first below on the GPU only)
        DOT_DTYPE=tl.float32 if INTERPRET else tl.bfloat16,
        **({} if INTERPRET else {"num_warps": warps, "num_stages": stages}),
    )


def _pick_config(name: str, configs: list, key: tuple, run) -> tuple:
    """First config under the interpreter or when only one fits; else time each once per shape key."""
    usable = [c for c in configs if key[2] % c[1] == 0 and c[1] % key[3] == 0]
    if not usable:
        raise ValueError(f"int4_moe: input dim {key[2]} is not a multiple of any BLOCK_K in {[c[1] for c in configs]} "
                         f"(it must be a multiple of {GROUP_SIZE})")
    if INTERPRET or len(usable) == 1:
        return usable[0]
    usable = usable[:3]  # each candidate costs a compile on first use
    full_key = (name,) + key
    if full_key not in _CHOSEN:
        import triton.testing

        times = []
        for c in usable:
            try:
                times.append(float(triton.testing.do_bench(lambda c=c: run(c), warmup=2, rep=10, return_mode="median")))
            except triton.runtime.errors.OutOfResources as err:  # too much shared memory for this GPU
                log.info("int4_moe %s %s: config %s skipped (%s)", name, key, c, err)
                times.append(float("inf"))
        _CHOSEN[full_key] = usable[min(range(len(usable)), key=times.__getitem__)]
        log.info("int4_moe %s %s: configs %s ms %s -> %s", name, key, usable, [round(t, 3) for t in times], _CHOSEN[full_key])
    return _CHOSEN[full_key]


def _check(x, weights, ids, gate_packed, gate_scale, up_packed, up_scale, down_packed, down_scale):
    E, I, Hw = gate_packed.shape
    H = x.shape[1]
    problems = []
    if x.dtype != torch.bfloat16:
        problems.append(f"x dtype {x.dtype} (bf16 expected)")
    if Hw * PACK_FACTOR != H or up_packed.shape != gate_packed.shape:
        problems.append(f"gate/up packed {tuple(gate_packed.shape)}/{tuple(up_packed.shape)} vs hidden {H}")
    if tuple(down_packed.shape) != (E, H, I // PACK_FACTOR):
        problems.append(f"down packed {tuple(down_packed.shape)} (expected {(E, H, I // PACK_FACTOR)})")
    for name, packed, scale in (("gate", gate_packed, gate_scale), ("up", up_packed, up_scale), ("down", down_packed, down_scale)):
        if packed.dtype != torch.int32 or scale.shape[:2] != packed.shape[:2] or not packed.is_contiguous() or not scale.is_contiguous():
            problems.append(f"{name}: packed {packed.dtype} {tuple(packed.shape)}, scale {tuple(scale.shape)} (int32, same [E, out], contiguous)")
    if ids.shape != weights.shape or ids.shape[0] != x.shape[0]:
        problems.append(f"ids {tuple(ids.shape)} / weights {tuple(weights.shape)} vs x {tuple(x.shape)}")
    if problems:
        raise ValueError("int4_moe: " + "; ".join(problems))


def int4_moe(x, weights, ids, gate_packed, gate_scale, up_packed, up_scale, down_packed, down_scale,
             expert_start: int = 0, num_experts: int | None = None, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Triton W4A16 MoE: x [N, H] bf16, router weights [N, k] fp32 and ids [N, k] -> [N, H] out_dtype.

    Weights are this rank's experts [expert_start, expert_start + E_l) of `num_experts` in all
    (default: E_l, every expert local). Needs CUDA, or CPU tensors under TRITON_INTERPRET=1.
    """
    if not HAS_TRITON:
        raise RuntimeError("int4_moe needs triton (pip install triton); use moe_reference on this machine")
    _check(x, weights, ids, gate_packed, gate_scale, up_packed, up_scale, down_packed, down_scale)
    x = x.contiguous()
    N, k = ids.shape
    E, I, H = gate_packed.shape[0], gate_packed.shape[1], x.shape[1]
    rows = N * k
    order, counts = sort_by_expert(ids, E, expert_start)
    block_m = choose_block_m(rows, E)
    table = tile_table(counts, E, block_m, rows)
    tokens = (order // k).to(torch.int32)  # [N*k]: the token of each sorted row
    pairs = order.to(torch.int32)  # [N*k]: its flat (token, slot) index
    pair_weight = weights.reshape(-1).float().contiguous()  # [N*k]

    h = torch.empty(rows, I, dtype=torch.bfloat16, device=x.device)  # sorted order
    # rows of other ranks' experts get no tile: zero them so the sum over slots ignores them
    foreign = expert_start > 0 or (num_experts or E) > E
    y = (torch.zeros if foreign else torch.empty)(N * k, H, dtype=torch.bfloat16, device=x.device)  # [N*k, H]

    def gate_up(config):
        _launch(config, x, tokens, gate_packed, gate_scale, up_packed, up_scale, h, None, None, table, block_m, True, True, False)

    def down(config):
        _launch(config, h, None, down_packed, down_scale, None, None, y, pairs, pair_weight, table, block_m, False, False, True)

    gate_up(_pick_config("gate_up", GATE_UP_CONFIGS, (I, H, H, GROUP_SIZE, block_m), gate_up))
    down(_pick_config("down", DOWN_CONFIGS, (H, I, I, GROUP_SIZE, block_m), down))
    return y.view(N, k, H).sum(1, dtype=out_dtype)  # [N, H]


# ---------------------------------------------------------------------------- grouped_mm paths


def _grouped_offsets(counts: torch.Tensor, num_local: int) -> torch.Tensor:
    return counts[:num_local].cumsum(0).to(torch.int32)  # [E_l] end offsets, torch._grouped_mm's form


def bf16_grouped_mm_moe(x, weights, ids, gate_up_t, down_t, expert_start: int = 0) -> torch.Tensor:
    """Sort by expert + torch._grouped_mm with bf16 weights: gate_up_t [E, H, 2I], down_t [E, I, H] -> [N, H] bf16.

    The anchor's speed-of-light reference (../shared/anchors/anchor_moe.py), same math.
    """
    N, k = ids.shape
    E = gate_up_t.shape[0]
    order, counts = sort_by_expert(ids, E, expert_start)
    offs = _grouped_offsets(counts, E)
    token = order // k
    xs = x[token]  # [N*k, H] sorted by expert
    g, u = torch._grouped_mm(xs, gate_up_t, offs=offs).chunk(2, -1)  # rows past offs[-1] are left undefined
    y = torch._grouped_mm(F.silu(g) * u, down_t, offs=offs)  # [N*k, H]
    mine = (torch.arange(order.shape[0], device=x.device) < offs[-1])[:, None]  # rows of local experts
    y = torch.where(mine, y * weights.reshape(-1)[order, None].to(y.dtype), 0)  # foreign rows: undefined -> 0
    return torch.zeros_like(x).index_add_(0, token, y)


def int4_moe_grouped_mm(x, weights, ids, gate_packed, gate_scale, up_packed, up_scale, down_packed, down_scale,
                        expert_start: int = 0) -> torch.Tensor:
    """Dequantize all local experts to bf16, then `bf16_grouped_mm_moe` -> [N, H] bf16."""
    gate_up = torch.cat([_dequantize(gate_packed, gate_scale, x.dtype), _dequantize(up_packed, up_scale, x.dtype)], 1)
    down = _dequantize(down_packed, down_scale, x.dtype)
    return bf16_grouped_mm_moe(x, weights, ids, gate_up.transpose(1, 2), down.transpose(1, 2), expert_start)
