"""Progress where the output is not a terminal: a plain line a few times a minute, with a fake clock."""

from __future__ import annotations

import io

from areal_hpc.launch.progress_view import ProgressLines
from areal_hpc.utils import PIPED_PROGRESS_S, bar_interval, on_terminal


def _progress(t: float, version: int, **more) -> dict:
    """progress.json as rank 0 writes it at `t`, `t` seconds into the run."""
    return {
        "state": "running",
        "version": version,
        "versions": 400,
        "start_version": 0,
        "reward_mean": 0.25 + version / 1000,
        "heldout_acc": 0.16,
        "heldout_version": 0,
        "consumed_tokens_per_s": 1234.5,
        "elapsed_s": t,
        "eval": None,
        "time": 1e9 + t,
        **more,
    }


class TerminalLike(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_ten_minutes_of_polls_give_a_few_lines_a_minute_each_with_the_figures():
    """The launcher polls every 0.1 s (here; 0.5 s in launch) for 10 minutes; rank 0 writes a version every 2 s,
    then nothing for the last 2 minutes (a stall): at most 6 lines in any minute, at least one in each minute
    while progress changes, none while it does not, and the end's figures once."""
    lines, printed = ProgressLines(), []
    p = None
    for tick in range(10 * 60 * 10):
        now = tick / 10
        if now < 8 * 60 and tick % 20 == 0:  # a new version every 2 s for 8 minutes
            p = _progress(now, version=tick // 20)
        if line := lines.line(now, p):
            printed.append((now, line))
    per_minute = [sum(1 for t, _ in printed if m * 60 <= t < (m + 1) * 60) for m in range(10)]
    assert all(1 <= n <= 6 for n in per_minute[:8]), per_minute
    assert per_minute[8] <= 1 and per_minute[9] == 0, per_minute  # a stall: the line that caught up, then none
    assert printed[0][0] == 0.0  # the first progress at once
    gaps = [b - a for (a, _), (b, _) in zip(printed, printed[1:])]
    assert min(gaps) >= PIPED_PROGRESS_S
    for _, line in printed:
        assert "\n" not in line and "\r" not in line
        assert line.startswith("progress: version ") and "/400" in line, line
        assert "reward 0." in line and "held-out 16.0% (v0)" in line and "1234 consumed tokens/s" in line, line
        assert "s since start" in line, line
    last = printed[-1][1]
    assert "version 239/400" in last, last  # caught up with the last version written
    assert lines.final(p) is None  # the end's figures were the latest line's already
    done = {**p, "state": "finished", "version": 400}
    assert "version 400/400 (finished)" in lines.final(done) and lines.final(done) is None


def test_a_line_says_what_the_bar_shows_beside_the_figures():
    """Reward failures and a held-out evaluation under way, as the bar's postfix has them; odd values never
    raise (status's line formats them as n/a)."""
    lines = ProgressLines(interval_s=20)
    ev = {"tag": "v50", "done": 37, "total": 100, "reward_timeouts": 0}
    line = lines.line(0.0, _progress(5.0, 50, reward_errors=2, heldout_reward_errors=1, eval=ev))
    assert "3 reward errors" in line and "evaluating v50: 37/100 episodes" in line, line
    assert lines.line(10.0, _progress(10.0, 51)) is None  # inside the interval
    odd = lines.line(30.0, {"version": None, "reward_mean": "x", "heldout_acc": [], "elapsed_s": "soon"})
    assert odd.startswith("progress: version ") and "reward n/a" in odd and "held-out n/a" in odd, odd
    assert lines.line(60.0, None) is None and lines.line(60.0, ["not", "a", "dict"]) is None


def test_bars_redraw_a_few_times_a_minute_unless_on_a_terminal(monkeypatch):
    """sync_loop's and the warm start's tqdm bars take this pace: tqdm's own 0.1 s on a terminal."""
    assert on_terminal(TerminalLike()) and not on_terminal(io.StringIO()) and not on_terminal(object())
    monkeypatch.setattr("sys.stderr", io.StringIO())
    assert bar_interval() == PIPED_PROGRESS_S >= 10
    monkeypatch.setattr("sys.stderr", TerminalLike())
    assert bar_interval() == 0.1
