"""Episodes over Ray replicas (models/engines/sessions.py ``ReplicaEpisodes``): each episode is assigned to one
replica when it starts and every turn of it runs there (where its kept KV is), the episodes are spread over the
replicas, and the tokens are those one engine samples for the same episodes.

Ray is started once for the module (2 logical CPUs, one per replica); replicas run the embedded engine.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.ray

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install -e '.[ray]')")

from models.engines.episodes import EpisodeStart  # noqa: E402
from models.engines.sessions import ReplicaEpisodes, open_session, replica_of_episode  # noqa: E402
from models.engines.types import SamplingParams  # noqa: E402
from tasks.serving.engines import Placement, build_engine, make_engine  # noqa: E402

PROMPTS = ["1+2=", "34+56=", "7+89=", "99+99=", "5+5=", "12+21="]
OBSERVATIONS = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [15, 4]]  # ids appended after turns 0, 1, 2


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def router(tiny_policy_dir):
    engine, tokenizer = make_engine(
        "embedded", tiny_policy_dir, dtype="float32", policy_version=0, max_batch=16, placement=Placement(2)
    )
    yield engine, tokenizer
    engine.close()


def _run(session, tok, *, turns: int = 3):
    """Every episode through ``turns`` turns, observations appended in the order turns end; per episode its turns."""
    for i, text in enumerate(PROMPTS):
        sampling = SamplingParams(temperature=1.0, max_tokens=6, seed=11)
        ids = tuple(tok(text)["input_ids"])
        session.start(EpisodeStart(episode_id=f"ep{i}", prompt_token_ids=ids, sampling=sampling))
    done: dict[str, list] = {f"ep{i}": [] for i in range(len(PROMPTS))}
    while session.busy:
        for turn in session.step():
            done[turn.episode_id].append(turn)
            if turn.turn + 1 < turns:
                session.extend(turn.episode_id, OBSERVATIONS[turn.turn])
            else:
                session.end(turn.episode_id)
    return done


def test_each_episode_runs_on_one_replica_and_samples_one_engines_tokens(router, tiny_policy_dir):
    engine, tok = router
    session = open_session(engine, max_live=2)  # 3 episodes a replica, 2 rows: some wait for room
    assert isinstance(session, ReplicaEpisodes) and session.keeps_kv
    got = _run(session, tok)
    single = open_session(build_engine("embedded", tiny_policy_dir, dtype="float32", policy_version=0), max_live=2)
    expected = _run(single, tok)

    placed = dict(session.assigned)
    assert sorted(placed.values()) == [0, 0, 0, 1, 1, 1]  # least loaded first: both replicas, evenly
    for episode, turns in got.items():
        assert [t.turn for t in turns] == [0, 1, 2]
        assert {t.replica for t in turns} == {placed[episode]}  # labelled by the replica that ran the turn
        for x, y in zip(turns, expected[episode]):  # noise keyed by episode seed and position: same tokens
            assert x.token_ids == y.token_ids and x.finish_reason == y.finish_reason and x.start == y.start
            assert x.logprobs == pytest.approx(y.logprobs, abs=1e-5)
            assert x.prefill_tokens == y.prefill_tokens  # the replica kept the KV as one engine does
        assert session.sequence(episode) == single.sequence(episode)
    # each replica's own session prefilled exactly the episodes assigned to it
    ran = [ray.get(a.episode_step.remote([]))[2].per_episode_prefill.keys() for a in engine.actors]
    assert [sorted(keys) for keys in ran] == [sorted(e for e, r in placed.items() if r == i) for i in (0, 1)]
    assert session.stats.reused_tokens == single.stats.reused_tokens > 0
    assert session.stats.prefill_tokens == single.stats.prefill_tokens and session.stats.turns == 3 * len(PROMPTS)


def test_ties_break_by_the_episode_id_and_an_episode_ends_after_its_turn(router):
    engine, tok = router
    assert replica_of_episode("ep0", [0, 1]) == replica_of_episode("ep0", [0, 1])
    assert {replica_of_episode(f"e{i}", [0, 1]) for i in range(16)} == {0, 1}
    session = open_session(engine, max_live=2)
    ids = tuple(tok(PROMPTS[0])["input_ids"])
    session.start(EpisodeStart(episode_id="a", prompt_token_ids=ids, sampling=SamplingParams(max_tokens=3)))
    assert session.assigned["a"] == replica_of_episode("a", [0, 1])  # both idle: the hash decides
    with pytest.raises(ValueError, match="queued"):
        session.end("a")
    with pytest.raises(ValueError, match="already started"):
        session.start(EpisodeStart(episode_id="a", prompt_token_ids=ids, sampling=SamplingParams(max_tokens=3)))
    turns = []
    while session.busy:
        turns += session.step()
    assert [t.replica for t in turns] == [session.assigned["a"]]
    session.end("a")
    assert not session.busy and session.step() == []  # the step checks that the end reached the replica
