#!/usr/bin/python3 -IS
"""A simulated ``nvidia-smi`` for the SSH test cluster (stdlib only, starts fast).

Output formats copy the real captures in ``tests/data/h100`` (driver 580.159.04):
``--query-gpu=<fields> --format=csv[,noheader][,nounits]``, ``--query-compute-apps=...``,
``-L``, ``--version``, ``-i <index|uuid>[,...]`` and the plain table.

State lives in a directory (``STATE_DIR`` below, replaced when the cluster installs this
file on a host; the env var ``FAKE_NVSMI_STATE`` overrides it for local tests):

* ``gpus``: one line per GPU: ``index<TAB>uuid<TAB>memory_mb<TAB>reserved_mb<TAB>name``
* ``procs/<pid>``: one file per simulated GPU process (written by ``gpu_hold``):
  ``gpu_index<TAB>used_mb<TAB>util_percent<TAB>starttime<TAB>process_name``.
  Entries whose PID is gone, a zombie, or a different process (start time differs) are
  ignored, so a SIGKILLed holder disappears.

memory.used = sum of live holders, memory.free = total - used - reserved (480 MiB like the
real H100), utilization.gpu = min(100, sum of holders' util).  Sensor-like values
(temperature, power, utilization.memory) are a deterministic function of utilization.gpu
chosen so that idle and 100 % reproduce the idle/busy captures.
"""

from __future__ import annotations

import os
import sys
import time

STATE_DIR = None  # replaced per host by the cluster

DRIVER = "580.159.04"
CUDA = "13.0"
VERSION_TEXT = (
    "NVIDIA-SMI version  : 580.159.04\n"
    "NVML version        : 580.159\n"
    "DRIVER version      : 580.159.04\n"
    "CUDA Version        : 13.0\n"
)
POWER_LIMIT = 700.0


class Usage(Exception):
    """Bad arguments: message printed on stdout, exit status 2 (like the real tool)."""


def state_dir() -> str:
    return os.environ.get("FAKE_NVSMI_STATE") or STATE_DIR or ""


def read_gpus(sdir: str) -> list[dict]:
    gpus = []
    try:
        with open(os.path.join(sdir, "gpus")) as f:
            lines = f.read().splitlines()
    except OSError:
        lines = []
    for line in lines:
        if not line.strip():
            continue
        index, uuid, total, reserved, name = line.split("\t", 4)
        gpus.append(
            {
                "index": int(index),
                "uuid": uuid,
                "total": int(total),
                "reserved": int(reserved),
                "name": name,
                "procs": [],
            }
        )
    return gpus


def proc_alive(pid: int, starttime: str) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return False
    fields = stat[stat.rfind(")") + 2 :].split()
    if not fields or fields[0] in ("Z", "X", "x"):
        return False
    return not starttime or starttime == "-" or fields[19] == starttime


def read_procs(sdir: str, gpus: list[dict]) -> None:
    by_index = {g["index"]: g for g in gpus}
    pdir = os.path.join(sdir, "procs")
    try:
        names = os.listdir(pdir)
    except OSError:
        return
    entries = []
    for fname in names:
        if not fname.isdigit():
            continue
        try:
            with open(os.path.join(pdir, fname)) as f:
                line = f.readline().rstrip("\n")
            gpu, mb, util, start, pname = line.split("\t", 4)
        except (OSError, ValueError):
            continue
        pid = int(fname)
        if int(gpu) in by_index and proc_alive(pid, start):
            entries.append((int(gpu), pid, int(mb), int(util), pname))
    for gpu, pid, mb, util, pname in sorted(entries):
        by_index[gpu]["procs"].append({"pid": pid, "mb": mb, "util": util, "name": pname})


def derive(g: dict) -> None:
    used = sum(p["mb"] for p in g["procs"])
    util = min(100, sum(p["util"] for p in g["procs"]))
    g["used"] = used
    g["free"] = max(0, g["total"] - used - g["reserved"])
    g["util"] = util
    g["mem_util"] = round(util * 0.31)
    g["temp"] = 34 + round(util * 0.21)
    g["power"] = 72.78 + util * 6.2821
    g["bus"] = f"00000000:00:{6 + g['index']:02X}.0"


# field -> (canonical header name, unit or "", value function)
def _mib(key):
    return lambda g, n: g[key]


GPU_FIELDS = {
    "timestamp": ("timestamp", "", lambda g, n: time.strftime("%Y/%m/%d %H:%M:%S.000")),
    "driver_version": ("driver_version", "", lambda g, n: DRIVER),
    "count": ("count", "", lambda g, n: n),
    "index": ("index", "", lambda g, n: g["index"]),
    "name": ("name", "", lambda g, n: g["name"]),
    "uuid": ("uuid", "", lambda g, n: g["uuid"]),
    "serial": ("serial", "", lambda g, n: str(1652924077256 + g["index"])),
    "pci.bus_id": ("pci.bus_id", "", lambda g, n: g["bus"]),
    "persistence_mode": ("persistence_mode", "", lambda g, n: "Enabled"),
    "pstate": ("pstate", "", lambda g, n: "P0"),
    "compute_mode": ("compute_mode", "", lambda g, n: "Default"),
    "fan.speed": ("fan.speed [%]", "%", lambda g, n: "[N/A]"),
    "temperature.gpu": ("temperature.gpu", "", lambda g, n: g["temp"]),
    "utilization.gpu": ("utilization.gpu [%]", "%", lambda g, n: g["util"]),
    "utilization.memory": ("utilization.memory [%]", "%", lambda g, n: g["mem_util"]),
    "memory.total": ("memory.total [MiB]", "MiB", _mib("total")),
    "memory.reserved": ("memory.reserved [MiB]", "MiB", _mib("reserved")),
    "memory.used": ("memory.used [MiB]", "MiB", _mib("used")),
    "memory.free": ("memory.free [MiB]", "MiB", _mib("free")),
    "power.draw": ("power.draw [W]", "W", lambda g, n: f"{g['power']:.2f}"),
    "power.limit": ("power.limit [W]", "W", lambda g, n: f"{POWER_LIMIT:.2f}"),
    "clocks.sm": ("clocks.current.sm [MHz]", "MHz", lambda g, n: 1980 if g["util"] else 345),
    "clocks.max.sm": ("clocks.max.sm [MHz]", "MHz", lambda g, n: 1980),
}
GPU_ALIASES = {
    "gpu_name": "name",
    "gpu_uuid": "uuid",
    "gpu_serial": "serial",
    "gpu_bus_id": "pci.bus_id",
    "persistence-mode": "persistence_mode",
    "performance_state": "pstate",
    "clocks.current.sm": "clocks.sm",
    "power.draw.instant": "power.draw",
}

APP_FIELDS = {
    "timestamp": ("timestamp", "", lambda g, p: time.strftime("%Y/%m/%d %H:%M:%S.000")),
    "gpu_name": ("gpu_name", "", lambda g, p: g["name"]),
    "gpu_bus_id": ("gpu_bus_id", "", lambda g, p: g["bus"]),
    "gpu_serial": ("gpu_serial", "", lambda g, p: str(1652924077256 + g["index"])),
    "gpu_uuid": ("gpu_uuid", "", lambda g, p: g["uuid"]),
    "pid": ("pid", "", lambda g, p: p["pid"]),
    "process_name": ("process_name", "", lambda g, p: p["name"]),
    "used_memory": ("used_gpu_memory [MiB]", "MiB", lambda g, p: p["mb"]),
}
APP_ALIASES = {"name": "process_name", "used_gpu_memory": "used_memory"}


def parse_fields(spec: str, table: dict, aliases: dict) -> list[str]:
    fields = []
    for raw in spec.split(","):
        key = raw.strip()
        canon = aliases.get(key, key)
        if canon not in table:
            raise Usage(f'Field "{key}" is not a valid field to query.\n\n')
        fields.append(canon)
    return fields


def parse_format(spec: str | None) -> tuple[bool, bool]:
    if spec is None:
        raise Usage("Missing --format option. Please run 'nvidia-smi -h' for help.\n")
    header, units = True, True
    for part in spec.split(","):
        part = part.strip()
        if part == "csv":
            continue
        if part == "noheader":
            header = False
        elif part == "nounits":
            units = False
        else:
            raise Usage(f'"{part}" is not a valid format option.\n')
    return header, units


def csv(rows: list[list[tuple[object, str]]], headers: list[str], header: bool, units: bool) -> str:
    out = []
    if header:
        out.append(", ".join(headers))
    for row in rows:
        cells = []
        for value, unit in row:
            text = str(value)
            if units and unit and not text.startswith("["):
                text = f"{text} {unit}"
            cells.append(text)
        out.append(", ".join(cells))
    return "".join(line + "\n" for line in out)


def select_gpus(gpus: list[dict], ids: str | None) -> list[dict]:
    if ids is None:
        return gpus
    chosen = []
    for ident in ids.split(","):
        ident = ident.strip()
        match = [
            g for g in gpus if str(g["index"]) == ident or g["uuid"] == ident or g["bus"] == ident
        ]
        if not match:
            raise Usage("No devices were found\n", 6)
        chosen.extend(m for m in match if m not in chosen)
    return chosen


def table(gpus: list[dict]) -> str:
    sep = "+-----------------------------------------+------------------------+----------------------+"
    wide = "+" + "-" * 89 + "+"
    lines = [
        time.asctime() + "       ",
        wide,
        f"| NVIDIA-SMI {DRIVER}             Driver Version: {DRIVER}     CUDA Version: {CUDA}     |",
        sep,
        "| GPU  Name                 Persistence-M | Bus-Id          Disp.A | Volatile Uncorr. ECC |",
        "| Fan  Temp   Perf          Pwr:Usage/Cap |           Memory-Usage | GPU-Util  Compute M. |",
        "|                                         |                        |               MIG M. |",
        "|=========================================+========================+======================|",
    ]
    for i, g in enumerate(gpus):
        if i:
            lines.append(sep)
        name = g["name"] if len(g["name"]) <= 29 else g["name"][:26] + "..."
        power = int(g["power"])
        lines.append(f"|{g['index']:>4}  {name:<29}  On  |{g['bus']:>19} Off |{'0':>21} |")
        lines.append(
            f"| N/A{g['temp']:>5}C{'P0':>6}{power:>15}W / {round(POWER_LIMIT):>4}W |"
            f"{g['used']:>8}MiB / {g['total']:>6}MiB |{g['util']:>7}%{'Default':>13} |"
        )
        lines.append(f"|{'':41}|{'':24}|{'Disabled':>21} |")
    lines += [
        sep,
        "",
        wide,
        "| Processes:                                                                              |",
        "|  GPU   GI   CI              PID   Type   Process name                        GPU Memory |",
        "|        ID   ID                                                               Usage      |",
        "|" + "=" * 89 + "|",
    ]
    procs = [(g, p) for g in gpus for p in g["procs"]]
    if not procs:
        lines.append("|  No running processes found" + " " * 61 + "|")
    for g, p in procs:
        pname = p["name"] if len(p["name"]) <= 36 else "..." + p["name"][-33:]
        mem = f"{p['mb']}MiB"
        lines.append(f"|{g['index']:>5}   N/A  N/A{p['pid']:>16}{'C':>7}   {pname:<36}{mem:>10} |")
    lines.append(wide)
    return "".join(line + "\n" for line in lines)


def run(argv: list[str]) -> tuple[str, int]:
    query_gpu = query_apps = fmt = ids = None
    list_gpus = version = False
    i = 0
    while i < len(argv):
        arg = argv[i]
        value = None
        if "=" in arg and arg.startswith("--"):
            arg, value = arg.split("=", 1)
        needs_value = arg in ("--query-gpu", "--query-compute-apps", "--format", "-i", "--id")
        if needs_value and value is None:
            i += 1
            if i >= len(argv):
                raise Usage(
                    "Invalid combination of input arguments. Please run 'nvidia-smi -h' for help.\n"
                )
            value = argv[i]
        if arg == "--query-gpu":
            query_gpu = value
        elif arg == "--query-compute-apps":
            query_apps = value
        elif arg == "--format":
            fmt = value
        elif arg in ("-i", "--id"):
            ids = value
        elif arg in ("-L", "--list-gpus"):
            list_gpus = True
        elif arg in ("--version", "-v"):
            version = True
        else:
            raise Usage(
                "Invalid combination of input arguments. Please run 'nvidia-smi -h' for help.\n"
            )
        i += 1
    if version:
        return VERSION_TEXT, 0
    sdir = state_dir()
    gpus = read_gpus(sdir)
    if not gpus:
        return (
            "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
            "Make sure that the latest NVIDIA driver is installed and running.\n\n",
            9,
        )
    if query_gpu is not None or query_apps is not None:
        table_, aliases = (
            (GPU_FIELDS, GPU_ALIASES) if query_gpu is not None else (APP_FIELDS, APP_ALIASES)
        )
        fields = parse_fields(query_gpu if query_gpu is not None else query_apps, table_, aliases)
        header, units = parse_format(fmt)
    read_procs(sdir, gpus)
    for g in gpus:
        derive(g)
    gpus = select_gpus(gpus, ids)
    if list_gpus:
        return "".join(f"GPU {g['index']}: {g['name']} (UUID: {g['uuid']})\n" for g in gpus), 0
    if query_gpu is not None:
        rows = [[(GPU_FIELDS[f][2](g, len(gpus)), GPU_FIELDS[f][1]) for f in fields] for g in gpus]
        return csv(rows, [GPU_FIELDS[f][0] for f in fields], header, units), 0
    if query_apps is not None:
        rows = [
            [(APP_FIELDS[f][2](g, p), APP_FIELDS[f][1]) for f in fields]
            for g in gpus
            for p in g["procs"]
        ]
        return csv(rows, [APP_FIELDS[f][0] for f in fields], header, units), 0
    return table(gpus), 0


def main() -> int:
    try:
        text, code = run(sys.argv[1:])
    except Usage as exc:
        text = exc.args[0]
        code = exc.args[1] if len(exc.args) > 1 else 2
    sys.stdout.write(text)
    sys.stdout.flush()
    return code


if __name__ == "__main__":
    sys.exit(main())
