"""Whether a config field is an input is declared once, on the field, and every reader asks the field.

An input shapes what a stage computes: it is part of the round's config hash, of each stage's resume key
(flows/stages.py) and of a campaign's identity (what ``--resume`` must match). A field that changes only how fast
or where a stage computes says ``NotInput``; an input added after campaigns were first recorded says
``AddedInput``, so those campaigns still resume. These tests hold the three readers to the markers, and make a
new field declare itself.
"""

from __future__ import annotations

import flows.config  # noqa: F401 -- defines the campaign's configs
import tasks.config.refilter  # noqa: F401 -- defines the refilter and reverify requests
from flows.config import CampaignConfig
from flows.stages import _canonical
from tasks.config.base import AddedInput, Config, NotInput, marker

FIELDS_BEFORE_MARKERS = frozenset(
    """
    CampaignConfig.experiment CampaignConfig.round CampaignConfig.rounds CampaignConfig.run_id
    CampaignConfig.stop_at_accuracy EvaluateConfig.approval EvaluateConfig.approval_timeout_s
    EvaluateConfig.champion_alias EvaluateConfig.max_tokens EvaluateConfig.serving_dtype EvaluateConfig.serving_engine
    EvaluateConfig.source FilterConfig.drop_zero_variance FilterConfig.epsilon FilterConfig.max_staleness
    FilterConfig.min_scored_per_group FilterConfig.normalize_std FilterConfig.overlong FilterConfig.overlong_buffer
    PolicyConfig.base_model PromptsConfig.chat_template PromptsConfig.history_rounds PromptsConfig.prompt_column
    PromptsConfig.reference_column PromptsConfig.solved_weight PromptsConfig.source PromptsConfig.system_prompt
    PromptsConfig.task PublishConfig.line PublishConfig.model_name PublishConfig.register_base RefilterRequest.filter
    RefilterRequest.regroup RefilterRequest.target_groups RefilterRequest.version RefilterRequest.where
    ReplayRequest.config ReplayRequest.evaluate ReplayRequest.from_model ReplayRequest.model_name
    ReplayRequest.trajectories ReverifyRequest.verify ReverifyRequest.version ReverifyRequest.where
    RolloutConfig.collection RolloutConfig.dtype RolloutConfig.engine RolloutConfig.gpu_memory_utilization
    RolloutConfig.max_batch RolloutConfig.max_prompts_factor RolloutConfig.max_tokens RolloutConfig.partial_rollouts
    RolloutConfig.ray_address RolloutConfig.replicas RolloutConfig.samples_per_prompt RolloutConfig.speculative
    RolloutConfig.stop RolloutConfig.temperature RolloutConfig.tensor_parallel_size RolloutConfig.top_p
    RolloutConfig.update_kv RolloutConfig.verdict_wait_s RoundConfig.device RoundConfig.evaluate RoundConfig.filter
    RoundConfig.mode RoundConfig.overlap_update_after RoundConfig.policy RoundConfig.prompts RoundConfig.publish
    RoundConfig.rollout RoundConfig.seed RoundConfig.train RoundConfig.verify SandboxLimits.cpu_time_s
    SandboxLimits.disk_mib SandboxLimits.max_open_files SandboxLimits.max_output_bytes SandboxLimits.max_processes
    SandboxLimits.memory_mib SandboxLimits.python SandboxLimits.wall_timeout_s
    SimulatedEnvironmentConfig.infra_failure_rate SimulatedEnvironmentConfig.median_latency_s
    SimulatedEnvironmentConfig.p99_over_median SimulatedEnvironmentConfig.seed SpeculativeConfig.enabled
    SpeculativeConfig.history_rounds SpeculativeConfig.k SpeculativeConfig.match_tokens
    SpeculativeConfig.max_index_tokens SpeculativeConfig.min_probability SpeculativeConfig.step_tokens
    TrainConfig.aggregation TrainConfig.clip_high TrainConfig.clip_low TrainConfig.epochs TrainConfig.groups_per_step
    TrainConfig.kl_coef TrainConfig.kl_reference TrainConfig.learning_rate TrainConfig.max_grad_norm TrainConfig.max_kl
    TrainConfig.minibatch_order TrainConfig.precision TrainConfig.recompute_proximal TrainConfig.seed
    TrainConfig.steps_per_round TrainConfig.tis_cap TrainConfig.weight_decay TrainConfig.workers
    VerifyConfig.infra_retries VerifyConfig.infra_retry_budget VerifyConfig.math_timeout_s
    VerifyConfig.max_infra_failure_rate VerifyConfig.on_ray VerifyConfig.sandbox VerifyConfig.simulated_environment
    VerifyConfig.timeout_s VerifyConfig.verifier VerifyConfig.workers
    """.split()
)
"""Every config field that existed when campaigns were first recorded and the markers were introduced: these are
inputs unless marked. A field added since to one of these configs must say what it is (the test below); a config
class added since is reached only through such a field, whose marker covers it."""


def config_classes() -> list[type[Config]]:
    found, todo = [], [Config]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub.__module__.split(".")[0] in ("tasks", "flows"):  # not the test-made configs below
                found.append(sub)
            todo.append(sub)
    return found


def test_a_field_added_since_the_markers_declares_whether_it_is_an_input():
    recorded = {name.split(".")[0] for name in FIELDS_BEFORE_MARKERS}
    undeclared = [
        f"{cls.__name__}.{name}"
        for cls in config_classes()
        if cls.__name__ in recorded
        for name, field in cls.model_fields.items()
        if f"{cls.__name__}.{name}" not in FIELDS_BEFORE_MARKERS
        and not (marker(field, NotInput) or marker(field, AddedInput))
    ]
    assert undeclared == [], (
        f"new config fields {undeclared} must declare whether they are inputs: annotate each with "
        "AddedInput(since=...) when it changes what a stage computes (a campaign recorded before it still resumes "
        "while it is at its default), or NotInput('why') when it changes only how fast or where "
        "(tasks/config/base.py)"
    )


def test_the_walk_finds_the_configs():
    names = {cls.__name__ for cls in config_classes()}
    assert {"RoundConfig", "RolloutConfig", "SpeculativeConfig", "SandboxLimits", "ReplayRequest"} <= names


def variant(**round_changes) -> CampaignConfig:
    return CampaignConfig.model_validate({"round": round_changes})


def readers(config: CampaignConfig) -> tuple[str, dict, dict]:
    """(config hash, identity, the rollout stage's key input for the rollout section)."""
    return config.round.config_hash(), config.identity(), _canonical(config.round.rollout)


def test_a_not_input_changes_no_reader():
    base = readers(variant())
    # speculation emits plain sampling's tokens: out of the hash, the identity and the keys
    assert readers(variant(rollout={"speculative": {"enabled": True, "k": 3}})) == base
    # where it computes, and how much of a GPU: held at the default in the hash and keys, out of the identity
    assert readers(variant(device="cpu")) == base
    assert readers(variant(rollout={"gpu_memory_utilization": 0.2, "tensor_parallel_size": 2})) == base
    # how the update is computed in memory, not what it is
    same_update = variant(train={"max_tokens_per_microbatch": 64, "gradient_checkpointing": True})
    assert readers(same_update)[:2] == base[:2] and _canonical(same_update.round.train) == _canonical(
        variant().round.train
    )


def test_an_input_changes_every_reader():
    base_hash, base_identity, base_key = readers(variant())
    changed_hash, changed_identity, changed_key = readers(variant(rollout={"temperature": 0.7}))
    assert changed_hash != base_hash
    assert changed_identity != base_identity
    assert changed_key != base_key


def test_an_added_input_enters_the_identity_only_away_from_its_default():
    base = variant()
    assert "stop" not in base.identity()["round"]["rollout"]  # a campaign recorded before rollout.stop matches
    assert "workers" not in base.identity()["round"]["train"]
    stopped = variant(rollout={"stop": ["\n"]})
    assert stopped.identity()["round"]["rollout"]["stop"] == ["\n"]
    assert stopped.round.config_hash() != base.round.config_hash()  # and it is an input of the hash throughout
    assert _canonical(base.round.rollout)["stop"] == []


def test_an_input_added_unkeyed_leaves_every_reader_alone_at_its_default():
    base = variant()
    assert "lora" not in _canonical(base.round.train) and "lora" not in base.identity()["round"]["train"]
    lora = variant(train={"lora": {"rank": 8}})
    assert _canonical(lora.round.train)["lora"]["rank"] == 8 and lora.identity()["round"]["train"]["lora"]["rank"] == 8
    assert lora.round.config_hash() != base.round.config_hash()


def test_markers_work_at_any_depth():
    from typing import Annotated

    class Inner(Config):
        fast: Annotated[int, NotInput("speed only")] = 1
        shape: int = 2

    class Outer(Config):
        inner: Inner = Inner()
        later: Annotated[int, AddedInput(since="2026-12")] = 0

    outer = Outer(inner=Inner(fast=9), later=0)
    assert outer.inputs_dump() == {"inner": {"shape": 2}, "later": 0}
    assert outer.identity_dump() == {"inner": {"shape": 2}}
    assert Outer(later=5).identity_dump() == {"inner": {"shape": 2}, "later": 5}
