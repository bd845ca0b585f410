"""Multi-turn, tool-using rollouts (megappo/agent/):

- (the python tool's sandbox is attacked in tests/test_sandbox.py);
- the calculator is exact and evaluates no code; malformed calls are error observations, counted;
- the tool formats: Hermes calls parsed, tool results rendered by the chat template (token in, token
  out), tools shown through the template's tools section or the declared system prompt, and a
  template with neither refused in one line;
- the agent loop in a real vLLM engine (tiny llama, one engine for the module): a forced first call
  (tool_choice=required), the calculator's exact result appended as the template's tool message,
  the model's tokens kept as sampled with their log-probs, the masks with the gap;
- a PPO run (Ray workers, Megatron, the hybrid engine) on multi-turn samples: Megatron's log-probs
  equal vLLM's on the model's tokens, the weights' fingerprints hold, the agent metrics are logged.
"""

import json
import os
import re

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import pytest  # noqa: E402
import torch  # noqa: E402


# ---- tools and formats ----------------------------------------------------------------------------

def test_calculator_is_exact_and_evaluates_no_code():
    from megappo.agent.tools import make_tools

    calc = make_tools(["calculator"])["calculator"]
    cases = {"123 * 456": "56088", "7 / 4": "1.75", "1 / 3": "1/3", "(1.1 + 2.2) * 10": "33",
             "2 ** 64": str(2 ** 64), "-(3 - 5) % 7": "2", "987654321987654321 * 123456789": str(987654321987654321 * 123456789)}
    for expr, want in cases.items():
        r = calc.call({"expression": expr})
        assert (r.text, r.error) == (want, False), expr
    for expr in ("__import__('os').system('id')", "x + 1", "2 ** 10 ** 10", "1 / 0", "3 +", "[1] * 3"):
        r = calc.call({"expression": expr})
        assert r.error and not r.invalid and r.text.startswith("error:"), expr
    for args in ({"expr": "1"}, "1 + 1", {"expression": 5}, {"expression": "1", "extra": 2}):
        r = calc.call(args)
        assert r.error and r.invalid and "calculator" in r.text, args


def test_tool_calls_are_parsed_and_malformed_ones_explained():
    from megappo.agent.format import parse_call

    call = parse_call('I will compute. <tool_call>\n{"name": "calculator", "arguments": {"expression": "2+2"}}\n</tool_call>')
    assert (call.name, call.arguments, call.error) == ("calculator", {"expression": "2+2"}, None)
    assert parse_call('<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"1\\"}"}</tool_call>').arguments \
        == {"expression": "1"}  # arguments as a JSON string (some models)
    assert parse_call("The answer is 4.") is None
    assert "not valid JSON" in parse_call("<tool_call>{name: calculator}</tool_call>").error
    assert "JSON object" in parse_call('<tool_call>["calculator"]</tool_call>').error


def test_forced_call_regex_admits_exactly_well_formed_calls():
    from megappo.agent.format import forced_call_regex
    from megappo.agent.tools import tool_schemas

    regex = forced_call_regex(tool_schemas(["calculator", "python"]))
    ok = ['<tool_call>{"name": "calculator", "arguments": {"expression": "1+2"}}</tool_call>',
          '<tool_call>{"name": "python", "arguments": {"code": "print(1)"}}</tool_call>']
    bad = ['<tool_call>{"name": "search", "arguments": {"query": "x"}}</tool_call>',
           '<tool_call>{"name": "python", "arguments": {"code": "a\\"b"}}</tool_call>',
           '<tool_call>{"name": "calculator", "arguments": {}}</tool_call>']
    assert all(re.fullmatch(regex, t) for t in ok) and not any(re.fullmatch(regex, t) for t in bad)


@pytest.fixture(scope="module")
def tokenizer(tiny_assets):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_assets["tiny-llama"]))


QWEN_STYLE_TEMPLATE = (  # a template with a tools section (the shape of Qwen2.5's)
    "{% if tools %}<|im_start|>system\n# Tools\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_tools_reach_the_prompt_through_the_template_or_the_declared_prompt(tokenizer):
    import copy

    from megappo.agent.format import template_has_tools
    from megappo.agent.tools import tool_schemas
    from megappo.data.dataset import prompt_to_text

    schemas = tool_schemas(["calculator"])
    assert not template_has_tools(tokenizer)
    with pytest.raises(ValueError, match="set rollout.multi_turn.tool_prompt"):
        prompt_to_text("What is 2+2?", tokenizer, tools=schemas)
    declared = prompt_to_text("What is 2+2?", tokenizer, tools=schemas, tool_prompt="Tools:\n{tools}\nCall them.")
    assert declared.startswith("<|im_start|>system\nTools:\n{\"name\": \"calculator\"") and "What is 2+2?" in declared
    with_system = prompt_to_text([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
                                 tokenizer, tools=schemas, tool_prompt="Tools: {tools}")
    assert with_system.count("<|im_start|>system") == 1 and "Be brief.\n\nTools: {" in with_system
    qwen_like = copy.deepcopy(tokenizer)
    qwen_like.chat_template = QWEN_STYLE_TEMPLATE
    text = prompt_to_text("What is 2+2?", qwen_like, tools=schemas)
    assert text.startswith("<|im_start|>system\n# Tools\n") and '"name": "calculator"' in text


def test_a_tool_result_is_the_templates_tool_message(tokenizer):
    from megappo.agent.format import Observations

    obs = Observations(tokenizer)
    after_call = tokenizer.decode(obs.ids("56088", model_ended_turn=False))
    assert after_call == "<|im_end|>\n<|im_start|>tool\n56088<|im_end|>\n<|im_start|>assistant\n"
    after_eos = tokenizer.decode(obs.ids("56088", model_ended_turn=True))
    assert after_eos == "\n<|im_start|>tool\n56088<|im_end|>\n<|im_start|>assistant\n"


# ---- environments: tools and a trajectory reward per data_source ------------------------------------

def test_environments_by_data_source(tokenizer, tmp_path):
    """Rule environments for every reward rule (the config's tools, the rule on the final answer), a
    registered one winning over them, each row shown and carrying its environment's tools; a row whose
    data_source has no environment is refused in one line naming the file, the row and the fix."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from megappo.agent.environment import Environments, Episode
    from megappo.config.schema import MultiTurnConfig
    from megappo.data.dataset import RLHFDataset
    from megappo.rewards.manager import DEFAULT_SCORERS

    mt = MultiTurnConfig(enable=True, tools=["calculator"], tool_prompt="Tools: {tools}",
                         environments={"py_task": "agent_envs:PythonOnly", "counted": "agent_envs:CountToolCalls"})
    envs = Environments(mt, DEFAULT_SCORERS)
    assert envs.tools_for("arithmetic") == ("calculator",) and envs.tools_for("py_task") == ("python",)
    turns = ({"role": "assistant", "text": '<tool_call>{"name": "calculator"}</tool_call>'},
             {"role": "tool", "name": "calculator", "arguments": {}, "text": "error: ...", "error": True},
             {"role": "assistant", "text": "#### 7"})
    assert Episode(turns, "7", "arithmetic", True).answer == "#### 7"
    assert envs.score("arithmetic", turns, "7", True) == 1.0  # the rule, on the final answer
    assert envs.score("arithmetic", turns[:2], "7", True) == 0.0
    assert envs.score("counted", turns, "7", True) == 1.0
    with pytest.raises(ValueError, match="^no environment for data_source 'nowhere' .*register one with "
                                         "rollout.multi_turn.environments.nowhere="):
        envs.get("nowhere")
    for target, match in (("agent_envs", "is not 'module:attribute'"), ("agent_envs:Missing", "cannot load it"),
                          ("no_such_module:X", "cannot load it"), ("agent_envs:NOT_AN_ENVIRONMENT", "no score")):
        with pytest.raises(ValueError, match=match):
            Environments(MultiTurnConfig(enable=True, environments={"s": target}), DEFAULT_SCORERS)

    rows = [("arithmetic", "1 + 2?"), ("py_task", "print 3"), ("nowhere", "?")]
    file = tmp_path / "mixed.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": [{"role": "user", "content": q}], "data_source": source,
                                          "reward_model": {"ground_truth": "3"}} for source, q in rows]), file)
    with pytest.raises(ValueError, match=r"mixed.parquet' row 2: no environment for data_source 'nowhere'"):
        RLHFDataset([file], tokenizer, max_prompt_length=512, **envs.prompt_args())
    pq.write_table(pq.read_table(file).slice(0, 2), file)
    ds = RLHFDataset([file], tokenizer, max_prompt_length=512, **envs.prompt_args())
    shown = [tokenizer.decode(r["input_ids"]) for r in ds.rows]
    assert '"name": "calculator"' in shown[0] and '"name": "python"' not in shown[0]
    assert '"name": "python"' in shown[1] and '"name": "calculator"' not in shown[1]
    assert list(ds.get_batch([0, 1]).non_tensor_batch["tools"]) == [("calculator",), ("python",)]


# ---- the loop in a real vLLM engine --------------------------------------------------------------

@pytest.fixture(scope="module")
def agent_rollout(tiny_assets):
    from megappo.agent.factory import agent_loop_builder
    from megappo.config.schema import MultiTurnConfig, RolloutConfig
    from megappo.workers.rollout.vllm_rollout import VLLMRollout

    mt = MultiTurnConfig(enable=True, max_turns=3, max_tool_calls=2, tools=["calculator"], tool_choice="required")
    cfg = RolloutConfig(n=2, temperature=1.0, max_new_tokens=160, kv_cache_memory_mb=32, multi_turn=mt)
    return VLLMRollout(tiny_assets["tiny-llama"], cfg, seed=0, dtype="float32", max_model_len=256,
                       agent=agent_loop_builder(mt))


def test_agent_loop_layout_in_vllm(agent_rollout, tokenizer):
    from megappo.agent.format import Observations, parse_call
    from megappo.agent.tools import make_tools
    from megappo.protocol import DataProto
    from megappo.workers.rollout.sampling import SamplingSpec
    from megappo.workers.rollout.vllm_rollout import left_pad

    texts = ["What is 12 + 30?", "Compute 7 * 6."]
    ids = [tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                             tokenize=False), add_special_tokens=False)["input_ids"] for t in texts]
    spec = SamplingSpec(n=2, temperature=1.0, max_new_tokens=160, seed=11)
    prompts = DataProto.from_dict(left_pad(ids, tokenizer.pad_token_id), {"uid": ["a", "b"]}, {"sampling": spec})
    out = agent_rollout.generate_sequences(prompts)
    b = out.batch
    P = b["prompts"].shape[1]
    calc, obs = make_tools(["calculator"])["calculator"], Observations(tokenizer)
    for i in range(len(out)):
        toks = b["responses"][i]
        model, attended = b["response_mask"][i].bool(), b["attention_mask"][i, P:].bool()
        n = int(attended.sum())
        assert attended[:n].all() and not attended[n:].any()  # real tokens first, then padding
        assert (model <= attended).all() and b["num_turns"][i] >= 2 and b["num_tool_calls"][i] == 1
        # turn 1: the forced call (not trained on), then the calculator's exact result as the tool message
        first_model = int(model.nonzero()[0]) if model.any() else n
        call_and_result = toks[:first_model].tolist()
        text = tokenizer.decode(call_and_result)
        call = parse_call(text)
        assert call is not None and call.error is None and call.name == "calculator"
        want = obs.ids(calc.call(call.arguments).text, model_ended_turn=False)
        sampled = call_and_result[:-len(want)]  # the forced call's tokens as vLLM sampled them (not re-tokenised)
        assert call_and_result[-len(want):] == want and tokenizer.decode(sampled).endswith("</tool_call>")
        # the model's own turn: log-probs where it sampled, zero on everything else
        lp = b["rollout_log_probs"][i]
        assert (lp[model] < 0).all() and (lp[~model] == 0).all()
    # each sample's one call is the forced, well-formed one: no call of them was invalid
    assert int(b["tool_tokens"].sum()) > 0 and b["num_invalid_calls"].tolist() == [0.0] * len(out)
    again = agent_rollout.generate_sequences(prompts)  # seeded per request and turn: reproducible
    assert torch.equal(again.batch["responses"], b["responses"])


def test_a_replicas_ranks_take_the_tool_results_of_its_first_rank(agent_rollout, tokenizer):
    """rollout.tp > 1 in the hybrid engine: each TP rank of a vLLM replica runs the loop and must send vLLM the same
    requests, so a tool result computed on one rank (a timeout there only) must not differ on another. The loop
    hands each turn's tool calls to `share_results` (vllm_rollout.replica_share: run on the first rank, broadcast
    over the replica), here a stand-in for a rank that is not the first: its samples carry the first rank's
    results, not its own, and nothing it computed itself."""
    from megappo.agent.tools import ToolResult
    from megappo.protocol import DataProto
    from megappo.workers.rollout.sampling import SamplingSpec
    from megappo.workers.rollout.vllm_rollout import left_pad

    ids = [tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": "What is 12 + 30?"}],
                                                   add_generation_prompt=True, tokenize=False),
                     add_special_tokens=False)["input_ids"]]
    shared = []

    def first_ranks(compute):  # as replica_share on a later rank: the first rank computes, this one does not
        shared.append(compute)
        return [ToolResult("41 (from the replica's first rank)") for _ in range(len(compute()))]

    agent_rollout.agent.share_results = first_ranks
    try:
        out = agent_rollout.generate_sequences(DataProto.from_dict(
            left_pad(ids, tokenizer.pad_token_id), {"uid": ["a"]},
            {"sampling": SamplingSpec(n=2, temperature=1.0, max_new_tokens=160, seed=3)}))
    finally:
        agent_rollout.agent.share_results = None
    assert shared  # every turn's calls went through it
    for turns in out.non_tensor_batch["agent_turns"]:
        results = [t["text"] for t in turns if t["role"] == "tool"]
        assert results and all(r == "41 (from the replica's first rank)" for r in results), results


def test_your_own_agent_at_rollout_tp2_needs_the_lockstep_of_fully_async(tiny_assets, data_dir, tmp_path):
    from megappo.config.loader import ConfigError
    from trainer_utils import config

    agent = os.path.join(os.path.dirname(__file__), "..", "examples", "agents", "calculator.py")
    for mode in ("sync", "async"):
        with pytest.raises(ConfigError, match=rf"^rollout.agent with rollout.tp=2 in trainer.mode={mode} would run "
                                              r"your agents on every TP rank .* set trainer.mode=fully_async"):
            config(tiny_assets, data_dir, tmp_path, f"rollout.agent={agent}:run", "rollout.tp=2",
                   f"trainer.mode={mode}", "resources.rollout_workers=2" if mode == "async" else "rollout.n=2")


def test_each_row_calls_only_its_environments_tools(agent_rollout, tokenizer):
    """Rows carrying different tools (their environments'): the forced first call is a call of the row's
    own tool, recorded in agent_turns with its result; a row with no tools is not forced (its first turn
    is trained on); a call of a tool the row was not given is invalid."""
    from megappo.agent.format import Call
    from megappo.protocol import DataProto
    from megappo.workers.rollout.sampling import SamplingSpec
    from megappo.workers.rollout.vllm_rollout import left_pad

    ids = [tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                             tokenize=False), add_special_tokens=False)["input_ids"]
           for t in ("What is 12 + 30?", "Print 42.", "Say hi.")]
    spec = SamplingSpec(n=2, temperature=1.0, max_new_tokens=160, seed=5)
    prompts = DataProto.from_dict(left_pad(ids, tokenizer.pad_token_id),
                                  {"uid": ["a", "b", "c"], "tools": [("calculator",), ("python",), ()]},
                                  {"sampling": spec})
    out = agent_rollout.generate_sequences(prompts)
    b, turns = out.batch, out.non_tensor_batch["agent_turns"]
    for i, allowed in enumerate(["calculator", "calculator", "python", "python"]):
        assert [t["role"] for t in turns[i]][:2] == ["assistant", "tool"] and turns[i][1]["name"] == allowed
        assert len([t for t in turns[i] if t["role"] == "assistant"]) == int(b["num_turns"][i])
        # the recorded texts are the tokens' own: the assistant turns after the forced one are the trained tokens
        trained = tokenizer.decode(b["responses"][i][b["response_mask"][i].bool()].tolist(), skip_special_tokens=True)
        assert trained == "".join(t["text"] for t in turns[i][2:] if t["role"] == "assistant")
    for i in (4, 5):  # no tools: nothing forced, the first turn is the model's own (trained on)
        assert b["response_mask"][i, 0] == 1 and turns[i][0]["role"] == "assistant"
        assert all(t["error"] for t in turns[i] if t["role"] == "tool")  # any call it makes names no tool it has
    wrong = agent_rollout.agent._execute(Call("calculator", {"expression": "1+1"}), ("python",))
    assert wrong.invalid and "unknown tool 'calculator'; available: python" in wrong.text


def test_rollout_agent_config_errors(tiny_assets, data_dir, tmp_path):
    """rollout.agent's bad settings: one line naming the fix, from load_config (before any worker starts)."""
    from megappo.config import ConfigError, load_config
    from trainer_utils import overrides

    (tmp_path / "agent.py").write_text("async def run(client, row):\n    return 1.0\n")
    agent = f"rollout.agent={tmp_path / 'agent.py'}:run"
    base = [f"model.path={tiny_assets['tiny-llama']}"]
    for extra, match in (([agent, "rollout.multi_turn.enable=true"], "both make the samples"),
                         ([agent, "rollout.agent_concurrency=0"], "must be >= 1"),
                         ([agent, "data.apply_chat_template=false"], "set data.apply_chat_template=true"),
                         ([agent, "rollout.agent_tool_parser=hermez"], "^rollout.agent_tool_parser: tool parser "
                                                                      "'hermez' is not one of vLLM's: choose one of"),
                         (["rollout.agent_tool_parser=llama3_json"], "set rollout.agent or remove it"),
                         ([f"rollout.agent={tmp_path / 'agent.py'}:walk"], "walk")):
        with pytest.raises(ConfigError, match=match):
            load_config("configs/ppo_tiny.yaml", base + extra)
    assert load_config("configs/ppo_tiny.yaml", base + [agent, "rollout.agent_tool_parser=llama3_json"])
    # with the paths checked (megappo train): the parser's marker tokens in the model's vocabulary
    with pytest.raises(ConfigError, match="^rollout.agent_tool_parser: vLLM's 'llama3_json' tool parser does not fit"):
        load_config("configs/ppo_tiny.yaml", overrides(tiny_assets, data_dir, tmp_path / "run", agent,
                                                        "rollout.agent_tool_parser=llama3_json"), check_paths=True)
    assert load_config("configs/ppo_tiny.yaml", overrides(tiny_assets, data_dir, tmp_path / "run", agent,
                                                          "rollout.agent_tool_parser=hermes"), check_paths=True)


def test_multi_turn_config_errors(tiny_assets, data_dir, tmp_path):
    from megappo.config import ConfigError, load_config
    from megappo.ppo.ray_trainer import RayPPOTrainer
    from trainer_utils import config

    base = [f"model.path={tiny_assets['tiny-llama']}", "rollout.multi_turn.enable=true"]
    for extra, match in ((["rollout.multi_turn.tools=[search]"], "unknown tool.*known: calculator, python"),
                         (["rollout.multi_turn.tool_choice=always"], "choose auto or required"),
                         (["rollout.multi_turn.tool_prompt='Use tools.'"], "must contain \\{tools\\}"),
                         (["rollout.multi_turn.tools=[]"], "no tools"),
                         (["data.apply_chat_template=false"], "apply_chat_template=true"),
                         (["rollout.multi_turn.environments.arithmetic=agent_envs"], "is not 'module:attribute'")):
        with pytest.raises(ConfigError, match=match):
            load_config("configs/ppo_tiny.yaml", base + extra)
    # the tiny tokenizer's template has no tools section and no tool_prompt is set: refused while the prompts
    # are built, before any worker starts (megappo train prints it as one line)
    with pytest.raises(ValueError, match="^the model's chat template has no tools section: set rollout.multi_turn.tool_prompt"):
        RayPPOTrainer(config(tiny_assets, data_dir, tmp_path, "rollout.multi_turn.enable=true"), show_progress=False)
    # a row whose data_source has no environment (no reward rule, none registered): one line, no worker started
    import pyarrow.parquet as pq

    table = pq.read_table(data_dir / "arith_train.parquet")
    pq.write_table(table.set_column(table.column_names.index("data_source"), "data_source",
                                    [["my_search"] * len(table)]), tmp_path / "search.parquet")
    with pytest.raises(ValueError, match="search.parquet' row 0: no environment for data_source 'my_search' .*"
                                         "rollout.multi_turn.environments.my_search=my_pkg.envs:MyEnv"):
        RayPPOTrainer(config(tiny_assets, data_dir, tmp_path, "rollout.multi_turn.enable=true",
                             "rollout.multi_turn.tool_prompt='Tools: {tools}'",
                             f"data.train_files=[{tmp_path / 'search.parquet'}]"), show_progress=False)


# ---- a PPO run on multi-turn samples --------------------------------------------------------------

def test_ppo_run_on_multi_turn_samples(ray_session, tiny_assets, data_dir, tmp_path):
    """Sync PPO with a critic, 2 steps: the model's tokens are scored by Megatron exactly as vLLM sampled
    them (the gap is fp32 rounding) although tool tokens sit between turns; the metrics are logged. The
    rows' environment is a registered one (tests/agent_envs.py) whose reward counts the tool calls."""
    from trainer_utils import config, run

    cfg = config(tiny_assets, data_dir, tmp_path, "rollout.max_new_tokens=200", "data.max_prompt_length=300",
                 "rollout.multi_turn.enable=true", "rollout.multi_turn.tool_choice=required",
                 "rollout.multi_turn.tool_prompt='You can use tools: {tools}'", "trainer.total_steps=2",
                 "rollout.multi_turn.environments.arithmetic=agent_envs:CountToolCalls", "reward.non_stop_penalty=false",
                 "trainer.save_every=0", "trainer.val_every=2", "trainer.export_hf=false")
    history = run(cfg)
    for h in history:
        assert h["objective/scores"] == h["rollout/tool_calls_mean"]  # the environment's reward, not the rule's
        assert h["rollout/turns_mean"] >= 2 and h["rollout/tool_calls_mean"] == 1.0 and h["rollout/tool_call_rate"] == 1.0
        assert h["rollout/tokens_tool"] > 0 and h["rollout/tokens_model"] > 0
        assert h["rollout/weights_fingerprint_ok"] == 1.0
        for key in ("rollout/tool_call_valid_rate", "rollout/tool_errors", "timing/tool_s", "critic/grad_norm"):
            assert key in h
    assert history[0]["rollout/logprob_diff_max"] < 1e-4  # same weights: vLLM's == Megatron's on model tokens
    assert history[1]["eval/tool_call_rate"] == 1.0 and history[1]["eval/turns_mean"] >= 2  # validation: same loop
    assert (tmp_path / "reward_curve.png").stat().st_size > 0
    _check_eval_with_and_without_tools(tiny_assets["tiny-llama"], tmp_path)


def _check_eval_with_and_without_tools(model, out):
    """`megappo eval --config <run>/config.json`: the run's tools offered (the model decides: tool_choice
    auto) and reported; --no-tools: the same run's settings without the loop (single-turn prompts: the plain
    eval's path, which test_trainer runs end to end), read here without a second vLLM engine."""
    import argparse
    import json
    import subprocess
    import sys

    from megappo.evaluate import _settings, add_arguments

    proc = subprocess.run([sys.executable, "-m", "megappo.cli", "eval", "--model", str(model), "--config",
                           str(out / "config.json"), "--out", str(out / "tools.json")],
                          capture_output=True, text=True,  # the run's environment module (tests/agent_envs.py)
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__),
                                                                           os.environ.get("PYTHONPATH", "")])})
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((out / "tools.json").read_text())
    tools = report["tools"]
    assert {"turns_mean", "tool_call_rate"} <= tools.keys()
    # with tools, the registered environment scores (a call scores 1 = correct)
    assert report["by_source"]["arithmetic"]["accuracy"] == tools["tool_call_rate"]
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    settings = {flag: _settings(parser.parse_args(["--model", str(model), "--config", str(out / "config.json"),
                                                    *([flag] if flag else [])])) for flag in ("", "--no-tools")}
    assert settings[""]["multi_turn"].tool_choice == "auto" and settings["--no-tools"]["multi_turn"] is None
    assert report["max_prompt_length"] == settings["--no-tools"]["max_prompt_length"] == 300


def test_async_grpo_on_multi_turn_samples(ray_session, tiny_assets, data_dir, tmp_path, fake_teacher):
    """Async mode (a separate rollout pool fed over the weight-sync group) with GRPO and no critic: the
    pool's engines run the same agent loop; step 1's samples come from the weights it trains from. A teacher
    server beside the reward (on-policy distillation) scores every row, the tool results as context only."""
    from distill_helpers import check_teacher_rows
    from trainer_utils import config, recording_updates, run

    teacher = fake_teacher()
    cfg = config(tiny_assets, data_dir, tmp_path, "rollout.max_new_tokens=200", "data.max_prompt_length=300",
                 "rollout.multi_turn.enable=true", "rollout.multi_turn.tool_choice=required",
                 "rollout.multi_turn.tool_prompt='You can use tools: {tools}'", "trainer.mode=async",
                 "resources.rollout_workers=1", "algorithm.adv_estimator=grpo", "critic.enable=false",
                 f"teacher.endpoint={teacher.url}",
                 "trainer.total_steps=2", "trainer.save_every=0", "trainer.val_every=0", "trainer.export_hf=false")
    batches = []
    history, _ = run(cfg, setup=recording_updates(batches))
    assert len(history) == 2 and "critic/grad_norm" not in history[0]
    for batch in batches:
        check_teacher_rows(batch)
    for h in history:
        assert h["rollout/tool_calls_mean"] == 1.0 and h["rollout/tokens_tool"] > 0
        assert h["rollout/weights_fingerprint_ok"] == 1.0
    assert history[0]["rollout/logprob_diff_max"] < 1e-4


# ---- your own agent (rollout.agent) in a PPO run ----------------------------------------------------

SDK_AGENT = '''
import json, os
CALC = {"type": "function", "function": {"name": "calculator", "description": "exact arithmetic",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}

CALLS = [0]

async def run(client, row):
    """An agent as a team writes it against the OpenAI SDK: tools=, two model calls with a tool result between."""
    CALLS[0] += 1
    if CALLS[0] % 3 == 0:  # every third sample in each rollout worker
        raise RuntimeError("this agent fails on some rows")
    messages = list(row["messages"])
    log = []
    for turn in range(2):
        r = await client.chat.completions.create(model="policy", messages=messages, tools=[CALC], max_tokens=6,
                                                 temperature=1.0)
        log.append({"prompt": r.model_extra["prompt_token_ids"], "sampled": r.choices[0].model_extra["token_ids"]})
        messages += [r.choices[0].message.model_dump(exclude_none=True), {"role": "tool", "content": "5"}]
    with open(LOG, "a") as f:
        f.write(json.dumps(log) + "\\n")
    return 0.5
'''


def test_ppo_run_with_your_own_openai_sdk_agent(ray_session, tiny_assets, data_dir, tmp_path):
    """rollout.agent: an agent written against the unmodified openai SDK (tools=, a tool result between two
    calls) trained by sync PPO for 2 steps. Every trained row is exactly a session the agent ran: its prompt the
    ids the gateway rendered for the agent's first request (tools included), its model tokens the ids the engine
    sampled, the tool result's tokens attended but masked out; vLLM and Megatron agree on those tokens (fp32);
    the agent's reward is the score, and an agent that raises on a row costs that row only (counted)."""
    from trainer_utils import config, recording_rewarded, run

    log = tmp_path / "agent_log.jsonl"
    (tmp_path / "sdk_agent.py").write_text(f"LOG = {str(log)!r}\n" + SDK_AGENT)
    cfg = config(tiny_assets, data_dir, tmp_path / "run", f"rollout.agent={tmp_path / 'sdk_agent.py'}:run",
                 "rollout.max_new_tokens=40", "data.max_prompt_length=200",
                 "rollout.multi_turn.tool_prompt='You can use tools: {tools}'", "reward.non_stop_penalty=false",
                 "trainer.total_steps=2", "trainer.save_every=0", "trainer.val_every=0", "trainer.export_hf=false")
    batches = []
    history, _ = run(cfg, setup=recording_rewarded(batches))
    sessions = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(history) == 2 and len(batches) == 2
    # the failures are visible beside their count: each step's distinct errors in <output_dir>/agent_errors.log
    logged = (tmp_path / "run" / "agent_errors.log").read_text().splitlines()
    for step, h in enumerate(history, 1):
        counts = [int(line.split(": ", 1)[1].split(" x ")[0]) for line in logged if line.startswith(f"step {step}: ")]
        assert sum(counts) == h["rollout/agent_errors"] and counts, logged
    assert all("RuntimeError: this agent fails on some rows" in line for line in logged), logged
    trained, expected = [], []
    for h, batch in zip(history, batches):
        b = batch.batch
        rows = b["responses"].shape[0]
        errors = h["rollout/agent_errors"]
        assert 0 < errors < rows and h["rollout/agent_requests_mean"] == pytest.approx(2 * (1 - errors / rows))
        assert h["objective/scores"] == pytest.approx(0.5 * (1 - errors / rows))  # the agent's reward; 0 if it failed
        assert h["rollout/agent_own_prompt"] == rows - errors  # tools= changed the prompt: trained as sent
        assert h["rollout/agent_fallbacks"] == 0 and h["rollout/agent_timeouts"] == 0
        assert h["rollout/weights_fingerprint_ok"] == 1.0
        assert h["rollout/agent_sessions"] == rows  # one session per sample
        # request latency: every request the agents sent, no more; a session's requests go one after another
        # within it, so their latencies sum to at most the session's own wall time (each sample's, not the max)
        latencies = batch.non_tensor_batch["agent_request_s"]
        assert [len(x) for x in latencies] == b["agent_requests"].int().tolist()
        for i, own in enumerate(latencies):
            assert sum(own) <= float(b["agent_s"][i]) + 1e-6, (i, own, float(b["agent_s"][i]))
        assert h["timing/agent_request_s_max"] == pytest.approx(max(s for own in latencies for s in own))
        width = b["prompts"].shape[1]
        for i in range(rows):
            if b["response_mask"][i].sum() == 0:  # a failed agent's sample: nothing trained
                continue
            prompt = b["prompts"][i][b["attention_mask"][i, :width].bool()].tolist()
            n = int(b["attention_mask"][i, width:].sum())  # right-padded response: its attended tokens
            trained.append((tuple(prompt), tuple(b["responses"][i, :n].tolist()),
                            tuple(b["response_mask"][i, :n].tolist())))
        # the tool results' tokens, counted as the built-in loop counts its own (attended, not trained)
        between = int(b["attention_mask"][:, width:].sum() - b["response_mask"].sum())
        assert between > 0 and h["rollout/tokens_tool"] == between
    for first, second in sessions:
        sent = first["prompt"] + first["sampled"]
        assert second["prompt"][:len(sent)] == sent  # the second request continues the sampled ids as sampled
        tool = second["prompt"][len(sent):]  # the tool result (and the turn's closing) as the template renders it
        assert tool
        expected.append((tuple(first["prompt"]), tuple(first["sampled"] + tool + second["sampled"]),
                         (1,) * len(first["sampled"]) + (0,) * len(tool) + (1,) * len(second["sampled"])))
    # token identity: trained prompt = the gateway's rendering of the first request, response = the sampled ids
    # and the tool result's tokens between them, only the sampled ids trained (response_mask)
    assert sorted(trained) == sorted(expected)
    assert history[0]["rollout/logprob_diff_max"] < 1e-4


REWRITING_AGENT = '''
import json

async def run(client, row):
    """An agent that rewrites its history on even rows: its second request drops the first reply and asks
    again (the gateway starts a new segment); on odd rows the second request extends the first."""
    messages = list(row["messages"])
    r = await client.chat.completions.create(model="policy", messages=messages, max_tokens=6, temperature=1.0)
    log = [{"prompt": r.model_extra["prompt_token_ids"], "sampled": r.choices[0].model_extra["token_ids"]}]
    if row["index"] % 2 == 0:
        messages = messages + [{"role": "user", "content": "Once more, in one word."}]
    else:
        messages = messages + [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "ok?"}]
    r = await client.chat.completions.create(model="policy", messages=messages, max_tokens=6, temperature=1.0)
    log.append({"prompt": r.model_extra["prompt_token_ids"], "sampled": r.choices[0].model_extra["token_ids"]})
    with open(LOG, "a") as f:
        f.write(json.dumps({"index": row["index"], "log": log}) + "\\n")
    return float(len(log[1]["sampled"]) % 2)
'''


def rewritten_sessions_rows(sessions: list) -> list:
    """What REWRITING_AGENT's logged sessions must be trained as: (prompt, response, response_mask) rows."""
    expected = []
    for s in sessions:
        first, second = s["log"]
        if s["index"] % 2 == 0:  # rewritten: two rows, each its own prompt and sampled ids
            expected.append((tuple(first["prompt"]), tuple(first["sampled"]), (1,) * len(first["sampled"])))
            expected.append((tuple(second["prompt"]), tuple(second["sampled"]), (1,) * len(second["sampled"])))
        else:  # extended: one row, the user message between the turns attended, not trained
            sent = first["prompt"] + first["sampled"]
            assert second["prompt"][:len(sent)] == sent
            between = second["prompt"][len(sent):]
            expected.append((tuple(first["prompt"]), tuple(first["sampled"] + between + second["sampled"]),
                             (1,) * len(first["sampled"]) + (0,) * len(between) + (1,) * len(second["sampled"])))
    return expected


def trained_rows(b: dict) -> list:
    """A batch's rows as (prompt ids, attended response ids, their response_mask)."""
    width, rows = b["prompts"].shape[1], []
    for i in range(len(b["responses"])):
        prompt = b["prompts"][i][b["attention_mask"][i, :width].bool()].tolist()
        n = int(b["attention_mask"][i, width:].sum())
        rows.append((tuple(prompt), tuple(b["responses"][i, :n].tolist()), tuple(b["response_mask"][i, :n].tolist())))
    return rows


def test_ppo_run_trains_a_rewritten_history_as_rows_of_its_own(ray_session, tiny_assets, data_dir, tmp_path):
    """rollout.agent with an agent that rewrites its history on even rows (ppo/segments.py), trained by sync GRPO
    at DP2 for 2 steps. Each rewritten session is two trained rows, each exactly a prompt the gateway rendered
    and the ids the engine sampled after it; a later row ends in its sample's score and gets its sample's
    advantage, while the reward metrics count samples; vLLM and Megatron agree on every row's tokens (fp32);
    the update keeps its optimizer steps (the rows filled to equal mini-batches)."""
    from trainer_utils import config, recording_updates, run

    from megappo.ppo.segments import Segments

    log = tmp_path / "agent_log.jsonl"
    (tmp_path / "rewriting_agent.py").write_text(f"LOG = {str(log)!r}\n" + REWRITING_AGENT)
    cfg = config(tiny_assets, data_dir, tmp_path / "run", f"rollout.agent={tmp_path / 'rewriting_agent.py'}:run",
                 "rollout.max_new_tokens=40", "data.max_prompt_length=200", "algorithm.adv_estimator=grpo",
                 "reward.non_stop_penalty=false", "trainer.total_steps=2", "trainer.save_every=0",
                 "trainer.val_every=0", "trainer.export_hf=false")
    batches = []
    history, _ = run(cfg, setup=recording_updates(batches))
    sessions = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(history) == 2 and len(batches) == 2
    samples = cfg.data.train_batch_size * cfg.rollout.n
    trained = []
    for h, batch in zip(history, batches):
        b, segments = batch.batch, Segments.of(batch)
        later = int((b["agent_segment"] > 0).sum())
        assert later > 0 and segments is not None and segments.later == later == len(b["responses"]) - samples
        assert h["rollout/agent_segment_rows"] == later and h["rollout/agent_fallbacks"] == later
        assert h["rollout/agent_requests_mean"] == 2 and h["rollout/agent_segments_mean"] == 1 + later / samples
        assert h["actor/rows"] >= len(b["responses"])  # + masked copies: equal mini-batches
        assert h["rollout/logprob_diff_max"] < 1e-4  # every row, later ones included
        seq_scores, mask = b["token_level_scores"].sum(-1), b["response_mask"].bool()
        for i, j in enumerate(segments.owner):  # a later row: its sample's score and advantage
            assert seq_scores[i] == seq_scores[j]
            assert torch.allclose(b["advantages"][i][mask[i]], b["advantages"][j][mask[j]][0])
        assert h["objective/scores"] == pytest.approx(float(seq_scores[segments.primary].mean()))  # samples only
        trained += trained_rows(b)
    assert sorted(trained) == sorted(rewritten_sessions_rows(sessions))  # token identity, every segment
