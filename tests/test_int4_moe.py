"""INT4 MoE (kernels/int4_moe.py) against a float64 formula written here.

Fixtures are packed by compressed-tensors' pack_to_int32 (the checkpoint's own layout), the
reference dequantizes with q * scale in float64 from the unpacked integers, and routes by
looping over (token, slot) pairs: nothing shared with the code under test. Routings have odd
token counts per expert, experts with no token, a rank that owns only some experts (EP), and
input dims of 3 and 2 scale groups (96 = 3 x 32, 64 = 2 x 32) so group boundaries fall inside
and across BLOCK_K.

The Triton kernels run on the CPU under TRITON_INTERPRET=1 in a subprocess (the variable must be
set before triton is imported), and directly on CUDA where there is a GPU: the kernels with their
unpack in Triton ops ("s") and in inline PTX ("sa", CUDA only), each on every routing case (dims
that are multiples of 128). The unpacks alone are checked against compressed-tensors' own
unpack_from_int32.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32

from eagleforge.kernels import int4_moe

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # kimi_shaped: the benchmarks' Kimi-shaped model

INNER = os.environ.get("EAGLEFORGE_TRITON_INNER") == "1"
HAS_CUDA = torch.cuda.is_available()


def make_experts(E: int, I: int, H: int, seed: int, device="cpu", group: int = 32):
    """Random INT4 experts, scale groups of `group` inputs: (packed/scale tensors dict, float64
    dequantized gate, up, down)."""
    g = torch.Generator().manual_seed(seed)
    out, dense = {}, {}
    for proj, (rows, cols) in {"gate": (I, H), "up": (I, H), "down": (H, I)}.items():
        q = torch.randint(-8, 8, (E, rows, cols), generator=g, dtype=torch.int8)
        scale = (torch.rand(E, rows, cols // group, generator=g) * 0.04 + 0.01).to(torch.bfloat16)
        out[f"{proj}_packed"] = torch.stack([pack_to_int32(q[e], 4) for e in range(E)]).to(device)
        out[f"{proj}_scale"] = scale.to(device)
        dense[proj] = q.double() * scale.double().repeat_interleave(group, dim=-1)  # W[o, i] = q * scale[o, i // group]
    return out, dense


def routing(N: int, k: int, E: int, empty: tuple[int, ...], seed: int):
    """ids [N, k] distinct per token, never the `empty` experts; weights [N, k] fp32."""
    g = torch.Generator().manual_seed(seed)
    allowed = torch.tensor([e for e in range(E) if e not in empty])
    ids = torch.stack([allowed[torch.randperm(len(allowed), generator=g)[:k]] for _ in range(N)])
    weights = torch.rand(N, k, generator=g) + 0.1
    return ids, weights


def formula(x, weights, ids, dense, lo: int = 0, hi: int | None = None) -> torch.Tensor:
    """float64 [N, H]: sum over slots of w * down(silu(gate x) * up x), experts [lo, hi) only."""
    hi = dense["gate"].shape[0] if hi is None else hi
    x = x.double()
    out = torch.zeros(x.shape, dtype=torch.float64)
    for n in range(ids.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[n, j])
            if lo <= e < hi:
                h = F.silu(dense["gate"][e] @ x[n]) * (dense["up"][e] @ x[n])
                out[n] += float(weights[n, j]) * (dense["down"][e] @ h)
    return out


def args_of(packs, lo=0, hi=None):
    names = ["gate_packed", "gate_scale", "up_packed", "up_scale", "down_packed", "down_scale"]
    return [packs[n][lo:hi] .contiguous() for n in names]


def rel_err(a, b) -> float:
    return float((a.double().cpu() - b.double().cpu()).norm() / b.double().cpu().norm())


@pytest.mark.parametrize("N,k,E,I,H", [(13, 3, 7, 64, 96), (5, 2, 4, 96, 64)])
def test_reference_matches_formula(N, k, E, I, H):
    packs, dense = make_experts(E, I, H, seed=N)
    ids, weights = routing(N, k, E, empty=(1,), seed=N)
    x = torch.randn(N, H, dtype=torch.float64)
    got = int4_moe.moe_reference(x, weights, ids, *args_of(packs))
    assert rel_err(got, formula(x, weights, ids, dense)) < 1e-12


@pytest.mark.parametrize("rows,E,block_m", [(37, 5, 4), (8, 3, 16), (100, 9, 7)])
def test_tile_table_covers_every_row_once(rows, E, block_m):
    g = torch.Generator().manual_seed(rows)
    cuts = torch.sort(torch.randint(0, rows + 1, (E - 1,), generator=g)).values
    bounds = [0] + cuts.tolist() + [rows]
    counts = torch.tensor([bounds[e + 1] - bounds[e] for e in range(E)] + [0])
    expert, begin, end = int4_moe.tile_table(counts, E, block_m, rows)
    seen = []
    for e, b, t in zip(expert.tolist(), begin.tolist(), end.tolist()):
        if b < t:
            assert t - b <= block_m and bounds[e] <= b and t <= bounds[e + 1], (e, b, t, bounds)
            seen.extend(range(b, t))
    assert sorted(seen) == list(range(rows))


def test_grouped_mm_paths_match_formula():
    """Dequantize + torch._grouped_mm (bf16, CPU here): whole expert set and an EP slice."""
    N, k, E, I, H = 11, 3, 6, 64, 96
    packs, dense = make_experts(E, I, H, seed=3)
    ids, weights = routing(N, k, E, empty=(2, 4), seed=3)
    x = torch.randn(N, H).to(torch.bfloat16)
    got = int4_moe.int4_moe_grouped_mm(x, weights, ids, *args_of(packs))
    assert rel_err(got, formula(x, weights, ids, dense)) < 2e-2
    got = int4_moe.int4_moe_grouped_mm(x, weights, ids, *args_of(packs, 3, 6), expert_start=3)
    assert rel_err(got, formula(x, weights, ids, dense, 3, 6)) < 2e-2


def test_rejects_bad_shapes():
    packs, _ = make_experts(3, 64, 96, seed=0)
    x = torch.randn(4, 64, dtype=torch.bfloat16)  # hidden 64, weights expect 96
    ids, weights = routing(4, 2, 3, empty=(), seed=0)
    with pytest.raises(ValueError, match="hidden 64"):
        int4_moe._check(x, weights, ids, *args_of(packs))
    x = torch.randn(4, 96, dtype=torch.bfloat16)
    args = args_of(packs)
    args[1] = args[1].half()  # gate scale in fp16: the PTX unpack would read it as bf16
    with pytest.raises(ValueError, match="gate: scale torch.float16"):
        int4_moe._check(x, weights, ids, *args)
    args = args_of(packs)
    args[3] = args[3].repeat_interleave(3, -1)[..., :1].contiguous()  # up: one group of 96, gate: three of 32
    with pytest.raises(ValueError, match="up scale"):
        int4_moe._check(x, weights, ids, *args)


# ---------------------------------------------------------------------------- Triton


def _triton_cases():
    # (N, k, E, I, H, empty experts, EP range, scale group, K per dot)
    return [  # the kernels work in blocks of 128 columns; each case another K per dot (NIB 4, 2, 1, 8)
        (13, 3, 7, 128, 256, (2,), (0, 7), 32, 64),  # two 128-blocks along H; expert 2 has no token
        (29, 4, 9, 256, 128, (0, 8), (0, 9), 16, 32),  # two blocks along I (the permuted h spans both); groups of 16
        (17, 2, 8, 128, 384, (5,), (3, 8), 64, 16),  # EP: this rank owns experts 3..7 of 8; groups of 64
        (1, 1, 3, 128, 128, (), (0, 3), 128, 128),  # one token, one block, one group per block
    ]


TRITON_IMPLS = ["s", "sa"]  # the unpack in Triton ops / in inline PTX
TRITON_CASES = [(impl, case) for impl in TRITON_IMPLS for case in _triton_cases()]


@pytest.mark.skipif(not (INNER or HAS_CUDA), reason="runs in the TRITON_INTERPRET=1 subprocess (test_triton_interpreted) or on CUDA")
@pytest.mark.parametrize("impl,case", TRITON_CASES, ids=lambda c: c if isinstance(c, str) else f"N{c[0]}k{c[1]}E{c[2]}I{c[3]}H{c[4]}ep{c[6][0]}g{c[7]}K{c[8]}")
def test_triton_matches_formula(impl, case, monkeypatch):
    N, k, E, I, H, empty, (lo, hi), group, dot_k = case
    device = "cuda" if HAS_CUDA and not INNER else "cpu"
    if impl == "sa" and INNER:
        pytest.skip("inline PTX (v3's 'sa' unpack) does not run under the Triton interpreter; it runs on CUDA")
    # one unpack and one K per dot
    config = (impl, 16 if INNER else 64, 32 if INNER else 64, dot_k, 4, 1 if INNER else 2)
    down = config + ((168,) if impl == "sa" else ())  # down's register cap (three CTAs per SM), as launched
    monkeypatch.setattr(int4_moe, "INTERPRET_CONFIGS", [config])
    monkeypatch.setattr(int4_moe, "V3_CONFIGS", {"large": [config], "small": [config]})
    monkeypatch.setattr(int4_moe, "V3_DOWN_CONFIGS", {"large": [down], "small": [down]})
    monkeypatch.setattr(int4_moe, "_CHOSEN", {})
    packs, dense = make_experts(E, I, H, seed=N, group=group)
    ids, weights = routing(N, k, E, empty, seed=N)
    x = torch.randn(N, H, generator=torch.Generator().manual_seed(N)).to(torch.bfloat16)
    got = int4_moe.int4_moe(x.to(device), weights.to(device), ids.to(device), *[t.to(device) for t in args_of(packs, lo, hi)],
                            expert_start=lo)
    want = formula(x, weights, ids, dense, lo, hi)
    assert got.dtype == torch.float32 and got.shape == (N, H)
    assert rel_err(got, want) < 1.5e-2, rel_err(got, want)
    # bf16 inputs, fp32 accumulation, h and each slot's output rounded to bf16: within a small
    # factor of the torch bf16 path (seen 1.2-1.5x on one-token cases, where few roundings decide)
    torch_bf16 = int4_moe.moe_reference(x, weights, ids, *[t.cpu() for t in args_of(packs, lo, hi)], expert_start=lo)
    assert rel_err(got, want) < 3 * rel_err(torch_bf16, want) + 1e-3


def test_permute_k128_and_supported_dims():
    """permute_k128 puts column 8j + n of each 128-block at 16n + j; dims the kernels do not take
    are refused with the dims named (`supports` says which)."""
    a = torch.arange(2 * 256).view(2, 256)
    p = int4_moe.permute_k128(a)
    for block, n, j in ((0, 0, 1), (0, 3, 5), (1, 7, 15), (1, 2, 0)):
        assert int(p[1, 128 * block + 16 * n + j]) == int(a[1, 128 * block + 8 * j + n])
    assert sorted(p[0].tolist()) == a[0].tolist()
    packs, _ = make_experts(3, 64, 96, seed=0)
    x = torch.randn(4, 96, dtype=torch.bfloat16)
    ids, weights = routing(4, 2, 3, empty=(), seed=0)
    assert not int4_moe.supports(96, 64, 32, 32)
    assert int4_moe.supports(7168, 2048, 32, 32) and not int4_moe.supports(7168, 2048, 32, 64)
    with pytest.raises(ValueError, match="hidden 96 and intermediate 64"):
        int4_moe.int4_moe(x, weights, ids, *args_of(packs))


# pointer types of the kernels' arguments for build_sm90 (others default to *bf16)
V3_PTRS = {**dict.fromkeys(("b_ptr", "b2_ptr", "a_rows_ptr", "c_rows_ptr", "tile_expert_ptr", "tile_begin_ptr", "tile_end_ptr",
                            "word_group_ptr"), "*i32"), "c_scale_ptr": "*fp32"}


def _v3_consts(kernel: str, impl: str, block_t: int, block_n: int, dot_k: int) -> dict:
    """The v3 kernel's constexprs as _launch sets them for a gate_up or down launch."""
    import triton.language as tl

    gate_up = kernel == "gate_up"
    return dict(GROUP=32, BLOCK_N=block_n, GATHER_A=gate_up, GATE_UP=gate_up, SCATTER_C=not gate_up, DOT_DTYPE=tl.bfloat16,
                BLOCK_T=block_t, PERMUTE_N=gate_up, ASM=impl == "sa", NIB=dot_k // 16)


@pytest.mark.skipif(INNER, reason="compiles, does not run: outside the interpreter subprocess")
@pytest.mark.parametrize("kernel,impl,dot_k,warps,stages", [("gate_up", "sa", 64, 4, 3), ("gate_up", "s", 128, 4, 2),
                                                          ("down", "sa", 32, 4, 2), ("down", "s", 16, 4, 3)])
def test_moe_kernels_build_for_sm90(kernel, impl, dot_k, warps, stages):
    """The kernels compiled ahead of time for sm_90 (no GPU needed: Triton's own ptxas), as the
    configs launch them (dot_k: the K per dot). The interpreter runs a
    kernel as Python and does not see compile-time errors (a branch returning two shapes once
    passed every interpreted test and failed here)."""
    pytest.importorskip("triton")
    from triton_build import build_sm90

    compiled = build_sm90(int4_moe._int4_moe_v3_kernel, _v3_consts(kernel, impl, 128, 64, dot_k), V3_PTRS, num_warps=warps, num_stages=stages)
    assert compiled.asm["cubin"] and "wgmma" in compiled.asm["ptx"]


@pytest.mark.skipif(INNER, reason="compiles, does not run: outside the interpreter subprocess")
def test_down_kernel_fits_three_ctas_per_sm_without_spills():
    """v3's down as its first config launches it on the GPU (V3_DOWN_CONFIGS: the 168-register cap
    that fits three 4-warp CTAs per SM): the cap holds, it spills (next to) nothing, and three
    CTAs' shared memory fits the H200's 227 KB."""
    pytest.importorskip("triton")
    from triton_build import build_sm90, resource_usage

    impl, block_t, block_n, dot_k, warps, stages, cap = int4_moe.V3_DOWN_CONFIGS["large"][0]
    compiled = build_sm90(int4_moe._int4_moe_v3_kernel, _v3_consts("down", impl, block_t, block_n, dot_k), V3_PTRS,
                          num_warps=warps, num_stages=stages, maxnreg=cap)
    usage = resource_usage(compiled)
    # spill stack: 0 bytes in Triton 3.6's build (the device's, as measured), 32 in 3.9's
    assert usage["REG"] <= cap and usage.get("STACK", 0) <= 32, usage
    assert 3 * (compiled.metadata.shared + 1024) <= 227 * 1024, compiled.metadata.shared


@pytest.mark.skipif(INNER, reason="compiles, does not run: outside the interpreter subprocess")
@pytest.mark.parametrize("out_dtype", ["*fp32", "*bf16"])
def test_combine_kernel_builds_for_sm90(out_dtype):
    """The slot combine as combine_slots launches it (Kimi: k 8, H 7168 in blocks of 1024)."""
    pytest.importorskip("triton")
    from triton_build import build_sm90

    compiled = build_sm90(int4_moe._combine_slots_kernel, dict(K=8, HAS_ADD=True, BLOCK_H=1024),
                          {"inv_ptr": "*i32", "out_ptr": out_dtype}, num_warps=4)
    assert compiled.asm["cubin"]


@pytest.mark.skipif(not (INNER or HAS_CUDA), reason="runs in the TRITON_INTERPRET=1 subprocess (test_triton_interpreted) or on CUDA")
@pytest.mark.parametrize("asm", [False, True], ids=["triton_ops", "ptx"])
@pytest.mark.parametrize("group", [32, 64])
def test_triton_unpack_matches_compressed_tensors(group, asm):
    """v3's unpacks (nibble tile n of the 16 words of a 128-column block, times each word's group
    scale; in Triton ops and in inline PTX), element by element against compressed-tensors'
    unpack_from_int32 times the scale, on all 16 nibble values and two group sizes."""
    import triton
    import triton.language as tl

    if asm and INNER:
        pytest.skip("inline PTX does not run under the Triton interpreter; it runs on CUDA")

    @triton.jit
    def unpack_kernel(b_ptr, s_ptr, wg_ptr, out_ptr, BN: tl.constexpr, GROUP: tl.constexpr, DTYPE: tl.constexpr,
                      ASM: tl.constexpr):
        offs_n = tl.arange(0, BN)
        offs_j = tl.arange(0, 16)
        words = tl.load(b_ptr + offs_n[:, None] * 16 + offs_j[None, :])  # [BN, 16]: one 128-column block
        scale_w = int4_moe._word_scales(s_ptr, offs_n * (128 // GROUP), 0, offs_n < BN, tl.load(wg_ptr + offs_j)[None, :], GROUP)
        if ASM:
            tiles = int4_moe._nibbles_times_scale_asm(words, scale_w)
        for n in tl.static_range(8):  # nibble n of word j: column 8j + n
            if ASM:
                w = tiles[n]
            else:
                w = int4_moe._nibble_times_scale(words, n, scale_w, DTYPE == tl.float32)
            tl.store(out_ptr + offs_n[:, None] * 128 + 8 * offs_j[None, :] + n, w.to(tl.float32))

    device = "cuda" if HAS_CUDA and not INNER else "cpu"
    BN, K = 8, 128
    g = torch.Generator().manual_seed(group)
    q = torch.randint(-8, 8, (BN, K), generator=g, dtype=torch.int8)
    q[0, :16] = torch.arange(-8, 8, dtype=torch.int8)  # every nibble value once
    packed = pack_to_int32(q, 4)
    scale = (torch.rand(BN, K // group, generator=g) + 0.5).to(torch.bfloat16)
    want = unpack_from_int32(packed, 4, torch.Size([BN, K])).double() * scale.double().repeat_interleave(group, -1)
    assert torch.equal(unpack_from_int32(packed, 4, torch.Size([BN, K])), q)  # the fixture's own layout
    out = torch.empty(BN, K, device=device)
    unpack_kernel[(1,)](packed.to(device), scale.to(device), int4_moe._word_group_table(group, torch.device(device)), out, BN=BN,
                        GROUP=group, DTYPE=tl.float32 if INNER else tl.bfloat16, ASM=asm)
    # q * scale is exact in fp32 (4-bit x 8-bit mantissas); on the GPU it is rounded to bf16 once
    tol = 0 if INNER else 2 ** -8
    assert float(((out.double().cpu() - want).abs() / want.abs().clamp(min=1e-30)).max()) <= tol


@pytest.mark.skipif(not (INNER or HAS_CUDA), reason="runs in the TRITON_INTERPRET=1 subprocess (test_triton_interpreted) or on CUDA")
@pytest.mark.parametrize("with_add", [False, True], ids=["routed", "plus_shared"])
def test_triton_combine_slots_matches_reference(with_add):
    """The slot combine: each token's local slots summed through the inverse sort order, slots
    of other ranks' experts skipped (their rows never written: NaN here, so reading one shows),
    an [N, H] add (the shared expert) included, bf16 out; against the torch reference and a
    plain loop over slots in float64."""
    device = "cuda" if HAS_CUDA and not INNER else "cpu"
    gen = torch.Generator().manual_seed(11)
    n, k, hidden, num_local, start = 37, 4, 1100, 5, 3  # hidden: not a power of two, > one 1024 block
    ids = torch.randint(0, 12, (n, k), generator=gen)
    order, counts = int4_moe.sort_by_expert(ids, num_local, start)
    local_rows = int(counts[:num_local].sum())
    y = torch.randn(n * k, hidden, generator=gen).to(torch.bfloat16)
    y[local_rows:] = float("nan")  # the tail: other ranks' pairs, never written by the down kernel
    add = torch.randn(n, hidden, generator=gen).to(torch.bfloat16) if with_add else None
    inv = int4_moe.inverse_local_order(order, counts, num_local)
    assert int((inv >= 0).sum()) == local_rows
    args = (y.to(device), inv.to(device), k, None if add is None else add.to(device))
    got32, got = int4_moe.combine_slots(*args, torch.float32), int4_moe.combine_slots(*args, torch.bfloat16)
    ref32 = int4_moe.combine_slots_reference(y, inv, k, add, torch.float32)
    ref = ref32.to(torch.bfloat16)
    assert torch.equal(got32.cpu(), ref32)  # one fp32 sum in slot order: the same bits
    want = torch.zeros(n, hidden, dtype=torch.float64)
    for pair in range(n * k):
        if start <= int(ids.flatten()[pair]) < start + num_local:
            want[pair // k] += y[int(inv[pair])].double()
    if add is not None:
        want += add.double()
    assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
    if INNER:  # the interpreter converts fp32 -> bf16 by truncation (seen: -4.2734 -> -4.25): one ulp
        assert bool(((got.float() - ref.float()).abs() <= ref.float().abs() * 2 ** -7).all())
    else:  # round to nearest on the GPU: the same bits
        assert torch.equal(got.cpu(), ref)
    assert float((ref.double() - want).abs().max()) <= 2 ** -7 * float(want.abs().max())


@pytest.mark.skipif(INNER, reason="this is the outer launcher")
@pytest.mark.skipif(HAS_CUDA, reason="CUDA is present: the compiled kernels run these cases directly (and Triton 3.6's "
                    "interpreter failed under numpy 2.5)")
def test_triton_interpreted():
    """This file's Triton tests again, in a subprocess under TRITON_INTERPRET=1 (CPU)."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", EAGLEFORGE_TRITON_INNER="1", OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", str(Path(__file__)),
                             "-k", "triton_"], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    n_cases = len(TRITON_CASES) - len(_triton_cases()) + 2 + 2  # sa skipped; + the Triton-ops unpacks + the slot combines
    assert f"{n_cases} passed" in result.stdout, result.stdout[-2000:]


# ---------------------------------------------------------------------------- model integration


@pytest.mark.parametrize("T,chunk", [(23, 5), (16, 16), (9, 100)])
def test_prefill_attention_chunks_match_explicit_softmax(T, chunk):
    """Chunked causal attention (bottom-right aligned per chunk) vs softmax(q k^T) v written out."""
    from eagleforge.extract.native.model import prefill_attention

    B, n, d_qk, d_v, scale = 2, 3, 24, 16, 0.3
    q, k = torch.randn(B, T, n, d_qk, dtype=torch.float64), torch.randn(B, T, n, d_qk, dtype=torch.float64)
    v = torch.randn(B, T, n, d_v, dtype=torch.float64)
    scores = torch.einsum("btnd,bsnd->bnts", q, k) * scale
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    want = torch.einsum("bnts,bsnd->btnd", scores.softmax(-1), v)
    got = prefill_attention(q, k, v, scale, chunk_tokens=chunk)
    assert got.shape == (B, T, n, d_v)
    assert float((got - want).abs().max()) < 1e-12


def test_prefill_attention_backend_checked_and_cpu_equal():
    """Every backend is the same math on the CPU; an unknown one is refused with its name."""
    from eagleforge.extract.native.model import prefill_attention

    q, k, v = torch.randn(1, 11, 2, 8), torch.randn(1, 11, 2, 8), torch.randn(1, 11, 2, 6)
    base = prefill_attention(q, k, v, 0.3, chunk_tokens=4, backend="auto")
    for backend in ("flash", "cudnn"):
        torch.testing.assert_close(prefill_attention(q, k, v, 0.3, chunk_tokens=4, backend=backend), base)
    with pytest.raises(ValueError, match="'fa9'"):
        prefill_attention(q, k, v, 0.3, backend="fa9")


@pytest.mark.gpu
@pytest.mark.parametrize("backend,chunk", [("auto", None), ("auto", 300), ("flash", None), ("flash", 300)])
def test_prefill_attention_cuda_backends_match_float64(backend, chunk):
    """MLA head dims (q/k 192, v 128), odd T, bf16 on CUDA, each kernel choice (cuDNN in one
    call with v unpadded, FA2 in one call or in bottom-right aligned chunks) against the float64
    softmax; auto must not have fallen back from cuDNN."""
    from eagleforge.extract.native.model import prefill_attention

    T, n, scale = 1031, 4, 192**-0.5
    g = torch.Generator().manual_seed(5)
    q, k = torch.randn(1, T, n, 192, generator=g).double(), torch.randn(1, T, n, 192, generator=g).double()
    v = torch.randn(1, T, n, 128, generator=g).double()
    scores = torch.einsum("btnd,bsnd->bnts", q, k) * scale
    want = torch.einsum("bnts,bsnd->btnd", scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1),
                                                               float("-inf")).softmax(-1), v)
    from eagleforge.extract.native.model import _cudnn_refused

    _cudnn_refused.clear()
    got = prefill_attention(*(x.cuda().bfloat16() for x in (q, k, v)), scale, chunk_tokens=chunk, backend=backend)
    assert got.shape == (1, T, n, 128)
    err = float((got.cpu().double() - want).abs().max() / want.abs().max())
    assert err < 2e-2, f"{backend}: max relative error {err:.2e}"
    assert not _cudnn_refused, f"cuDNN refused {_cudnn_refused}"


def test_routed_experts_backends_agree():
    """routed_experts_forward's loop and grouped_mm backends on a random Kimi-shaped toy layer (bf16)."""
    from kimi_shaped import build_bench_model, tiny_args

    from eagleforge.extract.native import model as M

    model = build_bench_model(tiny_args(), device="cpu", seed=1)
    moe = model.model.layers[1].mlp
    x = torch.randn(19, model.args.hidden_size).to(torch.bfloat16)
    weights, ids = moe.gate(x)
    ex = moe.experts
    packs = [getattr(ex, f"{p}_{part}") for p in ex.PROJS for part in ("packed", "scale")]
    want = int4_moe.moe_reference(x.double(), weights, ids, *packs)  # float64 from the same packed weights
    outs = {}
    for backend in ("loop", "grouped_mm"):
        ex.backend = backend  # target.moe_backend
        try:
            outs[backend] = M.routed_experts_forward(x, weights, ids, ex)
        finally:
            ex.backend = "auto"
        assert rel_err(outs[backend], want) < 2e-2, (backend, rel_err(outs[backend], want))


@pytest.mark.gpu
def test_router_bf16_gemm_with_fp32_output_matches_the_fp32_gemm():
    """The router's CUDA path (bf16 x bf16 GEMM, fp32 output) against the fp32 GEMM it replaces,
    at the real width (7168 x 384) and an odd token count: scores to fp32 rounding, the same
    experts chosen wherever the choice is not a near tie."""
    from kimi_shaped import kimi_args

    from eagleforge.extract.native.model import _MM_OUT_DTYPE, Router

    assert _MM_OUT_DTYPE, "torch.mm(out_dtype=) missing: the router falls back to the fp32 GEMM"
    args = kimi_args(2)
    gen = torch.Generator().manual_seed(5)
    router = Router(args, torch.bfloat16).cuda()
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=gen) * args.hidden_size**-0.5)
        router.e_score_correction_bias.copy_(torch.rand(args.n_routed_experts, generator=gen) * 0.01)
    x = torch.randn(4099, args.hidden_size, generator=gen).to("cuda", torch.bfloat16)
    fast = router.logits(x)
    ref = torch.nn.functional.linear(x.float(), router.weight.float())
    assert fast.dtype == torch.float32
    assert float((fast - ref).abs().max()) <= 1e-5 * float(ref.abs().max())
    weights, ids = router(x)
    scores = ref.sigmoid()
    ref_ids = (scores + router.e_score_correction_bias).topk(args.num_experts_per_tok, dim=-1).indices
    same = (ids.sort(-1).values == ref_ids.sort(-1).values).all(-1).float().mean()
    if args.n_group <= 1:
        assert same > 0.999, float(same)
    assert torch.isfinite(weights).all()


def test_router_with_groups_on_zero_tokens_and_add_needs_out_dtype():
    """A rank with no rows of a split router (few tokens, many ranks) routes nothing without
    failing, group-limited routing included; routed_experts_forward refuses an `add` it would drop."""
    from kimi_shaped import build_bench_model, tiny_args

    from eagleforge.extract.native import model as M

    args = dataclasses.replace(tiny_args(), n_group=2, topk_group=1)
    router = M.Router(args, torch.float32)
    weights, ids = router(torch.zeros(0, args.hidden_size))
    assert weights.shape == ids.shape == (0, args.num_experts_per_tok)
    model = build_bench_model(tiny_args(), device="cpu", seed=1)
    moe = model.model.layers[1].mlp
    x = torch.randn(5, model.args.hidden_size)
    w, e = moe.gate(x)
    with pytest.raises(ValueError, match="needs `out_dtype`"):
        M.routed_experts_forward(x, w, e, moe.experts, add=x)

