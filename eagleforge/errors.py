"""The project's error for bad input, and how an error line shows a value a user gave.

A UserInputError (bad input data, a mismatched or damaged file: the message names the file and
the value) is, with eagleforge.config.ConfigError and FileNotFoundError, what the stages' entry
points print as one `error: ...` line (eagleforge.config.run_main). Plain standard library, so the
draft library and eagleforge.atomic raise it without importing the configuration.
"""

from __future__ import annotations

import itertools
import math
from typing import Any


class UserInputError(ValueError):
    """Bad input data or a mismatched file: the message names the file and the value."""


# What an error message shows of a value a user gave: a long string, list or mapping is cut to
# its start and says how much more there was, so no input can make an error line grow with it
# (a 20,000-item list, a YAML alias bomb, a 10 MB string).
SHOWN_CHARS = 120
SHOWN_ITEMS = 6


def bounded_repr(value: Any, depth: int = 2) -> str:
    """repr(value), at most a few hundred characters whatever the value: strings past SHOWN_CHARS
    and containers past SHOWN_ITEMS items end in "... (N more)", nesting past `depth` levels is
    shown by its type and size, and each item is itself bounded (so a shared nested value is
    never walked whole)."""
    if isinstance(value, str):
        return repr(value) if len(value) <= SHOWN_CHARS else f"{value[:SHOWN_CHARS]!r}... ({len(value) - SHOWN_CHARS} more characters)"
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 256:
        return f"an integer of about {int(value.bit_length() * math.log10(2)) + 1} digits"
    if isinstance(value, (list, tuple, set, frozenset, dict)):
        return _bounded_container(value, depth)
    return bounded_text(repr(value))


def bounded_text(text: str, limit: int = SHOWN_CHARS) -> str:
    """`text` cut after `limit` characters, saying how many more there were."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit} more characters)"


def _bounded_container(value, depth: int) -> str:
    if depth <= 0:
        return f"<{type(value).__name__} of {len(value)} items>"
    if isinstance(value, dict):
        parts = [f"{bounded_repr(k, depth - 1)}: {bounded_repr(v, depth - 1)}" for k, v in itertools.islice(value.items(), SHOWN_ITEMS)]
        opening, closing = "{", "}"
    else:
        parts = [bounded_repr(v, depth - 1) for v in itertools.islice(value, SHOWN_ITEMS)]
        opening, closing = ("[", "]") if isinstance(value, list) else ("(", ")") if isinstance(value, tuple) else ("{", "}")
    if len(value) > len(parts):
        parts.append(f"... ({len(value) - len(parts)} more)")
    return opening + ", ".join(parts) + closing
