"""RayPPOTrainer: the PPO loop on the single controller (this process); the models live in Ray workers.

    trainer = RayPPOTrainer(config)        # tokenizer, datasets, reward managers, KL controller
    trainer.init_workers()                 # resource pools + worker groups + models + vLLM engines
    history = trainer.fit()                # the loop below; metrics to console/jsonl/tensorboard
    trainer.shutdown()

One step (`fit`), the whole RL loop in one screen:
  1. rollout     sync:  prompts -> actor group's `generate_sequences` (hybrid engine: the actor's
                        Megatron shards are resharded into each worker's vLLM, vLLM samples n per prompt)
                 async: take the batch launched during the previous step, push the current actor
                        weights to the rollout pool and launch the NEXT step's rollout, which then runs
                        while this step trains (open-instruct's Cleanba-style queue of depth 1)
  2. pi_old      actor `compute_log_prob` (Megatron, current weights) -> old_log_probs, entropy
                 (actor.use_rollout_log_probs: the sampler's log-probs instead, no forward)
  3. ref, values `compute_ref_log_prob` (frozen initial policy), critic `compute_values`; a teacher's
                 log-probs (on-policy distillation: the teacher group, or a server scoring meanwhile)
  4. reward      RewardManager (rules by data_source, non-stop penalty) [+ RM worker], then the KL
                 penalty in the reward (algorithm.use_kl_in_reward, fixed/adaptive beta); a generative
                 judge started on the rows as they came (ppo/judge_overlap.py), waited for here
  5. advantages  on this process (core_algos: GAE / GRPO / RLOO / REINFORCE++), plus the teacher's
                 per-token term -distill_coef * (log pi - log pi_teacher) (OPD: that term alone)
  6. updates     critic `update_critic`, actor `update_actor` (ppo_epochs x mini-batches; the loss
                 normaliser is the mini-batch's global token count, computed once per mini-batch)
  7. metrics (ppo/metrics.py, open-instruct names), validation every trainer.val_every steps,
     checkpoint every trainer.save_every steps.

Off-policy correction: `rollout_log_probs` (the sampler's own log-probs) always travel to
`update_actor`, which weights each token's clipped loss by min(pi_old / pi_rollout, 2)
(losses.compute_importance_weights, truncated IS). Sync mode: pi_rollout is vLLM on the same
weights, so the weights only absorb the vLLM/Megatron numeric gap (~1 on CPU fp32). Async mode: the
batch was sampled one optimizer step ago, so they also correct that lag; rollout/tis_* and
rollout/logprob_diff_* show how large it is.

Async mode (trainer.mode=async, resources.rollout_workers >= 1): rollout workers are a separate pool
of vLLM-only processes; the actor group has no vLLM. Weights go actor -> rollout over one collective
group spanning both pools (workers/rollout/weight_sync.py: every actor rank reshards to full HF
tensors, actor rank 0 broadcasts them bucket by bucket, each rollout worker loads them into vLLM and
checks the weight fingerprints). Overlap shows in timing/*: rollout_s (generation time on the rollout
pool), rollout_wait_s (what the driver still waited for it), rollout_overlap_s = rollout_s - wait.

Reproducibility: sampling is seeded from (trainer.seed, step) — vLLM per-request seeds — so a run
resumed from a step-k checkpoint (sync mode) repeats the uninterrupted run's steps k+1.. exactly.
The worker groups (pools, roles fused into processes, models, vLLM engines, teardown) are
ppo/workers.py's WorkersMixin; checkpoints (save in the background, resume, export, a full disk) are
ppo/checkpointing.py's CheckpointingMixin; the reward curve PNG is ppo/reward_curve.py's. An async run resumes from the
checkpoint's weights with a fresh pipeline (its first resumed step is on-policy).
"""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path
from typing import Callable, Optional

import torch

from megappo.agent.loop import agent_metrics
from megappo.agent.environment import Environments
from megappo.data.dataset import RLHFDataset
from megappo.data.images import processor_for
from megappo.data.sampler import EpochSampler
from megappo.ppo import core_algos as algos
from megappo.ppo.checkpointing import CheckpointingMixin
from megappo.ppo.dynamic_sampling import filter_groups
from megappo.ppo.losses import PolicyLoss, ValueLoss
from megappo.ppo.metrics import CONSOLE_KEYS, distill_metrics, eval_metrics, kl_metrics, step_metrics
from megappo.ppo.reward_curve import plot_reward_curve
from megappo.ppo.rollout_guard import RolloutGapError, RolloutGuard, on_policy_gap, update_gap
from megappo.ppo.run_control import PreemptionSignals, StepProgress
from megappo.ppo.segments import Segments
from megappo.ppo.staleness import batch_token_versions, loglinear_proximal_alpha
from megappo.ppo.teacher_endpoint import TeacherEndpoint, place, rows_of
from megappo.ppo.workers import WorkersMixin
from megappo.models.routing_replay import ROUTES
from megappo.models.vision import IMAGE_KEYS
from megappo.parallel.model_dims import language_config
from megappo.protocol import DataProto
from megappo.ppo.judge_engine import start_judges
from megappo.ppo.judge_overlap import JudgeOverlap
from megappo.rewards.manager import RewardManager
from megappo.rewards.rules import load_rewards
from megappo.utils.checkpoint import PendingCheckpoint
from megappo.workers.rollout.sampling import SamplingSpec

_MODEL_IN = ["input_ids", "attention_mask", "position_ids", "responses"]


def _model_in(b: dict) -> list:
    """What every model role reads of the rows: _MODEL_IN, and a vision-language model's images (models/vision.py)."""
    return _MODEL_IN + [k for k in IMAGE_KEYS if k in b]


@contextlib.contextmanager
def _timer(name: str, timing: dict):
    t0 = time.perf_counter()
    yield
    timing[name] = timing.get(name, 0.0) + time.perf_counter() - t0


class _Inflight:
    """An async rollout in flight on the rollout pool."""

    def __init__(self, call, step: int, sync_metrics: dict, version: int):
        self.call, self.step, self.sync_metrics = call, step, sync_metrics
        self.version = version  # the actor's updates when its weights were pushed: the policy that samples it

    def result(self) -> DataProto:
        out = self.call.result()[0]
        out.meta_info["policy_version"] = self.version
        return out


def prompts_of(batch: DataProto) -> DataProto:
    """One row per group (uid) of a generated batch: its prompt as the rollout took it, with the group's
    non-tensor fields (ground truth, data source) for the reward rules."""
    uids = batch.non_tensor_batch["uid"]
    first = sorted({u: i for i, u in reversed(list(enumerate(uids)))}.values())
    b, width = batch.batch, batch.batch["prompts"].shape[1]
    return DataProto.from_dict({"input_ids": b["prompts"][first], "attention_mask": b["attention_mask"][first, :width],
                                "position_ids": b["position_ids"][first, :width]},
                               {k: v[first] for k, v in batch.non_tensor_batch.items()})


class RayPPOTrainer(WorkersMixin, CheckpointingMixin):
    def __init__(self, config, tokenizer=None, reward_fn=None, val_reward_fn=None, show_progress: bool = True,
                 warm=None):
        """`warm`: a ppo/workers.WarmWorkers to take workers from and hand them back to (tests, sweeps)."""
        from transformers import AutoTokenizer

        self.config = cfg = config
        self.warm = warm
        self.clean_finish = False  # fit returned (the workers are fit for another run: WarmWorkers)
        self.tokenizer = tokenizer or AutoTokenizer.from_pretrained(str(cfg.model.tokenizer or cfg.model.path))
        r = cfg.reward
        # the config's own: reward.rules, the code source's reward.code, reward.combine's weighted sources
        stops, rules = list(cfg.rollout.stop_token_ids), load_rewards(r)
        self.reward_fn = reward_fn or RewardManager(self.tokenizer, r.num_examine, r.non_stop_penalty,
                                                    r.non_stop_penalty_value, scorers=rules, stop_token_ids=stops,
                                                    overlong_buffer_len=r.overlong_buffer_len,
                                                    overlong_penalty_factor=r.overlong_penalty_factor,
                                                    max_response_length=cfg.rollout.max_new_tokens)
        self.val_reward_fn = val_reward_fn or RewardManager(self.tokenizer, 0, r.non_stop_penalty,
                                                            r.non_stop_penalty_value, scorers=rules,
                                                            stop_token_ids=stops)
        # multi-turn and your own agent: each row's environment (its tools, its trajectory reward) by data_source
        self.environments = None
        if cfg.rollout.multi_turn.enable or cfg.rollout.agent:
            self.environments = Environments(cfg.rollout.multi_turn, self.reward_fn.scorers)
            for fn in (self.reward_fn, self.val_reward_fn):
                if isinstance(fn, RewardManager) and fn.environments is None:
                    fn.environments = self.environments
        # the built-in loop shows each row its environment's tools; your own agent sends the tools it has
        d, tools = cfg.data, (self.environments.prompt_args() if cfg.rollout.multi_turn.enable else {})
        tools["processor"] = processor_for(cfg.model.path)  # a vision-language model's prompts carry their images
        self.train_dataset = RLHFDataset(list(d.train_files), self.tokenizer, d.prompt_key, d.max_prompt_length,
                                         d.apply_chat_template, **tools)
        self.val_dataset = RLHFDataset(list(d.val_files), self.tokenizer, d.prompt_key, d.max_prompt_length,
                                       d.apply_chat_template, **tools) if d.val_files else None
        self.sampler = EpochSampler(len(self.train_dataset), d.train_batch_size, seed=cfg.trainer.seed,
                                    shuffle=d.shuffle)
        self._check_inputs()
        self._sampler_before: dict[int, dict] = {}  # step -> sampler state before drawing its prompts
        self.kl_ctrl = algos.make_kl_controller(cfg.algorithm)
        self.sampling = SamplingSpec.from_config(cfg.rollout)  # how training rollouts sample (seeded per step)
        self.policy_loss = PolicyLoss.from_config(cfg.actor)
        self.value_loss = ValueLoss.from_config(cfg.critic)
        self.async_mode = cfg.trainer.mode != "sync"  # async | fully_async: a rollout pool of its own
        self.fully_async = cfg.trainer.mode == "fully_async"
        self.stream = None  # fully_async: ppo/fully_async.GroupStream, made per _fit_once
        self._stream_resume: Optional[dict] = None  # fully_async: a checkpoint's GroupStream.state_dict()
        self.output_dir = Path(cfg.trainer.output_dir)
        self.ckpt_root = self.output_dir / "checkpoints"
        self.show_progress = show_progress
        self.global_step = 0
        self.groups: list = []
        self.startup_s: dict = {}  # init_workers' stages, seconds
        self.restarts = 0  # worker-group restarts in this process (fit)
        self.steps_redone = 0  # steps completed before a failure and done again after its restart
        self._failed_at: Optional[int] = None
        self.preempted = False  # fit stopped on SIGTERM / SIGUSR1 after checkpointing
        self.fault_hook: Optional[Callable[[str, int], None]] = None  # tests: fault_hook(phase, step)
        self._step = 0
        self._saved_steps: list[int] = []  # checkpoints this process wrote (a restart resumes from them)
        self._unfinished: Optional[PendingCheckpoint] = None  # a save its workers still write (async_save)
        self._initial_state = self._driver_state(0)
        # SIGTERM / SIGUSR1 from now on: finish the step in flight, checkpoint, stop (fit)
        self.preemption = PreemptionSignals().install()
        self.actor_wg = self.critic_wg = self.ref_wg = self.rm_wg = self.teacher_wg = self.rollout_wg = None
        # on-policy distillation's teacher behind a server (teacher.model is a worker group: init_workers)
        self.teacher_endpoint = TeacherEndpoint.from_config(cfg.teacher) if cfg.teacher.endpoint else None
        if self.teacher_endpoint is not None:
            self.teacher_endpoint.check()  # there, and its model named, before any worker starts
        self.resource_pool_manager = None
        self._plotting: Optional[threading.Thread] = None  # fit's reward_curve.png, drawn in the background
        # reward.judge.model: the judge's own engine, once, after every check and before any worker (shutdown stops it)
        self.judges = start_judges(rules)
        self.judge_overlap = JudgeOverlap.of(self.reward_fn, r.judge.overlap)  # the judge starts as the rows come

    def shutdown(self, stop_ray: bool = False) -> None:
        """WorkersMixin.shutdown, the judge's own engine (reward.judge.model) first."""
        for judge in [self.judge_overlap, *self.judges]:
            if judge is not None:
                judge.close()
        super().shutdown(stop_ray)

    def _check_inputs(self) -> None:
        """Before any worker starts: the tokenizer fits the model, and every data_source has a reward rule
        (your own agent: an environment; multi-turn: an environment, which the datasets checked row by row)."""
        from transformers import AutoConfig

        m = self.config.model
        vocab = language_config(AutoConfig.from_pretrained(str(m.path))).vocab_size
        if len(self.tokenizer) > vocab:
            raise ValueError(f"the tokenizer ({m.tokenizer or m.path}) has {len(self.tokenizer)} tokens but the model "
                             f"({m.path}) has vocab_size {vocab}: they do not belong together; use the model's own "
                             "tokenizer (model.tokenizer)")
        if self.config.rollout.multi_turn.enable:
            return
        check = self.environments.get if self.environments else self.reward_fn.scorer_for
        for ds in (self.train_dataset, self.val_dataset):
            for source in sorted({str(r["data_source"]) for r in ds.rows} if ds is not None else ()):
                check(source)  # a ValueError naming the known rules (environments) and how to add one

    # ---- the loop ----------------------------------------------------------------------------------

    def fit(self) -> list[dict]:
        """Train to trainer.total_steps; returns one metrics dict per step done in this call.

        Survives what a cluster does to a job: a dead or hung worker (WorkerError: a process died, or a
        phase outlived trainer.phase_timeout_s) tears every worker group down, brings them up again and
        resumes from the newest complete checkpoint (or the start), at most trainer.max_restarts times
        in a row; SIGTERM / SIGUSR1 (Slurm's warning before a time limit or preemption) finishes the
        step in flight, checkpoints it at once and returns with `self.preempted` set."""
        from megappo.controller.resource_pool import WorkerError

        history: dict[int, dict] = {}
        self.clean_finish = False
        failures, first_cause, mark, restart = 0, None, self.global_step, False
        while True:
            try:
                if restart:  # every group torn down and brought up again (a failing bring-up counts too)
                    self._teardown_workers()
                    self.init_workers()
                    restart = False
                self._fit_once(history, self.preemption)
                break
            except RolloutGapError:  # the guard stopped the run between two worker calls: the workers are sound,
                self.finish_checkpoint()  # and the previous step's background save is made whole
                self.clean_finish = not self.async_mode  # (the async modes have a rollout in flight)
                raise
            except Exception as err:  # noqa: BLE001 - a worker failure restarts; anything else propagates
                self._abandon_checkpoint()  # its writers may be dead: never commit what they left
                e = err if isinstance(err, WorkerError) else self._dead_worker_behind(err)
                if e is None:
                    raise
                if self.global_step > mark:  # the last restart made progress: count afresh
                    failures, first_cause = 0, None
                failures, first_cause, mark = failures + 1, first_cause or e, self.global_step
                if failures > self.config.trainer.max_restarts:
                    raise WorkerError(f"giving up after {failures - 1} restarts in a row "
                                      f"(trainer.max_restarts={self.config.trainer.max_restarts}); first cause: "
                                      f"{first_cause}") from first_cause
                print(f"megappo: worker failure in step {self._step}: {e}; restart {self.restarts + 1} "
                      f"({failures}/{self.config.trainer.max_restarts} in a row): bringing every worker group up "
                      "again and resuming from the newest complete checkpoint", flush=True)
                self.restarts += 1
                self._failed_at = self.global_step if self._failed_at is None else self._failed_at
                restart = True
        rows = [history[s] for s in sorted(history)]
        if self.config.trainer.export_hf and not self.preempted and self.global_step == self.config.trainer.total_steps \
                and rows:
            self.export_final(self.global_step)
        # the PNG is drawn while the workers and Ray shut down (matplotlib's import alone is ~1 s): shutdown() waits
        self._wait_for_plot()
        self._plotting = threading.Thread(target=plot_reward_curve, args=(self.output_dir,), name="reward-curve")
        self._plotting.start()
        self.clean_finish = True
        return rows

    def _wait_for_plot(self) -> None:
        if self._plotting is not None:
            self._plotting.join()
            self._plotting = None

    def _fit_once(self, history: dict, preempt) -> None:
        """Resume (checkpoint, or the start), then step until total_steps or a preemption signal."""
        from megappo.utils.tracking import Tracking

        cfg, total = self.config, self.config.trainer.total_steps
        self._resume()
        self.rollout_guard = RolloutGuard.from_config(cfg, self.on_gpu())  # each fit (a restart too) checks afresh
        if self._failed_at is not None:
            self.steps_redone += self._failed_at - self.global_step
            self._failed_at = None
        start = time.perf_counter()
        inflight = self._launch_rollout(self.global_step + 1) \
            if self.async_mode and not self.fully_async and self.global_step < total else None
        if self.fully_async:
            from megappo.ppo.fully_async import GroupStream, StreamSource

            resume, self._stream_resume = self._stream_resume, None
            self.stream = GroupStream(StreamSource(
                config=cfg, pool=self.rollout_wg, version=self.global_step, sampler=self.sampler,
                dataset=self.train_dataset, sampling=self.sampling, seed_for=self._sampling_for,
                score_rows=self.reward_fn.score_rows, sync_weights=self._sync_rollout_weights,
                pad_id=self.tokenizer.pad_token_id or 0, resume=resume,
                on_group=self.judge_overlap.submit if self.judge_overlap else None))
        with StepProgress(total, self.global_step, self.show_progress,
                       algos.algorithm_name(cfg.algorithm.adv_estimator)) as progress, \
                Tracking(cfg.trainer.project, cfg.trainer.experiment, self.output_dir, list(cfg.trainer.loggers),
                         config=cfg, console=progress.console, resume_step=self.global_step,
                         console_keys=CONSOLE_KEYS) as tracker:
            for step in range(self.global_step + 1, total + 1):
                metrics, inflight = self._run_step(step, inflight, start)
                # 7. the previous step's background save made whole, validation, checkpoint (written
                #    in the background unless it is the last step or a preemption), logging
                with _timer("timing/save_s", metrics):
                    self.finish_checkpoint()
                if cfg.trainer.val_every and (step % cfg.trainer.val_every == 0 or step == total):
                    metrics.update(self.validate())
                # the signal is read once per step: one arriving after this point stops the next step
                # (read twice, a signal landing between a background save and the stop would end the
                # run with that save unfinished, or with none for this step)
                stop = preempt.is_set()
                if self._saves_at(step) or stop:
                    with self._phase("save", metrics):
                        self.save_checkpoint(step, wait=not cfg.trainer.async_save or step == total or stop)
                metrics["trainer/restarts"] = float(self.restarts)
                tracker.log(metrics, step)
                history[step] = metrics
                progress.advance(metrics)
                if stop:
                    self.preempted = True
                    print(f"megappo: {preempt.name} received: stopped after step {step}, checkpoint written; "
                          "run the same command again (or requeue) to resume", flush=True)
                    return

    def _run_step(self, step: int, inflight, start: float):
        """Steps 1-6 of the loop (module docstring) for `step`; returns (metrics, next in-flight rollout)."""
        cfg, total = self.config, self.config.trainer.total_steps
        self._step = step
        t0, timing, counts = time.perf_counter(), {}, {}  # timing/*: seconds (and the teacher server's counts)
        # 1. rollout (async: the batch launched last step; launch the next one before training)
        baselines = None
        if self.stream is not None:  # fully_async: finished groups that keep every sample within the bound
            with self._phase("rollout_wait", timing):
                batch = self.stream.next_batch()
            if cfg.algorithm.adv_estimator == "remax":  # the greedy baseline under the pool's newest weights
                with self._phase("gen_baseline", timing):
                    baselines = self._greedy_baselines(prompts_of(batch), batch)
        elif inflight is None:
            prompts = self._next_prompts(step)
            with self._phase("gen", timing):
                batch = self._generate(prompts, self._sampling_for(step))
            if cfg.algorithm.filter_groups.enable:  # DAPO dynamic sampling: only groups that can learn
                with self._phase("filter_groups", timing):
                    batch = self._filter_groups(batch, step, counts)
            if cfg.algorithm.adv_estimator == "remax":
                with self._phase("gen_baseline", timing):
                    baselines = self._greedy_baselines(prompts, batch)
        else:
            with self._phase("rollout_wait", timing):
                batch = inflight.result()
            timing.update(inflight.sync_metrics)
            with self._phase("launch", timing):
                inflight = self._launch_rollout(step + 1) if step < total else None
        gen_metrics = batch.meta_info.pop("metrics", {})
        if self.judge_overlap is not None and self.stream is None:  # the batch came whole: judged from now on
            self.judge_overlap.submit(batch)
        self._report_agent_errors(step, batch)
        # 2-3. pi_old (+ entropy), reference log-probs, values of the sampled tokens; the guard: a rollout that is
        #      not the policy stops the run here, before anything trains on it (ppo/rollout_guard.py)
        batch = self._score_tokens(batch, timing)
        pi_old_recomputed = PolicyLoss.recomputes_old_log_probs(cfg.actor)
        if pi_old_recomputed:
            counts.update(self.rollout_guard.check(step, on_policy_gap(batch, self.global_step)))
        # 4-5. rewards (+ KL penalty) and advantages, here on the driver
        with self._phase("reward_adv", timing):
            scores, reward_metrics = self._rewards(batch, timing)
            kl = self._advantages(batch, scores, baselines)
        # 6. critic and actor updates
        critic_metrics, actor_metrics = self._update(batch, timing)
        if not pi_old_recomputed:  # the gap the update's first mini-batch measured, when the batch is on-policy
            gap = update_gap(batch, self.global_step, actor_metrics)
            counts.update(self.rollout_guard.check(step, gap, "the update"))
        if self.stream is not None:  # 6b. the new weights to the rollout pool, its generation in flight
            timing.update(self.stream.after_update())
        self.global_step = step
        timing["timing/step_s"] = time.perf_counter() - t0
        teacher_s = timing.get("timing/teacher_wait_s", timing.get("timing/teacher_s"))
        if teacher_s is not None:  # the step's time spent waiting on the teacher
            timing["distill/teacher_share"] = teacher_s / timing["timing/step_s"]
        if self.async_mode and not self.fully_async:  # how much of the rollout hid behind the previous step's training
            rollout_s = gen_metrics.get("timing/rollout_s", 0.0)
            timing["timing/rollout_overlap_s"] = max(0.0, rollout_s - timing["timing/rollout_wait_s"])
            timing["timing/rollout_overlap_frac"] = timing["timing/rollout_overlap_s"] / max(rollout_s, 1e-9)
        metrics = step_metrics(step=step, batch=batch, reward_metrics=reward_metrics, kl=kl,
                               actor=actor_metrics, critic=critic_metrics,
                               pi_old_recomputed=pi_old_recomputed,
                               prompts_per_step=cfg.data.train_batch_size,
                               responses_per_step=cfg.data.train_batch_size * cfg.rollout.n,
                               dataset_size=len(self.train_dataset), step_s=timing["timing/step_s"],
                               since_start_s=time.perf_counter() - start)
        metrics.update(gen_metrics)
        metrics.update(counts)
        metrics.update(timing)
        return metrics, inflight

    @contextlib.contextmanager
    def _phase(self, name: str, timing: dict):
        """Time a phase into timing/<name>_s (a test's fault_hook(name, step) runs first)."""
        if self.fault_hook is not None:
            self.fault_hook(name, self._step)
        with _timer(f"timing/{name}_s", timing):
            yield

    # ---- 1. rollout ----------------------------------------------------------------------------------

    def _report_agent_errors(self, step: int, batch: DataProto) -> None:
        """Your own agent's failures made visible beside their count (rollout/agent_errors): the step's distinct
        errors, the 3 most frequent on the console, every one in <output_dir>/agent_errors.log."""
        from collections import Counter

        turns = batch.non_tensor_batch.get("agent_turns")
        if turns is None:
            return
        segments = Segments.of(batch)  # a sample's later rows repeat its turns: each sample once
        rows = segments.primary if segments is not None else range(len(turns))
        errors = Counter(" ".join(str(t.get("text", "")).split()) for i in rows for t in turns[i]
                         if t.get("role") == "error")
        if not errors:
            return
        log = self.output_dir / "agent_errors.log"
        with open(log, "a", encoding="utf-8") as f:
            f.writelines(f"step {step}: {n} x {text}\n" for text, n in errors.most_common())
        shown = "; ".join(f"{n} x {text[:300]}" for text, n in errors.most_common(3))
        print(f"megappo: step {step}: your agent failed on {sum(errors.values())} sample(s): {shown} (all: {log})",
              flush=True)

    def _next_prompts(self, step: int) -> DataProto:
        self._sampler_before[step] = self.sampler.state_dict()
        return self.train_dataset.get_batch(next(self.sampler))

    def _sampling_for(self, step: int) -> SamplingSpec:
        """Per-step sampling seed: a step's rollout depends only on (trainer.seed, step) and the weights."""
        return self.sampling.with_seed((self.config.trainer.seed * 1_000_003 + step * 10_007) % (1 << 31))

    def _generate(self, prompts: DataProto, sampling: SamplingSpec, wg=None) -> DataProto:
        prompts.meta_info["sampling"] = sampling
        return (wg or self.rollout_wg).generate_sequences(prompts)[0]

    def _filter_groups(self, batch: DataProto, step: int, counts: dict) -> DataProto:
        """DAPO's dynamic sampling (ppo/dynamic_sampling.py): more prompts of this step until
        data.train_batch_size of them have responses that differ."""
        def draw_more(rnd: int) -> DataProto:
            seed = (self._sampling_for(step).seed + rnd * 1_000_003) % (1 << 31)
            more = self.train_dataset.get_batch(next(self.sampler))
            part = self._generate(more, self._sampling_for(step).with_seed(seed))
            part.meta_info.pop("metrics", None)
            return part

        kept, drawn = filter_groups(batch, self.config.data.train_batch_size, self.config.algorithm.filter_groups,
                                    draw_more, lambda part: self.reward_fn.score_rows(part, keep=True, examine=False),
                                    self.tokenizer.pad_token_id or 0)
        counts.update(drawn)
        return kept

    def _sync_rollout_weights(self, receive: str = "receive_weights", *args) -> dict:
        """Async: actor -> rollout pool over the weight-sync group (both sides at once; fully_async's pool
        receives with stream_receive_weights, between two engine steps)."""
        from megappo.controller.worker_group import first_failure

        t0 = time.perf_counter()
        send = self.actor_wg.submit("send_weights")
        recv = self.rollout_wg.submit(receive, *args)
        first_failure(send, recv)  # one side failing leaves the other in the broadcast: its error, at once
        sent, everyone = send.result()[0], recv.result()
        received = dict(everyone[0])
        if any("async/recomputed_samples" in r for r in everyone):  # re-prefilled samples, over the pool
            received["async/recomputed_samples"] = sum(r.get("async/recomputed_samples", 0.0) for r in everyone)
        return {"timing/weight_sync_s": time.perf_counter() - t0, **sent, **received}

    def _launch_rollout(self, step: int) -> _Inflight:
        """Async: push the actor's current weights, then start `step`'s rollout without waiting."""
        sync = self._sync_rollout_weights()
        prompts = self._next_prompts(step)
        prompts.meta_info["sampling"] = self._sampling_for(step)
        return _Inflight(self.rollout_wg.submit("generate_sequences", prompts), step, sync, self.global_step)

    # ---- 2-6. scoring, rewards, advantages, updates --------------------------------------------------

    def _score_tokens(self, batch: DataProto, timing: dict) -> DataProto:
        # actor.router_replay=r3: the rollout's MoE routes go with the rows (the actor's pi_old forward replays them)
        routes = [ROUTES] if ROUTES in batch.batch and self.config.actor.router_replay == "r3" else []
        model_in = batch.select(batch_keys=_model_in(batch.batch) + routes, non_tensor_keys=[],
                                meta_info_keys=["sampling"])
        b = batch.batch
        teacher = None  # a teacher server scores while the workers run pi_old and the reference
        if self.teacher_endpoint is not None:
            teacher = self.teacher_endpoint.submit(rows_of(b["input_ids"], b["attention_mask"]))
        if not PolicyLoss.recomputes_old_log_probs(self.config.actor):  # pi_old = the sampler's log-probs
            batch.batch["old_log_probs"] = batch.batch["rollout_log_probs"]
            if self.config.actor.proximal == "loglinear":  # A-3PO: pi_prox interpolated in the loss
                versions = batch_token_versions(batch, self.global_step)
                batch.batch["prox_alpha"] = loglinear_proximal_alpha(versions, self.global_step)
        else:
            with self._phase("old_log_prob", timing):
                batch.batch.update(self.actor_wg.compute_log_prob(model_in).batch)
        if self.ref_wg is not None:
            with self._phase("ref", timing):
                batch.batch.update(self.ref_wg.compute_ref_log_prob(model_in).batch)
        if self.critic_wg is not None:
            with self._phase("values", timing):
                batch.batch.update(self.critic_wg.compute_values(model_in).batch)
        if self.rm_wg is not None:
            with self._phase("rm", timing):
                batch.batch.update(self.rm_wg.compute_rm_score(model_in).batch)
        if self.teacher_wg is not None:
            with self._phase("teacher", timing):
                batch.batch.update(self.teacher_wg.compute_teacher_log_prob(model_in).batch)
        elif teacher is not None:
            with self._phase("teacher_wait", timing):
                log_probs, stats = teacher.result()
            b["teacher_log_prob"] = place(log_probs, b["attention_mask"], b["prompts"].shape[1])
            timing.update(stats.metrics())
        return batch

    def _greedy_baselines(self, prompts: DataProto, batch: DataProto) -> torch.Tensor:
        """ReMax: each row's baseline is the reward of its prompt's greedy response (same weights; fully_async:
        the pool's weights when the batch is taken, up to max_staleness versions newer than the samples'. A
        baseline that depends on the prompt only leaves the policy gradient unbiased either way)."""
        greedy = self._generate(prompts.select(meta_info_keys=[]), self.sampling.greedy())
        greedy.meta_info.pop("metrics", None)
        segments = Segments.of(greedy)
        if segments is not None:  # rollout.agent rewrote its history: the greedy sample's first row is the sample
            greedy = greedy[segments.primary]
        scores, _ = self.val_reward_fn(greedy)  # the training rules, no samples printed
        by_uid = dict(zip(greedy.non_tensor_batch["uid"], scores.sum(-1).tolist()))
        return torch.tensor([by_uid[u] for u in batch.non_tensor_batch["uid"]], dtype=torch.float32, device="cpu")

    def _rewards(self, batch: DataProto, timing: dict) -> tuple[torch.Tensor, dict]:
        """Token-level scores: each sample scored once (a later segment's row: its sample's score, segments.py)."""
        segments = Segments.of(batch)  # rollout.agent's rewritten histories: rows of their own
        samples = batch if segments is None else batch[segments.primary]
        if self.judge_overlap is not None:  # what the judge, started as the rows came, has still to do
            timing.update(self.judge_overlap.take(samples))
        scores, metrics = self.reward_fn(samples)
        return (scores if segments is None else segments.scores(scores, batch.batch["response_mask"])), metrics

    def _advantages(self, batch: DataProto, scores: torch.Tensor, baselines: Optional[torch.Tensor] = None) -> dict:
        a, b, segments = self.config.algorithm, batch.batch, Segments.of(batch)
        mask = b["response_mask"]
        kl = {}
        if "ref_log_prob" in b and a.use_kl_in_reward:
            rewards, kl = algos.apply_kl_penalty(scores, b["old_log_probs"], b["ref_log_prob"], mask, self.kl_ctrl,
                                                 a.kl_penalty)
        else:
            rewards = scores
            if "ref_log_prob" in b:
                kl = kl_metrics(b["old_log_probs"], b["ref_log_prob"], mask.float(), 0.0, a.kl_penalty)
        if segments is None or a.adv_estimator in algos.TOKEN_LEVEL_ESTIMATORS:
            adv, ret = algos.compute_advantages(rewards, mask, a, values=b.get("values"),
                                                index=batch.non_tensor_batch.get("uid"), baselines=baselines)
        else:  # an outcome estimator: its groups count samples; every segment gets its sample's advantage
            p = segments.primary
            adv, ret = algos.compute_advantages(segments.sample_rewards(rewards, scores, mask), mask[p], a,
                                                index=batch.non_tensor_batch["uid"][p])
            adv = ret = segments.spread(adv, mask[p], mask)
        if "teacher_log_prob" in b:  # on-policy distillation: each trained token's reverse-KL term
            adv = algos.add_distillation_term(adv, b["old_log_probs"], b["teacher_log_prob"], mask, a.distill_coef)
            ret = ret if a.adv_estimator == "gae" else adv  # GAE's returns are the critic's targets
            kl = {**kl, **distill_metrics(b["old_log_probs"], b["teacher_log_prob"], mask)}
        b["token_level_scores"], b["token_level_rewards"], b["advantages"], b["returns"] = scores, rewards, adv, ret
        return kl

    def _update(self, batch: DataProto, timing: dict) -> tuple[dict, dict]:
        b, segments = batch.batch, Segments.of(batch)
        meta = {"sampling": batch.meta_info["sampling"]}  # the actor's log-probs at the sampling temperature
        critic_metrics = {}
        if self.critic_wg is not None:
            keys = _model_in(b) + list(self.value_loss.required_keys)
            data = self._update_data(b, keys, meta, self.config.critic, segments)
            with self._phase("update_critic", timing):
                critic_metrics = self.critic_wg.update_critic(data, self.value_loss)[0]
        keys = _model_in(b) + self.policy_loss.required_keys + [k for k in self.policy_loss.optional_keys if k in b]
        keys += [ROUTES] if ROUTES in b else []  # actor.router_replay: the MoE routes the update replays
        data = self._update_data(b, keys, meta, self.config.actor, segments)
        with self._phase("update_actor", timing):
            actor_metrics = self.actor_wg.update_actor(data, self.policy_loss)[0]
        return critic_metrics, actor_metrics

    @staticmethod
    def _update_data(b: dict, keys: list, meta: dict, role_cfg, segments: Optional[Segments] = None) -> DataProto:
        """The update's rows; with a token budget, dealt to the DP ranks by token count (each global
        mini-batch keeps its rows: workers/packing.balance_across_dp)."""
        data = DataProto({k: b[k] for k in keys}, {}, meta)
        mini = role_cfg.ppo_mini_batch_size
        if segments is not None:  # later segments join their samples' mini-batches, filled to equal shares
            data = segments.update_batch(data, role_cfg.ppo_mini_batch_size, role_cfg.parallel.dp,
                                         role_cfg.micro_batch_size)
            mini = data.meta_info["mini_batch_rows"]
        if role_cfg.max_tokens_per_micro_batch is None:
            return data
        from megappo.workers.packing import balance_across_dp

        return data[balance_across_dp(data.batch["attention_mask"].sum(-1).tolist(), role_cfg.parallel.dp, mini)]

    # ---- 7. validation and checkpoints ---------------------------------------------------------------

    def validate(self) -> dict:
        """Greedy responses to the whole validation set with the CURRENT actor weights."""
        if self.val_dataset is None:
            return {}
        t0 = time.perf_counter()
        if self.async_mode and not self.fully_async:  # queued behind the in-flight rollout on the rollout pool
            self._sync_rollout_weights()  # (fully_async: the pool got this step's weights after its update)
        size, parts = self.config.data.val_batch_size, []
        for i in range(0, len(self.val_dataset), size):
            prompts = self.val_dataset.get_batch(range(i, min(i + size, len(self.val_dataset))))
            parts.append(self._generate(prompts, self.sampling.greedy()))
        out = DataProto.concat(parts)
        out.meta_info.pop("metrics", None)
        segments = Segments.of(out)
        if segments is not None:  # rollout.agent's rewritten histories: each sample scored once
            out = out[segments.primary]
        _, reward_metrics = self.val_reward_fn(out)
        tools = {k.replace("rollout/", "eval/"): v for k, v in agent_metrics(out.batch).items() if k.startswith("rollout/")}
        return {**eval_metrics(out, reward_metrics), **tools, "timing/validate_s": time.perf_counter() - t0}
