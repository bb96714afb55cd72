"""Round and campaign configuration: one model per stage, composed here, validated at construction.

The flow parameters are these pydantic models, so the Prefect UI renders them as forms and a
config file is checked field by field (unknown fields are errors, not silently ignored).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import textwrap
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, Field, TypeAdapter, ValidationError, field_validator, model_validator

from flows.presets import PresetError, load_preset, overlay
from models.builtin import BUILTIN_SOURCES, BUILTINS
from storage.model_versions import LineageError, parse_model_version
from tasks.config.base import AddedInput, Config, NotInput, field_help
from tasks.config.environment import EpisodeConfig
from tasks.config.evaluate import EvaluateConfig
from tasks.config.filter import FilterConfig
from tasks.config.prompts import PromptsConfig
from tasks.config.publish import PublishConfig
from tasks.config.rollout import RolloutConfig
from tasks.config.train import TrainConfig
from tasks.config.verify import KNOWN_VERIFIERS, VerifyConfig

BUILTIN_BASE = "builtin"
RUN_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


class ConfigError(ValueError):
    pass


class PolicyConfig(Config):
    """The policy a campaign starts from."""

    base_model: str = BUILTIN_BASE
    """'builtin' (the tiny addition Llama, built on first use and cached under the storage root),
    'builtin-longtail' (the same for the long-tailed count-down task) or a local Hugging Face causal-LM directory."""

    @field_validator("base_model")
    @classmethod
    def _exists(cls, v: str) -> str:
        if v not in BUILTINS and "://" not in v and not os.path.isdir(v):
            raise ValueError(
                f"base model directory {v!r} does not exist; set policy.base_model to "
                f"{' or '.join(map(repr, BUILTINS))} or a Hugging Face causal-LM directory"
            )
        return v


class RoundConfig(Config):
    """Everything one round does, stage by stage."""

    policy: PolicyConfig = PolicyConfig()
    """The policy the campaign starts from."""
    prompts: PromptsConfig = PromptsConfig()
    """Where training prompts come from."""
    rollout: RolloutConfig = RolloutConfig()
    """How samples are generated: engine, precision, sampling, replicas."""
    verify: VerifyConfig = VerifyConfig()
    """How finished samples are scored: verifier, its pool, sandbox limits, deadlines."""
    filter: FilterConfig = FilterConfig()
    """How rewards become advantages, and which samples train."""
    train: TrainConfig = TrainConfig()
    """How the policy is updated from one round's trajectories."""
    publish: PublishConfig = PublishConfig()
    """Where checkpoints are registered."""
    evaluate: EvaluateConfig = EvaluateConfig()
    """How published checkpoints are scored, at serving precision."""
    device: Annotated[
        str, NotInput("where it computes: a campaign may resume on another machine", keyed_at_default=True)
    ] = Field("auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$")
    """Where the stages that run torch compute (trainer, embedded engine, evaluation, base build). 'auto': CUDA when
    a GPU is visible, else the CPU; or 'cpu', 'cuda', 'cuda:N'. Checkpoints load on any device."""
    seed: int = 0
    """Seeds prompt order and sampling; a round's seed is derived from it and the round index."""
    mode: Literal["sync", "overlap"] = "sync"
    """'sync': a round's rollout starts once the previous round has trained, published and evaluated. 'overlap':
    round k+1's rollout runs while round k trains and takes round k's weights between two decode steps
    (rollout.update_kv); each token records its policy version."""
    environment: Annotated[str | None, AddedInput(since="2026-12-04", keyed_at_default=False)] = Field(
        None, pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$"
    )
    """Agentic rounds: the environment each sample is an episode in, as 'package.module:Name' (a class or function
    called with the round's tool pool, docs/environments.md), e.g. 'tasks.environments.tooladd:ToolAddEnvironment'.
    The environment scores each episode (verify.verifier is not used). None: a sample is one completion."""
    episode: Annotated[EpisodeConfig, AddedInput(since="2026-12-04", keyed_at_default=False)] = EpisodeConfig()
    """Agentic rounds (environment set): each episode's budgets and the warm pool of tool sandboxes."""
    overlap_update_after: float = Field(0.5, gt=0.0, le=4.0)
    """mode overlap: the next round's rollout takes the new weights after this many times target_groups x
    samples_per_prompt finished samples, waiting for training if it is late. A count, not a time, so rows stay
    reproducible."""

    @property
    def target_groups(self) -> int:
        """Trainable groups a round collects: one minibatch of groups per optimizer step."""
        return self.train.groups_per_step * self.train.steps_per_round

    @property
    def verifier(self) -> str:
        """The verifier's name: verify.verifier, else the prompts' task."""
        return self.verify.verifier or self.prompts.task

    @property
    def agent(self) -> dict:
        """``environment`` and ``episode`` as the stages that run episodes take them (``episode`` None in a
        single-turn round, so their keys are the ones recorded before episodes existed)."""
        return {"environment": self.environment, "episode": self.episode if self.environment is not None else None}

    @property
    def verify_resolved(self) -> VerifyConfig:
        """The verify section with its verifier named (what rollout and evaluation score with)."""
        return self.verify.model_copy(update={"verifier": self.verifier})

    @property
    def publish_resolved(self) -> PublishConfig:
        """The publish section with its promotion line and registered model name filled in: by default one
        line, and one registered model with its own champion, per task and held-out set."""
        return self.publish.resolved(self.prompts.task, self.evaluate.source)

    def config_hash(self) -> str:
        canonical = json.dumps(self.inputs_dump(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    @model_validator(mode="after")
    def _verifier_known(self) -> RoundConfig:
        if self.environment is None and self.verifier not in KNOWN_VERIFIERS:
            raise ValueError(
                f"no verifier named {self.verifier!r}; "
                f"set verify.verifier to one of: {', '.join(sorted(KNOWN_VERIFIERS))}"
            )
        return self

    @model_validator(mode="after")
    def _overlap_supported(self) -> RoundConfig:
        if self.mode != "overlap":
            return self
        if self.rollout.collection != "ready_pool":
            raise ValueError("mode 'overlap' needs rollout.collection 'ready_pool'; set it, or use mode 'sync'")
        if self.rollout.replicas > 1 or self.rollout.ray_address:
            raise ValueError(
                "mode 'overlap' updates the weights of one in-process engine mid-generation; set rollout.replicas "
                "to 1 and leave rollout.ray_address unset, or use mode 'sync'"
            )
        return self

    @model_validator(mode="after")
    def _episodes_supported(self) -> RoundConfig:
        if self.environment is None:
            return self
        unsupported = [
            (self.mode != "sync", "mode 'sync'"),
            (self.rollout.collection != "ready_pool", "rollout.collection 'ready_pool'"),
            (self.rollout.speculative.enabled, "rollout.speculative.enabled false"),
        ]
        needs = [need for bad, need in unsupported if bad]
        if needs:
            raise ValueError(f"episodes (round.environment) run with {', '.join(needs)}; set them or unset environment")
        return self

    @property
    def update_after_samples(self) -> int:
        """mode overlap: finished samples after which the next round's rollout takes the new weights."""
        return max(1, round(self.overlap_update_after * self.target_groups * self.rollout.samples_per_prompt))

    @model_validator(mode="after")
    def _builtin_base_fits_prompts(self) -> RoundConfig:
        base, task = BUILTINS.get(self.policy.base_model), BUILTIN_SOURCES.get(self.prompts.source)
        if base and task and base is not task:  # a built-in tokenizer knows only its own task's characters
            raise ValueError(
                f"policy.base_model {base.base_model!r} cannot read prompts of {task.source!r}; "
                f"set policy.base_model to {task.base_model!r}"
            )
        return self


class CampaignConfig(Config):
    """A campaign: rounds that each start from the previous round's checkpoint."""

    rounds: int = Field(45, ge=1, le=10_000)
    """Rounds to run."""
    run_id: str | None = None
    """Campaign id (directory and MLflow tag). Default: a fresh one. An existing one is continued by
    `rlrounds run --resume RUN_ID` (or by re-running the flow), never started over."""
    experiment: str = "rlrounds"
    """MLflow experiment holding the campaign run and its round runs."""
    stop_at_accuracy: float | None = Field(None, ge=0.0, le=1.0)
    """Stop early once a round's serving-precision held-out accuracy reaches this."""
    round: RoundConfig = RoundConfig()
    """Everything one round does, stage by stage."""

    def identity(self) -> dict:
        """What a resume must match: everything that shapes a round (``Config.identity_dump``). The round count and
        the stopping rule may change, so a finished campaign can be extended with `--resume RUN_ID --rounds N`."""
        return {"experiment": self.experiment, "round": self.round.identity_dump()}

    @field_validator("run_id")
    @classmethod
    def _run_id_safe(cls, v: str | None) -> str | None:
        if v is not None and not RUN_ID_PATTERN.match(v):
            raise ValueError(
                f"run_id {v!r} must be 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit"
            )
        return v


class ReplayRequest(Config):
    """What to replay, from where, with which config."""

    trajectories: str
    """Trajectory version id (or a unique prefix of at least 6 characters): a round's own or a derived one."""
    from_model: str
    """Registered model version to start from, 'NAME/VERSION'; its source is the checkpoint trained on."""
    config: RoundConfig | None = None
    """Round config whose train, prompts and evaluate sections the replay uses. Default: the training
    config recorded with the trajectories' round, and the default evaluation."""
    model_name: str | None = None
    """Registered model name for the result. Default: the parent's name."""
    evaluate: bool = True
    """Evaluate the replayed checkpoint (eval.* tags on its model version; the champion alias never moves)."""

    @field_validator("from_model")
    @classmethod
    def _name_slash_version(cls, v: str) -> str:
        try:
            parse_model_version(v)
        except LineageError:
            raise ValueError(
                f"from_model {v!r} must be a registered model version NAME/VERSION, e.g. rlrounds-addition/3"
            ) from None
        return v


def load_campaign_config(path: str | None, preset: str | None = None, **overrides) -> CampaignConfig:
    """Read a preset and a YAML/JSON config file (either, both or none; the file is laid over the preset,
    flows/presets.py) and apply CLI overrides; errors name the field and the fix."""
    data: dict = {}
    if path:
        if not os.path.exists(path):
            raise ConfigError(f"config file {path} does not exist; pass an existing YAML or JSON file with --config")
        with open(path) as f:
            text = f.read()
        try:
            if path.endswith(".json"):
                data = json.loads(text)
            else:
                data = yaml.safe_load(text) or {}
        except Exception as exc:  # noqa: BLE001 -- any parse error is the file's
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ConfigError(
                f"config file {path} is not valid {'JSON' if path.endswith('.json') else 'YAML'}: {first}"
            ) from None
        if not isinstance(data, dict):
            raise ConfigError(
                f"config file {path} must hold a mapping of fields (rounds, round: {{...}}), not {type(data).__name__}"
            )
    if preset:
        try:
            data = overlay(load_preset(preset), data)
        except PresetError as exc:
            raise ConfigError(str(exc)) from None
    for key, value in overrides.items():
        if value is not None:
            data[key] = value
    try:
        return CampaignConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(describe_validation_error(exc, path)) from None


def describe_validation_error(exc: ValidationError, path: str | None, model: type[BaseModel] = CampaignConfig) -> str:
    """The first error as one line: where, pydantic's message, and the field's help (its docstring).

    A validator's own message already names the fix, so only pydantic's built-in messages ("Input
    should be greater than or equal to 2") get the help appended."""
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err["loc"]) or "config"
    source = f"{path}: " if path else ""
    if err["type"] == "extra_forbidden":
        return f"{source}unknown field {where!r}; remove it or check its spelling against `rlrounds config`"
    msg = err["msg"].removeprefix("Value error, ")
    help_text = field_help(model, tuple(err["loc"])) if err["type"] != "value_error" else None
    if help_text:
        msg = f"{msg} — {help_text}"
    more = f" (and {len(exc.errors()) - 1} more)" if len(exc.errors()) > 1 else ""
    return f"{source}{where}: {msg}{more}"


def commented_yaml(config: BaseModel, indent: int = 0) -> str:
    """``config`` as YAML with each field's docstring as a comment above it (``rlrounds config``).

    Loading the text gives back the same values; the comments are the help a config file's reader needs."""
    pad = " " * indent
    lines: list[str] = []
    for name, field in type(config).model_fields.items():
        if field.description:
            text = " ".join(field.description.split())
            lines += [f"{pad}# {line}" for line in textwrap.wrap(text, width=max(40, 100 - indent))]
        value: Any = getattr(config, name)
        if isinstance(value, BaseModel):
            lines.append(f"{pad}{name}:")
            lines.append(commented_yaml(value, indent + 2).rstrip("\n"))
        else:
            dumped = yaml.safe_dump({name: _plain(value)}, sort_keys=False, default_flow_style=False).rstrip("\n")
            lines += [f"{pad}{line}" for line in dumped.splitlines()]
    return "\n".join(lines) + "\n"


def _plain(value: Any) -> Any:
    """A field value as YAML can write it (enums and other JSON-mode values by their JSON form)."""
    return TypeAdapter(type(value)).dump_python(value, mode="json") if value is not None else None
