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
_BASE_ROOT = os.environ.pop("RLROUNDS_TEST_BASE_ROOT", None)
for var in (
    "PREFECT_API_URL",
    "RLROUNDS_STORAGE",
    "RLROUNDS_MLFLOW_URI",
    "RLROUNDS_S3_ENDPOINT",
    "MLFLOW_TRACKING_URI",
):
    os.environ.pop(var, None)


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` skip, saying why, where torch sees no CUDA device (torch is imported only if any are
    collected)."""
    gpu = [item for item in items if "gpu" in item.keywords]
    if not gpu:
        return
    import torch

    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason=f"needs a CUDA device; torch {torch.__version__} sees none here")
        for item in gpu:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def prefect_harness():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=240):
        yield


@pytest.fixture(scope="session")
def tiny_policy_dir(tmp_path_factory) -> str:
    """A randomly initialised tiny Llama with the built-in tokenizer: fast, for engine and loss tests."""
    import torch

    from models.builtin.base_policy import BaseRecipe, build_model
    from models.builtin.tokenizer import build_char_tokenizer
    from models.checkpoint import save_policy

    torch.manual_seed(0)
    tokenizer = build_char_tokenizer()
    model = build_model(
        BaseRecipe(hidden_size=32, num_layers=2, intermediate_size=64, num_heads=2), len(tokenizer), tokenizer
    )
    path = str(tmp_path_factory.mktemp("tiny-policy"))
    save_policy(model, tokenizer, path)
    return path


# -- shared fixtures for the data suites (refilter, replay, lineage, S3) -----------------------------


@pytest.fixture(scope="session")
def seed_builtin_base(tmp_path_factory):
    """A function that commits the built-in base policy into a storage root, as if built there.

    The base recipe takes a minute or more on 2 cores; it is built once per session (by the same code a
    campaign uses) and each suite's root, local or S3, gets a committed copy through the checkpoint
    store, so its campaign finds the base cached instead of building it again.
    RLROUNDS_TEST_BASE_ROOT may name a local root to build it in and keep between sessions.
    """
    from storage import checkpoints
    from storage.paths import StorageRoot
    from tasks.campaign.base_policy import run_prepare_base

    build_root = _BASE_ROOT or str(tmp_path_factory.mktemp("base-build") / "data")
    built = run_prepare_base(storage=build_root, base_model="builtin")  # builds only if that root has no committed base
    source_root = StorageRoot.of(built.checkpoint)
    lineage = checkpoints.read_lineage(source_root, built.checkpoint)

    def seed(storage: str) -> str:
        root = StorageRoot.of(storage)
        target = root.base_policy(built.base_model)
        return checkpoints.commit_checkpoint(root, built.checkpoint, target, lineage)

    return seed


TINY_CAMPAIGN = {
    "rounds": 3,
    "run_id": "tiny",
    "round": {"train": {"groups_per_step": 2, "steps_per_round": 2}, "publish": {"model_name": "tiny-policy"}},
}


@pytest.fixture(scope="session")
def tiny_campaign(prefect_harness, seed_builtin_base, tmp_path_factory) -> dict:
    """One real 3-round campaign on a local root, shared by the refilter, replay and lineage suites.

    Model versions: tiny-policy/1 is the base (round 0), tiny-policy/2..4 are rounds 1..3.
    """
    import json

    from flows.campaign import rl_campaign
    from flows.config import CampaignConfig

    home = tmp_path_factory.mktemp("tiny-campaign")
    storage = str(home / "data")
    seed_builtin_base(storage)
    config_file = home / "campaign.json"
    config_file.write_text(json.dumps(TINY_CAMPAIGN))
    result = rl_campaign(CampaignConfig.model_validate(TINY_CAMPAIGN), storage=storage)
    return {"storage": storage, "result": result, "config_file": str(config_file), "config": TINY_CAMPAIGN}


@pytest.fixture(scope="session")
def s3_endpoint():
    """A local moto S3 server (a real HTTP server, started for this session) with bucket ``rlrounds-test``.

    Sets RLROUNDS_S3_ENDPOINT and dummy AWS credentials for the session; restores them afterwards.
    """
    import logging
    import socket

    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    env = {
        "RLROUNDS_S3_ENDPOINT": endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_SESSION_TOKEN": None,
        "AWS_PROFILE": None,
    }
    saved = {k: os.environ.get(k) for k in env}
    _set_env(env)
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket="rlrounds-test")
    try:
        yield endpoint
    finally:
        server.stop()
        _set_env(saved)


def _set_env(values: dict) -> None:
    for key, value in values.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="session")
def chat_policy_dir(tmp_path_factory) -> str:
    """The worked example's own model (models/builtin/chat_example.py): a tiny Qwen2, byte-level BPE, a chat
    template, two end-of-sequence ids and a distinct pad; built once a session (seconds)."""
    from models.builtin.chat_example import build_chat_policy

    path = str(tmp_path_factory.mktemp("chat-policy"))
    build_chat_policy(path)
    return path
