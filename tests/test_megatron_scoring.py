"""`megappo logprobs` as a black box (its entry point, megappo.cli.main, run in this process: cli_helpers):
TP2xPP2 on tiny qwen2 (tied embeddings, qkv bias, padded vocab), rows of different lengths and response starts;
compared with HF transformers."""

import json

from cli_helpers import run_cli

from megappo.assets import hf_response_logprobs

ROWS = [
    {"input_ids": [5, 17, 300, 42, 9, 77, 12, 999, 3], "response_start": 4},
    {"input_ids": [8, 1, 2, 600, 7], "response_start": 2},
    {"input_ids": [11, 23, 400, 5, 6, 7, 8, 9, 10, 11, 12, 13], "response_start": 6},
]


def test_logprobs_cli_tp2_pp2_matches_hf(tiny_assets, tmp_path):
    from safetensors.torch import load_file

    model = str(tiny_assets["tiny-qwen2"])
    inp = tmp_path / "rows.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    out = tmp_path / "lp.safetensors"
    rc, _, stderr = run_cli("logprobs", "--model", model, "--tp", "2", "--pp", "2", "--input", inp, "--out", out)
    assert rc == 0, stderr[-3000:]
    got = load_file(str(out))
    assert sorted(got) == ["logprobs.0", "logprobs.1", "logprobs.2"]
    for i, ref in enumerate(hf_response_logprobs(model, ROWS)):
        assert got[f"logprobs.{i}"].shape == ref.shape
        assert (got[f"logprobs.{i}"] - ref).abs().max().item() <= 1e-4


def test_logprobs_cli_rejects_bad_layout(tmp_path):
    rc, _, stderr = run_cli("logprobs", "--model", "x", "--pp", "1", "--vpp", "2", "--input", "x", "--out", tmp_path / "o")
    assert rc == 2 and "vpp" in stderr
