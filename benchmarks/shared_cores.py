"""Two torch processes sharing a machine's cores: why CI's two lanes run with OMP_NUM_THREADS=1 and
OMP_WAIT_POLICY=PASSIVE (.ci/run).

Each job is the built-in base recipe for ``--steps`` steps (models/builtin/base_policy.py), which fixes two
threads whatever the environment says. Timed, in one run:
- one job alone, at OpenMP's defaults (OMP_NUM_THREADS and OMP_WAIT_POLICY taken out of the environment);
- two jobs at once, at OpenMP's defaults (a waiting thread spins);
- two jobs at once under OMP_NUM_THREADS=1 and OMP_WAIT_POLICY=PASSIVE (a waiting thread sleeps).
Two jobs that shared the cores fairly would each take about twice the lone job on a 2-core machine; the
ratios printed are each pair's slower job against the lone one.

    python benchmarks/shared_cores.py [--steps 60]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = """
import tempfile, time
from models.builtin.base_policy import build_base_policy
from models.builtin.recipe import BaseRecipe
start = time.perf_counter()
build_base_policy(tempfile.mkdtemp(), BaseRecipe(max_steps={steps}, check_every={steps}, stop_at_accuracy=1.0))
print(time.perf_counter() - start)
"""


def run_jobs(count: int, steps: int, env: dict) -> list[float]:
    """Start ``count`` jobs together; each one's seconds, from its own clock (start-up left out)."""
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")}
    env = {**base, "PYTHONPATH": REPO, **env}
    jobs = [
        subprocess.Popen(
            [sys.executable, "-c", JOB.format(steps=steps)], env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
        )
        for _ in range(count)
    ]
    seconds = []
    for job in jobs:
        out, _ = job.communicate()
        if job.returncode:
            raise SystemExit(f"a job failed (exit {job.returncode})")
        seconds.append(float(out.decode().split()[-1]))
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60, help="recipe steps a job runs")
    args = parser.parse_args()
    print(f"{os.cpu_count()} cores; the built-in base recipe for {args.steps} steps a job")
    started = time.perf_counter()
    (alone,) = run_jobs(1, args.steps, {})
    print(f"{'one job alone:':<43}{alone:6.1f} s")
    for name, env in (
        ("two at once, OpenMP's defaults:", {}),
        ("two at once, one thread, sleeping waits:", {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}),
    ):
        pair = run_jobs(2, args.steps, env)
        slower = max(pair)
        print(f"{name:<43}{slower:6.1f} s  {slower / alone:4.1f}x the lone job  (the other {min(pair):.1f} s)")
    print(f"({time.perf_counter() - started:.0f} s in all)")


if __name__ == "__main__":
    main()
