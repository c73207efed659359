"""One module per scenario family of the benchmark; each builds its Scenario records from the
shared core (bench_driver.*) and imports no other family."""
