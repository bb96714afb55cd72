"""The default configuration learns: a short campaign on the built-in addition task, real rounds end to
end, raises held-out accuracy (served at bfloat16, the default) well above the base policy's."""

import time

import pytest

pytestmark = pytest.mark.slow

MIN_GAIN = 0.15  # points of held-out accuracy over the base; the default reaches ~+50 given 30 rounds


def test_a_short_default_campaign_raises_held_out_accuracy(prefect_harness, seed_builtin_base, tmp_path):
    from flows.campaign import rl_campaign
    from flows.config import CampaignConfig

    storage = str(tmp_path / "data")
    seed_builtin_base(storage)
    # Default rounds (128 groups x 16 steps each); it stops as soon as a round clears the bar with margin.
    config = CampaignConfig.model_validate({"rounds": 10, "run_id": "learns", "stop_at_accuracy": 0.6})
    start = time.monotonic()
    result = rl_campaign(config, storage=storage)
    elapsed = time.monotonic() - start
    accuracy = [r["accuracy"] for r in result["rounds"]]
    print(f"\nheld-out accuracy by round: {', '.join(f'{100 * a:.1f}%' for a in accuracy)}; {elapsed:.0f} s")
    assert accuracy[-1] - accuracy[0] >= MIN_GAIN, accuracy
