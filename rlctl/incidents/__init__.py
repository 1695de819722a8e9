"""Incidents: faults injected on purpose, detected while a run trains, diagnosed after, and the runbooks.

What this is: ``RunGuard`` (rlctl.incidents.recovery: a run's injected faults,
recovery events, NaN rollback, live alerts and the hang watchdog), fault
injection into a new or a running run (rlctl.incidents.inject), the drills
that inject each fault into a tiny real run and check its recovery
(rlctl.incidents.drill), the runbooks and their triggers
(rlctl.incidents.runbooks, rlctl.incidents.triggers) and the diagnosis tree
over a run's recorded metrics (rlctl.incidents.diagnose).

What this is not: the fault kinds (plugins) or the recoveries that live in the
roles themselves (the learner's OOM retry, the graders' retries).
"""
