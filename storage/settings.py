"""Deployment settings, from the environment (``RLROUNDS_*``), not from a round's config.

Where data lives and where MLflow listens differ per machine, while a round's config should mean
the same thing everywhere; so they are kept apart.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import fsspec
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="RLROUNDS_", extra="ignore")

    storage: str = "./rlrounds-data"
    """Storage root: a local directory or s3://bucket/prefix."""
    mlflow_uri: str | None = None
    """MLflow tracking URI. Default: a SQLite store inside a local storage root."""
    mlflow_artifacts: str | None = None
    """Where MLflow keeps run artifacts. Default: <storage>/mlartifacts."""
    s3_endpoint: str | None = None
    """S3 endpoint URL (a MinIO or moto server); default: the AWS endpoint of the environment."""
    s3_retries: int = Field(5, ge=0)
    """Attempts for transient S3 errors, with exponential back-off."""


def settings() -> Settings:
    return Settings()


@lru_cache(maxsize=8)
def _fs(protocol: str, endpoint: str | None, retries: int) -> Any:
    if protocol == "s3":
        client_kwargs = {"endpoint_url": endpoint} if endpoint else {}
        # Two layers retry transient errors: botocore ("standard" mode: throttling, 5xx, connection
        # errors, with jittered back-off) inside each call, and s3fs around whole calls (timeouts,
        # SlowDown). ``retries`` is an attribute of the s3fs instance, not a constructor argument.
        fs = fsspec.filesystem(
            "s3",
            client_kwargs=client_kwargs,
            config_kwargs={"retries": {"max_attempts": retries + 1, "mode": "standard"}},
        )
        fs.retries = retries + 1
        return fs
    return fsspec.filesystem(protocol)


def filesystem_for(uri: str) -> Any:
    protocol = uri.split("://", 1)[0] if "://" in uri else "file"
    s = settings()
    return _fs(protocol, s.s3_endpoint, s.s3_retries)
