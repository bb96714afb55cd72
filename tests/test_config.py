"""Config errors say what is wrong and what to set instead; the CLI turns them into one line."""

import json

import pytest

from flows.cli import main
from flows.config import CampaignConfig, ConfigError, load_campaign_config


def test_defaults_are_valid_and_consistent():
    c = CampaignConfig()
    assert c.round.target_groups == c.round.train.groups_per_step * c.round.train.steps_per_round
    assert len(c.round.config_hash()) == 16


@pytest.mark.parametrize(
    "content, fragment",
    [
        ({"round": {"train": {"learning_rate": -1}}}, "round.train.learning_rate"),  # out of range: names the field
        ({"round": {"trian": {}}}, "unknown field 'round.trian'"),  # a typo is an error, never ignored
        ({"rounds": 0}, "rounds"),  # at least one round
        ({"round": {"rollout": {"samples_per_prompt": 1}}}, "samples_per_prompt"),  # GRPO needs >= 2 samples
        ({"round": {"policy": {"base_model": "/no/such/dir"}}}, "does not exist"),  # missing base model path
        ({"round": {"rollout": {"dtype": "float8"}}}, "float32, bfloat16 or float16"),  # says what to use
        ({"run_id": "../escape"}, "run_id"),  # ids become directory names
        ({"round": {"verify": {"verifier": "nope"}}}, "one of: addition"),  # lists the verifiers that exist
    ],
)
def test_bad_config_errors(tmp_path, content, fragment):
    path = tmp_path / "c.json"
    path.write_text(json.dumps(content))
    with pytest.raises(ConfigError, match=None) as err:
        load_campaign_config(str(path))
    assert fragment in str(err.value)


def test_malformed_yaml_names_the_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("rounds: [1,\n")
    with pytest.raises(ConfigError, match="c.yaml is not valid YAML"):
        load_campaign_config(str(path))


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--config", "/no/such.yaml"], "does not exist"),
        (["--rounds", "0"], "rounds"),
        (["--storage", "/proc/rlrounds-not-writable"], "not writable"),
    ],
)
def test_cli_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys, args, fragment):
    storage = tmp_path / "data"
    argv = ["run", *args] if "--storage" in args else ["run", "--storage", str(storage), *args]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and fragment in err[0]
    assert not storage.exists()


def test_cli_help_is_fast_and_lists_commands(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    assert "run" in capsys.readouterr().out


# -- each field's docstring is its help, wherever people meet the field ---------------------------------


def test_an_out_of_range_value_gets_the_fields_help_appended(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"round": {"rollout": {"samples_per_prompt": 1}}}))
    with pytest.raises(ConfigError) as err:
        load_campaign_config(str(path))
    assert str(err.value).endswith(
        "round.rollout.samples_per_prompt: Input should be greater than or equal to 2 \u2014 "
        "Samples per group. GRPO compares samples of one prompt, so at least 2."
    )


def test_a_validators_own_message_is_not_repeated_with_help(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"round": {"publish": {"model_name": "a/b"}}}))
    with pytest.raises(ConfigError) as err:
        load_campaign_config(str(path))
    assert "\u2014" not in str(err.value)  # "must be non-empty without '/'" already says what to set


def test_a_precision_is_one_of_three_choices_or_auto():
    with pytest.raises(ConfigError) as err:
        load_campaign_config(None, round={"rollout": {"dtype": "float8"}})
    assert "round.rollout.dtype: Input should be 'float32', 'bfloat16', 'float16' or 'auto'" in str(err.value)


def test_help_reaches_nested_and_optional_models():
    from flows.config import ReplayRequest
    from tasks.config.base import field_help

    sandbox_memory = field_help(CampaignConfig, ("round", "verify", "sandbox", "memory_mib"))
    assert sandbox_memory.startswith("RLIMIT_AS of each process")
    assert field_help(ReplayRequest, ("config", "train", "learning_rate")).startswith("AdamW learning rate")
    assert field_help(CampaignConfig, ("round", "nope")) is None


def test_every_config_field_is_documented_in_the_json_schema_prefect_renders():
    """Prefect builds a flow's form from its parameters' JSON schema: the docstrings are its field help."""
    from prefect.utilities.callables import parameter_schema

    from flows.campaign import rl_campaign

    schema = parameter_schema(rl_campaign).model_dump_for_openapi()
    rollout = schema["definitions"]["RolloutConfig"]["properties"]
    assert rollout["samples_per_prompt"]["description"].startswith("Samples per group. GRPO compares samples")

    def described(prop: dict) -> bool:  # a nested model's field shares its model's docstring when they are equal
        ref = prop.get("$ref", "").rpartition("/")[2]
        return bool(prop.get("description") or schema["definitions"].get(ref, {}).get("description"))

    undocumented = [
        f"{name}.{field}"
        for name, definition in schema["definitions"].items()
        for field, prop in definition.get("properties", {}).items()
        if not described(prop)
    ]
    assert undocumented == []


def test_rlrounds_config_prints_each_fields_help_and_loads_back(capsys):
    import yaml

    assert main(["config"]) == 0
    text = capsys.readouterr().out
    assert "  rollout:\n" in text
    assert "    # Samples per group. GRPO compares samples of one prompt, so at least 2.\n" in text
    assert "    samples_per_prompt: 4\n" in text
    assert CampaignConfig.model_validate(yaml.safe_load(text)) == CampaignConfig()  # the comments change nothing


def config_models() -> list[type]:
    """Every config model: the campaign's sections and the replay, re-filter and re-verify requests."""
    from flows.config import ReplayRequest
    from tasks.config.base import model_in
    from tasks.config.refilter import RefilterRequest, ReverifyRequest

    found: list[type] = []
    todo = [CampaignConfig, ReplayRequest, RefilterRequest, ReverifyRequest]
    while todo:
        model = todo.pop()
        if model not in found:
            found.append(model)
            todo += [inner for f in model.model_fields.values() if (inner := model_in(f.annotation))]
    return found


def test_every_field_says_what_it_does_in_at_most_40_words():
    """Field help is what a field does; measurements go to the performance notes (docs/)."""
    models = config_models()
    assert len(models) >= 14  # the walk reached the nested sections
    undescribed = [f"{m.__name__}.{n}" for m in models for n, f in m.model_fields.items() if not f.description]
    assert undescribed == []
    wordy = [
        f"{m.__name__}.{n}: {len(f.description.split())} words"
        for m in models
        for n, f in m.model_fields.items()
        if len(f.description.split()) > 40
    ]
    assert wordy == []


def test_the_configuration_reference_is_current():
    from flows.config_reference import COMMAND, REFERENCE, reference

    assert REFERENCE.exists() and REFERENCE.read_text() == reference(), (
        f"docs/configuration.md is out of date with the config models; regenerate it with `{COMMAND}`"
    )
    text = reference()
    for section in ("`round.rollout`", "`round.verify.sandbox`", "`round.verify.simulated_environment`"):
        assert f"### {section}" in text
    assert "| `samples_per_prompt` | int, >= 2, <= 512 | `4` | Samples per group." in text


def test_the_verifiers_a_config_may_name_are_the_registrys():
    """The config checks verifier names without importing the verifiers; the registry builds each one."""
    from tasks.config.verify import KNOWN_VERIFIERS
    from tasks.verifiers.registry import VERIFIERS

    assert sorted(KNOWN_VERIFIERS) == sorted(VERIFIERS)


def test_fields_that_change_only_speed_or_placement_leave_the_config_hash_alone():
    """The hash is part of every stage's resume key: a campaign resumed on a GPU machine, or with speculation turned
    on, must find its records; and the hash of a config at its defaults is the one recorded before these fields
    were set apart (``rollout.speculative`` is new, so it is left out, as are the train and filter fields added
    since that leave it alone at their defaults; ``device`` is dumped at its default)."""
    import hashlib
    import json

    from flows.config import RoundConfig

    plain = RoundConfig()
    recorded = plain.model_dump(mode="json")
    recorded["rollout"].pop("speculative")
    for added in (
        "max_tokens_per_microbatch",
        "gradient_checkpointing",
        "lora",
        "warmup_steps",
        "drift_target",
        "adam_beta2",
        "credit",
    ):
        recorded["train"].pop(added)
    for added in ("history_baseline_rounds", "keep_samples"):
        recorded["filter"].pop(added)
    for added in ("environment", "episode"):  # agentic rounds: left out while they are at their defaults
        recorded.pop(added)
    assert (
        plain.config_hash()
        == hashlib.sha256(json.dumps(recorded, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]
    )
    moved = RoundConfig.model_validate(
        {
            "device": "cpu",
            "rollout": {"gpu_memory_utilization": 0.3, "tensor_parallel_size": 2, "speculative": {"enabled": True}},
            "episode": {"tools": {"sandboxes": 16, "warm": False}, "env_workers": 4},
        }
    )
    assert moved.config_hash() == plain.config_hash()
    assert RoundConfig.model_validate({"rollout": {"temperature": 0.5}}).config_hash() != plain.config_hash()
