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


def _schema(flow) -> dict:
    """The parameter schema as Prefect builds it for a deployment's form."""
    from prefect.utilities.callables import parameter_schema

    return parameter_schema(flow.fn).model_dump()


def _walk(schema: dict):
    """(where, property) for every property of the flow and of every model it holds. A property that
    only refers to a model whose docstring is the same text gets no description of its own from
    pydantic; the form shows the model's, so that is the property's help here."""
    definitions = schema.get("definitions", {})

    def described(prop: dict) -> dict:
        model = prop.get("$ref", "").rpartition("/")[2]
        if "description" not in prop and model in definitions:
            return {**prop, "description": definitions[model].get("description", "")}
        return prop

    for name, prop in schema["properties"].items():
        yield f"flow.{name}", described(prop)
    for model, definition in definitions.items():
        for name, prop in definition.get("properties", {}).items():
            yield f"{model}.{name}", described(prop)


def test_every_form_field_has_help_and_every_optional_field_a_default():
    for deployment in _spec()["deployments"]:
        schema = _schema(_flow(deployment))
        for where, prop in _walk(schema):
            assert prop.get("description", "").strip(), f"{deployment['name']}: {where} has no help in the form"
        for where, prop in _walk(schema):
            name = where.split(".", 1)[1]
            required = schema["required"] if where.startswith("flow.") else []
            assert (
                "default" in prop
                or name in required
                or "$ref" in prop
                or "allOf" in prop
                or where.startswith(("ReplayRequest", "RefilterRequest", "ReverifyRequest"))
            ), f"{deployment['name']}: {where} has no default"


DTYPES = ["float32", "bfloat16", "float16", "auto"]  # tasks/config/base.py's Dtype, as the forms list it


def test_choices_are_enums_in_the_forms():
    schema = _schema(_flow({"entrypoint": "flows.start:rl_round_from"}))
    definitions = schema["definitions"]
    assert definitions["RolloutConfig"]["properties"]["dtype"]["enum"] == DTYPES
    assert definitions["EvaluateConfig"]["properties"]["serving_dtype"]["enum"] == DTYPES
    assert definitions["RolloutConfig"]["properties"]["engine"]["enum"] == ["embedded", "vllm"]
    assert definitions["TrainConfig"]["properties"]["aggregation"]["enum"] == ["token", "sequence", "dr_grpo"]
    evaluate = _schema(_flow({"entrypoint": "flows.evaluate:rl_evaluate"}))["properties"]
    (choices,) = [option["enum"] for option in evaluate["serving_dtype"]["anyOf"] if "enum" in option]  # or null
    assert choices == DTYPES


def test_the_round_deployment_asks_for_a_model_reference_not_internal_strings():
    deployments = {d["name"]: d for d in _spec()["deployments"]}
    schema = _schema(_flow(deployments["round"]))
    assert schema["required"] == []  # every field filled in: the form can be submitted as it opens
    assert set(schema["properties"]) == {"start", "config", "run_id", "experiment", "storage", "rounds"}
    assert schema["properties"]["start"]["default"] == "rlrounds-addition@champion"
    assert "NAME/VERSION" in schema["properties"]["start"]["description"]


def test_schedules_are_declared_inactive_and_training_deployments_limited_to_one_run():
    deployments = {d["name"]: d for d in _spec()["deployments"]}
    (nightly,) = deployments["round"]["schedules"]
    assert nightly["active"] is False and nightly["cron"] == "0 2 * * *"
    assert nightly["parameters"] == {"start": "rlrounds-addition@champion"}
    for name in ("campaign", "round"):
        assert deployments[name]["concurrency_limit"]["limit"] == 1
    assert {"campaign", "round", "evaluate", "replay", "refilter", "reverify"} == set(deployments)
