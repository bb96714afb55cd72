"""Weight publication per engine: end-to-end latency and engine pause, measured apart.

For each engine (embedded, vLLM) and model size, a serving engine is started on checkpoint A; then
``--repeats`` times a new checkpoint (A and B alternating, both committed on local disk beforehand)
is published to it through the same call the round's publish stage makes (LiveEngines.serve, tasks/serving/live.py):

    latency  checkpoint on disk -> the engine serves it (read, load in place, prefix cache reset)
    pause    the part of that during which the engine could not serve (what the engine reports)

and one greedy request checks the engine answers with the new weights. Medians over the repeats.
The round's publish/latency_s also counts MLflow registration (≈0.3 s on SQLite, see BASELINES.md).

    python benchmarks/publish.py [--repeats 5] [--engines embedded,vllm] [--models builtin,llama-85m] [--device auto]

Run it as a script (vLLM's engine-core process is started with spawn, which re-imports this file).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings

from engines import MODELS, save_model  # benchmarks/engines.py (this directory): the same two models


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--engines", default="embedded,vllm")
    parser.add_argument("--models", default="builtin,llama-85m")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--device", default="auto", help="the embedded engine's: auto, cpu, cuda or cuda:N")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    from transformers.utils import logging as hf_logging

    from models.engines.types import GroupRequest, SamplingParams
    from tasks.serving.live import LiveEngines

    hf_logging.set_verbosity_error()
    print(
        f"publication of a new checkpoint into a running engine, {args.dtype}, embedded on {args.device}, "
        f"median of {args.repeats}"
    )
    print(f"{'engine':<10}{'model':<22}{'latency s':>11}{'pause s':>10}{'pause/latency':>15}{'start s':>9}")
    for model in args.models.split(","):
        hidden, layers, heads, ffn, _ = MODELS[model]
        with (
            tempfile.TemporaryDirectory(prefix="bench-publish-") as a,
            tempfile.TemporaryDirectory(prefix="bench-publish-") as b,
        ):
            params = save_model(a, hidden, layers, heads, ffn, seed=0)
            save_model(b, hidden, layers, heads, ffn, seed=1)
            for kind in args.engines.split(","):
                started = time.perf_counter()
                live = LiveEngines()
                engine, tokenizer, _ = live.serve(
                    kind, a, dtype=args.dtype, policy_version=0, max_batch=64, device=args.device
                )
                startup = time.perf_counter() - started
                probe = [
                    GroupRequest(
                        "probe",
                        tuple(tokenizer("12+34=")["input_ids"]),
                        1,
                        SamplingParams(temperature=0.0, max_tokens=4),
                    )
                ]
                list(engine.generate(probe))  # warm-up
                latencies, pauses = [], []
                for version in range(1, args.repeats + 1):
                    directory = b if version % 2 else a
                    committed = time.perf_counter()
                    _, _, pause = live.serve(
                        kind, directory, dtype=args.dtype, policy_version=version, device=args.device
                    )
                    latencies.append(time.perf_counter() - committed)
                    pauses.append(pause)
                    (sample,) = engine.generate(probe)
                    assert sample.token_policy_versions == [version] * len(sample.token_ids)
                live.close()
                latency, pause = statistics.median(latencies), statistics.median(pauses)
                label = f"{model} ({params / 1e6:.2f}M)"
                print(
                    f"{kind:<10}{label:<22}{latency:>11.4f}{pause:>10.4f}{pause / latency:>15.2f}{startup:>9.1f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
