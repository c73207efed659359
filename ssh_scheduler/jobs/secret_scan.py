"""Whether a file's content is a private key: a PEM, PGP or PuTTY key at a line's start, inside a
JSON or YAML value, base64-encoded once more, or in UTF-16/32 (what a copy forward withholds
whatever the file's name: :mod:`ssh_scheduler.jobs.forward`).  Pure: bytes in, a verdict out."""

from __future__ import annotations

import base64
import contextlib
import os
import re
import stat
from pathlib import Path

__all__ = ["KEY_SCAN_BYTES", "holds_key_text", "holds_private_key"]

# Keys are small: only files up to this size are read for a private key.
KEY_SCAN_BYTES = 64 * 1024
# A key at a line's start, as a PEM or PuTTY file has it (a BOM or indentation before it too).
_KEY_AT_LINE_START = re.compile(
    rb"^(?:\xef\xbb\xbf)?[ \t]*(?:-----BEGIN [A-Z0-9 ]*PRIVATE KEY(?: BLOCK)?-----|PuTTY-User-Key-File-)", re.M
)
# Anywhere else (a JSON string: a GCP service account's "private_key"; a YAML or .env value) the
# armour must be followed by what a key holds, so source code that names the header is no key:
# separators (real, or JSON-escaped \n), optional armour headers (Proc-Type:, Version:), then base64.
_SEP = rb"(?:[ \t\r\n]|\\[rnt])"
_KEY_ANYWHERE = re.compile(
    rb"-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY(?: BLOCK)?-----" + _SEP + rb"*"
    rb"(?:[A-Za-z][A-Za-z0-9-]*:[^\r\n\\]*" + _SEP + rb"+)*[A-Za-z0-9+/]{16}"
    rb"|PuTTY-User-Key-File-[0-9]+: *[\w@.-]+" + _SEP + rb"+Encryption: "
)
# A PEM file base64-encoded again (a Kubernetes secret, a kubeconfig's client-key-data).
_BASE64_PEM = re.compile(rb"LS0tLS1CRUdJTi[A-Za-z0-9+/]{20,200}")
_WIDE = ("utf-16-le", "utf-16-be", "utf-32-le", "utf-32-be")
# Decoding binary data (a NUL in it) four times costs ~60 us per KB, most of a forward's CPU for
# a dataset of small binary files.  A key's wide text needs each letter of "-----BEGIN" (or of
# "PuTTY") encoded somewhere in the bytes: looked for first, decoded only when every one is.
_WIDE_LETTERS = tuple(
    (encoding, tuple(tuple(c.encode(encoding) for c in word) for word in ("-BEGIN", "PuTY")))
    for encoding in _WIDE
)


def _letters_in(head: bytes, words: tuple[tuple[bytes, ...], ...]) -> bool:
    """Whether every letter of some word occurs in ``head`` (plain loops: a file's scan is a few
    microseconds, where generators would double it)."""
    for word in words:
        for letter in word:
            if letter not in head:
                break
        else:
            return True
    return False


def holds_key_text(head: bytes) -> bool:
    """Whether these bytes (a small file's content) hold a PEM, PGP or PuTTY private key: at a
    line's start, inside a JSON or YAML value, base64-encoded once more, or in UTF-16/32."""
    # Each pattern holds one of these words as it is: looked for first (a substring search is a
    # tenth of a regex search, which tries every line start or "-"), most files hold neither.
    if (b"-----BEGIN " in head or b"PuTTY-User-Key-File-" in head) and (
        _KEY_AT_LINE_START.search(head) or _KEY_ANYWHERE.search(head)
    ):
        return True
    if b"LS0tLS1CRUdJTi" in head:
        for match in _BASE64_PEM.finditer(head):
            chunk = match.group()[: len(match.group()) // 4 * 4]
            with contextlib.suppress(ValueError):
                if holds_key_text(base64.b64decode(chunk)):
                    return True
    if b"\x00" in head:
        for encoding, words in _WIDE_LETTERS:
            if not _letters_in(head, words):
                continue  # this decoding cannot hold either word
            narrow = head.decode(encoding, "ignore").encode("utf-8", "ignore")
            if b"-----BEGIN" in narrow or b"PuTTY" in narrow:
                return holds_key_text(narrow)
    return False


def holds_private_key(path: Path, st: os.stat_result) -> bool:
    if not stat.S_ISREG(st.st_mode) or st.st_size > KEY_SCAN_BYTES:
        return False
    try:
        with open(path, "rb") as f:
            head = f.read(KEY_SCAN_BYTES)
    except OSError:
        return False  # unreadable: hashing it will say so
    return holds_key_text(head)
