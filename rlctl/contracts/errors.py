"""The rlctl error hierarchy.

What this is: one exception type per area, each carrying a message (what
failed and why) and a hint (the next step). The CLI prints known errors as one
line plus the hint and exits 1; see rlctl/cli/_errors.py.

What this is not: a place for handling errors. Library code raises these;
only the CLI formats them.
"""

from __future__ import annotations


class RlctlError(Exception):
    """Base of every error rlctl reports to users without a traceback."""

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message} (hint: {self.hint})"


class ConfigError(RlctlError):
    """The config file or an override is malformed, unknown or invalid."""


class DataError(RlctlError):
    """A dataset row or task source is unusable."""


class ModelError(RlctlError):
    """A model or tokenizer directory is missing or not loadable."""


class PluginError(RlctlError):
    """A plugin is missing, duplicated, or does not satisfy its protocol."""


class RegistryError(RlctlError):
    """The run registry cannot be opened, migrated, or does not have the record."""


class CheckpointError(RlctlError):
    """A checkpoint is missing, corrupt, or incompatible."""


class RoleError(RlctlError):
    """A role (rollout, reward, learner) failed while the loop was running."""


class RolloutUnavailable(RoleError):
    """The engine behind a rollout backend is gone while serving a call.

    A backend raises it when its process died or every server it drives is
    unreachable, so the call's prompts were not (all) generated. The
    overlapped driver re-queues those prompts for any worker, restarts this
    worker (a new backend instance) and loads the current weights into it
    before it serves again, up to ``cluster.max_restarts`` times; the
    synchronous loop stops with it. Fault injectors (a ``worker-crash`` kind)
    raise it, or kill the engine, at the ``rollout.generate`` fault site.
    """


class ToolError(RoleError):
    """A tool an environment called failed: a bad call, a crash, or an answer that is not one.

    The environment records it on the episode's turn (``tool_status``) and the
    episode is flagged, retried per the verifier policy or its group dropped;
    it is never scored as a zero reward.
    """


class BadToolCall(ToolError):
    """The policy's call is wrong (unparsable, an unknown tool, a bad expression, code that raised).

    Not an infrastructure failure: the environment shows the message to the
    policy as a normal observation (``tool_status`` "invalid") and the episode
    goes on and is scored; the policy can learn from it.
    """


class RunbookError(RlctlError):
    """A runbook is malformed or its check failed."""


class WorkerLost(Exception):
    """A rollout worker died (process killed, actor lost) while serving a call.

    Raised by the placement's worker handles, caught by the overlapped driver:
    the call's prompts are re-queued and the worker restarted. Not an
    RlctlError: it never reaches a user unless the restarts run out.
    """


class LearnerLost(Exception):
    """The learner died (its actor or a rank was lost); its state must be restored from the newest checkpoint."""


__all__ = [
    "RlctlError",
    "ConfigError",
    "DataError",
    "ModelError",
    "PluginError",
    "RegistryError",
    "CheckpointError",
    "RoleError",
    "RolloutUnavailable",
    "RunbookError",
    "ToolError",
    "BadToolCall",
]  # WorkerLost and LearnerLost are signals between the placement and the loops, never shown to users
