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
  3. ref, values `compute_ref_log_prob` (frozen initial policy), critic `compute_values`
  4. reward      RewardManager (rules by data_source, non-stop penalty) [+ RM worker], then the KL
                 penalty in the reward (algorithm.use_kl_in_reward, fixed/adaptive beta)
  5. advantages  on this process (core_algos: GAE / GRPO / RLOO / REINFORCE++)
  6. updates     critic `update_critic`, actor `update_actor` (ppo_epochs x mini-batches; the loss
                 normaliser is the mini-batch's global token count, computed once per mini-batch)
  7. metrics (ppo/metrics.py, open-instruct names), validation every trainer.val_every steps,
     checkpoint every trainer.save_every steps.

Off-policy correction: `rollout_log_probs` (the sampler's own log-probs) always travel to
`update_actor`, which weights each token's clipped loss by min(pi_old / pi_rollout, 2)
(core_algos.compute_importance_weights, truncated IS). Sync mode: pi_rollout is vLLM on the same
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
Checkpoint `<output_dir>/checkpoints/step_N/` (atomic: temp dir, MANIFEST last, rename): actor/ and
critic/ (megatron dist checkpoints: model + optimizer + LR schedule), rng/ (every worker's RNG),
trainer_state.json (step, sampler position, KL controller, the driver's RNG). An async run resumes
from the checkpoint's weights with a fresh pipeline (its first resumed step is on-policy).
"""

from __future__ import annotations

import contextlib
import json
import random
import time
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from megappo.data.dataset import RLHFDataset
from megappo.data.sampler import EpochSampler
from megappo.ppo import core_algos as algos
from megappo.ppo.metrics import eval_metrics, kl_metrics, step_metrics
from megappo.protocol import DataProto
from megappo.rewards.manager import RewardManager
from megappo.utils.checkpoint import atomic_checkpoint, is_complete, latest_checkpoint


_MODEL_IN = ["input_ids", "attention_mask", "position_ids", "responses"]


@contextlib.contextmanager
def _timer(name: str, timing: dict):
    t0 = time.perf_counter()
    yield
    timing[name] = timing.get(name, 0.0) + time.perf_counter() - t0


def _same_layout(a, b) -> bool:
    return (a.tp, a.pp, a.dp, a.vpp) == (b.tp, b.pp, b.dp, b.vpp)


class _Inflight:
    """An async rollout in flight on the rollout pool."""

    def __init__(self, call, step: int, sync_metrics: dict):
        self.call, self.step, self.sync_metrics = call, step, sync_metrics

    def result(self) -> DataProto:
        return self.call.result()[0]


class RayPPOTrainer:
    def __init__(self, config, tokenizer=None, reward_fn=None, val_reward_fn=None, show_progress: bool = True):
        from transformers import AutoTokenizer

        self.config = cfg = config
        self.tokenizer = tokenizer or AutoTokenizer.from_pretrained(str(cfg.model.tokenizer or cfg.model.path))
        r = cfg.reward
        stops = list(cfg.rollout.stop_token_ids)
        self.reward_fn = reward_fn or RewardManager(self.tokenizer, r.num_examine, r.non_stop_penalty,
                                                    r.non_stop_penalty_value, stop_token_ids=stops)
        self.val_reward_fn = val_reward_fn or RewardManager(self.tokenizer, 0, r.non_stop_penalty,
                                                            r.non_stop_penalty_value, stop_token_ids=stops)
        d = cfg.data
        self.train_dataset = RLHFDataset(list(d.train_files), self.tokenizer, d.prompt_key, d.max_prompt_length,
                                         d.apply_chat_template)
        self.val_dataset = RLHFDataset(list(d.val_files), self.tokenizer, d.prompt_key, d.max_prompt_length,
                                       d.apply_chat_template) if d.val_files else None
        self.sampler = EpochSampler(len(self.train_dataset), d.train_batch_size, seed=cfg.trainer.seed,
                                    shuffle=d.shuffle)
        self._sampler_before: dict[int, dict] = {}  # step -> sampler state before drawing its prompts
        self.kl_ctrl = algos.make_kl_controller(cfg.algorithm)
        self.async_mode = cfg.trainer.mode == "async"
        self.output_dir = Path(cfg.trainer.output_dir)
        self.ckpt_root = self.output_dir / "checkpoints"
        self.show_progress = show_progress
        self.global_step = 0
        self.groups: list = []
        self.actor_wg = self.critic_wg = self.ref_wg = self.rm_wg = self.rollout_wg = None
        self.resource_pool_manager = None

    # ---- workers -----------------------------------------------------------------------------------

    def init_workers(self) -> None:
        """Pools (Ray placement groups), one worker group per role, models, then vLLM engines."""
        from megappo.workers.roles import ActorRolloutRefWorker, CriticWorker, RewardModelWorker
        from megappo.workers.worker_group import NVMegatronRayWorkerGroup, RayWorkerGroup
        from megappo.workers.resource_pool import ResourcePoolManager, Role

        cfg, res = self.config, self.config.resources
        fuse_ref = cfg.ref.enable and _same_layout(cfg.ref.parallel, cfg.actor.parallel)
        actor_kind = ("actor" if self.async_mode else "actor_rollout") + ("_ref" if fuse_ref else "")
        spec = {"train": [res.workers_per_node] * res.nodes}
        mapping = {Role.ActorRolloutRef if fuse_ref else Role.ActorRollout: "train"}
        if cfg.critic.enable:
            mapping[Role.Critic] = "train"
        if cfg.ref.enable and not fuse_ref:
            mapping[Role.RefPolicy] = "train"
        if cfg.reward.model.enable:
            mapping[Role.RewardModel] = "train"
        if self.async_mode:
            spec["rollout"] = [res.rollout_workers]
            mapping[Role.Rollout] = "rollout"
        use_gpu = res.device == "cuda" or (res.device == "auto" and torch.cuda.is_available())
        mgr = self.resource_pool_manager = ResourcePoolManager(spec, mapping, use_gpu=use_gpu,
                                                               cpus_per_bundle=res.cpus_per_worker)
        mgr.create_resource_pool()
        pool, timeout = mgr.pools["train"], cfg.trainer.worker_timeout_s

        def group(cls, name, *args, wg_cls=NVMegatronRayWorkerGroup, pool=pool):
            wg = wg_cls(pool, cls, args=(cfg, *args), name=name, timeout_s=timeout)
            self.groups.append(wg)
            return wg

        self.actor_wg = group(ActorRolloutRefWorker, "actor", actor_kind)
        self.critic_wg = group(CriticWorker, "critic") if cfg.critic.enable else None
        self.ref_wg = (self.actor_wg if fuse_ref else group(ActorRolloutRefWorker, "ref", "ref")) \
            if cfg.ref.enable else None
        self.rm_wg = group(RewardModelWorker, "rm") if cfg.reward.model.enable else None
        self.rollout_wg = group(ActorRolloutRefWorker, "rollout", "rollout", wg_cls=RayWorkerGroup,
                                pool=mgr.pools["rollout"]) if self.async_mode else self.actor_wg
        for call in [g.submit("init_model") for g in self.groups]:  # every megatron world comes up at once
            call.result()
        self.rollout_wg.init_rollout()
        if self.async_mode:
            host, port = self.actor_wg.weight_sync_address()[0]
            world = 1 + self.rollout_wg.world_size
            calls = [g.submit("init_weight_sync", host, port, world) for g in (self.actor_wg, self.rollout_wg)]
            for c in calls:
                c.result()

    def shutdown(self) -> None:
        for g in self.groups:
            g.shutdown()
        self.groups = []
        if self.resource_pool_manager is not None:
            self.resource_pool_manager.remove()

    # ---- the loop ----------------------------------------------------------------------------------

    def fit(self) -> list[dict]:
        from megappo.utils.tracking import Tracking

        cfg, total = self.config, self.config.trainer.total_steps
        self._resume()
        history: list[dict] = []
        start = time.perf_counter()
        inflight = self._launch_rollout(self.global_step + 1) \
            if self.async_mode and self.global_step < total else None
        with _Progress(total, self.global_step, self.show_progress) as progress, \
                Tracking(cfg.trainer.project, cfg.trainer.experiment, self.output_dir, list(cfg.trainer.loggers),
                         config=cfg, console=progress.console) as tracker:
            for step in range(self.global_step + 1, total + 1):
                t0, timing = time.perf_counter(), {}
                # 1. rollout (async: the batch launched last step; launch the next one before training)
                if inflight is None:
                    with _timer("timing/gen_s", timing):
                        batch = self._generate(self._next_prompts(step), self._sampling_meta(step))
                else:
                    with _timer("timing/rollout_wait_s", timing):
                        batch = inflight.result()
                    timing.update(inflight.sync_metrics)
                    with _timer("timing/launch_s", timing):
                        inflight = self._launch_rollout(step + 1) if step < total else None
                gen_metrics = batch.meta_info.pop("metrics", {})
                # 2-3. pi_old (+ entropy), reference log-probs, values of the sampled tokens
                batch = self._score_tokens(batch, timing)
                # 4-5. rewards (+ KL penalty) and advantages, here on the driver
                with _timer("timing/reward_adv_s", timing):
                    scores, reward_metrics = self.reward_fn(batch)
                    kl = self._advantages(batch, scores)
                # 6. critic and actor updates
                critic_metrics, actor_metrics = self._update(batch, timing)
                self.global_step = step
                timing["timing/step_s"] = time.perf_counter() - t0
                if self.async_mode:  # how much of the rollout hid behind the previous step's training
                    rollout_s = gen_metrics.get("timing/rollout_s", 0.0)
                    timing["timing/rollout_overlap_s"] = max(0.0, rollout_s - timing["timing/rollout_wait_s"])
                    timing["timing/rollout_overlap_frac"] = timing["timing/rollout_overlap_s"] / max(rollout_s, 1e-9)
                metrics = step_metrics(step=step, batch=batch, reward_metrics=reward_metrics, kl=kl,
                                       actor=actor_metrics, critic=critic_metrics,
                                       prompts_per_step=cfg.data.train_batch_size,
                                       responses_per_step=cfg.data.train_batch_size * cfg.rollout.n,
                                       dataset_size=len(self.train_dataset), step_s=timing["timing/step_s"],
                                       since_start_s=time.perf_counter() - start)
                metrics.update(gen_metrics)
                metrics.update(timing)
                # 7. validation, checkpoint, logging
                if cfg.trainer.val_every and (step % cfg.trainer.val_every == 0 or step == total):
                    metrics.update(self.validate())
                if cfg.trainer.save_every and (step % cfg.trainer.save_every == 0 or step == total):
                    with _timer("timing/save_checkpoint_s", metrics):
                        self.save_checkpoint(step)
                tracker.log(metrics, step)
                history.append(metrics)
                progress.advance(metrics)
        plot_reward_curve(self.output_dir)
        return history

    # ---- 1. rollout ----------------------------------------------------------------------------------

    def _next_prompts(self, step: int) -> DataProto:
        self._sampler_before[step] = self.sampler.state_dict()
        return self.train_dataset.get_batch(next(self.sampler))

    def _sampling_meta(self, step: int) -> dict:
        """Per-step sampling seed: a step's rollout depends only on (trainer.seed, step) and the weights."""
        r = self.config.rollout
        seed = (self.config.trainer.seed * 1_000_003 + step * 10_007) % (1 << 31)
        return {"seed": seed, "n": r.n, "temperature": r.temperature, "max_new_tokens": r.max_new_tokens}

    def _generate(self, prompts: DataProto, meta: dict, wg=None) -> DataProto:
        prompts.meta_info.update(meta)
        return (wg or self.rollout_wg).generate_sequences(prompts)[0]

    def _sync_rollout_weights(self) -> dict:
        """Async: actor -> rollout pool over the weight-sync group (both sides at once)."""
        t0 = time.perf_counter()
        send = self.actor_wg.submit("send_weights")
        recv = self.rollout_wg.submit("receive_weights")
        sent, received = send.result()[0], recv.result()[0]
        return {"timing/weight_sync_s": time.perf_counter() - t0, **sent, **received}

    def _launch_rollout(self, step: int) -> _Inflight:
        """Async: push the actor's current weights, then start `step`'s rollout without waiting."""
        sync = self._sync_rollout_weights()
        prompts = self._next_prompts(step)
        prompts.meta_info.update(self._sampling_meta(step))
        return _Inflight(self.rollout_wg.submit("generate_sequences", prompts), step, sync)

    # ---- 2-6. scoring, rewards, advantages, updates --------------------------------------------------

    def _score_tokens(self, batch: DataProto, timing: dict) -> DataProto:
        model_in = batch.select(batch_keys=_MODEL_IN, non_tensor_keys=[], meta_info_keys=[])
        model_in.meta_info["temperature"] = self.config.rollout.temperature
        with _timer("timing/old_log_prob_s", timing):
            batch.batch.update(self.actor_wg.compute_log_prob(model_in).batch)
        if self.ref_wg is not None:
            with _timer("timing/ref_s", timing):
                batch.batch.update(self.ref_wg.compute_ref_log_prob(model_in).batch)
        if self.critic_wg is not None:
            with _timer("timing/values_s", timing):
                batch.batch.update(self.critic_wg.compute_values(model_in).batch)
        if self.rm_wg is not None:
            with _timer("timing/rm_s", timing):
                batch.batch.update(self.rm_wg.compute_rm_score(model_in).batch)
        return batch

    def _advantages(self, batch: DataProto, scores: torch.Tensor) -> dict:
        a, b = self.config.algorithm, batch.batch
        mask = b["response_mask"]
        kl = {}
        if "ref_log_prob" in b and a.use_kl_in_reward:
            rewards, kl = algos.apply_kl_penalty(scores, b["old_log_probs"], b["ref_log_prob"], mask, self.kl_ctrl,
                                                 a.kl_penalty)
        else:
            rewards = scores
            if "ref_log_prob" in b:
                kl = kl_metrics(b["old_log_probs"], b["ref_log_prob"], mask.float(), 0.0, a.kl_penalty)
        if a.adv_estimator == "gae":
            adv, ret = algos.compute_gae_advantages(rewards, b["values"], mask, a.gamma, a.lam, a.whiten_advantages)
        elif a.adv_estimator == "grpo":
            adv, ret = algos.compute_grpo_outcome_advantage(rewards, mask, batch.non_tensor_batch["uid"])
        elif a.adv_estimator == "rloo":
            adv, ret = algos.compute_rloo_outcome_advantage(rewards, mask, batch.non_tensor_batch["uid"])
        else:
            adv, ret = algos.compute_reinforce_plus_plus_outcome_advantage(rewards, mask, a.gamma)
        b["token_level_scores"], b["token_level_rewards"], b["advantages"], b["returns"] = scores, rewards, adv, ret
        return kl

    def _update(self, batch: DataProto, timing: dict) -> tuple[dict, dict]:
        b, cfg = batch.batch, self.config
        meta = {"temperature": cfg.rollout.temperature}
        critic_metrics = {}
        if self.critic_wg is not None:
            keys = _MODEL_IN + ["response_mask", "values", "returns"]
            with _timer("timing/update_critic_s", timing):
                critic_metrics = self.critic_wg.update_critic(DataProto({k: b[k] for k in keys}, {}, meta))[0]
        keys = _MODEL_IN + ["response_mask", "old_log_probs", "advantages", "rollout_log_probs"] + \
            (["ref_log_prob"] if cfg.actor.use_kl_loss else [])
        with _timer("timing/update_actor_s", timing):
            actor_metrics = self.actor_wg.update_actor(DataProto({k: b[k] for k in keys}, {}, meta))[0]
        return critic_metrics, actor_metrics

    # ---- 7. validation and checkpoints ---------------------------------------------------------------

    def validate(self) -> dict:
        """Greedy responses to the whole validation set with the CURRENT actor weights."""
        if self.val_dataset is None:
            return {}
        t0 = time.perf_counter()
        if self.async_mode:  # queued behind the in-flight rollout on the rollout pool
            self._sync_rollout_weights()
        size, parts = self.config.data.val_batch_size, []
        for i in range(0, len(self.val_dataset), size):
            prompts = self.val_dataset.get_batch(range(i, min(i + size, len(self.val_dataset))))
            parts.append(self._generate(prompts, {"do_sample": False, "n": 1}))
        out = DataProto.concat(parts)
        out.meta_info.pop("metrics", None)
        _, reward_metrics = self.val_reward_fn(out)
        return {**eval_metrics(out, reward_metrics), "timing/validate_s": time.perf_counter() - t0}

    def save_checkpoint(self, step: int) -> Path:
        with atomic_checkpoint(self.ckpt_root, step) as tmp:
            calls = [g.submit("save_checkpoint", str(tmp)) for g in (self.actor_wg, self.critic_wg) if g is not None]
            for c in calls:
                c.result()
            state = {
                "step": step,
                "sampler": self._sampler_before.get(step + 1, self.sampler.state_dict()),
                "kl_ctrl": self.kl_ctrl.state_dict(),
                "rng": {"python": list(random.getstate()[1]), "python_pos": random.getstate()[2],
                        "numpy": np.random.get_state()[1].tolist(), "numpy_pos": int(np.random.get_state()[2]),
                        "torch": torch.get_rng_state().tolist()},
            }
            (tmp / "trainer_state.json").write_text(json.dumps(state))
        self._sampler_before = {k: v for k, v in self._sampler_before.items() if k > step}
        return self.ckpt_root

    def _resume(self) -> Optional[Path]:
        mode = self.config.trainer.resume
        if mode == "never":
            return None
        path = latest_checkpoint(self.ckpt_root) if mode == "auto" else Path(mode)
        if path is None:
            return None
        if not is_complete(path):
            raise ValueError(f"trainer.resume={mode}: {path} is not a complete checkpoint (no valid MANIFEST.json)")
        calls = [g.submit("load_checkpoint", str(path)) for g in (self.actor_wg, self.critic_wg) if g is not None]
        for c in calls:
            c.result()
        state = json.loads((path / "trainer_state.json").read_text())
        self.global_step = int(state["step"])
        self.sampler.load_state_dict(state["sampler"])
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        rng = state["rng"]
        random.setstate((3, tuple(rng["python"]), rng["python_pos"]))
        np.random.set_state(("MT19937", np.array(rng["numpy"], dtype=np.uint32), rng["numpy_pos"], 0, 0.0))
        torch.set_rng_state(torch.tensor(rng["torch"], dtype=torch.uint8))
        print(f"resumed from {path} at step {self.global_step}", flush=True)
        return path


class _Progress:
    """A rich progress bar over steps (score / correct rate / step time in its description)."""

    def __init__(self, total: int, done: int, enabled: bool):
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, \
            TimeRemainingColumn

        self.console = Console()
        self.progress = Progress(TextColumn("[bold]PPO"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                 TextColumn("eta"), TimeRemainingColumn(), TextColumn("{task.description}"),
                                 console=self.console, disable=not enabled, transient=False)
        self.task = self.progress.add_task("", total=total, completed=done)

    def __enter__(self) -> "_Progress":
        self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.stop()

    def advance(self, m: dict) -> None:
        desc = (f"score {m['objective/scores']:.3f}  correct {m['objective/verifiable_correct_rate']:.2f}  "
                f"kl {m['objective/kl']:.3f}  {m['time/training']:.1f}s/step")
        self.progress.update(self.task, advance=1, description=desc)


def plot_reward_curve(output_dir) -> Optional[Path]:
    """`<output_dir>/reward_curve.png`: objective/scores and verifiable_correct_rate per step (+ eval)."""
    from megappo.utils.tracking import read_metrics

    path = Path(output_dir) / "metrics.jsonl"
    if not path.is_file():
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = {int(r["step"]): r for r in read_metrics(path)}  # a resumed run re-logs steps: the last one wins
    steps = sorted(s for s in rows if "objective/scores" in rows[s])
    fig, ax = plt.subplots(figsize=(7, 4))
    for key, style in (("objective/scores", "-"), ("objective/verifiable_correct_rate", "--"),
                       ("eval/verifiable_correct_rate", "o")):
        xs = [s for s in steps if key in rows[s]]
        if xs:
            ax.plot(xs, [rows[s][key] for s in xs], style, label=key)
    ax.set_xlabel("PPO step")
    ax.set_title("reward curve")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out = Path(output_dir) / "reward_curve.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
