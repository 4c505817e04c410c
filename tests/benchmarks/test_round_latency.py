"""The round-latency benchmark's arithmetic (benchmarks/round_latency.py): a learner's row and the medians."""

from tests.benchmarks import load_benchmark


def test_rows_and_medians_of_the_two_settings():
    bench = load_benchmark("round_latency")
    summary = {"compute_seconds": 3.0, "train_seconds": 4.0, "wait_seconds": 1.0, "rounds_failed": 1,
               "inner_steps": 120, "steps_merged": 90.0, "last_eval_loss": 2.5, "version": 6,
               "global_state_sha256": "ab" * 32}
    row = bench.learner_row(summary)
    assert row["compute_share"] == 0.75 and row["merged_share"] == 0.75 and row["sha256"] == "ab" * 8
    assert bench.learner_row({})["compute_share"] == 0.0  # a summary without times divides by nothing
    runs = [{"early_close": True, "wall_seconds": w, "learners": [row, {**row, "compute_share": 0.25}]}
            for w in (10.0, 30.0)] + [{"early_close": False, "wall_seconds": 99.0, "learners": [row]}]
    early = bench.medians(runs, True)
    assert early["runs"] == 2 and early["wall_seconds"] == 20.0 and early["compute_share"] == 0.5
    assert early["rounds_failed"] == 4 and early["states"] == ["ab" * 8] and early["eval_losses"] == [2.5]
    assert bench.medians(runs, False)["wall_seconds"] == 99.0
