"""Ray single controller on CPU, for real: placement-group pools, colocated worker groups with their own
gloo worlds and megatron parallel_state, dispatch/collect (pad + unpad, PP as DP), and failures that
surface as errors (pending actors, timeouts, a worker killed mid-call) instead of hangs.

One Ray session (conftest `ray_session`, num_cpus=8) serves the module. Tests run in file order:
pending/placement first (they need free CPUs), then the toy megatron groups, then the real roles.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest
import torch

from megappo.parallel.layout import ParallelLayout
from megappo.protocol import DataProto
from megappo.controller.worker import Worker
from megappo.controller.dispatch import Dispatch, MegatronTopology, plan_call, register, registered_methods
from megappo.controller.resource_pool import RayResourcePool, ResourcePoolManager, WorkerError
from megappo.workers.roles import Role
from megappo.controller.worker_group import NVMegatronRayWorkerGroup, RayWorkerGroup


# Ray workers cannot import this test module by name: ship its classes by value.
import ray.cloudpickle  # noqa: E402

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


# ------------------------------------------------------------------------------------------ rendezvous ports
def test_rendezvous_ports_avoid_the_ephemeral_range():
    """A port from bind(0) lies in the ephemeral range, where another group's outgoing gloo connections
    can take it before our TCPStore listens (CI: EADDRINUSE with three groups starting side by side)."""
    import random
    import socket

    from megappo.parallel.launch import PORT_FLOOR, ephemeral_port_range, free_port

    low, high = ephemeral_port_range()
    ports = []
    for _ in range(20):
        random.seed(0)  # workers seed `random` alike: the pick must not follow it
        ports.append(free_port())
    assert all(PORT_FLOOR <= p < low for p in ports), (ports, low, high)
    assert len(set(ports)) == len(ports), ports  # never the same port twice in one process
    with socket.socket() as s:  # the picked port is listenable
        s.bind(("127.0.0.1", ports[-1]))
        s.listen()


# ------------------------------------------------------------------------------------------ toy workers
class SleepWorker(Worker):
    """No torch.distributed: for placement, timeout and pending tests."""

    @register(Dispatch.ONE_TO_ALL)
    def hello(self, x):
        return (self.rank, self.world_size, x, os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))

    @register(Dispatch.ALL_TO_ALL)
    def scatter(self, x):
        return x * 10 + self.rank

    @register(Dispatch.ONE_TO_ALL)
    def sleep(self, seconds):
        time.sleep(seconds)
        return self.rank

    @register(Dispatch.ONE_TO_ALL)
    def fail(self):
        raise ValueError(f"boom from rank {self.rank}")


class ToyMegatronWorker(Worker):
    """gloo + megatron parallel_state for a ParallelLayout; a deterministic per-row function."""

    def __init__(self, tp: int, pp: int, dp: int):
        super().__init__()
        self.layout = ParallelLayout(tp=tp, pp=pp, dp=dp)
        self.seen: list[int] = []

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self):
        self.init_megatron(self.layout)
        return self.rank

    def _rows(self, data: DataProto, mode: str) -> DataProto:
        import torch.distributed as dist
        from megatron.core import parallel_state as mpu

        x = data.batch["x"]
        self.seen = data.batch["row"].tolist()
        # every rank of this replica must hold the same chunk: compare a checksum over the replica's group
        group = mpu.get_model_parallel_group() if mode == "dp" else mpu.get_tensor_model_parallel_group()
        s = torch.tensor([float((data.batch["row"] + 1).pow(2).sum())])
        lo, hi = s.clone(), s.clone()
        dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
        dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
        dp, pp, tp, _ = self.megatron_coords()
        n = len(data)
        return DataProto.from_dict({
            "row": data.batch["row"].clone(),
            "y": torch.sin(x) * 3 + x.sum(-1, keepdim=True),
            "coords": torch.tensor([[dp, pp, tp]] * n, dtype=torch.long).reshape(n, 3),
            "same_chunk": torch.full((n,), float(lo == hi)),
        }, meta_info={"from_rank": self.rank})

    @register(Dispatch.MEGATRON_COMPUTE)
    def compute(self, data: DataProto, scale: float = 1.0) -> DataProto:
        out = self._rows(data, "dp")
        out.batch["y"] = out.batch["y"] * scale
        return out

    @register(Dispatch.MEGATRON_PP_AS_DP)
    def generate(self, data: DataProto) -> DataProto:
        return self._rows(data, "pp_as_dp")

    @register(Dispatch.MEGATRON_COMPUTE, pad=False)
    def update(self, data: DataProto) -> dict:
        return {"rows": len(data), "rank": self.rank}

    @register(Dispatch.ONE_TO_ALL)
    def last_seen(self):
        return self.seen

    @register(Dispatch.ONE_TO_ALL)
    def stuck_allreduce(self, where: str):
        """Every rank says it is in the call (`where`/in_<rank>), waits for `where`/go, then joins an all-reduce."""
        import torch.distributed as dist

        open(os.path.join(where, f"in_{self.rank}"), "w").close()
        while not os.path.exists(os.path.join(where, "go")):
            time.sleep(0.01)
        t = torch.ones(1)
        dist.all_reduce(t)
        return float(t)


def reference(x: torch.Tensor) -> torch.Tensor:
    return torch.sin(x) * 3 + x.sum(-1, keepdim=True)


def make_batch(n: int, seed: int = 0) -> DataProto:
    g = torch.Generator().manual_seed(seed)
    return DataProto.from_dict({"row": torch.arange(n), "x": torch.randn(n, 3, generator=g)},
                               {"uid": [f"u{i}" for i in range(n)]}, {"step": 7})


# ------------------------------------------------------------------------------------------ pure dispatch
def test_register_only_attaches_a_spec_and_plans_are_explicit():
    specs = registered_methods(ToyMegatronWorker)
    assert specs["compute"].mode is Dispatch.MEGATRON_COMPUTE and specs["compute"].pad
    assert specs["update"].pad is False and specs["generate"].mode is Dispatch.MEGATRON_PP_AS_DP
    assert specs["megatron_coords"].mode is Dispatch.ONE_TO_ALL  # inherited from Worker
    layout = ParallelLayout(tp=2, pp=2, dp=2)
    topo = MegatronTopology(tuple(layout.coords(r) for r in range(8)))
    plan = plan_call(specs["compute"], 8, topo, (make_batch(5),), {}, "compute")
    assert plan.pad_size == 1
    # every rank of dp group d receives chunk d; readers are tp==0 on the last stage, in dp order
    for rank in range(8):
        dp = layout.coords(rank)[0]
        assert plan.args[rank][0].batch["row"].tolist() == [[0, 1, 2], [3, 4, 0]][dp]
    assert plan.collect_ranks == [layout.rank(0, 1, 0), layout.rank(1, 1, 0)]
    pp_plan = plan_call(specs["generate"], 8, topo, (make_batch(8),), {}, "generate")
    assert pp_plan.collect_ranks == [layout.rank(d, p, 0) for d in range(2) for p in range(2)]
    with pytest.raises(ValueError, match="does not divide into 2 data-parallel replicas"):
        plan_call(specs["update"], 8, topo, (make_batch(5),), {}, "update")
    with pytest.raises(RuntimeError, match="init_model"):
        plan_call(specs["compute"], 8, None, (make_batch(4),), {}, "compute")
    # context parallel: the cp ranks of a dp replica get its rows (they split each row's tokens themselves);
    # one of them (cp == 0, tp == 0, last stage) is read
    layout = ParallelLayout(tp=2, cp=2, dp=2)
    topo = MegatronTopology(tuple(layout.coords(r) + (layout.cp_rank(r),) for r in range(8)))
    assert (topo.dp_size, topo.cp_size, topo.tp_size) == (2, 2, 2)
    plan = plan_call(specs["compute"], 8, topo, (make_batch(4),), {}, "compute")
    for rank in range(8):
        assert plan.args[rank][0].batch["row"].tolist() == [[0, 1], [2, 3]][layout.coords(rank)[0]]
    assert plan.collect_ranks == [layout.rank(0, 0, 0, cp=0), layout.rank(1, 0, 0, cp=0)] == [0, 4]
    with pytest.raises(ValueError, match="not a full dp x pp x tp x cp grid"):
        MegatronTopology(tuple(layout.coords(r) for r in range(8)))  # cp ranks left out: coordinates repeat


# ------------------------------------------------------------------------------------------ placement failures
def test_pool_that_cannot_be_placed_raises_naming_the_bundles(ray_session):
    # the pool's own 2 s deadline ended the wait (the message says so), not Ray's
    with pytest.raises(WorkerError, match=r"pool 'huge'.*\[2\] x \{'CPU': 64\}.*not placed within 2s"):
        RayResourcePool([2], cpus_per_bundle=64, name="huge", ready_timeout_s=2)
    with pytest.raises(ValueError, match="need CPU 128 but the Ray cluster has CPU 8"):
        ResourcePoolManager({"p": [128]}, {Role.Critic: "p"}).create_resource_pool()


def test_pending_actor_raises_within_timeout_naming_bundle_and_request(ray_session):
    pool = RayResourcePool([1], name="tight", max_colocate_count=1, ready_timeout_s=120)  # 1 CPU, no sharing
    try:
        first = RayWorkerGroup(pool, SleepWorker, name="first", timeout_s=120)
        assert first.hello(1) == [(0, 1, 1, "127.0.0.1", first.infos[0]["master_port"])]
        # a CPU pool's workers compute on the CPU and see no GPU, whatever the node exports (Ray >= 2.48
        # leaves a GPU-less actor the node's CUDA_VISIBLE_DEVICES): parallel/device.py
        assert (first.infos[0]["device"], first.infos[0]["cuda_visible_devices"]) == ("cpu", "")
        with pytest.raises(WorkerError, match=r"group 'second' rank 0 \(pool 'tight' bundle 0 \{'CPU': 1\}.*"
                                              r"asked \{'num_cpus': 1\.0\}\) did not start within 3s"):
            RayWorkerGroup(pool, SleepWorker, name="second", timeout_s=3)
        first.shutdown()
    finally:
        pool.remove()


# ------------------------------------------------------------------------------------------ colocated toy groups
@pytest.fixture(scope="class")
def toy_groups(ray_session):
    """A pool of 4 CPU bundles shared (colocated) by a TP2xPP2 group and a TP1xPP2xDP2 group."""
    mgr = ResourcePoolManager({"global_pool": [4]}, {Role.Actor: "global_pool", Role.Critic: "global_pool"})
    mgr.create_resource_pool(ready_timeout_s=120)
    pool = mgr.get_resource_pool(Role.Actor)
    assert pool is mgr.get_resource_pool(Role.Critic) and pool.worker_resources() == {"num_cpus": 0.5}
    a = NVMegatronRayWorkerGroup(pool, ToyMegatronWorker, args=(2, 2, 1), name="toy_tp2pp2", timeout_s=120)
    b = NVMegatronRayWorkerGroup(pool, ToyMegatronWorker, args=(1, 2, 2), name="toy_pp2dp2", timeout_s=120)
    # both groups start their megatron worlds at the same time, each on its own master port
    pa, pb = a.submit("init_model"), b.submit("init_model")
    assert pa.result() == [0, 1, 2, 3] and pb.result() == [0, 1, 2, 3]  # result() also reads the coordinates
    yield a, b
    a.shutdown(), b.shutdown()
    mgr.remove()


class TestColocatedToyGroups:
    def test_groups_share_bundles_with_own_worlds_and_megatron_coords(self, toy_groups):
        a, b = toy_groups
        assert [i["master_port"] for i in a.infos] == [a.infos[0]["master_port"]] * 4
        assert a.infos[0]["master_port"] != b.infos[0]["master_port"]
        assert {i["pid"] for i in a.infos}.isdisjoint({i["pid"] for i in b.infos})  # separate processes
        for g, layout in ((a, ParallelLayout(tp=2, pp=2, dp=1)), (b, ParallelLayout(tp=1, pp=2, dp=2))):
            assert list(g.topology.coords) == [layout.coords(r) + (0,) for r in range(4)]  # megatron agrees (cp 0)
            assert (g.dp_size, g.pp_size, g.tp_size) == (layout.dp, layout.pp, layout.tp)

    def test_megatron_compute_pads_splits_and_collects_in_input_order(self, toy_groups):
        a, b = toy_groups
        data = make_batch(10)
        for g in (a, b):
            out = g.compute(data, scale=2.0)
            assert len(out) == 10 and out.batch["row"].tolist() == list(range(10))
            torch.testing.assert_close(out.batch["y"], 2.0 * reference(data.batch["x"]), rtol=0, atol=0)
            assert out.batch["same_chunk"].eq(1).all()  # every tp/pp rank of a dp group had the same chunk
            # read only from tp == 0 on the last pipeline stage
            assert out.batch["coords"][:, 1].eq(g.pp_size - 1).all() and out.batch["coords"][:, 2].eq(0).all()
            assert out.meta_info["from_rank"] == g.topology.coords.index((0, g.pp_size - 1, 0, 0))
        # b: dp=2 -> 10 rows padded to... 10 (divisible); try 7 rows: padded to 8, 4 per dp rank
        out = b.compute(make_batch(7))
        assert out.batch["row"].tolist() == list(range(7))
        assert out.batch["coords"][:, 0].tolist() == [0, 0, 0, 0, 1, 1, 1]
        seen = b.last_seen()
        layout = ParallelLayout(tp=1, pp=2, dp=2)
        for rank, rows in enumerate(seen):
            assert rows == ([0, 1, 2, 3], [4, 5, 6, 0])[layout.coords(rank)[0]]  # row 0 repeated as padding

    def test_pp_as_dp_uses_pipeline_stages_as_replicas(self, toy_groups):
        a, b = toy_groups
        data = make_batch(10, seed=1)
        out = b.generate(data)  # 4 replicas (dp2 x pp2): 10 rows -> padded to 12, 3 each
        assert out.batch["row"].tolist() == list(range(10))
        torch.testing.assert_close(out.batch["y"], reference(data.batch["x"]), rtol=0, atol=0)
        replica = out.batch["coords"][:, 0] * 2 + out.batch["coords"][:, 1]
        assert replica.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3]
        out = a.generate(data)  # tp2 x pp2: 2 replicas, both pp stages answer
        assert out.batch["coords"][:, 1].tolist() == [0] * 5 + [1] * 5
        assert out.batch["same_chunk"].eq(1).all() and out.non_tensor_batch == {}

    def test_unpadded_method_refuses_a_batch_that_does_not_divide(self, toy_groups):
        a, b = toy_groups
        assert b.update(make_batch(8)) == [{"rows": 4, "rank": 2}, {"rows": 4, "rank": 3}]
        with pytest.raises(ValueError, match="9 rows does not divide into 2"):
            b.update(make_batch(9))

    def test_worker_killed_mid_collective_is_a_clear_error_not_a_hang(self, toy_groups, tmp_path):
        from waiting import wait_for

        a, b = toy_groups
        victim = 3
        # killed once every rank is in the call, while the others wait to join the all-reduce: the death (Ray's
        # notice) is the call's first outcome. (Killed 0.5 s into a 3 s nap, a notice slower than 2.5 s on a loaded
        # machine let a survivor's "Connection reset" from the all-reduce arrive first.)
        call = a.submit("stuck_allreduce", str(tmp_path))
        wait_for(lambda: all((tmp_path / f"in_{r}").exists() for r in range(4)), "every rank to enter the call")
        os.kill(a.infos[victim]["pid"], signal.SIGKILL)
        with pytest.raises(WorkerError) as err:  # the death, named (a hang would end in "did not finish within 60s")
            call.result(timeout_s=60)
        (tmp_path / "go").touch()  # the survivors into the all-reduce with a dead peer (the group's shutdown ends them)
        msg = str(err.value)
        assert "group 'toy_tp2pp2' rank 3" in msg and f"pid {a.infos[victim]['pid']}" in msg
        assert f"node {a.infos[victim]['node_ip']}" in msg and "died during stuck_allreduce" in msg
        assert "\n" not in msg
        with pytest.raises(WorkerError, match="unusable after an earlier failure"):
            a.last_seen()
        assert len(b.compute(make_batch(4))) == 4  # the colocated group is unaffected


# ------------------------------------------------------------------------------------------ timeouts, errors
def test_call_timeout_and_worker_exception(ray_session):
    pool = RayResourcePool([2], name="small", max_colocate_count=4, ready_timeout_s=120)
    g = RayWorkerGroup(pool, SleepWorker, name="sleepy", timeout_s=2, spawn_timeout_s=120)
    try:
        # calls that must finish get a bound of their own that no busy machine reaches; the group's 2 s is for the
        # one that cannot (a 600 s nap)
        assert g.submit("scatter", [1, 2]).result(timeout_s=120) == [10, 21]
        with pytest.raises(ValueError, match=r"boom from rank [01]"):  # the worker's own exception class
            g.submit("fail").result(timeout_s=120)
        with pytest.raises(WorkerError, match=r"group 'sleepy': sleep did not finish within 2s on 2 of 2 workers; "
                                              r"first: group 'sleepy' rank 0 \(node [\d.]+, pid \d+\)"):
            g.sleep(600)
        # first_failure (the trainer's weight sync: two groups meeting in one broadcast): one call failing ends
        # the wait at once with its error, while the other would block until its own timeout
        from megappo.controller.worker_group import first_failure

        blocked, failing = [RayWorkerGroup(pool, SleepWorker, name=n, timeout_s=120, spawn_timeout_s=120)
                            for n in ("blocked", "failing")]
        try:
            asleep = blocked.submit("sleep", 600)
            with pytest.raises(ValueError, match=r"boom from rank [01]"):
                first_failure(asleep, failing.submit("fail"))
            # it raised while the other call still sleeps (waiting for both would end after its 600 s nap)
            import ray

            assert ray.wait(asleep.refs, num_returns=len(asleep.refs), timeout=0)[1], "the sleeping call had ended"
        finally:
            blocked.shutdown()
            failing.shutdown()
    finally:
        g.shutdown()
        pool.remove()


# ------------------------------------------------------------------------------------------ real roles (tiny llama)
def _ppo_batch(n: int, prompt: int = 6, response: int = 6, seed: int = 0) -> DataProto:
    """Left-padded prompts + right-padded responses over the tiny vocab (1000)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 1000, (n, prompt + response), generator=g)
    mask = torch.ones(n, prompt + response, dtype=torch.long)
    for i in range(n):
        mask[i, : i % 3] = 0  # prompt left padding
        if i % 4:
            mask[i, prompt + response - (i % 4):] = 0  # response right padding
    ids = ids * mask + 3 * (1 - mask)  # pad id 3
    return DataProto.from_dict({"input_ids": ids, "attention_mask": mask, "responses": ids[:, prompt:],
                                "response_mask": mask[:, prompt:]}, {"uid": [f"q{i}" for i in range(n)]})


def _hf_reference(model_dir, data: DataProto):
    """Single-process reference: HF transformers fp32 log-probs of the response tokens."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    ids, mask = data.batch["input_ids"], data.batch["attention_mask"]
    r = data.batch["responses"].shape[1]
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
    logp = torch.log_softmax(logits[:, -r - 1:-1].float(), -1)
    return logp.gather(-1, ids[:, -r:, None])[..., 0]


def _seq_cls_model(src, dst, vocab_size=None):
    """A *ForSequenceClassification (num_labels=1) made from the tiny llama: same body, random score head."""
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaForSequenceClassification

    cfg = AutoConfig.from_pretrained(str(src))
    cfg.num_labels, cfg.pad_token_id = 1, 3
    if vocab_size:
        cfg.vocab_size = vocab_size
    torch.manual_seed(5)
    rm = LlamaForSequenceClassification(cfg)
    if not vocab_size:
        rm.model.load_state_dict(AutoModelForCausalLM.from_pretrained(str(src)).model.state_dict())
    rm.save_pretrained(str(dst))
    return rm.eval()


def _config(tiny_assets, tmp_path):
    from megappo.config.schema import MegappoConfig

    cfg = MegappoConfig()
    cfg.model.path = str(tiny_assets["tiny-llama"])
    cfg.model.dtype = "fp32"
    cfg.actor.parallel.tp, cfg.actor.parallel.pp, cfg.actor.parallel.dp = 2, 2, 1
    cfg.critic.parallel.tp, cfg.critic.parallel.pp, cfg.critic.parallel.dp = 1, 2, 2
    cfg.actor.log_prob_micro_batch_size = 4
    cfg.actor.ppo_mini_batch_size, cfg.actor.micro_batch_size = 10, 5
    cfg.actor.optim.lr = 1e-3
    cfg.critic.ppo_mini_batch_size, cfg.critic.micro_batch_size = 10, 5
    cfg.reward.model.enable = True
    cfg.reward.model.path = str(tmp_path / "rm")
    cfg.reward.model.micro_batch_size = 3
    return cfg


def test_colocated_actor_and_critic_match_single_process(ray_session, tiny_assets, tmp_path):
    from megappo.ppo.losses import PolicyLoss, ValueLoss
    from megappo.workers.roles import ActorRolloutRefWorker, CriticWorker, RewardModelWorker, check_reward_model_vocab

    cfg = _config(tiny_assets, tmp_path)
    policy_loss, value_loss = PolicyLoss.from_config(cfg.actor), ValueLoss.from_config(cfg.critic)
    rm_ref = _seq_cls_model(tiny_assets["tiny-llama"], tmp_path / "rm")
    cfg.model.critic_path = str(tmp_path / "rm")  # critic initialised from the same seq-cls checkpoint
    mgr = ResourcePoolManager({"global_pool": [4]}, {Role.ActorRollout: "global_pool", Role.Critic: "global_pool",
                                                     Role.RewardModel: "global_pool"})
    mgr.create_resource_pool(ready_timeout_s=120)
    pool = mgr.get_resource_pool(Role.ActorRollout)
    groups = []
    try:
        actor = NVMegatronRayWorkerGroup(pool, ActorRolloutRefWorker, args=(cfg, "actor_rollout_ref"), name="actor",
                                         timeout_s=240)
        critic = NVMegatronRayWorkerGroup(pool, CriticWorker, args=(cfg,), name="critic", timeout_s=240)
        # the reward model at context parallel 2: each rank holds half of every row (zigzag), the last token's score
        # comes from the rank that holds it (CP's gather), equal to transformers' on whole rows
        cfg.reward.model.parallel.cp = 2
        rm = NVMegatronRayWorkerGroup(pool, RewardModelWorker, args=(cfg,), name="rm", world_size=2, timeout_s=240)
        groups += [actor, critic, rm]
        inits = [g.submit("init_model") for g in groups]  # the three megatron worlds come up side by side
        assert inits[0].result()[0]["layout"] == "TP2xPP2xDP1"
        assert inits[1].result()[0]["layout"] == "TP1xPP2xDP2" and inits[2].result()[0]["layout"] == "TP1xCP2xPP1xDP1"
        assert (critic.dp_size, critic.pp_size, critic.tp_size) == (2, 2, 1)

        data = _ppo_batch(10)
        ref = _hf_reference(tiny_assets["tiny-llama"], data)
        mask = data.batch["response_mask"].bool()
        out = actor.compute_log_prob(data)
        assert len(out) == 10 and out.batch["old_log_probs"].shape == (10, 6)
        torch.testing.assert_close(out.batch["old_log_probs"][mask], ref[mask], rtol=0, atol=1e-4)
        ref_out = actor.compute_ref_log_prob(data)
        torch.testing.assert_close(ref_out.batch["ref_log_prob"][mask], ref[mask], rtol=0, atol=1e-4)

        # critic at dp=2 on 9 rows (padded to 10, unpadded back); values = the seq-cls body + score head
        nine = data[:9]
        values = critic.compute_values(nine).batch["values"]
        with torch.no_grad():
            ids, am = nine.batch["input_ids"], nine.batch["attention_mask"]
            hidden = rm_ref.model(input_ids=ids, attention_mask=am,
                                  position_ids=(am.cumsum(-1) - 1).clamp(min=0)).last_hidden_state
            per_pos = rm_ref.score(hidden)[..., 0]
        assert values.shape == (9, 6)
        torch.testing.assert_close(values[mask[:9]], per_pos[:, -7:-1][mask[:9]], rtol=0, atol=1e-4)
        last = (torch.arange(12)[None] * data.batch["attention_mask"]).amax(-1)
        scores = rm.compute_rm_score(data).batch["rm_scores"]
        with torch.no_grad():
            ids, am = data.batch["input_ids"], data.batch["attention_mask"]
            full = rm_ref.score(rm_ref.model(input_ids=ids, attention_mask=am,
                                             position_ids=(am.cumsum(-1) - 1).clamp(min=0)).last_hidden_state)[..., 0]
        torch.testing.assert_close(scores, full.gather(1, last[:, None])[:, 0], rtol=0, atol=1e-4)

        # one PPO update each: the metrics come back, the policy moves
        batch = data.union(out.select(["old_log_probs"]))
        batch.batch["advantages"] = torch.linspace(-1, 1, 10)[:, None].expand(10, 6).clone()
        metrics = actor.update_actor(batch, policy_loss)
        assert len(metrics) == 1 and {"actor/pg_loss", "actor/grad_norm", "actor/lr"} <= set(metrics[0])  # one per dp
        after = actor.compute_log_prob(data).batch["old_log_probs"]
        assert not torch.allclose(after[mask], ref[mask], atol=1e-3)
        # checkpoint round trip through the group: save, move on, load back -> the saved policy again
        actor.save_checkpoint(str(tmp_path / "ckpt"))
        actor.update_actor(batch, policy_loss)
        moved = actor.compute_log_prob(data).batch["old_log_probs"]
        assert not torch.allclose(moved[mask], after[mask], atol=1e-5)
        actor.load_checkpoint(str(tmp_path / "ckpt"))
        torch.testing.assert_close(actor.compute_log_prob(data).batch["old_log_probs"], after, rtol=0, atol=1e-6)
        values10 = critic.compute_values(data)
        cmetrics = critic.update_critic(data.union(values10.union(DataProto.from_dict({"returns": torch.ones(10, 6)}))),
                                       value_loss)
        assert len(cmetrics) == 2 and cmetrics[0] == cmetrics[1] and cmetrics[0]["critic/vf_loss"] > 0
        assert 0.1 < cmetrics[0]["perf/critic_peak_rss_gb"] < 24  # the larger DP rank's, on both
        with pytest.raises(ValueError, match="9 rows does not divide into 2"):
            critic.update_critic(nine.union(DataProto.from_dict({"values": values, "returns": torch.ones(9, 6)})),
                                 value_loss)
        with pytest.raises(RuntimeError, match="call init_rollout"):
            actor.generate_sequences(data)

        # a reward model with another vocab is refused, saying why
        _seq_cls_model(tiny_assets["tiny-llama"], tmp_path / "rm_bad", vocab_size=1200)
        with pytest.raises(ValueError, match="reward model vocab_size 1200 .* != policy vocab_size 1000"):
            check_reward_model_vocab(tmp_path / "rm_bad", cfg.model.path)
    finally:
        for g in groups:
            g.shutdown()
        mgr.remove()


def test_the_weight_sync_rendezvous_is_the_nodes_address_not_loopback(ray_session, monkeypatch):
    """Async modes: the rollout pool joins the weight-sync group at actor rank 0's address. An actor pool on one node
    has MASTER_ADDR 127.0.0.1 (its own rendezvous), which a rollout worker on another node cannot reach: it
    waited 600 s and failed. The two-node test on one host cannot see that, so the address itself is checked."""
    import socket

    from megappo.config.schema import MegappoConfig
    from megappo.workers.roles import ActorRolloutRefWorker

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29555")
    worker = ActorRolloutRefWorker(MegappoConfig(), "actor")
    assert worker.master_addr == "127.0.0.1"
    host, port = worker.weight_sync_address()
    assert host == ray_session.util.get_node_ip_address() and not host.startswith("127."), host
    with socket.socket() as s:  # free on that address
        s.bind((host, port))


def test_rollout_engines_load_no_checkpoint_unless_vllm_keeps_its_own_base(monkeypatch):
    """Every rollout engine of a run samples only after a weight sync brought the trainer's weights, so it is built
    with vLLM's dummy load format (a 70B job's 64 ranks read the checkpoint against the worker timeout, for vLLM to
    throw it away at its first sleep); adapter sync alone keeps the base vLLM loads (only adapters are sent). The
    trainer runs (their log-probs equal Megatron's, their fingerprints pass) show the dummy weights never sample."""
    from megappo.config.schema import MegappoConfig
    from megappo.workers.roles import ActorRolloutRefWorker
    from megappo.workers.rollout.vllm_rollout import VLLMRollout

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29556")
    seen = []
    monkeypatch.setattr(VLLMRollout, "from_config",
                        classmethod(lambda cls, cfg, load_format="auto": seen.append(load_format) or object()))
    cfg = MegappoConfig()
    ActorRolloutRefWorker(cfg, "rollout").init_rollout()
    cfg.actor.lora.rank, cfg.rollout.lora_sync = 8, "adapter"
    ActorRolloutRefWorker(cfg, "rollout").init_rollout()
    assert seen == ["dummy", "auto"]


def test_actor_rollout_ref_roles_are_chosen_by_config():
    from megappo.config.schema import MegappoConfig
    from megappo.workers.roles import ActorRolloutRefWorker

    cfg = MegappoConfig()
    flags = {r: (w.is_actor, w.is_rollout, w.is_ref) for r in ("actor", "rollout", "ref", "actor_rollout",
                                                                 "actor_rollout_ref")
             for w in [ActorRolloutRefWorker(cfg, r)]}
    assert flags == {"actor": (True, False, False), "rollout": (False, True, False), "ref": (False, False, True),
                     "actor_rollout": (True, True, False), "actor_rollout_ref": (True, True, True)}
    from megappo.workers.roles import ACTOR_ROLES, Role, fused_role

    for r in ACTOR_ROLES:  # one vocabulary: a worker given a Role holds its value, and its parts name it back
        w = ActorRolloutRefWorker(cfg, Role(r))
        assert w.role == r and fused_role(w.is_actor, w.is_rollout, w.is_ref) == Role(r)
    with pytest.raises(ValueError, match="role must be one of"):
        ActorRolloutRefWorker(cfg, "critic")
    with pytest.raises(RuntimeError, match="no actor engine"):
        ActorRolloutRefWorker(cfg, "ref").compute_log_prob(_ppo_batch(2))
