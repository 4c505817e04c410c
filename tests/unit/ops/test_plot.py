"""``p2p-diloco plot``: a PNG from learners' audit logs."""

import json
import struct

import pytest

from p2p_diloco.ops.plot import PlotError, find_logs, plot, read_series


def _log(path, events):
    path.mkdir(parents=True)
    with open(path / "audit.jsonl", "w") as f:
        for seq, e in enumerate(events):
            f.write(json.dumps({"seq": seq, "prev": "x", **e}) + "\n")
        f.write("{torn line\n")


def _run(tmp_path):
    for i in range(2):
        events = [{"time": 100.0, "event": "started"}]
        for k in range(1, 6):
            t = 100.0 + 10 * k + i
            events.append({"time": t, "event": "committed", "tokens": 1000, "bytes_sent": 500_000})
            events.append({"time": t + 1, "event": "outer_step", "tokens": 1000 * k, "train_seconds": 10.0 * k,
                           "compute_seconds": 9.0 * k, "eval_loss": 5.0 - k * 0.5 if k % 2 else None})
        _log(tmp_path / "run" / f"ckpt-{i}", events)
    return tmp_path / "run"


def test_a_learner_series_from_its_log(tmp_path):
    s = read_series(find_logs([_run(tmp_path)])[0])
    assert s.eval_loss == [4.5, 3.5, 2.5] and s.eval_tokens == [1000, 3000, 5000]
    assert s.merged_tokens == [1000, 2000, 3000, 4000, 5000] and s.round_bytes == [500_000] * 5
    assert s.compute_share == pytest.approx([0.9] * 4)


def test_plot_writes_a_png_of_the_expected_size(tmp_path):
    out = plot([_run(tmp_path)], tmp_path / "out" / "run.png")
    raw = out.read_bytes()
    assert raw[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", raw[16:24])  # the IHDR chunk
    assert (width, height) == (1200, 800)


def test_no_logs_is_one_clear_error(tmp_path):
    with pytest.raises(PlotError, match="no audit.jsonl"):
        find_logs([tmp_path])
    with pytest.raises(PlotError, match="does not exist"):
        find_logs([tmp_path / "nope"])
