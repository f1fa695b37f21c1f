"""``make demo``, the README's first command, as a new user runs it: it ends with a one-line
verdict, shows values as people read them without deltaflow's own columns, and prints no
warning (pandas, log4j, the JVM) on stderr, only its progress bar."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path


def test_the_demo_runs_clean_and_says_how_it_went() -> None:
    # A clean environment: no setting of the operator's, the jar cache kept.
    env = {k: v for k, v in os.environ.items() if not k.startswith("DELTAFLOW_") or "JARS" in k}
    demo = [sys.executable, "-m", "deltaflow.cli", "demo", "--rows", "3000", "--keep"]
    done = subprocess.run(
        [*demo, "--engine", "delta-rs"], capture_output=True, text=True, timeout=240, env=env
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    verdict = lines[-2]
    assert verdict.startswith("OK: 3,000 changes streamed by 2 nodes in ")
    # The verdict says what the count means: the changes' own outcome.
    found = re.search(
        r"table orders holds ([\d,]+) rows, as the changes leave it \(([\d,]+) orders "
        r"created, ([\d,]+) updates, ([\d,]+) deleted\)",
        verdict,
    )
    assert found is not None, verdict
    held, created, updates, deleted = (int(g.replace(",", "")) for g in found.groups())
    assert held == created - deleted and created >= 2_250 and updates + deleted > 600
    kept = Path(lines[-1].removeprefix("the table stays at ").split(" (")[0])
    try:
        assert (kept / "_delta_log").is_dir()  # --keep: the table is there to read
    finally:
        shutil.rmtree(kept.parent)
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["id", "customer"])
    assert lines[header].split() == ["id", "customer", "amount", "ts", "note"]
    assert lines[header + 1].split()[3:5] == ["2026-01-01", "00:00:00.000"]
    # stderr holds the progress bar (redrawn with \r) and nothing else.
    said = [part for part in done.stderr.replace("\r", "\n").splitlines() if part.strip()]
    assert [s for s in said if not s.startswith("streaming")] == []
