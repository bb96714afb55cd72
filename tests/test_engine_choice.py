"""Pure pieces of engine choice that need neither vLLM nor Ray: config, placement, per-token policy
versions from vLLM's weight-version spans, the prompt -> replica hash, and when the truncated
importance-sampling correction is switched on."""

from dataclasses import dataclass

import pytest

from models.engines.replicas import replica_for
from models.engines.vllm_engine import token_versions
from tasks.engines import Placement
from tasks.update import needs_proximal


@dataclass
class Span:  # the shape of vllm.outputs.WeightVersionSpan
    version: str
    start: int
    end: int


@pytest.mark.parametrize(
    "spans, length, fallback, expected",
    [
        ([Span("3", 0, 4)], 4, 0, [3, 3, 3, 3]),  # one version throughout
        ([Span("3", 0, 2), Span("4", 2, 5)], 5, 0, [3, 3, 4, 4, 4]),  # a weight update mid-sample
        ([Span("default", 0, 3)], 3, 7, [7, 7, 7]),  # a label that is not a version: the admitted version
        (None, 2, 1, [1, 1]),  # no spans reported
        ([Span("2", 0, 9)], 3, 0, [2, 2, 2]),  # a span past the end is clipped
    ],
)
def test_token_versions(spans, length, fallback, expected):
    assert token_versions(spans, length, fallback) == expected


@pytest.mark.parametrize(
    "setting, dtype, engines, expected",
    [
        ("auto", "float32", [{"name": "embedded", "dtype": "float32"}], False),  # engine == trainer to ~1e-6
        ("auto", "float32", [{"name": "vllm", "dtype": "float32"}], True),  # other kernels: correct for them
        ("auto", "bfloat16", [{"name": "embedded", "dtype": "bfloat16"}], True),  # lower precision
        ("auto", "float32", [{"name": "embedded", "dtype": "float32"}, {"name": "vllm", "dtype": "float32"}], True),
        ("never", "bfloat16", [{"name": "vllm", "dtype": "bfloat16"}], False),
        ("always", "float32", [{"name": "embedded", "dtype": "float32"}], True),
        ("auto", "float32", [None], False),  # rows without engine identity: the config decides
    ],
)
def test_needs_proximal(setting, dtype, engines, expected):
    assert needs_proximal(setting, dtype, engines) is expected


def test_placement_uses_ray_for_replicas_or_an_address():
    assert not Placement().uses_ray
    assert Placement(replicas=2).uses_ray and Placement(ray_address="auto").uses_ray


def test_replica_hash_is_stable_and_spreads_prompts():
    assert replica_for((1, 5, 14, 6, 15), 4) == replica_for((1, 5, 14, 6, 15), 4)
    assert len({replica_for((1, a, 14, b, 15), 4) for a in range(4, 14) for b in range(4, 14)}) == 4


def test_config_takes_vllm_and_replicas_and_names_bad_values():
    from flows.config import ConfigError, load_campaign_config

    config = load_campaign_config(
        None,
        round={
            "rollout": {"engine": "vllm", "replicas": 2, "ray_address": "auto"},
            "evaluate": {"serving_engine": "vllm", "serving_dtype": "bfloat16"},
        },
    )
    assert config.round.rollout.engine == "vllm" and config.round.rollout.replicas == 2
    with pytest.raises(ConfigError, match="round.rollout.engine"):
        load_campaign_config(None, round={"rollout": {"engine": "sglang"}})
    with pytest.raises(ConfigError, match="serving_dtype"):
        load_campaign_config(None, round={"evaluate": {"serving_dtype": "fp8"}})
