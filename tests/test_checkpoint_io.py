"""Atomic checkpoint dirs: manifest last, torn dirs skipped, a failed save leaves nothing behind."""

import json
import logging

import pytest

from megappo.utils.checkpoint import MANIFEST, atomic_checkpoint, is_complete, latest_checkpoint, read_step, step_dir


def _save(root, step, payload="x"):
    with atomic_checkpoint(root, step) as tmp:
        (tmp / "actor").mkdir()
        (tmp / "actor" / "shard.bin").write_text(payload * 10)
        (tmp / "trainer_state.json").write_text(json.dumps({"step": step}))


def test_save_and_latest(tmp_path):
    assert latest_checkpoint(tmp_path) is None
    _save(tmp_path, 2)
    _save(tmp_path, 10)
    latest = latest_checkpoint(tmp_path)
    assert latest == step_dir(tmp_path, 10) and read_step(latest) == 10
    manifest = json.loads((latest / MANIFEST).read_text())
    assert set(manifest["files"]) == {"actor/shard.bin", "trainer_state.json"}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")]


def test_torn_checkpoint_skipped_with_warning(tmp_path, caplog):
    _save(tmp_path, 2)
    _save(tmp_path, 4)
    (step_dir(tmp_path, 4) / "actor" / "shard.bin").write_text("short")  # truncated after the fact
    torn = step_dir(tmp_path, 6)
    torn.mkdir()
    (torn / "trainer_state.json").write_text("{}")  # crash before the manifest
    with caplog.at_level(logging.WARNING):
        assert latest_checkpoint(tmp_path) == step_dir(tmp_path, 2)
    assert "step_00000006" in caplog.text and "step_00000004" in caplog.text
    assert not is_complete(torn)


def test_failed_save_leaves_no_dir(tmp_path):
    with pytest.raises(RuntimeError):
        with atomic_checkpoint(tmp_path, 3) as tmp:
            (tmp / "partial").write_text("x")
            raise RuntimeError("worker died")
    assert list(tmp_path.iterdir()) == []
    assert latest_checkpoint(tmp_path) is None
