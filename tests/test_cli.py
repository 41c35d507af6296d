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
