"""Chain speculative decoding with greedy verification (batch 1), and its metrics.

The engine is the measuring instrument of docs/eval-results.md: a drafter proposes up to k tokens,
the target verifies all of them in ONE forward over `[last_token, d_1 .. d_k]` with a KV cache,
the longest prefix of drafts that equals the target's own greedy choice is accepted, and the
target's token after that prefix (the "bonus" token when all k are accepted, the correction
otherwise) is appended. The output therefore equals plain greedy decoding token for token
(`greedy_generate` is the reference; tests check the equality), and the draft only changes how
many target forwards it takes.

Bookkeeping of one round, context length n (prompt + generated), target cache holding
positions 0..n-2 (the last token x_{n-1} is not in the cache yet):

    fed       = [x_{n-1}, d_1, .., d_m]          positions n-1 .. n-1+m, one forward
    greedy    = argmax(logits)  [m+1]            greedy[i] = target's token after fed[:i+1]
    accepted  a = longest prefix with d_{i+1} == greedy[i]
    append      d_1 .. d_a, greedy[a]
    cache       keep positions 0 .. n-1+a        (crop the m - a rejected entries)

Metrics follow vLLM's spec-decode counters: a round is a verification that had at least one
draft token (`num_drafts`), acceptance length = 1 + accepted / rounds, and the per-position
rate of position i = (rounds whose draft i was accepted) / rounds, so that
acceptance_length = 1 + sum(per_position_acceptance).

Drafters implement the small `Drafter` protocol. `NgramDrafter` is prompt-lookup decoding;
`Eagle3Drafter` runs an EAGLE-3 draft (eagleforge.draft) fed with the target's aux-layer
hidden states captured by hooks (eagleforge.target.capture) during the verify forwards.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass, field
from typing import Callable, Iterable, Protocol, Sequence

import torch

# --------------------------------------------------------------------------------------------
# Target forward with a KV cache
# --------------------------------------------------------------------------------------------


def _cache_kwarg(model) -> str:
    """transformers >= 5.2x names the cache argument `cache`; earlier 5.x `past_key_values`."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def new_target_cache(model):
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def model_device(model) -> torch.device:
    return next(model.parameters()).device


def target_forward(model, cache, token_ids: Sequence[int], logits_to_keep: int = 0) -> torch.Tensor:
    """Run `token_ids` (the next positions after the cache) and return greedy ids.

    Returns int64 [len(token_ids)] (or [logits_to_keep] when > 0): the target's argmax next
    token after each of the fed positions. The cache grows by len(token_ids).
    """
    ids = torch.tensor([list(token_ids)], dtype=torch.long, device=model_device(model))  # [1, T]
    kwargs = {_cache_kwarg(model): cache, "use_cache": True}
    if logits_to_keep:
        kwargs["logits_to_keep"] = logits_to_keep  # prefill needs only the last row of [T, V]
    with torch.inference_mode():
        logits = model(input_ids=ids, **kwargs).logits  # [1, T or keep, V]
    return logits[0].argmax(dim=-1).cpu()


def crop_cache(cache, keep: int) -> None:
    """Drop cached positions >= keep (rejected drafts).

    DynamicCache.crop(n) with a negative n removes |n| tokens in every transformers version
    (positive n means an absolute length in 4.x and is refused in 5.x).
    """
    remove = cache.get_seq_length() - keep
    if remove < 0:
        raise ValueError(f"cannot crop a cache of {cache.get_seq_length()} positions to {keep}")
    if remove:
        cache.crop(-remove)


def eos_token_ids(model, tokenizer=None) -> set[int]:
    """EOS ids from the generation config (int or list), else the tokenizer's."""
    ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if ids is None and tokenizer is not None:
        ids = tokenizer.eos_token_id
    if ids is None:
        return set()
    return {int(i) for i in ids} if isinstance(ids, (list, tuple)) else {int(ids)}


# --------------------------------------------------------------------------------------------
# Plain greedy reference
# --------------------------------------------------------------------------------------------


def greedy_generate(
    target, prompt_ids: Sequence[int], max_new_tokens: int, eos_ids: Iterable[int] = ()
) -> list[int]:
    """Plain greedy decoding, one token per target forward, with a KV cache.

    Returns the generated ids (prompt excluded), ending at the first EOS (included) or after
    max_new_tokens.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    eos_ids = set(eos_ids)
    cache = new_target_cache(target)
    token = int(target_forward(target, cache, prompt_ids, logits_to_keep=1)[-1])
    generated = [token]
    while len(generated) < max_new_tokens and token not in eos_ids:
        token = int(target_forward(target, cache, [token])[-1])
        generated.append(token)
    return generated


# --------------------------------------------------------------------------------------------
# Drafters
# --------------------------------------------------------------------------------------------


class Drafter(Protocol):
    """What the engine needs from a drafter (one sequence at a time).

    begin(prompt_ids)            a new sequence starts; called before the prefill forward.
    propose(context_ids, k)      up to k draft tokens continuing context_ids (may be fewer).
    observe(verified_ids, next)  after every target forward: the tokens at the positions that
                                 forward newly verified (the prefill: the prompt; a round:
                                 [last_token, d_1..d_a]) and the target's token after them.
    end()                        the sequence is done (release hooks, caches).
    target_hooks()               context manager active around every target forward.
    """

    def begin(self, prompt_ids: list[int]) -> None: ...

    def propose(self, context_ids: list[int], k: int) -> list[int]: ...

    def observe(self, verified_ids: list[int], next_token: int) -> None: ...

    def end(self) -> None: ...

    def target_hooks(self) -> contextlib.AbstractContextManager: ...


def ngram_match(context_ids: Sequence[int], k: int, ngram_max: int, ngram_min: int) -> list[int]:
    """Prompt-lookup decoding: continue the context the way it continued last time.

    For n from ngram_max down to ngram_min, look for the last n tokens of the context earlier
    in the context (most recent occurrence first) and return the up to k tokens that followed
    that occurrence. No match: [].
    """
    if ngram_min < 1 or ngram_max < ngram_min:
        raise ValueError(f"need 1 <= eval.ngram_min <= eval.ngram_max, got {ngram_min}, {ngram_max}")
    length = len(context_ids)
    tokens = list(context_ids)
    for n in range(min(ngram_max, length - 1), ngram_min - 1, -1):
        suffix = tokens[length - n :]
        # An occurrence ending at `end` (exclusive) with end < length leaves a continuation.
        for end in range(length - 1, n - 1, -1):
            if tokens[end - n : end] == suffix:
                return tokens[end : end + k]
    return []


class NgramDrafter:
    """Prompt-lookup (n-gram) drafting over prompt + generated tokens; no model."""

    def __init__(self, ngram_max: int = 3, ngram_min: int = 1):
        if ngram_min < 1 or ngram_max < ngram_min:
            raise ValueError(f"need 1 <= eval.ngram_min <= eval.ngram_max, got {ngram_min}, {ngram_max}")
        self.ngram_max = ngram_max
        self.ngram_min = ngram_min

    def begin(self, prompt_ids: list[int]) -> None:
        pass

    def propose(self, context_ids: list[int], k: int) -> list[int]:
        return ngram_match(context_ids, k, self.ngram_max, self.ngram_min)

    def observe(self, verified_ids: list[int], next_token: int) -> None:
        pass

    def end(self) -> None:
        pass

    def target_hooks(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


class Eagle3Drafter:
    """An EAGLE-3 draft fed with the target's aux-layer states from its own verify forwards.

    Hooks (HiddenStateCapture) on the target's decoder layers `draft.config.aux_layer_ids`
    (project convention: outputs of those layers) capture aux [1, T, k*Ht] during each target
    forward. After a forward that verified positions p..p+n-1 (tokens verified_ids) and
    produced next_token, the draft's cache is extended with rows pairing aux at position t
    with token t+1: aux[:, :n] with tokens verified_ids[1:] + [next_token]. Proposals are
    k target ids from `draft.propose(cache, k)`.
    """

    def __init__(self, draft, target):
        self.draft = draft
        self.target = target
        self.aux_layer_ids = list(draft.config.aux_layer_ids)
        self._capture = aux_capture(draft, target)
        self._cache = None
        self._draft_param = next(draft.parameters())

    def target_hooks(self) -> contextlib.AbstractContextManager:
        return self._capture

    def begin(self, prompt_ids: list[int]) -> None:
        self._cache = self.draft.new_cache()

    def observe(self, verified_ids: list[int], next_token: int) -> None:
        aux = self._capture.aux_hidden_states  # [1, T, k*Ht], T >= len(verified_ids)
        n = len(verified_ids)
        if aux is None or aux.shape[1] < n:
            raise RuntimeError(f"captured aux states {None if aux is None else tuple(aux.shape)} cover fewer than {n} positions")
        aux = aux[:, :n].to(device=self._draft_param.device, dtype=self._draft_param.dtype)
        next_ids = list(verified_ids[1:]) + [int(next_token)]
        next_ids = torch.tensor([next_ids], dtype=torch.long, device=self._draft_param.device)  # [1, n]
        with torch.inference_mode():
            self.draft.extend(self._cache, aux, next_ids)

    def propose(self, context_ids: list[int], k: int) -> list[int]:
        with torch.inference_mode():
            ids = self.draft.propose(self._cache, k)
        return [int(i) for i in torch.as_tensor(ids).reshape(-1).tolist()]

    def end(self) -> None:
        self._cache = None


# --------------------------------------------------------------------------------------------
# The engine
# --------------------------------------------------------------------------------------------


@dataclass
class RoundStats:
    proposed: int  # draft tokens verified in this round (0 .. k)
    accepted: int  # the accepted prefix of them (0 .. proposed)
    copyable: bool | None = None  # the position's kind when a classifier was given (copy_classifier)


@dataclass
class SpecDecodeOutput:
    token_ids: list[int]  # generated ids, prompt excluded, same stopping rule as greedy_generate
    rounds: list[RoundStats] = field(default_factory=list)
    target_forwards: int = 0  # prefill included


def speculative_generate(
    target,
    drafter: Drafter,
    prompt_ids: Sequence[int],
    k: int,
    max_new_tokens: int,
    eos_ids: Iterable[int] = (),
    classify: Callable[[list[int], int], bool] | None = None,
) -> SpecDecodeOutput:
    """Chain speculative decoding with greedy verification; output == greedy_generate's.

    Every round asks the drafter for k tokens (the accounting does not shrink k near the end;
    tokens past max_new_tokens or an EOS are verified and counted but not returned, as an
    engine with a long max_tokens would have produced them). classify(context, target_token),
    when given, labels each round (RoundStats.copyable) from the context the drafter saw and the
    target's token at the first draft position.
    """
    if k < 1:
        raise ValueError(f"eval.k must be >= 1, got {k}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not prompt_ids:
        raise ValueError("speculative_generate: empty prompt")
    eos_ids = set(eos_ids)
    context = [int(t) for t in prompt_ids]
    prompt_len = len(context)
    out = SpecDecodeOutput(token_ids=[])
    cache = new_target_cache(target)
    drafter.begin(list(context))
    try:
        with drafter.target_hooks():
            first = int(target_forward(target, cache, context, logits_to_keep=1)[-1])
        out.target_forwards += 1
        drafter.observe(list(context), first)
        context.append(first)
        while not _finished(context, prompt_len, max_new_tokens, eos_ids):
            drafts = [int(t) for t in drafter.propose(list(context), k)][:k]
            fed = [context[-1]] + drafts  # positions len(context)-1 .. len(context)-1+m
            with drafter.target_hooks():
                greedy = target_forward(target, cache, fed).tolist()  # [m + 1]
            out.target_forwards += 1
            accepted = 0
            while accepted < len(drafts) and drafts[accepted] == greedy[accepted]:
                accepted += 1
            crop_cache(cache, len(context) + accepted)  # keep 0 .. n-1+a
            kind = None if classify is None else bool(classify(context, greedy[0]))
            out.rounds.append(RoundStats(proposed=len(drafts), accepted=accepted, copyable=kind))
            drafter.observe(fed[: accepted + 1], greedy[accepted])
            context.extend(drafts[:accepted] + [greedy[accepted]])
    finally:
        drafter.end()
    out.token_ids = _truncate(context[prompt_len:], max_new_tokens, eos_ids)
    return out


def _finished(context: list[int], prompt_len: int, max_new_tokens: int, eos_ids: set[int]) -> bool:
    generated = context[prompt_len:]
    return len(generated) >= max_new_tokens or any(t in eos_ids for t in generated)


def _truncate(generated: list[int], max_new_tokens: int, eos_ids: set[int]) -> list[int]:
    """Cut at the first EOS (kept) and at max_new_tokens: greedy_generate's stopping rule."""
    for i, token in enumerate(generated):
        if token in eos_ids:
            generated = generated[: i + 1]
            break
    return generated[:max_new_tokens]


# --------------------------------------------------------------------------------------------
# Metrics (docs/eval-results.md)
# --------------------------------------------------------------------------------------------


def acceptance_metrics(rounds: Iterable[RoundStats], k: int) -> dict:
    """vLLM-style acceptance over verification rounds that had at least one draft token.

    acceptance_length = 1 + accepted / rounds; per_position_acceptance[i] = share of rounds
    whose draft position i was accepted (accepted > i); their sum + 1 is acceptance_length.
    With no round at all: acceptance_length 1.0 and zero rates.
    """
    counted = [r for r in rounds if r.proposed > 0]
    accepted_at = [0] * k
    for r in counted:
        if r.accepted > r.proposed or r.proposed > k or r.accepted < 0:
            raise ValueError(f"inconsistent round {r} for k={k}")
        for i in range(r.accepted):
            accepted_at[i] += 1
    n = len(counted)
    total_accepted = sum(r.accepted for r in counted)
    return {
        "acceptance_length": 1.0 + total_accepted / n if n else 1.0,
        "per_position_acceptance": [c / n if n else 0.0 for c in accepted_at],
        "rounds": n,
        "draft_tokens": sum(r.proposed for r in counted),
        "accepted_tokens": total_accepted,
        "draft_acceptance_rate": total_accepted / max(1, sum(r.proposed for r in counted)),
    }


def aux_capture(draft, target):
    """HiddenStateCapture hooks on the target's decoder layers the draft reads (its config's
    aux_layer_ids, checked against the target's depth): what the draft is fed, in serving and
    teacher-forced alike."""
    from eagleforge.target.capture import HiddenStateCapture
    from eagleforge.target.loading import decoder_layers, final_norm

    ids = list(draft.config.aux_layer_ids)
    num_layers = len(decoder_layers(target))
    if not ids or max(ids) >= num_layers or min(ids) < 0:
        raise ValueError(f"draft aux_layer_ids {ids} do not fit a target with {num_layers} decoder layers")
    return HiddenStateCapture(decoder_layers(target), ids, final_norm(target))


def teacher_forced_hits(draft, target, token_ids: Sequence[int], k: int) -> torch.Tensor:
    """Which draft positions of a round starting at each row the draft gets right when it is fed
    the true tokens: bool [T, k], hits[t, j] = TTT step j at row t (predicting token t+2+j from
    the target's aux states of ONE forward over token_ids and the true tokens t+1 .. t+1+j)
    equals token_ids[t+2+j]; False where t+2+j is past the end.

    A round of chain speculative decoding whose context ends at token t+1 feeds the draft
    exactly these inputs as long as its drafts are right, so the round accepts the leading run
    of hits[t] (tests check this round by round; `teacher_forced_acceptance` turns hits into
    acceptance lengths). Beside the measured acceptance it separates what the serving path
    loses (nothing, when they agree) from what the text asks of the draft."""
    ids = torch.tensor([list(token_ids)], dtype=torch.long, device=model_device(target))  # [1, T]
    param = next(draft.parameters())
    with torch.inference_mode():
        with aux_capture(draft, target) as capture:
            target(input_ids=ids, use_cache=False)
            aux = capture.aux_hidden_states.to(device=param.device, dtype=param.dtype)  # [1, T, k*Ht]
        normed = draft.forward_ttt(aux, ids.to(param.device), k)  # k x [1, T, H]
        predicted = torch.stack([draft.to_target_ids(draft.logits(h).argmax(-1))[0] for h in normed], dim=1)  # [T, k]
    t = ids.shape[1]
    truth = torch.full((t, k), -1, dtype=torch.long)
    flat = ids[0].cpu()
    for j in range(k):
        truth[: max(0, t - 2 - j), j] = flat[2 + j:]
    return predicted.cpu() == truth


def teacher_forced_acceptance(hits: Sequence[torch.Tensor], starts: Sequence[int], k: int) -> dict:
    """Two acceptance lengths from teacher-forced hits [T_i, k] of sequences whose answers start
    after row starts[i] (the draft row of the first round), both over rounds whose k positions
    all lie inside the sequence:

    every_row: every row t >= start as a round start; position j's rate = share of rows whose
        first j+1 hits are all True.
    replayed: the rounds chain speculative decoding would run on this text: from the start row,
        accept the leading run a of hits[t], go on at row t + a + 1. Over those rounds it equals
        the measured acceptance when the serving path computes what training computed (the
        engine also counts the last rounds, whose drafts run past the answer). It differs from
        every_row because rounds fall unevenly: one starts right after every miss, while the
        rows inside an accepted run start none (on real text it came out lower)."""
    every, replayed = [], []
    for h, start in zip(hits, starts):
        last = h.shape[0] - 2 - k  # the last row whose k positions lie inside: t + 1 + k <= T - 1
        accepted = torch.cumprod(h.int(), dim=1).sum(dim=1).tolist()  # [T]: the leading run of hits
        every += [RoundStats(proposed=k, accepted=accepted[t]) for t in range(start, last + 1)]
        row = start
        while row <= last:
            replayed.append(RoundStats(proposed=k, accepted=accepted[row]))
            row += accepted[row] + 1
    return {"every_row": acceptance_metrics(every, k), "replayed": acceptance_metrics(replayed, k)}


def copy_classifier(ngram_max: int = 3, ngram_min: int = 1) -> Callable[[list[int], int], bool]:
    """classify for speculative_generate: a position is "copyable" when prompt lookup's first
    token (ngram_match) is the target's token there, i.e. the text continues as it did before."""
    return lambda context, token: ngram_match(context, 1, ngram_max, ngram_min)[:1] == [int(token)]


def acceptance_by_kind(rounds: Sequence[RoundStats], k: int) -> dict | None:
    """acceptance_metrics over the copyable rounds and over the others ("novel"), with each kind's
    share of the rounds; None when the rounds were not classified."""
    rounds = [r for r in rounds if r.proposed > 0]
    if not rounds or any(r.copyable is None for r in rounds):
        return None
    out = {}
    for kind, flag in (("copyable", True), ("novel", False)):
        part = [r for r in rounds if r.copyable is flag]
        m = acceptance_metrics(part, k)
        out[kind] = {"share_of_rounds": len(part) / len(rounds), "rounds": m["rounds"],
                     "acceptance_length": m["acceptance_length"], "per_position_acceptance": m["per_position_acceptance"]}
    return out
