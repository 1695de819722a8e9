"""Capacity planning: what a run will need and where its time goes, before and after it runs.

What this is: the dry run (checks, the per-role memory ledger of every
placement, a measured smoke step: rlctl.planning.dryrun), the ledger's
arithmetic (rlctl.planning.memory, model shapes in rlctl.planning.shapes), the
staleness and throughput simulator of the overlapped modes
(rlctl.planning.staleness), GPU plans (rlctl.planning.plan) and the profile of
a run's stage times (rlctl.planning.profile).

What this is not: running or resuming runs (rlctl.lifecycle) or handling
faults (rlctl.incidents).
"""
