"""Evaluation of a registered model version as a Prefect flow: the held-out set at the precision and on
the engine the policy will be served with, and at training precision, both and their gap tagged on the
model version (``rlrounds eval NAME/VERSION [--engine vllm] [--dtype bfloat16]``).

Rounds evaluate their own checkpoint already (tasks/evaluate.run_evaluate, which also applies the
champion gate); this flow re-scores any version later, e.g. at a serving precision the campaign did
not use. It never moves the champion alias: its figures may come from another engine or dtype than
the champion's, and promotion compares like with like.
"""

from __future__ import annotations

from typing import Literal

from prefect import flow

from flows.config import RoundConfig
from flows.tasks import evaluate_version_task
from storage.settings import settings
from tasks.config.base import Dtype
from tasks.config.evaluate import EvaluateConfig
from tasks.round.results import VersionEvaluation
from tasks.serving.live import LiveEngines

TRAIN_DTYPE = "float32"  # the trainer always works in float32 (tasks/train/stage.py, run_train)


@flow(name="rl-evaluate", flow_run_name="evaluate-{model_version}", validate_parameters=True)
def rl_evaluate(
    model_version: str,
    config: RoundConfig | None = None,
    serving_engine: Literal["embedded", "vllm"] | None = None,
    serving_dtype: Dtype | None = None,
    storage: str | None = None,
) -> VersionEvaluation:
    """Score a registered model version at a serving engine and precision, and at training precision.

    Args:
        model_version: The registered model version to score, NAME/VERSION (e.g. rlrounds-addition/3).
        config: Round config whose evaluate, prompts and verify sections apply. Default: the defaults.
        serving_engine: Serving engine, overriding config.evaluate.serving_engine.
        serving_dtype: Serving precision, overriding config.evaluate.serving_dtype.
        storage: Storage root the rounds ran on. Default: $RLROUNDS_STORAGE.
    """
    storage = storage or settings().storage
    rc = config or RoundConfig()
    overrides = {k: v for k, v in (("serving_engine", serving_engine), ("serving_dtype", serving_dtype)) if v}
    evaluate = EvaluateConfig.model_validate({**rc.evaluate.model_dump(), **overrides})
    with LiveEngines() as engines:  # an engine this evaluation starts does not outlive it
        return evaluate_version_task(
            storage=storage,
            model_version=model_version,
            config=evaluate,
            prompts=rc.prompts,
            verify=rc.verify_resolved,
            train_dtype=TRAIN_DTYPE,
            engines=engines,
            device=rc.device,
            **rc.agent,
        )
