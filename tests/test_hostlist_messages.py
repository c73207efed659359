"""Each refusal of a host range, word for word: the message is the user's only help (what is
wrong, in the pattern as they wrote it, and how to write it instead), so a hint that went missing
or a wrong example is a bug like a wrong name."""

from __future__ import annotations

import pytest

from ssh_scheduler.errors import ConfigError
from ssh_scheduler.machines.hostlist import expand

A55 = "a" * 55

MESSAGES = {
    "@gpus": "host range '@gpus': node groups like '@gpus' are not supported (list the hosts, or write a range like gpu[1-8])",
    "gpu*": (
        "host range 'gpu*': wildcards like 'gpu*' are not supported (ClusterShell matches them against the hosts "
        "of a group source, and there is none here: list the hosts, or write a range like gpu[1-8])"
    ),
    "gpu[1-2]?": (
        "host range 'gpu[1-2]?': wildcards like 'gpu[1-2]?' are not supported (ClusterShell matches them against "
        "the hosts of a group source, and there is none here: list the hosts, or write a range like gpu[1-8])"
    ),
    "a]b": "host range 'a]b': ']' without a matching '[' (write ranges like gpu[1-4])",
    "r[1-2][3-4]": (
        "host range 'r[1-2][3-4]': two brackets next to each other, which ClusterShell refuses too (put text "
        "between them, like r[1-2]n[1-4])"
    ),
    "r[1-2]0[3-4]": (
        "host range 'r[1-2]0[3-4]': only digits ('0') between two brackets, which ClusterShell refuses too (put "
        "a letter between them, like r[1-2]n[1-4], or write the digits inside the brackets)"
    ),
    "n[1[2]]": "host range 'n[1[2]]': brackets cannot be nested (write ranges like r[1-2]n[1-4])",
    "x1[9-10]": (
        "host range 'x1[9-10]': a digit right before a range that goes from 9 to 10 is not supported (ClusterShell "
        "reads x1[9-10] as x19 to x110, every number between; split the range where the numbers grow a digit, or "
        "put the digit inside the brackets)"
    ),
    "n1[99-100]": (
        "host range 'n1[99-100]': a digit right before a range that goes from 99 to 100 is not supported "
        "(ClusterShell reads x1[99-100] as x199 to x1100, every number between; split the range where the numbers "
        "grow a digit, or put the digit inside the brackets)"
    ),
    "gpu[1-10/2]": "host range 'gpu[1-10/2]': steps like '1-10/2' are not supported (list the numbers, like gpu[1,3,5])",
    "gpu[a-b]": (
        "host range 'gpu[a-b]': 'a-b' is not a number or a lo-hi range of numbers (write it like gpu[1-8,12])"
    ),
    "n[08-100]": (
        "host range 'n[08-100]': range '08-100' has ends of different widths, which ClusterShell refuses too "
        "(write both ends with the same digits, like n[08-99,100] or n[008-100])"
    ),
    "gpu[]": "host range 'gpu[]': empty brackets '[]' (write numbers inside, like gpu[1-4])",
    "gpu[3-1]": "host range 'gpu[3-1]': range '3-1' goes down (write the smaller number first: 1-3)",
    "gpu[": "host range 'gpu[': '[' is never closed (add the ']', like gpu[1-4])",
    "   ": "empty host pattern (give a name or a range like gpu[1-8,12])",
    "a,,b": "host range 'a,,b': empty name between commas (remove the extra ',')",
    # An empty part names the operator right after it when none comes before it.
    ",a!b": "host range ',a!b': empty name between commas (remove the extra ',')",
    "!a,b": "host range '!a,b': nothing beside '!' (remove the extra '!')",
    "a!": "host range 'a!': nothing beside '!' (remove the extra '!')",
    "a!a": "host range 'a!a' leaves no host (check the '!', '&' or '^' parts)",
    "n[1-200000]": (
        "host range 'n[1-200000]' expands to 200000 names, more than the limit of 100000 names (use a smaller range)"
    ),
    # A pattern is shown whole up to 60 characters, and as its first 57 and "..." beyond.
    A55 + "[3-1]": f"host range '{A55}[3-1]': range '3-1' goes down (write the smaller number first: 1-3)",
    A55 + "a[3-1]": f"host range '{A55}a[...': range '3-1' goes down (write the smaller number first: 1-3)",
}


@pytest.mark.parametrize("pattern", MESSAGES)
def test_each_refusal_says_what_is_wrong_and_how_to_write_it(pattern: str) -> None:
    with pytest.raises(ConfigError) as err:
        expand(pattern)
    assert str(err.value) == MESSAGES[pattern]
