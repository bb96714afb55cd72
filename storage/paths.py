"""Every path rlrounds reads or writes is built here, and nowhere else.

The storage root is any fsspec URI: a local directory (default ``./rlrounds-data``) or
``s3://bucket/prefix``. Layout:

    <root>/base/<name>/                                         cached built-in base policy
    <root>/runs/<run_id>/campaign.json                          the campaign's config and owner (created exclusively)
    <root>/runs/<run_id>/owners/<generation>.json               each resume's takeover (created exclusively)
    <root>/runs/<run_id>/rounds/<n>/stages/<stage>.json         a stage's result, written once its output is committed
    <root>/runs/<run_id>/rounds/<n>/staging/                    rollout output not yet committed (rows, carry-over)
    <root>/runs/<run_id>/rounds/<n>/trajectories/<version>/     part-*.parquet, carryover.parquet; manifest.json commits
    <root>/runs/<run_id>/rounds/<n>/checkpoint/                 Hugging Face dir + lineage.json (written last)
    <root>/derived/<version>/                                   re-filtered versions
    <root>/replays/<replay_id>/checkpoint/                      checkpoints trained by `rlrounds replay`
    <root>/mlflow.db, <root>/mlartifacts/                       default MLflow stores for a local root
    <root>/locks/<name>.lock                                    short exclusive leases (champion gate, base build)
"""

from __future__ import annotations

import hashlib
import os
import posixpath
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from storage.settings import filesystem_for

MANIFEST = "manifest.json"
LINEAGE = "lineage.json"
CARRYOVER = "carryover.parquet"  # a round's unfinished samples, attached to its trajectory version


def part_name(index: int) -> str:
    return f"part-{index:05d}.parquet"


@dataclass(frozen=True)
class StorageRoot:
    uri: str

    @classmethod
    def of(cls, uri: str) -> StorageRoot:
        if "://" not in uri:
            uri = os.path.abspath(os.path.expanduser(uri))
        return cls(uri.rstrip("/"))

    @property
    def is_local(self) -> bool:
        return "://" not in self.uri or self.uri.startswith("file://")

    @cached_property
    def fs(self) -> Any:
        return filesystem_for(self.uri)

    def join(self, *parts: object) -> str:
        return posixpath.join(self.uri, *(str(p) for p in parts))

    def glob(self, pattern: str) -> list[str]:
        """URIs matching ``pattern`` (a URI under this root with * wildcards), sorted.

        fsspec globs remote paths without their protocol and answers without it; both are fixed here."""
        protocol, sep, bare = pattern.partition("://")
        hits = self.fs.glob(bare if sep else pattern)
        return sorted(f"{protocol}://{h}" if sep and "://" not in h else h for h in hits)

    # -- locations ------------------------------------------------------------------------------

    def base_policy(self, name: str) -> str:
        return self.join("base", name)

    def lock(self, name: str) -> str:
        return self.join("locks", f"{name}.lock")

    def campaign_file(self, run_id: str) -> str:
        return self.join("runs", run_id, "campaign.json")

    def campaign_owner(self, run_id: str, generation: int) -> str:
        return self.join("runs", run_id, "owners", f"{generation:06d}.json")

    def campaign_owners(self, run_id: str) -> str:
        return self.join("runs", run_id, "owners")

    def stage_record(self, run_id: str, round_index: int, stage: str) -> str:
        return self.join("runs", run_id, "rounds", round_index, "stages", f"{stage}.json")

    def staging(self, run_id: str, round_index: int) -> str:
        return self.join("runs", run_id, "rounds", round_index, "staging")

    def rollout_staging_file(self, run_id: str, round_index: int) -> str:
        return posixpath.join(self.staging(run_id, round_index), "rollout.parquet")

    def carryover_staging_file(self, run_id: str, round_index: int) -> str:
        return posixpath.join(self.staging(run_id, round_index), CARRYOVER)

    def round_trajectories(self, run_id: str, round_index: int) -> str:
        return self.join("runs", run_id, "rounds", round_index, "trajectories")

    def trajectory_version(self, run_id: str, round_index: int, version: str) -> str:
        return posixpath.join(self.round_trajectories(run_id, round_index), version)

    def derived_version(self, version: str) -> str:
        return self.join("derived", version)

    def checkpoint(self, run_id: str, round_index: int) -> str:
        return self.join("runs", run_id, "rounds", round_index, "checkpoint")

    def replay_checkpoint(self, replay_id: str) -> str:
        return self.join("replays", replay_id, "checkpoint")

    def mlflow_db(self) -> str:
        return self.join("mlflow.db")

    def mlflow_artifacts(self) -> str:
        return self.join("mlartifacts")

    def manifest_globs(self) -> list[str]:
        """Patterns matching every committed trajectory manifest under this root."""
        return [
            self.join("runs", "*", "rounds", "*", "trajectories", "*", MANIFEST),
            self.join("derived", "*", MANIFEST),
        ]

    def round_of(self, path: str) -> tuple[str, int] | None:
        """(run_id, round) of a path under ``<root>/runs/<run_id>/rounds/<n>/``, else None."""
        parts = path.removeprefix(self.uri).strip("/").split("/")
        if len(parts) >= 4 and parts[0] == "runs" and parts[2] == "rounds" and parts[3].isdigit():
            return parts[1], int(parts[3])
        return None

    def leftover_globs(self) -> dict[str, list[str]]:
        """Patterns of directories that hold uncommitted output until their commit marker appears.

        kind -> patterns. 'trajectories' commit with manifest.json, 'checkpoint' with lineage.json;
        'staging' never commits (filter deletes it once the version is committed).
        """
        return {
            "trajectories": [self.join("runs", "*", "rounds", "*", "trajectories", "*"), self.join("derived", "*")],
            "checkpoint": [
                self.join("runs", "*", "rounds", "*", "checkpoint"),
                self.join("base", "*"),
                self.join("replays", "*", "checkpoint"),
            ],
            "staging": [self.join("runs", "*", "rounds", "*", "staging")],
        }


def manifest_of(version_dir: str) -> str:
    return posixpath.join(version_dir, MANIFEST)


def lineage_of(checkpoint_dir: str) -> str:
    return posixpath.join(checkpoint_dir, LINEAGE)


def child(directory: str, *names: str) -> str:
    return posixpath.join(directory, *names)


def local_cache_dir() -> str:
    """Where remote checkpoints are copied before torch loads them."""
    return os.environ.get("RLROUNDS_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "rlrounds"))


def local_mlflow_db(root_uri: str) -> str:
    """The SQLite MLflow store of a remote root (SQLite cannot live on S3): one per root, in the cache,
    so two remote roots never share a registry."""
    key = hashlib.sha256(root_uri.encode()).hexdigest()[:12]
    return os.path.join(local_cache_dir(), "mlflow", key, "mlflow.db")
