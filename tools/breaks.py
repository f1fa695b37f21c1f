"""Deliberate breaks of the guarantees, each run against the tests that must catch it.

``make breaks`` copies the tree to a temporary directory once per break, applies the break
there (the work tree is never touched) and runs the break's tests; every break must make a
test fail. These are the breaks the guarantee tests were written against (docs/mutation.md,
"Hand-made breaks"): where mutation testing changes one token, each of these removes or
reorders a whole mechanism.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent


class Break(NamedTuple):
    """Replace ``old`` (found exactly once) by ``new`` in ``path``; ``tests`` must fail."""

    path: str
    old: str
    new: str
    tests: tuple[str, ...]


BREAKS: dict[str, Break] = {
    "arrival_order": Break(
        "deltaflow/server/dispatcher.py",
        "            while lane.failure is None and lane.next_seq in lane.pending:\n                seq = lane.next_seq\n",
        "            while lane.failure is None and lane.pending:\n                seq = lane.next_seq = next(iter(lane.pending))\n",
        (
            "tests/test_guarantees.py::test_every_key_is_applied_in_source_order_with_pipelined_batches_and_lost_requests",
            "tests/test_guarantees.py::test_every_key_of_a_table_ends_as_its_operations_applied_in_order",
        ),
    ),
    "arrival_order_table": Break(
        "deltaflow/server/dispatcher.py",
        "            while lane.failure is None and lane.next_seq in lane.pending:\n                seq = lane.next_seq\n",
        "            while lane.failure is None and lane.pending:\n                seq = lane.next_seq = next(iter(lane.pending))\n",
        (
            "tests/test_guarantees.py::test_every_key_of_a_table_ends_as_its_operations_applied_in_order",
        ),
    ),
    "buffered_not_reported": Break(
        "deltaflow/client/stream.py",
        "                    self.ledger.fail(positions, buffered)\n",
        "                    pass\n",
        (
            "tests/test_bad_input.py::test_client_never_sends_an_item_larger_than_a_batch",
            "tests/test_bad_input.py::test_items_that_cannot_be_encoded_are_named",
            "tests/test_policies.py",
            "tests/test_stream_errors.py",
            "tests/test_faults.py",
        ),
    ),
    "base_lane_not_started": Break(
        "deltaflow/server/dispatcher.py",
        "            if lane.task is None and lane.next_seq in lane.pending:\n                lane.task = self._spawn(self._run_lane(stream, p, lane))\n            return self._reply_error(",
        "            return self._reply_error(",
        ("tests/test_dispatcher.py::test_a_full_lane_that_base_moves_onto_a_waiting_batch_runs",),
    ),
    "needed_batch_refused": Break(
        "deltaflow/server/lanes.py",
        "            and seq != self.next_seq\n",
        "",
        ("tests/test_dispatcher.py::test_the_batch_a_full_lane_waits_for_is_not_refused",),
    ),
    "ack_before_durable": Break(
        "deltaflow/server/dispatcher.py",
        "            if ctx._durable:\n                await asyncio.gather(*ctx._durable)\n",
        "            pass\n",
        (
            "tests/test_guarantees.py::test_no_ack_leaves_while_its_commit_is_held",
            "tests/test_guarantees.py::test_a_batch_writing_two_tables_is_acked_only_once_both_commits_are_durable",
        ),
    ),
    "ack_after_first_table": Break(
        "deltaflow/server/dispatcher.py",
        "            if ctx._durable:\n                await asyncio.gather(*ctx._durable)\n",
        "            if ctx._durable:\n                await asyncio.wait(ctx._durable, return_when=asyncio.FIRST_COMPLETED)\n",
        (
            "tests/test_guarantees.py::test_a_batch_writing_two_tables_is_acked_only_once_both_commits_are_durable",
        ),
    ),
    "no_frame_check": Break(
        "deltaflow/client/connection.py",
        "        if len(data) > self.max_frame_bytes:\n",
        "        if False:\n",
        (
            "tests/test_guarantees.py::test_the_client_refuses_a_frame_over_the_nodes_limit_before_sending_it",
        ),
    ),
    "on_ack_error_ignored": Break(
        "deltaflow/client/stream.py",
        "                self.on_ack(applied.items)\n            except Exception as exc:  # noqa: BLE001 - the user's hook fails the stream\n                self._stop(exc)\n",
        "                self.on_ack(applied.items)\n            except Exception as exc:  # noqa: BLE001 - the user's hook fails the stream\n                pass\n",
        ("tests/test_guarantees.py::test_an_exception_from_a_hook_becomes_the_streams_cause",),
    ),
    "on_commit_error_ignored": Break(
        "deltaflow/client/stream.py",
        "                self.on_commit(position)\n            except Exception as exc:  # noqa: BLE001 - the user's hook fails the stream\n                self._stop(exc)\n",
        "                self.on_commit(position)\n            except Exception as exc:  # noqa: BLE001 - the user's hook fails the stream\n                pass\n",
        ("tests/test_guarantees.py::test_an_exception_from_a_hook_becomes_the_streams_cause",),
    ),
    "on_ack_for_dropped": Break(
        "deltaflow/client/stream.py",
        "            self._settle(batch)\n            return\n        self.dead_letters.send(batch, exc, reasons)\n",
        "            self._settle(batch)\n            if self.on_ack: self.on_ack(batch.items)\n            return\n        self.dead_letters.send(batch, exc, reasons)\n",
        ("tests/test_guarantees.py::test_on_ack_is_not_called_for_dropped_batches",),
    ),
    "dead_letter_limit": Break(
        "deltaflow/client/dead_letters.py",
        "[:2000]",
        "[:3000]",
        (
            "tests/test_guarantees.py::test_dead_letter_rows_carry_their_columns_and_a_bounded_error",
        ),
    ),
    "lane_bound": Break(
        "deltaflow/server/lanes.py",
        "len(self.pending) >= MAX_LANE_PENDING",
        "len(self.pending) >= MAX_LANE_PENDING + 1",
        (
            "tests/test_guarantees.py::test_a_lane_holds_at_most_64_waiting_batches_then_answers_overloaded",
        ),
    ),
    "results_kept": Break(
        "deltaflow/server/lanes.py",
        "while len(self.results) > RESULT_REPLAY_BATCHES:",
        "while len(self.results) > RESULT_REPLAY_BATCHES + 1:",
        (
            "tests/test_guarantees.py::test_results_of_the_last_1024_batches_of_a_lane_are_replayed_to_a_resend",
        ),
    ),
    "result_buffer_unbounded": Break(
        "deltaflow/client/results.py",
        "asyncio.Queue(maxsize=buffer)",
        "asyncio.Queue()",
        ("tests/test_guarantees.py::test_a_full_result_buffer_makes_its_reader_wait",),
    ),
    "no_one_by_one": Break(
        "deltaflow/tables/committer.py",
        "            for staged in group:\n                await self._commit_group([staged])\n            return\n",
        "            for staged in group:\n                settle(staged.future, exc)\n            return\n",
        ("tests/test_guarantees.py::test_a_group_whose_commit_fails_is_committed_write_by_write",),
    ),
    "dl_write_failure_ignored": Break(
        "deltaflow/client/dead_letters.py",
        "        self.ledger.fail(batch.positions, batch.items, [reason] * len(batch.items))\n        if not stopping:\n            self._stop(exc)\n",
        "        if not stopping:\n            self._stop(exc)\n",
        (
            "tests/test_guarantees.py::test_a_failed_dead_letter_write_fails_the_stream_listing_its_items",
        ),
    ),
}


def run(name: str, brk: Break) -> bool:
    """Whether the break's tests caught it."""
    with tempfile.TemporaryDirectory(prefix=f"deltaflow-break-{name}-") as tmp:
        tree = Path(tmp) / "tree"
        shutil.copytree(
            ROOT,
            tree,
            ignore=shutil.ignore_patterns(
                ".venv", "mutants", ".git", "__pycache__", ".*_cache", "bench"
            ),
        )
        target = tree / brk.path
        text = target.read_text()
        if text.count(brk.old) != 1:
            print(f"{name}: the code to break is not found once in {brk.path}; update the break")
            return False
        target.write_text(text.replace(brk.old, brk.new))
        # Run from the copy: pytest puts it first on sys.path, ahead of the editable install.
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *brk.tests],
            cwd=tree,
            capture_output=True,
            text=True,
            check=False,
        )
    last = (done.stdout.strip().splitlines() or ["(no output)"])[-1]
    caught = done.returncode == 1
    print(f"{name}: {'caught' if caught else 'MISSED'} ({last})", flush=True)
    return caught


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help=f"breaks to run (default: all {len(BREAKS)})")
    args = parser.parse_args()
    unknown = sorted(set(args.names) - set(BREAKS))
    if unknown:
        parser.error(f"unknown breaks {unknown}; known: {sorted(BREAKS)}")
    missed = [n for n in (args.names or BREAKS) if not run(n, BREAKS[n])]
    if missed:
        print(f"{len(missed)} break(s) not caught: {', '.join(missed)}")
        return 1
    print(f"every break caught ({len(args.names or BREAKS)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
