"""What a round's subflow costs Prefect beyond its own work, with and without a heartbeat thread.

    python benchmarks/subflow_overhead.py [--subflows 8] [--repeats 3] [--json PATH]

A parent flow calls ``--subflows`` empty subflows, alternately as Prefect runs them by default and inside
``flows.round.without_heartbeat`` (how the campaign runs its rounds), ``--repeats`` times each, on
Prefect's ephemeral API as ``rlrounds run`` uses it. Prints the median seconds per subflow of each way and
their ratio: the difference is the time Prefect waits for a flow run's heartbeat thread to notice it is
done, paid once per round. Run it with nothing else on the machine; the figures are wall seconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from contextlib import nullcontext


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--subflows", type=int, default=8, help="subflows per parent flow run")
    parser.add_argument("--repeats", type=int, default=3, help="parent flow runs per way")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()

    from flows.cli import quiet_libraries

    quiet_libraries(debug=False)
    from prefect import flow

    from flows.round import without_heartbeat

    @flow(name="bench-empty-round")
    def empty_round(index: int) -> int:
        return index

    @flow(name="bench-campaign")
    def campaign(subflows: int, quiet: bool) -> list[float]:
        seconds = []
        for index in range(subflows):
            start = time.perf_counter()
            with without_heartbeat() if quiet else nullcontext():
                empty_round(index)
            seconds.append(time.perf_counter() - start)
        return seconds

    campaign(2, True)  # starts the ephemeral API and warms both paths; not counted
    campaign(2, False)
    ways = {"with_heartbeat": False, "without_heartbeat": True}
    seconds: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(args.repeats):
        for name, quiet in ways.items():
            seconds[name] += campaign(args.subflows, quiet)
    figures = {name: statistics.median(values) for name, values in seconds.items()}
    for name, value in figures.items():
        print(f"{name:18s} {value:.3f} s per subflow (median of {len(seconds[name])})")
    ratio = figures["with_heartbeat"] / figures["without_heartbeat"]
    saved = figures["with_heartbeat"] - figures["without_heartbeat"]
    print(f"with / without heartbeat: {ratio:.2f}x, {saved:.3f} s a round")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"seconds_per_subflow": figures, "ratio": ratio, "subflows": seconds}, f, indent=2)


if __name__ == "__main__":
    main()
