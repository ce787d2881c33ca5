"""Parallel layers and process groups: the only file of the native backend that communicates.

Layout (docs/shards.md, docs/kimi-k25.md): the world is split into groups of `tp` consecutive ranks.
Inside a group, tensor parallelism cuts every layer so that each rank holds 1/tp of it:

    embedding        vocab-parallel: a contiguous range of token rows, masked lookup, all-reduce
    q_b, kv_b        column-parallel (whole heads per rank), no communication
    o_proj           row-parallel, one all-reduce per attention block
    q_a, kv_a, norms, router        replicated
    dense MLP, shared expert        gate/up column-parallel, down row-parallel (no reduce here)
    routed experts   "ep": a contiguous range of whole experts per rank (uneven when the count
                     does not divide); "tp": every expert, sliced along the intermediate dim
    MoE / MLP block  one all-reduce of (routed + shared) partial sums
    lm_head          vocab-parallel rows; the argmax is combined across ranks

After each block all-reduce every rank of a tp group holds the same hidden states, so hooks on any
rank see the full tensors. Where the ranks sit (groups, stages, tp ranks) and their process groups
are the job's Layout (eagleforge/layout.py); `tensor_parallel(layout)` is the model's view of it.
With one process nothing here communicates (`TensorParallel()`).

Modules record which slice of the checkpoint tensor they hold in `shard_spec`
({param name: (dim, start, end, full size)}); the loader reads exactly that slice.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from eagleforge.errors import UserInputError
from eagleforge.layout import Layout

log = logging.getLogger(__name__)


def split_range(n: int, rank: int, size: int) -> tuple[int, int]:
    """Contiguous [start, end) of n items for `rank` of `size`; the first n % size ranks get one more."""
    base, extra = divmod(n, size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def even_range(n: int, rank: int, size: int, what: str, multiple: int = 1) -> tuple[int, int]:
    """Like split_range, but the split must be even (and a multiple of `multiple`): else UserInputError."""
    if n % size or (n // size) % multiple:
        need = f" into multiples of {multiple}" if multiple > 1 else ""
        raise UserInputError(f"{what} = {n} cannot be split evenly over tp = {size} ranks{need}; choose a tp that divides it")
    return rank * (n // size), (rank + 1) * (n // size)


# From this many tokens, per-token work every rank would repeat (the router, attention's latent
# projections) is split over the ranks by rows and gathered (split_rows); fewer tokens run it whole
# on every rank.
SPLIT_ROWS_MIN_TOKENS = 1024
# From this many rows, a row-parallel linear's all-reduce goes in two row halves, the first
# overlapping the second half's GEMM; fewer rows reduce in one call.
OVERLAP_MIN_ROWS = 4096


@dataclass
class TensorParallel:
    """One rank's view of its tensor-parallel group; size 1 = no communication at all."""

    size: int = 1
    rank: int = 0
    group: object = None  # torch.distributed ProcessGroup when size > 1
    # the two thresholds above; tests and bench-extract's A/B switches set them per view
    split_rows_min_tokens: int = SPLIT_ROWS_MIN_TOKENS
    overlap_min_rows: int = OVERLAP_MIN_ROWS

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_reduce_in_halves(self, compute, out: torch.Tensor) -> torch.Tensor:
        """out [N, ...] = compute's rows summed over the group, the all-reduce overlapped with
        compute: compute(rows, dst) writes the rows `rows` (a slice) of the rank's partial result
        into dst. The first half's all-reduce runs on NCCL's stream while the second half is
        computed on the current one; both halves are contiguous row ranges of out (no copy)."""
        half = out.shape[0] // 2
        compute(slice(0, half), out[:half])
        work = dist.all_reduce(out[:half], group=self.group, async_op=True)
        compute(slice(half, None), out[half:])
        dist.all_reduce(out[half:], group=self.group)
        work.wait()  # the current stream (not the host) waits for the first half
        return out

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        if self.size == 1:
            return [x]
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return parts


    def split_rows(self, fn, x: torch.Tensor, min_rows: int = 0) -> tuple[torch.Tensor, ...]:
        """fn(x) for a row-wise fn returning a tuple of [N, ...] tensors, each rank computing
        only its 1/size of the N rows, the results all-gathered (every rank ends with all N):
        for per-token work that the ranks would otherwise all repeat (the router, attention's
        q_a/kv_a latents). One
        collective for all outputs (their bytes side by side), and the bytes gathered are the
        outputs' (the router's [N, k] weights and ids, attention's latents), not x's."""
        if self.size == 1 or x.shape[0] < min_rows:  # below min_rows every rank computes every row
            return fn(x)
        n = x.shape[0]
        per = -(-n // self.size)  # rows per rank, the last ranks' padded
        lo, hi = min(n, self.rank * per), min(n, (self.rank + 1) * per)
        parts = [p.contiguous() for p in fn(x[lo:hi])]
        # each output as raw bytes per row [rows, nbytes], side by side in one uint8 buffer
        widths = [math.prod(p.shape[1:]) * p.element_size() for p in parts]
        local = torch.zeros(per, sum(widths), dtype=torch.uint8, device=x.device)
        col = 0
        for p, w in zip(parts, widths):
            local[: hi - lo, col:col + w] = p.reshape(hi - lo, w // p.element_size()).view(torch.uint8)
            col += w
        gathered = torch.empty(per * self.size, local.shape[1], dtype=torch.uint8, device=x.device)
        dist.all_gather_into_tensor(gathered, local, group=self.group)
        out, col = [], 0
        for p, w in zip(parts, widths):
            raw = gathered[:n, col:col + w].contiguous()
            out.append(raw.view(p.dtype).reshape((n,) + tuple(p.shape[1:])))
            col += w
        return tuple(out)


class AllReduce(nn.Module):
    """Sums partial outputs over the group: the single reduction of an MLP/MoE block."""

    def __init__(self, tp: TensorParallel):
        super().__init__()
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(x)


class ReplicatedLinear(nn.Linear):
    """Every rank holds the whole weight (q_a, kv_a, router)."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype):
        super().__init__(in_features, out_features, bias=False, dtype=dtype)
        self.shard_spec: dict = {}


class ColumnParallelLinear(nn.Linear):
    """Output features [start, end) of the full weight [out, in]; no communication."""

    def __init__(self, in_features: int, out_features: int, tp: TensorParallel, dtype: torch.dtype, what: str, unit: int = 1):
        # `unit`: outputs that must stay together on one rank (a head's dims, an INT4 group).
        start, end = even_range(out_features // unit, tp.rank, tp.size, what)
        super().__init__(in_features, (end - start) * unit, bias=False, dtype=dtype)
        self.shard_spec = {"weight": (0, start * unit, end * unit, out_features)}


class RowParallelLinear(nn.Linear):
    """Input features [start, end) of the full weight [out, in]; optionally all-reduces its output."""

    def __init__(self, in_features: int, out_features: int, tp: TensorParallel, dtype: torch.dtype, what: str, reduce: bool, unit: int = 1):
        start, end = even_range(in_features // unit, tp.rank, tp.size, what)
        super().__init__((end - start) * unit, out_features, bias=False, dtype=dtype)
        self.shard_spec = {"weight": (1, start * unit, end * unit, in_features)}
        self.tp = tp
        self.reduce = reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if not (self.reduce and self.tp.size > 1 and rows >= self.tp.overlap_min_rows):
            y = super().forward(x)
            return self.tp.all_reduce(y) if self.reduce else y
        flat = x.reshape(rows, x.shape[-1])  # [N, in_local] -> out [N, out], reduced in two row halves
        out = torch.empty(rows, self.out_features, dtype=self.weight.dtype, device=x.device)
        self.tp.all_reduce_in_halves(lambda part, dst: torch.mm(flat[part], self.weight.t(), out=dst), out)
        return out.view(*x.shape[:-1], self.out_features)


class _VocabRows(nn.Module):
    """This rank's rows [start, end) of a [V, H] vocabulary matrix (embedding or lm_head)."""

    def __init__(self, vocab_size: int, dim: int, tp: TensorParallel, dtype: torch.dtype):
        super().__init__()
        self.start, self.end = split_range(vocab_size, tp.rank, tp.size)
        self.weight = nn.Parameter(torch.empty(self.end - self.start, dim, dtype=dtype), requires_grad=False)
        self.shard_spec = {"weight": (0, self.start, self.end, vocab_size)}
        self.tp = tp


class VocabParallelEmbedding(_VocabRows):
    """Token rows [start, end) of the embedding; other ranks' tokens give zeros, then all-reduce."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # [B, T] -> [B, T, H]
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        y = F.embedding(local.masked_fill(outside, 0), self.weight)
        y = y.masked_fill(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(y)


def expert_partition(n_experts: int, intermediate: int, tp: TensorParallel, layout: str, group_size: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """(expert range, intermediate range) owned by this rank for routed experts.

    "ep": a contiguous range of whole experts (uneven when tp does not divide the count; a rank
    with no expert is refused). "tp": all experts, intermediate slice a multiple of the INT4 group.
    """
    if layout == "ep":
        if n_experts < tp.size:
            raise UserInputError(f"target.expert_layout = ep: {n_experts} routed experts cannot give each of tp = {tp.size} ranks one; use expert_layout = tp")
        return split_range(n_experts, tp.rank, tp.size), (0, intermediate)
    if layout == "tp":
        return (0, n_experts), even_range(intermediate, tp.rank, tp.size, "moe_intermediate_size (expert_layout = tp)", group_size)
    raise UserInputError(f"target.expert_layout must be 'ep' or 'tp', got {layout!r}")


# Tokens per chunk of the greedy head's logits (the memory planner counts one chunk).
ARGMAX_CHUNK_TOKENS = 1024


class VocabParallelHead(_VocabRows):
    """lm_head rows [start, end) of [V, H]; only its greedy token is needed, combined across ranks."""

    @torch.no_grad()
    def argmax(self, hidden: torch.Tensor, chunk_tokens: int = ARGMAX_CHUNK_TOKENS) -> torch.Tensor:
        """Full-vocabulary greedy token [N] int32 from normed hidden [N, H].

        Chunked over tokens into ONE reused [chunk, V/tp] logits buffer in the model dtype, so
        [N, V/tp] logits never exist and the memory planner can count this as one chunk (an fp32
        copy per chunk, with the previous chunk's still referenced, set the peak of a forward;
        measured: BENCHMARKS.md, "Smaller measurements the code's choices rest on"). The argmax
        of the rounded logits is the argmax of their exact fp32 copy. Ties go to the lowest token id, as torch.argmax over the
        full vocabulary would.
        """
        n_rows = hidden.shape[0]
        out = torch.empty(n_rows, dtype=torch.int32, device=hidden.device)
        buf = torch.empty(min(chunk_tokens, n_rows), self.weight.shape[0], dtype=self.weight.dtype, device=hidden.device)
        for begin in range(0, n_rows, chunk_tokens):
            part = hidden[begin:begin + chunk_tokens]
            logits = torch.mm(part, self.weight.t(), out=buf[: part.shape[0]])  # [n, V/tp]
            index = logits.argmax(-1, keepdim=True)  # first maximum = lowest id
            best = logits.gather(-1, index).squeeze(-1).float()  # exact; gathered across ranks in fp32
            index = index.squeeze(-1) + self.start
            if self.tp.size > 1:
                bests = torch.stack(self.tp.all_gather(best))  # [tp, n]; rank order = vocab order
                indices = torch.stack(self.tp.all_gather(index))
                winner = bests.argmax(0, keepdim=True)  # first rank with the maximum = lowest id
                index = indices.gather(0, winner).squeeze(0)
            out[begin:begin + chunk_tokens] = index.to(torch.int32)
        return out


class StageLink:
    """This rank's point-to-point links in its pipeline: from the same tp rank of the previous
    stage, to the same tp rank of the next (every rank of a tp group holds the whole hidden state
    after the block all-reduces, so each sends its own copy: no gather at the receiver).

    Sends are asynchronous and at most `max_sends` stay in flight (their buffers are kept alive
    until they complete); a receive can be posted ahead (`post_recv`) for the next forward's
    shape, so that transfer runs while this stage computes the current one. Messages between a
    pair of ranks arrive in the order they were sent; every forward's shape is known to both
    sides (the same token rows), so no header travels."""

    def __init__(self, layout: Layout, max_sends: int = 2):
        self.prev = layout.rank - layout.tp if layout.stage > 0 else None
        self.next = layout.rank + layout.tp if layout.stage < layout.pp - 1 else None
        self.max_sends = max_sends
        self._sends: list = []  # (buffer, work) in flight, oldest first
        self._posted: list = []  # (shape, dtype, buffer, work) of receives posted ahead, oldest first

    def post_recv(self, shape: tuple, dtype: torch.dtype, device: torch.device) -> None:
        """Post the receive of a [shape] message from the previous stage (its buffer allocated here)."""
        buffer = torch.empty(shape, dtype=dtype, device=device)
        self._posted.append((tuple(shape), dtype, buffer, dist.irecv(buffer, src=self.prev)))

    def recv(self, shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The next message from the previous stage: the oldest receive posted ahead, else one posted now."""
        if not self._posted:
            self.post_recv(shape, dtype, device)
        posted_shape, posted_dtype, buffer, work = self._posted.pop(0)
        if (posted_shape, posted_dtype) != (tuple(shape), dtype):
            raise RuntimeError(f"pipeline receive posted for {posted_shape} {posted_dtype}, the forward expects {tuple(shape)} {dtype}")
        work.wait()
        return buffer

    def send(self, tensor: torch.Tensor) -> None:
        """Send `tensor` to the next stage without waiting (the oldest send first when max_sends are in flight)."""
        tensor = tensor.contiguous()
        self._sends.append((tensor, dist.isend(tensor, dst=self.next)))
        while len(self._sends) > self.max_sends:
            self._sends.pop(0)[1].wait()

    def drain(self, keep: int = 0) -> None:
        """Wait for the sends in flight but the newest `keep` and let their buffers go (keep 0:
        before the process group goes away). With NCCL the wait is the current stream's, not the
        host's; a send whose receive the next stage posted ahead is done or nearly."""
        while len(self._sends) > keep:
            self._sends.pop(0)[1].wait()


def tensor_parallel(layout: Layout) -> TensorParallel:
    """The model's view of this rank's tensor-parallel group in the job's Layout."""
    return TensorParallel(size=layout.tp, rank=layout.tp_rank, group=layout.tp_group)
