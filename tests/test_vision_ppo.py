"""GRPO on images end to end (configs/grpo_tiny_vl.yaml's run, 2 steps, the tiny Qwen2.5-VL, the hybrid engine):
the rows carry their images from the parquet file through vLLM and every model role, and after each weight sync
(the vision tower's 30 tensors fingerprinted with the rest) vLLM's sampled log-probs are within 1e-3 of the actor's
megatron forward of the same rows. The export holds the vision tower, moved by the update (an entropy bonus: the
random model earns no reward), and the processor's files. Fresh workers resumed from the step-1 checkpoint repeat
step 2 (the tower's weights and optimizer state are in the checkpoint)."""

import shutil

import pytest

from tests.trainer_utils import REPO, recording_updates, run


@pytest.fixture(scope="module")
def squares(tmp_path_factory):
    from megappo.data.preprocess_arithmetic import write_parquet
    from megappo.data.preprocess_count_squares import make_rows

    out = tmp_path_factory.mktemp("squares")
    write_parquet(make_rows(8, 0, 4, "train"), out / "train.parquet")
    write_parquet(make_rows(4, 1, 4, "val"), out / "val.parquet")
    return out


def test_grpo_on_images_samples_from_the_policy(ray_session, tiny_assets, squares, tmp_path):
    from megappo.config.loader import load_config

    cfg = load_config(REPO / "configs/grpo_tiny_vl.yaml", [
        f"model.path={tiny_assets['tiny-qwen2_5_vl']}", f"data.train_files=[{squares / 'train.parquet'}]",
        f"data.val_files=[{squares / 'val.parquet'}]", "data.train_batch_size=4", "rollout.n=2",
        "rollout.max_new_tokens=6", "rollout.kv_cache_memory_mb=16", "actor.ppo_mini_batch_size=4",
        "actor.micro_batch_size=2", "actor.log_prob_micro_batch_size=4", "ref.log_prob_micro_batch_size=4",
        "actor.ppo_epochs=1", "actor.use_rollout_log_probs=false", "actor.entropy_coeff=0.05", "trainer.total_steps=2",
        "trainer.save_every=1", "trainer.val_every=0", f"trainer.output_dir={tmp_path / 'full'}",
        "trainer.loggers=[jsonl]", "reward.num_examine=0"])
    batches = []
    history, _ = run(cfg, setup=recording_updates(batches), warm=False)
    assert len(batches) == 2 and len(history) == 2
    for step, (b, row) in enumerate(zip(batches, history)):
        pixels, grids = b.batch["pixel_values"], b.batch["image_grid_thw"]
        assert pixels.shape[0] == 8 and pixels.abs().sum() > 0 and grids[:, 0].tolist() == [[1, 8, 8]] * 8
        assert [len(x) for x in b.non_tensor_batch["images"]] == [1] * 8
        mask = b.batch["response_mask"].bool()
        gap = (b.batch["old_log_probs"] - b.batch["rollout_log_probs"]).abs()[mask].max().item()
        print(f"step {step + 1}: max |dlogp| vLLM vs megatron {gap:.2e}")
        assert gap <= 1e-3, (step, gap)
        assert row["rollout/weights_fingerprint_ok"] == 1.0 and row["rollout/weights_fingerprint_vision_tensors"] == 30
    # the export holds the vision tower by HF names, moved, with the processor's files vLLM and transformers read
    from safetensors.torch import load_file

    from megappo.utils.checkpoint import step_dir
    from tests.trainer_utils import assert_same_steps

    export, start = tmp_path / "full" / "hf_final", load_file(str(tiny_assets["tiny-qwen2_5_vl"] / "model.safetensors"))
    got = {k: v for f in sorted(export.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    assert sorted(got) == sorted(start) and (export / "processor_config.json").is_file()
    moved = [k for k in got if k.startswith("visual.") and not got[k].equal(start[k])]
    assert len(moved) >= 20, moved  # the tower trains: a resume that lost its state would differ below

    # stopped after step 1: fresh workers resume from its checkpoint and repeat step 2
    shutil.copytree(step_dir(tmp_path / "full" / "checkpoints", 1), step_dir(tmp_path / "resumed" / "checkpoints", 1))
    cfg.trainer.output_dir, cfg.trainer.save_every = str(tmp_path / "resumed"), 0
    again = run(cfg, warm=False)
    assert len(again) == 1 and again[0]["episode"] == history[1]["episode"]
    assert_same_steps(history[1:], again)
