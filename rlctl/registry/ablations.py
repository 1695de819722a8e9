"""Ablations in the registry: one row per ablation, one per (cell, seed) pointing at its run.

What this is: ``AblationStore``, a thin layer over ``Registry``'s transactions
for the two ablation tables; it returns contract dataclasses.

What this is not: running the matrix or its statistics (rlctl.lifecycle.ablate).
"""

from __future__ import annotations

import secrets
import time
from typing import Any, Mapping

from sqlalchemy import select
from sqlalchemy.orm import Session

from rlctl.contracts.errors import RegistryError
from rlctl.contracts.types import AblationRecord, AblationRunRecord
from rlctl.registry.store import Registry, _json_safe
from rlctl.registry.tables import Ablation, AblationRun


class AblationStore:
    """Create, find and update ablations and their runs in ``registry``."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry

    def find_or_create(self, name: str, spec_hash: str, spec: Mapping[str, Any]) -> tuple[AblationRecord, bool]:
        """The newest ablation with ``spec_hash`` (to continue it), or a new one; the flag says it is new."""

        def write(s: Session) -> tuple[AblationRecord, bool]:
            query = select(Ablation).where(Ablation.spec_hash == spec_hash).order_by(Ablation.created_at.desc())
            found = s.scalars(query).first()
            if found is not None:
                return _record(found), False
            now = time.time()
            row = Ablation(id=f"abl-{time.strftime('%Y%m%d-%H%M%S', time.gmtime(now))}-{secrets.token_hex(3)}",
                           name=name, spec_hash=spec_hash, spec=_json_safe(dict(spec), "ablation spec"),
                           status="running", created_at=now, updated_at=now)
            s.add(row)
            s.flush()
            return _record(row), True

        return self.registry._tx("find or create ablation", write, write=True, idempotent=False)

    def get(self, ablation_id: str) -> AblationRecord:
        def read(s: Session) -> AblationRecord:
            row = s.get(Ablation, ablation_id)
            if row is None:
                raise RegistryError(f"no ablation with id {ablation_id!r} in the registry",
                                    "list runs with `rlctl runs list`; ablation ids start with 'abl-'")
            return _record(row)

        return self.registry._tx(f"read ablation {ablation_id}", read)

    def update(self, ablation_id: str, *, status: str | None = None,
               spec: Mapping[str, Any] | None = None) -> AblationRecord:
        def write(s: Session) -> AblationRecord:
            row = s.get(Ablation, ablation_id)
            if row is None:
                raise RegistryError(f"no ablation with id {ablation_id!r} in the registry")
            if status is not None:
                row.status = status
            if spec is not None:
                row.spec = _json_safe(dict(spec), "ablation spec")
            row.updated_at = time.time()
            return _record(row)

        return self.registry._tx(f"update ablation {ablation_id}", write, write=True)

    def runs(self, ablation_id: str) -> list[AblationRunRecord]:
        query = select(AblationRun).where(AblationRun.ablation_id == ablation_id).order_by(
            AblationRun.cell, AblationRun.seed)
        return self.registry._tx(f"read runs of ablation {ablation_id}",
                                 lambda s: [_run_record(r) for r in s.scalars(query)])

    def set_run(self, ablation_id: str, cell: str, seed: int, *, status: str, run_id: str | None = None,
                wall_s: float | None = None) -> AblationRunRecord:
        """Insert or update the (cell, seed) row (the run id is kept when not given)."""

        def write(s: Session) -> AblationRunRecord:
            row = s.get(AblationRun, (ablation_id, cell, seed))
            if row is None:
                row = AblationRun(ablation_id=ablation_id, cell=cell, seed=seed, run_id=run_id, status=status,
                                  wall_s=wall_s, updated_at=time.time())
                s.add(row)
            else:
                row.status, row.updated_at = status, time.time()
                if run_id is not None:
                    row.run_id = run_id
                if wall_s is not None:
                    row.wall_s = wall_s
            s.flush()
            return _run_record(row)

        return self.registry._tx(f"record run {cell} seed {seed} of ablation {ablation_id}", write, write=True)


def _record(row: Ablation) -> AblationRecord:
    return AblationRecord(id=row.id, name=row.name, spec_hash=row.spec_hash, spec=row.spec, status=row.status,
                          created_at=row.created_at, updated_at=row.updated_at)


def _run_record(row: AblationRun) -> AblationRunRecord:
    return AblationRunRecord(ablation_id=row.ablation_id, cell=row.cell, seed=row.seed, run_id=row.run_id,
                             status=row.status, wall_s=row.wall_s)
