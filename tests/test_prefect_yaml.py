"""prefect.yaml deployments point at real flows with the names the UI will show."""

import importlib
import inspect
import os

import yaml
from pydantic import BaseModel


def _spec() -> dict:
    return yaml.safe_load(open(os.path.join(os.path.dirname(__file__), "..", "prefect.yaml")))


def _flow(deployment: dict):
    path, attr = deployment["entrypoint"].split(":")
    return getattr(importlib.import_module(path.removesuffix(".py").replace("/", ".")), attr)


def test_deployments_point_at_flows():
    spec = _spec()
    assert spec["deployments"]
    for deployment in spec["deployments"]:
        flow = _flow(deployment)
        assert flow.name.startswith("rl-"), deployment["name"]
        assert deployment["work_pool"]["name"] == "rlrounds"


def test_replay_refilter_and_reverify_deployments_take_pydantic_requests():
    deployments = {d["name"]: d for d in _spec()["deployments"]}
    for name, flow_name in (("replay", "rl-replay"), ("refilter", "rl-refilter"), ("reverify", "rl-reverify")):
        flow = _flow(deployments[name])
        assert flow.name == flow_name
        request = inspect.signature(flow.fn).parameters["request"].annotation
        request = getattr(importlib.import_module(flow.fn.__module__), request) if isinstance(request, str) else request
        assert issubclass(request, BaseModel)  # the Prefect UI renders it as a form
        assert "request" in flow.parameters.properties and flow.parameters.required == ["request"]
