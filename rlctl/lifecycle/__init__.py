"""A run's lifecycle: train, resume, evaluate and compare runs, with their registry bookkeeping.

What this is: the library functions the CLI's run commands call (one each):
``train`` (a new run), ``resume`` (from the newest committed checkpoint),
``evaluate_runs`` (hidden-split pass@1 against the warm start), seed groups and
ablations; ``Run`` (rlctl.lifecycle.run), which owns everything around the
loop for a new run and a resumed one alike (registry row and status, events,
sinks, observer hooks, checkpoints, the run directory's lock, signals); and
the supervisor that restarts a crashed training process.

What this is not: building roles (rlctl.placement), the loop (rlctl.engine),
capacity planning (rlctl.planning) or incident handling (rlctl.incidents).
"""
