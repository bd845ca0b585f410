"""Decoupled PPO (#39; AReaL, Fu et al. 2025): the loss against its formula by hand, plain PPO when the
behaviour policy is the proximal one, gradients through pi_theta only, and its config (moved out of
test_core_algos.py, which holds the rest of the PPO math)."""

import math

import pytest
import torch

from megappo.ppo import losses

REPO = __import__("pathlib").Path(__file__).resolve().parents[1]

T = torch.tensor


def close(a, b, tol=1e-5):
    return torch.allclose(torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64), atol=tol)


# ----------------------------------------------------------------------------- decoupled PPO (#39)
def test_decoupled_loss_matches_the_formula_by_hand():
    # per token: r = pi_theta / pi_prox, w = pi_prox / pi_behav; l = w * max(-A r, -A clip(r, .8, 1.2))
    prox = T([[0.0, 0.0, 0.0, 0.0]])
    behav = T([[math.log(0.5), math.log(2.0), 0.0, math.log(0.1)]])  # w = 2, .5, 1, 10
    logp = T([[math.log(1.5), math.log(0.5), math.log(1.1), 0.0]])  # r = 1.5, .5, 1.1, 1
    adv = T([[1.0, -1.0, 2.0, 1.0]])
    mask = torch.ones(1, 4)
    loss, clipfrac, _, _, m = losses.compute_decoupled_policy_loss(prox, behav, logp, adv, mask, clip_ratio=0.2,
                                                                   clip_ratio_c=None)
    # token losses: 2 * -1.2 (r clipped at 1.2); .5 * .8 (r=.5, A<0: max(.5, .8)); 1 * -2.2; 10 * -1
    assert close(loss, (-2.4 + 0.4 - 2.2 - 10.0) / 4)
    assert close(clipfrac, 0.5) and close(m["behav_weight_mean"], (2 + 0.5 + 1 + 10) / 4)
    assert close(m["behav_capped_frac"], 0.0)
    # truncation: w = min(w, 3): only the last token's 10 becomes 3
    loss_t, *_, m_t = losses.compute_decoupled_policy_loss(prox, behav, logp, adv, mask, behav_imp_weight_cap=3.0,
                                                           clip_ratio=0.2, clip_ratio_c=None)
    assert close(loss_t, (-2.4 + 0.4 - 2.2 - 3.0) / 4)
    assert close(m_t["behav_capped_frac"], 0.25) and close(m_t["behav_weight_mean"], (2 + 0.5 + 1 + 3) / 4)


def test_decoupled_loss_is_plain_ppo_when_behaviour_is_proximal():
    g = torch.Generator().manual_seed(0)
    old, logp, adv = (torch.randn(3, 5, generator=g) for _ in range(3))
    mask = (torch.rand(3, 5, generator=g) > 0.3).float()
    ppo = losses.compute_policy_loss(old, logp, adv, mask, clip_ratio=0.2, clip_ratio_c=3.0)
    dec = losses.compute_decoupled_policy_loss(old, old.clone(), logp, adv, mask, behav_imp_weight_cap=2.0,
                                               clip_ratio=0.2, clip_ratio_c=3.0)
    for a, b in zip(ppo, dec[:4]):
        assert close(a, b, tol=1e-7)
    assert close(dec[4]["behav_weight_mean"], 1.0)


def test_decoupled_loss_gradients_flow_through_pi_theta_only():
    prox = T([[0.0, 0.0]]).requires_grad_()
    behav = T([[math.log(0.5), 0.0]]).requires_grad_()
    logp = T([[0.0, 0.0]]).requires_grad_()
    adv = T([[2.0, 1.0]])
    loss, *_ = losses.compute_decoupled_policy_loss(prox, behav, logp, adv, torch.ones(1, 2), clip_ratio=0.2)
    loss.backward()
    assert prox.grad is None or close(prox.grad, 0.0)
    assert behav.grad is None or close(behav.grad, 0.0)
    assert close(logp.grad, [[-2.0 * 2.0 / 2, -1.0 / 2]])  # d/dlogp of -w A e^{logp - prox} / N at r = 1


def test_policy_loss_decoupled_from_config_and_refused_combinations():
    from megappo.config import ConfigError, load_config
    from megappo.ppo.losses import PolicyLoss

    cfg = load_config(REPO / "configs/grpo_tiny.yaml", ["actor.policy_loss=decoupled", "actor.behav_imp_weight_cap=5",
                                                        "actor.use_rollout_log_probs=false"], validate=True)
    loss = PolicyLoss.from_config(cfg.actor)
    assert loss.policy_loss == "decoupled" and loss.behav_imp_weight_cap == 5 and "rollout_log_probs" in loss.required_keys
    mb = {"old_log_probs": T([[0.0, 0.0]]), "rollout_log_probs": T([[math.log(0.1), 0.0]]),
          "advantages": T([[1.0, 1.0]]), "response_mask": torch.ones(1, 2), "ref_log_prob": T([[0.0, 0.0]])}
    total, metrics = loss({"logprobs": T([[0.0, 0.0]])}, mb, norm=2.0, n_tokens=2.0)
    assert close(total, -5.0 - 1.0)  # a sum: w = min(10, 5) and 1, r = 1
    assert close(metrics["actor/behav_capped_frac"], 0.5)
    for over, msg in ((["actor.behav_imp_weight_cap=5"], "policy_loss=decoupled"),
                      (["actor.policy_loss=decoupled", "actor.behav_imp_weight_cap=0.5"], ">= 1"),
                      (["actor.policy_loss=decoupled", "actor.use_rollout_log_probs=true"], "use_rollout_log_probs"),
                      (["actor.policy_loss=dapo"], "policy_loss")):
        with pytest.raises(ConfigError, match=msg):
            load_config(REPO / "configs/grpo_tiny.yaml", over, validate=True)


# ----------------------------------------------------------------------------- A-3PO's log-linear proximal (#39)


def test_loglinear_alpha_puts_the_proximal_between_behaviour_and_theta():
    """alpha = (v - v_behav) / (v + 1 - v_behav): 0 for a token sampled by the weights the update starts
    from (pi_prox = pi_behav exactly), 1/2 one version behind, 2/3 two behind; -1 (no version) gets 0."""
    from megappo.ppo.staleness import loglinear_proximal, loglinear_proximal_alpha

    versions = T([[5, 4, 3, -1], [5, 5, 0, 5]])
    alpha = loglinear_proximal_alpha(versions, 5)
    assert close(alpha, [[0.0, 0.5, 2 / 3, 0.0], [0.0, 0.0, 5 / 6, 0.0]])
    behav, theta = T([[-1.0, -2.0, -3.0, 0.0]]), T([[-0.5, -1.0, -1.0, -4.0]])
    prox = loglinear_proximal(behav, theta, alpha[:1])
    assert close(prox, [[-1.0, -1.5, -3.0 + 2 / 3 * 2.0, 0.0]])


def test_loglinear_proximal_loss_by_hand_and_without_a_forward():
    """actor.proximal=loglinear: the loss clips around the interpolated pi_prox and weights by pi_prox /
    pi_behav (checked by hand on two tokens), gradients through pi_theta only (the interpolation is
    detached); the config asks for `prox_alpha` and refuses loglinear without the decoupled loss."""
    from megappo.config import ConfigError, load_config
    from megappo.ppo.losses import PolicyLoss

    cfg = load_config(REPO / "configs/grpo_tiny.yaml", ["actor.policy_loss=decoupled", "actor.proximal=loglinear",
                                                        "actor.use_rollout_log_probs=false"], validate=True)
    loss = PolicyLoss.from_config(cfg.actor)
    assert "prox_alpha" in loss.required_keys
    behav = T([[math.log(0.5), math.log(0.5)]])
    theta = T([[math.log(0.8), math.log(0.5)]]).requires_grad_()
    mb = {"old_log_probs": behav, "rollout_log_probs": behav, "prox_alpha": T([[0.5, 0.0]]),
          "advantages": T([[1.0, 1.0]]), "response_mask": torch.ones(1, 2), "ref_log_prob": theta.detach()}
    total, metrics = loss({"logprobs": theta}, mb, norm=2.0, n_tokens=2.0)
    # token 0: log pi_prox = (log .5 + log .8) / 2, pi_prox = sqrt(.4); r = .8 / sqrt(.4) = 1.265 > 1.2: clipped
    # (A > 0) to 1.2, times w = sqrt(.4) / .5 = 1.265; token 1: on-policy, r = 1, w = 1
    w0 = math.sqrt(0.4) / 0.5
    assert close(total, -(w0 * 1.2 + 1.0), tol=1e-5)
    assert close(metrics["actor/behav_weight_mean"], (w0 + 1.0) / 2, tol=1e-5)
    total.backward()
    assert close(theta.grad, [[0.0, -1.0]])  # the clipped token gives none; pi_prox is not differentiated
    with pytest.raises(ConfigError, match="actor.proximal=loglinear interpolates"):
        load_config(REPO / "configs/grpo_tiny.yaml", ["actor.proximal=loglinear"], validate=True)
    with pytest.raises(ConfigError, match="choose one of: recompute, loglinear"):
        load_config(REPO / "configs/grpo_tiny.yaml", ["actor.proximal=harmonic"], validate=True)


def test_token_versions_of_each_mode():
    """What the loglinear alpha is computed from: fully_async's per-token record as it is; one-step async's
    batch sampled at the version its rollout was launched with (_Inflight puts it in meta_info); a sync
    batch at the trainer's current version. Tokens past the response: -1."""
    from types import SimpleNamespace

    from megappo.ppo.ray_trainer import _Inflight
    from megappo.ppo.staleness import batch_token_versions, loglinear_proximal_alpha
    from megappo.protocol import DataProto

    mask = T([[1, 1, 0], [1, 0, 0]])
    sync = DataProto.from_dict({"response_mask": mask})
    assert batch_token_versions(sync, 3).tolist() == [[3, 3, -1], [3, -1, -1]]
    call = SimpleNamespace(result=lambda: [DataProto.from_dict({"response_mask": mask})])
    launched = _Inflight(call, step=4, sync_metrics={}, version=2).result()
    assert batch_token_versions(launched, 3).tolist() == [[2, 2, -1], [2, -1, -1]]
    streamed = DataProto.from_dict({"response_mask": mask, "token_versions": T([[1, 2, -1], [3, -1, -1]])})
    assert batch_token_versions(streamed, 3).tolist() == [[1, 2, -1], [3, -1, -1]]
    assert loglinear_proximal_alpha(batch_token_versions(launched, 3), 3)[0, 0] == 0.5


def test_without_a_pi_old_forward_the_updates_first_step_measures_the_sampler_gap():
    """No pi_old forward (actor.proximal=loglinear or actor.use_rollout_log_probs): old_log_probs are the
    sampler's own, so comparing them says nothing. The update's first optimizer step (weights as they sampled,
    in sync mode) reports |log pi_theta - log pi_rollout| on its tokens instead, token-weighted so micro-batches
    and DP ranks sum to the mini-batch mean; later steps (moved weights) and a recomputing loss report none.
    The step's metrics then take no parity from the batch (it would read 0)."""
    from megappo.config import load_config
    from megappo.ppo.losses import PolicyLoss
    from megappo.ppo.metrics import step_metrics

    def loss_for(*overrides):
        return PolicyLoss.from_config(load_config(REPO / "configs/grpo_tiny.yaml", list(overrides), validate=True).actor)

    a3po = loss_for("actor.policy_loss=decoupled", "actor.proximal=loglinear", "actor.use_rollout_log_probs=false")
    rollout_only = loss_for("actor.use_rollout_log_probs=true")
    recompute = loss_for("actor.use_rollout_log_probs=false")
    assert a3po.parity_in_update and rollout_only.parity_in_update and not recompute.parity_in_update
    behav = T([[-1.0, -2.0, -0.5]])
    theta = T([[-1.1, -1.7, -1000.0]])  # the third token is padding (mask 0): its exp would overflow
    mb = {"old_log_probs": behav, "rollout_log_probs": behav, "prox_alpha": torch.zeros(1, 3),
          "advantages": T([[1.0, -1.0, 1.0]]), "response_mask": T([[1.0, 1.0, 0.0]]), "ref_log_prob": behav}
    _, first = a3po({"logprobs": theta}, mb, norm=4.0, n_tokens=4.0, first=True)  # 2 of the mini-batch's 4 tokens
    assert close(first["rollout/logprob_diff_mean"], (0.1 + 0.3) / 2 * 0.5)
    assert close(first["rollout/token_mult_prob_error"], (math.exp(0.1) + math.exp(0.3)) / 2 * 0.5)
    for loss, is_first in ((a3po, False), (recompute, True)):
        assert "rollout/logprob_diff_mean" not in loss({"logprobs": theta}, mb, norm=4.0, n_tokens=4.0,
                                                       first=is_first)[1]
    _, m = rollout_only({"logprobs": theta}, mb, norm=2.0, n_tokens=2.0, first=True)
    assert close(m["rollout/logprob_diff_mean"], 0.2)

    from test_ppo_metrics import _batch
    b = _batch()  # old_log_probs 0.01 off the sampler's
    kw = dict(step=1, batch=b, reward_metrics={"objective/scores": 0.5}, kl={}, critic={}, prompts_per_step=1,
              responses_per_step=3, dataset_size=3, step_s=1.0, since_start_s=1.0)
    assert step_metrics(actor={}, **kw)["rollout/logprob_diff_max"] == pytest.approx(0.01, abs=1e-6)
    b.batch["old_log_probs"] = b.batch["rollout_log_probs"]
    m = step_metrics(actor={"rollout/logprob_diff_mean": 0.2}, pi_old_recomputed=False, **kw)
    assert m["rollout/logprob_diff_mean"] == 0.2 and "rollout/logprob_diff_max" not in m
    assert "rollout/tis_weight_mean" not in m
