import pytest
import torch

from p2p_diloco.checkpoint import CheckpointError, claim_checkpoint_dir, load_checkpoint, save_checkpoint


def test_save_load_roundtrip(tmp_path):
    save_checkpoint(tmp_path, {"format": 2, "x": torch.arange(3)})
    save_checkpoint(tmp_path, {"format": 2, "x": torch.arange(4)})
    assert torch.equal(load_checkpoint(tmp_path)["x"], torch.arange(4))
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".latest")] == []


def test_missing_checkpoint_is_none(tmp_path):
    assert load_checkpoint(tmp_path) is None


def test_corrupt_checkpoint_is_refused(tmp_path):
    (tmp_path / "latest.pt").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="corrupt"):
        load_checkpoint(tmp_path)
    save_checkpoint(tmp_path, {"format": 99})
    with pytest.raises(CheckpointError, match="not a p2p-diloco checkpoint"):
        load_checkpoint(tmp_path)


def test_checkpoint_dirs_are_exclusive(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    a, lock_a = claim_checkpoint_dir(None)
    b, lock_b = claim_checkpoint_dir(None)
    assert a != b
    with pytest.raises(CheckpointError, match="in use"):
        claim_checkpoint_dir(str(a))
    lock_a.release()
    c, lock_c = claim_checkpoint_dir(None)
    assert c == a
    lock_b.release()
    lock_c.release()
