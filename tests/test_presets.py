"""Presets: configs shipped with the package, selected by name, with --config laid over them."""

import fnmatch
import os
import tomllib

import pytest
import yaml

from flows.cli import main
from flows.config import CampaignConfig, ConfigError, load_campaign_config
from flows.presets import load_preset, overlay, preset_names

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize(
    "base, over, merged",
    [
        ({"a": 1}, {}, {"a": 1}),  # nothing laid over: the preset as it is
        ({"a": 1}, {"a": 2}, {"a": 2}),  # a value in the file replaces the preset's
        ({"r": {"x": 1, "y": 2}}, {"r": {"y": 3}}, {"r": {"x": 1, "y": 3}}),  # sections merge field by field
        ({"r": {"s": {"x": 1}}}, {"r": {"s": {"z": 0}}}, {"r": {"s": {"x": 1, "z": 0}}}),  # at any depth
        ({"r": {"x": 1}}, {"r": None}, {"r": None}),  # an explicit null replaces a whole section
        ({"l": [1, 2]}, {"l": [3]}, {"l": [3]}),  # lists replace, never concatenate
        ({}, {"new": 1}, {"new": 1}),  # fields the preset leaves out come from the file
    ],
)
def test_overlay(base, over, merged):
    assert overlay(base, over) == merged


def test_long_tail_preset_selects_its_task_base_and_simulated_environment():
    assert "long-tail" in preset_names()
    config = load_campaign_config(None, "long-tail")
    rc = config.round
    assert (rc.policy.base_model, rc.prompts.source, rc.verifier) == (
        "builtin-longtail",
        "builtin:longtail",
        "longtail",
    )
    assert rc.verify.simulated_environment is not None and rc.verify.simulated_environment.p99_over_median == 10.0
    assert rc.evaluate.max_tokens >= len("999,998,997,996,995,994,993,992,991,990,989,988,987,986,985") + 1
    # its carried-over groups are its long samples: spread over the minibatches, not first as by default
    assert rc.train.minibatch_order == "shuffled" != load_campaign_config(None, None).round.train.minibatch_order


@pytest.mark.parametrize("name", preset_names())
def test_every_preset_validates_and_is_shipped_as_package_data(name):
    CampaignConfig.model_validate(load_preset(name))
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        globs = tomllib.load(f)["tool"]["setuptools"]["package-data"]["flows"]
    assert any(fnmatch.fnmatch(f"presets/{name}.yaml", g) for g in globs), globs


CONFIGS_DIR = os.path.join(ROOT, "benchmarks", "configs")
BENCHMARK_CONFIGS = sorted(n for n in os.listdir(CONFIGS_DIR) if os.path.isfile(os.path.join(CONFIGS_DIR, n)))
LEARNING_SPEED_CONFIGS = sorted(os.listdir(os.path.join(CONFIGS_DIR, "learning_speed")))


@pytest.mark.parametrize("name", BENCHMARK_CONFIGS)
def test_benchmark_configs_lay_over_the_long_tail_preset(name):
    """The files `benchmarks/batch_collection.py --config` is shown with stay valid as the config grows."""
    path = os.path.join(ROOT, "benchmarks", "configs", name)
    config, preset = load_campaign_config(path, "long-tail"), load_campaign_config(None, "long-tail")
    assert config.round.rollout.engine == "vllm"  # what each file is for
    assert config.round.prompts == preset.round.prompts and config.round.verify == preset.round.verify


@pytest.mark.parametrize("name", LEARNING_SPEED_CONFIGS)
def test_learning_speed_screen_configs_lay_over_the_defaults(name):
    """The files docs/performance.md's learning-speed screens quote stay valid as the config grows (an unknown or
    renamed field fails here, not in a reader's forty-minute run)."""
    path = os.path.join(CONFIGS_DIR, "learning_speed", name)
    config = load_campaign_config(path, None)  # an unknown field raises ConfigError
    with open(path) as f:
        sections = yaml.safe_load(f)["round"]
    for section, fields in sections.items():
        for field, value in fields.items():
            assert getattr(getattr(config.round, section), field) == value, (section, field)


def test_the_collection_benchmark_rejects_a_missing_config_before_it_starts(tmp_path):
    """A bad --config ends the run at once, naming the file, before any base is built or run taken over."""
    import subprocess
    import sys

    missing = tmp_path / "nowhere.yaml"
    done = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "benchmarks", "batch_collection.py"),
            "--config",
            str(missing),
            "--storage",
            str(tmp_path / "store"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert done.returncode == 2, done.stderr
    assert f"config file {missing} does not exist" in done.stderr
    assert not (tmp_path / "store").exists()


def test_config_file_is_laid_over_the_preset_and_flags_apply_last(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump({"rounds": 3, "round": {"train": {"learning_rate": 5e-5}, "seed": 9}}))
    config = load_campaign_config(str(path), "long-tail", rounds=7)
    preset = load_campaign_config(None, "long-tail")
    assert config.rounds == 7  # --rounds beats both
    assert (config.round.train.learning_rate, config.round.seed) == (5e-5, 9)  # the file beats the preset
    assert config.round.train.groups_per_step == preset.round.train.groups_per_step  # the rest is the preset's
    assert config.round.prompts == preset.round.prompts


def test_config_prints_the_presets_full_config_with_field_help(capsys):
    assert main(["config", "--preset", "long-tail"]) == 0
    text = capsys.readouterr().out
    assert yaml.safe_load(text) == load_campaign_config(None, "long-tail").model_dump(mode="json")
    assert "    # Samples per group. GRPO compares samples of one prompt, so at least 2.\n" in text
    assert "    simulated_environment:\n      # SIMULATION: median seconds" in text  # the simulation says it is one
    assert main(["config"]) == 0
    assert yaml.safe_load(capsys.readouterr().out) == CampaignConfig().model_dump(mode="json")


@pytest.mark.parametrize("argv", [["config", "--preset", "long-tial"], ["run", "--preset", "long-tial"]])
def test_unknown_preset_fails_in_one_line_naming_the_known_ones(argv, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("RLROUNDS_STORAGE", str(tmp_path / "data"))
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: no preset named 'long-tial'") and "\n" not in err, err
    assert "long-tail" in err
    assert not os.path.exists(tmp_path / "data")


@pytest.mark.parametrize(
    "round_fields, fragment",
    [
        ({"prompts": {"source": "builtin:longtail"}}, "set prompts.task to 'longtail'"),
        (
            {"prompts": {"source": "builtin:longtail", "task": "longtail"}},
            "set policy.base_model to 'builtin-longtail'",
        ),
        ({"policy": {"base_model": "builtin-longtial"}}, "'builtin' or 'builtin-longtail'"),
    ],
)
def test_built_in_task_and_base_must_agree(round_fields, fragment):
    with pytest.raises(ConfigError, match=fragment):
        load_campaign_config(None, round=round_fields)
