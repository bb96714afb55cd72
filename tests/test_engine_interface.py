"""Every engine is a ``RolloutEngine``: it subclasses the Protocol and defines each of its members
itself, with the Protocol's signatures, so no caller has to probe an engine for what it has.

The classes are checked by their source (vLLM is not needed to import models/engines/vllm_engine.py,
nor Ray to import models/engines/replicas.py); the embedded engine is checked live too, and the
replica router live in tests/test_ray_replicas.py.
"""

from __future__ import annotations

import ast
import inspect
import textwrap

import pytest

from models.checkpoint import load_policy
from models.engines.embedded import EmbeddedEngine
from models.engines.replicas import ReplicaRouter
from models.engines.types import EngineInfo, RolloutEngine
from models.engines.vllm_engine import VLLMEngine

ENGINES = [EmbeddedEngine, VLLMEngine, ReplicaRouter]


def protocol_methods() -> list[str]:
    return sorted(n for n, v in vars(RolloutEngine).items() if inspect.isfunction(v) and not n.startswith("_"))


def protocol_attributes() -> list[str]:
    return sorted(inspect.get_annotations(RolloutEngine))


def set_in_init(cls: type) -> set[str]:
    """The ``self.NAME`` an engine's ``__init__`` assigns."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls.__init__)))
    targets = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            targets.extend(node.targets)
        elif isinstance(node, ast.AnnAssign):
            targets.append(node.target)
    return {t.attr for t in targets if isinstance(t, ast.Attribute) and getattr(t.value, "id", "") == "self"}


def test_the_protocol_declares_what_callers_use():
    assert protocol_methods() == ["close", "configure", "generate", "load_weights"]
    assert protocol_attributes() == ["decode_steps", "info", "policy_version"]


@pytest.mark.parametrize("cls", ENGINES, ids=lambda c: c.__name__)
def test_each_engine_defines_every_method_with_the_protocols_signature(cls):
    assert RolloutEngine in cls.__mro__  # declared, not only shaped alike
    for name in protocol_methods():
        declared, defined = getattr(RolloutEngine, name), getattr(cls, name)
        assert defined is not declared, f"{cls.__name__}.{name} is only the Protocol's stub"
        expected = inspect.signature(declared).parameters
        got = inspect.signature(defined).parameters
        assert [(p.name, p.kind, p.default) for p in got.values()] == [
            (p.name, p.kind, p.default) for p in expected.values()
        ], f"{cls.__name__}.{name}"


@pytest.mark.parametrize("cls", ENGINES, ids=lambda c: c.__name__)
def test_each_engine_sets_every_attribute(cls):
    properties = {n for n in protocol_attributes() if isinstance(inspect.getattr_static(cls, n, None), property)}
    assert set(protocol_attributes()) - properties <= set_in_init(cls)


def test_the_embedded_engine_is_a_rollout_engine(tiny_policy_dir):
    model, tok = load_policy(tiny_policy_dir)
    engine = EmbeddedEngine(model, tok.eos_token_id, tok.pad_token_id, max_batch=8)
    assert isinstance(engine, RolloutEngine)
    assert isinstance(engine.info, EngineInfo) and engine.policy_version == 0 and engine.decode_steps == 0
    engine.configure(4, "keep")
    assert (engine.max_batch, engine.update_kv) == (4, "keep")
    engine.close()
