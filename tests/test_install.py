"""The README's install is what CI runs and what the lock pins: a new user's commands cannot drift from CI's."""

from __future__ import annotations

import importlib.util
import pathlib
import re
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _readme_commands():
    spec = importlib.util.spec_from_file_location("readme_commands", ROOT / ".ci" / "readme_commands.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _pins() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version, f"constraints.txt line {line!r} is not an exact pin"
            key = re.sub(r"[-_.]+", "-", name.lower())
            assert key not in pins, f"constraints.txt pins {name} twice"
            pins[key] = version
    return pins


def _requirement_names(specs: list[str]) -> set[str]:
    return {re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9._-]+", s).group(0).lower()) for s in specs}


def test_readme_has_the_two_commands_in_order():
    run, tests = _readme_commands().quick_start_commands((ROOT / "README.md").read_text())
    assert run.endswith("rlrounds run")  # 1. set up and run the main job
    assert tests.endswith("-m pytest -q")  # 2. set up and pass the tests
    for command in (run, tests):
        # torch's CPU build first, then the project under the lock: no CUDA download, no resolver search
        assert command.startswith("python3 -m venv .venv && .venv/bin/pip install torch==2.13.0 && ")
        assert ".venv/bin/pip install -c constraints.txt -e " in command


def test_ci_runs_the_readme_test_command_as_written():
    commands = _readme_commands()
    tests = commands.quick_start_commands((ROOT / "README.md").read_text())[1]
    set_up, run = commands.split_command(tests)
    assert f"{set_up} && {run}" == tests  # the two parts CI runs are the command, nothing added or lost
    ci = (ROOT / ".ci" / "run").read_text()
    assert "readme_commands.py install 2" in ci and "readme_commands.py run 2" in ci  # read, not copied
    assert 'bash -c "$install"' in ci and 'bash -c "$tests"' in ci
    assert "upgrade pip" not in ci  # CI uses the interpreter's own pip, as a new user does
    assert "PIP_NO_CACHE_DIR=1" in ci


def test_lock_pins_every_dependency_the_install_names():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = _requirement_names(
        project["dependencies"] + project["optional-dependencies"]["test"] + project["optional-dependencies"]["ray"]
    )
    pins = _pins()
    missing = wanted - set(pins)
    assert not missing, f"constraints.txt lacks {sorted(missing)}; regenerate it with `bash .ci/lock`"
    assert pins["torch"] == "2.13.0"  # the CPU build on disk, whatever the lock machine had


def test_lock_hash_is_part_of_the_code_version(tmp_path, monkeypatch):
    from flows.campaign import code_version, dependency_lock_hash

    lock = tmp_path / "constraints.txt"
    lock.write_text("torch==2.13.0\n")
    first = dependency_lock_hash(str(lock))
    lock.write_text("torch==2.13.0\nnumpy==2.4.6\n")
    assert dependency_lock_hash(str(lock)) != first  # another dependency set, another hash
    assert dependency_lock_hash(str(tmp_path / "absent.txt")) is None  # an installed wheel has no lock beside it
    monkeypatch.setenv("RLROUNDS_CODE_VERSION", "img-7")
    assert code_version() == f"img-7 deps:{dependency_lock_hash()}"


def test_run_help_states_the_real_default(capsys):
    from flows.cli import build_parser
    from flows.config import CampaignConfig

    with pytest.raises(SystemExit):
        build_parser().parse_args(["run", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert f"--rounds ROUNDS number of rounds (default: the config's, {CampaignConfig().rounds})" in text
