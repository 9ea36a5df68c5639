"""Request bodies from JSON text, refused with a 400 when no handler could use them safely.

Beyond "is it JSON": a body nested deeper than ``MAX_JSON_DEPTH`` (Python's parser raises RecursionError
at ~1,000 levels; pydantic and schema compilers recurse too), and a string holding a lone UTF-16 surrogate
(``"\\ud800"`` is valid JSON but no valid text: tokenizers and encoders raise on it) are refused here, once,
naming where the problem is, so no endpoint meets either.
"""

from __future__ import annotations

import json
import re
from typing import Any

from kvserve.errors import InvalidRequestError

# No real request nests this deep (a JSON schema of 20 levels is already unusual).
MAX_JSON_DEPTH = 128

# A \uD800-\uDFFF escape in the raw text; only then can a parsed string hold a surrogate (raw UTF-8
# cannot encode one, and the body was decoded as strict UTF-8).
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89abcdefABCDEF]")
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def parse_json_object(text: str) -> dict[str, Any]:
    """Parse a request body.

    Raises:
        InvalidRequestError: not JSON (NaN and Infinity included), not an object, nested deeper than
            ``MAX_JSON_DEPTH``, or a string with a lone surrogate (``param`` is its path, e.g. ``prompt`` or
            ``messages[0].content``).
    """
    try:
        obj = json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise InvalidRequestError(f"body: JSON nested deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as e:
        raise InvalidRequestError(f"body: not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise InvalidRequestError("body: must be a JSON object")
    _check_tree(obj, check_strings=_SURROGATE_ESCAPE.search(text) is not None)
    return obj


def _check_tree(root: dict[str, Any], check_strings: bool) -> None:
    """Depth and (when asked) lone surrogates, iteratively: ``[(value, path, depth)]`` as a stack."""
    stack: list[tuple[Any, tuple[str | int, ...], int]] = [(root, (), 1)]
    while stack:
        value, path, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            field = str(path[0]) if path else None  # the body's field holding the deep value
            raise InvalidRequestError(f"{field or 'body'}: JSON nested deeper than {MAX_JSON_DEPTH} levels",
                                      param=field)
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, child in items:
            if isinstance(child, dict | list):
                stack.append((child, (*path, key), depth + 1))
            elif check_strings and isinstance(child, str):
                _check_string(child, (*path, key))
            if check_strings and isinstance(key, str):
                _check_string(key, path)


def _check_string(s: str, path: tuple[str | int, ...]) -> None:
    match = _LONE_SURROGATE.search(s)
    if match is None:
        return
    param = _path(path)
    raise InvalidRequestError(
        f"{param or 'body'}: not valid Unicode text: a lone UTF-16 surrogate \\u{ord(match.group()):04x} at "
        f"character {match.start()} (escape pairs must come as high + low surrogate)", param=param or None)


def _path(parts: tuple[str | int, ...]) -> str:
    """``('messages', 0, 'content')`` -> ``messages[0].content``."""
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")
