"""``make demo``, the README's first command, as a new user runs it: it ends with a one-line
verdict, shows values as people read them without deltaflow's own columns, and prints no
warning (pandas, log4j, the JVM) on stderr, only its progress bar."""

from __future__ import annotations

import os
import subprocess
import sys


def test_the_demo_runs_clean_and_says_how_it_went() -> None:
    # A clean environment: no setting of the operator's, the jar cache kept.
    env = {k: v for k, v in os.environ.items() if not k.startswith("DELTAFLOW_") or "JARS" in k}
    done = subprocess.run(
        [sys.executable, "-m", "deltaflow.cli", "demo", "--rows", "3000", "--engine", "delta-rs"],
        capture_output=True, text=True, timeout=240, check=False, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[-1].startswith("OK: 3,000 changes streamed by 2 nodes in ")
    assert "rows as expected" in lines[-1]
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["id", "customer"])
    assert lines[header].split() == ["id", "customer", "amount", "ts", "note"]
    assert lines[header + 1].split()[3:5] == ["2026-01-01", "00:00:00.000"]
    # stderr holds the progress bar (redrawn with \r) and nothing else.
    said = [part for part in done.stderr.replace("\r", "\n").splitlines() if part.strip()]
    assert [s for s in said if not s.startswith("streaming")] == []
