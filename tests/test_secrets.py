"""The copy forward's secret filter finds keys wherever a file holds them and the token stores
of common tools (issue 23, item 6): a PEM key inside a GCP service account's JSON, in indented
YAML, after a BOM, in UTF-16, base64-encoded once more; PGP and PuTTY keys; Hugging Face, Kaggle,
gh, rclone and the shell histories.  Source code that merely names a key's header is sent."""

from __future__ import annotations

import base64
import contextlib
import json
import random
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from ssh_scheduler.jobs import secret_scan
from ssh_scheduler.jobs.forward import ForwardPolicy, Hasher, collect_forward, holds_key_text

PEM = ec.generate_private_key(ec.SECP256R1()).private_bytes(
    serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
).decode()
PGP = (
    "-----BEGIN PGP PRIVATE KEY BLOCK-----\n\n"
    "lQOYBGXkZ2IBCADL5Ue0tLwJ0T0x2l3hE2bDk1m4P6x+3g9fXh0QJ0cXqWvP0n2y\n=abcd\n"
    "-----END PGP PRIVATE KEY BLOCK-----\n"
)
PPK_LINES = "PuTTY-User-Key-File-3: ssh-ed25519\nEncryption: none\nComment: me\nPublic-Lines: 2\n"

KEYS: dict[str, bytes] = {
    "gcp-sa.json": json.dumps({"type": "service_account", "private_key_id": "abc", "private_key": PEM}).encode(),
    "compact.json": json.dumps({"private_key": PEM}, separators=(",", ":")).encode(),
    "values.yaml": ("tls:\n  key: |\n" + "".join(f"    {line}\n" for line in PEM.splitlines())).encode(),
    "bom.pem": b"\xef\xbb\xbf" + PEM.encode(),
    "utf16le.pem": PEM.encode("utf-16"),  # with its BOM
    "utf16be.txt": PEM.encode("utf-16-be"),
    "utf32le.pem": PEM.encode("utf-32"),  # with its BOM
    "utf32be.txt": PEM.encode("utf-32-be"),
    # After binary bytes (a NUL among them), as a key pasted into a data file would stand.
    "blob16.bin": b"\x00\x01\xff\xfe" * 8 + PEM.encode("utf-16-le"),
    "blob32.bin": b"\x00\x01\xff\xfe" * 8 + PEM.encode("utf-32-be"),
    "putty16.txt": PPK_LINES.encode("utf-16-le"),
    "pgp.asc": PGP.encode(),
    "pgp-indented.yaml": ("key: |\n" + "".join(f"  {line}\n" for line in PGP.splitlines())).encode(),
    "putty.json": json.dumps({"key": PPK_LINES}).encode(),
    "secret.yaml": b"data:\n  tls.key: " + base64.b64encode(PEM.encode()) + b"\n",
    "app.env": b"PRIVATE_KEY=\"" + PEM.replace("\n", "\\n").encode() + b"\"\n",
}
TOKEN_STORES = [
    ".cache/huggingface/token", ".huggingface/token", "hf_home/huggingface/stored_tokens",
    ".kaggle/kaggle.json", "kaggle.json", ".config/kaggle/kaggle.json",
    ".config/gh/hosts.yml", ".config/rclone/rclone.conf", "rclone.conf", ".config/hub",
    ".bash_history", ".zsh_history", "sub/.python_history", ".local/share/fish/fish_history",
    ".psql_history", ".mysql_history", ".ipython/profile_default/history.sqlite",
    ".cargo/credentials.toml", ".terraform.d/credentials.tfrc.json",
]
NOT_SECRETS: dict[str, bytes] = {
    "src/pem.py": b"HEADER = '-----BEGIN RSA PRIVATE KEY-----'\nFOOTER = '-----END RSA PRIVATE KEY-----'\n",
    "src/doc.md": b"A key file starts with `-----BEGIN OPENSSH PRIVATE KEY-----` and then its body.\n",
    "src/check.json": json.dumps({"header": "-----BEGIN PRIVATE KEY-----", "note": "what a key starts with"}).encode(),
    "certs/ca.pem": b"-----BEGIN CERTIFICATE-----\nMIIBszCCAVmgAwIBAgIUYj\n-----END CERTIFICATE-----\n",
    "keys/pub.asc": b"-----BEGIN PGP PUBLIC KEY BLOCK-----\n\nmQENBGXkZ2IBCADL5Ue0tLwJ0T0x\n-----END PGP PUBLIC KEY BLOCK-----\n",
    "keys/id.pub": b"ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIG me\n",
    "data/utf16.txt": "plain text, no key at all\n".encode("utf-16"),
    "history.md": b"# History of the project\n",
    "token.txt.example": b"put your token here\n",
}


def _tree(base: Path, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        path = base / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


@pytest.mark.parametrize("name", KEYS)
def test_a_key_is_withheld_wherever_in_the_file_it_stands(name: str, tmp_path: Path) -> None:
    _tree(tmp_path, {"train.py": b"print(1)\n", f"conf/{name}": KEYS[name]})
    forward = collect_forward((".",), tmp_path, Hasher())
    assert [f.rel for f in forward.files] == ["train.py"]
    assert forward.withheld == (f"conf/{name}",)


def test_token_stores_and_histories_are_withheld(tmp_path: Path) -> None:
    _tree(tmp_path, {"train.py": b"print(1)\n", **{rel: b"hf_abcdefghijklmnop\n" for rel in TOKEN_STORES}})
    forward = collect_forward((".",), tmp_path, Hasher())
    assert [f.rel for f in forward.files] == ["train.py"]
    withheld = set(forward.withheld)
    for rel in TOKEN_STORES:  # the file, or the folder holding it
        assert any(rel == w or rel.startswith(w + "/") for w in withheld), rel


def test_text_that_only_names_a_key_is_sent(tmp_path: Path) -> None:
    _tree(tmp_path, NOT_SECRETS)
    forward = collect_forward((".",), tmp_path, Hasher())
    assert sorted(f.rel for f in forward.files) == sorted(NOT_SECRETS)
    assert forward.withheld == ()


def test_a_named_key_file_in_json_is_refused_unless_allowed(tmp_path: Path) -> None:
    from ssh_scheduler.errors import TransferError

    _tree(tmp_path, {"sa.json": KEYS["gcp-sa.json"]})
    with pytest.raises(TransferError, match="holds a private key; secrets are not sent"):
        collect_forward(("sa.json",), tmp_path, Hasher())
    allowed = collect_forward(("sa.json",), tmp_path, Hasher(), policy=ForwardPolicy(allow_secrets=True))
    assert [f.rel for f in allowed.files] == ["sa.json"]



def _decoding_every_way(head: bytes) -> bool:
    """The scan as it was before it looked for the letters first (the oracle): every wide
    decoding tried, in order, the first that shows a word ending the scan."""
    if secret_scan._KEY_AT_LINE_START.search(head) or secret_scan._KEY_ANYWHERE.search(head):
        return True
    for match in secret_scan._BASE64_PEM.finditer(head):
        chunk = match.group()[: len(match.group()) // 4 * 4]
        with contextlib.suppress(ValueError):
            if _decoding_every_way(base64.b64decode(chunk)):
                return True
    if b"\x00" in head:
        for encoding in ("utf-16-le", "utf-16-be", "utf-32-le", "utf-32-be"):
            narrow = head.decode(encoding, "ignore").encode("utf-8", "ignore")
            if b"-----BEGIN" in narrow or b"PuTTY" in narrow:
                return _decoding_every_way(narrow)
    return False


def test_the_wide_scan_skips_a_decoding_only_where_it_could_not_find_a_key() -> None:
    """Looking for the letters first changes no answer: binary data with and without a key in
    each wide encoding, at either alignment, its letters split by units the decoding drops, and
    random bytes: the same verdict as decoding every way."""
    rng = random.Random(7)
    pieces = [PEM, PGP, PPK_LINES, "-----BEGIN", "PuTTY", "-BEGIN PuTY", "no key here"]
    heads = []
    for _ in range(600):
        text = rng.choice(pieces)
        encoding = rng.choice(("utf-16-le", "utf-16-be", "utf-32-le", "utf-32-be"))
        wide = text.encode(encoding)
        if rng.random() < 0.3 and encoding.startswith("utf-32"):
            unit, bad = 4, b"\x7f\xff\xff\xff"[:: 1 if encoding.endswith("be") else -1]  # > U+10FFFF
            wide = bad.join(wide[i : i + unit] for i in range(0, len(wide), unit))
        noise = bytes(rng.randrange(256) for _ in range(rng.randrange(64))) + b"\x00"
        heads.append(noise[: rng.randrange(len(noise) + 1)] + wide + noise)
    heads += [bytes(rng.randrange(256) for _ in range(2000)) for _ in range(200)]
    verdicts = [_decoding_every_way(head) for head in heads]
    assert [holds_key_text(head) for head in heads] == verdicts
    assert 100 < sum(verdicts) < len(heads) - 200  # keys found and missed alike


def test_only_a_small_file_is_judged_by_its_content(tmp_path: Path) -> None:
    from ssh_scheduler.errors import TransferError

    """A key is a few KB: a file past KEY_SCAN_BYTES (a dataset whose first record happens to
    quote one) is not withheld for its content, named or walked; one at the limit is."""
    key = KEYS["gcp-sa.json"]
    _tree(tmp_path, {
        "big.json": key + b" " * (secret_scan.KEY_SCAN_BYTES + 1 - len(key)),
        "edge.json": key + b" " * (secret_scan.KEY_SCAN_BYTES - len(key)),
    })  # fmt: skip
    assert [f.rel for f in collect_forward(("big.json",), tmp_path, Hasher()).files] == ["big.json"]
    walked = collect_forward((".",), tmp_path, Hasher())
    assert [f.rel for f in walked.files] == ["big.json"] and walked.withheld == ("edge.json",)
    with pytest.raises(TransferError, match=r"edge\.json holds a private key"):
        collect_forward(("edge.json",), tmp_path, Hasher())
