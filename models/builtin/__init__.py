"""The built-in tasks and the base policy each one starts from.

One entry per built-in base: what ``policy.base_model`` and ``prompts.source`` name it, the task's
data module (seeded prompt streams, fixed held-out set), its characters, and the deterministic
recipe of its base policy, cached under ``<root>/base/<cache_name>/``. Bump a task's recipe version
when its recipe or data change: the cache name changes with it, so no stale base is reused.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

from models.builtin import addition, longtail, tooladd
from models.builtin.recipe import RECIPE_VERSION, BaseRecipe


@dataclass(frozen=True, kw_only=True)
class BuiltinTask:
    base_model: str
    """The value of ``policy.base_model`` that selects this base."""
    source: str
    """The value of ``prompts.source`` that streams this task's prompts."""
    task: str
    """Task name on every row; also the verifier's name."""
    data: ModuleType
    """Prompt data: ``prompt_stream(seed)``, ``training_prompts(seed, count)``, ``held_out_prompts()``,
    ``longest_prompt()``, ``base_prompt_stream(seed)``, the base recipe's supervised examples (endless:
    the recipe takes each step's as it goes), and ``base_validation_prompts(seed, count)``, those it judges its
    stopping point on."""
    characters: str
    """The character tokenizer's alphabet (after pad/bos/eos/unk)."""
    answer_tokens: int
    """New tokens the recipe's greedy accuracy checks allow: the longest correct answer plus end-of-sequence."""
    recipe: BaseRecipe
    recipe_version: str
    policy_name: str
    """Name recorded in the base checkpoint's lineage.json."""
    environment_spans: Callable[[str], list[tuple[int, int]]] | None = None
    """An agentic task's: the character spans [start, end) of a base example's reference that the environment
    writes in an episode (a tool's answer). The recipe leaves them out of its loss and its accuracy checks, as RL
    leaves observations out of its loss. None: the policy writes the whole reference."""

    @property
    def cache_name(self) -> str:
        return f"builtin-{self.task}-v{self.recipe_version}"


BUILTINS: dict[str, BuiltinTask] = {
    "builtin": BuiltinTask(
        base_model="builtin",
        source="builtin:addition",
        task=addition.TASK_NAME,
        data=addition,
        characters=addition.CHARACTERS,
        answer_tokens=8,
        recipe=BaseRecipe(),
        recipe_version=RECIPE_VERSION,
        policy_name="builtin-addition-llama",
    ),
    # Longer sequences than addition: the counted-down answers reach 84 tokens, the recipe's examples 95,
    # and rollout lets wrong ones run on, so the model gets 128 positions. Smaller, faster steps than
    # addition's recipe keep the build short on a small CPU (a step is mostly matrix products). Two
    # threads, as addition's recipe: at these sizes they build bit for bit the weights one thread builds,
    # faster (docs/performance.md), and on a 2-core machine the build leaves the thread count of a
    # campaign after it in the same process alone (set_threads).
    "builtin-longtail": BuiltinTask(
        base_model="builtin-longtail",
        source="builtin:longtail",
        task=longtail.TASK_NAME,
        data=longtail,
        characters=longtail.CHARACTERS,
        answer_tokens=88,
        recipe=BaseRecipe(
            batch_size=64,
            learning_rate=2e-3,
            max_position_embeddings=128,
            length_buckets=4,
            teacher_forced_checks=True,
            check_every=25,  # a check costs a few steps, but validation climbs fast near the stop
            stop_at_accuracy=0.50,  # stopped at 45% it counted worse and RL levelled off lower (docs/performance.md)
        ),
        recipe_version="3",  # v3: examples count down to 24 numbers (longtail.BASE_MAX_SPAN), v2's to 21
        policy_name="builtin-longtail-llama",
    ),
    # An agentic task: episodes call a tool (tasks/environments/tooladd.py). The examples are whole episodes
    # (a call, the tool's answer, the sum: 40 tokens at most); a sample that runs on gets room for a second
    # call within 96 positions. Stopping is judged teacher-forced on examples that mix calls and head-sums
    # (head-sums are never right), so the stopping accuracy is below what the base reaches on the calls alone.
    # Stopped at 30% it miscopied a quarter of its sampled calls; at 35% the base still calls on about half
    # its sampled episodes: RL's headroom (docs/performance.md).
    "builtin-tooladd": BuiltinTask(
        base_model="builtin-tooladd",
        source="builtin:tooladd",
        task=tooladd.TASK_NAME,
        data=tooladd,
        characters=tooladd.CHARACTERS,
        answer_tokens=40,
        recipe=BaseRecipe(
            batch_size=64,
            learning_rate=2e-3,
            max_position_embeddings=96,
            teacher_forced_checks=True,
            check_every=25,
            stop_at_accuracy=0.35,
        ),
        recipe_version="1",
        policy_name="builtin-tooladd-llama",
        environment_spans=tooladd.observation_spans,
    ),
}
BUILTIN_SOURCES: dict[str, BuiltinTask] = {b.source: b for b in BUILTINS.values()}
