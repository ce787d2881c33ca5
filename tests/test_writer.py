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
    """A sink slower than the producer fills the queue: submit waits, and the wait is reported."""
    def slow(meta, t):
        time.sleep(0.05)

    with OverlappedWriter(slow, max_pending=1) as w:
        for i in range(5):
            w.submit({"x": torch.ones(2)}, meta=i)
    assert w.stats.submit_blocked_s > 0.08, w.stats
    assert w.stats.sink_s >= 0.2


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
    from eagleforge.target import load_target

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
