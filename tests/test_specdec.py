"""Speculative decoding (eval/specdec.py): output equals plain greedy decoding, token for token.

References: transformers' own `generate(do_sample=False)` for greedy_generate; greedy_generate
for every drafter; a full (non-incremental) target forward with hooks for the aux states the
EAGLE drafter is fed; brute-force formulas for the metrics and the n-gram matcher.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from eagleforge.eval.specdec import (
    Eagle3Drafter,
    NgramDrafter,
    RoundStats,
    acceptance_by_kind,
    acceptance_metrics,
    copy_classifier,
    eos_token_ids,
    greedy_generate,
    ngram_match,
    speculative_generate,
)
from eagleforge.target.loading import padding_id

MAX_NEW = 24
PROMPTS = [
    "Write a Python function that returns the sum of a list of numbers.",
    "List the planets of the solar system in order.",
    "def fib(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
]


def _prompt_ids(tokenizer, text: str) -> list[int]:
    from eagleforge.eval.evaluate import chat_prompt_ids

    return chat_prompt_ids(tokenizer, [{"role": "user", "content": text}])


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Decoding is many tiny forwards: on a shared 2-core machine two threads spin-wait on each
    other (measured 5x slower than one). Restored after the module."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def cases(one_thread, smollm2):
    """(prompt_ids, greedy reference) for each prompt, plus the EOS ids."""
    model, tokenizer = smollm2
    eos = eos_token_ids(model, tokenizer)
    out = []
    for text in PROMPTS:
        ids = _prompt_ids(tokenizer, text)
        out.append((ids, greedy_generate(model, ids, MAX_NEW, eos)))
    return out, eos


def test_greedy_generate_matches_transformers_generate(smollm2, cases):
    model, tokenizer = smollm2
    (ids, ref), eos = cases[0][0], cases[1]
    hf = model.generate(
        torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=sorted(eos),
        pad_token_id=padding_id(tokenizer),
    )[0, len(ids):].tolist()
    assert ref == hf


class OracleDrafter:
    """Knows the greedy continuation; each round proposes a random number `good` of correct
    tokens followed by one wrong token, so the engine must accept exactly `good`."""

    def __init__(self, prompt_len: int, reference: list[int], vocab_size: int, seed: int):
        self.prompt_len, self.reference, self.vocab_size = prompt_len, reference, vocab_size
        self.rng = random.Random(seed)
        self.expected: list[int] = []

    def begin(self, prompt_ids):
        assert len(prompt_ids) == self.prompt_len

    def propose(self, context_ids, k):
        done = len(context_ids) - self.prompt_len
        assert context_ids[self.prompt_len:] == self.reference[:done], "context diverged from greedy"
        available = self.reference[done:done + k]
        good = self.rng.randint(0, k)
        if good < len(available):
            drafts = available[:good] + [(available[good] + 1) % self.vocab_size]
        else:
            drafts, good = list(available), len(available)
        self.expected.append(good)
        return drafts

    def observe(self, verified_ids, next_token):
        pass

    def end(self):
        pass

    def target_hooks(self):
        import contextlib

        return contextlib.nullcontext()


@pytest.mark.parametrize("k", [1, 3, 5])
def test_oracle_drafter_exact_acceptance(smollm2, cases, k):
    model, _ = smollm2
    (ids, ref), eos = cases[0][k % len(PROMPTS)], cases[1]
    drafter = OracleDrafter(len(ids), ref, model.config.vocab_size, seed=k)
    out = speculative_generate(model, drafter, ids, k, MAX_NEW, eos)
    assert out.token_ids == ref
    # every round's accepted count is exactly the oracle's planted correct prefix
    assert [r.accepted for r in out.rounds] == drafter.expected
    assert out.target_forwards == 1 + len(out.rounds)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_ngram_speculative_equals_greedy(smollm2, cases, k):
    model, _ = smollm2
    prompts, eos = cases
    for ids, ref in prompts:
        out = speculative_generate(model, NgramDrafter(3, 1), ids, k, MAX_NEW, eos)
        assert out.token_ids == ref
        assert all(0 <= r.accepted <= r.proposed <= k for r in out.rounds)


def test_stops_at_eos_like_greedy(smollm2, cases):
    """An EOS id planted on a token the target will produce: both stop right after it."""
    model, _ = smollm2
    ids, ref = cases[0][1]
    eos = {ref[5]}
    greedy = greedy_generate(model, ids, MAX_NEW, eos)
    assert greedy == ref[: ref.index(ref[5]) + 1]
    drafter = OracleDrafter(len(ids), ref, model.config.vocab_size, seed=0)
    assert speculative_generate(model, drafter, ids, 4, MAX_NEW, eos).token_ids == greedy


# ---------------------------------------------------------------------------------- EAGLE


class RecordingDraft:
    """Stands in for Eagle3Draft: records what Eagle3Drafter feeds it and proposes oracle tokens
    (partly wrong), so acceptances happen and the alignment is checked under them."""

    def __init__(self, aux_layer_ids, prompt_len, reference, vocab_size, seed):
        self.config = type("Cfg", (), {"aux_layer_ids": aux_layer_ids})()
        self._param = torch.nn.Parameter(torch.zeros(1))
        self.oracle = OracleDrafter(prompt_len, reference, vocab_size, seed)
        self.aux, self.tokens = [], []

    def parameters(self):
        yield self._param

    def new_cache(self):
        return {"rows": 0}

    def extend(self, cache, aux, next_ids):
        assert aux.shape[:2] == next_ids.shape and aux.dim() == 3
        self.aux.append(aux.clone())
        self.tokens.extend(next_ids[0].tolist())
        cache["rows"] += aux.shape[1]

    def propose(self, cache, k):
        # rows cover positions 0..rows-1 and tokens[t] is token t+1: the context is
        # [token 0] + tokens, i.e. everything up to the token after the last row.
        assert len(self.tokens) == cache["rows"]
        return torch.tensor(self.oracle.propose([self.first_token] + self.tokens, k))


@pytest.mark.parametrize("k", [5])
def test_eagle_drafter_feeds_aligned_aux_states(smollm2, cases, k):
    from eagleforge.target.capture import HiddenStateCapture
    from eagleforge.target.loading import decoder_layers, final_norm

    model, _ = smollm2
    (ids, ref), eos = cases[0][k % len(PROMPTS)], cases[1]
    aux_ids = [1, 14, 26]
    draft = RecordingDraft(aux_ids, len(ids), ref, model.config.vocab_size, seed=k)
    draft.first_token = ids[0]
    drafter = Eagle3Drafter(draft, model)
    out = speculative_generate(model, drafter, ids, k, MAX_NEW, eos)
    assert out.token_ids == ref
    assert any(r.accepted > 0 for r in out.rounds)
    # Row t of what the draft got pairs aux at position t with token t+1 of the sequence.
    seq = [ids[0]] + draft.tokens  # [rows + 1]
    rows = len(draft.tokens)
    assert seq[: len(ids)] == ids and seq[len(ids):][: len(ref)] == ref[: rows + 1 - len(ids)]
    fed_aux = torch.cat(draft.aux, dim=1)  # [1, rows, 3H]
    with HiddenStateCapture(decoder_layers(model), aux_ids, final_norm(model)) as cap, torch.no_grad():
        model(input_ids=torch.tensor([seq[:rows]]))
        full_aux = cap.aux_hidden_states  # [1, rows, 3H], one non-incremental forward
    assert fed_aux.shape == full_aux.shape == (1, rows, 3 * model.config.hidden_size)
    torch.testing.assert_close(fed_aux, full_aux, atol=2e-4, rtol=1e-4)


def _random_draft(model, seed: int, draft_vocab_size: int = 6007):
    """A random-weight Eagle3Draft for the target: the target's embedding, a draft vocabulary of
    odd size (random subset of ids, so d2t is exercised), aux layers [1, 14, 26]."""
    from eagleforge.draft import Eagle3Config, Eagle3Draft

    torch.manual_seed(seed)
    config = Eagle3Config.from_target_config(model.config, draft_vocab_size, [1, 14, 26])
    draft = Eagle3Draft(config)
    draft.reset_parameters(std=0.05)
    draft.set_embed_tokens(model.get_input_embeddings().weight)
    ids = torch.randperm(config.vocab_size)[:draft_vocab_size].sort().values
    t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    draft.set_vocab_map(ids - torch.arange(draft_vocab_size), t2d)
    return draft.eval().requires_grad_(False)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_eagle_random_draft_equals_greedy(smollm2, cases, k):
    """A random draft is a harsh test: almost every draft token is rejected."""
    model, _ = smollm2
    prompts, eos = cases
    drafter = Eagle3Drafter(_random_draft(model, seed=k), model)
    for ids, ref in prompts:
        out = speculative_generate(model, drafter, ids, k, MAX_NEW, eos)
        assert out.token_ids == ref
        assert all(r.proposed == k and 0 <= r.accepted <= k for r in out.rounds)


def test_eagle_draft_cache_under_acceptances_matches_one_extend(smollm2, cases):
    """The real draft's extend, fed incrementally by Eagle3Drafter while an oracle plants
    acceptances of every length, ends with the same cache as one extend over the whole verified
    sequence (aux from one full target forward), and proposes the same tokens from it."""
    from eagleforge.target.capture import HiddenStateCapture
    from eagleforge.target.loading import decoder_layers, final_norm

    model, _ = smollm2
    (ids, _), eos = cases[0][2], cases[1]
    # a reference longer than MAX_NEW: the last round may verify up to k tokens past it
    ref = greedy_generate(model, ids, MAX_NEW + 6, eos)
    assert len(ref) == MAX_NEW + 6, "the prompt should not hit EOS this early"
    draft = _random_draft(model, seed=11)
    oracle = OracleDrafter(len(ids), ref, model.config.vocab_size, seed=3)
    caches = []
    real_new_cache = draft.new_cache

    def new_cache():
        caches.append(real_new_cache())
        return caches[-1]

    draft.new_cache = new_cache
    draft.propose = lambda cache, k: torch.tensor([oracle.propose((ids + ref)[: cache.length + 1], k)])
    out = speculative_generate(model, Eagle3Drafter(draft, model), ids, 4, MAX_NEW, eos)
    assert out.token_ids == ref[:MAX_NEW] and any(r.accepted >= 2 for r in out.rounds)
    incremental = caches[-1]
    rows = incremental.length
    seq = (ids + ref)[: rows + 1]
    assert rows > len(ids) and len(seq) == rows + 1
    with HiddenStateCapture(decoder_layers(model), [1, 14, 26], final_norm(model)) as cap, torch.no_grad():
        model(input_ids=torch.tensor([seq[:rows]]))
        full_aux = cap.aux_hidden_states  # [1, rows, 3H]
    whole = real_new_cache()
    draft.extend(whole, full_aux, torch.tensor([seq[1:]]))
    for name in ("keys", "values", "hidden"):
        torch.testing.assert_close(getattr(incremental, name), getattr(whole, name), atol=3e-4, rtol=1e-4)
    assert torch.equal(type(draft).propose(draft, incremental, 5), type(draft).propose(draft, whole, 5))


# ---------------------------------------------------------------------------------- metrics


def test_acceptance_metrics_hand_made_rounds():
    rounds = [RoundStats(3, 3), RoundStats(3, 0), RoundStats(3, 1), RoundStats(2, 2), RoundStats(0, 0)]
    m = acceptance_metrics(rounds, k=3)
    # the empty round (no draft) is not a verification round, as in vLLM's num_drafts
    assert m["rounds"] == 4
    assert m["acceptance_length"] == pytest.approx(1 + (3 + 0 + 1 + 2) / 4)
    assert m["per_position_acceptance"] == pytest.approx([3 / 4, 2 / 4, 1 / 4])
    assert m["acceptance_length"] == pytest.approx(1 + sum(m["per_position_acceptance"]))
    assert m["draft_tokens"] == 11 and m["accepted_tokens"] == 6
    empty = acceptance_metrics([], k=2)
    assert empty["acceptance_length"] == 1.0 and empty["per_position_acceptance"] == [0.0, 0.0]
    with pytest.raises(ValueError):
        acceptance_metrics([RoundStats(2, 3)], k=3)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 5), max_size=40).flatmap(
    lambda accepted: st.tuples(st.just(accepted), st.lists(st.integers(0, 5), min_size=len(accepted), max_size=len(accepted)))))
def test_acceptance_metrics_random_rounds(data):
    accepted, extra = data
    k = 5
    rounds = [RoundStats(min(k, a + e) if a + e > 0 else 0, a if a + e > 0 else 0) for a, e in zip(accepted, extra)]
    m = acceptance_metrics(rounds, k)
    counted = [r for r in rounds if r.proposed]
    n = len(counted)
    if n:
        for i in range(k):
            assert m["per_position_acceptance"][i] == pytest.approx(sum(r.accepted > i for r in counted) / n)
        assert m["acceptance_length"] == pytest.approx(1 + sum(r.accepted for r in counted) / n)


# ---------------------------------------------------------------------------------- n-gram


def test_ngram_match_hand_made():
    #          0  1  2  3  4  5  6  7  8
    context = [5, 6, 7, 8, 9, 1, 5, 6, 7]
    assert ngram_match(context, 3, ngram_max=3, ngram_min=1) == [8, 9, 1]  # "5 6 7" seen at 0..2
    assert ngram_match(context, 10, 3, 1) == [8, 9, 1, 5, 6, 7]  # continuation runs to the end
    # most recent occurrence wins: "4" appears twice, followed by 1 then by 2
    assert ngram_match([4, 1, 3, 4, 2, 0, 4], 2, 1, 1) == [2, 0]
    # the longest n is tried first: "2 3" continues with 9, the lone "3" later with 7
    assert ngram_match([2, 3, 9, 3, 7, 2, 3], 1, 2, 1) == [9]
    assert ngram_match([1, 2, 3], 4, 3, 1) == []  # nothing repeats
    assert ngram_match([1, 2, 3, 4], 4, 3, 2) == []
    with pytest.raises(ValueError):
        ngram_match([1, 2], 2, 1, 2)


def _ngram_reference(context, k, ngram_max, ngram_min):
    """Brute force over a string encoding: rfind of the suffix in the context minus its last token."""
    for n in range(ngram_max, ngram_min - 1, -1):
        if n >= len(context):
            continue
        suffix = "".join(f"<{t}>" for t in context[-n:])
        head = "".join(f"<{t}>" for t in context[:-1])  # occurrences must end before the last token
        pos = head.rfind(suffix)
        if pos >= 0:
            start = head[:pos].count("<") + n
            return list(context[start:start + k])
    return []


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=30), st.integers(1, 6), st.integers(1, 4), st.integers(0, 3))
def test_ngram_match_against_bruteforce(context, k, ngram_min, span):
    ngram_max = ngram_min + span
    assert ngram_match(context, k, ngram_max, ngram_min) == _ngram_reference(context, k, ngram_max, ngram_min)


# --------------------------------------------------------------------------------------------
# The CPU attention (prepare_for_decoding): grouped-query attention without repeating K and V


@pytest.mark.parametrize("q_len,k_len,kv_heads,groups", [(1, 37, 3, 3), (6, 41, 2, 5), (13, 13, 1, 4)])
def test_gqa_attention_matches_sdpa(q_len, k_len, kv_heads, groups):
    """Against torch's sdpa on K/V repeated per query head, with left padding and causality."""
    from eagleforge.target.loading import gqa_attention

    gen = torch.Generator().manual_seed(q_len * 100 + k_len)
    batch, head_dim = 3, 24
    heads = kv_heads * groups
    query = torch.randn(batch, heads, q_len, head_dim, generator=gen)
    key = torch.randn(batch, kv_heads, k_len, head_dim, generator=gen)
    value = torch.randn(batch, kv_heads, k_len, head_dim, generator=gen)
    allowed = torch.ones(batch, 1, q_len, k_len, dtype=torch.bool).tril(diagonal=k_len - q_len)  # causal, queries last
    allowed[1, :, :, :5] = False  # row 1 is left-padded by 5
    additive = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    out, _ = gqa_attention(None, query, key, value, additive, scaling=0.3)  # [B, Tq, H, D]
    ref = torch.nn.functional.scaled_dot_product_attention(
        query, key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1), attn_mask=allowed, scale=0.3
    ).transpose(1, 2)
    # query rows that see no key at all (left padding) are never read; compare the others
    seen = allowed.any(dim=-1)[:, 0]  # [B, Tq]
    assert seen.sum() >= batch  # every row has a query that attends
    torch.testing.assert_close(out[seen], ref[seen], atol=1e-5, rtol=1e-5)


def test_prepared_head_reads_contiguous_rows():
    """With logits_to_keep, transformers hands the output head a strided view hidden[:, -k:],
    which torch's matmul turns into a bmm against the head expanded per row (a copy of the
    whole head per row). After prepare_for_decoding the head reads contiguous rows, and the
    kept logits equal those of a full forward without it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from eagleforge.target.loading import prepare_for_decoding

    torch.manual_seed(7)
    config = LlamaConfig(vocab_size=211, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                         num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 211, (3, 11))
    with torch.no_grad():
        full = model(input_ids=ids).logits[:, -2:]  # [3, 2, V], the reference
    seen = []
    head = model.get_output_embeddings()
    prepare_for_decoding(model)
    prepare_for_decoding(model)  # idempotent: one hook
    head.register_forward_pre_hook(lambda module, args: seen.append(args[0].is_contiguous()))
    with torch.no_grad():
        kept = model(input_ids=ids, logits_to_keep=2).logits  # [3, 2, V]
    assert seen == [True]
    assert len(head._forward_pre_hooks) == 2
    torch.testing.assert_close(kept, full, atol=1e-5, rtol=1e-5)


@pytest.fixture
def cpu_attention(smollm2):
    """The shared SmolLM2 model switched to the CPU attention for one test, then restored."""
    from eagleforge.target.loading import prepare_for_decoding

    model, _ = smollm2
    before = model.config._attn_implementation
    prepare_for_decoding(model)
    assert model.config._attn_implementation != before
    yield model
    model.set_attn_implementation(before)


@pytest.mark.parametrize("k", [2, 5])
def test_cpu_attention_keeps_greedy_output(cpu_attention, cases, k):
    """Plain greedy and n-gram speculative decoding under the CPU attention equal the greedy
    reference computed with transformers' default attention (float32)."""
    prompts, eos = cases
    for ids, ref in prompts:
        assert greedy_generate(cpu_attention, ids, MAX_NEW, eos) == ref
        assert speculative_generate(cpu_attention, NgramDrafter(3, 1), ids, k, MAX_NEW, eos).token_ids == ref


@pytest.mark.parametrize("k", [1, 3, 5])
def test_copy_classifier_labels_agree_with_the_ngram_drafter(smollm2, cases, k):
    """A round is "copyable" when prompt lookup's first token is the target's: for the n-gram
    drafter with the same settings that is exactly "it proposed and its first token was
    accepted", an independent check of the labels; the output stays greedy's."""
    model, _ = smollm2
    prompts, eos = cases
    labelled = 0
    for ids, ref in prompts:
        out = speculative_generate(model, NgramDrafter(3, 1), ids, k, MAX_NEW, eos, classify=copy_classifier(3, 1))
        assert out.token_ids == ref
        for r in out.rounds:
            if r.proposed:
                assert r.copyable == (r.accepted >= 1), r
                labelled += 1
    assert labelled > 0


def test_acceptance_by_kind_hand_made_rounds():
    rounds = [RoundStats(3, 3, True), RoundStats(3, 1, True), RoundStats(3, 0, False), RoundStats(0, 0, False),
              RoundStats(3, 2, False)]
    kinds = acceptance_by_kind(rounds, 3)
    assert kinds["copyable"]["rounds"] == 2 and kinds["copyable"]["acceptance_length"] == pytest.approx(1 + 4 / 2)
    assert kinds["copyable"]["per_position_acceptance"] == pytest.approx([1.0, 0.5, 0.5])
    assert kinds["novel"]["rounds"] == 2 and kinds["novel"]["acceptance_length"] == pytest.approx(1 + 2 / 2)
    assert kinds["copyable"]["share_of_rounds"] == pytest.approx(0.5)  # the round without drafts does not count
    assert acceptance_by_kind([RoundStats(2, 1)], 2) is None  # not classified


def _memorizing_draft(model, sequences, k: int, steps: int = 150):
    """A random draft trained (TTT, k steps, cross-entropy on the true tokens) until it nearly
    memorizes `sequences`: a real draft that accepts often but not always."""
    from eagleforge.target.capture import HiddenStateCapture
    from eagleforge.target.loading import decoder_layers, final_norm

    draft = _random_draft(model, seed=11).requires_grad_(True)
    draft.embed_tokens.weight.requires_grad_(False)
    # A draft vocabulary holding every token of the sequences (the rest random): all predictable.
    vd, v = draft.config.draft_vocab_size, draft.config.vocab_size
    seen = torch.tensor(sorted({t for seq in sequences for t in seq}))
    others = torch.randperm(v, generator=torch.Generator().manual_seed(3))
    others = others[~torch.isin(others, seen)][: vd - len(seen)]
    ids = torch.cat([seen, others]).sort().values
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[ids] = True
    draft.set_vocab_map(ids - torch.arange(vd), t2d)
    batches = []
    for seq in sequences:
        ids = torch.tensor([seq])
        with HiddenStateCapture(decoder_layers(model), [1, 14, 26], final_norm(model)) as cap, torch.no_grad():
            model(input_ids=ids)
            batches.append((cap.aux_hidden_states.clone(), ids))
    t2d_index = torch.cumsum(draft.t2d.long(), 0) - 1  # target id -> draft id where t2d
    opt = torch.optim.Adam([p for p in draft.parameters() if p.requires_grad], lr=1e-2)
    for step in range(steps):
        aux, ids = batches[step % len(batches)]
        normed = draft.forward_ttt(aux, ids, k)
        loss = 0.0
        for j, h in enumerate(normed):
            rows = ids.shape[1] - 2 - j
            target = ids[0, 2 + j:]
            keep = draft.t2d[target]
            logits = draft.logits(h[0, :rows])
            loss = loss + torch.nn.functional.cross_entropy(logits[keep], t2d_index[target[keep]])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return draft.eval().requires_grad_(False)


def test_rounds_accept_the_teacher_forced_run_of_hits(smollm2, cases):
    """Train/serve agreement of the whole EAGLE path: every round of real speculative decoding
    (incremental draft cache, aux states from the verify forwards) accepts exactly the leading
    run of the draft's teacher-forced TTT hits (one target forward, forward_ttt) at the round's
    start row; the teacher-forced acceptance is then the measured one over those rows."""
    from eagleforge.eval.specdec import teacher_forced_acceptance, teacher_forced_hits

    model, _ = smollm2
    prompts, eos = cases
    k = 4
    draft = _memorizing_draft(model, [ids + ref for ids, ref in prompts], k)
    drafter = Eagle3Drafter(draft, model)
    checked, accepted_lengths, checked_rounds, all_hits = 0, set(), [], []
    for ids, ref in prompts:
        out = speculative_generate(model, drafter, ids, k, MAX_NEW, eos)
        assert out.token_ids == ref
        seq = ids + ref
        hits = teacher_forced_hits(draft, model, seq, k)  # [T, k]
        all_hits.append(hits)
        assert hits.shape == (len(seq), k) and not hits[-2:, :].any()  # no truth past the end
        row = len(ids) - 1  # the first round's context ends at token len(ids): draft row len(ids) - 1
        for r in out.rounds:
            if row + 1 + r.proposed <= len(seq) - 1:  # every drafted position inside the output
                expected = int(torch.cumprod(hits[row, : r.proposed].int(), 0).sum())
                assert r.accepted == expected, (row, r, hits[row].tolist())
                checked += 1
                accepted_lengths.add(r.accepted)
                checked_rounds.append(r)
            row += r.accepted + 1
    assert checked >= 15 and 0 in accepted_lengths and max(accepted_lengths) >= k - 1 and len(accepted_lengths) >= 3, \
        (checked, accepted_lengths)
    summary = teacher_forced_acceptance(all_hits, [len(ids) - 1 for ids, _ in prompts], k)
    assert summary["replayed"]["rounds"] == checked  # the replay runs exactly the checked rounds
    measured = acceptance_metrics(checked_rounds, k)
    assert summary["replayed"]["acceptance_length"] == pytest.approx(measured["acceptance_length"])
    assert summary["replayed"]["per_position_acceptance"] == pytest.approx(measured["per_position_acceptance"])
    rates = summary["every_row"]["per_position_acceptance"]
    assert summary["every_row"]["rounds"] > checked and all(a >= b for a, b in zip(rates, rates[1:]))


def test_teacher_forced_acceptance_hand_made():
    from eagleforge.eval.specdec import teacher_forced_acceptance

    t, f = True, False
    hits = torch.tensor([[t, t, f], [f, t, t], [t, f, t], [t, t, t], [t, t, t], [t, t, t], [t, t, t],
                         [f, f, f], [f, f, f]])  # [9, 3]: rows t <= 9 - 2 - 3 = 4 have all 3 positions inside
    out = teacher_forced_acceptance([hits], [0], 3)
    every, replayed = out["every_row"], out["replayed"]
    # every row 0..4: runs 2, 0, 1, 3, 3 -> position rates 4/5, 3/5, 2/5
    assert every["rounds"] == 5 and every["per_position_acceptance"] == pytest.approx([0.8, 0.6, 0.4])
    # replay: row 0 accepts 2 -> row 3 accepts 3 -> row 7 is past the last full row
    assert replayed["rounds"] == 2 and replayed["per_position_acceptance"] == pytest.approx([1.0, 1.0, 0.5])
    assert replayed["acceptance_length"] == pytest.approx(3.5)
    assert teacher_forced_acceptance([hits], [5], 3)["every_row"]["rounds"] == 0
