"""On-policy distillation (ppo/core_algos.add_distillation_term, a teacher.model group, a teacher.endpoint
server): the per-token term is a Monte-Carlo estimate of the reverse KL whose policy gradient descends it, a
teacher equal to the student gives exactly nothing, tokens nobody sampled get nothing, and a server that fails is
retried and counted, or fails the step in one line."""

from __future__ import annotations

import json

import pytest
import torch

from distill_helpers import check_teacher_rows, fake_log_prob
from megappo.ppo import core_algos as algos


def test_a_teacher_equal_to_the_student_adds_exactly_nothing():
    """add_distillation_term with the student's own log-probs: the advantage is unchanged bit for bit (no
    whitening epsilon, no baseline), beside GRPO's and as OPD's (zeros)."""
    g = torch.Generator().manual_seed(0)
    lp = -torch.rand(6, 9, generator=g) * 5
    mask = (torch.rand(6, 9, generator=g) > 0.2).float()
    adv = torch.randn(6, 9, generator=g) * mask
    assert torch.equal(algos.add_distillation_term(adv, lp, lp.clone(), mask, 1.0), adv)
    opd, _ = algos.compute_advantages(torch.zeros(6, 9), mask, type("A", (), {"adv_estimator": "opd"}))
    assert torch.equal(algos.add_distillation_term(opd, lp, lp.clone(), mask, 0.5), torch.zeros(6, 9))


def test_the_per_token_term_estimates_the_reverse_kl_and_its_gradient():
    """On an 8-token vocabulary at 5 positions: the mean of log pi_s(y) - log pi_t(y) over 200k samples
    y ~ pi_s is within 2% of the exact KL(pi_s || pi_t) at every position, and the PPO loss's gradient with the
    term as advantage (ratio 1), averaged over the samples, is within 2% of the exact gradient of that KL."""
    g = torch.Generator().manual_seed(3)
    v, t, n = 8, 5, 200_000
    s_logits = (torch.randn(t, v, generator=g) * 1.5).requires_grad_(True)
    t_logits = torch.randn(t, v, generator=g) * 1.5
    ls, lt = s_logits.log_softmax(-1), t_logits.log_softmax(-1)
    exact = (ls.exp() * (ls - lt)).sum(-1)  # KL(pi_s || pi_t) per position
    y = torch.multinomial(ls.detach().exp(), n, replacement=True, generator=g).T  # [n, t]
    s_lp = ls.gather(-1, y.T).T  # [n, t]
    t_lp = lt.gather(-1, y.T).T
    mask = torch.ones(n, t)
    adv = algos.add_distillation_term(torch.zeros(n, t), s_lp.detach(), t_lp, mask, 1.0)
    assert torch.allclose(-adv.mean(0), exact.detach(), rtol=0.02)
    # the policy-gradient surrogate: -A * ratio, ratio = exp(lp - lp.detach()) = 1 in value
    surrogate = (-adv * torch.exp(s_lp - s_lp.detach())).mean(0).sum()
    (pg,) = torch.autograd.grad(surrogate, s_logits, retain_graph=True)
    (kl_grad,) = torch.autograd.grad(exact.sum(), s_logits)
    assert (pg - kl_grad).norm() / kl_grad.norm() < 0.02


def test_tokens_nobody_trained_carry_no_term_and_no_metric():
    """response_mask 0 (a tool result, text an agent inserted, padding): the advantage there stays 0 whatever
    the two models say, and distill/reverse_kl counts the trained tokens only."""
    from megappo.ppo.metrics import distill_metrics

    s = torch.full((2, 6), -1.0)
    teacher = torch.full((2, 6), -1.5)
    mask = torch.tensor([[1, 1, 0, 0, 1, 0], [1, 0, 0, 1, 1, 1]], dtype=torch.float)
    teacher_planted = teacher.clone()
    teacher_planted[mask == 0] = -1e4  # a huge gap where nothing is trained
    adv = algos.add_distillation_term(torch.zeros(2, 6), s, teacher_planted, mask, 1.0)
    assert torch.equal(adv[mask == 0], torch.zeros(int((mask == 0).sum())))
    assert torch.allclose(adv[mask == 1], torch.full((int(mask.sum()),), -0.5))
    m = distill_metrics(s, teacher_planted, mask)
    assert m == distill_metrics(s, teacher, mask) and m["distill/reverse_kl"] == pytest.approx(0.5)
    assert m["distill/reverse_kl_seq"] == pytest.approx((3 * 0.5 + 4 * 0.5) / 2)


# ---- a teacher server -----------------------------------------------------------------------------------

def test_the_servers_log_probs_land_on_each_rows_response_tokens(fake_teacher):
    """rows_of sends each row's real tokens (left-padded prompts of different widths, every response token
    including those nobody sampled), teacher.rows_per_request consecutive rows per request as a batch prompt (its
    answers read by their index, which the server may order otherwise); place puts the log-prob of the row's k-th
    token at its response column."""
    from megappo.ppo.teacher_endpoint import TeacherEndpoint, place, rows_of

    server = fake_teacher()
    prompts = torch.tensor([[0, 0, 5, 6], [0, 8, 9, 10], [11, 12, 13, 14]])
    pmask = (prompts != 0).long()
    responses = torch.tensor([[20, 21, 22, 0, 0], [23, 24, 0, 0, 0], [25, 26, 27, 28, 29]])
    rmask = (responses != 0).long()
    ids, attn = torch.cat([prompts, responses], 1), torch.cat([pmask, rmask], 1)
    client = TeacherEndpoint(server.url, concurrency=2, rows_per_request=2)
    try:
        lps, stats = client.score(rows_of(ids, attn))
    finally:
        client.close()
    rows = [r[m.bool()].tolist() for r, m in zip(ids, attn)]
    assert sorted(b["prompt"] for b in server.bodies) == [rows[:2], rows[2:]]  # rows 0-1, then row 2
    assert all(b["echo"] is True and b["logprobs"] == 0 and b["model"] == "teacher" for b in server.bodies)
    placed = place(lps, attn, prompts.shape[1])
    for i in range(3):
        p = int(pmask[i].sum())
        for j in range(responses.shape[1]):
            want = fake_log_prob(p + j, int(responses[i, j])) if rmask[i, j] else 0.0
            assert placed[i, j].item() == pytest.approx(want, abs=1e-6), (i, j)
    assert stats.requests == 2 and stats.retries == 0 and server.most_in_flight <= 2


def test_a_failing_server_is_retried_and_counted_or_fails_in_one_line(fake_teacher):
    """503s, a dropped connection and an answer past the timeout are retried (counted, the result as if none
    failed); a 400 is the server's own line at once; a server that fails every try is one line naming it
    after 1 + retries attempts."""
    from megappo.ppo.teacher_endpoint import TeacherEndpoint, TeacherEndpointError

    rows = [[1, 2, 3, 4], [5, 6, 7], [8, 9]]
    # the slow answer comes far past the timeout, every other one far within it (20 ms against 5 s)
    server = fake_teacher("503", "drop", "slow", "503", slow_s=60.0)
    client = TeacherEndpoint(server.url, concurrency=3, retries=4, backoff_s=0.01, timeout_s=5.0, rows_per_request=1)
    try:
        lps, stats = client.score(rows)
    finally:
        client.close()
    assert lps == [[fake_log_prob(k, t) for k, t in enumerate(r)][1:] for r in rows]
    assert stats.retries == 4 and stats.requests == 7 and server.most_in_flight <= 3

    # a server that takes no batch prompt (one choice for two prompts): one line naming the setting, never a row
    # trained on another's log-probs
    single = fake_teacher("one")
    client = TeacherEndpoint(single.url, model="teacher", retries=0, rows_per_request=2)
    with pytest.raises(TeacherEndpointError, match=r"a batch of 2 prompts \(rows 0-1\) came back with 1 choices; .*"
                                                   r"set teacher\.rows_per_request=1"):
        client.score([[1, 2, 3], [4, 5]])
    client.close()

    refused = fake_teacher("400")
    client = TeacherEndpoint(refused.url, model="teacher", retries=3, backoff_s=0.01)
    with pytest.raises(TeacherEndpointError, match="refused row 0: HTTP 400: prompt is longer than max_model_len 64"):
        client.score([[1, 2, 3]])
    client.close()
    assert refused.requests == 1

    dead = fake_teacher(*["503"] * 10)
    client = TeacherEndpoint(dead.url, model="teacher", retries=2, backoff_s=0.01)
    with pytest.raises(TeacherEndpointError) as e:
        client.score([[1, 2, 3]])
    client.close()
    assert dead.requests == 3 and "\n" not in str(e.value)
    assert f"teacher.endpoint {dead.url} failed row 0 3 times (last: HTTP 503: overloaded)" in str(e.value)
    odd = fake_teacher()
    for body in ({"object": "list", "data": {"id": "teacher"}}, ["teacher"], {"data": [None, "teacher"]}):
        odd.models_body = body  # a /models reply that is not OpenAI's list: one line, never an AttributeError
        client = TeacherEndpoint(odd.url, retries=0)
        with pytest.raises(TeacherEndpointError, match="lists no model at /models; set teacher.endpoint_model"):
            client.check()
        client.close()
    gone = TeacherEndpoint("http://127.0.0.1:9/v1", retries=1, backoff_s=0.01)
    with pytest.raises(TeacherEndpointError, match="failed the model list 2 times .*ConnectError"):
        gone.check()
    gone.close()


def test_teacher_config_errors(tiny_assets, tmp_path):
    """Each wrong teacher setting is one line naming the key, before any worker starts."""
    from trainer_utils import config

    from megappo.config.errors import ConfigError
    from megappo.config.validate import validate_config

    def err(*extra, paths=False):
        with pytest.raises(ConfigError) as e:  # load_config validates; --paths reads the dirs too
            validate_config(config(tiny_assets, tmp_path, tmp_path / "run", *extra), check_paths=paths)
        return str(e.value)

    opd = ("algorithm.adv_estimator=opd", "critic.enable=false", "algorithm.use_kl_in_reward=false")
    tiny = str(tiny_assets["tiny-llama"])
    assert "opd needs a teacher: set teacher.model" in err(*opd)
    assert "both set" in err(*opd, f"teacher.model={tiny}", "teacher.endpoint=http://h:1/v1")
    assert "algorithm.distill_coef=0.0 with a teacher set" in err(f"teacher.model={tiny}", "algorithm.distill_coef=0")
    assert "set critic.enable=false" in err("algorithm.adv_estimator=opd", "algorithm.use_kl_in_reward=false",
                                            "teacher.endpoint=http://h:1/v1")
    assert "algorithm.use_kl_in_reward=false" in err("algorithm.adv_estimator=opd", "critic.enable=false",
                                                     "teacher.endpoint=http://h:1/v1")
    assert "is not a URL" in err(*opd, "teacher.endpoint=h:1")
    assert "teacher.endpoint scores at temperature 1 but rollout.temperature=0.6" in err(
        *opd, "teacher.endpoint=http://h:1/v1", "rollout.temperature=0.6")
    assert "teacher.parallel tp*pp*dp = 1*1*1 = 1 but the pool has 2" in err(*opd, f"teacher.model={tiny}",
                                                                              "teacher.parallel.dp=1")
    mla_teacher = err(*opd, f"teacher.model={tiny_assets['tiny-deepseek_v3']}", "model.transformer_engine=true",
                      "resources.device=cuda")  # refused here, not inside the teacher's workers
    assert mla_teacher.startswith(f"teacher.model {tiny_assets['tiny-deepseek_v3']}: model.transformer_engine=true is "
                                  "not supported for multi-latent attention"), mla_teacher
    assert "set teacher.model, or 0" in err(*opd, "teacher.endpoint=http://h:1/v1", "resources.teacher_workers=1")
    other = tmp_path / "other_tokenizer"  # the student's model with another tokenizer
    other.mkdir()
    for f in tiny_assets["tiny-llama"].iterdir():
        (other / f.name).symlink_to(f)
    (other / "tokenizer.json").unlink()  # "+" and "," trade ids: the same text, other ids
    tok = json.loads((tiny_assets["tiny-llama"] / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    vocab["+"], vocab[","] = vocab[","], vocab["+"]
    (other / "tokenizer.json").write_text(json.dumps(tok))
    assert "does not share the student's tokenizer" in err(*opd, f"teacher.model={other}", "teacher.parallel.dp=2",
                                                           paths=True)


# ---- trained ----------------------------------------------------------------------------------------------

def test_opd_from_a_teacher_of_another_family_on_a_pool_of_its_own(ray_session, tiny_assets, data_dir, tmp_path):
    """algorithm.adv_estimator=opd, the student the tiny llama, the teacher the tiny qwen3 (another family, other
    weights, the same tokenizer) on a worker pool of its own (resources.teacher_workers=2, its layout context parallel
    over that pool: each row's tokens split over 2 ranks), 2 sync steps (fp32): the teacher's log-probs of every
    response token are transformers' on
    the teacher's weights (1e-5), not the student's; every advantage is exactly the reverse-KL term
    -(log pi_old - log pi_teacher) on the trained tokens, and distill/teacher_share is the teacher's time over the
    step's."""
    from megappo.assets import hf_response_logprobs
    from trainer_utils import config, recording_updates, run

    teacher = tiny_assets["tiny-qwen3"]
    cfg = config(tiny_assets, data_dir, tmp_path / "run", "algorithm.adv_estimator=opd", "critic.enable=false",
                 "ref.enable=false", "algorithm.use_kl_in_reward=false", "actor.entropy_coeff=0",
                 f"teacher.model={teacher}", "resources.teacher_workers=2", "teacher.parallel.cp=2",
                 "teacher.parallel.dp=1",
                 "trainer.total_steps=2", "trainer.save_every=0", "trainer.val_every=0", "trainer.export_hf=false")
    assert cfg.teacher.parallel.dp == 1 and cfg.teacher.parallel.cp == 2
    batches = []
    history, trainer = run(cfg, setup=recording_updates(batches))
    assert len(history) == 2
    for h, batch in zip(history, batches):
        b = batch.batch
        width = b["prompts"].shape[1]
        rows, lengths = [], []
        for i in range(len(batch)):
            p, n = int(b["attention_mask"][i, :width].sum()), int(b["attention_mask"][i, width:].sum())
            rows.append({"input_ids": b["input_ids"][i][b["attention_mask"][i].bool()].tolist(), "response_start": p})
            lengths.append(n)
        for i, ref in enumerate(hf_response_logprobs(teacher, rows)):
            torch.testing.assert_close(b["teacher_log_prob"][i, :lengths[i]], ref, rtol=0, atol=1e-5)
        mask = b["response_mask"].bool()
        assert (b["teacher_log_prob"] - b["old_log_probs"]).abs()[mask].mean() > 0.1  # not the student's
        term = 0.0 - 1.0 * (b["old_log_probs"] - b["teacher_log_prob"]) * b["response_mask"]  # distill_coef 1
        assert torch.equal(b["advantages"], term.to(b["advantages"].dtype))
        assert h["distill/teacher_share"] == pytest.approx(h["timing/teacher_s"] / h["timing/step_s"], rel=1e-9)


def test_a_megappo_serve_teacher_in_a_trainer_run(ray_session, tiny_assets, data_dir, tmp_path, monkeypatch,
                                                  served_tiny_llama):
    """teacher.endpoint at a real server: `megappo serve` of the student's own weights in its own process (the
    session's, conftest `served_tiny_llama`: vLLM's prompt log-probs over /v1/completions with echo, the key from
    teacher.api_key_env) beside PPO's GAE for 1 sync step (fp32, on the trainer tests' warm workers):
    every response token's teacher log-prob is the student's pi_old (the same weights in two engines, 1e-4), so the
    per-token term is at most that gap, and the server scored the step's rows in batch prompts of
    teacher.rows_per_request (8) rows."""
    from trainer_utils import config, recording_updates, run

    url, key = served_tiny_llama
    monkeypatch.setenv("MEGAPPO_TEACHER_API_KEY", key)
    cfg = config(tiny_assets, data_dir, tmp_path / "run", f"teacher.endpoint={url}/v1", "algorithm.distill_coef=0.5",
                 "trainer.total_steps=1", "trainer.save_every=0", "trainer.val_every=0", "trainer.export_hf=false")
    batches = []
    history, _ = run(cfg, setup=recording_updates(batches))
    b, h = batches[0].batch, history[0]
    mask = b["response_mask"].bool()
    requests = -(-len(batches[0]) // cfg.teacher.rows_per_request)
    assert mask.sum() > 0 and h["distill/teacher_requests"] == requests and h["distill/teacher_retries"] == 0
    torch.testing.assert_close(b["teacher_log_prob"][mask], b["old_log_probs"][mask], rtol=0, atol=1e-4)
    assert h["distill/reverse_kl"] == pytest.approx(0.0, abs=1e-4)


def test_a_teacher_server_beside_the_reward_survives_its_failures(ray_session, tiny_assets, data_dir, tmp_path,
                                                                  fake_teacher):
    """teacher.endpoint beside PPO's GAE (slime's form: A_t - coef * (log pi - log pi_teacher)), 2 sync steps, a
    server whose first requests fail (503, a dropped connection): each row's teacher log-probs are the server's
    for its tokens, retried requests are counted and the steps finish, distill/reverse_kl over the trained tokens."""
    from trainer_utils import config, recording_updates, run

    server = fake_teacher("503", "drop", "503")
    cfg = config(tiny_assets, data_dir, tmp_path / "run", f"teacher.endpoint={server.url}", "teacher.retries=3",
                 "teacher.backoff_s=0.01", "teacher.concurrency=4", "teacher.rows_per_request=2",
                 "algorithm.distill_coef=0.5", "trainer.total_steps=2", "trainer.save_every=0", "trainer.val_every=0",
                 "trainer.export_hf=false")
    batches = []
    history, _ = run(cfg, setup=recording_updates(batches))
    assert len(history) == 2 and server.most_in_flight <= 4
    assert [h["distill/teacher_retries"] for h in history] == [3, 0]
    # two rows per request, the three failed tries again
    assert [h["distill/teacher_requests"] for h in history] == [-(-len(batches[0]) // 2) + 3, -(-len(batches[1]) // 2)]
    assert all(len(b["prompt"]) <= 2 and isinstance(b["prompt"][0], list) for b in server.bodies)
    for h, batch in zip(history, batches):
        check_teacher_rows(batch)
        b = batch.batch
        mask = b["response_mask"]
        d = (b["old_log_probs"] - b["teacher_log_prob"]) * mask
        assert h["distill/reverse_kl"] == pytest.approx((d.sum() / mask.sum()).item(), rel=1e-5)
        # the server scored while pi_old ran: the driver waited at most as long as the scoring took
        assert h["timing/teacher_wait_s"] <= h["timing/teacher_s"] + 0.01
