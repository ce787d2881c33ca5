"""Benchmark: online training on one GPU (`make bench-online`; BENCHMARKS.md, "Online training"):
the Kimi-shaped extraction model of bench-extract (benchmarks/kimi_shaped.py) feeding the
Kimi-shaped draft with the Kimi configs' step options, through the trainer's DraftWithLoss,
TTTLoss and AdamW as train/loop.py runs it.

Three timings on the same batches of --tokens tokens (sequences of --seq): extraction alone
(extract/native/target.py forward_batch, the rows padded into a training batch on the device),
training alone (steps on one captured batch) and online (each batch's forward in line before its
step, as the trainer runs them). Prints tokens/s of each, the serial ideal 1 / (1/extract +
1/train), online's ratio to it, and the peak memory against train/online_plan.py's plan.

--stage N: one rank of the pp-8 pipeline-online path (train/online.py) on one GPU: a middle stage
of N MoE layers (8: the pilot's fullest) with its messages through an in-process link, this
rank's rows arriving into the last stage's buffer, the frozen embedding's rows gathered on the
host, and the draft's step with bf16 parameters and the whole optimizer on this rank (no FSDP) in
the online plan's checkpoint mode for the pilot (or --checkpoint). Per slot the stage forwards 8
ranks' batches (in forwards of --forward-tokens) and the draft steps on one. Prints both rates,
their peak memory against the plan's stage at a world of 1 (less the FSDP2 gather), and the
pilot's projected tokens/s a group (COMPUTED: 1 / (1/stage rate + 1/(8 x draft rate)), scaled
by the stated / measured matmul rate; the last stage and PCIe are not in it).

    python3 benchmarks/bench_online.py --tokens 16384 --json $OUT/online.json
    python3 benchmarks/bench_online.py --stage 8 --tokens 8192 --json $OUT/online_stage.json   # one H200
    python3 benchmarks/bench_online.py [--stage 2] --tiny    # CPU check: its numbers only show it runs
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench_common import device_name, device_peaks, matmul_tflops, sync, write_json  # noqa: E402
from kimi_shaped import KIMI_K25_TEXT, build_bench_model, kimi_args, tiny_args  # noqa: E402  (imports eagleforge from a bare checkout)

from eagleforge.config import Config  # noqa: E402
from eagleforge.draft import Eagle3Config, Eagle3Draft  # noqa: E402
from eagleforge.extract.native.target import forward_batch  # noqa: E402
from eagleforge.target.capture import HiddenStateCapture  # noqa: E402
from eagleforge.train.batching import pad_batch  # noqa: E402
from eagleforge.train.distributed import DraftWithLoss, clip_grad_norm  # noqa: E402
from eagleforge.train.loop import ttt_loss_of  # noqa: E402
from eagleforge.train.online_plan import GIB, plan_online  # noqa: E402
from eagleforge.train.step_plan import resolve_param_dtype  # noqa: E402
from eagleforge.train.weight_grads import fuse_weight_grads  # noqa: E402


def overlap_report(target_tokens: int, target_seconds: float, train_tokens: int, train_seconds: float,
                   online_tokens: int, online_seconds: float) -> dict:
    """Rates in tokens/s and the online rate over the serial ideal 1 / (1/extract + 1/train):
    above 1 when the target's forwards overlap the draft's training."""
    extract = target_tokens / target_seconds if target_seconds else float("nan")
    train = train_tokens / train_seconds if train_seconds else float("nan")
    online = online_tokens / online_seconds if online_seconds else float("nan")
    serial = 1.0 / (1.0 / extract + 1.0 / train)
    return {"extract_tokens_per_s": extract, "train_tokens_per_s": train, "online_tokens_per_s": online,
            "serial_ideal_tokens_per_s": serial, "ratio_to_serial": online / serial}


def text_config(args) -> dict:
    """The target's text config for the draft's shape: Kimi-K2.5's with this run's model widths."""
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "kv_lora_rank", "v_head_dim",
            "qk_nope_head_dim")
    return {**KIMI_K25_TEXT, **{k: getattr(args, k) for k in keys}}


def report_peaks(result: dict, plan: str) -> None:
    """The peak memory (device_peaks: what the plan counts is the memory in use on the device, as
    check_plan.py reads it for extraction) against the plan; on the CPU the plan alone."""
    if result["peak_allocated_gib"] is None:
        print(f"{plan} (CPU run: no device peak to compare)")
    else:
        print(f"peak allocated {result['peak_allocated_gib']:.2f} GiB, reserved {result['peak_reserved_gib']:.2f} GiB, "
              f"in use {result['peak_in_use_gib']:.2f} GiB; {plan}")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=8192, help="tokens per batch (train.batch_tokens = extract.batch_tokens)")
    p.add_argument("--seq", type=int, default=2048, help="tokens per sequence")
    p.add_argument("--layers", type=int, default=4, help="target layers (1 dense + the rest MoE)")
    p.add_argument("--steps", type=int, default=8, help="timed batches per mode")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--tiny", "--cpu", dest="tiny", action="store_true", help="toy shapes on the CPU")
    p.add_argument("--stage", type=int, default=0, help="N > 0: one middle pipeline stage of N MoE layers online (see above)")
    p.add_argument("--forward-tokens", type=int, default=8192, help="--stage: tokens per target forward (extract.batch_tokens)")
    p.add_argument("--checkpoint", default="plan", help="--stage: the draft's checkpoint mode; plan = the online plan's for the pilot")
    p.add_argument("--json", default=None)
    opt = p.parse_args(argv)
    if opt.stage:
        return stage_main(opt)

    device = torch.device("cpu" if opt.tiny or not torch.cuda.is_available() else "cuda")
    if opt.tiny:
        opt.tokens, opt.seq = min(opt.tokens, 256), min(opt.seq, 64)
    args = tiny_args(3) if opt.tiny else kimi_args(opt.layers)
    aux = [0, 1, 2] if opt.tiny else [1, 2, 3]
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    target = build_bench_model(args, device=device, dtype=dtype)

    cfg = Config()
    tc = cfg.train
    tc.batch_tokens, tc.ttt_steps = opt.tokens, (3 if opt.tiny else 7)
    tc.bf16 = device.type == "cuda"
    tc.activation_checkpoint, tc.attention, tc.compile = ("none", "auto", False) if opt.tiny else \
        ("selective_all", "merged_cudnn", True)  # the Kimi configs' step options
    cfg.extract.batch_tokens, cfg.extract.aux_layers = opt.tokens, aux
    cfg.target.tp, cfg.data.max_length = 1, opt.seq
    cfg.vocab.draft_vocab_size = 256 if opt.tiny else 32000

    text = {**text_config(args), "num_hidden_layers": args.num_hidden_layers}
    vd = cfg.vocab.draft_vocab_size
    torch.manual_seed(0)
    param_dtype = resolve_param_dtype(tc, device, "none")  # as the trainer: bf16 parameters on CUDA
    draft = Eagle3Draft(Eagle3Config.from_target_config(text, vd, aux)).to(device, param_dtype)
    fuse_weight_grads(draft, param_dtype == torch.bfloat16)
    draft.set_vocab_map(torch.zeros(vd, dtype=torch.int64), torch.arange(args.vocab_size) < vd)  # draft ids = the first Vd
    draft.embed_tokens.weight.requires_grad_(False)
    if target.model.embed_tokens.weight.dtype == param_dtype:  # as the trainer at tp 1: the target's own tensor
        draft.embed_tokens.weight = torch.nn.Parameter(target.model.embed_tokens.weight, requires_grad=False)
    teacher_head = (torch.randn(vd, args.hidden_size, device=device) * 0.02).to(torch.bfloat16 if tc.bf16 else torch.float32)
    model = DraftWithLoss(draft, ttt_loss_of(cfg, teacher_head, device, tc.activation_checkpoint, tc.compile))
    params = [q for q in model.parameters() if q.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95))

    gen = torch.Generator().manual_seed(1)
    n_seq = max(1, opt.tokens // opt.seq)
    batches = [[torch.randint(0, args.vocab_size, (opt.seq,), generator=gen).tolist() for _ in range(n_seq)]
               for _ in range(opt.warmup + opt.steps)]
    tokens_per_batch = n_seq * opt.seq

    capture = HiddenStateCapture(target.model.layers, aux, target.model.norm).__enter__()

    def produce(i: int):
        """The online source's work for one batch: target forward, the rows padded on the device."""
        ids = batches[i]
        packed = forward_batch(target, capture, ids, device, write_target_argmax=True, keep=True)
        rows, row = [], 0
        for seq in ids:
            n = len(seq)
            rows.append({"input_ids": torch.tensor(seq, device=device), "loss_mask": torch.ones(n, dtype=torch.bool, device=device),
                         **{k: v[row:row + n] for k, v in packed.items()}})
            row += n
        return pad_batch(rows).to(device, param_dtype)  # the trainer's batch, in the draft's input dtype

    def train_step(batch) -> None:
        optimizer.zero_grad(set_to_none=True)
        loss, _ = model(batch.aux_hidden_states, batch.input_ids, batch.last_hidden_state, batch.loss_mask,
                        batch.target_argmax)
        loss.backward()
        clip_grad_norm(params, 0.5)
        optimizer.step()

    def timed(fn) -> float:
        """Seconds of fn(i) over the timed batches, after fn on the warm-up ones."""
        for i in range(opt.warmup):
            fn(i)
        sync(device)
        start = time.perf_counter()
        for i in range(opt.warmup, opt.warmup + opt.steps):
            fn(i)
        sync(device)
        return time.perf_counter() - start

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    extract_s = timed(produce)
    one = produce(0)
    train_s = timed(lambda i: train_step(one))  # noqa: F821 (bound above; deleted only after the call)
    del one
    online_s = timed(lambda i: train_step(produce(i)))  # as the trainer: each forward in line before its step
    n = opt.steps * tokens_per_batch
    report = overlap_report(n, extract_s, n, train_s, n, online_s)
    plan = plan_online(cfg, world=1, args=args, quantized=True)
    result = {"device": device_name(device), "tokens_per_batch": tokens_per_batch, "steps": opt.steps,
              "layers": args.num_hidden_layers, **report, **device_peaks(device), "plan_gib": plan.total_bytes() / GIB}
    print(f"\nonline training, {result['device']}, {tokens_per_batch} tokens per batch, {opt.steps} batches, "
          f"{args.num_hidden_layers}-layer target")
    print(f"{'mode':<34}{'tokens/s':>12}")
    print(f"{'extraction alone':<34}{report['extract_tokens_per_s']:>12.0f}")
    print(f"{'training alone':<34}{report['train_tokens_per_s']:>12.0f}")
    print(f"{'serial ideal 1/(1/ex + 1/tr)':<34}{report['serial_ideal_tokens_per_s']:>12.0f}")
    print(f"{'online (forwards in line)':<34}{report['online_tokens_per_s']:>12.0f}")
    print(f"{'online / serial ideal':<34}{report['ratio_to_serial']:>12.3f}")
    report_peaks(result, f"plan {plan.total_bytes() / GIB:.2f} GiB (target {plan.target.total_bytes / GIB:.2f}, draft "
                         f"{plan.draft_bytes() / GIB:.2f}; the plan includes the runtime reserve)")
    write_json(opt.json, result)
    return result


PILOT_GROUP = 8  # the pilot's GPUs a group: a slot forwards this many ranks' batches


def stage_main(opt) -> dict:
    """--stage N: see the module docstring."""
    import collections

    from kimi_shaped import randomize_

    from eagleforge.config import load_config
    from eagleforge.extract.native.model import DeepseekV3ForExtraction
    from eagleforge.extract.native.parallel import TensorParallel
    from eagleforge.extract.native.preflight import STATED_RATES
    from eagleforge.extract.native.target import NativeTarget
    from eagleforge.layout import Layout
    from eagleforge.target.protocol import rows_from_bytes
    from eagleforge.train.batching import gather_embeddings
    from eagleforge.train.online_plan import _Planner, checkpoint_candidates, plan_online
    from eagleforge.train.optimizer import build_optimizer

    device = torch.device("cpu" if opt.tiny or not torch.cuda.is_available() else "cuda")
    if opt.tiny:
        opt.tokens, opt.seq, opt.forward_tokens = min(opt.tokens, 256), min(opt.seq, 64), min(opt.forward_tokens, 128)
    n = opt.stage
    # layers 2 .. n+1 held; aux layers 0 and 1 come with the input (as Kimi's 1 and 29 at layers 32-39), the third after
    args = (tiny_args if opt.tiny else kimi_args)(n + 4)
    aux = [0, 1, n + 3]
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    with torch.device(device):
        model = DeepseekV3ForExtraction(args, TensorParallel(), "ep", dtype, True, range(2, 2 + n), first=False, last=False)
    randomize_(model.eval().requires_grad_(False), 0)
    hidden = args.hidden_size
    gen = torch.Generator().manual_seed(1)

    class Link:  # the previous stage's messages made ahead; this stage's newest send kept (in flight)
        def __init__(self):
            self.sent = collections.deque(maxlen=1)
            self.posted = collections.deque()

        def post_recv(self, shape, dtype, device):
            self.posted.append(torch.randn(shape, generator=gen).to(device, dtype))

        def recv(self, shape, dtype, device):
            if not self.posted:
                self.post_recv(shape, dtype, device)
            return self.posted.popleft()

        def send(self, tensor):
            self.sent.append(tensor.contiguous())

        def drain(self, keep=0):
            while len(self.sent) > keep:
                self.sent.popleft()

    target = NativeTarget(model, Layout(world_size=8, rank=4, pp=8, device=device), aux, write_target_argmax=True, link=Link())

    cfg = load_config(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs", "kimi_k25_pilot.yaml"),
                      ["train.source=online", "target.path=/nonexistent", f"train.batch_tokens={opt.tokens}"])
    tc = cfg.train
    mode = opt.checkpoint
    if mode == "plan":  # what the trainer runs with on the pilot's 96 GB cards at pp 8
        mode = plan_online(cfg, world=8, gpu_bytes=96e9).checkpoint
    if opt.tiny:
        tc.ttt_steps, tc.bf16, tc.attention, tc.compile, mode = 3, False, "auto", False, "step"
    param_dtype = torch.bfloat16 if tc.bf16 else torch.float32
    text = text_config(args)
    vd = 256 if opt.tiny else cfg.vocab.draft_vocab_size
    torch.manual_seed(0)
    draft = Eagle3Draft(Eagle3Config.from_target_config(text, vd, aux))
    draft.set_vocab_map(torch.zeros(vd, dtype=torch.int64), torch.arange(args.vocab_size) < vd)
    embedding = draft.embed_tokens.weight.detach().to(param_dtype)  # the frozen [V, H] on the host
    draft.embed_tokens.weight = torch.nn.Parameter(embedding.new_empty(0, hidden), requires_grad=False)
    draft = draft.to(device, param_dtype)
    fuse_weight_grads(draft, param_dtype == torch.bfloat16)
    teacher_head = (torch.randn(vd, hidden, generator=gen) * 0.02).to(device, param_dtype)
    model_loss = DraftWithLoss(draft, ttt_loss_of(cfg, teacher_head, device, mode, tc.compile))
    params = [q for q in model_loss.parameters() if q.requires_grad]
    optimizer = build_optimizer(params, param_dtype, 1e-4, (0.9, 0.999), 0.0)

    n_seq = max(1, opt.tokens // opt.seq)
    shapes = target._row_shapes()
    row_bytes = sum(int(torch.Size(shape).numel()) * dt.itemsize for shape, dt in shapes.values())

    def slot_forwards() -> None:
        """The stage's forwards of one slot: 8 ranks' batches, in forwards of --forward-tokens."""
        per_forward = max(1, opt.forward_tokens // opt.seq)
        ids = [[0] * opt.seq] * (PILOT_GROUP * n_seq)
        chunks = [ids[i:i + per_forward] for i in range(0, len(ids), per_forward)]
        for c, chunk in enumerate(chunks):
            target.forward(chunk, then=chunks[c + 1] if c + 1 < len(chunks) else chunks[0])
        target.pause()

    def batch_of_slot():
        """This rank's rows arriving (the buffer the last stage's message fills), the batch made."""
        buffer = torch.randint(0, 256, (n_seq * opt.seq, row_bytes), generator=gen, dtype=torch.uint8).to(device)
        rows = rows_from_bytes(buffer, shapes)
        del buffer
        rows["aux_hidden_states"].normal_()
        rows["last_hidden_state"].normal_()
        rows["target_argmax"].random_(0, vd)
        samples, row = [], 0
        for _ in range(n_seq):
            samples.append({"input_ids": torch.randint(0, args.vocab_size, (opt.seq,), generator=gen).to(device),
                            "loss_mask": torch.ones(opt.seq, dtype=torch.bool, device=device),
                            **{key: value[row:row + opt.seq] for key, value in rows.items()}})
            row += opt.seq
        batch = pad_batch(samples)
        batch.input_embeds = gather_embeddings(embedding, batch.input_ids.cpu(), tc.ttt_steps, pin=device.type == "cuda")
        return batch.to(device, None)

    def step(batch) -> None:
        optimizer.zero_grad(set_to_none=True)
        loss, _ = model_loss(batch.aux_hidden_states, batch.input_ids, batch.last_hidden_state, batch.loss_mask,
                             batch.target_argmax, batch.input_embeds)
        loss.backward()
        clip_grad_norm(params, 0.5)
        optimizer.step()

    def timed(fn, count: int) -> float:
        sync(device)
        start = time.perf_counter()
        for _ in range(count):
            fn()
        sync(device)
        return (time.perf_counter() - start) / count

    batches = collections.deque(maxlen=1)
    for _ in range(opt.warmup):
        slot_forwards()
        step(batch_of_slot())
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    forward_s = timed(slot_forwards, opt.steps)
    batches.append(batch_of_slot())
    step_s = timed(lambda: step(batches[0]), opt.steps)
    online_s = timed(lambda: (slot_forwards(), step(batch_of_slot())), opt.steps)
    peaks = device_peaks(device)

    tokens = n_seq * opt.seq
    stage_rate = PILOT_GROUP * tokens / forward_s  # tokens/s through this stage
    draft_rate = tokens / step_s
    recompute = dict(checkpoint_candidates(draft.config, tc.ttt_steps)).get(mode, 0.0)
    measured_tflops = matmul_tflops(device)
    scale = STATED_RATES.matmul_tflops / measured_tflops  # this GPU's rates to the pilot's stated one
    pilot = 1.0 / (1.0 / (stage_rate * scale) + 1.0 / (PILOT_GROUP * draft_rate * scale))
    planner = _Planner(cfg, 1)
    plan_stage = planner.stage(range(32, 32 + n), 4, mode)  # the online plan's line for this stage, world 1
    # one rank without FSDP2 steps its own weights: no gathered bf16 copy of them (2 bytes a parameter) at the step
    plan_total = plan_stage.total_bytes(opt.tokens) - 2 * planner.trainable
    result = {"device": device_name(device), "stage_moe_layers": n, "tokens_per_batch": tokens,
              "forward_tokens": opt.forward_tokens, "checkpoint": mode, "steps": opt.steps, "stage_tokens_per_s": stage_rate,
              "draft_tokens_per_s": draft_rate, "slot_s": online_s, "serial_slot_s": forward_s + step_s, "matmul_tflops": measured_tflops,
              "recompute_share": recompute, "pilot_projected_tokens_per_s": pilot, **peaks, "plan_gib": plan_total / GIB}
    print(f"\npipeline-online stage, {result['device']}: {n} MoE layers, {PILOT_GROUP} x {tokens} tokens a slot in forwards of "
          f"{opt.forward_tokens}, the draft's step on {tokens} tokens with {mode}")
    print(f"  stage forwards {stage_rate:,.0f} tokens/s, draft step {draft_rate:,.0f} tokens/s, a slot {online_s * 1e3:.0f} ms "
          f"(forwards + step timed apart: {(forward_s + step_s) * 1e3:.0f} ms)")
    print(f"  the pilot's training tokens/s a group, COMPUTED from these rates x {STATED_RATES.matmul_tflops:.0f} / "
          f"{measured_tflops:.0f} TFLOP/s: {pilot:,.0f}")
    report_peaks(result, f"the online plan's stage at a world of 1 (the draft's states unsharded, no FSDP2 gather): "
                         f"{plan_total / GIB:.2f} GiB")
    write_json(opt.json, result)
    return result


if __name__ == "__main__":
    main()
