"""bench/async_sim.py, the discrete-event simulator of sync / one-step async / fully async training: its
arithmetic against hand computations on a tiny case, and the orderings the modes must show on a long tail."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import async_sim as sim  # noqa: E402

# one decode step costs 1 s at any batch size; the trainer 0.1 s per token; a sync 0.5 s
FLAT = sim.Costs({1: 1.0, 100: 1.0}, update_s_per_token=0.1, weight_sync_s=0.5, prompt_len=0)
TWO = dict(lengths=[3, 5], steps=2, groups_per_step=1, n=2, max_num_seqs=8)


def test_sync_is_generate_then_train_then_sync():
    r = sim.simulate("sync", FLAT, **TWO)
    # per step: the group's longest sample (5 steps) + 8 tokens x 0.1 + 0.5
    assert r.seconds == pytest.approx(2 * (5 + 0.8 + 0.5))
    assert r.trained_tokens == 16 and r.engine_busy_s == pytest.approx(10)


def test_async_overlaps_the_next_generation_with_training():
    r = sim.simulate("async", FLAT, **TWO)
    # batch 1 generated (5), then each step: sync + max(train this batch, generate the next)
    assert r.seconds == pytest.approx(5 + (0.5 + max(0.8, 5)) + (0.5 + 0.8))


def test_fully_async_at_staleness_0_is_the_sync_schedule():
    on_policy = sim.simulate("fully_async", FLAT, max_staleness=0, **TWO)
    assert on_policy.seconds == pytest.approx(sim.simulate("sync", FLAT, **TWO).seconds)
    assert set(on_policy.staleness) == {0} and on_policy.cross_update == 0


def test_decode_cost_is_interpolated_between_measured_batch_sizes():
    c = sim.Costs({1: 0.02, 64: 0.03, 256: 0.08}, update_s_per_token=0.0)
    assert c.step_s(1) == pytest.approx(0.02) and c.step_s(64) == pytest.approx(0.03)
    assert c.step_s(160) == pytest.approx(0.055)
    assert c.step_s(512) == pytest.approx(0.08 + 0.05 * 256 / 192)  # extrapolated along the last segment


def test_on_a_long_tail_fully_async_beats_async_beats_sync():
    out = sim.run(sim.DEMO, steps=8)
    tps = {m: out[m]["trained_tokens_per_s"] for m in sim.MODES}
    assert tps["fully_async"] > tps["async"] > tps["sync"], tps
    fa = out["fully_async"]
    assert 0 < fa["staleness_sample_mean"] <= 1.5 and fa["cross_update_sample_frac"] > 0
    # samples beyond the bound are counted, not hidden (out-of-order completion can overtake the admission rule)
    r = sim.simulate("fully_async", sim.Costs(sim.DEMO["decode_s"], 2e-4, 1.0, 1.0, 2e-5, 64),
                     sim.lengths_from(sim.DEMO["lengths"]), 8, 8, 8, 256, max_staleness=1)
    assert r.over_bound == sum(s > 1 for s in r.staleness)


def test_unknown_mode_is_one_line():
    with pytest.raises(ValueError, match="mode='fast': choose from sync, async, fully_async"):
        sim.simulate("fast", FLAT, **TWO)


def test_sync_with_two_engines_waits_for_the_slower_half():
    # the hybrid engine's DP replicas: samples [3, 5, 3, 5] split [3, 5] | [3, 5], each half on its own engine
    two = dict(TWO, groups_per_step=2)
    r = sim.simulate("sync", FLAT, engines=2, **two)
    assert r.seconds == pytest.approx(2 * (5 + 1.6 + 0.5))
    # a skewed split: [9, 1] | [1, 1] -> the first engine's 9 steps
    assert sim.simulate("sync", FLAT, lengths=[9, 1, 1, 1], steps=1, groups_per_step=2, n=2, max_num_seqs=8,
                        engines=2).seconds == pytest.approx(9 + 1.2 + 0.5)
    # async splits each batch the same way: batch 1 (5), then sync + max(train, the next batch's slower half)
    assert sim.simulate("async", FLAT, engines=2, **two).seconds == pytest.approx(5 + (0.5 + 5) + (0.5 + 1.6))
    # fully_async pools the engines; on-policy it is still the sync schedule
    assert sim.simulate("fully_async", FLAT, engines=2, max_staleness=0, **two).seconds == pytest.approx(r.seconds)
    with pytest.raises(ValueError, match="engines=0: give the number of rollout engines"):
        sim.simulate("sync", FLAT, engines=0, **TWO)


def test_each_mode_takes_its_own_layout():
    inputs = {**sim.DEMO, "per_mode": {"async": {"update_s_per_token": 1e-3}}}
    out = sim.run(inputs, steps=3)
    assert out["async"]["trainer_busy_frac"] > sim.run(sim.DEMO, steps=3)["async"]["trainer_busy_frac"]
    assert out["sync"] == sim.run(sim.DEMO, steps=3)["sync"]


def test_bench_async_modes_turns_a_measured_run_into_the_simulators_inputs():
    """bench/async_modes.py: the trainer's cost is its update phases per trained token over steps 2.. (step 1 warms
    up), the weight sync the median, the lengths those sampled; sync's layout has two engines."""
    import types

    import async_modes

    hist = [{"tokens/actor_real": 100, "timing/old_log_prob_s": 50.0, "timing/update_actor_s": 50.0,
             "timing/weight_sync_s": 9.0},
            {"tokens/actor_real": 100, "timing/old_log_prob_s": 1.0, "timing/update_actor_s": 3.0,
             "timing/weight_sync_s": 1.0, "timing/gen_s": 99.0},
            {"tokens/actor_real": 300, "timing/update_actor_s": 8.0, "timing/reward_adv_s": 0.0,
             "timing/weight_sync_s": 3.0}]
    args = types.SimpleNamespace(groups=2, n=2)
    decode = {"decode_s": {"1": 0.1}, "prefill_s_per_token": 0.0}
    for mode, engines in (("sync", 2), ("fully_async", 1)):
        inputs = async_modes.sim_inputs({"name": mode, "history": hist, "lengths": [5, 7]}, decode, 10, args)
        assert inputs["update_s_per_token"] == pytest.approx(12 / 400) and inputs["update_s_fixed"] == 0
        assert inputs["weight_sync_s"] == 2.0 and inputs["engines"] == engines and inputs["lengths"] == [5, 7]
        out = sim.run(inputs, steps=2, modes=(mode,))
        assert out[mode]["trained_tokens_per_s"] > 0


def test_pooled_engines_share_the_active_samples_and_their_prefills():
    costs = sim.Costs({1: 1.0, 2: 1.5, 4: 3.0}, update_s_per_token=0.0, prefill_s_per_token=0.25, prompt_len=4)
    pool = sim.Engine(costs, max_num_seqs=2, engines=2)
    assert pool.free() == 4
    for length in (1, 2, 2, 2):
        pool.add(sim.Sample(0, length))
    dt, done = pool.advance(0)  # 2 samples per engine (1.5 s) + 4 prefills of 4 tokens shared by 2 engines
    assert dt == pytest.approx(1.5 + 4 * 0.25 * 4 / 2) and len(done) == 1
    dt, done = pool.advance(0)  # 3 left: the busier engine has 2
    assert dt == pytest.approx(1.5) and len(done) == 3


def test_a_split_keeps_each_prompts_samples_on_one_engine():
    # 3 groups of 2 over 2 engines: groups {0, 1} | {2}; the second group's long sample sets the first part's time
    r = sim.simulate("sync", FLAT, lengths=[1, 1, 1, 9, 2, 2], steps=1, groups_per_step=3, n=2, max_num_seqs=8,
                     engines=2)
    assert r.seconds == pytest.approx(9 + 1.6 + 0.5)
    assert sim._generate_split(FLAT, 8, 2, [], 0, 2) == 0.0
