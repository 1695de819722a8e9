"""Run-level operations: train and evaluate runs with their registry bookkeeping.

What this is: the library functions CLI commands call (one each). They own the
run directory and the registry rows; the loop itself lives in rlctl.engine.
"""
