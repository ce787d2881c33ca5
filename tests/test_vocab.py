"""Draft vocabulary selection, d2t/t2d, coverage, target head reading, and the vocab stage."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from eagleforge.config import Config
from eagleforge.errors import UserInputError
from eagleforge.vocab import (
    count_tokens,
    coverage,
    draft_to_target_ids,
    load_target_head,
    load_vocab_map,
    read_target_head,
    select_draft_vocab,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models: one thread is faster


# ----------------------------------------------------------------------------- a tiny real run


def build_tiny_run(tmp_path, llama_config, n_samples=24, seed=0, with_argmax=True, samples_per_shard=7):
    """A tiny random Llama target saved as an HF dir + shards written with ShardWriter from its
    real hidden states (HiddenStateCapture). Returns a Config pointing at both."""
    from transformers import LlamaForCausalLM

    from eagleforge.shards import ShardWriter
    from eagleforge.target.capture import HiddenStateCapture
    from eagleforge.target.loading import decoder_layers, default_aux_layers, final_norm

    torch.manual_seed(seed)
    model = LlamaForCausalLM(llama_config).eval()
    with torch.no_grad():  # a peaked next-token distribution, like a trained model's (random init is ~uniform)
        model.lm_head.weight.mul_(40.0)
    target_dir = tmp_path / "target"
    model.save_pretrained(target_dir, safe_serialization=True)
    n_layers = llama_config.num_hidden_layers
    aux_layers = default_aux_layers(n_layers)
    header = {
        "target": {"path": str(target_dir), "architecture": "LlamaForCausalLM", "num_layers": n_layers,
                   "hidden_size": llama_config.hidden_size, "vocab_size": llama_config.vocab_size},
        "aux_layer_ids": aux_layers, "tokenizer": "none", "chat_template": None, "max_length": 64,
        "has_target_argmax": with_argmax,
    }
    run = tmp_path / "run"
    writer = ShardWriter(run / "hidden", header, storage_dtype="bfloat16")
    g = torch.Generator().manual_seed(seed + 1)
    samples = []
    for i in range(n_samples):
        n = int(torch.randint(9, 41, (1,), generator=g))
        # Skewed token distribution (a real text's Zipf-like head), ids in [3, V).
        ids = (torch.distributions.Geometric(probs=0.08).sample((n,)).long() + 3).clamp(max=llama_config.vocab_size - 1)
        mask = torch.zeros(n, dtype=torch.uint8)
        mask[n // 3 :] = 1  # the "assistant" part
        with torch.no_grad(), HiddenStateCapture(decoder_layers(model), aux_layers, final_norm(model)) as cap:
            logits = model(ids[None]).logits[0]
        sample = {"input_ids": ids.int(), "loss_mask": mask, "aux_hidden_states": cap.aux_hidden_states[0],
                  "last_hidden_state": cap.last_hidden_state[0]}
        if with_argmax:
            sample["target_argmax"] = logits.argmax(-1).int()
        samples.append(sample)
    for start in range(0, n_samples, samples_per_shard):
        chunk = samples[start : start + samples_per_shard]
        writer.write_shard(start // samples_per_shard, chunk, list(range(start, start + len(chunk))))
    cfg = Config(run_dir=str(run))
    cfg.target.path = str(target_dir)
    cfg.target.device = "cpu"
    cfg.train.device = "cpu"
    return cfg, model, samples


# ----------------------------------------------------------------------------- selection logic


def test_ties_broken_by_lower_id_and_sorted():
    counts = torch.tensor([0, 5, 3, 5, 3, 3, 9, 0, 1, 3], dtype=torch.int64)
    d2t, t2d = select_draft_vocab(counts, 5)
    ids = draft_to_target_ids(d2t)
    # top by count: 6 (9), then 1 and 3 (5 each), then among the 3s the lowest ids 2 and 4
    assert ids.tolist() == [1, 2, 3, 4, 6]
    assert torch.equal(t2d.nonzero().squeeze(1), ids)


def test_padding_with_lowest_unused_ids():
    counts = torch.zeros(50, dtype=torch.int64)
    counts[[40, 7, 33]] = torch.tensor([2, 9, 2])
    d2t, t2d = select_draft_vocab(counts, 8)
    assert draft_to_target_ids(d2t).tolist() == [0, 1, 2, 3, 4, 7, 33, 40]
    assert int(t2d.sum()) == 8


def test_vd_capped_at_vocab_and_consistency_random():
    g = torch.Generator().manual_seed(4)
    for vocab, vd in [(37, 100), (211, 50), (97, 97), (1000, 333)]:
        counts = torch.randint(0, 4, (vocab,), generator=g) * torch.randint(0, 2, (vocab,), generator=g)
        d2t, t2d = select_draft_vocab(counts, vd)
        ids = draft_to_target_ids(d2t)
        assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool
        assert d2t.shape == (min(vd, vocab),) and t2d.shape == (vocab,)
        assert torch.all(ids[1:] > ids[:-1]), "sorted ascending, distinct"
        assert torch.equal(t2d.nonzero().squeeze(1), ids)
        # independent reference: sort by (-count, id) in Python
        ref = sorted(sorted(range(vocab), key=lambda i: (-int(counts[i]), i))[: min(vd, vocab)])
        assert ids.tolist() == ref
        # every kept id has a count >= every dropped id
        if vd < vocab:
            assert counts[t2d].min() >= counts[~t2d].max()


def test_count_tokens_and_coverage():
    pairs = [
        (torch.tensor([5, 6, 7, 5], dtype=torch.int32), torch.tensor([0, 1, 1, 1], dtype=torch.uint8)),
        (torch.tensor([1, 5], dtype=torch.int32), torch.tensor([1, 0], dtype=torch.uint8)),
    ]
    counts = count_tokens(pairs, 10)
    assert counts.tolist() == [0, 1, 0, 0, 0, 1, 1, 1, 0, 0]
    d2t, t2d = select_draft_vocab(counts, 2)  # ids 1 and 5 (count 1 each, lowest ids)
    assert draft_to_target_ids(d2t).tolist() == [1, 5]
    assert coverage(counts, t2d) == pytest.approx(2 / 4)
    with pytest.raises(UserInputError, match="outside"):
        count_tokens([(torch.tensor([10]), torch.tensor([1]))], 10)


# ----------------------------------------------------------------------------- target head reading


def test_read_target_head_untied_tied_and_kimi_prefix(tmp_path):
    g = torch.Generator().manual_seed(1)
    embed, head = torch.randn(13, 4, generator=g), torch.randn(13, 4, generator=g)
    plain = tmp_path / "plain"
    plain.mkdir()
    save_file({"model.embed_tokens.weight": embed, "lm_head.weight": head, "model.norm.weight": torch.ones(4)}, str(plain / "model.safetensors"))
    (plain / "config.json").write_text(json.dumps({"tie_word_embeddings": False}))
    got_head, got_embed = read_target_head(plain)
    assert torch.equal(got_head, head) and torch.equal(got_embed, embed)

    tied = tmp_path / "tied"
    tied.mkdir()
    save_file({"model.embed_tokens.weight": embed}, str(tied / "model.safetensors"))
    (tied / "config.json").write_text(json.dumps({"tie_word_embeddings": True}))
    got_head, got_embed = read_target_head(tied)
    assert torch.equal(got_head, embed) and torch.equal(got_embed, embed)

    # Kimi-K2.5 layout: text weights under language_model., sharded with an index file.
    kimi = tmp_path / "kimi"
    kimi.mkdir()
    save_file({"language_model.model.embed_tokens.weight": embed, "vision_tower.x.weight": torch.ones(2)}, str(kimi / "a.safetensors"))
    save_file({"language_model.lm_head.weight": head}, str(kimi / "b.safetensors"))
    weight_map = {"language_model.model.embed_tokens.weight": "a.safetensors", "vision_tower.x.weight": "a.safetensors",
                  "language_model.lm_head.weight": "b.safetensors"}
    (kimi / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (kimi / "config.json").write_text(json.dumps({"text_config": {"tie_word_embeddings": False}}))
    got_head, got_embed = read_target_head(kimi)
    assert torch.equal(got_head, head) and torch.equal(got_embed, embed)

    with pytest.raises(FileNotFoundError):
        read_target_head(tmp_path / "nothing-here")


# ----------------------------------------------------------------------------- the stage


def test_vocab_stage_end_to_end(tmp_path, tiny_llama_config, caplog):
    from eagleforge.vocab import build_vocab, main

    cfg, model, samples = build_tiny_run(tmp_path, tiny_llama_config, n_samples=20)
    cfg.train.holdout_samples = 4
    cfg.vocab.draft_vocab_size = 40
    main(cfg)
    assert (cfg.run / "config.yaml").is_file()
    vocab = load_vocab_map(cfg.run)
    V = tiny_llama_config.vocab_size

    # independent count over the training samples only (the last 4 are held out)
    ref = torch.zeros(V, dtype=torch.int64)
    for s in samples[:16]:
        for tok, m in zip(s["input_ids"].tolist(), s["loss_mask"].tolist()):
            ref[tok] += m
    assert torch.equal(vocab["counts"], ref)
    ids = draft_to_target_ids(vocab["d2t"])
    assert ids.tolist() == sorted(sorted(range(V), key=lambda i: (-int(ref[i]), i))[:40])
    assert torch.equal(vocab["t2d"].nonzero().squeeze(1), ids)

    head = load_target_head(cfg.run)
    assert torch.equal(head["embed_tokens"], model.model.embed_tokens.weight.detach())
    assert torch.equal(head["lm_head"], model.lm_head.weight.detach()[ids])

    # second run: reused (identity in the metadata), files untouched
    mtime = (cfg.run / "vocab" / "vocab_map.safetensors").stat().st_mtime_ns
    summary = build_vocab(cfg)
    assert summary["reused"] and (cfg.run / "vocab" / "vocab_map.safetensors").stat().st_mtime_ns == mtime
    assert summary["coverage"] == pytest.approx(float(ref[ids].sum()) / float(ref.sum()))
    with safe_open(str(cfg.run / "vocab" / "target_head.safetensors"), framework="pt") as f:
        assert len(f.metadata()["identity"]) == 64

    # a different Vd recomputes
    cfg.vocab.draft_vocab_size = 30
    assert not build_vocab(cfg)["reused"]
    assert load_vocab_map(cfg.run)["d2t"].shape == (30,)

    cfg.train.holdout_samples = 20
    with pytest.raises(UserInputError, match="holdout_samples"):
        build_vocab(cfg)
