"""The command line: typer commands over the Python API; the only layer that prints.

May import: every layer, typer.
"""
