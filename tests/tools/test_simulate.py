"""`gpushare simulate`: the policy study (docs/scheduling.md), the real arbiter on a
virtual clock, through the real command line. Deterministic: figures are exact per seed,
the bounds here are the rules' (a cell answered by a turn, prefetch hiding a switch)."""

from __future__ import annotations

import pytest

from gpushare.tools.cli import main


def rows(capsys: pytest.CaptureFixture[str], *args: str) -> dict[float, list[str]]:
    assert main(["simulate", "--no-plot", *args]) == 0  # 120 s each
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("gpushare simulate: ")
    return {float(line.split()[0]): line.split() for line in out[2:]}


def test_a_notebook_beside_batch_jobs_is_answered_by_turns(capsys):
    # three sessions of 30 GiB on 80 GiB: oversubscribed, so every switch swaps
    turns = rows(capsys, "--mix", "interactive", "--tq", "5", "30")
    none = rows(capsys, "--mix", "interactive", "--tq", "5", "--turn", "0")
    for tq in (5.0, 30.0):
        # TQ  goodput  ideal  /ideal  batch-loss  p50 / p99  switches  GiB
        _, _, _, _, loss, p50, _, p99, *_ = turns[tq]
        assert float(p50) < 0.1 and float(p99) < 1.0, turns[tq]
        assert float(loss.rstrip("%")) < 5.0
    assert float(none[5.0][5]) > 5.0  # without turns, a cell waits its turn in the queue


def test_prefetch_hides_the_switch_when_the_next_session_fits_beside_the_holder(capsys):
    on = rows(capsys, "--mix", "batch", "--tq", "1")
    off = rows(capsys, "--mix", "batch", "--tq", "1", "--no-prefetch")
    assert float(on[1.0][1]) > 0.97 > float(off[1.0][1])


def test_a_workload_of_the_users_mix_and_a_bad_one(capsys):
    got = rows(capsys, "--workload", "batch:30GiB", "--workload", "short:30GiB@2", "--tq", "5")
    assert 0.0 < float(got[5.0][1]) <= 1.0
    assert main(["simulate", "--no-plot", "--workload", "nonsense"]) == 2
    assert "gpushare simulate: error:" in capsys.readouterr().err


def test_the_wait_for_ones_turn_shows_at_a_long_tq(capsys):
    # short bursts keep their quantum through hundreds of bursts, then wait two quanta once
    # a round: p99 hid it (0.00 at TQ 30) and a 120 s run saw it about once
    got = rows(capsys, "--mix", "short", "--tq", "30")
    # TQ  goodput  ideal  /ideal  batch-loss  p50 / p99 / max  switches  GiB  run-s
    longest, run_s = float(got[30.0][9]), float(got[30.0][-1])
    assert 55.0 < longest < 65.0, got[30.0]  # two quanta of 30 s
    assert run_s >= 4 * 30 * 3
