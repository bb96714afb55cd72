"""MLflow adapter: campaign and round runs, stage metrics, registered checkpoints and their lineage tags.

Everything goes through an explicit ``MlflowClient`` and run ids, never the fluent API's global
"active run", so Prefect tasks on worker threads cannot log into each other's runs. Runs are found
again by tags (``rlrounds.run_id``, ``rlrounds.round``), so a resumed campaign reuses its runs.
"""

from __future__ import annotations

import fcntl
import logging
import os
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from mlflow import MlflowClient
from mlflow.entities import Dataset, DatasetInput, InputTag, Metric, Param

from storage.model_versions import LineageError
from storage.paths import StorageRoot, local_mlflow_db
from storage.settings import Settings

RUN_ID_TAG = "rlrounds.run_id"
ROUND_TAG = "rlrounds.round"
KIND_TAG = "rlrounds.kind"
LINEAGE_TAGS = (
    "round",
    "run_id",
    "parent_model_version",
    "trajectory_version",
    "base_model",
    "config_hash",
    "code_version",
    "prefect_flow_run_id",
)
CHECKPOINT_TAG = "checkpoint"
"""The checkpoint URI, beside the version's source: an MLflow server accepts a local path as a source only
inside the run's artifact directory, so through one a local checkpoint is registered with the run's
artifact URI as its source and found by this tag (``checkpoint_uri``)."""
LINE_TAG = "line"
"""A model version's promotion line (tasks/config/publish.py, promotion_line): the champion gate compares only
versions of one line. Versions registered before lines existed have none."""


def checkpoint_uri(model_version: Any) -> str:
    """The checkpoint a registered model version was trained into (its tag, else its source)."""
    return str((model_version.tags or {}).get(CHECKPOINT_TAG) or model_version.source or "")


def tracking_uris(settings: Settings, root: StorageRoot) -> tuple[str, str]:
    """(tracking URI, default artifact location)."""
    if settings.mlflow_uri:
        tracking = settings.mlflow_uri
    elif root.is_local:
        tracking = f"sqlite:///{root.mlflow_db()}"
    else:
        # A SQLite file cannot live on S3: keep one per root in the local cache unless a server is given
        # (set RLROUNDS_MLFLOW_URI to share a registry between machines).

        tracking = f"sqlite:///{local_mlflow_db(root.uri)}"
    artifacts = settings.mlflow_artifacts or root.mlflow_artifacts()
    return tracking, artifacts


def server_command(settings: Settings, root: StorageRoot, host: str, port: int, workers: int) -> list[str]:
    """``mlflow server`` over the root's own store: the SQLite file rounds use without a server (with the
    same lock wait) and the root's artifact directory, so a server started later sees what rounds wrote
    before, and rounds that stop using it later see what they wrote through it."""
    tracking, artifacts = tracking_uris(settings.model_copy(update={"mlflow_uri": None}), root)
    return [
        sys.executable,
        "-m",
        "mlflow",
        "server",
        "--backend-store-uri",
        f"{tracking}?timeout={SQLITE_BUSY_TIMEOUT_S}",
        "--artifacts-destination",
        artifacts,
        "--host",
        host,
        "--port",
        str(port),
        "--workers",
        str(workers),
    ]


def probe_server(tracking: str, timeout_s: float = 5.0) -> None:
    """Fail in seconds when nothing answers at a tracking server: MLflow's own client retries with
    back-off for minutes before it gives up on a refused connection."""
    try:
        urllib.request.urlopen(tracking.rstrip("/") + "/health", timeout=timeout_s).close()
    except urllib.error.HTTPError:
        pass  # something answered; whether it is MLflow, the first real call tells
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", None) or exc
        raise LineageError(
            f"cannot reach MLflow at {tracking} ({reason}); start the tracking server, "
            "or set RLROUNDS_MLFLOW_URI to a reachable one (unset it to use SQLite in the storage root)"
        ) from None


SQLITE_BUSY_TIMEOUT_S = 120


@contextmanager
def _exclusive(lock_path: str) -> Iterator[None]:
    """Hold an exclusive advisory lock on ``lock_path`` (created if needed) for the block."""
    with open(lock_path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@dataclass
class Tracker:
    client: Any
    artifact_location: str
    server: bool = False
    """Talking to an MLflow tracking server (RLROUNDS_MLFLOW_URI=http://...) rather than a SQLite file."""

    @classmethod
    def connect(cls, settings: Settings, root: StorageRoot, must_exist: bool = False) -> Tracker:
        """``must_exist``: for read-only commands, refuse to create an empty SQLite store."""
        logging.getLogger("alembic").setLevel(logging.WARNING)
        tracking, artifacts = tracking_uris(settings, root)
        if settings.s3_endpoint:  # MLflow's S3 artifact store reads its endpoint from this variable only
            os.environ["MLFLOW_S3_ENDPOINT_URL"] = settings.s3_endpoint
        if tracking.startswith("sqlite:///"):
            db = tracking.removeprefix("sqlite:///").split("?", 1)[0]
            if must_exist and not os.path.exists(db):
                raise LineageError(
                    f"no MLflow registry at {db}; run a campaign with this storage root first, "
                    "or set RLROUNDS_MLFLOW_URI to the tracking server the rounds used"
                )
            os.makedirs(os.path.dirname(db) or ".", exist_ok=True)
        if tracking.startswith(("http://", "https://")):
            probe_server(tracking)

        if not tracking.startswith("sqlite:///"):
            try:
                client = MlflowClient(tracking_uri=tracking, registry_uri=tracking)
                client.search_experiments(max_results=1)
            except Exception as exc:
                raise LineageError(
                    f"cannot reach MLflow at {tracking}: {exc}; set RLROUNDS_MLFLOW_URI to a reachable tracking server"
                ) from exc
            return cls(client, artifacts, server=tracking.startswith(("http://", "https://")))
        # Many campaigns, rounds and replays may open one SQLite store at once. MLflow creates and
        # migrates a new store on first use, and two processes migrating together break each other
        # (duplicate tables, half-applied revisions), so one process at a time opens it. Writers then
        # wait up to SQLITE_BUSY_TIMEOUT_S for each other's locks instead of failing at SQLite's 5 s.
        uri = (
            tracking
            if "timeout=" in tracking
            else f"{tracking}{'&' if '?' in tracking else '?'}timeout={SQLITE_BUSY_TIMEOUT_S}"
        )
        try:
            with _exclusive(f"{db}.open-lock"):
                client = MlflowClient(tracking_uri=uri, registry_uri=uri)
                client.search_experiments(max_results=1)
        except Exception as exc:
            raise LineageError(
                f"the MLflow store {db} cannot be opened: {exc}; check that its directory is writable and the file "
                "is an MLflow database, or set RLROUNDS_MLFLOW_URI to a tracking server"
            ) from exc
        return cls(client, artifacts)

    # -- runs -----------------------------------------------------------------------------------

    def experiment_id(self, name: str) -> str:
        exp = self.client.get_experiment_by_name(name)
        if exp is not None:
            return exp.experiment_id
        try:
            return self.client.create_experiment(name, artifact_location=f"{self.artifact_location}/{name}")
        except Exception:  # created concurrently: read it back
            exp = self.client.get_experiment_by_name(name)
            if exp is None:
                raise
            return exp.experiment_id

    def find_run(self, experiment_id: str, tags: dict[str, str]) -> str | None:
        query = " and ".join(f"tags.`{k}` = '{v}'" for k, v in tags.items())
        runs = self.client.search_runs([experiment_id], filter_string=query, max_results=1)
        return runs[0].info.run_id if runs else None

    def ensure_run(self, experiment_id: str, name: str, tags: dict[str, str], parent: str | None = None) -> str:
        """The run carrying ``tags``, created once; a resumed campaign gets the same run back."""
        found = self.find_run(experiment_id, tags)
        if found:
            return found
        all_tags = dict(tags)
        if parent:
            all_tags["mlflow.parentRunId"] = parent
        return self.client.create_run(experiment_id, tags=all_tags, run_name=name).info.run_id

    def log(
        self, run_id: str, metrics: dict[str, float] | None = None, params: dict[str, Any] | None = None, step: int = 0
    ) -> None:
        now = int(time.time() * 1000)
        ms = [Metric(k, float(v), now, step) for k, v in (metrics or {}).items() if v is not None]
        ps = [Param(k, str(v)[:6000]) for k, v in (params or {}).items()]
        for i in range(0, max(len(ms), len(ps)), 500):
            self.client.log_batch(run_id, metrics=ms[i : i + 500], params=ps[i : i + 500])

    def log_dataset(self, run_id: str, name: str, digest: str, source: str, context: str = "training") -> None:
        dataset = Dataset(name=name, digest=digest, source_type="trajectory_store", source=source)
        self.client.log_inputs(
            run_id, datasets=[DatasetInput(dataset, tags=[InputTag("mlflow.data.context", context)])]
        )

    def log_text(self, run_id: str, text: str, artifact_file: str) -> None:
        self.client.log_text(run_id, text, artifact_file)

    def finish(self, run_id: str, status: str = "FINISHED") -> None:
        self.client.set_terminated(run_id, status=status)

    # -- registry -------------------------------------------------------------------------------

    def find_model_version(self, name: str, tags: dict[str, str]) -> str | None:
        query = " and ".join([f"name = '{name}'"] + [f"tags.`{k}` = '{v}'" for k, v in tags.items()])
        found = self.client.search_model_versions(query, max_results=1)
        return str(found[0].version) if found else None

    def register(self, name: str, source: str, run_id: str, tags: dict[str, str]) -> str:
        """Register a checkpoint once: the same (run_id, round) tags return the existing version."""
        existing = self.find_model_version(name, {"run_id": tags["run_id"], "round": tags["round"]})
        if existing:
            return existing
        try:
            self.client.create_registered_model(name, description="rlrounds policy checkpoints")
        except Exception:  # noqa: BLE001 -- already exists
            pass
        missing = [t for t in LINEAGE_TAGS if t not in tags]
        if missing:
            raise LineageError(f"refusing to register {name} without lineage tags: {', '.join(missing)}")
        registered_source = source
        if self.server and "://" not in source:  # see CHECKPOINT_TAG
            registered_source = self.client.get_run(run_id).info.artifact_uri
        mv = self.client.create_model_version(
            name,
            source=registered_source,
            run_id=run_id,
            tags={**{k: str(v) for k, v in tags.items()}, CHECKPOINT_TAG: source},
        )
        return str(mv.version)

    def tag_model_version(self, name: str, version: str, tags: dict[str, Any]) -> None:
        for key, value in tags.items():
            self.client.set_model_version_tag(name, version, key, str(value))

    def model_version(self, name: str, version: str) -> Any:
        return self.client.get_model_version(name, version)

    def registered_version(self, name: str, version: str, where: str = "") -> Any:
        """``model_version``, or a LineageError naming the version (and ``where``, e.g. " in ROOT")."""
        try:
            return self.model_version(name, version)
        except Exception as exc:  # MLflow raises its own error type for a missing version
            raise LineageError(
                f"no registered model version {name}/{version}{where}; list versions with `rlrounds lineage`"
            ) from exc

    def alias_version(self, name: str, alias: str) -> str | None:
        try:
            return str(self.client.get_model_version_by_alias(name, alias).version)
        except Exception:  # noqa: BLE001 -- alias not set yet
            return None

    def set_alias(self, name: str, alias: str, version: str) -> None:
        self.client.set_registered_model_alias(name, alias, version)
