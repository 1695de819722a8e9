"""The built-in weight transports: ``disk`` (versions as directories on a local or shared file system) and
``inprocess`` (the encoded tensors handed over by reference, for readers in this process).

What this is: their registrations and the disk transport's options. The
transports themselves are core's (exported by rlctl.kit), so a rollout backend
builds one by name (``rlctl.kit.weight_transport``) whatever plugin provides it.
The torch.distributed broadcast transport is not registered here: it needs a
process group of publisher and readers, which a backend sets up itself.

What this is not: the publish / apply protocol (rlctl.kit.Broadcaster).
"""

from __future__ import annotations

from typing import Any, Sequence

from pydantic import BaseModel, ConfigDict, Field

from rlctl import hookimpl


class DiskTransportOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    keep_versions: int = Field(2, ge=1, description="Committed versions kept in the directory (readers need the "
                               "newest; an older one lets a slow reader finish).")


def _disk(options: DiskTransportOptions, directory: str, extra_files: Sequence[str] = ()) -> Any:
    from rlctl.kit import DiskTransport

    return DiskTransport(directory, keep_versions=options.keep_versions, extra_files=extra_files)


def _inprocess(options: Any, directory: str, extra_files: Sequence[str] = ()) -> Any:
    from rlctl.kit import InProcessTransport

    return InProcessTransport()


@hookimpl
def register_weight_transports(register: Any) -> None:
    register("disk", _disk, options=DiskTransportOptions)
    register("inprocess", _inprocess)
