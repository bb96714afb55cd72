"""The failure taxonomy per episode (tasks/environments/types.py ``episode_outcome``): which side failed decides
whether an episode's reward may enter the gradient. One case a row, the rule it checks in the comment."""

import pytest

from tasks.environments.types import episode_outcome
from tasks.verifiers.outcome import Outcome


@pytest.mark.parametrize(
    "done, reward, infra_error, exhausted, expected",
    [
        (True, 1.0, None, None, (Outcome.SUCCESS, 1.0)),  # scored and right
        (True, 0.5, None, None, (Outcome.SUCCESS, 0.5)),  # partial credit is still a success
        (True, 0.0, None, None, (Outcome.MODEL_FAILURE, 0.0)),  # scored and wrong
        (True, None, None, None, (Outcome.UNKNOWN, None)),  # finished but the environment cannot score it
        (False, None, None, "no answer within max_turns=4", (Outcome.MODEL_FAILURE, 0.0)),  # the model's budget
        (False, None, "the tool call hung past 10s", None, (Outcome.INFRA_FAILURE, None)),  # the tool's fault
        # an infrastructure failure wins over a budget: the episode never had a fair chance to finish
        (
            False,
            None,
            "the tool's process exited with 3",
            "no answer within max_tool_seconds=60",
            (Outcome.INFRA_FAILURE, None),
        ),
        (True, 1.0, "sandbox gone", None, (Outcome.INFRA_FAILURE, None)),  # never a reward from a failed environment
        (False, None, None, None, (Outcome.UNKNOWN, None)),  # unfinished without a reason: a guard, not a rule
    ],
)
def test_episode_outcome(done, reward, infra_error, exhausted, expected):
    verdict = episode_outcome(done=done, reward=reward, infra_error=infra_error, exhausted=exhausted)
    assert (verdict.outcome, verdict.reward) == expected
    assert verdict.error == (infra_error or exhausted or (None if done else "the episode did not finish"))
