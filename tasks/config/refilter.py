"""What re-filtering and re-verification of a stored trajectory version take: which rows, and how."""

from __future__ import annotations

from pydantic import Field

from tasks.config.base import Config
from tasks.config.filter import FilterConfig
from tasks.config.verify import VerifyConfig


class RefilterRequest(Config):
    """Which version to re-filter, and how."""

    version: str
    """Trajectory version id (or a unique prefix of at least 6 characters) to select rows from."""
    where: str
    """DuckDB SQL predicate over the trajectory columns, e.g.
    "len(completion_token_ids) <= 4 AND outcome <> 'infra_failure'"."""
    regroup: bool = False
    """Recompute advantages over the rows left in each group and re-drop groups without signal."""
    filter: FilterConfig | None = None
    """Rules for regrouping. Default: the rules recorded by the round that produced the rows."""
    target_groups: int | None = Field(None, ge=1)
    """With regroup: keep only the first N trainable groups (later ones are marked batch_full). Default: all."""


REVERIFY_DEFAULT_WHERE = "outcome = 'infra_failure'"


class ReverifyRequest(Config):
    """Which rows of a version to score again, once the environment that failed them is fixed."""

    version: str
    """Trajectory version id (or a unique prefix of at least 6 characters)."""
    where: str = REVERIFY_DEFAULT_WHERE
    """DuckDB SQL predicate choosing the rows to verify again; default: the infrastructure failures."""
    verify: VerifyConfig = Field(default_factory=VerifyConfig)
    """How the rows are scored: the verifier's workers, retries, deadlines and sandbox limits.
    ``verify.verifier`` defaults to the one recorded on the selected rows (they must name one)."""
