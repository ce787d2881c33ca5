"""The draft a run trains: sized from the target's config, given the target's frozen embedding and
the draft vocabulary, its embedding placed where the step plan wants it."""

from __future__ import annotations

from dataclasses import asdict, fields

import torch

from eagleforge.config import Config, check_model_sizes
from eagleforge.errors import UserInputError
from eagleforge.target.loading import check_target_files, target_path


def target_hf_config(cfg: Config, manifest: dict):
    """The target's HF config: stored in the manifest when the extractor put it there, else
    read from the target directory (AutoConfig)."""
    stored = manifest.get("target", {}).get("config")
    if isinstance(stored, dict):
        return stored
    from transformers import AutoConfig

    path = target_path(cfg.target)
    kwargs = {"gguf_file": cfg.target.gguf_file} if cfg.target.gguf_file else {}
    if not kwargs:
        check_target_files(path, weights=False)  # config.json a JSON object: one line naming it
    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=cfg.target.trust_remote_code, **kwargs)
    except (OSError, ValueError) as err:
        raise UserInputError(f"target.path {path}: cannot read the target's config ({str(err).splitlines()[0]})") from None


def build_draft(cfg: Config, manifest: dict, vocab: dict, head: dict) -> torch.nn.Module:
    """Eagle3Draft sized from the target config (+ cfg.draft overrides), with the frozen target
    embedding and d2t/t2d, its weights drawn under train.seed (so every rank, and a benchmark
    pairing two trainers, starts from the same draft) or taken from train.init_draft. lm_head
    keeps its random init: in a short SmolLM2 trial, starting it from the target's head rows gave
    a higher initial loss, far larger grad norms (so clipping dominated) and no accuracy gain
    (BENCHMARKS.md, "Smaller measurements the code's choices rest on")."""
    from eagleforge.draft import Eagle3Config, Eagle3Draft
    from eagleforge.draft.config import RopeConflictError

    overrides = {f.name: getattr(cfg.draft, f.name) for f in fields(cfg.draft)}
    target_config = target_hf_config(cfg, manifest)  # its own errors name the target's files
    try:
        draft_config = Eagle3Config.from_target_config(
            target_config, int(vocab["d2t"].shape[0]), manifest["aux_layer_ids"], **overrides
        )
    except RopeConflictError as err:  # the target's own config, not the draft.* keys
        raise UserInputError(f"target.path {cfg.target.path or 'embedded default'}: {err}") from None
    except ValueError as err:  # a draft.* override that does not fit the target or itself
        set_keys = ", ".join(f"draft.{k}={v}" for k, v in overrides.items() if v not in (None, 0, ""))
        raise UserInputError(f"draft config ({set_keys or 'defaults'}) does not fit the target of {cfg.run / 'hidden'}: {err}") from None
    # the target's config.json sized it: checked before Eagle3Draft allocates [vocab_size, hidden_size]
    check_model_sizes(asdict(draft_config), f"the draft sized from target.path {cfg.target.path or 'embedded default'}'s config")
    try:  # the export's config.json, written at the end: refused now rather than after training
        draft_config.to_hf_dict()
    except ValueError as err:
        raise UserInputError(f"{cfg.run / 'hidden'}: the draft of its aux layers cannot be exported: {err}") from None
    shard_hidden = manifest.get("target", {}).get("hidden_size")
    if shard_hidden is not None and int(shard_hidden) != draft_config.target_hidden_size:
        raise UserInputError(
            f"{cfg.run / 'hidden'}: the shards hold hidden_size {shard_hidden} but the target "
            f"({cfg.target.path or 'embedded default'}) has {draft_config.target_hidden_size}; extract again for this target"
        )
    torch.manual_seed(cfg.train.seed)
    draft = Eagle3Draft(draft_config)
    try:
        draft.set_embed_tokens(head["embed_tokens"])
        draft.set_vocab_map(vocab["d2t"], vocab["t2d"])
    except ValueError as err:
        raise UserInputError(f"{cfg.run / 'vocab'}: {err} (target changed since the vocab stage? rerun it)") from None
    draft.embed_tokens.weight.requires_grad_(False)
    if cfg.train.init_draft:
        warm_start(draft, cfg.train.init_draft)
    return draft


def warm_start(draft: torch.nn.Module, path: str) -> None:
    """Start `draft` (built for this run) from the trained weights of the draft at `path`
    (train.init_draft): an export, or a draft in a form another trainer writes (load_draft,
    docs/export.md), of the same shape and the same draft vocabulary, or a UserInputError naming
    what differs. The frozen embedding stays the run's (the target's)."""
    from eagleforge.draft import load_draft

    try:  # the target's depth: the aux layers of a config.json that names none
        loaded = load_draft(path, target_num_layers=draft.config.target_num_layers)
    except (OSError, ValueError) as err:
        raise UserInputError(f"train.init_draft={path}: {err}") from None
    ours, theirs = draft.config.to_hf_dict(), loaded.config.to_hf_dict()
    differ = sorted(k for k in ours.keys() | theirs.keys() if k not in WARM_START_FREE_KEYS and ours.get(k) != theirs.get(k))
    if differ:
        raise UserInputError(f"train.init_draft={path}: the draft differs from this run's in "
                             + ", ".join(f"{k} ({theirs.get(k)!r}, this run {ours.get(k)!r})" for k in differ[:6]))
    theirs_ids, ours_ids = (d.d2t.cpu() + torch.arange(d.config.draft_vocab_size) for d in (loaded, draft))
    if not torch.equal(theirs_ids, ours_ids):  # lm_head row i scores target id i + d2t[i]: another map, other tokens
        differ = (theirs_ids != ours_ids).nonzero().flatten()
        i = int(differ[0])
        raise UserInputError(f"train.init_draft={path}: its vocabulary map (d2t) is not this run's RUN/vocab: {len(differ)} of "
                             f"{len(ours_ids)} draft ids map to other target ids (draft id {i}: target id {int(theirs_ids[i])}, "
                             f"this run {int(ours_ids[i])}); run the vocab stage with the draft's vocabulary or train from scratch")
    trained = {n: t for n, t in loaded.state_dict().items() if n not in ("embed_tokens.weight", "d2t", "t2d")}
    with torch.no_grad():
        result = draft.load_state_dict(trained, strict=False)
    assert not result.unexpected_keys and set(result.missing_keys) <= {"embed_tokens.weight", "d2t", "t2d"}, result


# config.json keys that may differ between a warm start and the run: none changes the weights' meaning
# (eagle_config repeats the top-level aux ids in the numbering SGLang gives the run's target).
WARM_START_FREE_KEYS = ("max_position_embeddings", "target_num_layers", "torch_dtype", "dtype", "transformers_version",
                        "eagle_config")


def embedding_to_host(draft: torch.nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """Take the draft's frozen embedding out of it: returns its weight [V, H] as `dtype` on the
    host and leaves an empty [0, H] one in the draft (moved with it, holding no memory), so
    the batches bring their embedding rows (Batch.input_embeds) instead."""
    weight = draft.embed_tokens.weight.detach().to("cpu", dtype)
    draft.embed_tokens.weight = torch.nn.Parameter(weight.new_empty(0, weight.shape[1]), requires_grad=False)
    return weight
