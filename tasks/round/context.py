"""What a stage needs to know about the round it runs in: identities and URIs, nothing heavy."""

from __future__ import annotations

import hashlib
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict


class RoundContext(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    PER_PROCESS: ClassVar[frozenset[str]] = frozenset({"flow_run_id", "code_version", "mlflow_run_id", "storage"})
    """Not what a stage was asked to do: a resume may run other code (a bug fix) in another Prefect flow
    run, the MLflow run is found again by its tags, and the storage root is where the records live."""

    storage: str
    """Storage root URI."""
    run_id: str
    round: int
    experiment: str
    parent_checkpoint: str
    """URI of the committed checkpoint this round starts from."""
    parent_policy_version: int
    """Policy version of the parent (its round index; 0 is the base)."""
    parent_model_version: str
    """Registered model version of the parent ('NAME/VERSION')."""
    base_model: str
    config_hash: str
    code_version: str
    flow_run_id: str
    mlflow_run_id: str
    seed: int

    def inputs(self) -> dict[str, Any]:
        """The round's identity as a stage input (its resume key), without the per-process fields."""
        return self.model_dump(mode="json", exclude=set(self.PER_PROCESS))

    def stage_seed(self, stage: str) -> int:
        """A seed per (campaign seed, round, stage): rounds never reuse each other's randomness."""
        digest = hashlib.blake2b(f"{self.seed}/{self.round}/{stage}".encode(), digest_size=4).digest()
        return int.from_bytes(digest, "little")
