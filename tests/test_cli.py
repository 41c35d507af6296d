"""Entry-script start-up (reve_jax/cli.py)."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_setup_logging_shows_info_lines_after_orbax_is_imported():
    # Importing orbax leaves a WARNING-level handler on the root logger; logging.basicConfig alone is then a no-op
    # and every INFO line of the scripts (progress, compile times) vanished.
    code = (
        "import logging, orbax.checkpoint\n"
        "from reve_jax import cli\n"
        "cli.setup_logging(); cli.setup_logging()\n"
        "logging.getLogger('reve_jax.probe').info('probe-line')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = [ln for ln in out.stderr.splitlines() if "probe-line" in ln]
    assert len(lines) == 1, out.stderr  # shown, once
    assert "INFO reve_jax.probe: probe-line" in lines[0]


def test_progress_logs_at_most_every_interval_and_always_at_the_end():
    from reve_jax.progress import Progress

    now, lines, notes = [0.0], [], []

    def note():
        notes.append(1)
        return "loss 1.0"

    p = Progress("step", 10, seconds=30.0, log=lines.append, clock=lambda: now[0])
    for i in range(1, 11):
        now[0] = 10.0 * i  # a step every 10 s: a line at 30 s, 60 s, 90 s and at the last step
        p(i, note)
    assert [ln.split(" (")[0] for ln in lines] == ["step 3/10", "step 6/10", "step 9/10", "step 10/10"]
    assert lines[0] == "step 3/10 (30.0%, 0.1/s, 70 s left): loss 1.0"
    assert len(notes) == 4  # the note is computed for a line only
