"""What the function sweep and joblib tests run on the hosts.  Copied into each test's project
folder as ``sweep_work.py``: a module of the user's, installed nowhere, that reaches the hosts only
through the copied-forward folder.  Each run of ``task`` is noted in the host's ``sweeps.log``
(the test counts runs there); ``fail_<method>`` in the host's home makes that combination fail."""

import json
import os
import socket
import time

HOME = os.path.expanduser("~")


class Failed(Exception):
    pass


def task(method, num_packing, num_zmode, num_run, num_epoch):
    """The 004 example's task: writes metrics.json where it runs (its combination's folder)."""
    with open(os.path.join(HOME, "sweeps.log"), "a") as f:
        f.write(f"{method}-{num_packing}-{num_zmode}\n")
    if os.path.exists(os.path.join(HOME, "fail_" + method)):
        raise Failed(f"{method} failed as asked")
    with open("metrics.json", "w") as f:
        json.dump({"score": num_packing * 10 + num_zmode, "epochs": num_epoch * num_run}, f)
    return {"host": socket.gethostname(), "cwd": os.path.basename(os.getcwd()), "method": method}


def square(x):
    return x * x, socket.gethostname()


def slow_square(x):
    time.sleep(0.3)
    return x * x


def refuse(x):
    if x == 3:
        raise Failed("three is refused")
    return x
