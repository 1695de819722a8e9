"""Model evals in the registry: pass@k of a model directory evaluated without a run.

What this is: ``ModelEvalStore``, a thin layer over ``Registry``'s transactions
for the ``model_evals`` table, keyed by the model's weight hash; it returns
``ModelEvalRecord`` contract dataclasses.

What this is not: sampling, grading or statistics (rlctl.lifecycle.evaluate_model).
"""

from __future__ import annotations

import dataclasses

from sqlalchemy import select
from sqlalchemy.orm import Session

from rlctl.contracts.types import ModelEvalRecord
from rlctl.registry.store import Registry, _json_safe
from rlctl.registry.tables import ModelEval

_FIELDS = tuple(f.name for f in dataclasses.fields(ModelEvalRecord))


class ModelEvalStore:
    """Add and list model evals in ``registry``."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry

    def add(self, record: ModelEvalRecord) -> ModelEvalRecord:
        """Store ``record`` (its ``id`` is ignored) and return it with the id it got."""
        values = {f: getattr(record, f) for f in _FIELDS if f not in ("id", "results", "details")}
        values["results"] = _json_safe(dict(record.results), "model eval results")
        values["details"] = _json_safe(dict(record.details), "model eval details")

        def insert(s: Session) -> int:
            row = ModelEval(**values)
            s.add(row)
            s.flush()
            return row.id

        new_id = self.registry._tx(f"add the eval of model {record.model_hash[:12]}", insert, write=True,
                                   idempotent=False)
        return dataclasses.replace(record, id=new_id)

    def list(self, model_hash: str | None = None, *, newest_first: bool = False,
             limit: int | None = None) -> list[ModelEvalRecord]:
        """Model evals, oldest first (or newest first, at most ``limit``); only those of ``model_hash`` (a full hash
        or a prefix) when given."""
        query = select(ModelEval).order_by(ModelEval.id.desc() if newest_first else ModelEval.id).limit(limit)
        if model_hash:
            query = query.where(ModelEval.model_hash.startswith(model_hash))

        def read(s: Session) -> list[ModelEvalRecord]:
            return [ModelEvalRecord(**{f: getattr(e, f) for f in _FIELDS}) for e in s.scalars(query)]

        return self.registry._tx("read model evals", read)
