"""Multi-turn episodes on the embedded engine (models/engines/embedded_episodes.py): the KV cache kept between turns
gives the tokens and logprobs a full re-prefill each turn gives, for a fraction of the prefill; the policy's ids are
kept as sampled and observations appended as given; a waiting episode does not stop the others decoding."""

import pytest
import torch

from models.checkpoint import load_policy
from models.engines.embedded import EmbeddedEngine
from models.engines.embedded_episodes import EmbeddedEpisodes
from models.engines.episodes import EpisodeSession, EpisodeStart
from models.engines.types import GroupRequest, SamplingParams

PROMPTS = ["1+2=", "34+56=", "7+89=", "99+99=", "5+5="]
OBSERVATIONS = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [15, 4]]  # ids appended after turns 0, 1, 2


def _engine(path: str, kv_cache: str = "auto") -> tuple[EmbeddedEngine, object]:
    model, tok = load_policy(path)
    return EmbeddedEngine(model, tok.eos_token_id, tok.pad_token_id, max_batch=8, kv_cache=kv_cache), tok


def _run(session, prompts, tok, *, turns: int, max_tokens: int = 6, temperature: float = 1.0):
    """Every episode through ``turns`` turns, observations appended in the order turns end; per episode its turns."""
    for i, text in enumerate(prompts):
        sampling = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=11)
        ids = tuple(tok(text)["input_ids"])
        session.start(EpisodeStart(episode_id=f"ep{i}", prompt_token_ids=ids, sampling=sampling))
    done: dict[str, list] = {f"ep{i}": [] for i in range(len(prompts))}
    while session.busy:
        for turn in session.step():
            done[turn.episode_id].append(turn)
            if turn.turn + 1 < turns:
                session.extend(turn.episode_id, OBSERVATIONS[turn.turn])
            else:
                session.end(turn.episode_id)
    return done


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_kept_kv_gives_the_tokens_and_logprobs_of_a_full_reprefill_each_turn(tiny_policy_dir, temperature):
    engine, tok = _engine(tiny_policy_dir)
    kept = EmbeddedEpisodes(engine, max_live=3, keep_kv=True)  # 5 episodes, 3 rows: some wait for room
    again = EmbeddedEpisodes(engine, max_live=3, keep_kv=False)
    assert isinstance(kept, EpisodeSession) and kept.keeps_kv and not again.keeps_kv
    a = _run(kept, PROMPTS, tok, turns=3, temperature=temperature)
    b = _run(again, PROMPTS, tok, turns=3, temperature=temperature)
    for episode in a:
        assert [t.turn for t in a[episode]] == [0, 1, 2]
        for x, y in zip(a[episode], b[episode]):
            assert x.token_ids == y.token_ids and x.finish_reason == y.finish_reason
            assert x.start == y.start
            assert torch.allclose(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-5)
        # the sequence is the turns and the observations, each as given
        seq, expected = kept.sequence(episode), []
        for t in a[episode]:
            expected += t.token_ids + (OBSERVATIONS[t.turn] if t.turn < 2 else [])
        assert seq == expected
        # turn k > 0 prefilled its observation and the last token of the turn before, nothing more
        for t in a[episode][1:]:
            assert t.prefill_tokens == 1 + len(OBSERVATIONS[t.turn - 1])
            assert t.prefill_tokens < b[episode][t.turn].prefill_tokens  # the re-prefill took the whole history
    assert kept.stats.prefill_tokens < again.stats.prefill_tokens
    assert kept.stats.reused_tokens > 0 and again.stats.reused_tokens == 0


def test_first_turn_is_the_single_turn_engines_sample(tiny_policy_dir):
    """Turn 0 of an episode is what ``generate`` samples for a group of one with the same id: same seed, same noise."""
    engine, tok = _engine(tiny_policy_dir)
    turns = _run(EmbeddedEpisodes(engine, max_live=4), PROMPTS[:2], tok, turns=1)
    sampling = SamplingParams(temperature=1.0, max_tokens=6, seed=11)
    for i, text in enumerate(PROMPTS[:2]):
        (sample,) = engine.generate([GroupRequest(f"ep{i}", tuple(tok(text)["input_ids"]), 1, sampling)])
        (turn,) = turns[f"ep{i}"]
        assert turn.token_ids == sample.token_ids
        assert torch.allclose(torch.tensor(turn.logprobs), torch.tensor(sample.logprobs), atol=1e-5)


def test_other_episodes_keep_decoding_while_one_waits_on_its_environment(tiny_policy_dir):
    """An episode whose turn ended holds no row: the others' decode steps go on without it, and when its observation
    arrives late it continues exactly as it would have at once (sampling noise is per position, not per step)."""
    engine, tok = _engine(tiny_policy_dir)
    prompt = tuple(tok(PROMPTS[0])["input_ids"])
    sampling = SamplingParams(temperature=1.0, max_tokens=5, seed=3, ignore_eos=True)  # every turn runs 5 tokens
    long = SamplingParams(temperature=1.0, max_tokens=40, seed=3, ignore_eos=True)

    def episode(delay_steps: int):
        session = EmbeddedEpisodes(engine, max_live=4)
        session.start(EpisodeStart(episode_id="slow", prompt_token_ids=prompt, sampling=sampling))
        session.start(EpisodeStart(episode_id="busy", prompt_token_ids=prompt, sampling=long))
        turns, waited, steps = [], None, 0
        while session.busy or waited is not None:
            if waited is not None and steps >= waited:
                session.extend("slow", [7, 8])
                waited = None
            for turn in session.step():
                turns.append(turn)
                if turn.episode_id == "slow" and turn.turn == 0:
                    waited = steps + delay_steps  # the environment answers this many decode steps later
            steps += 1
        return {(t.episode_id, t.turn): t for t in turns}, session.stats.decode_steps

    quick, _ = episode(0)
    late, decode_steps = episode(10)
    assert late[("slow", 1)].token_ids == quick[("slow", 1)].token_ids
    assert late[("busy", 0)].token_ids == quick[("busy", 0)].token_ids
    assert late[("busy", 0)].finished_at > late[("slow", 0)].finished_at  # busy decoded while slow waited
    assert decode_steps == 39  # busy's 40 tokens (the first from its prefill): slow's turns ran beside them


def test_padded_cache_reprefills_each_turn_with_the_same_tokens(tiny_policy_dir):
    """A model the slot cache cannot serve still runs episodes, prefilling the whole sequence each turn."""
    slots, tok = _engine(tiny_policy_dir, "slots")
    padded, _ = _engine(tiny_policy_dir, "padded")
    session = EmbeddedEpisodes(padded, max_live=3)
    assert not session.keeps_kv
    a = _run(EmbeddedEpisodes(slots, max_live=3), PROMPTS[:3], tok, turns=2, temperature=0.0)
    b = _run(session, PROMPTS[:3], tok, turns=2, temperature=0.0)
    for episode in a:
        assert [t.token_ids for t in a[episode]] == [t.token_ids for t in b[episode]]


def test_extend_refuses_an_episode_that_is_still_decoding(tiny_policy_dir):
    engine, tok = _engine(tiny_policy_dir)
    session = EmbeddedEpisodes(engine, max_live=2)
    session.start(EpisodeStart(episode_id="a", prompt_token_ids=(1, 5), sampling=SamplingParams(max_tokens=4)))
    with pytest.raises(ValueError, match="queued"):
        session.extend("a", [5])
    with pytest.raises(ValueError, match="already started"):
        session.start(EpisodeStart(episode_id="a", prompt_token_ids=(1, 5), sampling=SamplingParams(max_tokens=4)))


def test_restored_rows_with_tails_of_different_lengths_match_a_fresh_prefill(tiny_policy_dir):
    """The cache itself: three rows set aside, restored together beside live rows with tails of 1, 5 and 9 tokens
    (right-padded in one append pass), give the logits a fresh prefill of their whole sequences gives, and so does
    the decode step after (the padding's keys are never read)."""
    from models.engines.embedded_episodes import EpisodeSlotCache
    from models.engines.kv_cache import SlotCache

    model, tok = load_policy(tiny_policy_dir)
    seqs = [tuple(tok(p)["input_ids"]) for p in PROMPTS]
    tails = [(), (), (6,), (7, 8, 9, 10, 11), (12, 13, 14, 15, 4, 5, 6, 7, 8)]  # rows 0, 1 stay live
    with torch.inference_mode():
        cache = EpisodeSlotCache(model, 8, tok.pad_token_id)
        cache.admit(seqs, list(range(len(seqs))), 64)
        kept = [cache.save(row) for row in (2, 3, 4)]
        assert cache.retire([0, 1]) == [0, 1]
        restored = cache.restore(kept, tails[2:], 64)
        fresh = SlotCache(model, 8, tok.pad_token_id)
        expected = fresh.admit([s + t for s, t in zip(seqs, tails)], list(range(5)), 64)
        assert torch.allclose(restored, expected[2:], atol=1e-5)
        step = torch.tensor([3, 4, 5, 6, 7])
        assert torch.allclose(cache.step(step), fresh.step(step), atol=1e-5)
        assert cache.lengths[:5].tolist() == [len(s) + len(t) + 1 for s, t in zip(seqs, tails)]


def test_open_session_picks_the_session_of_the_engines_kind(tiny_policy_dir):
    from models.engines.sessions import open_session

    engine, _ = _engine(tiny_policy_dir)
    assert type(open_session(engine, max_live=2)) is EmbeddedEpisodes
    assert not open_session(engine, max_live=2, keep_kv=False).keeps_kv
    with pytest.raises(TypeError, match="embedded or vllm"):
        open_session(object(), max_live=2)
