"""Run a script on this Python told to report another minor version: ``python3 fake_version.py
MINOR [-options] SCRIPT ARGS...`` (the options are the interpreter's, and ignored).  The fallback of tests/other_python.py where no other Python is
installed: it exercises a version check, not what another version really cannot load."""

import runpy
import sys

if __name__ == "__main__":
    minor = int(sys.argv[1])
    sys.version_info = (3, minor, 0, "final", 0)  # type: ignore[assignment]
    sys.version = f"3.{minor}.0 (told to say so)"
    sys.argv = sys.argv[2:]
    while sys.argv and sys.argv[0].startswith("-"):  # the interpreter's own options (-B -u)
        del sys.argv[0]
    runpy.run_path(sys.argv[0], run_name="__main__")
