"""How vLLM and SGLang will read a draft (docs/export.md "Checking a draft").

    python -m eagleforge.export check DRAFT [--target TARGET]

DRAFT is a draft directory (config.json + model.safetensors: the project's export or a draft
another trainer wrote); TARGET the target model's directory or its config.json (plain JSON, no
remote code). One short report: the architecture, the aux layers the draft was trained on and
the layers each engine captures (draft/engines.py), the vocabulary map, RoPE and context, the
norm switches. Exit 0 when both engines read the draft as it was trained; exit 2 with one
`error:` line per problem where an engine would silently run it otherwise (other layers, a
switch it does not read) or where the draft does not say what it was trained on. `warning:`
lines name what an engine refuses loudly or changes with only a log line. The eval stage runs
the same check first (eval/evaluate.py).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path

from eagleforge.draft import engines
from eagleforge.draft.config import Eagle3Config, flatten_speculators
from eagleforge.draft.io import CONFIG_FILE, EMBED_TENSOR, FOREIGN_TENSOR_NAMES, check_draft_weights, read_draft_config
from eagleforge.errors import bounded_text
from eagleforge.failures import MAX_LINE_CHARS, one_line

VLLM = "vLLM " + "/".join(engines.VLLM_VERSIONS)
SGLANG = f"SGLang {engines.SGLANG_VERSION}"


@dataclass
class Report:
    lines: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def text(self) -> str:
        verdict = ("both engines read it as it was trained" if not self.errors
                   else f"{len(self.errors)} problem{'s' * (len(self.errors) > 1)}: an engine would not run it as it was trained")
        lines = [*self.lines, f"verdict: {verdict}", *(f"warning: {w}" for w in self.warnings), *(f"error: {e}" for e in self.errors)]
        return "\n".join(bounded_text(line, MAX_LINE_CHARS) for line in lines)  # a crafted config's 20,000 ids: cut


def read_target_config(path) -> dict:
    """A target's config.json (a directory holding one, or the file) as a dict."""
    from eagleforge.readers import read_json_object

    path = Path(path)
    file = path / CONFIG_FILE if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"--target {path}: no {CONFIG_FILE} there")
    return read_json_object(file, "a model's config.json")


def _rope(config: dict) -> tuple[str, float | None, dict]:
    """(RoPE type, theta, scaling dict) of a config.json, old (rope_scaling) or new (rope_parameters) style."""
    scaling = config.get("rope_scaling") or {}
    params = config.get("rope_parameters") if isinstance(config.get("rope_parameters"), dict) else {}
    if not scaling and params:
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    theta = config.get("rope_theta") if config.get("rope_theta") is not None else params.get("rope_theta")
    return str(scaling.get("rope_type") or scaling.get("type") or "default"), theta, scaling


def _default_depth(aux: list[int]) -> int | None:
    """The target depth L whose engine defaults, the outputs of [1, L//2 - 1, L - 4], are `aux`; None if none."""
    depth = aux[-1] + 4 if aux else 0
    return depth if aux == [j - 1 for j in engines.default_capture(depth)] else None


def _tensors(weights: Path) -> dict[str, list[int]]:
    from eagleforge.readers import open_safetensors

    with open_safetensors(weights) as f:
        return {name: list(f.get_slice(name).get_shape()) for name in f.keys()}


def check_draft(draft_dir, target: dict | None = None) -> Report:
    """The report of `python -m eagleforge.export check` for the draft at `draft_dir` and the
    target config.json `target` (None: unknown)."""
    draft_dir = Path(draft_dir)
    report = Report()
    raw, config_path, weights = read_draft_config(draft_dir)
    shapes = _tensors(weights)
    text = (target.get("text_config") or target) if target else {}
    text = text if isinstance(text, dict) else {}  # a text_config that is not an object: sizes unknown
    arch = (target.get("architectures") or [""])[0] if target else ""
    depth = int(text.get("num_hidden_layers") or 0) or None

    speculators = "speculators_model_type" in raw
    try:
        hf = flatten_speculators(raw, str(config_path))  # as vLLM reads it; SGLang reads no speculators format
    except ValueError as err:
        report.errors.append(str(err))
        return report
    try:
        config = Eagle3Config.from_hf_dict(raw, str(config_path), target_num_layers=depth or 0)
    except ValueError as err:
        config = None
        report.errors.append(f"{err}")

    report.lines.append(f"draft: {draft_dir}" + (" (vLLM's speculators format)" if speculators else ""))
    if config is not None:
        c = config
        report.lines.append(
            f"architecture: {', '.join(hf.get('architectures') or [])}: one Llama decoder layer, hidden {c.hidden_size}, "
            f"{c.num_attention_heads} heads / {c.num_key_value_heads} kv heads x {c.head_dim}, intermediate "
            f"{c.intermediate_size}, fc {c.num_aux_layers} x {c.target_hidden_size} -> {c.hidden_size}")
    if target:
        report.lines.append(f"target: {arch or '(no architectures)'}, {depth or '?'} layers, hidden "
                            f"{text.get('hidden_size')}, vocabulary {text.get('vocab_size')}")
    _check_aux_layers(report, hf, raw, config, arch if target else None, depth, speculators)
    if config is not None:
        _check_sizes(report, config, shapes, text, hf)
        _check_weights(report, config, weights, config_path)
        _check_rope(report, hf, config, text)
        _check_norms(report, hf, raw, config, shapes, speculators)
    return report


SGLANG_FAMILIES = ((engines.PLUS_ONE, "Llama, Qwen, Gemma, gpt-oss and most targets"),
                   (engines.PLUS_ONE_IF_FIRST_IS_ONE, "DeepSeek-V2/V3 and Kimi-K2.5 targets"))


def _check_aux_layers(report: Report, hf: dict, raw: dict, config, arch: str | None, depth: int | None, speculators: bool) -> None:
    """The layers each engine captures against those the draft was trained on (draft/engines.py)."""
    trained = config.aux_layer_ids if config is not None else None
    want = [i + 1 for i in trained] if trained is not None else None  # as layer inputs
    report.lines.append("aux layers (outputs of target layers): " + (f"{trained}" if trained is not None else "unknown (see the errors)"))

    def verdict(engine: str, captured: list[int] | None, how: str, last: int | None, fix: str = "") -> None:
        """One line for `engine` capturing the inputs of `captured` (None: the target's defaults),
        `last` the largest layer input it can capture on this target."""
        if captured is None and depth is None:
            guess = _default_depth(trained) if trained is not None else None
            report.lines.append(f"  {engine}: the target's defaults, the inputs of (2, L//2, L-3) ({how})"
                                + (f": the trained layers on a {guess}-layer target" if guess else ""))
            if trained is not None and guess is None:
                report.errors.append(f"{engine} captures the target's default layers ({how}), which are not the trained "
                                     f"{trained} for any depth" + (f"; {fix}" if fix else ""))
            return
        captured = engines.default_capture(depth) if captured is None else captured
        report.lines.append(f"  {engine}: captures the inputs of {captured} ({how})"
                            + ("" if want is None else ": as trained" if captured == want else f": NOT the trained {want}"))
        if want is not None and captured != want:
            report.errors.append(f"{engine} captures the inputs of layers {captured} ({how}) but the draft was trained on "
                                 f"the outputs of {trained}, the inputs of {want}" + (f"; {fix}" if fix else ""))
        if last is not None and max(captured) > last:
            report.errors.append(f"{engine} would capture the inputs of layers {captured}: it captures none past {last} on "
                                 f"the target's {depth} layers")

    inner = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") if isinstance(raw.get("eagle_config"), dict) else None
    readings = {version: engines.vllm_captures(hf, version) for version in engines.VLLM_VERSIONS}
    same = len({str(v) for v in readings.values()}) == 1
    for version, captured in readings.items():
        if hf.get("eagle_aux_hidden_state_layer_ids"):
            how = "top-level eagle_aux_hidden_state_layer_ids"
        elif captured is not None:
            how = "no top-level ids: eagle_config's, as layer inputs"
        else:
            how = "no top-level ids" + ("; eagle_config's are not read" if inner else "")
        fix = "" if hf.get("eagle_aux_hidden_state_layer_ids") or want is None else f"write top-level eagle_aux_hidden_state_layer_ids {want}"
        verdict(VLLM if same else f"vLLM {version}", captured, how, depth, fix)  # vLLM captures up to the last layer's output
        if same:
            break

    if speculators:
        report.lines.append(f"  {SGLANG}: reads no speculators format")
        report.warnings.append(f"{SGLANG} cannot load this draft: it reads no speculators format (speculators_model_type)")
        return
    ids = inner or None
    if arch is not None:
        rule = engines.sglang_rule(arch)
        last = None if depth is None else depth if rule == engines.PLUS_ONE_UNLESS_MAX_IS_DEPTH else depth - 1
        try:
            fix = "" if trained is None else f"write eagle_config's eagle_aux_hidden_state_layer_ids {engines.sglang_eagle_config_ids(trained, arch)}"
        except ValueError as err:
            fix = f"no eagle_config list can say them: {err}"
        verdict(SGLANG, engines.sglang_captures(ids, rule, depth),
                (f"eagle_config {ids}" if ids else "no eagle_config ids") + f"; a {arch or 'the'} target {rule}", last, fix)
        return
    # No target: SGLang's reading of a list depends on the target's architecture.
    readings = {rule: engines.sglang_captures(ids, rule, None) for rule, _ in SGLANG_FAMILIES}
    if not ids or len({str(v) for v in readings.values()}) == 1:
        verdict(SGLANG, readings[engines.PLUS_ONE], f"eagle_config {ids}, on every target" if ids else "no eagle_config ids", None)
        return
    for rule, targets in SGLANG_FAMILIES:
        report.lines.append(f"  {SGLANG} on {targets}: captures the inputs of {readings[rule]} (eagle_config {ids})"
                            + ("" if want is None else ": as trained" if readings[rule] == want else f": NOT the trained {want}"))
    if want is not None and want not in readings.values():
        report.errors.append(f"{SGLANG} captures the inputs of {' or '.join(str(v) for v in readings.values())} "
                             f"(eagle_config {ids}) but the draft was trained on the inputs of {want}")
    elif want is not None:
        wrong = next(targets for rule, targets in SGLANG_FAMILIES if readings[rule] != want)
        report.warnings.append(f"{SGLANG} reads eagle_config {ids} as other layers on {wrong}: give --target to check")


def _check_weights(report: Report, config, weights: Path, config_path: Path) -> None:
    """The weights against config.json as load_draft checks them (tensors, shapes, dtypes, the
    vocabulary map: draft/io.py check_draft_weights): an engine would refuse the file or run
    other numbers."""
    from eagleforge.readers import open_safetensors

    try:
        with open_safetensors(weights) as f:
            check_draft_weights(f, config, weights, config_path)
    except ValueError as err:
        report.errors.append(str(err))


def _check_sizes(report: Report, config, shapes: dict, text: dict, hf: dict) -> None:
    c = config
    names = set(shapes)
    report.lines.append(f"vocabulary: Vd {c.draft_vocab_size} of V {c.vocab_size}; d2t {'present' if 'd2t' in names else 'absent'}, "
                        f"t2d {'present' if 't2d' in names else 'absent (derived from d2t)' if 'd2t' in names else 'absent'}"
                        + ("; the draft's own embed_tokens.weight (vLLM runs it where it differs from the target's, SGLang "
                           "the target's)" if EMBED_TENSOR in names else ""))
    fc = shapes.get("fc.weight")
    count = engines.fc_aux_count(hf)
    if fc is not None and count * c.target_hidden_size != fc[1]:
        report.warnings.append(f"{VLLM} and {SGLANG} size fc for {count} aux states ({count * c.target_hidden_size} inputs; "
                               f"num_aux_hidden_states, else eagle_config's ids, else 3) but fc.weight has {fc[1]}: they refuse "
                               "to load it; write eagle_config's eagle_aux_hidden_state_layer_ids")
    if text:
        if text.get("vocab_size") is not None and int(text["vocab_size"]) != c.vocab_size:
            report.errors.append(f"the draft's vocab_size {c.vocab_size} is not the target's {text['vocab_size']}: "
                                 "d2t maps draft ids into another vocabulary")
        if text.get("hidden_size") is not None and int(text["hidden_size"]) != c.target_hidden_size:
            report.errors.append(f"the draft reads aux states of width {c.target_hidden_size} (target_hidden_size, else "
                                 f"hidden_size) but the target's are {text['hidden_size']}")


def _check_rope(report: Report, hf: dict, config, text: dict) -> None:
    rope_type, theta, scaling = _rope(hf)
    factor = f" factor {scaling['factor']}" if scaling.get("factor") is not None else ""
    mpe = config.max_position_embeddings
    target_mpe = text.get("max_position_embeddings") if text else None
    report.lines.append(f"RoPE: {rope_type}{factor}, theta {config.rope_theta:g}; max_position_embeddings {mpe}"
                        + (f" (target {target_mpe})" if target_mpe is not None else ""))
    if target_mpe is not None and mpe < int(target_mpe) and rope_type not in engines.VLLM_CACHE_ONLY_ROPE_TYPES:
        report.warnings.append(
            f"vLLM >= 0.33 serves the target at the draft's context, {mpe} instead of {target_mpe}: a {rope_type} RoPE draft "
            "with a shorter max_position_embeddings lowers max_model_len with a log warning only "
            "(vllm/config/vllm.py _limit_max_model_len_to_draft); 0.32 raises the draft's instead. Set the draft's "
            f"max_position_embeddings to {target_mpe}")
    if text:
        t_type, t_theta, _ = _rope(text)
        if t_type != rope_type or (t_theta is not None and float(t_theta) != config.rope_theta):
            report.warnings.append(f"the draft's RoPE ({rope_type}, theta {config.rope_theta:g}) is not the target's "
                                   f"({t_type}, theta {t_theta}): trained so, it runs so in both engines")


def _check_norms(report: Report, hf: dict, raw: dict, config, shapes: dict, speculators: bool) -> None:
    c = config
    legacy = sorted(n for n in shapes if any(n.startswith(p) for p in FOREIGN_TENSOR_NAMES if p.startswith("aux_norm")))
    report.lines.append(f"norms: fc_norm {str(c.fc_norm).lower()}" + (" (EAGLE-3.1)" if c.fc_norm else "")
                        + f", norm_before_residual {str(c.norm_before_residual).lower()}, norm_output {str(c.norm_output).lower()}")
    if c.norm_before_residual and not speculators:
        report.errors.append(f"norm_before_residual is true: {SGLANG} does not read it and runs the draft with the residual "
                             f"h instead of hidden_norm(h); {VLLM} reads it")
    if c.fc_norm and (raw.get("use_aux_norm") and not raw.get("fc_norm") or legacy):
        report.warnings.append(f"{VLLM} refuses this EAGLE-3.1 draft: it reads only \"fc_norm\": true and the names "
                               f"fc_norm.{{i}}.weight (here {'use_aux_norm' if raw.get('use_aux_norm') else 'fc_norm'}"
                               + (f", {legacy[0]}" if legacy else "") + f"); {SGLANG} reads both")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eagleforge.export", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser("check", help="how vLLM and SGLang will read a draft (exit 2 where one would misread it)")
    check.add_argument("draft", help="the draft's directory (config.json, model.safetensors)")
    check.add_argument("--target", help="the target's directory or config.json: its depth and architecture decide what "
                                        "the engines capture")
    args = parser.parse_args(argv)
    try:
        target = read_target_config(args.target) if args.target else None
        report = check_draft(args.draft, target)
    except (OSError, ValueError) as err:
        print(f"error: {one_line(err)}", file=sys.stderr)
        return 2
    print(report.text())
    return 2 if report.errors else 0


if __name__ == "__main__":
    sys.exit(main())
