"""Shared-disk weight transport: one immutable directory per version, committed by its manifest.

Layout under ``root``::

    v00000012-full/                 a full version (Hugging Face / SGLang loadable when
        model-00001-of-00002.safetensors     its encoding is raw or bf16)
        model.safetensors.index.json
        config.json                 copied ``extra_files`` (full versions only)
        manifest.json               written LAST: the commit point
    v00000013-delta/                a delta against v12 (rlctl receivers only)
        delta-00001-of-00001.rlst   safetensors content, a suffix no HF loader picks up
        manifest.json

Commit protocol (``send``): take the root's lock, delete uncommitted leftovers,
write every shard (their sha256 computed in a second thread from the same
buffers), fsync every shard, write ``manifest.json.tmp``, fsync, rename to
``manifest.json``, fsync the directory and the root. A directory without
``manifest.json`` does not exist to a reader, so a publisher killed at any
point leaves readers on the previous version. Old versions are deleted
manifest first, so a half-deleted directory is never loadable.

What this is not: object storage (a later transport) or a queue.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterator, Sequence

from rlctl.contracts.errors import RoleError
from rlctl.contracts.types import WeightManifest, WeightShard
from rlctl.engine.transports import load_blob, safetensors_parts
from rlctl.engine.weight_codec import ShardDraft, manifest_from_dict, manifest_to_dict
from rlctl.storage.durable import fsync_path
from rlctl.engine.faults import fault_site

MANIFEST = "manifest.json"
_VERSION_DIR = re.compile(r"^v(\d{8})-(full|delta)$")


def version_dir_name(version: int, delta: bool) -> str:
    return f"v{version:08d}-{'delta' if delta else 'full'}"


def is_committed(directory: str | Path) -> bool:
    return (Path(directory) / MANIFEST).is_file()


def is_version_dir(directory: str | Path) -> bool:
    """True for a directory a publish created (committed or not): it must never load as a plain model."""
    path = Path(directory)
    return bool(_VERSION_DIR.match(path.name)) or is_committed(path) or (path / (MANIFEST + ".tmp")).exists()


def read_manifest(directory: str | Path) -> WeightManifest:
    """The committed manifest of ``directory``; refuses a directory a publish never finished."""
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise RoleError(f"{directory} holds no committed weight version (no {MANIFEST}): its publish was "
                        "interrupted, or it is not a weight publish directory",
                        "keep serving the previous version; the next publish replaces it")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise RoleError(f"{path} is not valid JSON: {err}", "republish this version") from err
    return manifest_from_dict(data, where=str(path))


def fetch_directory(directory: str | Path) -> tuple[WeightManifest, dict[str, Any]]:
    """Read and verify every shard of a committed version directory (sha256 before anything is parsed)."""
    root = Path(directory)
    manifest = read_manifest(root)
    stored: dict[str, Any] = {}
    for shard in manifest.shards:
        if Path(shard.path).name != shard.path:
            raise RoleError(f"manifest in {root} names shard {shard.path!r} outside its directory",
                            "refusing it; republish this version")
        path = root / shard.path
        if not path.is_file():
            raise RoleError(f"shard {shard.path} of weight version {manifest.version} is missing from {root}",
                            "the receiver keeps its current weights; republish this version")
        stored.update(load_blob(manifest, shard, path.read_bytes()))
    return manifest, stored


def _sha256_parts(parts: list[memoryview]) -> str:
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part)
    return digest.hexdigest()



class DiskTransport:
    """Publishes versions as directories under ``root`` (local or a shared file system)."""

    name = "disk"

    @property
    def location(self) -> str:
        """The directory of the last version sent ("" before the first)."""
        return str(self.last_dir or "")

    def __init__(self, root: str | Path, *, keep_versions: int = 2, extra_files: Sequence[str | Path] = ()) -> None:
        if keep_versions < 1:
            raise ValueError(f"keep_versions must be >= 1 (got {keep_versions}): readers need the newest version")
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.keep_versions = keep_versions
        self.extra_files = tuple(Path(p) for p in extra_files)
        self.last_dir: Path | None = None

    # -- publisher ---------------------------------------------------------------

    def send(self, draft: WeightManifest, shards: Sequence[ShardDraft]) -> WeightManifest:
        with self._locked():
            self._collect_garbage()
            target = self.root / version_dir_name(draft.version, draft.is_delta)
            if is_committed(target):
                existing = read_manifest(target)
                if existing.fingerprint == draft.fingerprint:
                    self.last_dir = target
                    return existing  # the same weights again: versions are immutable, so reuse
                raise RoleError(f"weight version {draft.version} is already published in {target} with other "
                                f"weights (fingerprint {existing.fingerprint} != {draft.fingerprint})",
                                "versions are immutable: publish the new weights under a new version number")
            if target.exists():
                shutil.rmtree(target)
            target.mkdir()
            loadable = not draft.is_delta and all(
                t.encoding != "fp8_e4m3" for s in draft.shards for t in s.tensors)
            prefix, suffix = ("model", "safetensors") if loadable else ("delta" if draft.is_delta else "fp8", "rlst")
            names = [f"{prefix}-{i + 1:05d}-of-{len(shards):05d}.{suffix}" for i in range(len(shards))]
            written = self._write_shards(target, names, shards)
            manifest = replace(draft, shards=tuple(written))
            if loadable:
                self._write_hf_files(target, manifest)
            self._commit(target, manifest)
            self._retain()
            self.last_dir = target
            return manifest

    def _write_shards(self, target: Path, names: list[str], shards: Sequence[ShardDraft]) -> list[WeightShard]:
        """Write every shard, then fsync them all; one thread hashes the same buffers meanwhile.

        The buffers are views of the tensors (nothing is copied before the
        write) and hashlib releases the GIL, so hashing runs beside the writes
        and the device flushes early shards while later ones are written.
        """
        parts = [safetensors_parts(shard) for shard in shards]
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlctl-shard-sha256") as hasher:
            digests = [hasher.submit(_sha256_parts, p) for p in parts]
            sizes = [self._write_shard(target / name, shard, p) for name, shard, p in zip(names, shards, parts)]
            for name in names:
                fsync_path(target / name)
            return [WeightShard(path=name, sha256=digest.result(), num_bytes=size, tensors=shard.tensors)
                    for name, digest, size, shard in zip(names, digests, sizes, shards)]

    def _write_shard(self, path: Path, shard: ShardDraft, parts: list[memoryview]) -> int:
        with open(path, "wb", buffering=0) as f:
            fault_site("weights.write", path=str(path))  # a failed write (injected: ENOSPC) leaves no manifest
            for part in parts:
                while part:
                    part = part[f.write(part):]
        return sum(len(p) for p in parts)

    def _write_hf_files(self, target: Path, manifest: WeightManifest) -> None:
        weight_map = {t.name: s.path for s in manifest.shards for t in s.tensors}
        index = {"metadata": {"total_size": manifest.num_bytes}, "weight_map": weight_map}
        self._write_synced(target / "model.safetensors.index.json", json.dumps(index, indent=1).encode())
        for src in self.extra_files:
            if src.is_file():
                self._write_synced(target / src.name, src.read_bytes())

    def _commit(self, target: Path, manifest: WeightManifest) -> None:
        tmp = target / (MANIFEST + ".tmp")
        self._write_synced(tmp, json.dumps(manifest_to_dict(manifest), indent=1).encode())
        os.replace(tmp, target / MANIFEST)
        fsync_path(target)
        fsync_path(self.root)

    @staticmethod
    def _write_synced(path: Path, data: bytes) -> None:
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    @contextmanager
    def _locked(self) -> Iterator[None]:
        """One publisher per root at a time; the OS drops the lock if the holder dies."""
        with open(self.root / ".publish.lock", "a+") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def _collect_garbage(self) -> None:
        for path in self._version_dirs(committed=False):
            shutil.rmtree(path, ignore_errors=True)

    def _retain(self) -> None:
        committed = sorted(self._version_dirs(committed=True), key=lambda p: p.name)
        for old in committed[: max(0, len(committed) - self.keep_versions)]:
            (old / MANIFEST).unlink()  # not loadable from here on, even if the delete is cut short
            fsync_path(old)
            shutil.rmtree(old)

    def _version_dirs(self, committed: bool) -> list[Path]:
        out = []
        for path in self.root.iterdir():
            if path.is_dir() and _VERSION_DIR.match(path.name) and is_committed(path) == committed:
                out.append(path)
        return out

    # -- receiver ----------------------------------------------------------------

    def latest_dir(self) -> Path:
        """The newest committed version directory (a full one when a full and a delta share a version)."""
        best: tuple[int, int] | None = None
        found: Path | None = None
        for path in self._version_dirs(committed=True):
            m = _VERSION_DIR.match(path.name)
            assert m is not None
            key = (int(m.group(1)), 1 if m.group(2) == "full" else 0)
            if best is None or key > best:
                best, found = key, path
        if found is None:
            raise RoleError(f"no committed weight version under {self.root}", "publish one first")
        return found

    def fetch(self, timeout_s: float | None = None, *, directory: str | Path | None = None,
              ) -> tuple[WeightManifest, dict[str, Any]]:
        return fetch_directory(directory if directory is not None else self.latest_dir())

    def close(self) -> None:
        pass
