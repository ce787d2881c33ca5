"""INT4 MoE down projection in Gluon (Triton's explicit-layout dialect): experiments beside v3.

Not used by int4_moe: each variant below is correct (tests against v3 and float64 on the GPU,
sm_90 builds on the CPU) and slower than v3 with its register cap (kernels/int4_moe.py), and is
kept with its measurements as the starting point of a faster kernel. What bounds v3 (Nsight
Compute, 2026-11-30 V1/V7): its loop is latency-bound (tensor pipe 37-46% active, L2 ~50%): each
warp alternates unpack and MMA, and waits on the words' global loads in the step that unpacks
them; Triton 3.6 stages only a dot's operands through shared memory.

Same math and tile table as v3's down kernel: C^T [BN, BT] = W [BN, K] @ A^T [K, BT], W the
packed checkpoint rows [E, N, K/8] int32 with bf16 scales [E, N, K/GROUP], A = h with permuted
columns, sorted rows r of the tile [begin, end) written to c[c_rows[r]] times c_scale[c_rows[r]].
Needs sm_90 (wgmma); Gluon has no interpreter.

Variants, down at 16K tokens on an H200 against v3's capped kernel (benchmarks/bench_moe_gluon.py):
- "regs" (U8, V4: 0.88x): the weights in wgmma's operand registers, eight async wgmmas per
  128-column block, one wait; ptxas still schedules the next block's unpack ahead of them.
  h permuted by permute_k128 (as v3): the same output as v3 bit for bit.
- "ws" (V4-V6: 0.71-0.75x): warp-specialized, a producer warpgroup stages h (cp.async) and the
  unpacked weights in shared memory, the consumer only issues wgmmas; two CTAs per SM.
- "wsp" (V5-V7: 0.62x): persistent, one program per SM, three warpgroups (loader, unpacker,
  consumer with the epilogue) on a 4-stage ring.
The warp-specialized ones are bounded by shared-memory traffic: with both operands staged, a
128-column block of 64 weight rows and 128 tokens moves 96 KB (h and weights written, both read
by the wgmma) per ~512 tensor-core cycles, 187 bytes per cycle against the SM's 128. Beating v3
this way needs larger tiles that reuse each staged byte more (128 x 256, two consumer warpgroups)
or h multicast by TMA across a cluster. They store the weights in "pair order" (permute_pairs:
nibbles i and i + 4 of a word side by side, as the unpack leaves them in one register), so they
sum in another order than v3 (within 1e-2).
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

from eagleforge.kernels.int4_moe import _UNPACK_PTX_TEXT, PACK_FACTOR

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
    def _program_tile(tile_begin_ptr, tile_end_ptr):
        """(pid_n, pid_t, begin, end) of a grid program: its weight-row block (axis 0, fastest, as
        v3's grid) and its token tile's rows [begin, end) (begin = end: a surplus tile)."""
        pid_t = gl.program_id(1)
        return gl.program_id(0), pid_t, gl.load(tile_begin_ptr + pid_t), gl.load(tile_end_ptr + pid_t)

    @gluon.jit
    def _block_words(w_ptrs, s_ptrs, n_mask, block, nk, GROUP: gl.constexpr):
        """Block `block`'s packed words [BN, 16] and their scales (masked off past the last block, nk)."""
        mask = n_mask[:, None] & (block < nk)
        return (gl.load(w_ptrs + block * 16, mask=mask, other=0),
                gl.load(s_ptrs + block * (128 // GROUP), mask=mask, other=0.0))

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
        pid_n, pid_t, begin, end = _program_tile(tile_begin_ptr, tile_end_ptr)
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
            words, scales = _block_words(w_ptrs, s_ptrs, n_mask, 0, nk, GROUP)
            t0, t1, t2, t3, t4, t5, t6, t7 = _unpack8(words, scales)
            words, scales = _block_words(w_ptrs, s_ptrs, n_mask, 1, nk, GROUP)
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
                words, scales = _block_words(w_ptrs, s_ptrs, n_mask, i + 2, nk, GROUP)
                acc, t0, t1, t2, t3, t4, t5, t6, t7 = hopper.warpgroup_mma_wait(
                    num_outstanding=0, deps=[tok, t0, t1, t2, t3, t4, t5, t6, t7])
                _cta_barrier()  # no warp still reads block i's stage
                async_copy.async_copy_global_to_shared(a_i, a_ptrs + (i + 2) * 128, mask=ta_mask[:, None] & (i + 2 < nk))
                async_copy.commit_group()
                t0, t1, t2, t3, t4, t5, t6, t7 = u0, u1, u2, u3, u4, u5, u6, u7
            async_copy.wait_group(0)
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
    def _stage_ring(STAGES: gl.constexpr, BN: gl.constexpr, BT: gl.constexpr, READY_ARRIVALS: gl.constexpr):
        """The warp-specialized kernels' ring of STAGES stages: h's blocks [BT, 128] and the weights'
        [BN, 128] in shared memory (128-byte swizzle, as wgmma reads them), and per stage a ready
        barrier (READY_ARRIVALS arrivals, plus the copies counted on it) and an empty barrier (the
        consumer's one arrival)."""
        sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        a_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BT, 128], sl)
        w_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BN, 128], sl)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for st in gl.static_range(STAGES):
            mbarrier.init(ready.index(st), count=READY_ARRIVALS)
            mbarrier.init(empty.index(st), count=1)
        return a_smem, w_smem, ready, empty

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
        words, scales = _block_words(w_ptrs, s_ptrs, n_mask, 0, nk, GROUP)
        for i in range(nk):
            s = i % stages
            mbarrier.wait(empty.index(s), (i // stages & 1) ^ 1)  # the wgmma that read stage s is done
            async_copy.async_copy_global_to_shared(a_smem.index(s), a_ptrs + i * 128, mask=ta_mask[:, None])
            async_copy.mbarrier_arrive(ready.index(s))  # counted until this thread's copies land
            t0, t1, t2, t3, t4, t5, t6, t7 = _unpack8(words, scales)
            words, scales = _block_words(w_ptrs, s_ptrs, n_mask, i + 1, nk, GROUP)  # in flight while this block is stored
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
        pid_n, pid_t, begin, end = _program_tile(tile_begin_ptr, tile_end_ptr)
        if begin < end:
            expert = gl.load(tile_expert_ptr + pid_t).to(gl.int64)
            a_smem, w_smem, ready, empty = _stage_ring(STAGES, BN, BT, 1)
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
                      GROUP: gl.constexpr, BN: gl.constexpr):
        """Unpacking warpgroup of "wsp": each block's weights, words loaded one block ahead,
        unpacked and stored in pair order into the block's stage. (A second unpacker on
        alternate blocks changed nothing: 2026-11-30 V6.)"""
        w_rl: gl.constexpr = gl.BlockedLayout([1, 4], [16, 2], [4, 1], [1, 0])  # [BN, 16] words
        stages: gl.constexpr = w_smem.type.shape[0]
        it = 0
        for w in range(gl.program_id(0), n_items, gl.num_programs(0)):
            pid_n, pid_t, begin, end = _work_item(w, n_blocks_n, tile_begin_ptr, tile_end_ptr)
            if begin < end:
                expert = gl.load(tile_expert_ptr + pid_t).to(gl.int64)
                w_ptrs, s_ptrs, n_mask = _word_pointers(b_ptr, s_ptr, expert, pid_n, N, stride_be, stride_bn, stride_se,
                                                        stride_sn, BN, GROUP, w_rl)
                words, scales = _block_words(w_ptrs, s_ptrs, n_mask, 0, nk, GROUP)
                for i in range(nk):
                    s = it % stages
                    t0, t1, t2, t3, t4, t5, t6, t7 = _unpack8(words, scales)
                    words, scales = _block_words(w_ptrs, s_ptrs, n_mask, i + 1, nk, GROUP)
                    tile = _pair_order_tile(t0, t1, t2, t3, t4, t5, t6, t7)
                    mbarrier.wait(empty.index(s), (it // stages & 1) ^ 1)
                    w_smem.index(s).store(tile)
                    hopper.fence_async_shared()
                    _cta_barrier()
                    mbarrier.arrive(ready.index(s))
                    it += 1

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
        UNPACKER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr,
    ):
        """The persistent "wsp" variant: one program per SM walks work items (weight-row block,
        token tile); three warpgroups share a ring of STAGES stages: a loader (h by cp.async), an
        unpacker (the weights into shared memory) and the consumer (wgmmas, then the epilogue,
        which overlaps the next item's loads). ready[s] completes on two arrivals (loader,
        unpacker) and the copies; empty[s] on the consumer's."""
        a_smem, w_smem, ready, empty = _stage_ring(STAGES, BN, BT, 2)
        nk = K // 128
        gl.warp_specialize([
            (_wsp_consumer, (c_ptr, c_rows_ptr, c_scale_ptr, stride_cm, tile_begin_ptr, tile_end_ptr, n_items, n_blocks_n,
                             nk, N, a_smem, w_smem, ready, empty, BN, BT)),
            (_wsp_loader, (a_ptr, stride_am, tile_begin_ptr, tile_end_ptr, n_items, n_blocks_n, nk, a_smem, ready, empty, BT)),
            (_wsp_unpacker, (b_ptr, s_ptr, tile_expert_ptr, tile_begin_ptr, tile_end_ptr, n_items, n_blocks_n, nk, N,
                             stride_be, stride_bn, stride_se, stride_sn, w_smem, ready, empty, GROUP, BN)),
        ], [4, 4], [LOADER_REGS, UNPACKER_REGS])


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
    # persistent, three warpgroups (loader, unpacker, consumer), one program per SM
    "wsp": dict(STAGES=4, UNPACKER_REGS=136, LOADER_REGS=88, maxnreg=168),
}
VARIANTS = ("regs",) + tuple(WS_VARIANTS)


def down_gluon(h: torch.Tensor, down_packed: torch.Tensor, down_scale: torch.Tensor, y: torch.Tensor,
               rows_out: torch.Tensor, sorted_weight: torch.Tensor, table, variant: str = "regs",
               max_programs: int | None = None) -> None:
    """v3's down launch in Gluon: h [rows, I] bf16 (columns permuted: by permute_k128 for "regs",
    by permute_pairs for the warp-specialized WS_VARIANTS), down packed [E, H, I/8] int32 and
    scales [E, H, I/GROUP] bf16, y [rows, H] bf16 written at rows_out, table from
    tile_table(..., BLOCK_T, ...). variant: "regs", "ws" or "wsp" (the module docstring).
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
        _int4_down_g_kernel[grid](*args, **common)
