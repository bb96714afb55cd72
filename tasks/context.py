"""What a stage needs to know about the round it runs in: identities and URIs, nothing heavy."""

from __future__ import annotations

import hashlib

from pydantic import BaseModel, ConfigDict


class RoundContext(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

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

    def stage_seed(self, stage: str) -> int:
        """A seed per (campaign seed, round, stage): rounds never reuse each other's randomness."""
        digest = hashlib.blake2b(f"{self.seed}/{self.round}/{stage}".encode(), digest_size=4).digest()
        return int.from_bytes(digest, "little")
