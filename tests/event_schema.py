"""The ``--json`` event schema as the README documents it, and a checker for objects against it.

The README's table (between the ``event-schema`` markers) is the one source: the tests read it
here, so the documentation cannot drift from what ``--json`` prints.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

README = Path(__file__).resolve().parents[1] / "README.md"
COMMON = {"version": "int", "event": "str", "t": "float"}
GPU = {"index": "int", "memory_used_mb": "int", "memory_total_mb": "int", "utilization": "float", "ours_mb": "int"}


def load_schema(readme: Path = README) -> dict[str, dict[str, str]]:
    """event kind -> {field: type} (the common fields included)."""
    text = readme.read_text()
    body = text.split("<!-- event-schema: begin -->", 1)[1].split("<!-- event-schema: end -->", 1)[0]
    schema: dict[str, dict[str, str]] = {}
    for line in body.splitlines():
        match = re.match(r"\| `([a-z_]+)` \|(.*)\|$", line.strip())
        if not match:
            continue
        fields = dict(COMMON)
        for part in filter(None, (p.strip() for p in match.group(2).split(", `"))):
            name, kind = part.strip("`").split("` ", 1) if "` " in part else (part.strip("`"), "")
            fields[name] = kind.strip()
        schema[match.group(1)] = fields
    return schema


def _split_pair(inner: str) -> list[str]:
    """``str, int`` -> two types; ``[str, int]`` nested stays whole."""
    depth, start, parts = 0, 0, []
    for i, ch in enumerate(inner):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(inner[start:i].strip())
            start = i + 1
    parts.append(inner[start:].strip())
    return parts


def check_type(value: Any, kind: str, where: str) -> list[str]:
    if kind.endswith("?"):
        return [] if value is None else check_type(value, kind[:-1], where)
    if kind.startswith("["):
        if not isinstance(value, list):
            return [f"{where}: {value!r} is not a list ({kind})"]
        parts = _split_pair(kind[1:-1])
        if len(parts) == 2:
            if len(value) != 2:
                return [f"{where}: {value!r} is not a pair ({kind})"]
            return [*check_type(value[0], parts[0], where), *check_type(value[1], parts[1], where)]
        return [p for i, v in enumerate(value) for p in check_type(v, parts[0], f"{where}[{i}]")]
    if kind == "gpu":
        if not isinstance(value, dict) or set(value) != set(GPU):
            return [f"{where}: {value!r} is not a gpu object"]
        return [p for k, t in GPU.items() for p in check_type(value[k], t, f"{where}.{k}")]
    ok = {
        "str": isinstance(value, str),
        "int": isinstance(value, int) and not isinstance(value, bool),
        "float": isinstance(value, int | float) and not isinstance(value, bool),
        "bool": isinstance(value, bool),
    }.get(kind)
    if ok is None:
        return [f"{where}: the README names an unknown type {kind!r}"]
    return [] if ok else [f"{where}: {value!r} is not {kind}"]


def problems(obj: dict[str, Any], schema: dict[str, dict[str, str]]) -> list[str]:
    """Why ``obj`` does not match its event's documented fields (empty when it does)."""
    kind = obj.get("event")
    if kind not in schema:
        return [f"undocumented event {kind!r}"]
    fields = schema[str(kind)]
    found = [f"{kind}: missing field {name!r}" for name in fields if name not in obj]
    found += [f"{kind}: undocumented field {name!r}" for name in obj if name not in fields]
    found += [p for name, t in fields.items() if name in obj for p in check_type(obj[name], t, f"{kind}.{name}")]
    return found
