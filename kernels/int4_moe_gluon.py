"""INT4 MoE down projection in Gluon (Triton's explicit-layout dialect): v3 with its wgmmas in flight.

v3 (kernels/int4_moe.py) unpacks the INT4 weights straight into the registers of wgmma's left
operand; Triton 3.6 then waits for each wgmma before the next instruction, because the
registers of a register-operand wgmma must not change while it runs. So the unpack of the next
tile never overlaps the tensor cores (issue 6's limit: 1.13x the bf16 grouped GEMM at 16K).
Gluon lets the kernel say which registers stay alive: the eight wgmmas of a 128-column block are
issued asynchronously, and while they run the kernel unpacks the next block's weights into
other registers and loads the block after it; one wait per block. (A probe build for sm_90 with
Triton 3.6: four HGMMAs with register operands back to back and one WARPGROUP.DEPBAR, 2026-11-30.)

Same math, layouts and tile table as v3's down kernel: C^T [BN, BT] = W [BN, K] @ A^T [K, BT],
W the packed checkpoint rows [E, N, K/8] int32 with bf16 scales [E, N, K/GROUP], A = h with its
columns permuted by permute_k128 (the gate+up kernel writes it so), sorted rows r of the tile
[begin, end) written to c[c_rows[r]] times c_scale[c_rows[r]]. Needs sm_90 (wgmma); no
interpreter (Gluon has none): its tests compare it with v3 and the float64 formula on the GPU,
and a CPU test builds it for sm_90.

Two variants, measured on an H200 (2026-11-30 U8/U10, benchmarks/bench_moe_gluon.py), both the
same output as v3's bit for bit:
- "regs": the weights in wgmma's operand registers, eight async wgmmas per block, one wait;
  0.995x v3 at 16K tokens, 1.04x at 4K: ptxas schedules the next block's unpack ahead of the
  wgmmas, so within a CTA the unpack still does not overlap them.
- "smem": the next block unpacked into a second shared-memory stage while the block's wgmma
  runs (the wait leaves one in flight); 0.79x: the stores, and the barrier Triton puts between
  the eight tile stores, cost more than the overlap gains.
Not used by int4_moe; kept as the start of a producer/consumer (warp-specialized) version, where
one warpgroup unpacks and another only issues wgmmas.
"""

from __future__ import annotations

import torch

# Gluon's API changes between Triton releases (3.9 renamed thread_barrier and the cp.async op);
# this kernel is written against 3.6, the device image's.
GLUON_TRITON = "3.6"
try:
    import triton
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia import hopper
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier

    _cta_barrier = gl.thread_barrier
    HAS_GLUON = triton.__version__.startswith(GLUON_TRITON + ".")
except (ImportError, AttributeError):  # pragma: no cover - depends on the Triton version
    HAS_GLUON = False
WHY_NO_GLUON = f"the Gluon kernel is written against Triton {GLUON_TRITON}'s Gluon API (the device image's)"

from .int4_moe import _UNPACK_PTX_TEXT, PACK_FACTOR

BLOCK_N = 64  # weight rows per program: one warpgroup's wgmma M
BLOCK_T = 128  # tokens per program (the tile table's block_m): wgmma N

if HAS_GLUON:
    _UNPACK = gl.constexpr(_UNPACK_PTX_TEXT)

    @gluon.jit
    def _unpack8(words, scales):
        """int32 words [BN, 16] and their bf16 scales -> the eight nibble tiles [BN, 16] bf16 (v3's PTX)."""
        return gl.inline_asm_elementwise(
            asm=_UNPACK, constraints="=h,=h,=h,=h,=h,=h,=h,=h,r,h", args=[words, scales],
            dtype=(gl.bfloat16,) * 8, is_pure=False, pack=1)

    @gluon.jit
    def _h_block_pointers(a_ptr, stride_am, begin, end, BT: gl.constexpr, layout: gl.constexpr):
        """Pointers to the first 128 columns of the tile's rows [begin, end) of h [BT, 128], and the row mask."""
        offs = begin + gl.arange(0, BT, layout=gl.SliceLayout(1, layout))
        cols = gl.arange(0, 128, layout=gl.SliceLayout(0, layout))
        return a_ptr + offs.to(gl.int64)[:, None] * stride_am + cols[None, :], offs < end

    @gluon.jit
    def _word_pointers(b_ptr, s_ptr, expert, pid_n, N, stride_be, stride_bn, stride_se, stride_sn,
                       BN: gl.constexpr, GROUP: gl.constexpr, layout: gl.constexpr):
        """Pointers to the first block's packed words [BN, 16] of this program's weight rows and to
        each word's scale (word j of a 128-column block is in group j // (GROUP / 8)), and the row mask."""
        offs_n = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, layout))
        j = gl.arange(0, 16, layout=gl.SliceLayout(0, layout))
        rows = offs_n.to(gl.int64)[:, None]
        w_ptrs = b_ptr + expert * stride_be + rows * stride_bn + j[None, :]
        s_ptrs = s_ptr + expert * stride_se + rows * stride_sn + (j // (GROUP // 8))[None, :]
        return w_ptrs, s_ptrs, offs_n < N

    @gluon.jit
    def _store_scaled_rows(acc, c_ptr, c_rows_ptr, c_scale_ptr, stride_cm, begin, end, pid_n, N,
                           BN: gl.constexpr, BT: gl.constexpr, acc_l: gl.constexpr):
        """C^T [BN, BT] to c[c_rows[r]] times c_scale[c_rows[r]] for the tile's rows r (v3's epilogue)."""
        offs_t = begin + gl.arange(0, BT, layout=gl.SliceLayout(0, acc_l))
        t_mask = offs_t < end
        c_rows = gl.load(c_rows_ptr + offs_t, mask=t_mask, other=0).to(gl.int64)
        acc = acc * gl.load(c_scale_ptr + c_rows, mask=t_mask, other=0.0)[None, :]
        offs_p = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, acc_l))
        gl.store(c_ptr + c_rows[None, :] * stride_cm + offs_p[:, None], acc.to(gl.bfloat16),
                 mask=(offs_p < N)[:, None] & t_mask[None, :])

    @gluon.jit
    def _int4_down_g_kernel(
        a_ptr, stride_am, b_ptr, s_ptr, c_ptr, c_rows_ptr, c_scale_ptr, stride_cm,
        tile_expert_ptr, tile_begin_ptr, tile_end_ptr, N, K,
        stride_be, stride_bn, stride_se, stride_sn,
        GROUP: gl.constexpr, BN: gl.constexpr, BT: gl.constexpr,
    ):
        acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BT, 16])
        w_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_l, k_width=2)
        a_l: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])  # [BT, 128] bf16: 16-byte loads
        a_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        pid_n = gl.program_id(0)
        pid_t = gl.program_id(1)
        begin = gl.load(tile_begin_ptr + pid_t)
        end = gl.load(tile_end_ptr + pid_t)
        if begin < end:
            expert = gl.load(tile_expert_ptr + pid_t).to(gl.int64)
            # A: rows [begin, end) of h, one 128-column block at a time, copied asynchronously
            # (cp.async) into two shared-memory stages: block i + 2 lands while block i + 1 computes
            a_ptrs, ta_mask = _h_block_pointers(a_ptr, stride_am, begin, end, BT, a_l)
            a_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BT, 128], a_sl)
            # W: [BN, 16] packed words of the block, in the registers of wgmma's left operand
            w_ptrs, s_ptrs, n_mask = _word_pointers(b_ptr, s_ptr, expert, pid_n, N, stride_be, stride_bn, stride_se,
                                                    stride_sn, BN, GROUP, w_l)
            nk = K // 128
            # prologue: blocks 0 and 1 on their way to shared memory; block 0 unpacked, block 1's words loaded
            async_copy.async_copy_global_to_shared(a_smem.index(0), a_ptrs, mask=ta_mask[:, None])
            async_copy.commit_group()
            async_copy.async_copy_global_to_shared(a_smem.index(1), a_ptrs + 128, mask=ta_mask[:, None] & (nk > 1))
            async_copy.commit_group()
            words = gl.load(w_ptrs, mask=n_mask[:, None], other=0)
            scales = gl.load(s_ptrs, mask=n_mask[:, None], other=0.0)
            t0, t1, t2, t3, t4, t5, t6, t7 = _unpack8(words, scales)
            more = nk > 1
            words = gl.load(w_ptrs + 16, mask=n_mask[:, None] & more, other=0)
            scales = gl.load(s_ptrs + 128 // GROUP, mask=n_mask[:, None] & more, other=0.0)
            acc = gl.zeros([BN, BT], gl.float32, acc_l)
            for i in range(nk):
                a_i = a_smem.index(i % 2)
                async_copy.wait_group(1)  # this thread's copies of block i have landed
                hopper.fence_async_shared()
                _cta_barrier()  # and every other thread's
                tok = hopper.warpgroup_mma_init(acc)
                tok = hopper.warpgroup_mma(t0, a_i.slice(0, 16, dim=1).permute((1, 0)), tok, is_async=True)
                tok = hopper.warpgroup_mma(t1, a_i.slice(16, 16, dim=1).permute((1, 0)), tok, is_async=True)
                tok = hopper.warpgroup_mma(t2, a_i.slice(32, 16, dim=1).permute((1, 0)), tok, is_async=True)
                tok = hopper.warpgroup_mma(t3, a_i.slice(48, 16, dim=1).permute((1, 0)), tok, is_async=True)
                tok = hopper.warpgroup_mma(t4, a_i.slice(64, 16, dim=1).permute((1, 0)), tok, is_async=True)
                tok = hopper.warpgroup_mma(t5, a_i.slice(80, 16, dim=1).permute((1, 0)), tok, is_async=True)
                tok = hopper.warpgroup_mma(t6, a_i.slice(96, 16, dim=1).permute((1, 0)), tok, is_async=True)
                tok = hopper.warpgroup_mma(t7, a_i.slice(112, 16, dim=1).permute((1, 0)), tok, is_async=True)
                # while the tensor cores run: block i + 1 unpacked into other registers, block i + 2's words loaded
                u0, u1, u2, u3, u4, u5, u6, u7 = _unpack8(words, scales)
                more = i + 2 < nk
                words = gl.load(w_ptrs + (i + 2) * 16, mask=n_mask[:, None] & more, other=0)
                scales = gl.load(s_ptrs + (i + 2) * (128 // GROUP), mask=n_mask[:, None] & more, other=0.0)
                acc, t0, t1, t2, t3, t4, t5, t6, t7 = hopper.warpgroup_mma_wait(
                    num_outstanding=0, deps=[tok, t0, t1, t2, t3, t4, t5, t6, t7])
                _cta_barrier()  # no warp still reads block i's stage
                async_copy.async_copy_global_to_shared(a_i, a_ptrs + (i + 2) * 128, mask=ta_mask[:, None] & more)
                async_copy.commit_group()
                t0, t1, t2, t3, t4, t5, t6, t7 = u0, u1, u2, u3, u4, u5, u6, u7
            async_copy.wait_group(0)
            _store_scaled_rows(acc, c_ptr, c_rows_ptr, c_scale_ptr, stride_cm, begin, end, pid_n, N, BN, BT, acc_l)


if HAS_GLUON:

    @gluon.jit
    def _unpack_to_smem(w_ptrs, s_ptrs, k_block, n_mask, w_stage, GROUP: gl.constexpr):
        """Block k_block's packed words [BN, 16] unpacked into w_stage [BN, 128] in shared memory,
        nibble tile n at columns [16 n, 16 n + 16) (the permuted column order h is written in)."""
        words = gl.load(w_ptrs + k_block * 16, mask=n_mask[:, None], other=0)
        scales = gl.load(s_ptrs + k_block * (128 // GROUP), mask=n_mask[:, None], other=0.0)
        t0, t1, t2, t3, t4, t5, t6, t7 = _unpack8(words, scales)
        w_stage.slice(0, 16, dim=1).store(t0)
        w_stage.slice(16, 16, dim=1).store(t1)
        w_stage.slice(32, 16, dim=1).store(t2)
        w_stage.slice(48, 16, dim=1).store(t3)
        w_stage.slice(64, 16, dim=1).store(t4)
        w_stage.slice(80, 16, dim=1).store(t5)
        w_stage.slice(96, 16, dim=1).store(t6)
        w_stage.slice(112, 16, dim=1).store(t7)

    @gluon.jit
    def _int4_down_gs_kernel(
        a_ptr, stride_am, b_ptr, s_ptr, c_ptr, c_rows_ptr, c_scale_ptr, stride_cm,
        tile_expert_ptr, tile_begin_ptr, tile_end_ptr, N, K,
        stride_be, stride_bn, stride_se, stride_sn,
        GROUP: gl.constexpr, BN: gl.constexpr, BT: gl.constexpr,
    ):
        """The "smem" variant: block i + 1's weights are unpacked into a second shared-memory stage
        while block i's wgmma (both operands in shared memory, K = 128) runs; a wait that leaves
        one wgmma in flight frees the stage block i - 1 used. Same tiles and output as the
        kernel above."""
        acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BT, 16])
        w_rl: gl.constexpr = gl.BlockedLayout([1, 4], [16, 2], [4, 1], [1, 0])  # [BN, 16] words in registers
        a_l: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])  # [BT, 128] bf16: 16-byte copies
        sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        pid_n = gl.program_id(0)
        pid_t = gl.program_id(1)
        begin = gl.load(tile_begin_ptr + pid_t)
        end = gl.load(tile_end_ptr + pid_t)
        if begin < end:
            expert = gl.load(tile_expert_ptr + pid_t).to(gl.int64)
            a_ptrs, ta_mask = _h_block_pointers(a_ptr, stride_am, begin, end, BT, a_l)
            a_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BT, 128], sl)
            w_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BN, 128], sl)
            w_ptrs, s_ptrs, n_mask = _word_pointers(b_ptr, s_ptr, expert, pid_n, N, stride_be, stride_bn, stride_se,
                                                    stride_sn, BN, GROUP, w_rl)
            nk = K // 128
            # prologue: blocks 0 and 1 staged (h by cp.async, weights unpacked by this warpgroup)
            async_copy.async_copy_global_to_shared(a_smem.index(0), a_ptrs, mask=ta_mask[:, None])
            async_copy.commit_group()
            _unpack_to_smem(w_ptrs, s_ptrs, 0, n_mask, w_smem.index(0), GROUP)
            if nk > 1:
                async_copy.async_copy_global_to_shared(a_smem.index(1), a_ptrs + 128, mask=ta_mask[:, None])
                _unpack_to_smem(w_ptrs, s_ptrs, 1, n_mask, w_smem.index(1), GROUP)
            async_copy.commit_group()
            acc = gl.zeros([BN, BT], gl.float32, acc_l)
            for i in range(nk):
                s = i % 2
                async_copy.wait_group(0)  # block i's h (and i + 1's, issued with it) in shared memory
                hopper.fence_async_shared()
                _cta_barrier()
                tok = hopper.warpgroup_mma(w_smem.index(s), a_smem.index(s).permute((1, 0)), acc, is_async=True)
                acc = hopper.warpgroup_mma_wait(num_outstanding=1, deps=[tok])  # block i - 1's wgmma done
                if i >= 1 and i + 1 < nk:  # its stage takes block i + 1 while block i's wgmma runs
                    async_copy.async_copy_global_to_shared(a_smem.index(1 - s), a_ptrs + (i + 1) * 128, mask=ta_mask[:, None])
                    _unpack_to_smem(w_ptrs, s_ptrs, i + 1, n_mask, w_smem.index(1 - s), GROUP)
                async_copy.commit_group()
            acc = hopper.warpgroup_mma_wait(num_outstanding=0, deps=[acc])
            _store_scaled_rows(acc, c_ptr, c_rows_ptr, c_scale_ptr, stride_cm, begin, end, pid_n, N, BN, BT, acc_l)


if HAS_GLUON:

    @gluon.jit
    def _pair_order_tile(t0, t1, t2, t3, t4, t5, t6, t7):
        """The eight nibble tiles [BN, 16] -> one [BN, 128] tile in "pair order": column 8j + 2i + c
        holds nibble i + 4c of word j (permute_pairs' order). The unpack leaves nibbles i and i + 4
        in one 32-bit register, so each thread's word becomes 8 contiguous bf16 (one 16-byte
        shared-memory store) without a byte permute; join and permute only rename registers."""
        p0 = gl.join(t0, t4)  # [BN, 16, 2 (c)]
        p1 = gl.join(t1, t5)
        p2 = gl.join(t2, t6)
        p3 = gl.join(t3, t7)
        q0 = gl.permute(gl.join(p0, p1), (0, 1, 3, 2))  # [BN, 16, 2 (b), 2 (c)], i = 2a + b
        q1 = gl.permute(gl.join(p2, p3), (0, 1, 3, 2))
        r = gl.permute(gl.join(q0, q1), (0, 1, 4, 2, 3))  # [BN, 16, 2 (a), 2 (b), 2 (c)]
        return gl.reshape(r, [t0.shape[0], 128])

    @gluon.jit
    def _ws_producer(a_ptr, stride_am, b_ptr, s_ptr, expert, pid_n, begin, end, N, nk,
                     stride_be, stride_bn, stride_se, stride_sn, a_smem, w_smem, ready, empty,
                     GROUP: gl.constexpr, BN: gl.constexpr, BT: gl.constexpr):
        """The worker warpgroup of the "ws" variant: per 128-column block i, into stage i % STAGES
        once the consumer has freed it: h's block by cp.async (its arrival tracked by the stage's
        ready barrier), the weights unpacked from words loaded one block ahead and stored in pair
        order (h comes permuted by permute_pairs to match)."""
        a_l: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])  # [BT, 128] bf16: 16-byte copies
        w_rl: gl.constexpr = gl.BlockedLayout([1, 4], [16, 2], [4, 1], [1, 0])  # [BN, 16] words
        stages: gl.constexpr = a_smem.type.shape[0]
        a_ptrs, ta_mask = _h_block_pointers(a_ptr, stride_am, begin, end, BT, a_l)
        w_ptrs, s_ptrs, n_mask = _word_pointers(b_ptr, s_ptr, expert, pid_n, N, stride_be, stride_bn, stride_se,
                                                stride_sn, BN, GROUP, w_rl)
        words = gl.load(w_ptrs, mask=n_mask[:, None], other=0)
        scales = gl.load(s_ptrs, mask=n_mask[:, None], other=0.0)
        for i in range(nk):
            s = i % stages
            mbarrier.wait(empty.index(s), (i // stages & 1) ^ 1)  # the wgmma that read stage s is done
            async_copy.async_copy_global_to_shared(a_smem.index(s), a_ptrs + i * 128, mask=ta_mask[:, None])
            async_copy.mbarrier_arrive(ready.index(s))  # counted until this thread's copies land
            t0, t1, t2, t3, t4, t5, t6, t7 = _unpack8(words, scales)
            more = i + 1 < nk  # the next block's words, in flight while this block's tiles are stored
            words = gl.load(w_ptrs + (i + 1) * 16, mask=n_mask[:, None] & more, other=0)
            scales = gl.load(s_ptrs + (i + 1) * (128 // GROUP), mask=n_mask[:, None] & more, other=0.0)
            w_smem.index(s).store(_pair_order_tile(t0, t1, t2, t3, t4, t5, t6, t7))  # one store per block
            hopper.fence_async_shared()  # the stores, before the consumer's wgmma reads them (async proxy)
            _cta_barrier()  # every producer thread has stored and registered its copies
            mbarrier.arrive(ready.index(s))

    @gluon.jit
    def _ws_consumer(a_smem, w_smem, ready, empty, nk, BN: gl.constexpr, BT: gl.constexpr):
        """The default partition of the "ws" variant: one wgmma of K = 128 per block, both operands
        in shared memory; each wait leaves the newest in flight and frees the stage before it."""
        acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BT, 16])
        stages: gl.constexpr = a_smem.type.shape[0]
        acc = gl.zeros([BN, BT], gl.float32, acc_l)
        for i in range(nk):
            s = i % stages
            mbarrier.wait(ready.index(s), i // stages & 1)
            tok = hopper.warpgroup_mma(w_smem.index(s), a_smem.index(s).permute((1, 0)), acc, is_async=True)
            acc = hopper.warpgroup_mma_wait(num_outstanding=1, deps=[tok])  # block i - 1's wgmma is done
            mbarrier.arrive(empty.index((i + stages - 1) % stages), pred=i > 0)
        return (hopper.warpgroup_mma_wait(num_outstanding=0, deps=[acc]),)  # a tuple: the partition's results

    @gluon.jit
    def _int4_down_ws_kernel(
        a_ptr, stride_am, b_ptr, s_ptr, c_ptr, c_rows_ptr, c_scale_ptr, stride_cm,
        tile_expert_ptr, tile_begin_ptr, tile_end_ptr, N, K,
        stride_be, stride_bn, stride_se, stride_sn,
        GROUP: gl.constexpr, BN: gl.constexpr, BT: gl.constexpr, STAGES: gl.constexpr, PRODUCER_REGS: gl.constexpr,
    ):
        """The "ws" variant (warp-specialized): a producer warpgroup stages h and the unpacked
        weights, the consumer warpgroup only issues wgmmas, so the unpack of block i + 1 overlaps
        block i's MMA by construction; stages handed over through ready/empty mbarriers (one
        arrival each per phase). Same tiles and output as the kernels above."""
        acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BT, 16])
        sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        pid_n = gl.program_id(0)
        pid_t = gl.program_id(1)
        begin = gl.load(tile_begin_ptr + pid_t)
        end = gl.load(tile_end_ptr + pid_t)
        if begin < end:
            expert = gl.load(tile_expert_ptr + pid_t).to(gl.int64)
            a_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BT, 128], sl)
            w_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BN, 128], sl)
            ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            for st in gl.static_range(STAGES):
                mbarrier.init(ready.index(st), count=1)
                mbarrier.init(empty.index(st), count=1)
            nk = K // 128
            (acc,) = gl.warp_specialize([
                (_ws_consumer, (a_smem, w_smem, ready, empty, nk, BN, BT)),
                (_ws_producer, (a_ptr, stride_am, b_ptr, s_ptr, expert, pid_n, begin, end, N, nk,
                                stride_be, stride_bn, stride_se, stride_sn, a_smem, w_smem, ready, empty, GROUP, BN, BT)),
            ], [4], [PRODUCER_REGS])
            _store_scaled_rows(acc, c_ptr, c_rows_ptr, c_scale_ptr, stride_cm, begin, end, pid_n, N, BN, BT, acc_l)


if HAS_GLUON:

    @gluon.jit
    def _work_item(w, n_blocks_n, tile_begin_ptr, tile_end_ptr):
        """Work item w of the persistent kernel: (pid_n, pid_t), the weight-row block fastest (as
        v3's grid: consecutive items share one token tile), and the tile's rows [begin, end)."""
        pid_t = w // n_blocks_n
        return w % n_blocks_n, pid_t, gl.load(tile_begin_ptr + pid_t), gl.load(tile_end_ptr + pid_t)

    @gluon.jit
    def _wsp_loader(a_ptr, stride_am, tile_begin_ptr, tile_end_ptr, n_items, n_blocks_n, nk, a_smem, ready, empty,
                    BT: gl.constexpr):
        """Loader warpgroup of "wsp": h's 128-column blocks by cp.async into the stage ring, up to
        STAGES blocks ahead of the consumer, for every work item of this program."""
        a_l: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])  # [BT, 128] bf16: 16-byte copies
        stages: gl.constexpr = a_smem.type.shape[0]
        it = 0
        for w in range(gl.program_id(0), n_items, gl.num_programs(0)):
            pid_n, pid_t, begin, end = _work_item(w, n_blocks_n, tile_begin_ptr, tile_end_ptr)
            if begin < end:
                a_ptrs, ta_mask = _h_block_pointers(a_ptr, stride_am, begin, end, BT, a_l)
                for i in range(nk):
                    s = it % stages
                    mbarrier.wait(empty.index(s), (it // stages & 1) ^ 1)
                    async_copy.async_copy_global_to_shared(a_smem.index(s), a_ptrs + i * 128, mask=ta_mask[:, None])
                    async_copy.mbarrier_arrive(ready.index(s))  # counted until this thread's copies land
                    _cta_barrier()  # every loader thread has registered its copies before the arrive
                    mbarrier.arrive(ready.index(s))
                    it += 1

    @gluon.jit
    def _wsp_unpacker(b_ptr, s_ptr, tile_expert_ptr, tile_begin_ptr, tile_end_ptr, n_items, n_blocks_n, nk, N,
                      stride_be, stride_bn, stride_se, stride_sn, w_smem, ready, empty,
                      GROUP: gl.constexpr, BN: gl.constexpr, U: gl.constexpr, NU: gl.constexpr):
        """Unpacking warpgroup U of NU in "wsp": the blocks whose ring position (counted over all
        of this program's blocks) is U mod NU; each block's words loaded one of its blocks ahead,
        unpacked and stored in pair order into the block's stage."""
        w_rl: gl.constexpr = gl.BlockedLayout([1, 4], [16, 2], [4, 1], [1, 0])  # [BN, 16] words
        stages: gl.constexpr = w_smem.type.shape[0]
        it0 = 0  # ring position of the item's first block
        for w in range(gl.program_id(0), n_items, gl.num_programs(0)):
            pid_n, pid_t, begin, end = _work_item(w, n_blocks_n, tile_begin_ptr, tile_end_ptr)
            if begin < end:
                expert = gl.load(tile_expert_ptr + pid_t).to(gl.int64)
                w_ptrs, s_ptrs, n_mask = _word_pointers(b_ptr, s_ptr, expert, pid_n, N, stride_be, stride_bn, stride_se,
                                                        stride_sn, BN, GROUP, w_rl)
                first = (U + NU - it0 % NU) % NU  # this warpgroup's first block of the item
                more = first < nk
                words = gl.load(w_ptrs + first * 16, mask=n_mask[:, None] & more, other=0)
                scales = gl.load(s_ptrs + first * (128 // GROUP), mask=n_mask[:, None] & more, other=0.0)
                for i in range(first, nk, NU):
                    it = it0 + i
                    s = it % stages
                    t0, t1, t2, t3, t4, t5, t6, t7 = _unpack8(words, scales)
                    more = i + NU < nk
                    words = gl.load(w_ptrs + (i + NU) * 16, mask=n_mask[:, None] & more, other=0)
                    scales = gl.load(s_ptrs + (i + NU) * (128 // GROUP), mask=n_mask[:, None] & more, other=0.0)
                    tile = _pair_order_tile(t0, t1, t2, t3, t4, t5, t6, t7)
                    mbarrier.wait(empty.index(s), (it // stages & 1) ^ 1)
                    w_smem.index(s).store(tile)
                    hopper.fence_async_shared()
                    _cta_barrier()
                    mbarrier.arrive(ready.index(s))
                it0 += nk

    @gluon.jit
    def _wsp_consumer(c_ptr, c_rows_ptr, c_scale_ptr, stride_cm, tile_begin_ptr, tile_end_ptr, n_items, n_blocks_n, nk, N,
                      a_smem, w_smem, ready, empty, BN: gl.constexpr, BT: gl.constexpr):
        """Default partition of "wsp": per work item, one wgmma of K = 128 per block (one left in
        flight, the stage before it freed), then the item's scaled row stores, while the loader
        and the unpacker already fill the stages of the next item."""
        acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BT, 16])
        stages: gl.constexpr = a_smem.type.shape[0]
        it = 0
        for w in range(gl.program_id(0), n_items, gl.num_programs(0)):
            pid_n, pid_t, begin, end = _work_item(w, n_blocks_n, tile_begin_ptr, tile_end_ptr)
            if begin < end:
                acc = gl.zeros([BN, BT], gl.float32, acc_l)
                for i in range(nk):
                    s = it % stages
                    mbarrier.wait(ready.index(s), it // stages & 1)
                    tok = hopper.warpgroup_mma(w_smem.index(s), a_smem.index(s).permute((1, 0)), acc, is_async=True)
                    acc = hopper.warpgroup_mma_wait(num_outstanding=1, deps=[tok])
                    mbarrier.arrive(empty.index((it + stages - 1) % stages), pred=i > 0)
                    it += 1
                acc = hopper.warpgroup_mma_wait(num_outstanding=0, deps=[acc])
                mbarrier.arrive(empty.index((it + stages - 1) % stages))
                _store_scaled_rows(acc, c_ptr, c_rows_ptr, c_scale_ptr, stride_cm, begin, end, pid_n, N, BN, BT, acc_l)

    @gluon.jit
    def _int4_down_wsp_kernel(
        a_ptr, stride_am, b_ptr, s_ptr, c_ptr, c_rows_ptr, c_scale_ptr, stride_cm,
        tile_expert_ptr, tile_begin_ptr, tile_end_ptr, N, K, n_items, n_blocks_n,
        stride_be, stride_bn, stride_se, stride_sn,
        GROUP: gl.constexpr, BN: gl.constexpr, BT: gl.constexpr, STAGES: gl.constexpr,
        UNPACKER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr, UNPACKERS: gl.constexpr,
    ):
        """The persistent "wsp" variant: one program per SM walks work items (weight-row block,
        token tile); warpgroups share a ring of STAGES stages: a loader (h by cp.async), UNPACKERS
        unpackers (weights into shared memory, alternate blocks when two) and the consumer
        (wgmmas, then the epilogue, which overlaps the next item's loads). ready[s] completes on
        two arrivals (the loader's, the block's unpacker's) and the copies; empty[s] on the
        consumer's."""
        sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        a_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BT, 128], sl)
        w_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BN, 128], sl)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for st in gl.static_range(STAGES):
            mbarrier.init(ready.index(st), count=2)
            mbarrier.init(empty.index(st), count=1)
        nk = K // 128
        # (Gluon takes no JIT function in a variable: the partitions are spelled out per branch)
        if UNPACKERS == 1:
            gl.warp_specialize([
                (_wsp_consumer, (c_ptr, c_rows_ptr, c_scale_ptr, stride_cm, tile_begin_ptr, tile_end_ptr, n_items,
                                 n_blocks_n, nk, N, a_smem, w_smem, ready, empty, BN, BT)),
                (_wsp_loader, (a_ptr, stride_am, tile_begin_ptr, tile_end_ptr, n_items, n_blocks_n, nk, a_smem, ready,
                               empty, BT)),
                (_wsp_unpacker, (b_ptr, s_ptr, tile_expert_ptr, tile_begin_ptr, tile_end_ptr, n_items, n_blocks_n, nk, N,
                                 stride_be, stride_bn, stride_se, stride_sn, w_smem, ready, empty, GROUP, BN, 0, 1)),
            ], [4, 4], [LOADER_REGS, UNPACKER_REGS])
        else:
            gl.warp_specialize([
                (_wsp_consumer, (c_ptr, c_rows_ptr, c_scale_ptr, stride_cm, tile_begin_ptr, tile_end_ptr, n_items,
                                 n_blocks_n, nk, N, a_smem, w_smem, ready, empty, BN, BT)),
                (_wsp_loader, (a_ptr, stride_am, tile_begin_ptr, tile_end_ptr, n_items, n_blocks_n, nk, a_smem, ready,
                               empty, BT)),
                (_wsp_unpacker, (b_ptr, s_ptr, tile_expert_ptr, tile_begin_ptr, tile_end_ptr, n_items, n_blocks_n, nk, N,
                                 stride_be, stride_bn, stride_se, stride_sn, w_smem, ready, empty, GROUP, BN, 0, 2)),
                (_wsp_unpacker, (b_ptr, s_ptr, tile_expert_ptr, tile_begin_ptr, tile_end_ptr, n_items, n_blocks_n, nk, N,
                                 stride_be, stride_bn, stride_se, stride_sn, w_smem, ready, empty, GROUP, BN, 1, 2)),
            ], [4, 4, 4], [LOADER_REGS, UNPACKER_REGS, UNPACKER_REGS])


def permute_pairs(a: torch.Tensor) -> torch.Tensor:
    """[R, K] -> [R, K], K % 8 == 0: column 8j + 2i + c <- column 8j + i + 4c (the "ws" kernels'
    column order: packed word j's nibbles i and i + 4 side by side)."""
    rows, k = a.shape
    return a.reshape(rows, k // 8, 2, 4).transpose(-1, -2).reshape(rows, k)


# The "ws" variants' launch: stages of h and of the unpacked weights (48 KB each at BN 64, BT 128),
# the producer warpgroup's registers, and the kernel's register cap (Triton then gives the
# consumer what the cap leaves: 2 x 128 = 136 for the producer + 120 for the consumer).
WS_VARIANTS = {
    "ws": dict(STAGES=2, PRODUCER_REGS=136, maxnreg=128),  # 96 KB, 128 registers: two CTAs per SM
    "ws4": dict(STAGES=4, PRODUCER_REGS=128, maxnreg=None),  # 192 KB: one CTA per SM, deeper pipeline
    # persistent, three warpgroups (loader, unpacker, consumer), one program per SM
    "wsp": dict(STAGES=4, UNPACKER_REGS=136, LOADER_REGS=88, UNPACKERS=1, maxnreg=168),
    "wsp2": dict(STAGES=4, UNPACKER_REGS=136, LOADER_REGS=56, UNPACKERS=2, maxnreg=128),  # two unpackers: 16 warps
}
VARIANTS = ("regs", "smem") + tuple(WS_VARIANTS)


def down_gluon(h: torch.Tensor, down_packed: torch.Tensor, down_scale: torch.Tensor, y: torch.Tensor,
               rows_out: torch.Tensor, sorted_weight: torch.Tensor, table, variant: str = "regs",
               max_programs: int | None = None) -> None:
    """v3's down launch in Gluon: h [rows, I] bf16 (columns permuted: by permute_k128 for "regs" and
    "smem", by permute_pairs for the "ws" variants), down packed [E, H, I/8] int32
    and scales [E, H, I/GROUP] bf16, y [rows, H] bf16 written at rows_out, table from
    tile_table(..., BLOCK_T, ...). variant: "regs" (weights in wgmma's operand registers), "smem"
    (unpacked into shared memory, overlapping the previous block's wgmma), or a warp-specialized
    one of WS_VARIANTS (a producer warpgroup unpacks, the consumer only issues wgmmas).
    max_programs: "wsp"'s number of programs (default: one per SM; tests take fewer, so that
    each program walks several items and the stage ring wraps across them)."""
    if not HAS_GLUON:
        raise RuntimeError(f"int4 down (Gluon): {WHY_NO_GLUON}")
    if variant not in VARIANTS:
        raise ValueError(f"int4 down (Gluon): variant {variant!r}, expected one of {VARIANTS}")
    n, k = down_packed.shape[1], down_packed.shape[2] * PACK_FACTOR
    if k % 128 or n % BLOCK_N:
        raise ValueError(f"int4 down (Gluon): intermediate {k} must be a multiple of 128 and hidden {n} of {BLOCK_N}")
    grid = (triton.cdiv(n, BLOCK_N), table[0].shape[0])
    args = (h, h.stride(0), down_packed, down_scale, y, rows_out, sorted_weight, y.stride(0),
            table[0], table[1], table[2], n, k,
            down_packed.stride(0), down_packed.stride(1), down_scale.stride(0), down_scale.stride(1))
    common = dict(GROUP=k // down_scale.shape[2], BN=BLOCK_N, BT=BLOCK_T, num_warps=4)
    if variant.startswith("wsp"):  # persistent: one program per SM over (weight-row block, token tile) items
        ws = dict(WS_VARIANTS[variant])
        cap = ws.pop("maxnreg")
        n_items = grid[0] * grid[1]
        programs = min(n_items, max_programs or torch.cuda.get_device_properties(h.device).multi_processor_count)
        if programs:
            _int4_down_wsp_kernel[(programs,)](*args[:13], n_items, grid[0], *args[13:], **ws, **common, maxnreg=cap)
    elif variant in WS_VARIANTS:
        ws = dict(WS_VARIANTS[variant])
        cap = ws.pop("maxnreg")
        _int4_down_ws_kernel[grid](*args, **ws, **common, **({"maxnreg": cap} if cap else {}))
    else:
        {"regs": _int4_down_g_kernel, "smem": _int4_down_gs_kernel}[variant][grid](*args, **common)
