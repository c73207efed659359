"""A record of an untrusted JSON file, its fields read one by one and each checked as it is read:
a wrong type is one :class:`ConfigError` naming the file, where in it, and the field (used on
the journal and the event file by ``results/batch_history.py``)."""

from __future__ import annotations

import math
from typing import Any

from ssh_scheduler.errors import ConfigError, show_value
from ssh_scheduler.events import GpuReading

__all__ = ["Fields"]

MAX_GPU_INDEX = 4096


class Fields:
    """A record's fields, each checked as it is read: a wrong type is one error line naming the
    file, where in it, and the field."""

    def __init__(self, record: dict[str, Any], where: str) -> None:
        self.record = record
        self.where = where

    def _bad(self, key: str, what: str) -> ConfigError:
        return ConfigError(
            f"{self.where}: '{key}' must be {what}, got {show_value(self.record[key], 60)}; the file is not as "
            f"ssh_scheduler wrote it (delete it, or fix that line)"
        )

    def number(self, key: str, default: float | None = None) -> float:
        value = self.record.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise self._bad(key, "a number") if key in self.record else ConfigError(f"{self.where}: no '{key}'")
        return float(value)

    def whole(self, key: str, default: int | None = 0) -> int | None:
        value = self.record.get(key, default)
        if value is None and default is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise self._bad(key, "a whole number")
        return value

    def count(self, key: str) -> int:
        value = self.whole(key, 0)
        return value if value is not None and value >= 0 else 0

    def text(self, key: str, default: str = "") -> str:
        value = self.record.get(key, default)
        if not isinstance(value, str):
            raise self._bad(key, "a string")
        return value

    def flag(self, key: str) -> bool:
        value = self.record.get(key, False)
        if not isinstance(value, bool):
            raise self._bad(key, "true or false")
        return value

    def texts(self, key: str) -> list[str]:
        value = self.record.get(key, [])
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise self._bad(key, "a list of strings")
        return value

    def gpus(self, key: str = "gpus") -> tuple[int, ...]:
        value = self.record.get(key, [])
        if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < MAX_GPU_INDEX for v in value):
            raise self._bad(key, "a list of GPU indices")
        return tuple(value)

    def readings(self) -> tuple[GpuReading, ...]:
        value = self.record.get("gpus", [])
        if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
            raise self._bad("gpus", "a list of GPU readings")
        found = []
        for reading in value:
            one = Fields(reading, self.where)
            index = one.whole("index")
            if index is None or not 0 <= index < MAX_GPU_INDEX:
                raise self._bad("gpus", f"a list of GPU readings with indices from 0 to {MAX_GPU_INDEX - 1}")
            found.append(GpuReading(
                index, one.count("memory_used_mb"), one.count("memory_total_mb"),
                min(max(one.number("utilization", 0.0), 0.0), 1.0), one.count("ours_mb"),
            ))
        return tuple(found)
