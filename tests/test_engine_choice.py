"""Pure pieces of engine choice that need neither vLLM nor Ray: config, placement, per-token policy
versions from vLLM's weight-version spans, the prompt -> replica hash, and when the truncated
importance-sampling correction is switched on."""

from dataclasses import dataclass

import pytest

from models.engines.replicas import replica_for
from models.engines.vllm_engine import token_versions
from tasks.serving.engines import Placement
from tasks.train.policy_update import needs_proximal


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


# -- vLLM on GPUs: sizing, the NCCL group's ranks, weights handed over in memory


@pytest.mark.parametrize(
    "share, tp, expected",
    [
        (0.45, 1, {"gpu_memory_utilization": 0.45, "tensor_parallel_size": 1}),  # the default: one engine-core worker
        (0.8, 2, {"gpu_memory_utilization": 0.8, "tensor_parallel_size": 2, "distributed_executor_backend": "mp"}),
    ],
)
def test_vllm_gpu_sizing_comes_from_config(monkeypatch, share, tp, expected):
    from models.engines.vllm_engine import default_engine_args

    monkeypatch.delenv("RLROUNDS_VLLM_ARGS", raising=False)
    assert default_engine_args(False, share, tp) == expected
    assert "gpu_memory_utilization" not in default_engine_args(True, share, tp)  # the CPU build sizes by bytes


@pytest.mark.parametrize(
    "workers, expected",
    [
        ([1], [0]),  # one replica: its worker follows the trainer (rank 1)
        ([1, 1, 1], [0, 1, 2]),  # three single-GPU replicas: ranks 1, 2, 3
        ([2, 4], [0, 2]),  # tensor-parallel replicas: ranks 1-2, then 3-6
    ],
)
def test_replica_rank_offsets(workers, expected):
    from models.engines.replicas import rank_offsets

    assert rank_offsets(workers) == expected


def test_offered_weights_are_handed_out_once_and_only_for_their_checkpoint():
    from tasks.serving.live import LiveEngines

    engines = LiveEngines()
    weights = {"w": object()}
    engines.offer_weights("root/ckpt-r1", weights)
    assert engines.take_offered("root/ckpt-r0") is None  # another checkpoint: read its files
    assert engines.take_offered("root/ckpt-r1") is weights
    assert engines.take_offered("root/ckpt-r1") is None  # used once
    engines.offer_weights("root/ckpt-r1", weights)
    engines.offer_weights("root/ckpt-r2", {})  # a newer offer releases the older one
    assert engines.take_offered("root/ckpt-r1") is None
    engines.offer_weights("root/ckpt-r3", weights)
    engines.close()  # the flow's end releases an offer nobody took
    assert engines.take_offered("root/ckpt-r3") is None


@pytest.mark.parametrize(
    "trainer, replicas, shared",
    [
        (["GPU-a"], [["GPU-b"], ["GPU-c"]], False),  # the trainer's GPU kept out of the replicas': NCCL push
        (["GPU-a"], [["GPU-a"], ["GPU-b"]], True),  # Ray gave replica 0 the trainer's GPU: reload the checkpoint
        (["GPU-a"], [["GPU-b", "GPU-a"]], True),  # a tensor-parallel replica seeing it among others
        (["GPU-a"], [[], []], False),  # replicas on CPUs see no GPU
    ],
)
def test_weights_go_over_nccl_only_from_a_gpu_no_replica_holds(trainer, replicas, shared):
    from models.engines.replicas import shares_a_gpu

    assert shares_a_gpu(trainer, replicas) is shared


def test_overlap_mode_publish_releases_the_offered_weights(monkeypatch, tmp_path):
    """Overlap mode: publish does not load the engine (the running rollout reads the checkpoint), and the trainer's
    offered weights are dropped there, not kept until the next round's offer."""
    from tasks.config.publish import PublishConfig
    from tasks.publish import stage
    from tasks.round.context import RoundContext
    from tasks.serving.live import LiveEngines

    class Registry:
        def log_dataset(self, *args):
            pass

        def register(self, *args):
            return "1"

    monkeypatch.setattr(stage.Tracker, "connect", classmethod(lambda cls, *args: Registry()))
    monkeypatch.setattr(stage.checkpoints, "read_lineage", lambda root, uri: {})
    ctx = RoundContext(
        storage=str(tmp_path), run_id="r", round=1, experiment="e", parent_checkpoint="p", parent_policy_version=0,
        parent_model_version="none", base_model="tiny", config_hash="h", code_version="test", flow_run_id="none",
        mlflow_run_id="m", seed=0,
    )  # fmt: skip
    with LiveEngines() as engines:
        engines.offer_weights("root/ckpt-r1", {"w": object()})
        stage.run_publish(
            ctx=ctx, config=PublishConfig(model_name="m", line="l"), checkpoint="root/ckpt-r1",
            trajectory_version="v", trajectory_uri="u", committed_at=None, engine="vllm", engine_dtype="bfloat16",
            max_batch=8, engines=engines, load_engine=False,
        )  # fmt: skip
        assert engines.take_offered("root/ckpt-r1") is None, "the offer outlived its publish"


def test_a_vllm_engine_starts_on_released_gpu_memory(monkeypatch, tiny_policy_dir):
    """Before a vLLM engine is built (a second one, or one replacing another), torch's cached GPU memory is
    returned; an embedded engine needs no room made for it."""
    from tasks.serving import live

    released: list[str] = []
    monkeypatch.setattr(live, "release_cached_memory", lambda: released.append("released"))
    monkeypatch.setattr(live, "make_engine", lambda *a, **k: (_Receiver(False), None))
    with live.LiveEngines() as engines:
        engines.serve("embedded", tiny_policy_dir, dtype="float32", policy_version=0)
        assert released == []
        engines.serve("vllm", tiny_policy_dir, dtype="float32", policy_version=0, role="evaluate")
        assert released == ["released"]


class _Receiver:
    """An engine that takes weights from memory, recording how each version arrived."""

    def __init__(self, from_memory: bool):
        self.weights_from_memory = from_memory
        self.policy_version = 0
        self.arrived: list[tuple[str, int]] = []

    def configure(self, max_batch, update_kv):
        pass

    def load_weights(self, checkpoint_dir, policy_version):
        self.arrived.append(("checkpoint", policy_version))
        self.policy_version = policy_version
        return 0.5

    def push_weights(self, weights, policy_version):
        self.arrived.append(("memory", policy_version))
        self.policy_version = policy_version
        return 0.25

    def close(self):
        pass


@pytest.mark.parametrize(
    "from_memory, offered, expected",
    [
        (True, True, ("memory", 0.25)),  # vLLM on a GPU, weights offered: pushed
        (True, False, ("checkpoint", 0.5)),  # nothing offered (a resumed round): the checkpoint reloads
        (False, True, ("checkpoint", 0.5)),  # on a CPU: the checkpoint reloads, as before
    ],
)
def test_a_live_engine_takes_offered_weights_only_when_it_can(
    monkeypatch, tiny_policy_dir, from_memory, offered, expected
):
    from tasks.serving import live

    engine = _Receiver(from_memory)
    monkeypatch.setattr(live, "make_engine", lambda *a, **k: (engine, None))
    with live.LiveEngines() as engines:
        engines.serve("vllm", tiny_policy_dir, dtype="float32", policy_version=0)
        weights = {"w": None} if offered else None
        _, _, pause = engines.serve("vllm", tiny_policy_dir, dtype="float32", policy_version=1, weights=weights)
        assert (engine.arrived[-1][0], pause) == expected and engine.policy_version == 1


def test_gpu_sizing_is_placement_not_identity():
    from flows.config import CampaignConfig

    default = CampaignConfig()
    sized = CampaignConfig.model_validate(
        {"round": {"rollout": {"gpu_memory_utilization": 0.8, "tensor_parallel_size": 2}}}
    )
    assert sized.identity() == default.identity()  # a campaign may resume with another GPU share or TP
