"""W4A16 grouped MoE: routed experts with INT4 weights, bf16 activations (Kimi-K2.5's layout).

Math, per token n with router ids e_1..e_k and weights w_1..w_k (docs/kimi-k25.md):

    h_nj = silu(x_n @ Wg[e_j].T) * (x_n @ Wu[e_j].T)          [I]
    y_n  = sum_j w_j * (h_nj @ Wd[e_j].T)                        [H]
    W[o, i] = (nibble(o, i) - 8) * scale[o, i // G]              INT4 "pack-quantized", group G (Kimi: 32)

Weights stay packed: int32 [E, out, in/8] (eight nibbles per word, column 8j+n in nibble n) and
bf16 scales [E, out, in/G]. Three implementations, same numbers up to bf16 rounding:

- `moe_reference`: plain torch, one expert at a time, dequantize then matmul, any dtype (float64
  in tests). The ground truth.
- `int4_moe_grouped_mm`: dequantize every local expert to bf16, then torch._grouped_mm over the
  tokens sorted by expert (the "dequantize-then-grouped-matmul" alternative; 3 x E x I x H x 2
  bytes of transient weights per call).
- `int4_moe`: two Triton kernels (gate+up, then down). The (token, slot) pairs are sorted by
  expert so each expert's rows are one contiguous block; a tile table (tile -> expert, first row,
  end row), built on the device with no host sync, drives a grid over (N tiles, expert tiles).
  Kernel 1 gathers the token rows of x itself (no [N*k, H] copy) and computes gate and up in one
  pass with the silu(g) * u epilogue -> h [N*k, I] bf16 in sorted order. Kernel 2 multiplies h
  by the down weights and scales by the router weight, still in sorted order; a combine kernel
  sums each token's slots through the inverse order (reading only this rank's rows, adding an
  optional [N, H] such as the shared expert, one rounding; deterministic, no atomics).
  The kernel ("v3"; H and I multiples of 128, a scale group of 8-128 dividing 128: `supports`):
  per 128 columns each weight row's 16 packed words are loaded once and nibble position n
  (n = 0..7) becomes its own [BN, 16] tile, unpacked elementwise without an int -> float
  conversion (the bf16 magic number 0x4300; in inline PTX on sm_90), and NIB of them side by
  side make one dot of K = 16 NIB against A's columns permuted to match (permute_k128 on x; the
  gate+up kernel writes h already permuted).

`bf16_grouped_mm_moe` is the speed-of-light reference of the same math with bf16 weights (the
sort-by-expert torch._grouped_mm), used by benchmarks/bench_moe.py.

Expert parallelism: the caller passes only its local experts and `expert_start`; pairs routed to
other ranks' experts fall into a dummy bucket that gets no tiles, so they contribute zero.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F

from eagleforge.kernels.optional_triton import HAS_TRITON, tl, triton

log = logging.getLogger(__name__)

PACK_FACTOR = 8  # 4-bit values per int32
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


# ---------------------------------------------------------------------------- torch reference


def _dequantize(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int32 [..., out, in/8] + scale [..., out, in/32] -> dtype [..., out, in] (docs/kimi-k25.md)."""
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


def inverse_local_order(order: torch.Tensor, counts: torch.Tensor, num_local: int) -> torch.Tensor:
    """order [N*k] (sort_by_expert) -> inv [N*k] int32: the sorted row of each (token, slot)
    pair, -1 for pairs of other ranks' experts (they sort past the local rows)."""
    rows = order.numel()
    inv = torch.empty(rows, dtype=torch.int32, device=order.device)
    inv[order] = torch.arange(rows, dtype=torch.int32, device=order.device)
    local_rows = counts[:num_local].sum()  # a device scalar: no host sync
    return torch.where(inv < local_rows, inv, -1)


def combine_slots_reference(y_sorted: torch.Tensor, inv: torch.Tensor, k: int, add: torch.Tensor | None = None,
                            out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """out[n] = sum over slots s of y_sorted[inv[n*k + s]] (slots with inv = -1 skipped), plus
    add[n], summed in fp32 and rounded once to out_dtype. y_sorted [R, H], inv [N*k] -> [N, H]."""
    rows, hidden = y_sorted.shape
    padded = torch.cat([y_sorted, y_sorted.new_zeros(1, hidden)])  # row R: the zero of a foreign slot
    index = torch.where(inv >= 0, inv, rows).long().view(-1, k)  # [N, k]
    acc = torch.zeros(index.shape[0], hidden, dtype=torch.promote_types(y_sorted.dtype, torch.float32), device=y_sorted.device)
    for slot in range(k):  # slot by slot: the kernel's order of the fp32 sum
        acc += padded[index[:, slot]].to(acc.dtype)
    if add is not None:
        acc = acc + add.to(acc.dtype)
    return acc.to(out_dtype)


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

# v3's PTX unpack of one word ($8) with its scale ($9) into the eight bf16 weights $0..$7: for
# shift 4i, nibbles i and i + 4 land in the two halves of t as 128 + nibble (0x4300 | nibble),
# then t - 136 (exact) and t * scale (rounded once), split into outputs i and i + 4.
_UNPACK_PAIR = """
            {shift}lop3.b32 t, {src}, 0x000f000f, 0x43004300, 0xea;
            sub.rn.bf16x2 t, t, c;
            mul.rn.bf16x2 t, t, s2;
            mov.b32 {{${lo}, ${hi}}}, t;"""
_UNPACK_PTX_TEXT = ("{ .reg .b32 t, w, s2, c; mov.b32 s2, {$9, $9}; mov.b32 c, 0x43084308;"
                    + "".join(_UNPACK_PAIR.format(shift=f"shr.u32 w, $8, {4 * i}; " if i else "", src="w" if i else "$8",
                                                  lo=i, hi=i + 4) for i in range(4))
                    + "\n}")


if HAS_TRITON:
    _UNPACK_PTX = tl.constexpr(_UNPACK_PTX_TEXT)

    @triton.jit
    def _combine_slots_kernel(y_ptr, inv_ptr, add_ptr, out_ptr, H, stride_y, stride_add, stride_out,
                              K: tl.constexpr, HAS_ADD: tl.constexpr, BLOCK_H: tl.constexpr):
        """One program per (token n, block of H): out[n] = sum_s y[inv[n*K + s]] (+ add[n]) in fp32."""
        n = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        mask = offs < H
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        for s in tl.static_range(K):
            r = tl.load(inv_ptr + n * K + s).to(tl.int64)  # -1: another rank's expert
            local = (offs * 0 + r) >= 0  # [BLOCK_H]: the slot's row is on this rank
            acc += tl.load(y_ptr + tl.maximum(r, 0) * stride_y + offs, mask=mask & local, other=0.0).to(tl.float32)
        if HAS_ADD:
            acc += tl.load(add_ptr + n * stride_add + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + n * stride_out + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _nibble_times_scale(words, n: tl.constexpr, scale_w, FP32_MATH: tl.constexpr):
        """Nibble n of each word times its scale: int32 [BN, 16] -> [BN, 16] bf16 (fp32 under FP32_MATH).

        No int -> float conversion instruction (16 per clock per SM on Hopper): OR-ing a nibble into the mantissa of bf16 128.0 (bits 0x4300) gives the bf16
        value 128 + nibble exactly, so W = (that - 136) * scale is one exact bf16 subtraction and
        one correctly rounded bf16 multiply (the bits of dequantize_int4's bf16 math).
        """
        b = (((words >> (4 * n)) & 0xF) | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)  # 128 + nibble
        if FP32_MATH:  # the interpreter: numpy has no bf16 arithmetic; the same values in fp32
            return (b.to(tl.float32) - 136.0) * scale_w.to(tl.float32)
        return (b - 136.0) * scale_w

    @triton.jit
    def _nibbles_times_scale_asm(words, scale_w):
        """All eight nibble tiles of the words at once, two nibbles per 32-bit operation (sm_90 PTX):
        int32 [BN, 16], bf16 [BN, 16] -> eight bf16 [BN, 16], the values of _nibble_times_scale.

        (w >> 4i) & 0x000F000F | 0x43004300 puts nibbles i and i + 4 into the mantissas of a bf16
        pair (128 + nibble each); one bf16x2 subtraction of 136 (exact) and one bf16x2 multiply by
        the word's scale (rounded once) give both weights.
        """
        return tl.inline_asm_elementwise(
            asm=_UNPACK_PTX,
            constraints="=h,=h,=h,=h,=h,=h,=h,=h,r,h",
            args=[words, scale_w],
            dtype=(tl.bfloat16,) * 8,
            is_pure=True,
            pack=1,
        )

    @triton.jit
    def _nibble_tiles(words, scale_w, FP32_MATH: tl.constexpr):
        """The eight nibble tiles of _nibble_times_scale as one tuple (the Triton-ops twin of the PTX unpack)."""
        return (_nibble_times_scale(words, 0, scale_w, FP32_MATH), _nibble_times_scale(words, 1, scale_w, FP32_MATH),
                _nibble_times_scale(words, 2, scale_w, FP32_MATH), _nibble_times_scale(words, 3, scale_w, FP32_MATH),
                _nibble_times_scale(words, 4, scale_w, FP32_MATH), _nibble_times_scale(words, 5, scale_w, FP32_MATH),
                _nibble_times_scale(words, 6, scale_w, FP32_MATH), _nibble_times_scale(words, 7, scale_w, FP32_MATH))

    @triton.jit
    def _unpack_words(words, scale_w, ASM: tl.constexpr, DOT_DTYPE: tl.constexpr):
        """int32 [BN, 16] words and their scales -> the eight nibble tiles [BN, 16] (tuple)."""
        if ASM:
            return _nibbles_times_scale_asm(words, scale_w)
        return _nibble_tiles(words, scale_w, DOT_DTYPE == tl.float32)

    @triton.jit
    def _cat_columns(a, b):
        """[R, C], [R, C] -> [R, 2C] = a then b along the columns. join puts the pair in each
        thread's registers, so in the MMA operand layout this is a renaming (no shuffle in the
        sm_90 build)."""
        c = tl.permute(tl.join(a, b), (0, 2, 1))  # [R, 2, C]
        return tl.reshape(c, (c.shape[0], 2 * c.shape[2]))

    @triton.jit
    def _concat_tiles(tiles, n: tl.constexpr, NIB: tl.constexpr):
        """Nibble tiles n .. n + NIB - 1 side by side: [BN, 16 NIB], the weights of A's permuted
        columns [16 n, 16 (n + NIB)) of a 128-block (one dot of K = 16 NIB instead of NIB dots)."""
        if NIB == 1:
            return tiles[n]
        elif NIB == 2:
            return _cat_columns(tiles[n], tiles[n + 1])
        elif NIB == 4:
            return _cat_columns(_cat_columns(tiles[n], tiles[n + 1]), _cat_columns(tiles[n + 2], tiles[n + 3]))
        else:
            tl.static_assert(NIB == 8, "NIB must be 1, 2, 4 or 8")
            return _cat_columns(_cat_columns(_cat_columns(tiles[0], tiles[1]), _cat_columns(tiles[2], tiles[3])),
                                _cat_columns(_cat_columns(tiles[4], tiles[5]), _cat_columns(tiles[6], tiles[7])))

    @triton.jit
    def _word_scales(s_ptr, s_off, k0, n_mask, word_group, GROUP: tl.constexpr):
        """[BN, 16]: the scale of each packed word of the 128 columns at k0 (a word lies in one group).

        Built from 128 / GROUP per-row [BN] loads and selects, elementwise, so the tile keeps the
        words' register layout (a [BN, 16] load of repeated addresses made Triton 3.6 convert the
        weights through shared memory: 2x the instructions, sm_90 build). word_group [1, 16].
        """
        scale_w = tl.load(s_ptr + s_off + k0 // GROUP, mask=n_mask, other=0.0)[:, None] + tl.zeros_like(word_group).to(s_ptr.dtype.element_ty)
        for g in tl.static_range(1, 128 // GROUP):
            scale_g = tl.load(s_ptr + s_off + k0 // GROUP + g, mask=n_mask, other=0.0)
            scale_w = tl.where(word_group == g, scale_g[:, None], scale_w)
        return scale_w

    @triton.jit
    def _int4_moe_v3_kernel(
        a_ptr, a_rows_ptr, stride_am,  # A [*, K] bf16, columns permuted by permute_k128; row r reads A[a_rows[r]] when GATHER_A
        b_ptr, s_ptr, b2_ptr, s2_ptr,  # packed int32 [E, N, K/8], scales bf16 [E, N, K/GROUP] (checkpoint layout); b2/s2: up
        c_ptr, c_rows_ptr, c_scale_ptr, stride_cm,  # SCATTER_C: sorted row r -> c[c_rows[r]] * c_scale[c_rows[r]]
        tile_expert_ptr, tile_begin_ptr, tile_end_ptr,
        N, K,
        stride_be, stride_bn, stride_se, stride_sn,
        word_group_ptr,  # int32 [16]: (8 j) // GROUP, the scale group of word j of a 128-column block
        GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr,
        GATHER_A: tl.constexpr, GATE_UP: tl.constexpr, SCATTER_C: tl.constexpr, DOT_DTYPE: tl.constexpr,
        PERMUTE_N: tl.constexpr, ASM: tl.constexpr, NIB: tl.constexpr,
    ):
        """v3: C^T [BN, BT] = W [BN, K] @ A^T [K, BT], one dot of K = 16 NIB per NIB nibble positions.

        Per 128 columns at k0 the [BN, 16] packed words of each weight row are loaded once; nibble
        n of word j is column k0 + 8j + n, so the eight nibble tiles [BN, 16] (n = 0..7) hold the
        column sets {k0 + 8j + n : j < 16}; A's columns come permuted the same way (permute_k128:
        A column k0 + 16n + j holds column k0 + 8j + n), so nibble tile n meets the contiguous A
        slice [k0 + 16n, k0 + 16n + 16); NIB consecutive tiles side by side (_concat_tiles) meet
        [k0 + 16n, k0 + 16(n + NIB)) in one dot of K = 16 NIB (each dot waits for its wgmma:
        fewer, larger dots wait less). The unpack is elementwise on the words
        (no reshape, no shuffle), so Triton builds it directly in the registers of wgmma's left
        operand: the weights sit on the MMA's M side (BN rows), the tokens on its N side (BT,
        16-256 wide), read from shared memory. ASM: the unpack in inline PTX, two nibbles per
        32-bit operation (sm_90); else in Triton ops (the interpreter's path).
        PERMUTE_N (gate+up): output column p is weight row c(p) = 128 (p // 128) + 8 (p % 16) +
        (p % 128) // 16, so h is written already permuted for the down kernel, in contiguous rows.
        """
        pid_n = tl.program_id(0)  # fastest: consecutive programs share one token tile, walk one expert
        pid_t = tl.program_id(1)
        begin = tl.load(tile_begin_ptr + pid_t)
        end = tl.load(tile_end_ptr + pid_t)
        if begin < end:
            expert = tl.load(tile_expert_ptr + pid_t).to(tl.int64)
            offs_t = begin + tl.arange(0, BLOCK_T)
            t_mask = offs_t < end
            if GATHER_A:
                a_rows = tl.load(a_rows_ptr + offs_t, mask=t_mask, other=0).to(tl.int64)
            else:
                a_rows = offs_t.to(tl.int64)
            offs_p = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # output columns
            n_mask = offs_p < N
            if PERMUTE_N:
                offs_n = (offs_p // 128) * 128 + 8 * (offs_p % 16) + (offs_p % 128) // 16
            else:
                offs_n = offs_p
            offs_j = tl.arange(0, 16)
            a_ptrs = a_ptr + a_rows[:, None] * stride_am + tl.arange(0, 16 * NIB)[None, :]  # [BT, 16 NIB]
            b_off = expert * stride_be + offs_n[:, None].to(tl.int64) * stride_bn + offs_j[None, :]  # [BN, 16] words
            s_off = expert * stride_se + offs_n.to(tl.int64) * stride_sn  # [BN]
            # [1, 16], loaded rather than computed from offs_j: Triton 3.6 then unpacks the words
            # straight into the MMA's operand registers; with the arange-derived form it sent every
            # unpacked tile through shared memory (a store, two barriers and ldmatrix per K = 16 dot)
            word_group = tl.load(word_group_ptr + offs_j)[None, :]
            acc = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
            acc2 = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
            for k0 in range(0, K, 128):
                words = tl.load(b_ptr + b_off + k0 // 8, mask=n_mask[:, None], other=0)
                tiles = _unpack_words(words, _word_scales(s_ptr, s_off, k0, n_mask, word_group, GROUP), ASM, DOT_DTYPE)
                if GATE_UP:
                    words2 = tl.load(b2_ptr + b_off + k0 // 8, mask=n_mask[:, None], other=0)
                    tiles2 = _unpack_words(words2, _word_scales(s2_ptr, s_off, k0, n_mask, word_group, GROUP), ASM, DOT_DTYPE)
                for n in tl.static_range(0, 8, NIB):
                    at = tl.trans(tl.load(a_ptrs + (k0 + 16 * n), mask=t_mask[:, None], other=0.0).to(DOT_DTYPE))  # [16 NIB, BT]
                    acc = tl.dot(_concat_tiles(tiles, n, NIB), at, acc)
                    if GATE_UP:
                        acc2 = tl.dot(_concat_tiles(tiles2, n, NIB), at, acc2)
            if GATE_UP:
                acc = acc * tl.sigmoid(acc) * acc2  # silu(gate) * up, [BN, BT]
            if SCATTER_C:
                c_rows = tl.load(c_rows_ptr + offs_t, mask=t_mask, other=0).to(tl.int64)
                acc = acc * tl.load(c_scale_ptr + c_rows, mask=t_mask, other=0.0)[None, :]
            else:
                c_rows = offs_t.to(tl.int64)
            c_ptrs = c_ptr + c_rows[None, :] * stride_cm + offs_p[:, None]  # [BN, BT], transposed store
            tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=n_mask[:, None] & t_mask[None, :])


# ---------------------------------------------------------------------------- launch configs
#
# A config is (impl, BLOCK_T, BLOCK_N, BLOCK_K, num_warps, num_stages[, maxnreg]):
#   "s"   weights on the MMA's M side (BLOCK_N rows), tokens on its N side (BLOCK_T)
#   "sa"  the same with the unpack in inline PTX (two nibbles per 32-bit operation; sm_90)
# BLOCK_K is the K of one dot: 16 NIB, NIB nibble tiles side by side (a loop step covers 128
# columns in 8 / NIB dots). What decides the speed, from the sm_90 SASS (Triton 3.6) and
# measurements on an H200 (gate+up at 16K tokens; the times: BENCHMARKS.md, "What bounds the
# INT4 kernels"): each dot waits for its wgmma (a register operand), so 8 / NIB waits per step;
# an arange-derived word_group sent every unpacked tile through shared memory (two barriers per
# dot), a loaded one keeps it in registers; 4-warp configs under ~110 KB of shared memory put two
# CTAs on an SM to cover each other's waits (the largest gain); the PTX unpack cuts the
# instructions per step by a quarter but hardly the time (issue was not the bound).

# v3 candidates per rows-per-expert bucket, each timed once per shape; the first is used untimed
# under the interpreter (INTERPRET_CONFIGS there)
# Down: a cap of 168 registers (185 uncapped, no spills at 168) fits three 4-warp CTAs per SM
# instead of two (faster at 4K and 16K tokens). Gate+up keeps two (255 registers for its two
# accumulators; at 168 it spills 552 bytes). Both kernels are latency-bound (Nsight Compute: the
# tensor pipe and L2 well below their peaks, the largest stall the words' global loads in the
# step that unpacks them); a prefetch of the next block into L1 doubled the L2 traffic and lost
# time; gate+up with gate and up stacked in one accumulator (three CTAs per SM, twice the
# token-tile reads) lost time too. Measured: BENCHMARKS.md, "What bounds the INT4 kernels".
V3_CONFIGS = {
    "large": [("sa", 128, 64, 64, 4, 3), ("sa", 128, 64, 32, 4, 3), ("s", 128, 64, 64, 4, 3), ("sa", 128, 64, 16, 4, 3)],
    "small": [("sa", 128, 64, 64, 4, 3), ("sa", 128, 64, 32, 4, 3), ("sa", 128, 64, 64, 4, 2), ("sa", 128, 64, 16, 4, 3)],
}
V3_DOWN_CONFIGS = {
    "large": [("sa", 128, 64, 64, 4, 2, 168), ("sa", 128, 64, 32, 4, 2), ("sa", 128, 64, 64, 4, 2), ("sa", 128, 64, 32, 4, 2, 168)],
    "small": [("sa", 128, 64, 64, 4, 2, 168), ("sa", 128, 64, 32, 4, 2), ("sa", 128, 64, 64, 4, 2), ("sa", 128, 64, 32, 4, 2, 168)],
}
INTERPRET_CONFIGS = [("s", 16, 32, 64, 4, 1)]  # what v3 runs under TRITON_INTERPRET=1 (tests switch it)
_CHOSEN: dict = {}
_FAILED: dict = {}  # config -> error text, for the benchmark's report
_TIMES: dict = {}  # shape key -> {config: ms} of the search


def size_bucket(rows: int, num_local: int) -> str:
    """"large" when experts average >= 192 rows (16K tokens at 384 experts and k 8: ~341), else "small" (4K: ~85)."""
    return "large" if rows >= 192 * num_local else "small"


def permute_k128(a: torch.Tensor) -> torch.Tensor:
    """[R, K] -> [R, K], K % 128 == 0: in each block of 128 columns, column 16n + j <- column 8j + n
    (the order in which v3 meets the packed words' nibbles: nibble n of word j is column 8j + n)."""
    rows, k = a.shape
    return a.reshape(rows, k // 128, 16, 8).transpose(-1, -2).reshape(rows, k)


def _launch(config, a, a_rows, b, s, b2, s2, c, c_rows, c_scale, table, gather, gate_up, scatter):
    impl, block_t, block_n, block_k, warps, stages, *maxnreg = config  # maxnreg: optional 7th, registers per thread
    n, k = b.shape[1], b.shape[2] * PACK_FACTOR
    grid = (triton.cdiv(n, block_n), table[0].shape[0])
    dummy = table[0]  # any int32 tensor: unused pointer arguments of a disabled branch
    args = (a, a_rows if a_rows is not None else dummy, a.stride(0),
            b, s, b2 if b2 is not None else b, s2 if s2 is not None else s,
            c, c_rows if c_rows is not None else dummy, c_scale if c_scale is not None else s, c.stride(0),
            table[0], table[1], table[2],
            n, k, b.stride(0), b.stride(1), s.stride(0), s.stride(1))
    # the interpreter computes bf16 arithmetic on the raw 16-bit integers: give it fp32 (the same
    # values: every bf16 is exact in fp32; on the GPU the products are rounded to bf16 once)
    common = dict(GROUP=k // s.shape[2], BLOCK_N=block_n, GATHER_A=gather, GATE_UP=gate_up,
                  SCATTER_C=scatter, DOT_DTYPE=tl.float32 if INTERPRET else tl.bfloat16,
                  **({} if INTERPRET else {"num_warps": warps, "num_stages": stages, **({"maxnreg": maxnreg[0]} if maxnreg else {})}))
    if block_k not in (16, 32, 64, 128):
        raise ValueError(f"int4_moe: config {config}: the K of a dot (BLOCK_K) must be 16, 32, 64 or 128")
    # the gate+up kernel writes h in the permuted column order the down kernel reads
    _int4_moe_v3_kernel[grid](*args, _word_group_table(common["GROUP"], b.device), BLOCK_T=block_t, PERMUTE_N=gate_up,
                              ASM=impl == "sa" and _has_bf16x2_math(b.device), NIB=block_k // 16, **common)


def _has_bf16x2_math(device: torch.device) -> bool:
    """The "sa" unpack's sub/mul.rn.bf16x2 need sm_90; below, "sa" configs run the Triton-ops unpack."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)


_WORD_GROUPS: dict = {}


def _word_group_table(group: int, device: torch.device) -> torch.Tensor:
    """int32 [16]: the scale group (8 j) // group of packed word j in a 128-column block (v3's word_group_ptr)."""
    key = (group, str(device))
    if key not in _WORD_GROUPS:
        _WORD_GROUPS[key] = (torch.arange(16, dtype=torch.int32) * 8 // group).to(device)
    return _WORD_GROUPS[key]


def _compile_errors():
    errors = (triton.runtime.errors.OutOfResources, triton.compiler.errors.CompilationError)
    ptxas = getattr(triton.runtime.errors, "PTXASError", None)  # Triton 3.x: not a RuntimeError
    return errors + ((ptxas,) if ptxas else ()) + (RuntimeError,)  # driver errors surface as RuntimeError


def _pick_config(name: str, configs: list, key: tuple, run) -> tuple:
    """The fastest of `configs` for this shape key, timed once per key (the first one under the interpreter).

    An own search rather than triton.autotune: BLOCK_T decides the host-side tile table, so each
    candidate needs its own table, built in `run`. A candidate that fails to compile or runs out
    of shared memory is skipped (and recorded in _FAILED); if all fail, the error is raised.
    """
    if INTERPRET:
        return configs[0]
    full_key = (name,) + key
    if full_key not in _CHOSEN:
        import triton.testing

        times = []
        for c in configs:
            try:
                times.append(float(triton.testing.do_bench(lambda c=c: run(c), warmup=2, rep=10, return_mode="median")))
            except _compile_errors() as err:
                _FAILED[(name,) + tuple(c)] = f"{type(err).__name__}: {str(err)[:300]}"
                log.warning("int4_moe %s %s: config %s failed (%s)", name, key, c, str(err)[:200])
                times.append(float("inf"))
        if min(times) == float("inf"):
            raise RuntimeError(f"int4_moe {name} {key}: every config failed: {[_FAILED.get((name,) + tuple(c)) for c in configs]}")
        _CHOSEN[full_key] = configs[min(range(len(configs)), key=times.__getitem__)]
        _TIMES[full_key] = {str(c): round(t, 3) for c, t in zip(configs, times)}
        log.info("int4_moe %s %s: configs %s ms %s -> %s", name, key, configs, [round(t, 3) for t in times], _CHOSEN[full_key])
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
        in_features = packed.shape[2] * PACK_FACTOR
        if scale.dtype != torch.bfloat16 or scale.dim() != 3 or scale.shape[2] < 1 or in_features % scale.shape[2]:
            problems.append(f"{name}: scale {scale.dtype} {tuple(scale.shape)} (bf16, [E, out, groups] with groups dividing {in_features})")
    if up_scale.shape != gate_scale.shape:
        problems.append(f"up scale {tuple(up_scale.shape)} vs gate scale {tuple(gate_scale.shape)} (the same groups expected)")
    if ids.shape != weights.shape or ids.shape[0] != x.shape[0]:
        problems.append(f"ids {tuple(ids.shape)} / weights {tuple(weights.shape)} vs x {tuple(x.shape)}")
    if problems:
        raise ValueError("int4_moe: " + "; ".join(problems))


def combine_slots(y_sorted: torch.Tensor, inv: torch.Tensor, k: int, add: torch.Tensor | None = None,
                  out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`combine_slots_reference` in one Triton pass (CUDA, or the CPU under TRITON_INTERPRET=1):
    reads only the local rows, writes [N, H] once; the slot order is fixed (deterministic)."""
    if not HAS_TRITON or not (y_sorted.is_cuda or INTERPRET):
        return combine_slots_reference(y_sorted, inv, k, add, out_dtype)
    n, hidden = inv.numel() // k, y_sorted.shape[1]
    if add is not None:
        if tuple(add.shape) != (n, hidden):
            raise ValueError(f"combine_slots: add must be [{n}, {hidden}], got {tuple(add.shape)}")
        add = add.contiguous()  # the kernel reads rows with unit stride
    out = torch.empty(n, hidden, dtype=out_dtype, device=y_sorted.device)
    if n == 0:
        return out
    block = min(1024, triton.next_power_of_2(hidden))
    add_t = add if add is not None else out
    _combine_slots_kernel[(n, triton.cdiv(hidden, block))](
        y_sorted, inv, add_t, out, hidden, y_sorted.stride(0), add_t.stride(0), out.stride(0),
        K=k, HAS_ADD=add is not None, BLOCK_H=block)
    return out


def supports(hidden: int, intermediate: int, group: int, down_group: int) -> bool:
    """Whether int4_moe's kernels take these dims: hidden and intermediate multiples of 128, one
    scale group of 8-128 dividing 128 for both gate/up and down (Kimi-K2.5: 7168, 2048, 32)."""
    return (hidden % 128 == 0 and intermediate % 128 == 0 and group % 8 == 0 and 128 % group == 0
            and down_group == group)


def int4_moe(x, weights, ids, gate_packed, gate_scale, up_packed, up_scale, down_packed, down_scale,
             expert_start: int = 0, out_dtype: torch.dtype = torch.float32,
             add: torch.Tensor | None = None) -> torch.Tensor:
    """Triton W4A16 MoE: x [N, H] bf16, router weights [N, k] fp32 and ids [N, k] -> [N, H] out_dtype.

    add [N, H] (optional, e.g. the shared expert's output): added to the sum over slots in fp32
    before the one rounding to out_dtype.

    Weights are this rank's experts [expert_start, expert_start + E_l); pairs routed to other
    experts contribute nothing (the combine skips them). The dims must pass `supports` (dots of
    K = 16-128 over side-by-side nibble tiles of 128-column blocks). The launch configs are timed
    once per shape. Needs CUDA, or CPU tensors under TRITON_INTERPRET=1.
    """
    if not HAS_TRITON:
        raise RuntimeError("int4_moe needs triton (pip install triton); use moe_reference on this machine")
    _check(x, weights, ids, gate_packed, gate_scale, up_packed, up_scale, down_packed, down_scale)
    I, H = gate_packed.shape[1], x.shape[1]
    group, down_group = H // gate_scale.shape[2], I // down_scale.shape[2]
    if not supports(H, I, group, down_group):
        raise ValueError(f"int4_moe: needs hidden {H} and intermediate {I} to be multiples of 128 and one scale "
                         f"group of 8-128 dividing 128 (got {group} / {down_group}); moe_reference or "
                         f"int4_moe_grouped_mm take any dims")
    N, k = ids.shape
    E = gate_packed.shape[0]
    x = permute_k128(x)  # [N, H]: the kernels meet the columns in nibble order
    rows = N * k
    order, counts = sort_by_expert(ids, E, expert_start)
    tokens = (order // k).to(torch.int32)  # [N*k]: the token of each sorted row
    rows_out = torch.arange(rows, dtype=torch.int32, device=x.device)  # down writes row r to row r (sorted order)
    sorted_weight = weights.reshape(-1).float()[order].contiguous()  # [N*k]: the router weight of each sorted row
    tables: dict = {}

    def table_for(block_t):
        if block_t not in tables:
            tables[block_t] = tile_table(counts, E, block_t, rows)
        return tables[block_t]

    h = torch.empty(rows, I, dtype=torch.bfloat16, device=x.device)  # sorted order, columns permuted
    # sorted order too, weighted; rows of other ranks' experts (the tail) are never written, and
    # the combine skips them: no zeroing, no reading of [N*k, H] beyond the local rows
    y = torch.empty(rows, H, dtype=torch.bfloat16, device=x.device)

    def gate_up(config):
        _launch(config, x, tokens, gate_packed, gate_scale, up_packed, up_scale, h, None, None, table_for(config[1]), True, True, False)

    def down(config):
        _launch(config, h, None, down_packed, down_scale, None, None, y, rows_out, sorted_weight, table_for(config[1]), False, False, True)

    key = size_bucket(rows, E)
    gu_configs, dn_configs = V3_CONFIGS[key], V3_DOWN_CONFIGS[key]
    if INTERPRET:  # small tiles: the interpreter runs every program in numpy
        gu_configs = dn_configs = INTERPRET_CONFIGS
    gate_up(_pick_config("v3_gate_up", gu_configs, (I, H, group, key), gate_up))
    down(_pick_config("v3_down", dn_configs, (H, I, down_group, key), down))
    return combine_slots(y, inverse_local_order(order, counts, E), k, add, out_dtype)  # [N, H]


# ---------------------------------------------------------------------------- grouped_mm paths


def _grouped_offsets(counts: torch.Tensor, num_local: int) -> torch.Tensor:
    return counts[:num_local].cumsum(0).to(torch.int32)  # [E_l] end offsets, torch._grouped_mm's form


def bf16_grouped_mm_moe(x, weights, ids, gate_up_t, down_t, expert_start: int = 0) -> torch.Tensor:
    """Sort by expert + torch._grouped_mm with bf16 weights: gate_up_t [E, H, 2I], down_t [E, I, H] -> [N, H] bf16.

    The speed-of-light reference of the same math with bf16 weights.
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
