"""The native backend as a Target (eagleforge/target/protocol.py): Kimi-K2.5 / DeepSeek-V3, tensor parallel per group.

    torchrun --nproc-per-node 8 -m eagleforge.extract --config configs/kimi_k25_pilot.yaml
    torchrun --nnodes 4 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        -m eagleforge.extract --config configs/kimi_k25_b300.yaml

The job's Layout (eagleforge/layout.py) cuts the world into groups of `target.tp` ranks. Every rank
loads only its slices (loader.py) and the group runs each forward together; after each block's
all-reduce all ranks of a group hold the same states, so the group's leader keeps the captured
rows (eagleforge/target/capture.py) and the others only take part. The memory plan (plan.py) is checked
before any weight is read.
"""

from __future__ import annotations

import logging
import math
from typing import Callable

import torch

from eagleforge.config import Config
from eagleforge.extract.native.loader import build_model, load_weights, read_checkpoint_info
from eagleforge.extract.native.model import DeepseekV3ForExtraction
from eagleforge.extract.native.parallel import StageLink, tensor_parallel
from eagleforge.extract.native.plan import GIB, check_fits, config_stage_layers, format_plan
from eagleforge.layout import Layout
from eagleforge.readers import read_json_object
from eagleforge.target.capture import HiddenStateCapture
from eagleforge.target.loading import resolve_aux_layers, target_path, torch_dtype
from eagleforge.target.protocol import (
    CapturingTarget,
    PendingRows,
    Rows,
    forward_packed,
    nonfinite_weights,
    pack_rows,
    pad_right,
    rows_to_bytes,
    select_rows,
)

log = logging.getLogger(__name__)

# The leader's row messages to earlier stages: the sends of this many forwards stay in flight.
ROW_FORWARDS_IN_FLIGHT = 2


class NativeTarget(CapturingTarget):
    """This rank's slices of the target (a built model: its stage's layers on its tensor-parallel
    group), hooks attached. `forward` (eagleforge/target/protocol.py) returns the rows on the group's leader,
    None on its other ranks, or, with rows_for, each named rank's own rows.

    Pipeline stages (target.pp > 1): stage s receives [B, T, (1 + c) H] from stage s - 1 (the
    hidden state and the c aux states captured before it: they travel with the activation, one
    message a hop, so the rows the last stage packs are the ones a one-stage model captures), runs
    its layers, captures its own aux layers and sends on without waiting; the last stage norms,
    packs the rows and runs the greedy head. Every rank loops over the same forwards (the
    extraction driver, online training's batches), so the stages work on consecutive forwards at
    once: the run's forwards are the pipeline's micro-batches, filled and drained once per run.
    Online training's rows go from the leader to each rank that trains on them (rows_for), over
    a process group of their own (`rows_group`): with NCCL the messages of one communicator run
    in order on one stream per pair of ranks, so rows on the activations' communicator would put
    a receive of rows between two sends of activations on the pair of the last two stages, each
    side waiting for the other (the leader posts the next activation's receive ahead)."""

    def __init__(self, model: DeepseekV3ForExtraction, layout: Layout, aux_layers: list[int], write_target_argmax: bool,
                 header: dict | None = None, hf_config: dict | None = None, link=None):
        self.model, self.layout, self.device = model, layout, layout.device
        self.planned_bytes = None  # what the memory plan counted for this rank (the loader sets it)
        self.vocab_size = model.args.vocab_size
        self.write_target_argmax = write_target_argmax
        self.header, self.hf_config = header or {}, hf_config or {}
        self.link = None
        if layout.pp == 1:
            super().__init__(model.model.layers, aux_layers, model.model.norm)
            return
        held = model.model.layers.ids()
        here = [i for i in aux_layers if i in held]  # this stage's aux layers; the final norm is run below
        self.aux_layers = aux_layers
        self.capture = HiddenStateCapture(model.model.layers, here, None).__enter__() if here else None
        self.carried_in = sum(i < held[0] for i in aux_layers)  # aux states arriving with the activation
        self.link = link or StageLink(layout)  # a benchmark may run two stages in one process through a queue
        # the leader's rows in flight to other ranks, one list of (buffer, work) per forward
        self._row_sends: list[list] = []
        self.rows_group = None
        if layout.distributed and link is None:
            import torch.distributed as dist

            # every rank builds its target in the same order, so every rank makes this group together
            self.rows_group = dist.new_group(list(range(layout.world_size)))

    def input_embedding(self) -> torch.Tensor | None:
        """The whole input embedding [V, H] when this rank holds it (tp 1, the first stage), else None."""
        embed = self.model.model.embed_tokens
        if embed is None or self.layout.tp > 1 or self.layout.pp > 1:
            return None
        return embed.weight

    def forward(self, input_ids: list[list[int]], then: list[list[int]] | None = None,
                rows_for: dict[int, list[int]] | None = None, post_rows: bool = True) -> Rows | PendingRows | None:
        """Every rank of the group calls it with the same ids (collectives). post_rows=False:
        an earlier stage's rows come back as a PendingRows whose receive is not posted yet."""
        lengths = [len(ids) for ids in input_ids]
        if self.link is None:  # one stage: every rank of the group ends with every row
            keep = self.layout.is_group_leader if rows_for is None else self.layout.rank in rows_for
            packed = forward_batch(self.model, self.capture, input_ids, self.device, self.write_target_argmax, keep=keep)
            if packed is None or rows_for is None:
                return packed
            return select_rows(packed, lengths, rows_for[self.layout.rank])
        return self._stage_forward(input_ids, lengths, then, rows_for, post_rows)

    @torch.inference_mode()
    def _stage_forward(self, input_ids, lengths, then, rows_for, post_rows=True):
        model, H = self.model, self.model.args.hidden_size
        dtype = next(model.parameters()).dtype
        tokens, _ = pad_right(input_ids, 0)  # [B, T]
        b, t = tokens.shape
        if model.first:
            x = model.model.embed_tokens(tokens.to(self.device))  # [B, T, H]
            carried = x.new_empty(b, t, 0)
        else:
            message = self.link.recv((b, t, (1 + self.carried_in) * H), dtype, self.device)  # [B, T, (1 + c) H]
            x, carried = message[..., :H].contiguous(), message[..., H:]
        if then is not None and not model.first:  # the next forward's transfer runs during this one's layers
            self.link.post_recv((len(then), max(len(ids) for ids in then), (1 + self.carried_in) * H), dtype, self.device)
        if self.capture is not None:
            self.capture.clear()
        x = model.model.run_layers(x)
        if self.capture is not None:
            carried = torch.cat([carried, self.capture.aux_hidden_states], dim=-1)  # ascending layer order
            self.capture.clear()
        if not model.last:
            self.link.send(torch.cat([x, carried], dim=-1))  # [B, T, (1 + c') H]
            return self._rows_from_leader(lengths, rows_for, post_rows)
        normed = model.model.norm(x)  # [B, T, H]
        del x
        greedy = model.greedy_tokens if self.write_target_argmax else None  # a tp collective of the last stage
        packed = pack_rows({"aux": carried, "last": normed}, lengths, greedy)
        del carried, normed
        if rows_for is None:
            return packed if self.layout.is_group_leader else None
        if self.layout.is_group_leader:
            self._send_rows(packed, lengths, rows_for)
        mine = rows_for.get(self.layout.rank)
        return None if mine is None else select_rows(packed, lengths, mine)

    def _row_shapes(self) -> dict[str, tuple[tuple, torch.dtype]]:
        H, k = self.model.args.hidden_size, len(self.aux_layers)
        dtype = next(self.model.parameters()).dtype
        shapes = {"aux_hidden_states": ((k * H,), dtype), "last_hidden_state": ((H,), dtype)}
        if self.write_target_argmax:
            shapes["target_argmax"] = ((), torch.int32)
        return shapes

    def _send_rows(self, packed: Rows, lengths: list[int], rows_for: dict[int, list[int]]) -> None:
        """The leader: each rank of an earlier stage named in rows_for gets its rows (one message,
        sent without waiting). The sends of at most ROW_FORWARDS_IN_FLIGHT forwards stay in flight:
        before this forward's, those of the oldest beyond are waited for, so the leader holds at
        most that many forwards' rows, [extract.batch_tokens, row bytes] each (the plan's line)."""
        import torch.distributed as dist

        while len(self._row_sends) >= ROW_FORWARDS_IN_FLIGHT:
            for _, work in self._row_sends.pop(0):
                work.wait()
        last_stage = self.layout.rank_of(self.layout.group_index, self.layout.pp - 1, 0)
        sends = []
        for rank, positions in sorted(rows_for.items()):
            if last_stage <= rank < last_stage + self.layout.tp:  # the last stage holds every row already
                continue
            buffer = rows_to_bytes(select_rows(packed, lengths, positions))
            sends.append((buffer, dist.isend(buffer, dst=rank, group=self.rows_group)))
        if sends:
            self._row_sends.append(sends)

    def _rows_from_leader(self, lengths: list[int], rows_for: dict[int, list[int]] | None,
                          post: bool = True) -> PendingRows | None:
        """An earlier stage's rank: its rows from the leader (rows_for) as a PendingRows, its
        receive posted now unless `post` is False; None when this rank has none in the forward."""
        import torch.distributed as dist

        if rows_for is None or self.layout.rank not in rows_for:
            return None
        shapes = self._row_shapes()
        row_bytes = sum(math.prod(shape) * dtype.itemsize for shape, dtype in shapes.values())
        n = sum(lengths[p] for p in rows_for[self.layout.rank])

        def receive():
            buffer = torch.empty(n, row_bytes, dtype=torch.uint8, device=self.device)
            return buffer, dist.irecv(buffer, src=self.layout.leader, group=self.rows_group)

        pending = PendingRows(receive, shapes)
        if post:
            pending.post()
        return pending

    def pause(self) -> None:
        """The caller runs no forward for a while (online training's draft step): the sends the
        next stage has taken are let go, the newest stays in flight (it carries the forward run
        ahead, which the next stage receives during the pause): one send, not two, held then."""
        if self.link is not None:
            self.link.drain(keep=1)

    def close(self) -> None:
        if self.link is not None:
            self.link.drain()
            while self._row_sends:
                for _, work in self._row_sends.pop(0):
                    work.wait()
        if self.capture is not None:
            self.capture.__exit__(None, None, None)


def load_native_target(cfg: Config, layout: Layout, write_target_argmax: bool, check_memory: Callable | None = None,
                       check_inputs: Callable[[int], None] | None = None,
                       stage_ranges: Callable[[], list[range] | None] | None = None) -> NativeTarget:
    """The target of target.path on this rank: checkpoint info, the memory check (check_memory(info),
    default: the extraction plan's) and the caller's check_inputs(vocab_size) before any weight is
    read, then this rank's slices (its stage's layers, its tp share) loaded. stage_ranges(): the
    stages' layers the memory check chose (online training cuts them by memory too), called after
    it; None or no callable: config_stage_layers, the cut by compute."""
    info = read_checkpoint_info(target_path(cfg.target))
    planned_bytes = (check_memory or (lambda i: check_extract_memory(cfg, i, layout)))(info)
    if check_inputs is not None:
        check_inputs(info.args.vocab_size)
    aux_layers = resolve_aux_layers(cfg.extract.aux_layers, info.args.num_hidden_layers)
    header = manifest_header(cfg, info, aux_layers)
    header["has_target_argmax"] = bool(write_target_argmax)
    # the raw config.json (text_config inside for Kimi): the draft is sized from it
    hf_config = read_json_object(info.path / "config.json", "a model's config.json")
    tp = tensor_parallel(layout)
    stages = (stage_ranges() if stage_ranges is not None else None) or config_stage_layers(cfg, info.args)
    layers = stages[layout.stage]
    if layout.pp > 1 and layout.is_main:
        log.info("pipeline: %d stages of layers %s", layout.pp, ", ".join(f"{r.start}-{r.stop - 1}" for r in stages))
    model = build_model(info, tp, cfg.target.expert_layout, torch_dtype(cfg.target.dtype), layout.device,
                        cfg.target.prefill_attention, cfg.target.moe_backend, layers, layout.stage == 0,
                        layout.stage == layout.pp - 1)
    stats = load_weights(model, info, show_progress=layout.is_main)
    log.info("rank 0 read %.2f GiB in %d tensors", stats.bytes_read / GIB, stats.tensors_read)
    target = NativeTarget(model, layout, aux_layers, write_target_argmax, header, hf_config)
    target.planned_bytes = planned_bytes
    target.nonfinite_weights = group_nonfinite_weights(model, layout)
    return target


def group_nonfinite_weights(model: DeepseekV3ForExtraction, layout: Layout) -> list[str]:
    """The weights holding NaN/Inf over this rank's group (each rank scans its own slices; one
    gather, which every rank of the job calls at load): a NaN in another rank's slice makes the
    group's states NaN as well."""
    found = layout.all_gather_object(nonfinite_weights(model))
    ranks = layout.group_ranks
    return [f"{name} (rank {rank})" if len(ranks) > 1 else name for rank in ranks for name in found[rank]]


def forward_batch(model: DeepseekV3ForExtraction, capture: HiddenStateCapture, input_ids: list[list[int]],
                  device: torch.device, write_target_argmax: bool, keep: bool = True) -> dict[str, torch.Tensor] | None:
    """One right-padded forward (causal, so padding never reaches real tokens; no mask needed):
    the packed rows of target.forward_packed. `keep` = False (a group's non-leader ranks): take
    part in the forward and the argmax, return None."""
    # the argmax is a collective over the group's vocabulary shards: every rank calls it
    greedy = model.greedy_tokens if write_target_argmax else None
    packed = forward_packed(lambda tokens, mask: model(tokens), capture, input_ids, 0, device, greedy)
    return packed if keep else None


def manifest_header(cfg: Config, info, aux_layers: list[int]) -> dict:
    a = info.args
    tokenizer_config = info.path / "tokenizer_config.json"
    chat_template = None
    if tokenizer_config.is_file():
        chat_template = read_json_object(tokenizer_config, "a tokenizer's config").get("chat_template")
    return {
        "target": {"path": str(info.path), "architecture": info.architecture, "num_layers": a.num_hidden_layers,
                   "hidden_size": a.hidden_size, "vocab_size": a.vocab_size},
        "aux_layer_ids": aux_layers,
        "tokenizer": str(info.path),
        "chat_template": chat_template,
        "max_length": cfg.data.max_length,
        "has_target_argmax": bool(cfg.extract.write_target_argmax),
    }


def check_extract_memory(cfg: Config, info, layout: Layout) -> float | None:
    """Refuse to start when the planner says the layout does not fit this GPU; the bytes it plans
    for this rank's stage (None on the CPU)."""
    gpu_gib = cfg.target.gpu_memory_gib
    if gpu_gib:
        gpu_bytes = int(gpu_gib * GIB)
    elif layout.device.type == "cuda":
        gpu_bytes = torch.cuda.get_device_properties(layout.device).total_memory
    else:
        return None
    plans = check_fits(cfg, info.args, info.quantized_experts, gpu_bytes)  # every stage, before any weight is read
    if layout.is_main:
        log.info("memory plan:\n%s", "\n".join(format_plan(plan, gpu_bytes) for plan in plans))
    return plans[layout.stage].total_bytes
