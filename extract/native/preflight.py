"""Preflight of a multi-GPU machine before a long extraction: measure, project, warn.

    make preflight CONFIG=configs/kimi_k25_pilot.yaml                 # every visible GPU
    torchrun --standalone --nproc-per-node 8 -m eagleforge.extract.native.preflight --config configs/kimi_k25_pilot.yaml

Every process measures at once, as extraction runs: the all-reduce over the whole group at a
few message sizes (1 MiB, 16 MiB and the config's own [extract.batch_tokens, H] activation),
reported as nccl-tests does (algbw = bytes / time, busbw = algbw * 2(n-1)/n, the rate each link
carries, comparable across group sizes), the one-way send/recv rate between neighbouring ranks
(the link of two pipeline stages), and each GPU's bf16 matmul rate. From these and the planner's
FLOPs and bytes per token (plan.py `flops_per_token`, `collective_bytes_per_token`,
`stage_work_per_token`) it projects the native backend's extraction tokens/s for the config,
and for every tp x pp layout of the GPUs (tensor parallel inside pipeline stages: on PCIe
machines stages move one activation per hop where tp moves two all-reduces per layer), printing
the fastest that fits as the keys to set (`target.tp=2 target.pp=4`); one line warns when the
bus bandwidth is under half of what the link should give (nvidia-smi: NVLink's link rates, else
the PCIe generation and width), naming what to check.

On CPUs the same runs over gloo (mechanics only: the numbers say nothing of a GPU machine).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import subprocess
import time
from dataclasses import dataclass

import torch

from eagleforge.cli import run_main
from eagleforge.config import Config
from eagleforge.errors import UserInputError

log = logging.getLogger(__name__)

MIB = 1 << 20
# The share of the measured bf16 matmul rate the Kimi-shaped forward + greedy head reaches
# (measured: BENCHMARKS.md, "Native extraction"); the projection uses 60% and also prints the
# bound at 100%.
FORWARD_MFU = 0.60
# What NCCL's busbw reaches of a link's raw one-way rate (PCIe Gen5 x16: 63 GB/s raw, ~50 GB/s).
LINK_EFFICIENCY = 0.8
# Below this share of the link's expected busbw the preflight warns.
WARN_BELOW = 0.5
PCIE_LANE_GBS = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}  # one way, per lane
# NCCL settings worth printing beside the measurement: each changes which path the all-reduce takes.
NCCL_VARS = ("NCCL_P2P_LEVEL", "NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE", "NCCL_IB_DISABLE", "NCCL_ALGO", "NCCL_PROTO",
             "NCCL_NVLS_ENABLE", "NCCL_MIN_NCHANNELS", "NCCL_TOPO_FILE")


def busbw_factor(n: int) -> float:
    """nccl-tests' all-reduce bus factor 2(n-1)/n: each rank sends and receives that many times
    the message in a ring (reduce-scatter, then all-gather)."""
    return 2 * (n - 1) / n


@dataclass
class Link:
    kind: str  # "NVLink" or "PCIe"
    detail: str  # e.g. "18 links x 26.6 GB/s" or "Gen5 x16"
    raw_gbs: float  # one-way GB/s of one GPU's link(s)

    @property
    def expected_busbw_gbs(self) -> float:
        return LINK_EFFICIENCY * self.raw_gbs


# ----------------------------------------------------------------------------- measuring (collective)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _slowest(seconds: float, device: torch.device) -> float:
    """The largest of every rank's `seconds`: a collective finishes with its slowest rank."""
    import torch.distributed as dist

    t = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def measure_all_reduce(sizes: list[int], device: torch.device, dtype: torch.dtype, iters: int, warmup: int) -> list[dict]:
    """All-reduce of `sizes` bytes over the default group, every rank with the same arguments:
    per size {bytes, seconds (per call, slowest rank), algbw_gbs, busbw_gbs}."""
    import torch.distributed as dist

    n = dist.get_world_size()
    rows = []
    for size in sizes:
        x = torch.ones(max(1, size // dtype.itemsize), dtype=dtype, device=device)
        for _ in range(warmup):
            dist.all_reduce(x)
        _sync(device)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(x)
        _sync(device)
        seconds = _slowest((time.perf_counter() - start) / iters, device)
        nbytes = x.numel() * x.element_size()
        algbw = nbytes / seconds / 1e9
        rows.append({"bytes": nbytes, "seconds": seconds, "algbw_gbs": algbw, "busbw_gbs": algbw * busbw_factor(n)})
    return rows


def measure_matmul_tflops(device: torch.device, n: int, iters: int) -> float:
    """This GPU's bf16 n x n x n matmul rate, TFLOP/s (every rank at once: shared power and cooling)."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(2):
        torch.mm(a, b)
    _sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        torch.mm(a, b)
    _sync(device)
    return 2 * n**3 * iters / (time.perf_counter() - start) / 1e12


def measure_send_recv(nbytes: int, device: torch.device, iters: int, warmup: int) -> float | None:
    """One-way send/recv rate between neighbouring ranks (0 -> 1, 2 -> 3, ...: the link two
    pipeline stages use), GB/s of the slowest pair, each direction timed; None with one rank."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    if world < 2:
        return None
    x = torch.ones(max(1, nbytes // 2), dtype=torch.bfloat16 if device.type == "cuda" else torch.float32, device=device)
    peer = rank + 1 if rank % 2 == 0 else rank - 1
    paired = peer < world
    seconds = 0.0
    for sender_parity in (0, 1):  # even ranks send, then odd ranks send
        for timed in (False, True):
            _sync(device)
            dist.barrier()
            start = time.perf_counter()
            for _ in range(iters if timed else warmup):
                if paired:
                    (dist.send if rank % 2 == sender_parity else dist.recv)(x, peer)
            _sync(device)
            if timed:
                seconds = max(seconds, (time.perf_counter() - start) / iters)
    slowest = _slowest(seconds if paired else 0.0, device)
    return x.numel() * x.element_size() / slowest / 1e9


def gather_floats(value: float, device: torch.device) -> list[float]:
    """Every rank's `value`, in rank order (a tensor all-gather, no pickled objects)."""
    import torch.distributed as dist

    parts = [torch.zeros(1, dtype=torch.float64, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, torch.tensor([value], dtype=torch.float64, device=device))
    return [float(p.item()) for p in parts]


# ----------------------------------------------------------------------------- projection (pure)


def project_tokens_per_s(flops_per_token: float, bytes_per_token: dict, matmul_tflops: float, busbw_gbs: float,
                         tp: int, groups: int, mfu: float = FORWARD_MFU) -> dict:
    """Extraction tokens/s of `groups` tp groups from one rank's work per token.

    Compute: flops_per_token / (matmul rate x mfu), at the slowest rank's rate (a group moves at
    its pace). Communication, not overlapped with compute: an all-reduce of S bytes takes
    S * 2(tp-1)/tp / busbw, an all-gather with S bytes of output S * (tp-1)/tp / busbw (nccl-tests'
    bus factors; the all-gathers are assumed to reach the all-reduce's busbw). The ranks of a
    group work on the same tokens, so a group's rate is 1 / (compute + communication) per token.
    """
    compute_s = flops_per_token / (matmul_tflops * 1e12 * mfu)
    comm_s = 0.0
    if tp > 1:
        comm_s = (bytes_per_token["all_reduce"] * busbw_factor(tp) + bytes_per_token["all_gather"] * (tp - 1) / tp) / (busbw_gbs * 1e9)
    per_group = 1.0 / (compute_s + comm_s)
    return {"compute_us": compute_s * 1e6, "comm_us": comm_s * 1e6, "per_group": per_group, "total": per_group * groups,
            "comm_share": comm_s / (compute_s + comm_s)}


@dataclass
class Rates:
    """What a projection assumes of a machine: measured (preflight) or stated (STATED_RATES)."""

    matmul_tflops: float  # bf16, one GPU
    busbw_gbs: float  # all-reduce bus bandwidth over a tp group
    p2p_gbs: float  # one-way send/recv between neighbouring GPUs
    mfu: float = FORWARD_MFU


# The pilot's stated rates (docs/kimi-k25.md, "Layouts": 8 x RTX PRO 6000, 500 TFLOP/s bf16, PCIe
# links untuned): what target.layout=auto ranks the layouts with at a stage's start, where nothing
# is measured; `make preflight` measures a machine's own and prints the table for them. Under this
# model pipeline stages (one hop per stage, overlapped) outrun tensor parallelism (two
# all-reduces per layer) on any link, so the ranking mostly says: the most stages that fit.
STATED_RATES = Rates(matmul_tflops=500.0, busbw_gbs=22.0, p2p_gbs=25.0)


def layout_splits(a, gpus: int) -> list[tuple[int, int]]:
    """(tp, pp) of every split of `gpus` GPUs a group: tp dividing the attention heads, pp at
    most the layers; tp descending."""
    return [(tp, gpus // tp) for tp in range(gpus, 0, -1)
            if gpus % tp == 0 and a.num_attention_heads % tp == 0 and gpus // tp <= a.num_hidden_layers]


def project_ranges(a, tp: int, ranges: list[range], rates: Rates, dtype_bytes: int, seq_len: int,
                   aux_layers: list[int], greedy_head: bool = True, split: bool = False) -> dict:
    """project_stages of a group whose stages hold `ranges` (a cut by memory, or by compute)."""
    from eagleforge.extract.native.plan import stage_work_per_token

    pp = len(ranges)
    work = [stage_work_per_token(a, tp, r, s == 0, s == pp - 1, dtype_bytes, seq_len, split, greedy_head, aux_layers)
            for s, r in enumerate(ranges)]
    return project_stages(work, tp, 1, rates)


def choose_extract_layout(cfg: Config, gpu_bytes: float | None, rates: Rates = STATED_RATES) -> tuple[int, int, str]:
    """target.layout=auto for extraction: (tp, pp, the line saying so) of the split of target.tp x
    target.pp GPUs that fits `gpu_bytes` by the extraction plan and projects fastest; the
    configured split when none fits (the stage then refuses it with the plan's shortfall)."""
    import dataclasses as dc

    from eagleforge.extract.native.plan import _aux_ids, _dtype_bytes, _splits_rows, config_stage_layers, config_stages, target_args

    a, quantized, _ = target_args(cfg)
    gpus = cfg.target.tp * cfg.target.pp
    seq = min(cfg.data.max_length, cfg.extract.batch_tokens)
    rows = []
    for tp, pp in layout_splits(a, gpus):
        trial = dc.replace(cfg, target=dc.replace(cfg.target, tp=tp, pp=pp))
        total = max(p.total_bytes for p in config_stages(trial, a, quantized))
        projection = project_ranges(a, tp, config_stage_layers(trial, a), rates, _dtype_bytes(cfg), seq, _aux_ids(cfg, a),
                                    cfg.extract.write_target_argmax, _splits_rows(trial))
        rows.append((tp, pp, gpu_bytes is None or total <= gpu_bytes, projection["per_group"]))
    return _pick(cfg, rows, gpus, gpu_bytes, "the extraction plan", "extraction tokens/s a group")


def _pick(cfg: Config, rows: list[tuple], gpus: int, gpu_bytes: float | None, plan: str, what: str,
          detail=lambda tp, pp: "") -> tuple[int, int, str]:
    """The fastest fitting row (tp, pp, fits, tokens/s) and its one line."""
    from eagleforge.extract.native.plan import GIB

    fitting = sorted((r for r in rows if r[2]), key=lambda r: -r[3])
    size = f"{gpu_bytes / GIB:.1f} GiB" if gpu_bytes else "any size (no GPU size known)"
    if not fitting:
        return cfg.target.tp, cfg.target.pp, (
            f"layout: target.tp={cfg.target.tp} target.pp={cfg.target.pp} as set (target.layout=auto: none of the "
            f"{len(rows)} splits of {gpus} GPUs fits {size} by {plan})")
    tp, pp, _, rate = fitting[0]
    others = ", ".join(f"tp {r[0]} x pp {r[1]} {r[3]:,.0f}" + ("" if r[2] else " (does not fit)")
                       for r in sorted(rows, key=lambda r: -r[3]) if (r[0], r[1]) != (tp, pp))
    return tp, pp, (f"layout: target.tp={tp} target.pp={pp} (target.layout=auto: the fastest of the {len(rows)} splits of "
                    f"{gpus} GPUs that fit {size} by {plan}{detail(tp, pp)}: {rate:,.0f} {what}, computed from the stated "
                    f"rates of extract/native/preflight.py STATED_RATES; {others})")


def project_stages(stages: list[dict], tp: int, groups: int, rates: Rates) -> dict:
    """Extraction tokens/s of `groups` groups of len(stages) pipeline stages of tp ranks, from each
    stage's work per token (plan.stage_work_per_token). A stage's time per token is its compute
    plus its tp group's collectives (not overlapped; project_tokens_per_s's model), or its
    receive or its send when longer: the receive is posted ahead and the send does not wait, so
    the transfers overlap the compute. Consecutive forwards fill the stages, so a group moves at
    its slowest stage's pace (the fill and drain once per run are left out: (pp - 1) forwards)."""
    times = []
    for work in stages:
        # seconds per token measured elsewhere (bench_pipeline scales measured layer times), else from the FLOPs
        compute = work["compute_s"] if "compute_s" in work else work["flops"] / (rates.matmul_tflops * 1e12 * rates.mfu)
        comm = 0.0
        if tp > 1:
            comm = (work["all_reduce"] * busbw_factor(tp) + work["all_gather"] * (tp - 1) / tp) / (rates.busbw_gbs * 1e9)
        hop = max(work["recv"], work["send"]) / (rates.p2p_gbs * 1e9)
        times.append({"compute_us": compute * 1e6, "comm_us": comm * 1e6, "hop_us": hop * 1e6,
                      "stage_us": max(compute + comm, hop) * 1e6})
    slowest = max(range(len(times)), key=lambda s: times[s]["stage_us"])
    per_group = 1e6 / times[slowest]["stage_us"]
    busy = sum(t["compute_us"] for t in times) / (len(times) * times[slowest]["stage_us"])
    return {"stages": times, "slowest_stage": slowest, "per_group": per_group, "total": per_group * groups,
            "compute_share": busy}


def layout_projections(a, gpus: int, rates: Rates, dtype_bytes: int, seq_len: int, aux_layers: list[int],
                       greedy_head: bool = True, split_min_tokens: int = 1024, batch_tokens: int = 8192,
                       fits=None) -> list[dict]:
    """Every tp x pp layout of `gpus` GPUs a group (tp dividing the attention heads), projected
    with `rates`, fastest first; fits(tp, pp) -> bool marks those whose stages fit the GPUs (the
    planner's check), the others are listed but never recommended."""
    from eagleforge.extract.native.plan import stage_layers, stage_work_per_token

    rows = []
    for tp in (t for t in range(gpus, 0, -1) if gpus % t == 0 and a.num_attention_heads % t == 0):
        pp = gpus // tp
        if pp > a.num_hidden_layers:
            continue
        split = tp > 1 and batch_tokens >= split_min_tokens
        ranges = stage_layers(a, pp, tp, seq_len, split, greedy_head)
        work = [stage_work_per_token(a, tp, r, s == 0, s == pp - 1, dtype_bytes, seq_len, split, greedy_head, aux_layers)
                for s, r in enumerate(ranges)]
        projection = project_stages(work, tp, 1, rates)
        rows.append({"tp": tp, "pp": pp, "fits": True if fits is None else bool(fits(tp, pp)),
                     "keys": f"target.tp={tp} target.pp={pp}", **projection})
    return sorted(rows, key=lambda r: -r["per_group"])


def format_layouts(rows: list[dict], groups: int = 1) -> str:
    """The layouts' table, and the recommendation: the fastest that fits."""
    lines = [f"  {'layout':<14}{'tokens/s per group':>19}{'x ' + str(groups) + ' groups':>14}{'slowest stage':>15}"
             f"{'compute us':>12}{'tp comm us':>12}{'hop us':>9}{'  fits':>7}"]
    for r in rows:
        t = r["stages"][r["slowest_stage"]]
        name = f"tp {r['tp']}" + (f" x pp {r['pp']}" if r["pp"] > 1 else "")
        lines.append(f"  {name:<14}{r['per_group']:>19,.0f}{r['per_group'] * groups:>14,.0f}{r['slowest_stage']:>15}"
                     f"{t['compute_us']:>12.2f}{t['comm_us']:>12.2f}{t['hop_us']:>9.2f}{'yes' if r['fits'] else 'no':>7}")
    best = next((r for r in rows if r["fits"]), None)
    lines.append(f"  recommended: {best['keys']}" if best else "  no layout of these GPUs fits: more GPUs a group")
    return "\n".join(lines)


def bandwidth_warning(busbw_gbs: float, link: Link | None) -> str | None:
    """One line when the measured busbw is under WARN_BELOW of what `link` should give."""
    if link is None or busbw_gbs >= WARN_BELOW * link.expected_busbw_gbs:
        return None
    pcie = ("check NCCL's topology settings (NCCL_P2P_LEVEL=SYS lets P2P cross the CPU's root complex; NCCL_P2P_DISABLE must be "
            "unset), ACS and the IOMMU in the BIOS (they force P2P through the CPU), and `nvidia-smi topo -m`; on 8-GPU PCIe machines "
            "these settings have been reported to change prefill speed ~9x")
    nvlink = "check `nvidia-smi nvlink --status` (links down or degraded), `nvidia-smi topo -m`, NCCL_P2P_DISABLE/NCCL_NVLS_ENABLE and NCCL_ALGO"
    return (f"warning: all-reduce bus bandwidth {busbw_gbs:.1f} GB/s is under {WARN_BELOW:.0%} of what {link.kind} {link.detail} "
            f"should give (~{link.expected_busbw_gbs:.0f} GB/s): {pcie if link.kind == 'PCIe' else nvlink}")


# ----------------------------------------------------------------------------- the link (nvidia-smi)


def _smi(*args: str) -> str:
    try:
        return subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def link_from_smi(nvlink_status: str, pcie_query: str) -> Link | None:
    """GPU 0's link from `nvidia-smi nvlink --status -i 0` ("Link 0: 26.562 GB/s" lines) and
    `nvidia-smi -i 0 --query-gpu=pcie.link.gen.max,pcie.link.width.max --format=csv,noheader`
    ("5, 16"); NVLink when any link is up, else PCIe; None when neither says."""
    speeds = []
    for line in nvlink_status.splitlines():
        parts = line.strip().split(":", 1)
        if len(parts) == 2 and parts[0].startswith("Link") and "GB/s" in parts[1]:
            try:
                speeds.append(float(parts[1].split("GB/s")[0]))
            except ValueError:
                continue
    if speeds:
        return Link("NVLink", f"{len(speeds)} links x {speeds[0]:.1f} GB/s", sum(speeds))
    fields = [f.strip() for f in pcie_query.strip().splitlines()[0].split(",")] if pcie_query.strip() else []
    if len(fields) == 2 and all(f.isdigit() for f in fields) and int(fields[0]) in PCIE_LANE_GBS:
        gen, width = int(fields[0]), int(fields[1])
        return Link("PCIe", f"Gen{gen} x{width}", PCIE_LANE_GBS[gen] * width)
    return None


def detect_link() -> Link | None:
    if shutil.which("nvidia-smi") is None:
        return None
    return link_from_smi(_smi("nvlink", "--status", "-i", "0"),
                         _smi("-i", "0", "--query-gpu=pcie.link.gen.max,pcie.link.width.max", "--format=csv,noheader"))


# ----------------------------------------------------------------------------- the stage


def default_sizes(cfg: Config, hidden_size: int | None, dtype_bytes: int) -> list[int]:
    """1 MiB, 16 MiB and the config's [extract.batch_tokens, H] activation (128 MiB when the
    hidden size is not known here), ascending, unique."""
    largest = cfg.extract.batch_tokens * hidden_size * dtype_bytes if hidden_size else 128 * MIB
    return sorted({MIB, 16 * MIB, largest})


def projection_inputs(cfg: Config):
    """(model args, their source, tp, flops per token, collective bytes per token) of the config's
    native layout; sequences of data.max_length (the longest: shorter ones cost less attention)."""
    from eagleforge.extract.native.parallel import SPLIT_ROWS_MIN_TOKENS
    from eagleforge.extract.native.plan import _dtype_bytes, collective_bytes_per_token, flops_per_token, target_args

    a, _, source = target_args(cfg)
    tp = cfg.target.tp
    if a.num_attention_heads % tp:
        raise UserInputError(f"target.tp = {tp} does not divide the {a.num_attention_heads} attention heads ({source})")
    split = tp > 1 and cfg.extract.batch_tokens >= SPLIT_ROWS_MIN_TOKENS
    seq = min(cfg.data.max_length, cfg.extract.batch_tokens)
    return a, source, tp, flops_per_token(a, tp, seq, split), collective_bytes_per_token(a, tp, _dtype_bytes(cfg), split)


def run_preflight(cfg: Config, device: torch.device, sizes: list[int] | None = None, iters: int | None = None,
                  matmul_n: int | None = None, link: Link | None = None) -> dict | None:
    """Measure on every rank of the default group, then rank 0 projects and prints; returns the
    report on rank 0 (None elsewhere). sizes / iters / matmul_n: smaller for tests."""
    import torch.distributed as dist

    from eagleforge.extract.native.plan import _dtype_bytes

    rank, world = dist.get_rank(), dist.get_world_size()
    cuda = device.type == "cuda"
    if cfg.target.backend == "native":
        a, source, tp, flops, traffic = projection_inputs(cfg)
    else:
        a = source = flops = traffic = None
        tp = 1
    sizes = sizes or default_sizes(cfg, a.hidden_size if a is not None else None, _dtype_bytes(cfg))
    # gloo has no bf16 sum on every build; the bytes are what the measurement is about
    dtype = torch.bfloat16 if cuda else torch.float32
    rows = measure_all_reduce(sizes, device, dtype, iters or (20 if cuda else 3), warmup=5 if cuda else 1) if world > 1 else []
    p2p = measure_send_recv(sizes[-1], device, iters or (20 if cuda else 3), warmup=5 if cuda else 1)
    rates = gather_floats(measure_matmul_tflops(device, matmul_n or (8192 if cuda else 256), iters or (20 if cuda else 3)), device)
    if rank != 0:
        return None
    link = link if link is not None else (detect_link() if cuda else None)
    report = {"world": world, "backend": dist.get_backend(), "all_reduce": rows, "send_recv_gbs": p2p, "matmul_tflops": rates,
              "link": dataclasses.asdict(link) if link is not None else None, "projection": None, "layouts": None}
    names = f"{world} x {torch.cuda.get_device_name(device)}" if cuda else f"{world} CPU process{'es' if world > 1 else ''}"
    settings = ", ".join(f"{k}={os.environ[k]}" for k in NCCL_VARS if k in os.environ) or "no NCCL_* topology variables set"
    print(f"preflight: {names} ({report['backend']}); {settings}")
    if rows:
        print(f"all-reduce over {world} ranks ({str(dtype).removeprefix('torch.')}; busbw = algbw x 2(n-1)/n = algbw x {busbw_factor(world):.3f}):")
        print(f"  {'size':>12} {'time us':>10} {'algbw GB/s':>11} {'busbw GB/s':>11}")
        for r in rows:
            print(f"  {r['bytes'] / MIB:>8.2f} MiB {r['seconds'] * 1e6:>10.1f} {r['algbw_gbs']:>11.2f} {r['busbw_gbs']:>11.2f}")
    else:
        print("one process: no all-reduce to measure (run it under torchrun --nproc-per-node N; make preflight does)")
    if p2p is not None:
        print(f"send/recv between neighbouring ranks (0 -> 1, 2 -> 3, ...: pipeline stages' link), {sizes[-1] / MIB:.2f} MiB: "
              f"{p2p:.2f} GB/s one way (slowest pair)")
    print("bf16 matmul TFLOP/s per rank: " + ", ".join(f"{r:.1f}" for r in rates) + f" (slowest {min(rates):.1f})")
    if link is not None:
        print(f"link: {link.kind} {link.detail}, {link.raw_gbs:.0f} GB/s one way: expect ~{link.expected_busbw_gbs:.0f} GB/s busbw")
    busbw = rows[-1]["busbw_gbs"] if rows else None  # the largest size: the config's activation
    if flops is not None:
        if tp > 1 and busbw is None:
            print(f"projection: target.tp = {tp} needs the all-reduce measured over more than one process")
        else:
            groups = max(1, world // tp)
            p = project_tokens_per_s(flops, traffic, min(rates), busbw or 1.0, tp, groups)
            bound = project_tokens_per_s(flops, traffic, min(rates), busbw or 1.0, tp, groups, mfu=1.0)
            report["projection"] = dict(p, flops_per_token=flops, bytes_per_token=traffic, tp=tp, groups=groups)
            note = "" if world >= tp else f"; busbw measured over {world} ranks, not {tp}"
            print(f"target: {source}")
            print(f"projection, tp {tp}, {cfg.extract.batch_tokens} tokens per forward{note}: per token on each rank "
                  f"{flops / 1e9:.2f} GFLOP, {traffic['all_reduce'] / 1024:.0f} KiB all-reduced, {traffic['all_gather'] / 1024:.1f} KiB all-gathered")
            print(f"  compute {p['compute_us']:.2f} us (at {FORWARD_MFU:.0%} of the slowest matmul rate) + communication {p['comm_us']:.2f} us "
                  f"({p['comm_share']:.0%}) per token: {p['per_group']:,.0f} tokens/s per group, {p['total']:,.0f} on {groups} group(s) "
                  f"(bound at 100% MFU: {bound['total']:,.0f})")
        if busbw is not None and p2p is not None:
            report["layouts"] = recommend_layout(cfg, a, world, Rates(min(rates), busbw, p2p), device)
    else:
        print(f"projection: for the native backend's layout (target.backend = {cfg.target.backend})")
    warning = bandwidth_warning(busbw, link) if busbw is not None else None
    report["warning"] = warning
    if warning:
        print(warning)
    return report


def recommend_layout(cfg: Config, a, gpus: int, rates: Rates, device: torch.device) -> list[dict]:
    """Every tp x pp layout of `gpus` GPUs a group projected with the measured rates, the fastest
    that fits (the planner's check for this GPU's memory) printed as the keys to set."""
    import dataclasses as dc

    from eagleforge.extract.native.parallel import SPLIT_ROWS_MIN_TOKENS
    from eagleforge.extract.native.plan import GIB, _aux_ids, _dtype_bytes, config_stages, target_args

    gpu_gib = cfg.target.gpu_memory_gib
    gpu_bytes = gpu_gib * GIB if gpu_gib else (torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None)
    _, quantized, _ = target_args(cfg)

    def fits(tp: int, pp: int) -> bool:
        if gpu_bytes is None:
            return True
        trial = dc.replace(cfg, target=dc.replace(cfg.target, tp=tp, pp=pp))
        return max(p.total_bytes for p in config_stages(trial, a, quantized)) <= gpu_bytes

    seq = min(cfg.data.max_length, cfg.extract.batch_tokens)
    layouts = layout_projections(a, gpus, rates, _dtype_bytes(cfg), seq, _aux_ids(cfg, a), cfg.extract.write_target_argmax,
                                 SPLIT_ROWS_MIN_TOKENS, cfg.extract.batch_tokens, fits)
    print(f"layouts of {gpus} GPUs a group, projected from these rates ({rates.matmul_tflops:.0f} TFLOP/s at {rates.mfu:.0%}, "
          f"all-reduce {rates.busbw_gbs:.1f} GB/s busbw, send/recv {rates.p2p_gbs:.1f} GB/s):")
    print(format_layouts(layouts))
    return layouts


def main(cfg: Config) -> None:
    import torch.distributed as dist

    from eagleforge.layout import join_process_group, resolve_device, world_size_from_env

    device = resolve_device(cfg.target.device)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if world_size_from_env() <= 1 and not dist.is_initialized():  # one process: a group of one, so the same code runs
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1)
        created = True
    else:
        created = join_process_group(device)
    try:
        run_preflight(cfg, device)
        # Leave together: a gloo rank tearing its group down while another still reads from it
        # aborts the other ("terminate called without an active exception").
        dist.barrier()
    finally:
        if created:
            dist.destroy_process_group()


if __name__ == "__main__":
    run_main(main, "Preflight of a multi-GPU machine: all-reduce bus bandwidth, bf16 matmul rate per GPU, projected extraction tokens/s.",
             sections=("target", "data", "extract"), writes_run_dir=False)
