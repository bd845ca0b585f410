"""trainer.mode=fully_async (#39, ppo/fully_async.py): the rollout pool generates continuously, weights reach
it while groups are in flight, admission keeps every trained sample within trainer.max_staleness. Real Ray,
real vLLM (one rollout worker), real megatron on the trainer tests' tiny config."""

from __future__ import annotations

import math

import pytest

from megappo.config.loader import ConfigError
from trainer_utils import config as _config, recording_updates, run as _run

FULLY_ASYNC = ["trainer.mode=fully_async", "resources.rollout_workers=1", "trainer.save_every=0",
               "trainer.export_hf=false"]


def _recording_groups(trained: list, steps: list = None):
    """A run's setup hook: each update's batch -> trained.append({group index: dataset index}) (and its step
    -> steps, when given)."""
    def setup(trainer):
        update = trainer._update

        def recorded(batch, timing):
            nt = batch.non_tensor_batch
            trained.append({int(g): int(i) for g, i in zip(nt["group"], nt["index"])})
            if steps is not None:
                steps.append(trainer._step)
            return update(batch, timing)

        trainer._update = recorded
    return setup


@pytest.mark.parametrize("overrides, expected", [
    (["trainer.max_staleness=-1"], "trainer.max_staleness=-1 must be >= 0"),
    (["resources.rollout_workers=2", "rollout.tp=2", "actor.lora.rank=4", "rollout.lora_sync=adapter"],
     "takes merged LoRA weights only .*set rollout.lora_sync=merged or rollout.tp=1"),
    (["trainer.mode=async", "trainer.partial_rollout=false"], "applies to trainer.mode=fully_async only"),
    (["trainer.mode=async", "algorithm.filter_groups.enable=true", "algorithm.adv_estimator=grpo",
      "critic.enable=false"], "which one-step async mode does not; use trainer.mode=sync or fully_async"),
])
def test_what_fully_async_does_not_do_yet_is_one_line(tiny_assets, data_dir, tmp_path, overrides, expected):
    with pytest.raises(ConfigError, match=expected) as e:
        _config(tiny_assets, data_dir, tmp_path, *FULLY_ASYNC, *overrides)
    assert "\n" not in str(e.value)


CP2 = [f"{role}.parallel.{k}={v}" for role in ("actor", "critic", "ref") for k, v in (("cp", 2), ("dp", 1))]


@pytest.mark.parametrize("pool", [
    # 65 s; CI keeps tp2 (the same driver, each group on one replica) and tp1 rollout workers in the tests below
    pytest.param([], marks=pytest.mark.long, id="tp1"),
    pytest.param(["resources.rollout_workers=2", "rollout.tp=2"], id="tp2"),
    # the trainer context parallel (every role CP2 x DP1): its weights reach the rollout pool once, from one CP
    # rank. Step 1 only: the actor's 2 mini-batches hold other rows at dp=1 (test_trainer's CP case)
    pytest.param(CP2, marks=pytest.mark.long, id="trainer_cp2")])
def test_max_staleness_0_trains_the_sync_runs_batches(sync_baseline, tiny_assets, data_dir, tmp_path, pool):
    """One batch admitted at a time, each group seeded as the sync run seeds it, trained on-policy: the
    sync baseline's first two steps (same prompts, same samples, same losses) within fp32 rounding; the
    weights reach the rollout worker over the sync group (fingerprint-checked), not the hybrid engine.
    tp2: one vLLM replica over two rollout workers, the second replaying the first's engine calls
    (rollout/lockstep.py): the same batches."""
    history = _run(_config(tiny_assets, data_dir, tmp_path / "fa0", *FULLY_ASYNC, "trainer.max_staleness=0",
                           "trainer.total_steps=2", *pool))
    base = sync_baseline[0]
    cp = pool is CP2
    for got, want in zip(history[:1] if cp else history, base[:2]):
        assert got["async/rollout_replicas"] == 1.0  # tp2: the two workers are one replica (checked: vLLM at TP2)
        assert got["async/sample_staleness_max"] == 0 and got["async/over_bound"] == 0
        assert got["rollout/weights_fingerprint_ok"] == 1.0
        assert got["objective/scores"] == pytest.approx(want["objective/scores"], abs=1e-6)  # the same samples
        actor = () if cp else ("loss/policy_avg", "policy/clipfrac_avg")
        for key in ("response_length/mean", "loss/value_avg", "objective/kl", "rollout/logprob_diff_max", *actor):
            assert math.isclose(got[key], want[key], rel_tol=1e-3, abs_tol=1e-4), (key, got[key], want[key])
    if cp:
        assert history[1]["rollout/weights_fingerprint_ok"] == 1.0  # step 1's CP-trained weights reached vLLM
        return
    assert history[1]["eval/verifiable_correct_rate"] == pytest.approx(base[1]["eval/verifiable_correct_rate"])


def test_stale_groups_within_the_bound_and_a_checkpoint_with_groups_in_flight(
        ray_session, tiny_assets, data_dir, tmp_path):
    """max_staleness=1, the decoupled loss, a checkpoint after every step. Two batches' groups start at
    version 0, so step 2 trains groups one version behind (corrected per token); no trained sample is ever
    more than 1 behind. At step 1's checkpoint 4 groups are trained and 4 more were generated at version 0:
    resumed from it, those 4 are regenerated (same prompts, same seeds, the resumed weights) and the run
    trains groups 0..11 once each, as the uninterrupted run does, each with the same prompt."""
    from megappo.utils.checkpoint import step_dir

    straight, resumed = [], []
    common = [*FULLY_ASYNC, "trainer.max_staleness=1", "trainer.total_steps=3", "trainer.val_every=0",
              "actor.policy_loss=decoupled"]
    history, _ = _run(_config(tiny_assets, data_dir, tmp_path / "a", *common, "trainer.save_every=1"),
                      setup=_recording_groups(straight))
    for h in history:
        print({k: round(v, 4) for k, v in h.items() if k.startswith("async/") or k in (
            "timing/rollout_wait_s", "timing/weight_sync_s", "timing/step_s")})
    assert [h["async/policy_version"] for h in history] == [0.0, 1.0, 2.0]
    assert history[0]["async/sample_staleness_max"] == 0
    assert history[1]["async/sample_staleness_max"] == 1  # admitted with step 1's groups, before any update
    for h in history:
        assert h["async/over_bound"] == 0 and h["async/sample_staleness_max"] <= 1
        assert h["rollout/weights_fingerprint_ok"] == 1.0 and h["rollout/weight_sync_bytes_received"] > 1e6
        assert math.isfinite(h["loss/policy_avg"])
    # the stale step's pi_old (proximal: the updated actor) differs from the sampler's log-probs
    assert history[1]["rollout/logprob_diff_max"] > 1e-3

    first = step_dir(tmp_path / "a" / "checkpoints", 1)
    _run(_config(tiny_assets, data_dir, tmp_path / "b", *common, f"trainer.resume={first}"),
         setup=_recording_groups(resumed))
    assert len(straight) == 3 and len(resumed) == 2
    once = [g for step in [straight[0], *resumed] for g in step]
    assert sorted(once) == list(range(12)) == sorted(g for step in straight for g in step)
    prompt = {g: i for step in straight for g, i in step.items()}
    assert all(prompt[g] == i for step in resumed for g, i in step.items())  # group g is the same prompt


def forced_pauses(monkeypatch, drained: bool) -> list:
    """Every weight update reaches the pool mid-sample, whatever the two sides' speeds. The groups a step would admit
    as it waits for its batch (GroupStream.next_batch) start instead just before the update's weights load
    (GroupStream.after_update, still at the version the load replaces: the same groups, seeds and bound); each
    replica's engine stops after the first step in which a request in flight has sampled (its stepping thread parks
    itself, as paused() makes it), is held paused, and resumes once the weights are loaded (the load runs inside the
    hold: those samples continue under the new weights), or, drained (trainer.partial_rollout=false), when the sync
    starts, which then waits for them. Returns the requests held mid-sample at each sync (0: every sample had
    finished, at step 1's, which admits nothing)."""
    import ray

    from megappo.ppo.fully_async import GroupStream

    # in a replica's leader (nested: Ray ships them by value); engine: its AsyncTokenEngine
    def arm(worker) -> None:
        engine = worker._stream.engine
        record = type(engine)._record

        def record_then_park(outputs, stepped_at):  # the stepping thread, under the step lock
            record(engine, outputs, stepped_at)
            if any(engine._token_versions.get(rid) for rid in engine._pending):  # sampled, not finished
                del engine._record
                with engine._resumed:
                    engine._pausing += 1  # paused()'s count: no step after this one until hold takes it over
                engine._parked = True

        engine._record = record_then_park

    def hold(worker) -> int:
        import contextlib
        import threading
        import time

        stream = worker._stream
        engine = stream.engine
        deadline = time.monotonic() + 300
        while not engine.__dict__.pop("_parked", False):
            if all(f.done() for _, _, futures, _ in stream._groups.values() for f in futures):
                engine.__dict__.pop("_record", None)  # nothing will sample: disarmed, no hold
                return 0
            assert time.monotonic() < deadline, "no request in flight sampled a token in 300 s"
            time.sleep(0.005)
        pause = contextlib.ExitStack()
        pause.enter_context(engine.paused())  # the step lock (reentrant: the weight load runs in this thread)
        with engine._resumed:
            engine._pausing -= 1  # the park's count, now held by the pause
        worker._forced_pause = (pause, threading.get_ident())
        return sum(1 for rid in engine._pending if engine._token_versions.get(rid))

    def unhold(worker) -> None:
        import threading

        pause, thread = worker.__dict__.pop("_forced_pause", (None, None))
        if pause is not None:
            assert thread == threading.get_ident(), "the actor ran two calls on two threads: the lock is another's"
            pause.close()

    def on_leaders(stream, fn) -> list:
        return ray.get([stream.pool.workers[r].__ray_call__.remote(fn) for r in stream.leaders], timeout=600)

    held, next_batch, after_update = [], GroupStream.next_batch, GroupStream.after_update

    def next_batch_admitting_nothing(self):
        if self.pending or self.done:  # groups started already (every step but the first): none admitted here
            self._admit = lambda: None
        try:
            return next_batch(self)
        finally:
            self.__dict__.pop("_admit", None)

    def after_update_mid_sample(self):
        on_leaders(self, arm)
        self._admit()  # before the version moves on (mgr.on_update): admitted as next_batch would have
        held.append(sum(on_leaders(self, hold)))
        if drained:
            on_leaders(self, unhold)
            return after_update(self)
        try:
            return after_update(self)
        finally:
            on_leaders(self, unhold)

    monkeypatch.setattr(GroupStream, "next_batch", next_batch_admitting_nothing)
    monkeypatch.setattr(GroupStream, "after_update", after_update_mid_sample)
    return held


PAUSES = {"partial": ["trainer.partial_rollout=true", "actor.proximal=loglinear"],
          "drained": ["trainer.partial_rollout=false"],
          # and one vLLM replica over two rollout workers (rollout.tp=2, rollout/lockstep.py): the second rank
          # replays the first's engine calls, loads each update's weights with it mid-sample, and re-prefills
          "recompute": ["trainer.partial_rollout=true", "trainer.pause_mode=recompute", "resources.rollout_workers=2",
                        "rollout.tp=2"]}


@pytest.mark.parametrize("pause", list(PAUSES))
def test_partial_rollouts_cross_weight_updates_within_the_bound(ray_session, tiny_assets, data_dir, tmp_path, pause,
                                                                monkeypatch):
    """Every update's weights reach the pool while admitted groups are mid-sample (forced_pauses: held there, not
    left to the pool being slower than the trainer). partial: those samples continue under the new weights
    (keep-KV pause): some trained tokens were sampled by a later version than their sample started with (per-token
    staleness below per-sample). recompute: the same, each sample in flight first re-prefilled under the new
    weights (async/recomputed_samples > 0 at a sync). trainer.partial_rollout=false: each sync first waits for them
    to finish, so no token is. recompute runs one vLLM replica over two rollout workers at rollout.tp=2 (the second
    replaying the first). Never over max_staleness=2. `partial` also takes pi_prox from A-3PO's interpolation
    (actor.proximal=loglinear): no forward before the update, and the behaviour weights of its stale tokens move
    off 1."""
    partial = pause != "drained"
    held = forced_pauses(monkeypatch, drained=not partial)
    # the trainer tests' 8-token responses do (a held sample has one token at least, and one more to come): partial
    # and drained run on the stale-groups test's warm workers (rollout.max_new_tokens builds vLLM's engine, and a
    # fully_async tp2 pool is never kept)
    history = _run(_config(tiny_assets, data_dir, tmp_path / "partial", *FULLY_ASYNC, "trainer.max_staleness=2",
                           "trainer.total_steps=5", "trainer.val_every=0", "actor.policy_loss=decoupled",
                           *PAUSES[pause]))
    # 5 steps: the groups started at syncs 2 and 3 (one version behind the load) are trained at steps 4 and 5
    print("held mid-sample at each sync:", held)
    for h in history:
        print({k: round(v, 4) for k, v in h.items() if k.startswith("async/") or k in (
            "response_length/mean", "timing/drain_s", "timing/weight_sync_s", "timing/step_s")})
        assert h["async/rollout_replicas"] == 1.0  # recompute: two workers at rollout.tp=2
        assert h["async/over_bound"] == 0 and h["async/sample_staleness_max"] <= 2
        assert h["rollout/weights_fingerprint_ok"] == 1.0 and math.isfinite(h["loss/policy_avg"])
    assert len(held) == 5 and all(held[1:]), held  # syncs 2-5 started groups, held mid-sample as the weights load
    if pause == "partial":  # loglinear: no pi_old forward; a token alpha > 0 has pi_prox / pi_behav != 1
        assert all("timing/old_log_prob_s" not in h for h in history)
        # the sampler/trainer gap from the update's first step (stale tokens: their policy lag in it), no max
        assert all("rollout/logprob_diff_max" not in h for h in history)
        # step 1 trains samples of the weights it holds (fp32 rounding only); later steps' stale tokens add the lag
        assert history[0]["rollout/logprob_diff_mean"] < 1e-5 < max(h["rollout/logprob_diff_mean"] for h in history)
        assert max(abs(h["actor/behav_weight_mean"] - 1) for h in history) > 1e-4
    recomputed = [h.get("async/recomputed_samples", 0) for h in history]
    # recompute: the samples held mid-sample at a sync are re-prefilled there (each sync's count in its step's row)
    assert (max(recomputed) > 0) == (pause == "recompute"), recomputed
    crossed = [h for h in history if h["async/cross_update_token_frac"] > 0]
    if not partial:  # samples were in flight at syncs 2-5 (held), and none spans an update: the drain finished them
        assert not crossed and all(h["async/staleness_mean"] == h["async/sample_staleness_mean"] for h in history)
        assert all("timing/drain_s" in h for h in history)
        return
    assert crossed, "no sample spanned a weight update"
    assert all("timing/drain_s" not in h for h in history)
    for h in crossed:  # a crossing sample's later tokens are fresher than the version it started at
        assert h["async/staleness_mean"] < h["async/sample_staleness_mean"]


@pytest.mark.long  # 140 s; CI keeps the checkpoint resume above (the restart path itself: test_fault_tolerance)
def test_a_rollout_worker_killed_mid_generation_is_replaced_and_its_groups_regenerated(
        ray_session, tiny_assets, data_dir, tmp_path):
    """SIGKILL the rollout worker while step 2 waits for its groups: every worker group comes up again, the
    run resumes from step 1's checkpoint and regenerates the groups that were in flight; groups 0..11 are
    trained once each over the run's surviving steps."""
    from test_fault_tolerance import _killer

    trained, steps, log = [], [], []

    def setup(trainer):
        _recording_groups(trained, steps)(trainer)
        trainer.fault_hook = _killer(trainer, {("rollout_wait", 2): ("rollout", 0, 0.3)}, log)

    history, trainer = _run(_config(tiny_assets, data_dir, tmp_path / "kill", *FULLY_ASYNC, "trainer.max_staleness=1",
                                    "trainer.total_steps=3", "trainer.val_every=0", "trainer.save_every=1",
                                    "trainer.async_save=false"), setup=setup)
    assert trainer.restarts == 1 and [e[1] for e in log] == ["rollout"], log
    # the kill lands 0.3 s into step 2's wait, or in its update when its groups were already there: an update
    # the restart rolls back (resume from step 1's checkpoint) is not one that survived, the redone step is
    survived = {step: groups for step, groups in zip(steps, trained)}  # a step's last update
    assert trainer.global_step == 3 and sorted(survived) == [1, 2, 3] and len(trained) in (3, 4), steps
    assert sorted(g for groups in survived.values() for g in groups) == list(range(12))


@pytest.mark.long  # 51 s; CI keeps ReMax's advantages (test_core_algos) and the pool's other calls in fully_async above
def test_remax_takes_its_greedy_baseline_from_the_pool(ray_session, tiny_assets, data_dir, tmp_path):
    """algorithm.adv_estimator=remax in fully_async: each batch's prompts get one greedy response from the pool
    (its newest weights) and every sample's advantage is its score minus that response's reward."""
    import torch

    captured, greedy = [], []

    def setup(trainer):
        advantages, generate = trainer._advantages, trainer._generate

        def recorded(batch, scores, baselines=None):
            out = advantages(batch, scores, baselines)
            b = batch.batch  # G_0: the whole response's reward (its score, plus KL penalties if in the reward)
            captured.append(((b["token_level_rewards"] * b["response_mask"]).sum(-1), baselines, b["advantages"],
                             b["response_mask"], list(batch.non_tensor_batch["uid"])))
            return out

        def generated(prompts, sampling, wg=None):  # the driver's own calls (the stream's groups are the pool's)
            greedy.append((list(prompts.non_tensor_batch["uid"]), sampling.do_sample, wg))
            return generate(prompts, sampling, wg)

        trainer._advantages, trainer._generate = recorded, generated

    from megappo.assets import ensure_assets
    from trainer_utils import REPO

    arith = ensure_assets(REPO / "assets", demo=True)["tiny-llama-arith"]  # warm-started: some answers right
    history, _ = _run(_config(tiny_assets, data_dir, tmp_path / "remax", *FULLY_ASYNC, "trainer.max_staleness=1",
                              "trainer.total_steps=2", "trainer.val_every=0", "algorithm.adv_estimator=remax",
                              "critic.enable=false", f"model.path={arith}"), setup=setup)
    assert len(captured) == 2 and len(history) == 2
    # one greedy response per prompt of each batch, from the pool (wg None: the rollout pool)
    assert [(sorted(uids), do_sample, wg) for uids, do_sample, wg in greedy] == \
        [(sorted(set(uids)), False, None) for *_, uids in captured]
    assert all(len(uids) == 8 and len(set(uids)) == 4 for *_, uids in captured)  # 4 prompts x rollout.n=2
    for score, baseline, adv, mask, _ in captured:
        print(f"rewards {score.tolist()} greedy baselines {baseline.tolist()}")
        assert baseline is not None and baseline.shape == score.shape
        first = mask.argmax(-1)  # ReMax's advantage is the same at every response token: (score - baseline)
        got = adv.gather(-1, first[:, None])[:, 0]
        torch.testing.assert_close(got, score - baseline, atol=1e-5, rtol=1e-5)
    every = torch.cat([torch.stack([s, b]) for s, b, *_ in captured], 1)
    assert len(set(every.flatten().tolist())) > 1  # rewards and baselines vary: the check above has teeth


# 45 s; CI keeps dynamic sampling's filter in a sync run (test_trainer's DAPO controls) and the stream's other calls
@pytest.mark.long
def test_dapo_filter_drops_groups_whose_responses_agree(ray_session, tiny_assets, data_dir, tmp_path):
    """algorithm.filter_groups in fully_async: each group is scored by its rule as it finishes and dropped when
    all its responses are equally right (metric=acc); its place goes to a new group. Every trained group has
    responses that differ, unless the per-batch drop budget ran out (then counted as topped up)."""
    trained_scores = []

    def setup(trainer):
        update = trainer._update

        def recorded(batch, timing):
            scores = batch.batch["token_level_scores"].sum(-1)
            by_uid = {}
            for u, s in zip(batch.non_tensor_batch["uid"], scores.tolist()):
                by_uid.setdefault(u, []).append(s)
            trained_scores.append(by_uid)
            return update(batch, timing)

        trainer._update = recorded

    from megappo.assets import ensure_assets
    from trainer_utils import REPO

    arith = ensure_assets(REPO / "assets", demo=True)["tiny-llama-arith"]  # warm-started: some answers right
    history, _ = _run(_config(tiny_assets, data_dir, tmp_path / "dapo", *FULLY_ASYNC, "trainer.max_staleness=1",
                              "trainer.total_steps=2", "trainer.val_every=0", "algorithm.adv_estimator=grpo",
                              "critic.enable=false", "algorithm.filter_groups.enable=true",
                              "algorithm.filter_groups.max_rounds=20", "algorithm.filter_groups.metric=score",
                              f"model.path={arith}"), setup=setup)
    for h, by_uid in zip(history, trained_scores):
        print({k: v for k, v in h.items() if k.startswith("dynamic_sampling/")},
              {u: [round(x, 2) for x in s] for u, s in by_uid.items()})
        assert h["dynamic_sampling/groups_topped_up"] == 0
        assert all(len(set(s)) > 1 for s in by_uid.values())  # every trained group can learn
    # each trained group was counted as varied when it finished, by its batch's report at the latest
    assert sum(h["dynamic_sampling/groups_varied"] for h in history) >= sum(map(len, trained_scores)) == 2 * 4
    assert sum(h["dynamic_sampling/groups_dropped"] for h in history) > 0  # the filter had something to drop


def _agent_run(tiny_assets, data_dir, tmp_path, agent_source: str, *extra) -> tuple[list, list, list]:
    """2 fully_async steps at max_staleness=1 whose samples are `agent_source`'s `run` (an agent module that
    appends each session to LOG): (history, each update's batch, the sessions the agent logged)."""
    import json

    log = tmp_path / "agent_log.jsonl"
    (tmp_path / "agent.py").write_text(f"LOG = {str(log)!r}\n" + agent_source)
    batches = []
    history, _ = _run(_config(tiny_assets, data_dir, tmp_path / "run", *FULLY_ASYNC, "trainer.max_staleness=1",
                              f"rollout.agent={tmp_path / 'agent.py'}:run", "rollout.max_new_tokens=40",
                              "data.max_prompt_length=200", "reward.non_stop_penalty=false", "trainer.total_steps=2",
                              "trainer.val_every=0", *extra),
                      setup=recording_updates(batches))
    return history, batches, [json.loads(line) for line in log.read_text().splitlines()]


@pytest.mark.parametrize("pool", [
    # CI keeps tp2 (the same agents on the same stream, plus the follower's replay); tp1 in `make test-all`
    pytest.param([], marks=pytest.mark.long, id="tp1"),
    pytest.param(["resources.rollout_workers=2", "rollout.tp=2"], id="tp2")])
def test_your_own_agent_streams_in_fully_async(ray_session, tiny_assets, data_dir, tmp_path, pool, fake_teacher):
    """rollout.agent in fully_async: each sample is the user's openai-SDK agent (tools=, a tool result between
    two calls) in its own gateway session on the rollout worker's stream, while weights load under it. Every
    trained row is exactly a session the agent ran (the gateway's prompt, the sampled ids, the tool tokens
    masked out), each sampled token carries the version that sampled it, every sample stays within the bound,
    and an agent that raises costs its sample only. tp2: one vLLM replica over two rollout workers; the agents'
    requests reach the leader's gateway and the follower replays its engine calls (rollout/lockstep.py). A
    teacher server beside the reward (on-policy distillation) scores every row as trained, the tool results
    as context only."""
    from distill_helpers import check_teacher_rows
    from megappo.config.schema import TeacherConfig
    from test_agent import SDK_AGENT

    teacher = fake_teacher()
    history, batches, sessions = _agent_run(tiny_assets, data_dir, tmp_path, SDK_AGENT,
                                            "rollout.multi_turn.tool_prompt='You can use tools: {tools}'",
                                            f"teacher.endpoint={teacher.url}", *pool)
    expected = set()
    for first, second in sessions:
        sent = first["prompt"] + first["sampled"]
        assert second["prompt"][:len(sent)] == sent  # the model's ids continued as sampled
        tool = second["prompt"][len(sent):]
        expected.add((tuple(first["prompt"]), tuple(first["sampled"] + tool + second["sampled"])))
    trained = []
    for h, batch in zip(history, batches):
        check_teacher_rows(batch)
        b = batch.batch
        rows, width = b["responses"].shape[0], b["prompts"].shape[1]
        assert h["distill/teacher_requests"] == -(-rows // TeacherConfig().rows_per_request)  # a batch prompt each
        errors = h["rollout/agent_errors"]
        assert 0 < errors < rows and h["objective/scores"] == pytest.approx(0.5 * (1 - errors / rows))
        assert h["async/sample_staleness_max"] <= 1 and h["rollout/agent_fallbacks"] == 0
        for i in range(rows):
            if b["response_mask"][i].sum() == 0:  # the agent raised: nothing trained
                assert (b["token_versions"][i] == -1).all()
                continue
            prompt = b["prompts"][i][b["attention_mask"][i, :width].bool()].tolist()
            n = int(b["attention_mask"][i, width:].sum())
            trained.append((tuple(prompt), tuple(b["responses"][i, :n].tolist())))
            model = b["response_mask"][i].bool()
            assert (b["token_versions"][i][model] >= 0).all() and (b["token_versions"][i][~model] == -1).all()
    print(f"{len(sessions)} sessions, {len(trained)} trained; staleness max "
          f"{[h['async/staleness_max'] for h in history]}, tokens across an update "
          f"{[h['async/cross_update_token_frac'] for h in history]}")
    assert trained and set(trained) <= expected  # token identity: what was trained is what the sessions sampled


def test_the_built_in_multi_turn_loop_streams_in_fully_async(ray_session, tiny_assets, data_dir, tmp_path):
    """rollout.multi_turn in fully_async: each sample runs its own turns on the worker's stream (AgentLoop.sample)
    with a forced calculator call, its tool tokens between the two model turns. max_staleness=0: one batch at a
    time, each sample seeded as the sync loop seeds it, so 2 steps give the same samples as a sync run of the
    same config (scores, model and tool token counts; losses within fp32 rounding), with staleness 0."""
    common = [*FULLY_ASYNC, "rollout.max_new_tokens=200", "data.max_prompt_length=300",
              "rollout.multi_turn.enable=true", "rollout.multi_turn.tool_choice=required",
              "rollout.multi_turn.tool_prompt='You can use tools: {tools}'", "reward.non_stop_penalty=false",
              "trainer.total_steps=2", "trainer.val_every=0"]
    sync = _run(_config(tiny_assets, data_dir, tmp_path / "sync", *common[1:], "trainer.mode=sync",
                        "trainer.max_staleness=0"))
    streamed = _run(_config(tiny_assets, data_dir, tmp_path / "fa", *common, "trainer.max_staleness=0"))
    for got, want in zip(streamed, sync):
        assert got["rollout/tool_calls_mean"] == 1.0 and got["rollout/turns_mean"] >= 2
        assert got["async/sample_staleness_max"] == 0 and got["async/over_bound"] == 0
        for key in ("objective/scores", "rollout/tokens_tool", "rollout/tokens_model", "response_length/mean"):
            assert got[key] == pytest.approx(want[key], rel=1e-6, abs=1e-6), (key, got[key], want[key])
        assert math.isclose(got["loss/policy_avg"], want["loss/policy_avg"], rel_tol=1e-3, abs_tol=1e-4)


def test_a_rewritten_history_streams_in_fully_async(ray_session, tiny_assets, data_dir, tmp_path):
    """rollout.agent in fully_async with an agent that rewrites its history on even rows (test_agent's
    REWRITING_AGENT): each later segment is a row of its own in its group, exactly as the gateway rendered and
    the engine sampled it, its model tokens carrying the versions that sampled them, within the bound."""
    from test_agent import REWRITING_AGENT, rewritten_sessions_rows, trained_rows

    history, batches, sessions = _agent_run(tiny_assets, data_dir, tmp_path, REWRITING_AGENT,
                                            "algorithm.adv_estimator=grpo")
    trained, later_rows = [], 0
    for h, batch in zip(history, batches):
        b = batch.batch
        later = b["agent_segment"] > 0
        # which groups a fully-async batch holds depends on arrival order: a batch may hold only unrewritten rows
        assert h["rollout/agent_segment_rows"] == int(later.sum())
        later_rows += int(later.sum())
        assert h["async/sample_staleness_max"] <= 1
        model = b["response_mask"].bool()
        assert (b["token_versions"][model] >= 0).all() and (b["token_versions"][~model] == -1).all()
        trained += trained_rows(b)
    assert later_rows > 0  # the rewrites reached the trainer as rows of their own
    assert trained and set(trained) <= set(rewritten_sessions_rows(sessions))  # groups still in flight: not all
