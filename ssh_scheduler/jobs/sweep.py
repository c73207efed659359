"""Parameter sweeps: a YAML grid -> combinations -> frozen :class:`Job` objects (pure).

The file follows the seed runner's format (YAML documents separated by ``---``)::

    template:                  # named commands, run in this order for every combination
      train: python train.py --lr {lr} --seed {seed} --out {_output}
      test: python test.py --model {_output}/model.pt
    default: {lr: 0.1, seed: 1, epochs: 10}
    gpus_per_job: 1            # needs here apply to every document (execute_batch flag names)
    ---
    lr: [0.1, 0.01]            # a document: the cross product of its lists
    seed: [1, 2]
    ---
    _title: long               # selectable with -t long
    epochs: 100
    lr: [0.01]
    gpu_memory_required: 20000 # this document's own needs

The combinations are the union of every document's cross product (defaults filling the rest),
duplicates dropped (the first wins).  Every error names the file and the document/key, and every
placeholder is checked against every document before anything runs.

Instead of ``template``, the header may name a Python function, ``call: package.module:function``:
each combination is then one call, ``function(**params)``, run in the combination's folder
(``ssh_scheduler.functions.call_sweep``; its job is ``<combination>.call``).

Placeholders are ``{name}`` for any parameter name the seed runner's ``str.format`` can address
(``early-stop`` too); ``{_output}`` is the combination's result folder and ``{_name}`` its name.
A value is written for where its placeholder stands in the shell's reading (a plain word,
``'...'``, ``"..."``, a comment; :mod:`ssh_scheduler.jobs.shell_template`): it stays one literal
piece of text whatever quoting surrounds it, and ``0.01`` or ``data/a.txt`` read exactly as
written; a placeholder where no writing could keep it literal (backquotes, arithmetic, a
here-document...) is refused when the file is read.  ``{{name}}`` is a literal ``{name}``;
``${VAR}`` and every brace that does not hold a name (JSON, ``awk '{print $1}'``) are left alone:
unlike ``str.format`` a shell command needs no escaping.

Combination names come from the parameters that vary anywhere in the file (not just in the part
selected with ``-t``/``--sample``), so a combination keeps its folder across runs: ``lr_0.01-seed_2``;
a name that had to be shortened or cleaned gets a short hash of its values.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import random
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import yaml

from ssh_scheduler.errors import BatchError, ConfigError, plain_text, show_value
from ssh_scheduler.jobs.batch_file import Job, check_dependencies
from ssh_scheduler.jobs.job_names import validate_job_name
from ssh_scheduler.jobs.needs import Needs, NeedsOverride
from ssh_scheduler.jobs.options import need_options
from ssh_scheduler.jobs.shell_template import TemplateError, check_template, placeholders

__all__ = [
    "CALL_COMMAND", "MAX_NAME_CHARS", "NEED_KEYS", "Combination", "SweepDocument", "SweepSpec",
    "build_jobs", "expand", "parse_sweep", "sample", "select_commands",
]

Scalar = str | int | float | bool

MAX_NAME_CHARS = 100
"""Longest combination folder name; longer ones are cut and get a hash (job names add a command)."""

# Per-document needs: the execute_batch flags, with underscores (``gpus_per_job: 2``), from the
# option table: a value's Needs field and type, a switch's field and what it sets.
NEED_KEYS: dict[str, tuple[str, type]] = {
    o.name: (o.to.partition(".")[2], o.kind) for o in need_options() if not o.switch
}
NEED_SWITCHES: dict[str, tuple[str, object]] = {
    o.name: (o.to.partition(".")[2], o.sets) for o in need_options() if o.switch
}
BUILTINS = ("_output", "_name")
_COMMAND_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_-]*\Z")
# ``call: package.module:function`` (a qualified name may hold dots: ``module:Class.method``)
_CALL_REFERENCE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_.]*\Z")
CALL_COMMAND = "call"
"""The one command of a sweep that calls a function: its jobs are ``<combination>.call``."""
_NAME_SAFE = re.compile(r"[^A-Za-z0-9._+=,@-]")


@dataclass(frozen=True, slots=True)
class SweepDocument:
    """One ``---`` section: lists to cross, its title and its own needs."""

    number: int
    """1-based position in the file, the header being document 1."""
    title: str | None
    params: dict[str, tuple[Scalar, ...]]
    needs: NeedsOverride = NeedsOverride()


@dataclass(frozen=True, slots=True)
class SweepSpec:
    path: str
    commands: tuple[tuple[str, str], ...]
    """``(name, template)`` in run order."""
    defaults: dict[str, Scalar]
    documents: tuple[SweepDocument, ...]
    call: str | None = None
    """``package.module:function`` when the header names a function instead of a template
    (``commands`` is then ``(("call", reference),)``)."""


@dataclass(frozen=True, slots=True)
class Combination:
    name: str
    index: int
    """1-based position among all combinations of the file (duplicates dropped)."""
    values: dict[str, Scalar]
    """Every parameter, as typed in the YAML, defaults first then the document's keys."""
    varying: tuple[str, ...]
    """The parameters that make up the name."""
    document: int
    title: str | None = None
    needs: NeedsOverride = field(default=NeedsOverride())


def render_value(value: Scalar) -> str:
    """How a value reads in a command and a name: YAML's own spelling for booleans."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


# --- parsing -------------------------------------------------------------------------------------


def _where(path: str, number: int, key: str | None = None) -> str:
    where = f"{plain_text(path)}: document {number}"
    return where + (f", key {show_value(key)}" if key is not None else "")


def _scalar(value: object, where: str) -> Scalar:
    if isinstance(value, str) and "\x00" in value:
        raise ConfigError(f"{where}: contains a NUL byte, which no command can carry")
    if isinstance(value, str | int | float | bool):
        return value
    if value is None:
        raise ConfigError(f"{where}: has no value (write one after the colon)")
    kind = "a mapping" if isinstance(value, dict) else type(value).__name__
    raise ConfigError(f"{where}: is {kind}; a parameter value must be a number, string or boolean")


def _needs(raw: Mapping[str, object], where: str) -> NeedsOverride:
    values: dict[str, object] = {}
    for key, value in raw.items():
        if key in NEED_SWITCHES:
            if not isinstance(value, bool):
                raise ConfigError(f"{where}, key {key!r}: must be true or false, not {show_value(value)}")
            if value:
                target, setting = NEED_SWITCHES[key]
                values[target] = setting
            continue
        target, kind = NEED_KEYS[key]
        ok = isinstance(value, int) if kind is int else isinstance(value, int | float)
        if not ok or isinstance(value, bool):
            what = "a whole number" if kind is int else "a number"
            raise ConfigError(f"{where}, key {key!r}: must be {what}, not {show_value(value)}")
        values[target] = kind(value)
    override = NeedsOverride(**values)  # type: ignore[arg-type]
    try:
        override.apply(Needs())  # the range checks of the execute_batch flags
    except ConfigError as err:
        raise ConfigError(f"{where}: {err}") from None
    return override


def _split_needs(raw: Mapping[str, object]) -> tuple[dict[str, object], dict[str, object]]:
    needs = {k: v for k, v in raw.items() if k in NEED_KEYS or k in NEED_SWITCHES}
    rest = {k: v for k, v in raw.items() if k not in needs}
    return needs, rest


def addressable(name: str) -> bool:
    """Whether ``{name}`` reaches ``name`` in the seed runner's ``str.format``: the names it
    accepts (``early-stop``, ``a b``), not those it reads as an index (``1``), an attribute or
    an item (``a.b``, ``a[0]``), a conversion or a format (``a!r``, ``a:3``)."""
    try:
        return ("{" + name + "}").format_map({name: "x"}) == "x"
    except (KeyError, IndexError, ValueError, AttributeError, TypeError):
        return False


def _check_param_name(key: object, where: str) -> str:
    if isinstance(key, str) and key.startswith("_"):
        raise ConfigError(f"{where}: {show_value(key)} is not a parameter name (names starting with '_' are reserved)")
    if not isinstance(key, str) or not addressable(key):
        raise ConfigError(
            f"{where}: {show_value(key)} is not a parameter name; a placeholder {{name}} cannot reach it "
            "(a name is text that is not a number and holds none of . [ ] { } ! :)"
        )
    return key


def _template(raw: object, path: str) -> tuple[tuple[str, str], ...]:
    where = _where(path, 1, "template")
    if isinstance(raw, str):
        raw = {"run": raw}
    if not isinstance(raw, dict) or not raw:
        raise ConfigError(f"{where}: must map command names to commands (train: python train.py {{lr}})")
    commands = []
    for name, text in raw.items():
        if not isinstance(name, str) or not _COMMAND_NAME.match(name):
            raise ConfigError(f"{where}: {show_value(name)} is not a command name (letters, digits, '_', '-')")
        if not isinstance(text, str) or not text.strip():
            raise ConfigError(f"{where}, command {name!r}: must be a non-empty shell command")
        if "\x00" in text:
            raise ConfigError(f"{where}, command {name!r}: contains a NUL byte")
        commands.append((name, text))
    return tuple(commands)


def _call(header: Mapping[str, object], path: str) -> str | None:
    """The function the header names (``call:``), its spelling checked; importing it is the
    caller's (this module reads text only)."""
    if "call" not in header:
        return None
    where = _where(path, 1, "call")
    if "template" in header:
        raise ConfigError(f"{where}: a sweep runs either a template's commands or one function; drop one of the two")
    reference = header["call"]
    if not isinstance(reference, str) or not _CALL_REFERENCE.match(reference.strip()):
        raise ConfigError(
            f"{where}: {show_value(reference)} does not name a function; write package.module:function "
            "(the module importable from the current folder)"
        )
    return reference.strip()


def _load_documents(text: str, path: str) -> list[Any]:
    try:
        return [d for d in yaml.safe_load_all(text)]
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark
        line = f" line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{plain_text(path)}{line}: not valid YAML: {err.problem}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{plain_text(path)}: not valid YAML: {err}") from None


def parse_sweep(text: str, path: str) -> SweepSpec:
    """Parse and validate a whole sweep file; see the module docstring for the format."""
    documents = _load_documents(text, path)
    if not documents or not isinstance(documents[0], dict):
        raise ConfigError(
            f"{plain_text(path)}: the first document must be a mapping with 'template' (and "
            "'default'); the parameters to sweep follow in '---' documents"
        )
    header_needs, header = _split_needs(documents[0])
    if "resource" in header:
        raise ConfigError(
            f"{_where(path, 1, 'resource')}: GPUs are not listed by hand here; the scheduler "
            "finds free ones on every machine (set gpus_per_job / gpu_memory_required instead)"
        )
    unknown = sorted(str(k) for k in header if k not in ("template", "default", "call"))
    if unknown:
        raise ConfigError(
            f"{_where(path, 1, unknown[0])}: unknown key in the header (it holds template or call, "
            "default and needs; parameters to sweep go in a '---' document after it)"
        )
    call = _call(header, path)
    if "template" not in header and call is None:
        raise ConfigError(f"{_where(path, 1)}: no 'template' (the commands to run) or 'call' (a function)")
    commands = ((CALL_COMMAND, call),) if call is not None else _template(header["template"], path)
    raw_defaults = header.get("default") or {}
    if not isinstance(raw_defaults, dict):
        raise ConfigError(f"{_where(path, 1, 'default')}: must map parameter names to values")
    defaults: dict[str, Scalar] = {}
    for key, value in raw_defaults.items():
        name = _check_param_name(key, _where(path, 1, "default"))
        if isinstance(value, list):
            raise ConfigError(
                f"{_where(path, 1, name)}: a default is one value; put lists to sweep in a '---' document"
            )
        defaults[name] = _scalar(value, _where(path, 1, name))
    base_needs = dict(header_needs)
    _needs(base_needs, _where(path, 1))
    found = (_document(raw, number, path, base_needs) for number, raw in enumerate(documents[1:], start=2))
    sweeps = [d for d in found if d is not None]
    if not sweeps:  # only defaults: one combination
        sweeps = [SweepDocument(1, None, {}, _needs(base_needs, _where(path, 1)))]
    spec = SweepSpec(path, commands, defaults, tuple(sweeps), call)
    _check_placeholders(spec)
    return spec


def _document(raw: object, number: int, path: str, base_needs: Mapping[str, object]) -> SweepDocument | None:
    if raw is None:
        return None  # an empty document (a trailing '---')
    if not isinstance(raw, dict):
        raise ConfigError(f"{_where(path, number)}: must be a mapping of parameters to values or lists")
    needs_raw, rest = _split_needs(raw)
    title = rest.pop("_title", None)
    if title is not None and not isinstance(title, str | int):
        raise ConfigError(f"{_where(path, number, '_title')}: must be a short string")
    params: dict[str, tuple[Scalar, ...]] = {}
    for key, value in rest.items():
        name = _check_param_name(key, _where(path, number))
        where = _where(path, number, name)
        values = value if isinstance(value, list) else [value]
        if not values:
            raise ConfigError(f"{where}: is an empty list (give at least one value)")
        params[name] = tuple(_scalar(v, where) for v in values)
    needs = _needs({**base_needs, **needs_raw}, _where(path, number))
    return SweepDocument(number, None if title is None else str(title), params, needs)


# --- placeholders --------------------------------------------------------------------------------


def _check_placeholders(spec: SweepSpec) -> None:
    """Every placeholder of every command has a value in every document, and stands where a value
    can be kept literal: a typo or an unsafe spot is found now, not when the last combination of a
    long sweep starts."""
    names = {*spec.defaults, *(k for d in spec.documents for k in d.params), *BUILTINS}
    for command, template in spec.commands:
        try:
            check_template(template, names)
        except TemplateError as err:
            raise ConfigError(f"{plain_text(spec.path)}: command {command!r}: {err}") from None
    for document in spec.documents:
        known = {*spec.defaults, *document.params, *BUILTINS}
        for command, template in spec.commands:
            for name in placeholders(template, names):
                if name not in known:
                    raise ConfigError(
                        f"{plain_text(spec.path)}: command {command!r} uses {{{plain_text(name)}}}, which has no "
                        f"value in document {document.number} (add {plain_text(name)} to 'default' or to that document)"
                    )


# --- combinations --------------------------------------------------------------------------------


def _varying(spec: SweepSpec) -> list[str]:
    """Parameters that take more than one value (or are missing somewhere) across the file."""
    order = list(dict.fromkeys([*spec.defaults, *(k for d in spec.documents for k in d.params)]))
    varying = []
    for key in order:
        seen: set[str | None] = set()
        for document in spec.documents:
            if key in document.params:
                seen.update(render_value(v) for v in document.params[key])
            else:
                seen.add(render_value(spec.defaults[key]) if key in spec.defaults else None)
        if len(seen) > 1:
            varying.append(key)
    return varying


def _short_hash(values: Mapping[str, str]) -> str:
    data = json.dumps(sorted(values.items()), separators=(",", ":"))
    return hashlib.sha256(data.encode()).hexdigest()[:8]


def combination_name(values: Mapping[str, Scalar], varying: Sequence[str]) -> str:
    """``lr_0.01-seed_2`` from the varying parameters; cleaned or cut names end in a hash."""
    shown = {k: render_value(values[k]) for k in varying if k in values}
    if not shown:
        return "default"
    readable = "-".join(f"{k}_{v}" for k, v in shown.items())
    clean = _NAME_SAFE.sub("_", readable)
    if clean == readable and len(clean) <= MAX_NAME_CHARS:
        return clean
    return f"{clean[: MAX_NAME_CHARS - 9]}-{_short_hash(shown)}"


def _identity(values: Mapping[str, Scalar]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, render_value(v)) for k, v in values.items()))


def _union(spec: SweepSpec, documents: Sequence[SweepDocument]) -> list[tuple[dict[str, Scalar], SweepDocument]]:
    """The documents' cross products in order, each combination once (its first document)."""
    seen: set[tuple[tuple[str, str], ...]] = set()
    found = []
    for document in documents:
        keys = list(document.params)
        for choice in itertools.product(*(document.params[k] for k in keys)):
            values = {**spec.defaults, **dict(zip(keys, choice, strict=True))}
            identity = _identity(values)
            if identity not in seen:
                seen.add(identity)
                found.append((values, document))
    return found


def expand(spec: SweepSpec, titles: Sequence[str] = ()) -> list[Combination]:
    """The union of the documents' cross products in file order, duplicates dropped; with
    ``titles``, the union of the documents so titled.  Names and indices come from the whole
    file, so a combination keeps them whatever is selected; names are unique, also ignoring case."""
    known_titles = {d.title for d in spec.documents if d.title is not None}
    for title in titles:
        if title not in known_titles:
            shown = ", ".join(sorted(known_titles)) or "none"
            raise ConfigError(f"{plain_text(spec.path)}: -t {title!r} matches no _title (titles: {shown})")
    varying = _varying(spec)
    combos = _disambiguate([
        Combination(combination_name(values, varying), index, values,
                    tuple(k for k in varying if k in values), document.number, document.title, document.needs)
        for index, (values, document) in enumerate(_union(spec, spec.documents), start=1)
    ])
    if not titles:
        return combos
    by_identity = {_identity(c.values): c for c in combos}
    selected = []
    for values, document in _union(spec, [d for d in spec.documents if d.title in titles]):
        known = by_identity[_identity(values)]
        selected.append(replace(known, document=document.number, title=document.title, needs=document.needs))
    return sorted(selected, key=lambda c: c.index)


def _disambiguate(combos: list[Combination]) -> list[Combination]:
    """Names equal ignoring case (a cleaned value, a case-insensitive disk) all get a hash."""
    groups: dict[str, list[int]] = {}
    for i, combo in enumerate(combos):
        groups.setdefault(combo.name.casefold(), []).append(i)
    out = list(combos)
    for indices in groups.values():
        if len(indices) < 2:
            continue
        for i in indices:
            combo = combos[i]
            digest = _short_hash({k: render_value(v) for k, v in combo.values.items()})
            name = f"{combo.name[: MAX_NAME_CHARS - 9]}-{digest}"
            out[i] = Combination(name, combo.index, combo.values, combo.varying, combo.document,
                                 combo.title, combo.needs)
    return out


def sample(combos: Sequence[Combination], count: int, seed: int) -> list[Combination]:
    """``count`` combinations drawn at random with ``seed`` (the same draw on every rerun), in
    file order."""
    if count < 1:
        raise ConfigError(f"--sample {count}: must be at least 1")
    if count >= len(combos):
        return list(combos)
    picked = sorted(random.Random(seed).sample(range(len(combos)), count))
    return [combos[i] for i in picked]


def select_commands(spec: SweepSpec, wanted: Sequence[str]) -> list[tuple[str, str]]:
    """The template's commands named with ``-c`` (all when none), in the template's order."""
    names = [name for name, _ in spec.commands]
    for name in wanted:
        if name not in names:
            raise ConfigError(f"{plain_text(spec.path)}: -c {name!r} is not a command of the template ({', '.join(names)})")
    return [(n, t) for n, t in spec.commands if not wanted or n in wanted]


# --- jobs ----------------------------------------------------------------------------------------


def command_values(combo: Combination, output: str) -> dict[str, str]:
    return {**{k: render_value(v) for k, v in combo.values.items()}, "_output": output, "_name": combo.name}


Copies = tuple[tuple[str, ...] | None, tuple[str, ...] | None]
"""A job's ``(copy_forwards, copy_backwards)``; ``None`` takes the batch's default."""


def build_jobs(
    runs: Sequence[tuple[Combination, str, str]],
    copies: Callable[[Combination, int], Copies],
    path: str,
) -> list[Job]:
    """``runs`` are ``(combination, command name, rendered command)`` in run order; each becomes
    job ``<combination>.<command>``, waiting (``after``) for the combination's previous run.
    ``copies(combination, k)`` gives the copy paths of the combination's k-th job (from 0)."""
    jobs: list[Job] = []
    previous: dict[str, str] = {}
    position: dict[str, int] = {}
    for combo, command, text in runs:
        name = f"{combo.name}.{command}"
        try:
            validate_job_name(name)
        except BatchError as err:
            raise ConfigError(f"{plain_text(path)}: {err}") from None
        after = (previous[combo.name],) if combo.name in previous else ()
        k = position.get(combo.name, 0)
        forwards, backwards = copies(combo, k)
        jobs.append(Job(name, text, combo.index, forwards, backwards, combo.needs, after))
        previous[combo.name] = name
        position[combo.name] = k + 1
    check_dependencies(jobs, plain_text(path))
    return jobs
