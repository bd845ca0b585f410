"""core_algos and the per-token losses (ppo/losses.py) against hand-computed numbers on tiny tensors (expected
values never come from the function under test)."""

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megappo.ppo import core_algos as ca, losses

REPO = __import__("pathlib").Path(__file__).resolve().parents[1]

T = torch.tensor


def close(a, b, tol=1e-5):
    return torch.allclose(torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64), atol=tol)


# ----------------------------------------------------------------------------- masked statistics
def test_masked_stats_ignore_padding():
    x = T([[1.0, 2.0, 100.0], [3.0, 4.0, 5.0]])
    m = T([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    assert close(ca.masked_sum(x, m), 15.0)
    assert close(ca.masked_mean(x, m), 3.0)  # (1+2+3+4+5)/5
    assert close(ca.masked_mean(x, m, dim=-1), [1.5, 4.0])
    assert close(ca.masked_var(x, m), 2.5)  # sum of sq dev = 10, / (5-1)
    assert close(ca.masked_var(x, m, unbiased=False), 2.0)
    w = ca.masked_whiten(x, m)
    assert close(w[0, 2], 0.0)  # padding zeroed, not (100-3)/std
    assert close(w[0, 0], (1 - 3) / math.sqrt(2.5 + 1e-8))
    assert close(ca.masked_whiten(x, m, shift_mean=False)[1, 2], (5 - 3) / math.sqrt(2.5 + 1e-8) + 3)


def test_masked_mean_empty_mask_is_zero():
    assert close(ca.masked_mean(T([[5.0, 6.0]]), T([[0.0, 0.0]])), 0.0)


# ----------------------------------------------------------------------------- advantages
def test_gae_matches_hand_computation_and_padding_does_not_leak():
    rewards = T([[0.0, 0.0, 1.0], [0.0, 2.0, 7.0]])  # row 1: padding holds junk reward 7
    values = T([[0.5, 0.5, 0.5], [0.1, 0.2, 9.0]])  # and a junk value 9
    mask = T([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    gamma, lam = 0.9, 0.8
    adv, ret = ca.compute_gae_advantages(rewards, values, mask, gamma, lam, whiten=False)
    # row 0: d2 = 1 - .5 = .5; d1 = 0 + .9*.5 - .5 = -.05; d0 = -.05
    a2 = 0.5
    a1 = -0.05 + gamma * lam * a2
    a0 = -0.05 + gamma * lam * a1
    # row 1 (length 2): d1 = 2 + 0 - .2 = 1.8; d0 = 0 + .9*.2 - .1 = .08
    b1 = 1.8
    b0 = 0.08 + gamma * lam * b1
    assert close(adv, [[a0, a1, a2], [b0, b1, 0.0]])
    assert close(ret, [[a0 + 0.5, a1 + 0.5, a2 + 0.5], [b0 + 0.1, b1 + 0.2, 0.0]])


def test_gae_whitening_is_a_separate_flag():
    rewards, values = T([[0.0, 1.0], [1.0, 0.0]]), T([[0.2, 0.3], [0.4, 0.1]])
    mask = T([[1.0, 1.0], [1.0, 1.0]])
    raw, ret_raw = ca.compute_gae_advantages(rewards, values, mask, 1.0, 1.0, whiten=False)
    white, ret_white = ca.compute_gae_advantages(rewards, values, mask, 1.0, 1.0, whiten=True)
    assert close(ret_raw, ret_white)  # returns come from the raw advantages
    flat = raw.flatten()
    expected = (flat - flat.mean()) / torch.sqrt(flat.var() + 1e-8)
    assert close(white.flatten(), expected)


def test_grpo_group_normalisation():
    rewards = T([[0.0, 1.0], [0.0, 0.0], [0.0, 3.0], [0.0, 5.0], [0.0, 4.0]])
    mask = T([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [1.0, 1.0], [1.0, 1.0]])
    index = np.array(["a", "a", "b", "b", "c"], dtype=object)
    adv, ret = ca.compute_grpo_outcome_advantage(rewards, mask, index, epsilon=0.0)
    # group a: scores 1, 0 -> mean .5, std (unbiased) sqrt(.5); group b: 3, 5 -> mean 4, std sqrt(2)
    sa, sb = math.sqrt(0.5), math.sqrt(2.0)
    expected = [[0.5 / sa, 0.5 / sa], [-0.5 / sa, 0.0], [-1 / sb, -1 / sb], [1 / sb, 1 / sb], [4.0, 4.0]]
    assert close(adv, expected)  # single-row group c: mean 0, std 1
    assert close(ret, adv)
    adv_nostd, _ = ca.compute_grpo_outcome_advantage(rewards, mask, index, norm_by_std=False)
    assert close(adv_nostd[:, 0], [0.5, -0.5, -1.0, 1.0, 4.0])


def test_rloo_leave_one_out_baseline():
    rewards = T([[1.0], [2.0], [6.0], [3.0]])
    mask = torch.ones(4, 1)
    adv, _ = ca.compute_rloo_outcome_advantage(rewards, mask, np.array([0, 0, 0, 1]))
    # 1 - (2+6)/2 = -3; 2 - (1+6)/2 = -1.5; 6 - (1+2)/2 = 4.5; lone row keeps its score
    assert close(adv[:, 0], [-3.0, -1.5, 4.5, 3.0])


def test_reinforce_plus_plus_discounted_returns_then_whitened():
    rewards = T([[1.0, 0.0, 2.0], [0.0, 3.0, 9.0]])
    mask = T([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv, ret = ca.compute_reinforce_plus_plus_outcome_advantage(rewards, mask, gamma=0.5)
    expected_ret = [[1 + 0.5 * 0 + 0.25 * 2, 0 + 0.5 * 2, 2.0], [0 + 0.5 * 3, 3.0, 0.0]]
    assert close(ret, expected_ret)
    valid = torch.tensor([1.5, 1.0, 2.0, 1.5, 3.0])
    mean, std = valid.mean(), valid.std()
    assert close(adv[0], (torch.tensor([1.5, 1.0, 2.0]) - mean) / std, tol=1e-4)
    assert close(adv[1, 2], 0.0)


# ----------------------------------------------------------------------------- KL
def test_kl_estimators_by_hand():
    logp, ref = T([-1.0, -2.0]), T([-1.5, -1.0])
    d = [0.5, -1.0]  # logp - ref
    assert close(ca.kl_penalty(logp, ref, "k1"), d)
    assert close(ca.kl_penalty(logp, ref, "k2"), [0.125, 0.5])
    assert close(ca.kl_penalty(logp, ref, "k3"), [math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1.0 - 1])
    assert close(ca.kl_penalty(T([0.0]), T([-30.0]), "k3"), [10.0])  # e^-30 + 30 - 1 = 29, clamped
    assert close(ca.kl_penalty(T([-30.0]), T([0.0]), "k3"), [10.0])  # exp(30) clamped
    with pytest.raises(ValueError, match="k1, k2, k3"):
        ca.kl_penalty(logp, ref, "k9")


def test_kl_controllers_update_and_resume():
    fixed = ca.FixedKLController(0.05)
    fixed.update(123.0, 8)
    assert fixed.value == 0.05
    ctl = ca.AdaptiveKLController(init_kl_coef=0.1, target_kl=2.0, horizon=100)
    ctl.update(current_kl=3.0, n_steps=10)  # err = clip(0.5) = 0.2 -> x1.02
    assert close(ctl.value, 0.1 * 1.02)
    ctl.update(current_kl=1.8, n_steps=10)  # err = -0.1 -> x0.99
    assert close(ctl.value, 0.1 * 1.02 * 0.99)
    resumed = ca.AdaptiveKLController(init_kl_coef=0.5, target_kl=2.0, horizon=100)
    resumed.load_state_dict(ctl.state_dict())
    resumed.update(0.0, 10)
    ctl.update(0.0, 10)
    assert resumed.value == ctl.value and close(ctl.value, 0.1 * 1.02 * 0.99 * 0.98)


def test_make_kl_controller_from_config():
    cfg = SimpleNamespace(kl_ctrl=SimpleNamespace(type="adaptive", kl_coef=0.2, target_kl=1.0, horizon=10))
    ctl = ca.make_kl_controller(cfg)
    assert isinstance(ctl, ca.AdaptiveKLController) and ctl.value == 0.2 and ctl.horizon == 10
    assert isinstance(ca.make_kl_controller(SimpleNamespace(type="fixed", kl_coef=0.3)), ca.FixedKLController)
    with pytest.raises(ValueError, match="fixed or adaptive"):
        ca.make_kl_controller(SimpleNamespace(type="pid", kl_coef=0.1))


def test_apply_kl_penalty_in_reward():
    scores = T([[0.0, 1.0], [2.0, 0.0]])
    logp, ref = T([[-1.0, -1.0], [-2.0, -3.0]]), T([[-1.5, -2.0], [-1.0, 0.0]])
    mask = T([[1.0, 1.0], [1.0, 0.0]])
    ctl = ca.AdaptiveKLController(0.1, target_kl=1.0, horizon=10)
    rewards, metrics = ca.apply_kl_penalty(scores, logp, ref, mask, ctl, kind="k1")
    # k1: [[.5, 1.], [-1., (masked)]]
    assert close(rewards, [[0 - 0.05, 1 - 0.1], [2 + 0.1, 0.0]])
    assert close(metrics["objective/kl"], (1.5 + -1.0) / 2)
    assert metrics["objective/kl_coef"] == 0.1
    assert close(metrics["objective/non_score_reward"], -0.1 * 0.25)
    assert close(metrics["objective/rlhf_reward"], ((0.95 - 0.1) + 2.1) / 2)
    assert close(ctl.value, 0.1 * (1 + (-0.2) * 2 / 10))  # kl .25 / target 1 - 1 -> clipped -0.2, n_steps = B


# ----------------------------------------------------------------------------- aggregation
LOSS = T([[1.0, 2.0, 3.0], [4.0, 5.0, 0.0], [6.0, 0.0, 0.0]])
MASK = T([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])


def test_agg_loss_modes_by_hand():
    assert close(losses.agg_loss(LOSS, MASK, "token-mean"), 21.0 / 6)
    assert close(losses.agg_loss(LOSS, MASK, "seq-mean-token-sum"), (6 + 9 + 6) / 3)
    assert close(losses.agg_loss(LOSS, MASK, "seq-mean-token-mean"), (2 + 4.5 + 6) / 3)
    assert close(losses.agg_loss(LOSS, MASK, "token-mean", normalizer=12), 21.0 / 12)
    with pytest.raises(ValueError, match="token-mean"):
        losses.agg_loss(LOSS, MASK, "mean")


@pytest.mark.parametrize("mode", losses.LOSS_AGG_MODES)
@pytest.mark.parametrize("splits", [[1, 1, 1, 1, 1], [2, 3], [4, 1], [5]])
def test_global_normalizer_makes_micro_batch_split_invariant(mode, splits):
    g = torch.Generator().manual_seed(0)
    loss_mat = torch.rand(5, 4, generator=g, dtype=torch.float64).requires_grad_()
    lengths = [4, 1, 3, 2, 4]
    mask = torch.tensor([[1.0 if t < n else 0.0 for t in range(4)] for n in lengths], dtype=torch.float64)
    full = losses.agg_loss(loss_mat, mask, mode)
    (full_grad,) = torch.autograd.grad(full, loss_mat)
    normalizer = losses.loss_normalizer(mask, mode)  # global count, computed once per mini-batch
    total, start = 0.0, 0
    for size in splits:  # micro-batches (or DP ranks)
        sl = slice(start, start + size)
        total = total + losses.agg_loss(loss_mat[sl], mask[sl], mode, normalizer=normalizer)
        start += size
    (split_grad,) = torch.autograd.grad(total, loss_mat)
    assert close(total, full, tol=1e-12) and close(split_grad, full_grad, tol=1e-12)
    if len(splits) > 1:  # without the global normalizer the sum of micro-batch means is wrong
        local = sum(losses.agg_loss(loss_mat[s:s + n], mask[s:s + n], mode)
                    for s, n in zip(np.cumsum([0] + splits[:-1]), splits))
        assert not close(local, full, tol=1e-6)


# ----------------------------------------------------------------------------- losses
def test_policy_loss_clip_and_dual_clip_by_hand():
    old = T([[0.0, 0.0, 0.0, 0.0]])
    logp = T([[math.log(1.5), math.log(0.5), math.log(1.1), math.log(5.0)]])
    adv = T([[1.0, -1.0, 2.0, -1.0]])
    mask = torch.ones(1, 4)
    loss, clipfrac, approx_kl, dual = losses.compute_policy_loss(old, logp, adv, mask, clip_ratio=0.2)
    # token losses: max(-A r, -A clip(r)):  r=1.5,A=1 -> max(-1.5,-1.2) = -1.2 (clipped)
    # r=.5,A=-1 -> max(.5,.8) = .8 (clipped); r=1.1,A=2 -> -2.2; r=5,A=-1 -> max(5, 1.2) = 5
    assert close(loss, (-1.2 + 0.8 - 2.2 + 5.0) / 4)
    assert close(clipfrac, 0.5)
    d = [math.log(1.5), math.log(0.5), math.log(1.1), math.log(5.0)]
    assert close(approx_kl, sum(0.5 * x * x for x in d) / 4)
    assert close(dual, 0.0)
    loss_c, _, _, dual_c = losses.compute_policy_loss(old, logp, adv, mask, clip_ratio=0.2, clip_ratio_c=3.0)
    # dual clip bounds the last token (A<0) at -A * 3 = 3
    assert close(loss_c, (-1.2 + 0.8 - 2.2 + 3.0) / 4)
    assert close(dual_c, 0.25)
    with pytest.raises(ValueError, match="> 1"):
        losses.compute_policy_loss(old, logp, adv, mask, clip_ratio=0.2, clip_ratio_c=0.5)


def test_policy_loss_masks_padding_and_has_ppo_gradient():
    old = T([[0.0, 0.0]])
    logp = T([[0.0, 3.0]]).requires_grad_()
    adv = T([[2.0, 100.0]])
    mask = T([[1.0, 0.0]])
    loss, clipfrac, approx_kl, _ = losses.compute_policy_loss(old, logp, adv, mask, clip_ratio=0.2)
    loss.backward()
    assert close(loss, -2.0) and close(clipfrac, 0.0) and close(approx_kl, 0.0)
    assert close(logp.grad, [[-2.0, 0.0]])  # d(-A e^{logp - old})/dlogp at ratio 1 = -A


def test_importance_weights_truncated_and_applied():
    old = T([[0.0, 0.0, 0.0]])
    rollout = T([[math.log(2.0), math.log(0.25), 0.0]])
    mask = T([[1.0, 1.0, 0.0]])
    w, metrics = losses.compute_importance_weights(old, rollout, mask, cap=2.0)
    assert close(w, [[0.5, 2.0, 0.0]])  # exp(0 - log 2) = .5; exp(log 4) = 4 -> capped at 2; padding 0
    assert close(metrics["rollout/tis_capped_frac"], 0.5)
    assert close(metrics["rollout/tis_weight_mean"], 1.25)
    logp, adv = T([[0.0, 0.0, 0.0]]), T([[1.0, 1.0, 1.0]])
    loss, *_ = losses.compute_policy_loss(old, logp, adv, mask, clip_ratio=0.2, importance_weights=w)
    assert close(loss, (-1 * 0.5 + -1 * 2.0) / 2)


def test_value_loss_clipped_by_hand():
    vpreds = T([[1.0, 0.5, 3.0]])
    values = T([[0.5, 0.4, 0.0]])
    returns = T([[1.0, 2.0, 5.0]])
    mask = T([[1.0, 1.0, 0.0]])
    loss, clipfrac = losses.compute_value_loss(vpreds, values, returns, mask, cliprange_value=0.2)
    # tok0: v=1, clip -> .7: max(0, .09) = .09 (clipped larger); tok1: v=.5 in range: (1.5)^2 = 2.25
    assert close(loss, 0.5 * (0.09 + 2.25) / 2)
    assert close(clipfrac, 0.5)


def test_entropy_loss_aggregates():
    ent = T([[1.0, 3.0], [2.0, 8.0]])
    mask = T([[1.0, 1.0], [1.0, 0.0]])
    assert close(losses.compute_entropy_loss(ent, mask), 2.0)
    assert close(losses.compute_entropy_loss(ent, mask, "seq-mean-token-mean"), (2.0 + 2.0) / 2)


@pytest.mark.parametrize("module", [ca, losses], ids=["core_algos", "losses"])
def test_core_algos_is_pure_torch(module):
    import ast
    from pathlib import Path

    tree = ast.parse(Path(module.__file__).read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not imported & {"ray", "megatron", "vllm"}


def test_estimator_table_has_exactly_the_config_choices():
    from megappo.config.schema import CHOICES

    assert tuple(ca.ADV_ESTIMATORS) == CHOICES["algorithm.adv_estimator"]
    with pytest.raises(ValueError, match="unknown algorithm.adv_estimator 'nope'"):
        ca.compute_advantages(torch.zeros(2, 3), torch.ones(2, 3), SimpleNamespace(adv_estimator="nope"))


def test_policy_loss_micro_batches_sum_to_the_mini_batch_loss():
    """PolicyLoss returns a SUM; divided by the mini-batch's normaliser the micro-batches add up to
    the loss of the whole mini-batch (core_algos with its own count), entropy and KL terms included."""
    from megappo.ppo.losses import PolicyLoss, ValueLoss

    g = torch.Generator().manual_seed(0)
    B, T = 6, 5
    mask = (torch.rand(B, T, generator=g) > 0.3).float()
    mask[:, 0] = 1
    mb = {"old_log_probs": -torch.rand(B, T, generator=g), "advantages": torch.randn(B, T, generator=g),
          "response_mask": mask, "ref_log_prob": -torch.rand(B, T, generator=g),
          "values": torch.randn(B, T, generator=g), "returns": torch.randn(B, T, generator=g)}
    outs = {"logprobs": -torch.rand(B, T, generator=g), "entropy": torch.rand(B, T, generator=g),
            "values": torch.randn(B, T, generator=g)}
    for loss in (PolicyLoss(loss_agg_mode="seq-mean-token-mean", entropy_coeff=0.01, use_kl_loss=True,
                            kl_loss_coef=0.1), PolicyLoss(), ValueLoss(cliprange_value=0.5)):
        norm, n_tokens = loss.normalizer(mask), float(mask.sum())
        parts = [loss({k: v[i:i + 2] for k, v in outs.items()}, {k: v[i:i + 2] for k, v in mb.items()},
                      norm=norm, n_tokens=n_tokens) for i in range(0, B, 2)]
        whole, metrics = loss(outs, mb, norm=norm, n_tokens=n_tokens)
        torch.testing.assert_close(sum(p[0] for p in parts), whole)
        for k in metrics:  # every metric is additive over micro-batches
            torch.testing.assert_close(sum(torch.as_tensor(p[1][k]) for p in parts), torch.as_tensor(metrics[k]))
        if isinstance(loss, ValueLoss):
            ref, _ = losses.compute_value_loss(outs["values"], mb["values"], mb["returns"], mask, 0.5)
        else:
            ref, *_ = losses.compute_policy_loss(mb["old_log_probs"], outs["logprobs"], mb["advantages"], mask,
                                                 loss.clip_ratio, loss.clip_ratio_c, loss.loss_agg_mode)
            if loss.use_kl_loss:
                ref = ref - 0.01 * losses.compute_entropy_loss(outs["entropy"], mask, loss.loss_agg_mode) + \
                    0.1 * losses.agg_loss(ca.kl_penalty(outs["logprobs"], mb["ref_log_prob"], "k3"), mask,
                                          loss.loss_agg_mode)
        torch.testing.assert_close(whole / norm, ref)


# ---- what a verl user expects (issue: algorithms) -----------------------------------------------------

def test_adaptive_kl_controller_holds_the_per_token_target_on_long_responses():
    """The controller sees each response's token-mean KL (verl's convention), so a long response at the
    target KL per token leaves beta alone; above it, beta grows at the clipped rate, whatever T is."""
    B, T = 4, 200
    mask = torch.ones(B, T)
    scores = torch.zeros(B, T)
    ref = torch.zeros(B, T)
    ctl = ca.AdaptiveKLController(0.05, target_kl=0.1, horizon=100)
    for _ in range(5):  # exactly on target per token (summed over 200 tokens it would be 20x the target)
        _, m = ca.apply_kl_penalty(scores, ref + 0.1, ref, mask, ctl, kind="k1")
    assert ctl.value == pytest.approx(0.05) and m["objective/kl_token_mean"] == pytest.approx(0.1)
    assert m["objective/kl"] == pytest.approx(20.0)  # open-instruct's objective/kl stays the summed KL
    trajectory = []
    for _ in range(3):  # twice the target: error clipped at 0.2, beta *= 1 + 0.2 * B / horizon per update
        ca.apply_kl_penalty(scores, ref + 0.2, ref, mask, ctl, kind="k1")
        trajectory.append(ctl.value)
    assert trajectory == pytest.approx([0.05 * 1.008 ** k for k in (1, 2, 3)])
    half = ca.AdaptiveKLController(0.05, target_kl=0.1, horizon=100)  # shorter responses, same per-token KL
    ca.apply_kl_penalty(scores[:, :10], ref[:, :10] + 0.2, ref[:, :10], mask[:, :10], half, kind="k1")
    assert half.value == pytest.approx(trajectory[0])


def test_kl_estimator_aliases_and_abs():
    logp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
    for alias, kind in (("kl", "k1"), ("mse", "k2"), ("low_var_kl", "k3")):
        assert torch.equal(ca.kl_penalty(logp, ref, alias), ca.kl_penalty(logp, ref, kind))
    assert ca.kl_penalty(logp, ref, "abs").tolist() == [0.5, 1.0]


def test_gae_with_gapped_masks_matches_a_loop_over_the_valid_tokens():
    g = torch.Generator().manual_seed(3)
    B, T = 5, 9
    mask = (torch.rand(B, T, generator=g) > 0.35).float()
    mask[:, 0] = 1
    rewards, values = torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)
    adv, ret = ca.compute_gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8, whiten=False)
    for b in range(B):
        idx = mask[b].nonzero()[:, 0].tolist()  # the valid tokens, gaps squeezed out
        r, v = rewards[b, idx], values[b, idx]
        a, last = torch.zeros(len(idx)), 0.0
        for k in reversed(range(len(idx))):
            nxt = v[k + 1] if k + 1 < len(idx) else 0.0
            last = r[k] + 0.9 * nxt - v[k] + 0.9 * 0.8 * last
            a[k] = last
        torch.testing.assert_close(adv[b, idx], a)
        torch.testing.assert_close(ret[b, idx], a + v)
        assert adv[b][mask[b] == 0].abs().sum() == 0
    # right padding alone (no gaps): exactly the plain recursion, as before
    right = torch.tensor([[1.0, 1, 1, 0, 0]])
    a2, _ = ca.compute_gae_advantages(torch.tensor([[0.0, 0, 1, 0, 0]]), torch.tensor([[0.5, 0.4, 0.3, 9, 9]]),
                                      right, gamma=1.0, lam=1.0, whiten=False)
    torch.testing.assert_close(a2, torch.tensor([[0.5, 0.6, 0.7, 0.0, 0.0]]))


def test_new_estimators_on_a_hand_worked_batch():
    # two prompts x 3 responses; outcome reward on the last token; lengths 2,3,1 and 3,3,2
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1], [1, 1, 1], [1, 1, 0]], dtype=torch.float32)
    s = torch.tensor([1.0, 0.0, 0.5, 0.0, 0.0, 2.0])
    rewards = torch.zeros(6, 3)
    for i, n in enumerate(mask.sum(-1).long().tolist()):
        rewards[i, n - 1] = s[i]
    index = ["a", "a", "a", "b", "b", "b"]
    algo = SimpleNamespace(gamma=1.0, lam=1.0, whiten_advantages=False, norm_adv_by_std_in_grpo=False)
    # REINFORCE++-baseline: group mean removed, then whitened over the batch's tokens
    algo.adv_estimator = "reinforce_plus_plus_baseline"
    rb, _ = ca.compute_advantages(rewards, mask, algo, index=index)
    centred = (s - torch.tensor([0.5] * 3 + [2 / 3] * 3)).unsqueeze(-1) * mask
    torch.testing.assert_close(rb, ca.masked_whiten(centred, mask) * mask)
    # GPG: alpha = B / nonzero = 6 / 3
    algo.adv_estimator = "gpg"
    gpg, _ = ca.compute_advantages(rewards, mask, algo, index=index)
    torch.testing.assert_close(gpg[:, 0], 2.0 * (s - torch.tensor([0.5] * 3 + [2 / 3] * 3)))
    # OPO: length-weighted group baseline: a: (2*1 + 3*0 + 1*.5)/6; b: (0 + 0 + 2*2)/8
    algo.adv_estimator = "opo"
    opo, _ = ca.compute_advantages(rewards, mask, algo, index=index)
    torch.testing.assert_close(opo[:, 0], s - torch.tensor([2.5 / 6] * 3 + [0.5] * 3))
    # pass@k: only each group's best learns, best - second best (no std normalisation here)
    algo.adv_estimator = "grpo_passk"
    pk, _ = ca.compute_advantages(rewards, mask, algo, index=index)
    torch.testing.assert_close(pk[:, 0], torch.tensor([0.5, 0, 0, 0, 0, 2.0]))
    # ReMax: reward-to-go minus the greedy response's reward
    algo.adv_estimator = "remax"
    rm, ret = ca.compute_advantages(rewards, mask, algo, baselines=torch.full((6,), 0.25))
    torch.testing.assert_close(ret[:, 0], s)
    torch.testing.assert_close(rm, (s.unsqueeze(-1) - 0.25) * mask)
    # Dr. GRPO: no std normalisation, and the loss is not normalised per response length
    algo.adv_estimator = "grpo"
    dr, _ = ca.compute_advantages(rewards, mask, algo, index=index)
    torch.testing.assert_close(dr[:, 0], s - torch.tensor([0.5] * 3 + [2 / 3] * 3))
    loss = torch.ones(6, 3)
    assert losses.loss_normalizer(mask, "seq-mean-token-sum-norm") == 18.0  # 6 sequences x T = 3
    assert losses.agg_loss(loss, mask, "seq-mean-token-sum-norm").item() == pytest.approx(mask.sum().item() / 18)


def test_ppo_kl_is_k1_and_approx_kl_is_k2():
    from megappo.ppo.losses import PolicyLoss

    old, new = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.0]])
    mb = {"old_log_probs": old, "advantages": torch.ones(1, 2), "response_mask": torch.ones(1, 2)}
    _, m = PolicyLoss()({"logprobs": new}, mb, norm=2.0, n_tokens=2.0)
    assert m["actor/ppo_kl"].item() == pytest.approx(((-1.0 + 1.5) + (-2.0 + 1.0)) / 2)  # mean(old - new)
    assert m["actor/approx_kl"].item() == pytest.approx((0.5 * 0.25 + 0.5 * 1.0) / 2)


# ---- DAPO's controls (Yu et al. 2025), each against the paper's formula on random inputs -----------------

def test_clip_higher_matches_the_dapo_objective():
    """J = 1/sum|o_i| sum_i sum_t min(r A, clip(r, 1 - eps_low, 1 + eps_high) A) (DAPO eq. 8, token-level),
    so loss = -J with token-mean aggregation; the symmetric default is the PPO clip."""
    g = torch.Generator().manual_seed(0)
    old = torch.randn(6, 9, generator=g) - 2
    logp = old + 0.4 * torch.randn(6, 9, generator=g)
    adv = torch.randn(6, 9, generator=g)
    mask = (torch.rand(6, 9, generator=g) > 0.2).long()
    r = torch.exp(logp - old)
    for low, high in ((0.2, 0.28), (0.1, 0.5), (0.2, 0.2)):
        j = torch.minimum(r * adv, torch.clamp(r, 1 - low, 1 + high) * adv)
        expected = -(j * mask).sum() / mask.sum()
        loss, clipfrac, _, _ = losses.compute_policy_loss(old, logp, adv, mask, clip_ratio=0.99, clip_ratio_c=None,
                                                          clip_ratio_low=low, clip_ratio_high=high)
        torch.testing.assert_close(loss, expected)
        clipped = (torch.clamp(r, 1 - low, 1 + high) * adv < r * adv)
        torch.testing.assert_close(clipfrac, (clipped * mask).sum() / mask.sum())
    sym, *_ = losses.compute_policy_loss(old, logp, adv, mask, clip_ratio=0.2, clip_ratio_c=None)
    both, *_ = losses.compute_policy_loss(old, logp, adv, mask, clip_ratio=0.2, clip_ratio_c=None, clip_ratio_low=0.2,
                                          clip_ratio_high=0.2)
    assert torch.equal(sym, both)
    # what clip-higher let through = what symmetric clipping clips minus what clip-higher clips
    _, sym_frac, _, _ = losses.compute_policy_loss(old, logp, adv, mask, clip_ratio=0.2, clip_ratio_c=None)
    _, high_frac, _, _ = losses.compute_policy_loss(old, logp, adv, mask, clip_ratio=0.2, clip_ratio_c=None,
                                                    clip_ratio_high=0.5)
    kept = losses.clip_higher_kept_frac(old, logp, adv, mask, 0.2, 0.5)
    assert kept > 0
    torch.testing.assert_close(kept, sym_frac - high_frac)


def test_policy_loss_from_config_passes_the_decoupled_clip():
    from megappo.config import load_config
    from megappo.ppo.losses import PolicyLoss

    cfg = load_config(REPO / "configs/grpo_tiny.yaml", ["actor.clip_ratio_high=0.28"], validate=False)
    loss = PolicyLoss.from_config(cfg.actor)
    assert (loss.clip_ratio, loss.clip_ratio_low, loss.clip_ratio_high) == (0.2, None, 0.28)


def test_overlong_penalty_matches_the_dapo_formula():
    """DAPO eq. 13 with L_max = max_length, L_cache = buffer: 0 for |y| <= L_max - L_cache, else
    ((L_max - L_cache) - |y|) / L_cache (scaled by the factor, verl's penalty_factor)."""
    from megappo.rewards.manager import overlong_penalty

    g = torch.Generator().manual_seed(1)
    for max_len, buf, factor in ((512, 128, 1.0), (64, 16, 0.5), (24, 24, 2.0)):
        for length in torch.randint(1, max_len + 1, (200,), generator=g).tolist() + [max_len - buf, max_len]:
            paper = 0.0 if length <= max_len - buf else ((max_len - buf) - length) / buf
            assert overlong_penalty(length, max_len, buf, factor) == pytest.approx(factor * paper)
        assert overlong_penalty(max_len, max_len, buf, factor) == pytest.approx(-factor)
    assert overlong_penalty(500, 512, 0) == 0.0  # off


def test_reward_manager_applies_the_overlong_penalty(tmp_path):
    from megappo.protocol import DataProto
    from megappo.rewards.manager import RewardManager

    class Tok:
        eos_token_id, pad_token_id = 0, 0

        def decode(self, ids, skip_special_tokens=True):
            return "#### 7"

    R = 10
    lengths = [3, 6, 8, 10]
    mask = torch.tensor([[1] * n + [0] * (R - n) for n in lengths])
    data = DataProto({"responses": torch.full((4, R), 5), "response_mask": mask, "stopped": torch.ones(4, dtype=torch.bool)},
                     {"data_source": np.array(["arithmetic"] * 4, dtype=object),
                      "reward_model": np.array([{"ground_truth": "7"}] * 4, dtype=object)})
    manager = RewardManager(Tok(), 0, overlong_buffer_len=4, overlong_penalty_factor=1.0, max_response_length=R)
    scores, metrics = manager(data)
    assert scores.sum(-1).tolist() == pytest.approx([1.0, 1.0, 1.0 - 2 / 4, 1.0 - 4 / 4])
    assert metrics["reward/overlong_frac"] == 0.5 and metrics["reward/overlong_penalty_mean"] == pytest.approx(-0.375)
    assert metrics["objective/verifiable_correct_rate"] == 1.0  # correctness is the rule's, not the shaped score
    with pytest.raises(ValueError, match="reward.overlong_buffer_len=11 must be in"):
        RewardManager(Tok(), 0, overlong_buffer_len=11, max_response_length=R)


def test_dynamic_sampling_keeps_groups_whose_scores_differ():
    from megappo.workers.rollout.vllm_rollout import left_pad_prompts
    from megappo.protocol import DataProto

    uids = np.array(["a", "a", "b", "b", "c", "c"], dtype=object)
    varied, same = ca.groups_with_varied_scores(uids, torch.tensor([1.0, 0.0, 0.1, 0.1, -1.0, -1.0]))
    assert (varied, same) == (["a"], ["b", "c"])

    def part(width, rows):
        ids = torch.arange(rows * width).reshape(rows, width)
        return DataProto({"prompts": ids, "input_ids": torch.cat([ids, ids[:, :2]], 1),
                          "attention_mask": torch.ones(rows, width + 2, dtype=torch.long),
                          "position_ids": torch.arange(width + 2).repeat(rows, 1),
                          "responses": ids[:, :2]}, {"uid": np.array(["x"] * rows, dtype=object)})

    a, b = left_pad_prompts([part(3, 2), part(5, 1)], pad_id=9)
    assert a.batch["prompts"].shape == (2, 5) and a.batch["input_ids"].shape == (2, 7)
    assert a.batch["prompts"][0].tolist() == [9, 9, 0, 1, 2] and a.batch["attention_mask"][0].tolist()[:3] == [0, 0, 1]
    assert a.batch["position_ids"][0].tolist() == [0, 0, 0, 1, 2, 3, 4] and torch.equal(b.batch["prompts"],
                                                                                         part(5, 1).batch["prompts"])
    DataProto.concat([a, b])  # the widths now agree


def test_dynamic_sampling_keeps_groups_whose_accuracy_varies():
    """DAPO's filter (Yu et al. 2025, eq. 11) keeps a group when 0 < #correct < G: the rule's correctness,
    not the shaped reward. Rows scored as the trainer scores them (RewardManager.score_rows, overlong
    penalty on): "acc" is the paper, "score" the shaped scalar."""
    from megappo.protocol import DataProto
    from megappo.rewards.manager import RewardManager

    class Tok:  # token 7 answers "#### 7" (right), any other "#### 3" (wrong, well formed: 0.1)
        eos_token_id, pad_token_id = 0, 0

        def decode(self, ids, skip_special_tokens=True):
            return f"#### {7 if ids[0] == 7 else 3}"

    R = 10
    # (uid, answer token, length): a all wrong, lengths differ (overlong penalty) - b mixed -
    # c all right, same length - d all right, lengths differ
    rows = [("a", 3, 3), ("a", 3, 8), ("b", 7, 3), ("b", 3, 3), ("c", 7, 3), ("c", 7, 3), ("d", 7, 3), ("d", 7, 10)]
    mask = torch.tensor([[1] * n + [0] * (R - n) for _, _, n in rows])
    data = DataProto({"responses": torch.tensor([[t] * R for _, t, _ in rows]), "response_mask": mask,
                      "stopped": torch.ones(len(rows), dtype=torch.bool)},
                     {"data_source": np.array(["arithmetic"] * len(rows), dtype=object),
                      "reward_model": np.array([{"ground_truth": "7"}] * len(rows), dtype=object),
                      "uid": np.array([u for u, _, _ in rows], dtype=object)})
    scored = RewardManager(Tok(), 0, overlong_buffer_len=4, max_response_length=R).score_rows(data)
    acc, score = [r.correct for r in scored], [r.final for r in scored]
    assert acc == [False, False, True, False, True, True, True, True]
    assert score == pytest.approx([0.1, 0.1 - 2 / 4, 1.0, 0.1, 1.0, 1.0, 1.0, 0.0])
    uids = data.non_tensor_batch["uid"]
    assert ca.groups_to_keep(uids, acc, score, "acc") == (["b"], ["a", "c", "d"])
    assert ca.groups_to_keep(uids, acc, score) == (["b"], ["a", "c", "d"])  # the paper's is the default
    assert ca.groups_to_keep(uids, acc, score, "score") == (["a", "b", "d"], ["c"])
    with pytest.raises(ValueError, match="choose one of: acc, score"):
        ca.groups_to_keep(uids, acc, score, "accuracy")


def test_filter_groups_draws_until_enough_varied_groups_then_tops_up():
    """ppo/dynamic_sampling.filter_groups with a stand-in generator and rule: it draws new prompts until
    `want` groups whose correctness differs are in hand, keeps exactly those (a group's rows together, prompts
    left-padded to the widest part); when rounds run out it tops up with zero-variance groups."""
    from types import SimpleNamespace

    from megappo.ppo.dynamic_sampling import filter_groups
    from megappo.protocol import DataProto

    def part(width, groups):  # groups: {uid: [correct per response]}
        uids = [u for u, cs in groups.items() for _ in cs]
        ids = torch.arange(len(uids) * width).reshape(len(uids), width) + 1
        return DataProto({"prompts": ids, "input_ids": torch.cat([ids, ids[:, :2]], 1),
                          "attention_mask": torch.ones(len(uids), width + 2, dtype=torch.long),
                          "responses": ids[:, :2]},
                         {"uid": np.array(uids, dtype=object),
                          "correct": np.array([c for cs in groups.values() for c in cs], dtype=object)})

    def score_rows(p):
        return [SimpleNamespace(correct=c, final=float(c)) for c in p.non_tensor_batch["correct"]]

    first = part(3, {"a": [1, 1], "b": [1, 0]})
    drawn = []

    def draw_more(rnd):
        drawn.append(rnd)
        return part(5, {"c": [0, 0], "d": [0, 1], "e": [1, 0]})

    fg = SimpleNamespace(max_rounds=3, metric="acc")
    kept, counts = filter_groups(first, 2, fg, draw_more, score_rows, pad_id=0)
    assert drawn == [1] and list(kept.non_tensor_batch["uid"]) == ["b", "b", "d", "d"]
    assert kept.batch["prompts"].shape == (4, 5) and kept.batch["prompts"][0, :2].tolist() == [0, 0]
    assert counts == {"dynamic_sampling/rounds": 2.0, "dynamic_sampling/groups_drawn": 5.0,
                      "dynamic_sampling/groups_varied": 3.0, "dynamic_sampling/groups_topped_up": 0.0}

    kept, counts = filter_groups(first, 2, SimpleNamespace(max_rounds=1, metric="acc"), draw_more, score_rows, 0)
    assert drawn == [1] and list(kept.non_tensor_batch["uid"]) == ["b", "b", "a", "a"]  # varied first, then topped up
    assert counts["dynamic_sampling/groups_topped_up"] == 1.0 and counts["dynamic_sampling/rounds"] == 1.0
