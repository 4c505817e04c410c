import pytest
import torch

from p2p_diloco.train.checkpoint import (
    CheckpointError,
    CheckpointWriter,
    claim_checkpoint_dir,
    load_checkpoint,
    save_checkpoint,
)


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


def test_writer_copies_the_payload_and_writes_in_the_background(tmp_path):
    writer = CheckpointWriter(tmp_path)
    x = torch.zeros(4)
    writer.submit({"format": 2, "x": x})
    x += 1  # training goes on changing its tensors: the snapshot keeps the values it was given
    writer.flush(timeout=30)
    assert torch.equal(load_checkpoint(tmp_path)["x"], torch.zeros(4))
    for i in range(5):
        writer.submit({"format": 2, "x": torch.full((4,), float(i))})
    writer.close(timeout=30)  # what waits is written before the thread stops; the newest wins
    assert torch.equal(load_checkpoint(tmp_path)["x"], torch.full((4,), 4.0))
    with pytest.raises(CheckpointError, match="closed"):
        writer.submit({"format": 2})


def test_writer_reports_a_failed_write_on_flush(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the directory should be")
    writer = CheckpointWriter(blocker)
    writer.submit({"format": 2})
    with pytest.raises(CheckpointError, match="failed"):
        writer.flush(timeout=30)
    writer.close(timeout=30)


def test_the_fault_hook_runs_with_the_write(tmp_path):
    seen = []
    writer = CheckpointWriter(tmp_path)
    writer.submit({"format": 2}, before_rename=lambda: seen.append(list(tmp_path.glob(".latest.pt.tmp-*"))))
    writer.flush(timeout=30)
    writer.close()
    assert len(seen) == 1 and len(seen[0]) == 1  # called between writing the temporary file and the rename


class _Payload:
    """Not a tensor, dict or number: weights_only loading must refuse to build it."""

    def __reduce__(self):
        return (print, ("a checkpoint ran code",))


def test_a_checkpoint_holding_an_object_or_non_finite_values_is_refused(tmp_path, capsys):
    torch.save({"format": 2, "evil": _Payload()}, tmp_path / "latest.pt")
    with pytest.raises(CheckpointError, match="corrupt or unreadable"):
        load_checkpoint(tmp_path)
    assert "ran code" not in capsys.readouterr().out
    good = {"format": 2, "model": {"w": torch.ones(2), "steps": torch.tensor([3])},
            "global": [{"params": [torch.ones(2)], "momentum": [torch.zeros(2)]}]}
    save_checkpoint(tmp_path, good)
    assert load_checkpoint(tmp_path) is not None
    save_checkpoint(tmp_path, {**good, "model": {"w": torch.tensor([1.0, float("nan")])}})
    with pytest.raises(CheckpointError, match=r"NaN or Inf in the local model \(w\)"):
        load_checkpoint(tmp_path)
    inf = [{"params": [torch.ones(2)], "momentum": [torch.tensor([float("inf")])]}]
    save_checkpoint(tmp_path, {**good, "global": inf})
    with pytest.raises(CheckpointError, match="NaN or Inf in the global state of fragment 0"):
        load_checkpoint(tmp_path)
