"""The evaluate section: how published checkpoints are scored at serving precision, and who promotes them."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from tasks.config.base import Config, Dtype


class EvaluateConfig(Config):
    """How published checkpoints are scored."""

    source: str | None = None
    """Held-out prompts (.jsonl/.parquet). Default: the built-in task's fixed 500 held-out prompts."""
    serving_engine: Literal["embedded", "vllm"] = "embedded"
    """Engine the policy is served with ('embedded' or 'vllm'); accuracy on it gates promotion."""
    serving_dtype: Dtype = "bfloat16"
    """Precision the policy is served at; accuracy at it gates promotion. bfloat16 by default, so it is
    tested at the precision it would be served with, not only at training precision. 'auto': bfloat16 on a GPU,
    float32 on the CPU."""
    max_tokens: int = Field(8, ge=1)
    """Most new tokens per greedy answer."""
    champion_alias: str = "champion"
    """Registry alias moved to a checkpoint whose serving accuracy is not below the current champion's."""
    approval: Literal["none", "required"] = "none"
    """Who moves the champion alias once a checkpoint passes the gate. 'none': the round. 'required': the round
    pauses after evaluation, shows its accuracy beside the champion's, and waits for a person to approve or reject
    it in the Prefect UI."""
    approval_timeout_s: int = Field(86_400, ge=1)
    """How long a round waits for an approval; no answer by then rejects the checkpoint."""
