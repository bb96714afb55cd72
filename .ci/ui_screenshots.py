"""The Prefect UI in a real browser: the campaign deployment's run form and a round's health report.

Starts `prefect server start` on a free loopback port, deploys prefect.yaml, runs a one-round campaign
against that server (so a health-report artifact exists), then opens both pages in headless Chromium
(Debian's `chromium` package), saves a screenshot of each and fails when the form lacks the config
fields' help or the artifact page lacks the report. Stops the server it started.

    python .ci/ui_screenshots.py [--out DIR]      # screenshots: DIR/run-form.png, DIR/health-report.png

RLROUNDS_TEST_BASE_ROOT may name a storage root holding a committed built-in base, to skip building it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# What must be on each page once the browser has rendered it.
FORM_TEXT = ("Rounds to run.", "Storage root (a directory")  # a config field's help, a flow parameter's help
REPORT_TEXT = ("batch readiness", "time to a trainable batch", "accuracy at training precision")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _get(url: str):
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.load(response)


def _post(url: str, body: dict):
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.load(response)


def _browser() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if shutil.which(name):
            return shutil.which(name)
    sys.exit("no Chromium found; install Debian's package: apt-get install -y chromium")


def _open(browser: str, url: str, screenshot: str) -> str:
    """Render ``url`` (letting its scripts run), save a screenshot, and return the rendered DOM."""
    common = [
        browser,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--hide-scrollbars",
        "--window-size=1400,2200",
        "--virtual-time-budget=30000",
    ]
    subprocess.run([*common, f"--screenshot={screenshot}", url], capture_output=True, timeout=180, check=True)
    return subprocess.run([*common, "--dump-dom", url], capture_output=True, text=True, timeout=180, check=True).stdout


def _seed_base(storage: str) -> None:
    source = os.environ.get("RLROUNDS_TEST_BASE_ROOT")
    if not source:
        return  # the campaign builds it (a minute or two)
    sys.path.insert(0, REPO)
    from storage import checkpoints
    from storage.paths import StorageRoot
    from tasks.campaign.base_policy import run_prepare_base

    built = run_prepare_base(storage=source, base_model="builtin")
    lineage = checkpoints.read_lineage(StorageRoot.of(built.checkpoint), built.checkpoint)
    root = StorageRoot.of(storage)
    checkpoints.commit_checkpoint(root, built.checkpoint, root.base_policy(built.base_model), lineage)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(REPO, "ui-screenshots"), help="where the screenshots go")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    browser = _browser()
    home = tempfile.mkdtemp(prefix="rlrounds-ui-")
    port = _free_port()
    ui, api = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port}/api"
    storage = os.path.join(home, "data")
    env = {
        **os.environ,
        "PREFECT_HOME": os.path.join(home, "prefect"),
        "PREFECT_API_URL": api,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "DO_NOT_TRACK": "1",
        "PYTHONPATH": REPO,
        "RLROUNDS_HOME": REPO,
        "RLROUNDS_STORAGE": storage,
        "RLROUNDS_CACHE": os.path.join(home, "cache"),
    }
    log = open(os.path.join(home, "server.log"), "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 180  # a first start runs the database migrations
        while True:
            try:
                _get(f"{api}/health")
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    sys.exit(f"the Prefect server did not start; see {log.name}")
                time.sleep(1)
        for command in (["work-pool", "create", "rlrounds", "--type", "process"], ["--no-prompt", "deploy", "--all"]):
            subprocess.run(
                [sys.executable, "-m", "prefect", *command], cwd=REPO, env=env, check=True, capture_output=True
            )
        _seed_base(storage)
        config = os.path.join(home, "campaign.json")
        with open(config, "w") as f:
            tiny = {"train": {"groups_per_step": 2, "steps_per_round": 2}}
            json.dump({"rounds": 1, "run_id": "ui", "round": tiny}, f)
        subprocess.run(
            [sys.executable, "-m", "flows.cli", "run", "--config", config, "--storage", storage],
            cwd=REPO,
            env=env,
            check=True,
        )
        deployment = _get(f"{api}/deployments/name/rl-campaign/campaign")
        artifacts = _post(f"{api}/artifacts/filter", {"artifacts": {"key": {"any_": ["round-ui-1"]}}})
        if not artifacts:
            sys.exit("no health-report artifact 'round-ui-1' on the server after the campaign")
        failures = []
        pages = (
            ("run-form", f"{ui}/deployments/deployment/{deployment['id']}/run", FORM_TEXT),
            ("health-report", f"{ui}/artifacts/artifact/{artifacts[0]['id']}", REPORT_TEXT),
        )
        for name, url, expected in pages:
            screenshot = os.path.join(args.out, f"{name}.png")
            dom = _open(browser, url, screenshot)
            missing = [text for text in expected if text not in dom]
            print(f"{name}: {url} -> {screenshot}" + (f"; missing {missing}" if missing else ""))
            if missing:
                failures.append(f"{name} page lacks {missing} ({url})")
        if failures:
            print("FAILED: " + "; ".join(failures), file=sys.stderr)
            return 1
        return 0
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)


if __name__ == "__main__":
    sys.exit(main())
