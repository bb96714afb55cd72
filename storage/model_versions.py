"""References to registered model versions (NAME/VERSION) and the error a lineage walk raises.

Apart from storage/tracking.py so that a config can check a reference without importing MLflow.
"""

from __future__ import annotations


class LineageError(RuntimeError):
    pass


def parse_model_version(ref: str) -> tuple[str, str]:
    """'NAME/VERSION' -> (name, version); the one parser of a registered model version reference."""
    name, sep, version = ref.rpartition("/")
    if not sep or not name or not version.isdigit():
        raise LineageError(f"model version {ref!r} must look like NAME/VERSION, e.g. rlrounds-addition/3")
    return name, version
