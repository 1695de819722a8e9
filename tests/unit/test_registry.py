"""Tests of rlctl.registry on SQLite (temp file) and PostgreSQL (fresh schema per test).

PostgreSQL cases carry the ``postgres`` marker (deselected by default; run with
``-m postgres``) and need the server on 127.0.0.1:5432 with database ``test``.
Multi-process cases start real OS processes with ``subprocess``.
"""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa

from rlctl.contracts.errors import RegistryError
from rlctl.contracts.types import EvalRecord
from rlctl.registry import Registry, default_url, upgrade
from rlctl.registry import db

PG_BASE = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
TABLES = {"runs", "metrics", "events", "checkpoints", "evals", "ablations", "ablation_runs", "model_evals",
          "alembic_version"}
BACKENDS = ["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)]


@pytest.fixture(params=BACKENDS)
def url(request: pytest.FixtureRequest, tmp_path: Path):
    """A URL of an empty registry database that no other test shares."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'home' / 'registry.db'}"
        return
    pytest.importorskip("psycopg", reason="the PostgreSQL driver is not installed: pip install -e '.[postgres]'")
    schema = f"t_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(PG_BASE, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.exec_driver_sql(f"CREATE SCHEMA {schema}")
    try:
        yield f"{PG_BASE}?options=-csearch_path%3D{schema}"
    finally:
        with admin.connect() as conn:
            conn.exec_driver_sql(f"DROP SCHEMA {schema} CASCADE")
        admin.dispose()


@pytest.fixture
def reg(url: str):
    with Registry.open(url) as registry:
        yield registry


def new_run(reg: Registry, **overrides) -> object:
    values = dict(
        name="tiny-grpo", config={"algo": {"name": "grpo", "lr": 1e-5}, "seeds": [1, 2]},
        config_hash="cfg-abc", code_version="git:1234567+dirty", dataset_version="data-v1",
        tokenizer_hash="tok-xyz", seed=2**32 - 1, run_dir="/runs/tiny",
    )
    return reg.create_run(**{**values, **overrides})


# -- schema and migrations ---------------------------------------------------


def test_migrate_from_empty_creates_every_table_at_head(url: str) -> None:
    upgrade(url)
    engine = db.open_engine(url)
    try:
        assert TABLES <= set(sa.inspect(engine).get_table_names())
        with engine.connect() as conn:
            assert conn.exec_driver_sql("SELECT version_num FROM alembic_version").scalar_one() == "0003"
    finally:
        engine.dispose()


def test_open_twice_is_idempotent_and_keeps_data(url: str) -> None:
    with Registry.open(url) as first:
        run = new_run(first)
    upgrade(url)
    with Registry.open(url) as second:
        assert second.get_run(run.id) == run


def test_migrations_match_the_orm_tables(url: str) -> None:
    from alembic.autogenerate import compare_metadata
    from alembic.runtime.migration import MigrationContext

    from rlctl.registry.tables import Base

    upgrade(url)
    engine = db.open_engine(url)
    try:
        with engine.connect() as conn:
            assert compare_metadata(MigrationContext.configure(conn), Base.metadata) == []
    finally:
        engine.dispose()


def test_schema_newer_than_code_is_refused(url: str) -> None:
    upgrade(url)
    engine = db.open_engine(url)
    with engine.begin() as conn:
        conn.exec_driver_sql("UPDATE alembic_version SET version_num = '9999'")
    engine.dispose()
    with pytest.raises(RegistryError, match="newer rlctl") as info:
        Registry.open(url)
    assert "upgrade rlctl" in info.value.hint


def test_sqlite_connections_use_foreign_keys_and_wal(tmp_path: Path) -> None:
    engine = db.open_engine(f"sqlite:///{tmp_path / 'deep' / 'dir' / 'r.db'}")
    with engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar_one() == 1
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar_one() == "wal"
        assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar_one() == 30000
    engine.dispose()


def test_default_url_reads_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("RLCTL_REGISTRY_URL", raising=False)
    monkeypatch.delenv("RLCTL_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_url() == f"sqlite:///{tmp_path / '.rlctl' / 'registry.db'}"
    monkeypatch.setenv("RLCTL_HOME", str(tmp_path / "home"))
    assert default_url() == f"sqlite:///{tmp_path / 'home' / 'registry.db'}"
    monkeypatch.setenv("RLCTL_REGISTRY_URL", PG_BASE)
    assert default_url() == PG_BASE


def test_open_none_uses_default_url(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("RLCTL_REGISTRY_URL", raising=False)
    monkeypatch.setenv("RLCTL_HOME", str(tmp_path / "h"))
    with Registry.open() as reg:
        new_run(reg)
    assert (tmp_path / "h" / "registry.db").is_file()


@pytest.mark.parametrize(
    "bad_url, message",
    [
        ("not a url", "not a database URL"),
        ("mysql://u@localhost/db", "only SQLite and PostgreSQL"),
        ("postgresql://postgres@127.0.0.1:1/test", "cannot open registry"),
    ],
)
def test_bad_urls_raise_registry_error_with_hint(bad_url: str, message: str) -> None:
    with pytest.raises(RegistryError, match=message) as info:
        Registry.open(bad_url)
    assert "RLCTL_REGISTRY_URL" in info.value.hint


# -- runs --------------------------------------------------------------------


def test_run_roundtrip_with_every_provenance_field(reg: Registry) -> None:
    before = time.time()
    run = new_run(reg)
    assert run.id[:15] == time.strftime("%Y%m%d-%H%M%S", time.gmtime(run.created_at))
    assert len(run.id) == 22 and int(run.id[16:], 16) >= 0
    assert (run.name, run.status, run.error) == ("tiny-grpo", "running", None)
    assert run.config == {"algo": {"name": "grpo", "lr": 1e-5}, "seeds": [1, 2]}
    assert (run.config_hash, run.code_version, run.dataset_version, run.tokenizer_hash) == (
        "cfg-abc", "git:1234567+dirty", "data-v1", "tok-xyz")
    assert (run.seed, run.run_dir) == (2**32 - 1, "/runs/tiny")
    assert before <= run.created_at == run.updated_at <= time.time()
    assert reg.get_run(run.id) == run
    assert reg.get_run(run.id[:19]) == run


def test_runs_without_dataset_or_tokenizer_get_them_later(reg: Registry) -> None:
    run = new_run(reg, dataset_version=None, tokenizer_hash=None, status="starting")
    assert (run.dataset_version, run.tokenizer_hash) == (None, None)
    updated = reg.update_run(run.id, status="running", dataset_version="d2", tokenizer_hash="t2")
    assert (updated.status, updated.dataset_version, updated.tokenizer_hash) == ("running", "d2", "t2")
    failed = reg.update_run(run.id, status="failed", error="boom\nTraceback ...")
    assert (failed.status, failed.error, failed.dataset_version) == ("failed", "boom\nTraceback ...", "d2")
    assert failed.updated_at >= updated.updated_at >= run.updated_at
    assert reg.get_run(run.id) == failed


def test_list_runs_newest_first_with_limit_and_status(reg: Registry) -> None:
    runs = [new_run(reg, name=f"r{i}") for i in range(4)]
    reg.update_run(runs[1].id, status="completed")
    assert [r.name for r in reg.list_runs()] == ["r3", "r2", "r1", "r0"]
    assert [r.name for r in reg.list_runs(limit=2)] == ["r3", "r2"]
    assert [r.name for r in reg.list_runs(status="completed")] == ["r1"]
    assert reg.list_runs(status="interrupted") == []


def test_ambiguous_prefix_names_the_matches(reg: Registry) -> None:
    a, b = new_run(reg), new_run(reg)
    with pytest.raises(RegistryError, match="ambiguous") as info:
        reg.get_run(a.id[:8])
    assert a.id in info.value.message and b.id in info.value.message
    assert "rlctl runs list" in info.value.hint


def test_unknown_run_raises_registry_error_everywhere(reg: Registry) -> None:
    new_run(reg)
    calls = [
        lambda: reg.get_run("nope"),
        lambda: reg.get_run(""),
        lambda: reg.get_run("2%"),
        lambda: reg.update_run("nope", status="failed"),
        lambda: reg.log_metrics("nope", 0, {"loss": 1.0}),
        lambda: reg.metrics("nope"),
        lambda: reg.last_metrics("nope"),
        lambda: reg.add_event("nope", "status", "x"),
        lambda: reg.events("nope"),
        lambda: reg.evals("nope"),
    ]
    for call in calls:
        with pytest.raises(RegistryError, match="no run with id") as info:
            call()
        assert "rlctl runs list" in info.value.hint


def test_bad_input_is_a_value_error(reg: Registry) -> None:
    run = new_run(reg)
    with pytest.raises(ValueError, match="seed"):
        new_run(reg, seed="7")
    with pytest.raises(ValueError, match="JSON"):
        new_run(reg, config={"path": Path("/x")})
    with pytest.raises(ValueError, match="step"):
        reg.log_metrics(run.id, -1, {"loss": 1.0})


# -- metrics -----------------------------------------------------------------


def test_rewriting_a_step_overwrites_it(reg: Registry) -> None:
    run = new_run(reg)
    reg.log_metrics(run.id, 3, {"loss": 1.0, "reward/mean": 0.25})
    reg.log_metrics(run.id, 3, {"loss": 0.5})
    points = reg.metrics(run.id)
    assert [(p.step, p.name, p.value) for p in points] == [(3, "loss", 0.5), (3, "reward/mean", 0.25)]


def test_metrics_order_filter_and_last(reg: Registry) -> None:
    run = new_run(reg)
    assert reg.metrics(run.id) == [] and reg.last_metrics(run.id) == {}
    for step in (2, 0, 1):
        reg.log_metrics(run.id, step, {"loss": 10.0 - step, "kl": step / 10})
    reg.log_metrics(run.id, 5, {"eval/pass@1": 0.4})
    assert [(p.step, p.name) for p in reg.metrics(run.id, names=["loss"])] == [(0, "loss"), (1, "loss"), (2, "loss")]
    assert [(p.step, p.name) for p in reg.metrics(run.id)][:3] == [(0, "kl"), (0, "loss"), (1, "kl")]
    assert reg.last_metrics(run.id) == {"loss": (2, 8.0), "kl": (2, 0.2), "eval/pass@1": (5, 0.4)}


def test_non_finite_metrics(reg: Registry, url: str) -> None:
    run = new_run(reg)
    reg.log_metrics(run.id, 1, {"grad_norm": math.inf, "neg": -math.inf, "loss": 1.0})
    reg.log_metrics(run.id, 1, {"loss": math.nan})
    values = {p.name: p.value for p in reg.metrics(run.id)}
    assert values["grad_norm"] == math.inf and values["neg"] == -math.inf
    if url.startswith("sqlite"):
        assert "loss" not in values
        [event] = reg.events(run.id)
        assert (event.kind, event.data) == ("metric_nonfinite", {"step": 1, "name": "loss", "value": "nan"})
    else:
        assert math.isnan(values["loss"]) and reg.events(run.id) == []


def test_delete_metrics_from_a_step_keeps_the_earlier_steps(reg: Registry) -> None:
    run = new_run(reg)
    for step in range(5):
        reg.log_metrics(run.id, step, {"loss": float(step), "reward_mean": 0.5})
    assert reg.delete_metrics_from(run.id, 3) == 4
    assert sorted({p.step for p in reg.metrics(run.id)}) == [0, 1, 2]
    with pytest.raises(RegistryError, match="no run"):
        reg.delete_metrics_from("nope", 0)


# -- checkpoints ---------------------------------------------------------------


def test_checkpoint_rows_upsert_list_and_delete(reg: Registry) -> None:
    run = new_run(reg)
    assert reg.checkpoints(run.id) == []
    reg.add_checkpoint(run.id, 20, "/runs/tiny/checkpoints/step-000020", "a" * 64, {"reward_mean": 0.5})
    reg.add_checkpoint(run.id, 10, "/runs/tiny/checkpoints/step-000010", "b" * 64, {"reward_mean": math.nan})
    reg.add_checkpoint(run.id, 20, "/runs/tiny/checkpoints/step-000020", "c" * 64)  # a retry or a reconcile
    rows = reg.checkpoints(run.id)
    assert [(r.step, r.manifest_sha256[0]) for r in rows] == [(10, "b"), (20, "c")]
    assert rows[0].metrics == {"reward_mean": "nan"} and rows[1].metrics == {}
    reg.delete_checkpoint(run.id, 10)
    reg.delete_checkpoint(run.id, 99)  # absent: no error
    assert [r.step for r in reg.checkpoints(run.id)] == [20]
    with pytest.raises(RegistryError, match="no run"):
        reg.add_checkpoint("nope", 1, "/x", "d" * 64)


def test_update_run_can_clear_the_error(reg: Registry) -> None:
    run = new_run(reg)
    assert reg.update_run(run.id, status="failed", error="boom").error == "boom"
    assert reg.update_run(run.id, status="running").error == "boom"
    assert reg.update_run(run.id, status="running", clear_error=True).error is None


# -- events and evals --------------------------------------------------------


def test_events_roundtrip_in_order(reg: Registry) -> None:
    run = new_run(reg)
    reg.add_event(run.id, "status", "started")
    reg.add_event(run.id, "alert", "loss spiked", {"step": 7, "loss": math.nan, "ranks": (0, 1)})
    first, second = reg.events(run.id)
    assert (first.run_id, first.kind, first.message, first.data) == (run.id, "status", "started", {})
    assert (second.kind, second.data) == ("alert", {"step": 7, "loss": "nan", "ranks": [0, 1]})
    assert run.created_at <= first.created_at <= second.created_at


def test_evals_roundtrip(reg: Registry) -> None:
    run = new_run(reg)
    record = EvalRecord(
        run_id=run.id, split="hidden", num_prompts=200, baseline_name="base", candidate_name="ckpt-40",
        baseline_pass_at_1=0.31, candidate_pass_at_1=0.42, diff=0.11, ci_low=0.05, ci_high=0.17,
        created_at=time.time(), details={"bootstrap": 1000, "per_prompt": [1, 0, 1]},
    )
    reg.add_eval(record)
    reg.add_eval(EvalRecord(**{**{f: getattr(record, f) for f in record.__slots__}, "split": "dev"}))
    assert [e.split for e in reg.evals(run.id)] == ["hidden", "dev"]
    assert reg.evals(run.id)[0] == record


# -- retries and concurrency -------------------------------------------------


def test_sqlite_lock_contention_is_retried(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("rlctl.registry.store._LOCK_BACKOFF_S", 0.01)
    url = f"sqlite:///{tmp_path / 'r.db'}"
    upgrade(url)
    reg = Registry(db.open_engine(url, busy_timeout_s=0.02))
    run = new_run(reg)
    holder = sa.create_engine(url)
    with holder.connect() as conn:
        conn.exec_driver_sql("BEGIN IMMEDIATE")
        releaser = threading.Timer(0.3, conn.exec_driver_sql, ["COMMIT"])
        releaser.start()
        reg.log_metrics(run.id, 0, {"loss": 1.0})  # fails at first, succeeds after the release
        releaser.join()
        conn.exec_driver_sql("BEGIN IMMEDIATE")
        with pytest.raises(RegistryError, match="stayed locked"):
            reg.log_metrics(run.id, 1, {"loss": 1.0})
        conn.exec_driver_sql("ROLLBACK")
    holder.dispose()
    assert [p.step for p in reg.metrics(run.id)] == [0]
    reg.close()


@pytest.mark.parametrize("url", [BACKENDS[1]], indirect=True)
def test_postgres_dropped_connection_is_survived(reg: Registry) -> None:
    run = new_run(reg)
    with reg._engine.connect() as conn:  # the pooled connection the next write will use
        pid = conn.exec_driver_sql("SELECT pg_backend_pid()").scalar_one()
    killer = sa.create_engine(PG_BASE, isolation_level="AUTOCOMMIT")
    with killer.connect() as conn:
        assert conn.exec_driver_sql(f"SELECT pg_terminate_backend({pid})").scalar_one()
    killer.dispose()
    reg.log_metrics(run.id, 0, {"loss": 1.0})
    assert reg.last_metrics(run.id) == {"loss": (0, 1.0)}


def test_dropped_connection_is_retried_once_for_idempotent_writes_only(reg: Registry) -> None:
    def flaky(failures: int):
        calls = []

        def fn(_session):
            calls.append(1)
            if len(calls) <= failures:
                raise sa.exc.OperationalError(
                    "INSERT", {}, Exception("server closed the connection"), connection_invalidated=True
                )
            return "ok"

        return fn, calls

    fn, calls = flaky(1)
    assert reg._tx("write", fn, write=True, idempotent=True) == "ok" and len(calls) == 2
    fn, calls = flaky(1)
    with pytest.raises(RegistryError, match="server closed"):
        reg._tx("write", fn, write=True, idempotent=False)
    assert len(calls) == 1
    fn, calls = flaky(2)
    with pytest.raises(RegistryError, match="server closed"):
        reg._tx("write", fn, write=True, idempotent=True)
    assert len(calls) == 2


WORKER = textwrap.dedent(
    """
    import sys
    from rlctl.registry import Registry
    url, mode, tag, run_id = sys.argv[1:5]
    print("ready", flush=True)
    sys.stdin.readline()
    reg = Registry.open(url)
    if mode == "open":
        run_id = reg.create_run(name=tag, config={}, config_hash="h", code_version="c",
                                dataset_version=None, tokenizer_hash=None, seed=0, run_dir="/r").id
    else:
        for step in range(200):
            reg.log_metrics(run_id, step, {f"worker/{tag}": float(step), "shared": float(step)})
    reg.close()
    print("done", run_id, flush=True)
    """
)


def run_workers(url: str, mode: str, n: int, run_id: str = "-") -> list[str]:
    """Start ``n`` worker processes, release them together, and return their last lines."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, url, mode, str(i), run_id],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for i in range(n)
    ]
    for proc in procs:
        assert proc.stdout.readline().strip() == "ready"
    for proc in procs:
        proc.stdin.write("go\n")
        proc.stdin.flush()
    results = [proc.communicate(timeout=120) for proc in procs]
    for proc, (out, err) in zip(procs, results):
        assert proc.returncode == 0, err
    return [out.strip() for out, _ in results]


def test_concurrent_fresh_open_by_several_processes(url: str) -> None:
    lines = run_workers(url, "open", 4)
    ids = {line.split()[1] for line in lines}
    with Registry.open(url) as reg:
        assert {r.id for r in reg.list_runs()} == ids and len(ids) == 4


def test_two_processes_write_metrics_concurrently_without_loss(reg: Registry, url: str) -> None:
    run = new_run(reg)
    run_workers(url, "metrics", 2, run.id)
    points = reg.metrics(run.id)
    by_name: dict[str, list[int]] = {}
    for p in points:
        by_name.setdefault(p.name, []).append(p.step)
    assert by_name == {name: list(range(200)) for name in ("shared", "worker/0", "worker/1")}


def test_ablation_store_round_trip(reg: Registry) -> None:
    from rlctl.registry.ablations import AblationStore

    store = AblationStore(reg)
    spec = {"cells": ["a=1"], "seeds": [0], "baseline": "a=1"}
    abl, new = store.find_or_create("demo", "hash-x", spec)
    assert new and abl.status == "running" and abl.id.startswith("abl-")
    again, new = store.find_or_create("demo", "hash-x", spec)
    assert not new and again.id == abl.id
    run = reg.create_run(name="r", config={}, config_hash="h", code_version="c", dataset_version=None,
                         tokenizer_hash=None, seed=0, run_dir="/tmp/x")
    store.set_run(abl.id, "a=1", 0, status="running", run_id=run.id)
    row = store.set_run(abl.id, "a=1", 0, status="succeeded", wall_s=1.5)
    assert (row.run_id, row.status, row.wall_s) == (run.id, "succeeded", 1.5)
    assert store.runs(abl.id) == [row]
    updated = store.update(abl.id, status="succeeded", spec={**spec, "resolved_budget_tokens": 10})
    assert updated.spec["resolved_budget_tokens"] == 10 and store.get(abl.id).status == "succeeded"


def test_migrate_from_the_frozen_0001_schema_keeps_runs(url: str) -> None:
    from alembic import command

    engine = db.open_engine(url)
    try:
        config = db._alembic_config()
        with engine.begin() as conn:
            config.attributes["connection"] = conn
            command.upgrade(config, "0001")
        assert "ablations" not in set(sa.inspect(engine).get_table_names())
        run = new_run(Registry(engine))  # a run written by an rlctl of the 0001 schema
    finally:
        engine.dispose()
    with Registry.open(url) as reg:  # upgrades to head on open
        assert reg.get_run(run.id) == run
    engine = db.open_engine(url)
    try:
        assert {"ablations", "ablation_runs"} <= set(sa.inspect(engine).get_table_names())
    finally:
        engine.dispose()
