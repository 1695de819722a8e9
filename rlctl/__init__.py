"""rlctl: reliable, versioned LLM RL post-training from one CLI.

Public API for plugin authors: the ``hookimpl`` marker, the contract types and
the errors. Importing rlctl never imports torch.
"""

from rlctl.contracts.errors import (
    CheckpointError,
    ConfigError,
    DataError,
    ModelError,
    PluginError,
    RegistryError,
    RlctlError,
    RoleError,
    RolloutUnavailable,
    RunbookError,
    ToolError,
    BadToolCall,
)
from rlctl.contracts.types import (
    CriticContext,
    PolicyLoss,
    PromptRecord,
    RewardResult,
    RolloutRequest,
    SamplingConfig,
    Split,
    TaskData,
    TerminalReason,
    Trajectory,
    WeightManifest,
    WeightUpdate,
)
from rlctl.contracts.checkpoints import CheckpointManifest, LearnerState
from rlctl.contracts.batch import AdvantageInputs
from rlctl.hooks.hookspecs import hookimpl

__version__ = "0.1.0"

__all__ = [
    "hookimpl",
    "CheckpointManifest",
    "LearnerState",
    "CriticContext",
    "PolicyLoss",
    "AdvantageInputs",
    "PromptRecord",
    "RewardResult",
    "RolloutRequest",
    "SamplingConfig",
    "Split",
    "TaskData",
    "TerminalReason",
    "Trajectory",
    "WeightManifest",
    "WeightUpdate",
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
    "__version__",
]
