"""The call runner: one Python call of ``ssh_scheduler.Executor``, run on its host.

Not part of the agent's own process: the executors stage this file into the call's job folder
(through the host's content-addressed cache, with cloudpickle's sources beside it) and the job's
shell line runs it with the machine's Python, after the machine's ``setup:`` lines, in the job's
folder and with the job's environment (``CUDA_VISIBLE_DEVICES`` set)::

    <python> -B -u .ssh_scheduler_call/call_runner.py PAYLOAD RESULT INFO

``PAYLOAD`` (written by ``functions/payload.py``) is one JSON header line, then two pickles: the
function, then its ``(args, kwargs)``.  The runner checks that this Python can load them before
it unpickles anything: a function that travels as code (a lambda, a closure, a function of
``__main__``) is bytecode of the Python that pickled it, which another minor version cannot run;
a function that travels by name needs its module here.  Either failure is one line naming both
versions, or the missing module, and the fix, never a pickle traceback.

It leaves ``RESULT``, the pickled return value (or exception), and then ``INFO``, one JSON object
saying what happened (``kind``: ``value``, ``raised`` or ``refused``, this Python, whether the
pickle holds code, the exception's type and the traceback text).  ``INFO`` is written last and
renamed into place, so its presence means the call ended and ``RESULT`` is whole.  Both come
home with the job's other results.  The value is pickled straight into the file: a 50 MB value
is not held twice.  Exit status: 0 value, 1 raised, 3 refused.

Runs on the host's Python (3.8 or newer): stdlib only, plus the cloudpickle it was sent with
(first on ``sys.path``: the same version as the coordinator's, whatever the host has).  It is
imported only when needed (a call that travels as code, a value or exception plain ``pickle``
cannot write): importing it costs more CPU than the rest of a trivial call, once per call
(a warm interpreter loads it once, for all the calls it forks: call_warm.preload).
A function that travels by name, with plain arguments, loads with ``pickle`` alone.
"""

import json
import os
import pickle
import sys
import types

RAISED = 1
REFUSED = 3
LIB = "lib"  # cloudpickle's sources, beside this file


def this_python():
    return "%s (Python %s)" % (sys.executable or "python", sys.version.split()[0])


def write_info(path, info):
    """``INFO`` whole or not at all: written beside it, then renamed into place."""
    info["python"] = list(sys.version_info[:3])
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(info, f)
    os.replace(tmp, path)


def refuse(info_path, message):
    """The call cannot load here: one line on stderr and in ``INFO``, exit 3."""
    sys.stderr.write("ssh_scheduler: %s\n" % message)
    write_info(info_path, {"kind": "refused", "message": message})
    sys.exit(REFUSED)


def code_pickler(cloudpickle):
    """cloudpickle's pickler, noting whether what it pickles holds code (bytecode runs only on
    the minor version that made it)."""

    class CodePickler(cloudpickle.Pickler):
        def __init__(self, file):
            cloudpickle.Pickler.__init__(self, file, protocol=5)
            self.holds_code = False

        def reducer_override(self, obj):
            if isinstance(obj, types.CodeType):
                self.holds_code = True
            return cloudpickle.Pickler.reducer_override(self, obj)

    return CodePickler


def set_path(here, header):
    """sys.path as the call's own script had it: the folders of its ``sys.path`` that were in
    the copied-forward folder, here in the job's folder; our cloudpickle first."""
    cwd = os.getcwd()
    if sys.path and os.path.abspath(sys.path[0]) == here:
        del sys.path[0]  # this file's folder: nothing of the user's
    folders = [os.path.normpath(os.path.join(cwd, rel)) for rel in header.get("path") or ["."]]
    sys.path[:0] = [os.path.join(here, LIB)] + folders


def load_call(payload, info_path, header):
    """The function and its arguments, or a refusal naming what this Python lacks."""
    wanted = header.get("python") or [0, 0, 0]
    shown = ".".join(str(n) for n in wanted)
    if header.get("code") and tuple(wanted[:2]) != tuple(sys.version_info[:2]):
        refuse(info_path, (
            "cannot run this call here: %s travels as code (a lambda, a closure or a function of "
            "__main__), pickled by Python %s, and this host's Python is %s, another minor "
            "version, which cannot load it; fix: set python: in the machine's YAML to a Python "
            "%d.%d there, or define the function in a module of the copied-forward folder, so it "
            "travels by name") % (header.get("function", "the function"), shown, this_python(),
            wanted[0], wanted[1]))
    try:  # (a pickle that holds code names cloudpickle's helpers: pickle imports it then)
        function = pickle.load(payload)
        args, kwargs = pickle.load(payload)
    except ModuleNotFoundError as exc:
        refuse(info_path, (
            "cannot load this call here: %s needs the module %r, which %s does not find on this "
            "host; fix: put the module in the copied-forward folder (copy_forwards) or install "
            "it for that Python") % (header.get("function", "the function"), exc.name, this_python()))
    except Exception as exc:
        refuse(info_path, "cannot load this call here with %s (pickled by Python %s): %s: %s" % (
            this_python(), shown, type(exc).__name__, str(exc)[:300]))
    return function, args, kwargs


def dump(value, path):
    """Pickle ``value`` into ``path``; whether the pickle holds code.  Plain ``pickle`` first
    (it writes no code); what only cloudpickle can write (a lambda, a class made at run time)
    is written again by cloudpickle."""
    try:
        with open(path, "wb") as f:
            pickle.Pickler(f, protocol=5).dump(value)
        return False
    except Exception:
        import cloudpickle

        with open(path, "wb") as f:
            pickler = code_pickler(cloudpickle)(f)
            pickler.dump(value)
        return pickler.holds_code


def keep_exception(result_path, info_path, exc):
    """The exception the call raised: pickled when it pickles, its traceback as text (from the
    call down: this runner's own frame is not the user's)."""
    import traceback

    tb = exc.__traceback__
    if tb is not None and tb.tb_frame.f_code is main.__code__ and tb.tb_next is not None:
        tb = tb.tb_next
    text = "".join(traceback.format_exception(type(exc), exc, tb))
    sys.stderr.write(text)
    info = {
        "kind": "raised", "type": "%s.%s" % (type(exc).__module__, type(exc).__qualname__),
        "message": str(exc)[:2000], "traceback": text[-20000:], "pickled": False,
    }
    try:
        info["code"] = dump(exc, result_path)
        info["pickled"] = True
    except Exception as problem:  # an attribute that does not pickle: the text still goes
        info["unpickled"] = "%s: %s" % (type(problem).__name__, str(problem)[:300])
    write_info(info_path, info)
    sys.exit(RAISED)


def main(argv, here=None, kept=None):
    """The call; ``kept``: a warm call's ``call_warm.KeptCode``, used while the call loads."""
    payload_path, result_path, info_path = argv
    here = here or os.path.dirname(os.path.abspath(__file__))
    with open(payload_path, "rb") as payload:
        try:
            header = json.loads(payload.readline().decode("utf-8"))
        except ValueError:
            refuse(info_path, "the call arrived damaged (its header is not JSON)")
        set_path(here, header)
        if header.get("code"):  # code: cloudpickle's helpers load it
            try:
                import cloudpickle  # noqa: F401
            except Exception as exc:
                refuse(info_path, "cloudpickle, sent with the call, does not load on %s: %s: %s" % (
                    this_python(), type(exc).__name__, exc))
        if kept is not None:
            kept.use(os.getcwd(), here)
        try:
            function, args, kwargs = load_call(payload, info_path, header)
        finally:
            if kept is not None:
                kept.close()
    if header.get("cwd"):  # a function sweep's combination folder: what the call writes lands there
        result_path, info_path = os.path.abspath(result_path), os.path.abspath(info_path)
        if not os.path.isdir(header["cwd"]):
            os.makedirs(header["cwd"])
        os.chdir(header["cwd"])
    try:
        value = function(*args, **kwargs)
    except Exception as exc:
        del args, kwargs
        keep_exception(result_path, info_path, exc)
    del function, args, kwargs  # what they held may be large: free it before pickling the value
    try:
        holds_code = dump(value, result_path)
    except Exception as exc:  # the value does not pickle: that is the call's error
        keep_exception(result_path, info_path, exc)
    write_info(info_path, {"kind": "value", "code": holds_code})


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        # The warm interpreter: its code is staged beside this file (executors/python_call.py).
        from ssh_scheduler_call_warm import serve

        serve(main)
    else:
        main(sys.argv[1:])
