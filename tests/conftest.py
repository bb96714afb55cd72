"""Test environment: every test gets private homes for Prefect, MLflow and the checkpoint cache.

Suites that run real flows use ``prefect_harness`` (a real Prefect API server on a temporary
database, started once per session with a generous start-up timeout for 2-core machines).
"""

from __future__ import annotations

import os
import tempfile

import pytest

_SESSION_HOME = tempfile.mkdtemp(prefix="rlrounds-tests-")
os.environ.update(
    {
        "PREFECT_HOME": os.path.join(_SESSION_HOME, "prefect"),
        "PREFECT_LOGGING_LEVEL": "WARNING",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "DO_NOT_TRACK": "1",
        "RLROUNDS_CACHE": os.path.join(_SESSION_HOME, "cache"),
        "TRANSFORMERS_VERBOSITY": "error",
        "HF_HUB_OFFLINE": "1",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
)
for var in ("PREFECT_API_URL", "RLROUNDS_STORAGE", "RLROUNDS_MLFLOW_URI", "RLROUNDS_S3_ENDPOINT", "MLFLOW_TRACKING_URI"):
    os.environ.pop(var, None)


@pytest.fixture(scope="session")
def prefect_harness():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=240):
        yield


@pytest.fixture(scope="session")
def tiny_policy_dir(tmp_path_factory) -> str:
    """A randomly initialised tiny Llama with the built-in tokenizer: fast, for engine and loss tests."""
    import torch

    from models.base_policy import BaseRecipe, build_model
    from models.policy import save_policy
    from models.tokenizer import build_char_tokenizer

    torch.manual_seed(0)
    tokenizer = build_char_tokenizer()
    model = build_model(BaseRecipe(hidden_size=32, num_layers=2, intermediate_size=64, num_heads=2), len(tokenizer), tokenizer)
    path = str(tmp_path_factory.mktemp("tiny-policy"))
    save_policy(model, tokenizer, path)
    return path
