"""``ssh-scheduler report``'s page: one self-contained HTML file, written atomically.

The page is ``static/report.html`` with the package's own ``report.css`` and ``report.js`` put
inline (nothing is fetched: the file opens anywhere, offline, and can be mailed), and the data
(``view/report_data.py``) as a JSON block the script reads and draws with ``textContent`` only.

Two defences keep a hostile job name, command, host name or output from becoming markup:
the JSON block cannot end early (every ``<``, ``>`` and ``&`` in it is a ``\\u`` escape, so
``</script>`` in a job's output is just text), and the page's Content-Security-Policy runs only
the script and style whose hashes it names and lets the page fetch nothing at all
(``default-src 'none'``), so even markup that got in could neither run nor call out.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import html
import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any

from ssh_scheduler.errors import ConfigError, plain_text

__all__ = ["embedded_json", "render_page", "write_page"]

STATIC = Path(__file__).resolve().parent / "static"
_SLOT = re.compile(r"\{\{(\w+)\}\}")
_JSON_ESCAPES = {"<": "\\u003c", ">": "\\u003e", "&": "\\u0026"}


def _static(name: str) -> str:
    return (STATIC / name).read_text(encoding="utf-8")


def _hash(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


def embedded_json(data: Any) -> str:
    """``data`` as JSON that is safe inside ``<script type="application/json">``: ASCII only
    (no U+2028 surprises), and no ``<``, ``>`` or ``&`` that could end the element."""
    text = json.dumps(data, ensure_ascii=True, separators=(",", ":"), allow_nan=False)
    return re.sub("[<>&]", lambda m: _JSON_ESCAPES[m.group()], text)


def render_page(data: dict[str, Any]) -> str:
    style, script = _static("report.css"), _static("report.js")
    policy = (
        f"default-src 'none'; script-src {_hash(script)}; style-src {_hash(style)}; "
        "img-src data:; base-uri 'none'; form-action 'none'"
    )
    slots = {
        "policy": html.escape(policy),
        "title": html.escape(f"ssh_scheduler report: {data['title']}"),
        "style": style,
        "data": embedded_json(data),
        "script": script,
    }
    return _SLOT.sub(lambda m: slots[m.group(1)], _static("report.html"))


def write_page(path: Path, page: str) -> None:
    """Write ``page`` to ``path`` whole or not at all (a temporary file beside it, renamed): a
    reader never sees half a report, and a link at ``path`` is replaced, not followed."""
    folder = path.parent if str(path.parent) else Path(".")
    try:
        fd, temp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
    except OSError as exc:
        raise ConfigError(f"cannot write {plain_text(str(path))}: {exc.strerror or exc} (give -o a file in a writable folder)") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as stream:
            stream.write(page)
        os.chmod(temp, 0o644)
        os.replace(temp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise ConfigError(f"cannot write {plain_text(str(path))}: {exc.strerror or exc} (give -o another file)") from None
