"""The benchmark driver's library (scripts/bench_run.py is its command line; run it through
``scripts/bench``).  Named bench_driver: a ``bench`` package would clash with the scripts/bench
entry script.

The shared core, each module importing only those above it:

  base         where things are (the repository, the venv, results and profiles) and the log line
  measure      running one whole process and accounting its wall, CPU and memory
  records      what a scenario is made of: tools, their runs' statistics, targets, groups
  verify       checks of a run's output (batch finished, output lines, the floor's JSON line)
  bench        the state of one benchmark run: its folder, clusters, environment, peer commands
  profiling    the untimed profiled runs (--profile)
  runner       running a scenario's rounds
  environment  the machine and the measured code, for the report
  table        the results table
  report       the text printed after the table
  results      the JSON result file

The scenario families (scenarios/, one module each) import the core only, never each other;
catalogue, last, lists them for the command line.
"""
