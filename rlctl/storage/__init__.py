"""Durable files: what survives a crash or a power cut (fsync, atomic renames, durable directories).

What this is: the low floor every writer of files shares -- warm-started
models (rlctl.models), checkpoints, the trajectory queue and run directories
(rlctl.engine) -- in rlctl.storage.durable.

What this is not: formats (checkpoints, weight versions and the queue's log
define their own) or the registry (rlctl.registry).
"""
