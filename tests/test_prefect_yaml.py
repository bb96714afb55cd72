"""prefect.yaml deployments point at real flows with the names the UI will show."""

import importlib
import os

import yaml


def test_deployments_point_at_flows():
    spec = yaml.safe_load(open(os.path.join(os.path.dirname(__file__), "..", "prefect.yaml")))
    assert spec["deployments"]
    for deployment in spec["deployments"]:
        path, attr = deployment["entrypoint"].split(":")
        module = importlib.import_module(path.removesuffix(".py").replace("/", "."))
        flow = getattr(module, attr)
        assert flow.name.startswith("rl-"), deployment["name"]
        assert deployment["work_pool"]["name"] == "rlrounds"
