"""extract/writer.py: the overlapped writer (order, back-pressure, errors) and fp8 storage error."""

from __future__ import annotations

import time

import pytest
import torch

from eagleforge.extract.writer import FP8_MAX, OverlappedWriter, dequantize_fp8, fp8_error, quantize_fp8


def test_writer_delivers_in_order_and_counts_bytes():
    got = []
    with OverlappedWriter(lambda meta, t: got.append((meta, {k: v.clone() for k, v in t.items()})), max_pending=2) as w:
        sent = []
        for i in range(7):
            tensors = {"aux": torch.randn(3 + i, 5), "ids": torch.arange(i + 1, dtype=torch.int32)}
            sent.append(tensors)
            w.submit(tensors, meta=i)
    assert [m for m, _ in got] == list(range(7))
    for (_, t), s in zip(got, sent):
        assert torch.equal(t["aux"], s["aux"]) and torch.equal(t["ids"], s["ids"])
    assert w.stats.items == 7
    assert w.stats.bytes == sum(s["aux"].numel() * 4 + s["ids"].numel() * 4 for s in sent)


def test_writer_copies_so_producer_may_reuse_its_tensors():
    got = []
    buf = torch.zeros(4)
    with OverlappedWriter(lambda meta, t: got.append(t["x"].clone())) as w:
        for i in range(3):
            buf.fill_(i)
            w.submit({"x": buf}, meta=i)
    assert [float(g[0]) for g in got] == [0.0, 1.0, 2.0]


def test_slow_sink_blocks_the_producer():
    """A sink slower than the producer fills the queue: submit waits, and the wait is reported.

    The sink holds item 0 until released; with one queue slot, item 1 fills it and the submit of
    item 2 must wait. Once the producer is seen waiting in the queue, the release comes at least
    0.1 s later, so the reported wait is at least the time from then to the release, whatever the
    machine's load."""
    import threading

    release, order = threading.Event(), []

    def slow(meta, t):
        order.append(("sink", meta))
        if meta == 0:
            assert release.wait(120)
        else:
            time.sleep(0.05)

    with OverlappedWriter(slow, max_pending=1) as w:
        def produce():
            for i in range(5):
                w.submit({"x": torch.ones(2)}, meta=i)
                order.append(("submitted", i))

        producer = threading.Thread(target=produce)
        producer.start()
        deadline = time.monotonic() + 120  # a bound on a hang only
        # the sink holds item 0, item 1 fills the slot, and the producer waits for a free slot (a
        # waiter on queue.Queue's condition): it is in the submit of item 2, which only the release ends
        while not (("sink", 0) in order and w._queue.full() and w._queue.not_full._waiters):
            assert producer.is_alive() and time.monotonic() < deadline, order
            time.sleep(0.001)
        waiting_since = time.perf_counter()
        time.sleep(0.1)
        released_at = time.perf_counter()
        order.append(("release", 0))
        release.set()
        producer.join(120)
    # items 0 and 1 went in at once (the sink's item and the one slot); item 2 only after the sink let go of item 0
    assert order.index(("submitted", 1)) < order.index(("release", 0)) < order.index(("submitted", 2)), order
    assert w.stats.submit_blocked_s >= released_at - waiting_since, (w.stats, released_at - waiting_since)
    assert w.stats.sink_s >= 0.1 + 4 * 0.05


def test_sink_error_reaches_the_producer():
    def failing(meta, t):
        if meta == 1:
            raise OSError("disk full (test)")

    w = OverlappedWriter(failing, max_pending=1)
    w.submit({"x": torch.ones(1)}, 0)
    w.submit({"x": torch.ones(1)}, 1)
    with pytest.raises(RuntimeError, match="disk full"):
        for i in range(2, 50):  # the failure surfaces at a later submit or at close
            w.submit({"x": torch.ones(1)}, i)
            time.sleep(0.005)
        w.close()
    w._queue.put(w._STOP)
    w._thread.join(timeout=5)
    assert not w._thread.is_alive()


@pytest.mark.parametrize("N,D,block", [(7, 96, 32), (5, 40, None), (1, 8, 8)])
def test_fp8_round_trip(N, D, block):
    x = torch.randn(N, D, dtype=torch.float64) * torch.logspace(-3, 3, N, dtype=torch.float64)[:, None]
    x[0, : (block or D)] = 0  # an all-zero block keeps scale 1 and dequantizes to zeros
    q, scale = quantize_fp8(x, block)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (N, D // (block or D))
    back = dequantize_fp8(q, scale, torch.float64)
    # e4m3: 3 mantissa bits -> each value within 2^-4 relative, or half the smallest subnormal step
    step = scale.repeat_interleave(block or D, dim=1).double()
    assert ((back - x).abs() <= x.abs() * 2.0**-4 + step * 2.0**-9).all()
    assert (back[0, : (block or D)] == 0).all()
    assert float(q.float().abs().max()) <= FP8_MAX


def test_fp8_rejects_bad_block():
    with pytest.raises(ValueError, match="multiple"):
        quantize_fp8(torch.randn(3, 10), 4)


def test_fp8_error_on_real_hidden_states():
    """fp8 vs bf16 storage of SmolLM2's aux states (layers 1, 14, 26) on a real prompt."""
    from eagleforge.config import TargetConfig
    from eagleforge.target.loading import load_target

    model, tokenizer = load_target(TargetConfig(device="cpu"))
    ids = tokenizer("Explain what json.dumps does and show a short example of its use.", return_tensors="pt").input_ids
    with torch.no_grad():
        states = model(ids, output_hidden_states=True).hidden_states
    H = states[0].shape[-1]
    aux = torch.cat([states[i + 1][0] for i in (1, 14, 26)], -1).float()  # [T, 3H]
    err = fp8_error(aux, block=H)
    # e4m3's 3 mantissa bits: about 2-3% RMS; bf16's 8 bits: about 0.2%
    assert err["fp8_rel_l2"] < 0.04 and err["bf16_rel_l2"] < 0.005, err
    assert err["fp8_min_token_cosine"] > 0.998, err


def test_project_errors_arrive_as_themselves():
    """A full disk is a UserInputError from ShardWriter: the entry point must see that class (one
    line, exit 2), not a RuntimeError wrapping it."""
    from eagleforge.errors import UserInputError

    def full(meta, t):
        raise UserInputError("shard-00003.safetensors: cannot write, no space left on device")

    w = OverlappedWriter(full, max_pending=1)
    w.submit({"x": torch.ones(1)}, 0)
    with pytest.raises(UserInputError, match="shard-00003"):
        for i in range(1, 50):
            w.submit({"x": torch.ones(1)}, i)
            time.sleep(0.005)
        w.close()
    w._queue.put(w._STOP)
    w._thread.join(timeout=5)


# ----------------------------------------------------------------------------- ShardSink


def _rows(gen, lengths, first_id):
    return [{"id": first_id + i, "input_ids": torch.randint(0, 50, (n,), generator=gen).tolist(),
             "loss_mask": torch.randint(0, 2, (n,), generator=gen).tolist()} for i, n in enumerate(lengths)]


@pytest.mark.parametrize("overlap", [True, False])
def test_shard_sink_assembles_chunks_from_batches_in_any_order(tmp_path, overlap):
    """Batches of a chunk arrive in the extractor's (length-sorted) order; the shard holds the
    chunk's samples in id order, NaN/Inf samples left out and listed; equal to a direct write."""
    from eagleforge.extract.writer import BatchRows, ShardSink, make_writer
    from eagleforge.shards import ShardReader, ShardWriter, load_manifest

    H, k = 7, 2
    header = {"target": {"path": "x", "architecture": "A", "num_layers": 5, "hidden_size": H, "vocab_size": 50},
              "aux_layer_ids": [1, 3], "has_target_argmax": True}
    gen = torch.Generator().manual_seed(0)
    chunks = [_rows(gen, [5, 2, 9, 1], 0), _rows(gen, [3, 8], 10)]
    states = {row["id"]: {"aux_hidden_states": torch.randn(len(row["input_ids"]), k * H, generator=gen),
                          "last_hidden_state": torch.randn(len(row["input_ids"]), H, generator=gen),
                          "target_argmax": torch.randint(0, 50, (len(row["input_ids"]),), generator=gen, dtype=torch.int32)}
              for chunk in chunks for row in chunk}
    states[2]["aux_hidden_states"][4, 0] = float("inf")
    batches = [(0, [2, 0]), (0, [3, 1]), (1, [1, 0])]  # positions within the chunk, not in id order
    sink = ShardSink(ShardWriter(tmp_path / "sink", header, "bfloat16"))
    with make_writer(sink, overlap) as out:
        for c, positions in batches:
            packed = {key: torch.cat([states[chunks[c][j]["id"]][key] for j in positions]) for key in states[0]}
            out.submit(packed, BatchRows(c, chunks[c], positions))
            for t in packed.values():
                t.fill_(7)  # the producer reuses its buffers: the sink must not see this
    assert sink.skipped == 1 and sink.shards_written == 2
    direct = ShardWriter(tmp_path / "direct", header, "bfloat16")
    for c, chunk in enumerate(chunks):
        keep = [row for row in chunk if row["id"] != 2]
        samples = [{**states[row["id"]], "input_ids": torch.tensor(row["input_ids"]),
                    "loss_mask": torch.tensor(row["loss_mask"])} for row in keep]
        direct.write_shard(c, samples, [row["id"] for row in keep], [2] if c == 0 else [])
    got, want = load_manifest(tmp_path / "sink")["shards"], load_manifest(tmp_path / "direct")["shards"]
    assert [(e["sha256"], e["sample_ids"], e["skipped_ids"]) for e in got] == \
        [(e["sha256"], e["sample_ids"], e["skipped_ids"]) for e in want]
    assert ShardReader(tmp_path / "sink", verify_checksums=True).sample_ids() == [0, 1, 3, 10, 11]


class _PlainMemoryWriter(OverlappedWriter):
    _alloc = staticmethod(lambda nbytes: torch.empty(nbytes, dtype=torch.uint8))


def test_buffer_pool_reuses_the_smallest_fitting_buffer_by_identity():
    """The pool logic of the CUDA path on the CPU (plain memory instead of pinned). Buffers of
    different sizes in the free list must be told apart by identity, not compared elementwise
    (a list.remove there broke every CUDA extraction with batches of varying rows)."""
    with _PlainMemoryWriter(lambda meta, t: None, max_pending=1, pool_size=3) as w:
        a, view_a = w._take(torch.Size([37, 96]), torch.bfloat16)
        b, _ = w._take(torch.Size([5, 96]), torch.bfloat16)
        c, _ = w._take(torch.Size([40, 96]), torch.float32)
        assert view_a.shape == (37, 96) and view_a.dtype == torch.bfloat16
        w._give_back([a, b, c])
        assert sorted(x.numel() for x in w._free) == sorted(x.numel() for x in (a, b, c))
        got, view = w._take(torch.Size([36, 96]), torch.bfloat16)  # fits a (and c): the smaller
        assert got is a and view.data_ptr() == a.data_ptr() and view.shape == (36, 96)
        assert all(x is not a for x in w._free) and len(w._free) == 2
        big, _ = w._take(torch.Size([1000, 96]), torch.float32)  # fits none: a new buffer
        assert all(big is not x for x in (a, b, c)) and big.numel() >= 1000 * 96 * 4
        w._give_back([got, big])
        assert len(w._free) == 3 and max(x.numel() for x in w._free) == big.numel()  # largest kept


@pytest.mark.gpu
def test_cuda_copies_pool_pinned_buffers_of_varying_rows():
    got = []
    with OverlappedWriter(lambda meta, t: got.append((meta, {k: v.clone() for k, v in t.items()})), max_pending=2) as w:
        sent = []
        for i, rows in enumerate([37, 5, 36, 40, 1, 0, 38]):
            t = {"aux": torch.randn(rows, 96, device="cuda", dtype=torch.bfloat16),
                 "ids": torch.arange(rows, device="cuda", dtype=torch.int32)}
            sent.append({k: v.cpu() for k, v in t.items()})
            w.submit(t, meta=i)
    assert [m for m, _ in got] == list(range(7))
    for (_, g), s in zip(got, sent):
        assert torch.equal(g["aux"], s["aux"]) and torch.equal(g["ids"], s["ids"])
    assert 0 < len(w._free) <= w._pool_size and all(b.is_pinned() for b in w._free)
