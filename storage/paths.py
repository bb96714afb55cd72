"""Every path rlrounds reads or writes is built here, and nowhere else.

The storage root is any fsspec URI: a local directory (default ``./rlrounds-data``) or
``s3://bucket/prefix``. Layout:

    <root>/base/<name>/                                         cached built-in base policy
    <root>/runs/<run_id>/campaign.json                          the campaign's config and owner
    <root>/runs/<run_id>/rounds/<n>/staging/                    rollout output not yet committed
    <root>/runs/<run_id>/rounds/<n>/trajectories/<version>/     part-*.parquet + manifest.json (the commit)
    <root>/runs/<run_id>/rounds/<n>/checkpoint/                 Hugging Face dir + lineage.json (written last)
    <root>/derived/<version>/                                   re-filtered versions
    <root>/mlflow.db, <root>/mlartifacts/                       default MLflow stores for a local root
"""

from __future__ import annotations

import os
import posixpath
from dataclasses import dataclass
from functools import cached_property
from typing import Any

MANIFEST = "manifest.json"
LINEAGE = "lineage.json"


def part_name(index: int) -> str:
    return f"part-{index:05d}.parquet"


@dataclass(frozen=True)
class StorageRoot:
    uri: str

    @classmethod
    def of(cls, uri: str) -> "StorageRoot":
        if "://" not in uri:
            uri = os.path.abspath(os.path.expanduser(uri))
        return cls(uri.rstrip("/"))

    @property
    def is_local(self) -> bool:
        return "://" not in self.uri or self.uri.startswith("file://")

    @cached_property
    def fs(self) -> Any:
        from storage.settings import filesystem_for

        return filesystem_for(self.uri)

    def join(self, *parts: object) -> str:
        return posixpath.join(self.uri, *(str(p) for p in parts))

    # -- locations ------------------------------------------------------------------------------

    def base_policy(self, name: str) -> str:
        return self.join("base", name)

    def runs(self) -> str:
        return self.join("runs")

    def run(self, run_id: str) -> str:
        return self.join("runs", run_id)

    def campaign_file(self, run_id: str) -> str:
        return self.join("runs", run_id, "campaign.json")

    def round_dir(self, run_id: str, round_index: int) -> str:
        return self.join("runs", run_id, "rounds", round_index)

    def staging(self, run_id: str, round_index: int) -> str:
        return self.join("runs", run_id, "rounds", round_index, "staging")

    def rollout_staging_file(self, run_id: str, round_index: int) -> str:
        return posixpath.join(self.staging(run_id, round_index), "rollout.parquet")

    def round_trajectories(self, run_id: str, round_index: int) -> str:
        return self.join("runs", run_id, "rounds", round_index, "trajectories")

    def trajectory_version(self, run_id: str, round_index: int, version: str) -> str:
        return posixpath.join(self.round_trajectories(run_id, round_index), version)

    def derived_version(self, version: str) -> str:
        return self.join("derived", version)

    def checkpoint(self, run_id: str, round_index: int) -> str:
        return self.join("runs", run_id, "rounds", round_index, "checkpoint")

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


def manifest_of(version_dir: str) -> str:
    return posixpath.join(version_dir, MANIFEST)


def lineage_of(checkpoint_dir: str) -> str:
    return posixpath.join(checkpoint_dir, LINEAGE)


def child(directory: str, name: str) -> str:
    return posixpath.join(directory, name)


def local_cache_dir() -> str:
    """Where remote checkpoints are copied before torch loads them."""
    return os.environ.get("RLROUNDS_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "rlrounds"))
