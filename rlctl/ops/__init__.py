"""Run-level operations: train, resume and evaluate runs with their registry bookkeeping.

What this is: the library functions CLI commands call (one each). The run
lifecycle (registry row, status, sinks, hooks, lock, signals) is
rlctl.ops.run.Run; the run directory's layout is rlctl.engine.rundir.RunDir;
the loop itself lives in rlctl.engine.loop.
"""
