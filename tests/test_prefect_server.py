"""The deployments as a user runs them from the UI: a real `prefect server start` on a free loopback
port, a process work pool and worker, `prefect deploy --all` on this repository's prefect.yaml, and
every deployment triggered through the API with the JSON parameters the UI's form sends.

Checks what only a server shows: each flow run completes, its artifacts are on the server, the
forms' help and the schedule are registered, an approval is answered through the API, and each
MLflow model version names the flow run that made it. Every process started here is stopped at the end.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

pytestmark = pytest.mark.prefect_server

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = "srv-policy"
ROUND = {"train": {"groups_per_step": 2, "steps_per_round": 2}, "publish": {"model_name": MODEL}}
START_TIMEOUT_S = 180  # a first server start runs its migrations; 2 shared cores take their time
RUN_TIMEOUT_S = 600
LOG_WAIT_S = 60  # logs are shipped in batches and may land after the run is Completed


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _prefect(env: dict, *args: str, timeout: float = 300) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "prefect", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, f"prefect {' '.join(args)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def _descendants(pid: int) -> list[int]:
    """Every living process below ``pid`` (by /proc's parent ids), whatever session it started."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(parent, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _gone(pid: int) -> bool:
    from storage.campaigns import process_started

    return process_started(pid) is None  # exited, or a zombie


def _stop(process: subprocess.Popen) -> None:
    """Stop a process this suite started and everything it started: its process group, and the processes below it
    that left the group (a Prefect worker starts each flow run in a session of its own)."""
    below = _descendants(process.pid)  # before the kill: orphans are re-parented and the tree is lost
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)
    for pid in below:
        if not _gone(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while not all(_gone(pid) for pid in below):
        assert time.monotonic() < deadline, f"processes {below} outlived the kill"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def server(tmp_path_factory, seed_builtin_base):
    """Server, pool, deployments and worker; yields the API URL, the storage root and the env."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    home = tmp_path_factory.mktemp("prefect-server")
    storage = str(home / "data")
    seed_builtin_base(storage)
    port = _free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = {
        **os.environ,
        "PREFECT_HOME": str(home / "prefect"),
        "PREFECT_API_URL": api,
        "PREFECT_SERVER_API_HOST": "127.0.0.1",
        "PREFECT_SERVER_API_PORT": str(port),
        "PREFECT_LOGGING_LEVEL": "INFO",
        "PREFECT_WORKER_QUERY_SECONDS": "2",  # each deployment run is picked up within 2 s, not 10
        "PYTHONPATH": REPO,
        "RLROUNDS_HOME": REPO,
        "RLROUNDS_STORAGE": storage,
    }
    logs = open(home / "server.log", "w")
    started = []
    try:
        server = subprocess.Popen(
            [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
            env=env,
            stdout=logs,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        started.append(server)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                urllib.request.urlopen(f"{api}/health", timeout=5).close()
                break
            except OSError:
                assert server.poll() is None, f"prefect server exited; see {home / 'server.log'}"
                assert time.monotonic() < deadline, f"prefect server did not answer within {START_TIMEOUT_S} s"
                time.sleep(1)
        _prefect(env, "work-pool", "create", "rlrounds", "--type", "process")
        _prefect(env, "--no-prompt", "deploy", "--all")
        worker_log = open(home / "worker.log", "a")

        def start_worker() -> subprocess.Popen:
            worker = subprocess.Popen(
                [sys.executable, "-m", "prefect", "worker", "start", "--pool", "rlrounds"],
                cwd=REPO,
                env=env,
                stdout=worker_log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # its flow runs share its process group
            started.append(worker)
            return worker

        start_worker()
        with temporary_settings({PREFECT_API_URL: api}):
            yield {
                "api": api,
                "storage": storage,
                "env": env,
                "home": home,
                "start_worker": start_worker,
                "processes": started,
            }
    finally:
        for process in reversed(started):
            _stop(process)


def _run(name: str, parameters: dict, timeout: float = RUN_TIMEOUT_S):
    """Trigger a deployment as the UI's Run button does and wait for the flow run to end."""
    from prefect.deployments import run_deployment

    flow_run = run_deployment(name, parameters=parameters, timeout=timeout)
    assert flow_run.state.is_completed(), f"{name}: {flow_run.state.type} {flow_run.state.message}"
    return flow_run


def _client():
    from prefect.client.orchestration import get_client

    return get_client(sync_client=True)


def _registry(storage: str):
    from mlflow import MlflowClient

    db = f"sqlite:///{storage}/mlflow.db"
    return MlflowClient(tracking_uri=db, registry_uri=db)


def _subflow_ids(client, flow_run_id) -> set[str]:
    """The flow run and every flow run it started (a round runs as a subflow)."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId

    children = client.read_flow_runs(
        flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[flow_run_id]))
    )
    return {str(flow_run_id)} | {str(c.id) for c in children}


def _artifacts(client, flow_run_ids: set[str]) -> list:
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    return client.read_artifacts(
        artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=list(flow_run_ids)))
    )


def _logs_containing(client, flow_run_ids: set[str], wanted: list[str], timeout: float = LOG_WAIT_S) -> str:
    """All log messages of these flow runs, read until each wanted text is there or the wait is over.

    A flow run's process ships its logs in batches, so the last of them may reach the server after the
    run is already Completed; the logs are read in pages, oldest first, so none is cut off by a limit.
    """
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.client.schemas.sorting import LogSort

    log_filter = LogFilter(flow_run_id=LogFilterFlowRunId(any_=list(flow_run_ids)))
    deadline = time.monotonic() + timeout
    while True:
        messages, page = [], 200
        while True:
            found = client.read_logs(
                log_filter=log_filter, limit=page, offset=len(messages), sort=LogSort.TIMESTAMP_ASC
            )
            messages += [log.message for log in found]
            if len(found) < page:
                break
        logs = " ".join(messages)
        if all(text in logs for text in wanted) or time.monotonic() > deadline:
            return logs
        time.sleep(2)


def test_deployments_forms_and_schedule_are_registered(server):
    with _client() as client:
        campaign = client.read_deployment_by_name("rl-campaign/campaign")
        schema = campaign.parameter_openapi_schema
        definitions = schema.get("definitions") or schema.get("$defs")
        assert definitions, f"no model definitions in the stored schema: {sorted(schema)}"
        rollout = definitions["RolloutConfig"]["properties"]
        assert rollout["dtype"]["enum"] == ["float32", "bfloat16", "float16", "auto"]
        assert rollout["dtype"]["description"].startswith("Engine precision")
        assert schema["properties"]["storage"]["description"].startswith("Storage root")
        assert schema["properties"]["config"]["default"]["rounds"] == 45  # the form opens filled in
        round_ = client.read_deployment_by_name("rl-round-from/round")
        assert round_.parameter_openapi_schema["properties"]["start"]["default"] == "rlrounds-addition@champion"
        (nightly,) = round_.schedules
        assert nightly.active is False and nightly.schedule.cron == "0 2 * * *"
        assert nightly.parameters == {"start": "rlrounds-addition@champion"}
        for deployment in (round_, campaign):  # one run at a time, the rest wait in line
            assert deployment.global_concurrency_limit.limit == 1, deployment.global_concurrency_limit
            assert deployment.concurrency_options.collision_strategy == "ENQUEUE"
        names = {d.name for d in client.read_deployments()}
        assert {"campaign", "round", "evaluate", "replay", "refilter", "reverify"} <= names


@pytest.fixture(scope="module")
def campaign_run(server):
    return _run("rl-campaign/campaign", {"config": {"rounds": 1, "run_id": "srv", "round": ROUND}})


def test_campaign_deployment_completes_with_artifacts_and_lineage(server, campaign_run):
    with _client() as client:
        runs = _subflow_ids(client, campaign_run.id)
        keys = {a.key for a in _artifacts(client, runs)}
        assert {"campaign-srv-rounds", "round-srv-1", "srv-round-1-rollout"} <= keys, keys
        table = client.read_latest_artifacts()  # the latest version of each key
        rounds = next(a for a in table if a.key == "campaign-srv-rounds")
        assert '"round": 1' in str(rounds.data).replace("'", '"')  # updated after round 1
        logs = _logs_containing(client, runs, ["round 1: rollout started", "round 1: train done in"])
        assert "round 1: rollout started" in logs and "round 1: train done in" in logs, logs[-2000:]
    versions = _registry(server["storage"]).search_model_versions(f"name = '{MODEL}'")
    by_round = {v.tags["round"]: v for v in versions if v.tags["run_id"] == "srv"}
    assert by_round["0"].tags["prefect_flow_run_id"] == str(campaign_run.id)
    assert by_round["1"].tags["prefect_flow_run_id"] in runs  # the round's own (sub)flow run
    api_ui = server["api"].removesuffix("/api")
    assert f"{api_ui}/runs/flow-run/{by_round['1'].tags['prefect_flow_run_id']}" in by_round["1"].description


def test_round_from_the_champion_then_evaluate_refilter_and_replay(server, campaign_run):
    registry = _registry(server["storage"])
    champion = registry.get_model_version_by_alias(MODEL, "champion")
    flow_run = _run("rl-round-from/round", {"start": f"{MODEL}@champion", "run_id": "srv-next", "config": ROUND})
    with _client() as client:
        runs = _subflow_ids(client, flow_run.id)
    (made,) = [v for v in registry.search_model_versions(f"name = '{MODEL}'") if v.tags["run_id"] == "srv-next"]
    assert made.tags["parent_model_version"] == f"{MODEL}/{champion.version}"
    assert made.tags["round"] == str(int(champion.tags["round"]) + 1)
    assert made.tags["prefect_flow_run_id"] in runs
    _run("rl-evaluate/evaluate", {"model_version": f"{MODEL}/{made.version}", "serving_dtype": "float32"})
    assert "eval.embedded.float32.accuracy" in registry.get_model_version(MODEL, made.version).tags
    refiltered = _run(
        "rl-refilter/refilter", {"request": {"version": made.tags["trajectory_version"], "where": "reward > 0"}}
    )
    del refiltered
    from storage.paths import StorageRoot
    from storage.trajectories import list_manifests

    (derived,) = [m for m in list_manifests(StorageRoot.of(server["storage"])) if m.parent]
    replay = _run(
        "rl-replay/replay", {"request": {"trajectories": derived.version, "from_model": f"{MODEL}/{champion.version}"}}
    )
    (replayed,) = [
        v
        for v in registry.search_model_versions(f"name = '{MODEL}'")
        if v.tags.get("prefect_flow_run_id") == str(replay.id)
    ]
    assert replayed.tags["trajectory_version"] == derived.version
    assert f"derived from `{made.tags['trajectory_version']}`" in replayed.description


def _paused_round(client, parent_id, deadline: float):
    """The paused round (sub)flow run of ``parent_id``, once it pauses."""
    while time.monotonic() < deadline:
        for run_id in _subflow_ids(client, parent_id) - {str(parent_id)}:
            run = client.read_flow_run(run_id)
            if run.state.is_paused():
                return run
        time.sleep(2)
    raise AssertionError("the round never paused for approval")


def _wait(flow_run_id, deadline: float):
    with _client() as client:
        while time.monotonic() < deadline:
            run = client.read_flow_run(flow_run_id)
            if run.state.is_final():
                return run
            time.sleep(2)
    raise AssertionError(f"flow run {flow_run_id} did not finish in time")


@pytest.mark.parametrize("answer", ["approve", "timeout"])
def test_approval_moves_the_alias_only_when_approved(server, campaign_run, answer):
    """A fresh alias per case: no champion under it yet, so the gate passes and the round pauses."""
    from prefect.deployments import run_deployment

    alias = f"reviewed-{answer}"
    evaluate = {
        "approval": "required",
        "champion_alias": alias,
        "approval_timeout_s": 600 if answer == "approve" else 5,
    }
    flow_run = run_deployment(
        "rl-round-from/round",
        timeout=0,
        parameters={"start": f"{MODEL}/1", "run_id": f"srv-{answer}", "config": {**ROUND, "evaluate": evaluate}},
    )
    with _client() as client:
        if answer == "approve":
            paused = _paused_round(client, flow_run.id, time.monotonic() + RUN_TIMEOUT_S)
            markdown = [a for a in _artifacts(client, {str(paused.id)}) if a.key == f"srv-{answer}-round-1-approval"]
            assert markdown and "serving precision" in markdown[0].data and "training precision" in markdown[0].data
            from prefect.flow_runs import resume_flow_run

            resume_flow_run(paused.id, run_input={"approve": True, "note": "looks right"})
    finished = _wait(flow_run.id, time.monotonic() + RUN_TIMEOUT_S)
    assert finished.state.is_completed(), f"{finished.state.type} {finished.state.message}"
    registry = _registry(server["storage"])
    (made,) = [v for v in registry.search_model_versions(f"name = '{MODEL}'") if v.tags["run_id"] == f"srv-{answer}"]
    if answer == "approve":
        assert made.tags["eval.approval"] == "approved"
        assert str(registry.get_model_version_by_alias(MODEL, alias).version) == str(made.version)
    else:
        assert made.tags["eval.approval"] == "timed_out" and made.tags["eval.promoted"] == "0.0"
        with pytest.raises(Exception, match="alias"):
            registry.get_model_version_by_alias(MODEL, alias)


def test_a_killed_worker_and_a_rerun_with_the_same_run_id_continue_the_campaign(server, campaign_run):
    """Kill the worker (and the flow run it started) once round 1 is committed; mark the run crashed
    as a person would in the UI, start a worker again and re-run the deployment with the same run id:
    the campaign finishes with one model version and one trajectory version per round."""
    from prefect.client.schemas.objects import StateType
    from prefect.deployments import run_deployment
    from prefect.states import Crashed

    from storage.paths import StorageRoot
    from storage.trajectories import list_manifests

    # Verifications wait on a simulated environment, so round 2 lasts long enough (about half a minute on 2
    # cores) for the poll below to see round 1 committed and the kill to land inside round 2; a round that
    # ended first would leave the first run Completed, and the state check below would fail. (A 2 s median
    # made each round of this test wait two minutes on the environment, and the re-run waits again.)
    slow = {**ROUND, "verify": {"simulated_environment": {"median_latency_s": 0.5, "p99_over_median": 1.5}}}
    parameters = {"config": {"rounds": 2, "run_id": "srv-kill", "round": slow}}
    first = run_deployment("rl-campaign/campaign", parameters=parameters, timeout=0)
    root = StorageRoot.of(server["storage"])
    record = root.stage_record("srv-kill", 1, "record")
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not root.fs.exists(record):  # round 1 committed: the kill lands in round 2
        assert time.monotonic() < deadline, "round 1 of the campaign never committed"
        time.sleep(1)
    worker = server["processes"][-1]
    _stop(worker)  # SIGTERM to the worker's process group: the flow run dies with it
    with _client() as client:
        killed = client.read_flow_run(first.id)
        if not killed.state.is_final():
            client.set_flow_run_state(first.id, Crashed(message="worker killed"), force=True)
        assert client.read_flow_run(first.id).state.type in (StateType.CRASHED, StateType.FAILED, StateType.CANCELLED)
    server["start_worker"]()
    second = _run("rl-campaign/campaign", parameters)
    assert second.id != first.id
    versions = [
        v
        for v in _registry(server["storage"]).search_model_versions(f"name = '{MODEL}'")
        if v.tags["run_id"] == "srv-kill"
    ]
    assert sorted(v.tags["round"] for v in versions) == ["0", "1", "2"]  # none registered twice
    rounds = sorted(
        m.body["round"] for m in list_manifests(root) if m.body.get("run_id") == "srv-kill" and not m.parent
    )
    assert rounds == [1, 2]  # one committed trajectory version per round
