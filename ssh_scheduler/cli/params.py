"""The option table (:mod:`ssh_scheduler.jobs.options`) as typer parameters, and back to argv.

A command is written ``def execute_batch(batch_file: ..., **values)``: :func:`takes_options`
gives it the table's options of that command as keyword parameters through ``__signature__``,
which typer reads (``inspect.signature``) to build its click command, so ``--help`` lists them
and typer passes each parsed value by name into ``values``.

The ancestor took several values after one flag (``--machines a.yaml b.yaml``); click does not,
so :func:`expand_multi_value` rewrites such argv into the repeated-flag form before typer sees it.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from types import GenericAlias
from typing import Annotated, Any, TypeVar

import typer

from ssh_scheduler.cli.common import err_line
from ssh_scheduler.jobs.options import OPTIONS, Option, options_of

__all__ = ["MULTI_VALUE", "command_argv", "expand_multi_value", "parameter", "takes_options"]

F = TypeVar("F", bound=Callable[..., None])

MULTI_VALUE: tuple[str, ...] = tuple(flag for o in OPTIONS if o.greedy for flag in o.flags)
"""The flags that take several values (``--machines a.yaml b.yaml``)."""


def expand_multi_value(argv: Sequence[str], options: Sequence[str] = MULTI_VALUE) -> list[str]:
    """``--machines a b --x`` -> ``--machines a --machines b --x``.  Values run until the next
    token that starts with ``-`` (or ``--``, which ends them and is dropped)."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        if token in options:
            i += 1
            values = []
            while i < len(argv) and not argv[i].startswith("-"):
                values.append(argv[i])
                i += 1
            if i < len(argv) and argv[i] == "--" and values:
                i += 1
            if not values:
                out.append(token)  # let typer report the missing value
            for value in values:
                out.extend([token, value])
            continue
        out.append(token)
        i += 1
    return out


def parameter(option: Option, command: str, *, hidden: bool = False) -> inspect.Parameter:
    """One option of ``command`` as the keyword parameter typer turns into a click option."""
    annotation: Any
    if option.count:
        annotation = int
    elif option.switch:
        annotation = bool
    elif option.many:
        annotation = GenericAlias(list, (option.kind,)) | None  # list[kind] | None, kind known at run time
    elif option.default is None:
        annotation = option.kind | None
    else:
        annotation = option.kind
    info = typer.Option(
        *option.flags,
        help=option.help_for(command) or None,
        count=option.count,
        min=option.minimum,
        hidden=option.hidden or hidden,
    )
    return inspect.Parameter(
        option.name, inspect.Parameter.KEYWORD_ONLY, default=option.default, annotation=Annotated[annotation, info]
    )


def takes_options(command: str) -> Callable[[F], F]:
    """Give ``func(own parameters..., **values)`` the options ``command`` takes from the table.

    The options the table says ``command`` refuses are accepted as hidden flags and refused with
    their reason in one line, rather than with click's bare "No such option"."""
    taken = list(options_of(command))
    refused = [o for o in OPTIONS if o.refused_by(command) and o not in taken]

    def decorate(func: F) -> F:
        own = [
            p for p in inspect.signature(func, eval_str=True).parameters.values()
            if p.kind is not inspect.Parameter.VAR_KEYWORD
        ]

        @functools.wraps(func)
        def run(**given: Any) -> None:
            for option in refused:
                if given.pop(option.name, option.default) != option.default:
                    err_line(f"error: {option.flag} does not go with {_what(command)}: {option.refused_by(command)}")
                    raise typer.Exit(2)
            func(**given)

        params = [*own, *(parameter(o, command) for o in taken), *(parameter(o, command, hidden=True) for o in refused)]
        run.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        return run  # type: ignore[return-value]

    return decorate


def _what(command: str) -> str:
    return "a sweep" if command == "sweep" else command


def command_argv(command: str, values: Mapping[str, Any], positionals: Sequence[str], *, leave_out: Sequence[str] = ()) -> list[str]:
    """The argv that runs ``command`` again with these values: each option that differs from its
    default in its long ``--flag=value`` form (a value may start with ``-``), then ``--`` and
    the positional words (a file name may too)."""
    argv = [command]
    for option in options_of(command):
        value = values.get(option.name, option.default)
        if option.name in leave_out or value == option.default:
            continue
        if option.count:
            argv += [option.flag] * int(value)
        elif option.switch:
            argv.append(option.flag)
        elif option.many:
            argv += [f"{option.flag}={item}" for item in value]
        else:
            argv.append(f"{option.flag}={value}")
    return [*argv, "--", *positionals]
