"""RLHFDataset, collate, EpochSampler and the preprocess scripts (real parquet, real tiny tokenizer)."""

import json
import logging

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from megappo.data import EpochSampler, RLHFDataset, collate
from megappo.data import preprocess_arithmetic, preprocess_gsm8k


@pytest.fixture(scope="module")
def tokenizer(tiny_assets):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_assets["tokenizer"])


def write(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def row(prompt, truth="1", extra=None):
    return {"prompt": prompt, "data_source": "arithmetic",
            "reward_model": {"ground_truth": truth, "style": "rule"}, "extra_info": extra or {"index": 0}}


# ----------------------------------------------------------------------------- dataset
def test_dataset_loads_chat_and_string_prompts(tmp_path, tokenizer):
    chat = write(tmp_path / "chat.parquet", [row([{"role": "user", "content": "What is 1 + 2?"}], "3")])
    plain = write(tmp_path / "plain.parquet", [row("What is 1 + 2?", "3")])
    ds = RLHFDataset([chat, plain], tokenizer, max_prompt_length=64)
    assert len(ds) == 2 and ds.num_filtered == 0
    expected = "<|im_start|>user\nWhat is 1 + 2?<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(ds[0]["input_ids"]) == expected
    assert ds[1]["input_ids"] == ds[0]["input_ids"]  # a string prompt is one user message
    assert ds[0]["reward_model"]["ground_truth"] == "3" and ds[1]["raw_prompt"] == "What is 1 + 2?"
    raw = RLHFDataset(plain, tokenizer, max_prompt_length=64, apply_chat_template=False)
    assert tokenizer.decode(raw[0]["input_ids"]) == "What is 1 + 2?"


def test_dataset_filters_overlong_prompts_with_count(tmp_path, tokenizer, caplog):
    rows = [row("What is 1 + 2?"), row("the " * 80), row("What is 3 + 4?"), row("one two " * 40)]
    path = write(tmp_path / "d.parquet", rows)
    with caplog.at_level(logging.WARNING, logger="megappo.data.dataset"):
        ds = RLHFDataset(path, tokenizer, max_prompt_length=32)
    assert ds.num_filtered == 2 and len(ds) == 2
    assert all(len(r["input_ids"]) <= 32 for r in ds.rows)
    assert "filtered 2 prompts" in caplog.text
    assert [r["index"] for r in ds.rows] == [0, 1]


def test_missing_file_and_missing_column_errors(tmp_path, tokenizer):
    with pytest.raises(FileNotFoundError, match=r"nope\.parquet.*preprocess_arithmetic"):
        RLHFDataset(tmp_path / "nope.parquet", tokenizer)
    bad = write(tmp_path / "bad.parquet", [{"question": "hi", "data_source": "x", "reward_model": {"ground_truth": "1"}}])
    with pytest.raises(ValueError, match=r"bad\.parquet.*no column 'prompt'.*preprocess"):
        RLHFDataset(bad, tokenizer)
    no_rm = write(tmp_path / "no_rm.parquet", [{"prompt": "hi", "data_source": "x"}])
    with pytest.raises(ValueError, match="no column 'reward_model'"):
        RLHFDataset(no_rm, tokenizer)


def test_collate_left_pads_with_position_ids(tokenizer):
    rows = [
        {"input_ids": [11, 12, 13], "raw_prompt": "a", "data_source": "arithmetic",
         "reward_model": {"ground_truth": "1"}, "extra_info": {}, "index": 0},
        {"input_ids": [21], "raw_prompt": "b", "data_source": "gsm8k",
         "reward_model": {"ground_truth": "2"}, "extra_info": {"k": 1}, "index": 1},
    ]
    batch = collate(rows, tokenizer, max_prompt_length=8)
    pad = tokenizer.pad_token_id
    assert batch.batch["input_ids"].tolist() == [[11, 12, 13], [pad, pad, 21]]
    assert batch.batch["attention_mask"].tolist() == [[1, 1, 1], [0, 0, 1]]
    assert batch.batch["position_ids"].tolist() == [[0, 1, 2], [0, 0, 0]]
    assert batch.batch["input_ids"].dtype == torch.long
    assert list(batch.non_tensor_batch["data_source"]) == ["arithmetic", "gsm8k"]
    assert batch.non_tensor_batch["reward_model"][1]["ground_truth"] == "2"
    uids = batch.non_tensor_batch["uid"]
    assert len(set(uids)) == 2
    repeated = batch.repeat(3)  # n responses per prompt share the prompt's uid
    assert list(repeated.non_tensor_batch["uid"]) == [uids[0]] * 3 + [uids[1]] * 3
    with pytest.raises(ValueError, match="max_prompt_length=2"):
        collate(rows, tokenizer, max_prompt_length=2)


# ----------------------------------------------------------------------------- sampler
def test_sampler_covers_each_epoch_and_reshuffles():
    s = EpochSampler(num_rows=10, batch_size=4, seed=3)
    epoch0 = [next(s) for _ in range(2)]  # drop_last: 2 batches, 2 rows skipped
    assert s.epoch == 1 and s.epoch_float == 1.0
    epoch1 = [next(s) for _ in range(2)]
    flat0, flat1 = sum(epoch0, []), sum(epoch1, [])
    assert len(set(flat0)) == 8 and len(set(flat1)) == 8
    assert flat0 != flat1  # a new permutation each epoch
    assert flat0 == np.random.default_rng(3).permutation(10)[:8].tolist()
    again = EpochSampler(num_rows=10, batch_size=4, seed=3)
    assert [next(again) for _ in range(4)] == epoch0 + epoch1  # deterministic by seed


def test_sampler_no_drop_last_and_epoch_float():
    s = EpochSampler(num_rows=5, batch_size=2, seed=0, shuffle=False, drop_last=False)
    assert next(s) == [0, 1] and s.epoch_float == pytest.approx(0.4)
    assert next(s) == [2, 3]
    assert next(s) == [4] and s.epoch_float == 1.0
    assert next(s) == [0, 1]
    with pytest.raises(ValueError, match="cannot fill one batch"):
        EpochSampler(num_rows=3, batch_size=4, seed=0)


def test_sampler_resumes_exactly_from_state_dict():
    s = EpochSampler(num_rows=7, batch_size=3, seed=11)
    for _ in range(3):  # into the second epoch
        next(s)
    state = json.loads(json.dumps(s.state_dict()))  # survives a JSON checkpoint
    expected = [next(s) for _ in range(5)]
    resumed = EpochSampler(num_rows=7, batch_size=3, seed=0)
    resumed.load_state_dict(state)
    assert [next(resumed) for _ in range(5)] == expected
    with pytest.raises(ValueError, match="7 rows"):
        EpochSampler(num_rows=8, batch_size=3, seed=11).load_state_dict(state)


# ----------------------------------------------------------------------------- preprocess
def test_preprocess_arithmetic_writes_readable_deterministic_parquet(tmp_path, tokenizer):
    assert preprocess_arithmetic.main(["--out", str(tmp_path / "a"), "--train-size", "40", "--val-size", "8"]) == 0
    preprocess_arithmetic.main(["--out", str(tmp_path / "b"), "--train-size", "40", "--val-size", "8"])
    train = pq.read_table(tmp_path / "a" / "arith_train.parquet").to_pylist()
    assert len(train) == 40 and len(pq.read_table(tmp_path / "a" / "arith_val.parquet")) == 8
    assert pq.read_table(tmp_path / "b" / "arith_train.parquet").to_pylist() == train
    for r in train:
        a, b = r["extra_info"]["a"], r["extra_info"]["b"]
        assert r["reward_model"]["ground_truth"] == str(a + b) and r["data_source"] == "arithmetic"
        assert f"What is {a} + {b}?" in r["prompt"][0]["content"]
    ds = RLHFDataset(tmp_path / "a" / "arith_train.parquet", tokenizer, max_prompt_length=48)  # ppo_tiny's limit
    assert len(ds) == 40 and ds.num_filtered == 0


def test_preprocess_gsm8k_from_jsonl(tmp_path, tokenizer):
    src = tmp_path / "train.jsonl"
    records = [{"question": f"Tom has {i} apples and buys 1,000 more. How many?", "answer": f"{i} + 1000\n#### {i + 1000:,}"}
               for i in range(6)]
    src.write_text("\n".join(json.dumps(r) for r in records))
    assert preprocess_gsm8k.main(["--input", str(src), "--test-size", "2", "--out", str(tmp_path / "out")]) == 0
    train = pq.read_table(tmp_path / "out" / "gsm8k_train.parquet").to_pylist()
    test = pq.read_table(tmp_path / "out" / "gsm8k_test.parquet").to_pylist()
    assert len(train) == 4 and len(test) == 2
    for r in train + test:
        n = int(r["extra_info"]["question"].split()[2])
        assert r["reward_model"]["ground_truth"] == str(n + 1000)  # commas removed
        assert r["data_source"] == "openai/gsm8k" and '"####"' in r["prompt"][0]["content"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "q", "answer": "no final line"}))
    with pytest.raises(ValueError, match="row 0.*####"):
        preprocess_gsm8k.main(["--input", str(bad), "--test-input", str(bad), "--out", str(tmp_path / "x")])


def test_held_out_split_never_trains_on_a_val_problem_or_its_mirror(tmp_path):
    """The SmolLM2 recipe's claim "problems it never saw": with --held-out (the Makefile's flags), no val
    pair (a, b), nor its mirror (b, a), appears in train; val has the asked number of distinct pairs
    and train still covers every other pair."""
    import pyarrow.parquet as pq

    from megappo.data.preprocess_arithmetic import main

    main(["--out", str(tmp_path), "--held-out", "--min-operand", "0", "--max-operand", "30", "--val-size", "150",
          "--train-size", "4096", "--instruction", "Give only the number."])
    pairs = {split: [(r["extra_info"]["a"], r["extra_info"]["b"]) for r in
                     pq.read_table(tmp_path / f"arith_{split}.parquet").to_pylist()] for split in ("train", "val")}
    val = set(pairs["val"])
    assert len(pairs["val"]) == len(val) == 150
    seen = set(pairs["train"])
    assert not val & seen and not {(b, a) for a, b in val} & seen
    unordered_val = {(min(p), max(p)) for p in val}
    every = {(a, b) for a in range(31) for b in range(31)}
    assert seen == {(a, b) for a, b in every if (min(a, b), max(a, b)) not in unordered_val}
    for split in ("train", "val"):
        for r in pq.read_table(tmp_path / f"arith_{split}.parquet").to_pylist():
            a, b = r["extra_info"]["a"], r["extra_info"]["b"]
            assert r["reward_model"]["ground_truth"] == str(a + b)
            assert r["prompt"][0]["content"] == f"What is {a} + {b}? Give only the number."


def test_tool_shots_are_worked_calculator_exchanges(tmp_path):
    """--tool-shots K: K (question, Hermes call, tool result, answer) exchanges before each question; the
    calls parse and the results are the calculator's; the val pairs are those of the plain split."""
    from megappo.agent.format import parse_call
    from megappo.agent.tools import make_tools

    calc = make_tools(["calculator"])["calculator"]
    args = ["--held-out", "--min-operand", "100", "--max-operand", "120", "--val-size", "10", "--train-size", "16"]
    preprocess_arithmetic.main(["--out", str(tmp_path / "shots"), "--tool-shots", "2", *args])
    preprocess_arithmetic.main(["--out", str(tmp_path / "plain"), *args])
    shots = pq.read_table(tmp_path / "shots" / "arith_val.parquet").to_pylist()
    plain = pq.read_table(tmp_path / "plain" / "arith_val.parquet").to_pylist()
    for row, ref in zip(shots, plain):
        msgs = row["prompt"]
        assert [m["role"] for m in msgs] == ["user", "assistant", "tool", "assistant"] * 2 + ["user"]
        assert msgs[-1] == ref["prompt"][0] and row["reward_model"] == ref["reward_model"]
        for k in (1, 5):
            call = parse_call(msgs[k]["content"])
            assert call.error is None and calc.call(call.arguments).text == msgs[k + 1]["content"] == msgs[k + 2]["content"]
    with pytest.raises(SystemExit):
        preprocess_arithmetic.main(["--out", str(tmp_path / "x"), "--tool-shots", "9"])
