"""Mutation testing of the modules that carry deltaflow's guarantees (``make mutation``).

Runs mutmut 3 as ``[tool.mutmut]`` in pyproject.toml configures it (which modules, which fast
tests) from a clean ``mutants/``, then reports per module: mutants, killed (a test failed or
the tests hung), survived, not covered, the survivors docs/mutation.md explains as
equivalent, and the kill rate over the non-equivalent ones. See docs/mutation.md.

A clean start because mutmut keeps the verdict of every mutant whose function did not change:
a survivor that a new test kills would still read "survived" in a reused ``mutants/``
(``--keep`` reuses it, for a quick look at one module: ``mutmut run "deltaflow.protocol.*"``).

Exits non-zero when mutmut fails, when a module has no killed mutant at all (the tests ran
against another copy of the code than the mutated one), or when a module kills fewer than
``--min-rate`` percent of its non-equivalent mutants.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MUTANTS = ROOT / "mutants"
EQUIVALENTS = ROOT / "docs" / "mutation.md"
#: A mutant's name: module path, then the mangled function (``xǁClassǁmethod``) and a number.
_MUTANT_NAME = re.compile(r"deltaflow\.[\w.\u01c1]+__mutmut_\d+")

#: mutmut's exit codes of a mutant's test run (mutmut/stats.py). A test failed (1, or 3 for
#: an internal pytest error); the tests hung and mutmut stopped them (SIGXCPU); no test covers
#: the mutated function. Any other signal (negative code) also means the mutant crashed the
#: tests, so it was caught: e.g. ``os.kill(pid, 1)`` for ``os.kill(pid, 0)`` hangs up pytest.
_KILLED = {1, 3}
_TIMEOUT = {-24, 24, 36, 152, 255}
_SURVIVED = {0}
_NO_TESTS = {5, 33}


def _caught(code: int | None) -> bool:
    return code is not None and (code in _KILLED or (code < 0 and code not in _TIMEOUT))


@dataclass
class Module:
    """The verdicts of one mutated module."""

    path: str
    verdicts: dict[str, int | None] = field(default_factory=dict)

    def names(self, codes: set[int]) -> list[str]:
        return sorted(k for k, v in self.verdicts.items() if v in codes)

    def detected(self) -> list[str]:
        """Mutants a test caught: killed, crashed or hung."""
        return sorted(k for k, v in self.verdicts.items() if _caught(v) or v in _TIMEOUT)

    def missed(self) -> list[str]:
        """Mutants no test caught: survived, not covered, or not checked (run interrupted)."""
        caught = set(self.detected())
        return sorted(k for k in self.verdicts if k not in caught)

    def unexplained(self, equivalent: set[str]) -> list[str]:
        return [k for k in self.missed() if k not in equivalent]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--workers",
        type=int,
        default=int(os.environ.get("MUTATION_WORKERS", "2")),
        help="mutants tested at once (default: $MUTATION_WORKERS or 2)",
    )
    parser.add_argument("--keep", action="store_true", help="reuse mutants/ and its verdicts")
    parser.add_argument("--min-rate", type=float, default=90.0, help="percent (default 90)")
    parser.add_argument(
        "--report-only", action="store_true", help="report the verdicts in mutants/, run nothing"
    )
    args = parser.parse_args()
    os.chdir(ROOT)
    started = time.monotonic()
    if not args.report_only:
        if not args.keep:
            shutil.rmtree(MUTANTS, ignore_errors=True)
        mutmut = Path(sys.executable).with_name("mutmut")
        run = subprocess.run([str(mutmut), "run", "--max-children", str(args.workers)], check=False)
        if run.returncode != 0:
            print(f"mutmut run failed (exit status {run.returncode})", file=sys.stderr)
            return run.returncode
    elapsed = time.monotonic() - started
    modules = _load()
    if not modules:
        print("no mutmut results in mutants/: run `make mutation`", file=sys.stderr)
        return 1
    equivalent, named = _equivalents()
    ok = _report(modules, equivalent, named, args.min_rate)
    if not args.report_only:
        print(f"\nwall-clock time: {elapsed / 60:.1f} min ({args.workers} workers)")
    return 0 if ok else 1


def _load() -> list[Module]:
    modules = []
    for meta in sorted(MUTANTS.rglob("*.py.meta")):
        data = json.loads(meta.read_text(encoding="utf-8"))
        path = str(meta.relative_to(MUTANTS)).removesuffix(".meta")
        modules.append(Module(path, data["exit_code_by_key"]))
    return modules


def _equivalents() -> tuple[set[str], set[str]]:
    """Mutant names docs/mutation.md explains as equivalent (those in its section
    "## Equivalent mutants", up to the next heading of that level), and all it names."""
    if not EQUIVALENTS.exists():
        return set(), set()
    text = EQUIVALENTS.read_text(encoding="utf-8")
    _, _, section = text.partition("\n## Equivalent mutants")
    equivalent = set(_MUTANT_NAME.findall(section.split("\n## ", 1)[0]))
    return equivalent, set(_MUTANT_NAME.findall(text))


def _report(modules: list[Module], equivalent: set[str], named: set[str], min_rate: float) -> bool:
    ok = True
    header = f"{'module':42} {'mutants':>7} {'killed':>6} {'hung':>5} {'surv.':>5}"
    header += f" {'no test':>7} {'equiv.':>6} {'rate':>7}"
    print("\n" + header)
    print("-" * len(header))
    known: set[str] = set()
    for m in modules:
        known.update(m.verdicts)
        counts = Counter(m.verdicts.values())
        hung = sum(counts[c] for c in _TIMEOUT)
        killed = len(m.detected()) - hung
        survived = sum(counts[c] for c in _SURVIVED)
        no_tests = sum(counts[c] for c in _NO_TESTS)
        equiv = sum(1 for k in m.missed() if k in equivalent)
        relevant = len(m.verdicts) - equiv
        rate = 100.0 * (killed + hung) / relevant if relevant else 100.0
        print(
            f"{m.path:42} {len(m.verdicts):7} {killed:6} {hung:5} {survived:5} {no_tests:7}"
            f" {equiv:6} {rate:6.1f}%"
        )
        if killed + hung == 0 and survived:
            print(f"  {m.path}: no mutant killed: did the tests import the mutated copy?")
            ok = False
        elif rate < min_rate:
            ok = False
    unexplained = [name for m in modules for name in m.unexplained(equivalent)]
    accepted = [name for name in unexplained if name in named]
    if accepted:
        print(f"\n{len(accepted)} survivor(s) docs/mutation.md explains as not equivalent:")
        for name in accepted:
            print(f"  {name}")
    new = [name for name in unexplained if name not in named]
    if new:
        print(f"\n{len(new)} survivor(s) docs/mutation.md does not explain (`mutmut show NAME`):")
        for name in new:
            print(f"  {name}")
    killed_listed = sorted(name for m in modules for name in m.detected() if name in equivalent)
    stale = sorted(equivalent - known) + killed_listed
    if stale:
        print("\nlisted as equivalent in docs/mutation.md but killed now, or gone: update it")
        for name in stale:
            print(f"  {name}")
    if not ok:
        print(f"\nbelow {min_rate:.0f}% of the non-equivalent mutants killed, or none killed")
    return ok


if __name__ == "__main__":
    sys.exit(main())
