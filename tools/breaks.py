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
    "results_kept": Break(
        "deltaflow/server/lanes.py",
        "while len(self.results) > RESULT_REPLAY_BATCHES:",
        "while len(self.results) > RESULT_REPLAY_BATCHES + 1:",
        ("tests/test_dispatcher.py::test_results_are_kept_for_the_latest_batches_only",),
    ),
    "result_buffer_unbounded": Break(
        "deltaflow/client/results.py",
        "asyncio.Queue(maxsize=buffer)",
        "asyncio.Queue()",
        ("tests/test_guarantees.py::test_a_full_result_buffer_makes_its_reader_wait",),
    ),
    "no_one_by_one": Break(
        "deltaflow/tables/commit/owner.py",
        "            sent_back += await self._commit_group([staged], has_committer=has_committer)\n",
        "            settle(staged.future, exc)\n",
        ("tests/test_guarantees.py::test_a_group_whose_commit_fails_is_committed_write_by_write",),
    ),
    # A group's writes are isolated as the group was committed: the one that creates the
    # table goes on through the table's committer instead of failing as TableCreated.
    "isolated_creation_fails": Break(
        "deltaflow/tables/commit/owner.py",
        "            sent_back += await self._commit_group([staged], has_committer=has_committer)\n",
        "            sent_back += await self._commit_group([staged])\n",
        (
            "tests/test_table_bounds.py::test_a_badly_typed_batch_fails_alone_in_the_group_that_creates_its_table",
        ),
    ),
    # A node refuses a table past max_tables, and its peers' polls carry none of its tables.
    "max_tables_unchecked": Break(
        "deltaflow/tables/engine.py",
        "            self._check_room(table)\n",
        "",
        (
            "tests/test_table_bounds.py::test_a_stream_to_a_table_past_max_tables_is_refused_and_the_node_s_tables_go_on",
        ),
    ),
    "poll_answer_lists_tables": Break(
        "deltaflow/server/node.py",
        "self._peer_gate.answer(caller, self._cluster_body(tables=False))",
        "self._peer_gate.answer(caller, self._cluster_body())",
        (
            "tests/test_table_bounds.py::test_a_peer_s_poll_answer_keeps_its_size_whatever_the_node_writes",
        ),
    ),
    "dl_write_failure_ignored": Break(
        "deltaflow/client/dead_letters.py",
        "        self.ledger.fail(batch.positions, batch.items, [reason] * len(batch.items))\n        if not stopping:\n            self._stop(exc)\n",
        "        if not stopping:\n            self._stop(exc)\n",
        (
            "tests/test_guarantees.py::test_a_failed_dead_letter_write_fails_the_stream_listing_its_items",
        ),
    ),
    # A client that keeps a little of every batch it settled: memory that grows with the
    # stream's length (10 positions a batch, 1.6 MB over the test's 5,000,000 items).
    "client_memory_grows": Break(
        "deltaflow/client/sender.py",
        "    def _forget(self, batch: Batch) -> None:\n",
        "    def _forget(self, batch: Batch) -> None:\n        globals().setdefault('KEPT', []).append(batch.positions[:10])\n",
        ("tests/test_memory.py",),
    ),
    # The certificate checks TLS rests on, and deltaflow's own create-if-absent commit on a
    # store: breaks the suite once missed (issue 36, "The tests' blind spots").
    "client_hostname_unchecked": Break(
        "deltaflow/security.py",
        "        context.minimum_version = ssl.TLSVersion.TLSv1_2\n        if self.cert is not None and self.key is not None:\n",
        "        context.minimum_version = ssl.TLSVersion.TLSv1_2\n        context.check_hostname = False\n        if self.cert is not None and self.key is not None:\n",
        (
            "tests/test_tls_checks.py::test_a_client_refuses_a_node_whose_certificate_names_another_host",
        ),
    ),
    "peer_certificates_unverified": Break(
        "deltaflow/security.py",
        "        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.ca)\n        context.minimum_version = ssl.TLSVersion.TLSv1_2\n        context.load_cert_chain(self.cert, self.key)\n        return context\n",
        "        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.ca)\n        context.minimum_version = ssl.TLSVersion.TLSv1_2\n        context.load_cert_chain(self.cert, self.key)\n        context.check_hostname = False\n        context.verify_mode = ssl.CERT_NONE\n        return context\n",
        (
            "tests/test_tls_checks.py::test_a_node_admits_no_peer_whose_certificate_it_cannot_verify",
        ),
    ),
    "peer_hostname_unchecked": Break(
        "deltaflow/security.py",
        "        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.ca)\n        context.minimum_version = ssl.TLSVersion.TLSv1_2\n        context.load_cert_chain(self.cert, self.key)\n        return context\n",
        "        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.ca)\n        context.minimum_version = ssl.TLSVersion.TLSv1_2\n        context.load_cert_chain(self.cert, self.key)\n        context.check_hostname = False\n        return context\n",
        (
            "tests/test_tls_checks.py::test_a_node_admits_no_peer_whose_certificate_it_cannot_verify",
        ),
    ),
    # A table's committer: the marks and the files a group replaces are checked again.
    "committer_ignores_marks": Break(
        "deltaflow/tables/commit/committer.py",
        "            held = self.marks.applied\n",
        "            held = lambda lane, mark: False  # noqa: E731\n",
        (
            "tests/test_coordinator.py::test_a_late_committer_finds_the_group_applied",
            "tests/test_committer_cluster.py::test_a_paused_committer_s_late_commit_does_not_land",
        ),
    ),
    "committer_ignores_lane_starts": Break(
        "deltaflow/tables/commit/committer.py",
        "            some = [lane for lane, first in prepared.starts.items() if held(lane, first)]\n",
        "            some: list[str] = []\n",
        (
            "tests/test_coordinator.py::test_a_group_whose_lane_was_partly_applied_meanwhile_is_sent_back",
        ),
    ),
    "committer_one_lane_twice": Break(
        "deltaflow/tables/commit/committer.py",
        "            elif not applying.isdisjoint(prepared.lanes):\n",
        "            elif False:\n",
        ("tests/test_coordinator.py::test_two_groups_of_one_lane_in_a_commit_apply_it_once",),
    ),
    "commit_proof_ignores_payload": Break(
        "deltaflow/security.py",
        "    digest = hashlib.sha256(payload.encode()).hexdigest()\n",
        '    digest = hashlib.sha256(b"").hexdigest()\n',
        ("tests/test_peer_identity.py::test_a_commit_is_proven_in_headers_over_its_body",),
    ),
    # A peer cannot forge another (issue 47, findings 2, 5 and 6).
    "commit_body_read_before_proof": Break(
        "deltaflow/server/node.py",
        '        caller = await self._peer_gate.admit_unread(request, "commit", limit=limit)\n',
        '        caller = await self._peer_gate.admit(request, "commit", limit=limit)\n',
        (
            "tests/test_peer_identity.py::test_a_strangers_commit_body_is_refused_unread_and_memory_stays_bounded",
        ),
    ),
    "commit_unsigned": Break(
        "deltaflow/server/peer_gate.py",
        "        if op in SIGNED_OPS and self._keys is not None and not signed:\n",
        "        if False:\n",
        ("tests/test_peer_identity.py::test_the_peer_token_alone_cannot_commit_as_a_live_node",),
    ),
    "poll_answer_unsigned": Break(
        "deltaflow/server/topology.py",
        "            elif not m.signed and self._keys_checked and (self._signed_only or own):\n",
        "            elif False:\n",
        (
            "tests/test_peer_identity.py::test_a_token_holding_fake_answering_as_a_live_node_is_refused_and_owns_nothing",
        ),
    ),
    "other_warehouse_unheard": Break(
        "deltaflow/server/topology.py",
        "            and (m.signed or not self._signed_only or m.identity != self.identity)\n",
        "            and (m.signed or not self._signed_only)\n",
        (
            "tests/test_cluster_identity.py::test_with_a_peer_token_a_node_on_another_warehouse_still_refuses_itself",
        ),
    ),
    "poll_unsigned_accepted": Break(
        "deltaflow/server/peer_gate.py",
        "        if op in MEMBER_OPS and credentialed and self._keys is not None and not signed:\n",
        "        if False:\n",
        (
            "tests/test_peer_identity.py::test_an_unsigned_poll_claiming_a_node_is_refused_and_not_learned",
            "tests/test_roles.py::test_invented_peers_are_not_enrolled_and_learned_ones_are_capped",
            "tests/test_roles.py::test_a_leave_is_taken_only_from_the_leaving_node_itself",
        ),
    ),
    "committer_ignores_ownership": Break(
        "deltaflow/tables/commit/committer.py",
        "            if maps and prepared.writer != node:\n",
        "            if False:\n",
        ("tests/test_peer_identity.py::test_a_group_outside_its_writers_partitions_is_sent_back",),
    ),
    "encoded_paths_allowed": Break(
        "deltaflow/tables/commit/prepared.py",
        '    r"(?:_deltaflow_bucket=(?:0|[1-9][0-9]{0,5})/)?(?!.*\\.\\.)[A-Za-z0-9][A-Za-z0-9_.-]{0,250}\\.parquet"\n',
        '    r"(?!/)(?!.*(?:^|/)\\.\\.(?:/|$))[A-Za-z0-9_.=%/+-]{1,1000}"\n',
        ("tests/test_peer_identity.py::test_a_path_outside_the_tables_own_layout_is_refused",),
    ),
    "commit_call_any_table": Break(
        "deltaflow/tables/engine.py",
        "        if table not in self._committers and not await self.in_thread(\n",
        "        if False and not await self.in_thread(\n",
        ("tests/test_peer_identity.py::test_a_commit_is_proven_in_headers_over_its_body",),
    ),
    "committer_ignores_replaced_files": Break(
        "deltaflow/tables/commit/committer.py",
        "                reason = self.marks.changed_since(prepared.read_version, prepared.removes)\n",
        "                reason = None\n",
        (
            "tests/test_coordinator.py::test_a_group_whose_files_were_replaced_meanwhile_is_prepared_again",
        ),
    ),
    # A commit that cannot be read stops the marks before it; skipped, a batch it applied
    # would look new.
    "unreadable_commit_skipped": Break(
        "deltaflow/tables/commit_file.py",
        "    except ValueError as exc:  # not as a Delta writer writes it: no marks of ours in it\n",
        "    except (OSError, ValueError) as exc:\n",
        ("tests/test_marks.py::test_a_commit_that_cannot_be_read_is_read_next_time_not_skipped",),
    ),
    # A node that finds a table created as it creates it hands its rows to the committer
    # rather than racing it for the next versions.
    "creation_loser_races_committer": Break(
        "deltaflow/tables/commit/owner_writes.py",
        "                if self._has_committer:\n                    self.engine.stats.creation_races += 1\n",
        "                if False:\n                    self.engine.stats.creation_races += 1\n",
        (
            "tests/test_coordinator.py::test_a_writer_that_loses_a_table_s_creation_hands_its_rows_to_the_committer",
            "tests/test_store_cluster.py::test_three_writers_of_a_table_commit_through_its_committer_without_races",
        ),
    ),
    # A node's kept commit files are named by their whole URI: a version of another table is
    # never read in place of this one's.
    "kept_commit_of_another_table": Break(
        "deltaflow/tables/log.py",
        "    return str(commit)\n",
        "    return commit.name\n",
        (
            "tests/test_coordinator.py::test_a_group_whose_files_were_replaced_meanwhile_is_prepared_again",
            "tests/test_merge_on_read.py::test_merge_on_read_commits_racing_on_a_store_lose_nothing",
        ),
    ),
    "store_commit_overwrites": Break(
        "deltaflow/storage/paths.py",
        "    if isinstance(target, StorePath):\n        target.create(data)\n        return\n",
        "    if isinstance(target, StorePath):\n        target.write_bytes(data)\n        return\n",
        ("tests/test_merge_on_read.py::test_merge_on_read_commits_racing_on_a_store_lose_nothing",),
    ),
    "store_create_overwrites": Break(
        "deltaflow/storage/paths.py",
        'return dict(obstore.put(self._store, self._key, data, mode="create"))',
        'return dict(obstore.put(self._store, self._key, data, mode="overwrite"))',
        ("tests/test_merge_on_read.py::test_merge_on_read_commits_racing_on_a_store_lose_nothing",),
    ),
    # A group of no rows left (every change superseded) commits its marks, never MERGEs `IN ()`.
    # (The owner's early commit of such a group's marks is not a break of its own: every
    # engine's write of an empty group commits the marks alone too, and no test can tell.)
    "empty_bucket_list": Break(
        "deltaflow/tables/footprint.py",
        'on.append(f"t.{b} IN ({listed})" if listed else "FALSE")',
        'on.append(f"t.{b} IN ({listed})")',
        (
            "tests/test_emptied_tables.py::test_the_merge_condition_of_a_group_of_no_rows_matches_nothing",
        ),
    ),
    # Of writers creating a table at once, one does: version 0 is put create-if-absent.
    "create_overwrites": Break(
        "deltaflow/engines/delta_rs.py",
        "    commit_log_entry(path, 0, actions)\n",
        '    (delta_log_dir(path) / f"{0:020d}.json").write_text("".join(json.dumps(a) + "\\n" for a in actions))\n',
        ("tests/test_coordinator.py::test_of_writers_creating_a_table_at_once_exactly_one_does",),
    ),
    # A panic in delta-rs fails the write, never the task awaiting it.
    "panic_ends_the_task": Break(
        "deltaflow/engines/delta_rs.py",
        '        if not isinstance(exc, Exception) and type(exc).__name__ != "PanicException":\n',
        "        if not isinstance(exc, Exception):\n",
        (
            "tests/test_table_settings.py::test_a_null_in_a_not_null_column_fails_the_write_with_the_column_named",
        ),
    ),
    # A DataFrame's rows travel as its Arrow batches: the table gets its exact types.
    "dataframe_as_rows": Break(
        "deltaflow/spark_integration/dataframe.py",
        "        if streamer.columnar:\n",
        "        if False:\n",
        ("tests/test_spark_io.py::test_rows_become_wire_values_and_timestamps_keep_their_instant",),
    ),
    # An Arrow stream's dead letters travel as dead-letter rows, not as the failed page.
    "dead_letters_as_the_page": Break(
        "deltaflow/client/dead_letters.py",
        "            items=list(batch.items),\n",
        "            items=batch.items,\n",
        (
            "tests/test_spark_io.py::test_failed_rows_are_counted_per_partition_or_dead_lettered_and_read_back",
        ),
    ),
    # An Arrow page holds as many rows as fit, whatever batches they came in (replays).
    "arrow_byte_cut_by_slice": Break(
        "deltaflow/client/accumulator.py",
        "                take = min(take, end - 1 - offset)\n",
        "                take = 0 if buf.rows else min(take, end - 1 - offset)\n",
        (
            "tests/test_accumulator.py::test_arrow_batches_handed_over_together_make_the_pages_they_make_one_by_one",
        ),
    ),
    "noop_merge_commits_nothing": Break(
        "deltaflow/engines/delta_rs.py",
        "            if target.version() == before:\n",
        "            if False:\n",
        (
            "tests/test_emptied_tables.py::test_changes_older_than_the_deletes_that_emptied_a_table_are_superseded[delta-rs]",
        ),
    ),
    # Streams belong to the key that opened them; lanes take a bounded window.
    "stream_any_owner": Break(
        "deltaflow/server/streams.py",
        "        return self._streams.get((sid, owner)) if owner is not None else None\n",
        "        return next((s for (i, _), s in self._streams.items() if i == sid), None)\n",
        (
            "tests/test_stream_ownership.py::test_another_connection_can_neither_close_nor_feed_a_stream",
            "tests/test_dispatcher.py::test_the_same_id_under_another_key_is_a_stream_of_its_own",
        ),
    ),
    "marks_without_owner": Break(
        "deltaflow/receivers/base.py",
        '    owned = f"{owner}/" if owner else ""\n',
        '    owned = ""\n',
        (
            "tests/test_stream_ownership.py::test_a_replay_after_a_node_restart_is_not_skipped_for_an_intruders_marks",
            "tests/test_dispatcher.py::test_the_same_id_under_another_key_is_a_stream_of_its_own",
        ),
    ),
    "lane_window_unchecked": Break(
        "deltaflow/server/dispatcher.py",
        "        if not in_window(seq, base):\n",
        "        if False:\n",
        (
            "tests/test_stream_ownership.py::test_a_batch_outside_its_lanes_window_is_refused",
            "tests/test_dispatcher.py::test_a_lane_takes_only_batches_inside_its_window_above_base",
        ),
    ),
    "sender_past_window": Break(
        "deltaflow/client/sender.py",
        "            and seq < min(self._unacked[partition]) + LANE_WINDOW\n",
        "",
        (
            "tests/test_sender.py::test_no_batch_goes_a_lane_window_or_more_past_its_partitions_lowest_unsettled",
        ),
    ),
    "stream_key_random": Break(
        "deltaflow/client/stream_keys.py",
        "    return hmac.new(material, _LABEL + stream_id.encode(), hashlib.sha256).digest()\n",
        "    return secrets.token_bytes(STREAM_KEY_BYTES)\n",
        (
            "tests/test_stream_ownership.py::test_a_replay_after_a_client_restart_needs_the_same_id_and_key",
        ),
    ),
    "held_streams_evicted": Break(
        "deltaflow/server/streams.py",
        "        return self.holders == 0 and not any(\n",
        "        return not any(\n",
        ("tests/test_dispatcher.py::test_a_node_holds_at_most_max_streams_open",),
    ),
    "abandoned_streams_kept": Break(
        "deltaflow/server/streams.py",
        "            oldest = next((s for s in self._streams.values() if s.idle()), None)\n",
        "            oldest = None\n",
        (
            "tests/test_dispatcher.py::test_a_node_holds_at_most_max_streams_open",
            "tests/test_stream_ownership.py::test_streams_left_open_by_a_client_that_went_away_do_not_lock_others_out",
        ),
    ),
    "streams_unbounded": Break(
        "deltaflow/server/streams.py",
        "        if len(self._streams) >= MAX_STREAMS:\n            raise OverloadedError(\n",
        "        if False:\n            raise OverloadedError(\n",
        ("tests/test_dispatcher.py::test_a_node_holds_at_most_max_streams_open",),
    ),
    "handoff_ignores_later_sends": Break(
        "deltaflow/client/handoff.py",
        "        if out is not None and any(later > seq for later in out[1]):\n",
        "        if False:\n",
        (
            "tests/test_sender.py::test_a_batch_that_a_later_one_waits_for_goes_there_while_an_earlier_one_is_out",
        ),
    ),
    # Roles and peer proofs (docs/security.md, "Roles").
    "peer_answer_proof_not_compared": Break(
        "deltaflow/server/peers.py",
        "            return proof is not None and hmac.compare_digest(\n                proof, answer_proof(self._secret, nonce, data)\n            )\n",
        "            return proof is not None\n",
        (
            "tests/test_roles.py::test_a_wrong_proof_in_a_peers_answer_is_refused",
            "tests/test_roles.py::test_no_secret_reaches_an_address_in_peers_that_has_not_proven_itself",
        ),
    ),
    "answer_address_unchecked": Break(
        "deltaflow/server/topology.py",
        "            elif m.claimed is not None and m.claimed != m.address:\n",
        "            elif False:\n",
        (
            "tests/test_roles.py::test_a_relay_at_an_address_in_peers_cannot_pass_a_real_nodes_answers_off",
        ),
    ),
    "handshakes_per_address_uncapped": Break(
        "deltaflow/server/connection.py",
        " or from_remote >= MAX_UNAUTHENTICATED_PER_ADDRESS",
        "",
        (
            "tests/test_hostile_input.py::test_connections_still_in_their_handshake_are_capped_and_have_a_deadline",
            "tests/test_stranger_limits.py::test_a_stranger_past_the_handshake_caps_is_refused_before_the_upgrade",
        ),
    ),
    "upgrade_unchecked": Break(
        "deltaflow/server/connection.py",
        "    refusal = conn.stranger and handshake_refusal(connections, conn.remote, node.node_id)\n",
        "    refusal = None\n",
        (
            "tests/test_stranger_limits.py::test_a_stranger_past_the_handshake_caps_is_refused_before_the_upgrade",
            "tests/test_stranger_limits.py::test_strangers_first_messages_are_refused_unread_and_clients_stream_meanwhile",
        ),
    ),
    "first_message_unlimited": Break(
        "deltaflow/server/connection.py",
        "            self._read_limit.limit_reading(FIRST_MESSAGE_BYTES, self._first_message_overrun)\n",
        "            pass\n",
        (
            "tests/test_stranger_limits.py::test_a_stranger_may_send_a_few_kib_before_its_hello_passes",
            "tests/test_stranger_limits.py::test_strangers_first_messages_are_refused_unread_and_clients_stream_meanwhile",
        ),
    ),
    "token_client_counted": Break(
        "deltaflow/server/connection.py",
        "return not (self.proven or self.authenticated or self._refusing)",
        "return not (self.authenticated or self._refusing)",
        (
            "tests/test_stranger_limits.py::test_strangers_reopening_every_slot_never_lock_out_a_client_with_the_token",
        ),
    ),
    "no_header_timeout": Break(
        "deltaflow/server/listening.py",
        "        self._deadline = loop.call_later(self._gate.header_timeout, self._headers_overdue)\n",
        "        del loop\n",
        (
            "tests/test_stranger_limits.py::test_a_half_sent_request_is_closed_within_the_header_timeout",
        ),
    ),
    "no_connection_cap": Break(
        "deltaflow/server/listening.py",
        "        refusal = self._gate.admit(self, transport)\n        if refusal is not None:\n",
        "        refusal = self._gate.admit(self, transport)\n        if False:\n",
        (
            "tests/test_stranger_limits.py::test_open_connections_are_capped_per_node_and_per_address_at_accept",
            "tests/test_stranger_limits.py::test_open_connections_stay_below_the_open_file_limit",
        ),
    ),
    "caps_ignore_file_limit": Break(
        "deltaflow/server/listening.py",
        "        total = min(total, open_files - max(MIN_FILE_RESERVE, open_files // 4))\n",
        "        pass\n",
        ("tests/test_stranger_limits.py::test_open_connections_stay_below_the_open_file_limit",),
    ),
    "peer_call_proof_not_compared": Break(
        "deltaflow/server/peer_gate.py",
        "if not (isinstance(proof, str) and hmac.compare_digest(proof, expected)):",
        "if not isinstance(proof, str):",
        (
            "tests/test_roles.py::test_a_client_cannot_push_a_live_node_out_or_drain_one",
            "tests/test_roles.py::test_a_wrong_proof_in_a_call_is_refused_and_a_challenge_serves_once",
        ),
    ),
    "challenge_reusable": Break(
        "deltaflow/server/peer_gate.py",
        "            self._challenges.use(challenge)\n",
        "",
        (
            "tests/test_roles.py::test_a_wrong_proof_in_a_call_is_refused_and_a_challenge_serves_once",
        ),
    ),
    "drain_unguarded": Break(
        "deltaflow/server/node.py",
        'caller = await self._peer_gate.admit(request, "drain")',
        'caller = __import__("deltaflow.server.peer_gate").server.peer_gate.Caller("o", "h:0", "0" * 32)',
        (
            "tests/test_roles.py::test_a_client_cannot_push_a_live_node_out_or_drain_one",
            "tests/test_roles.py::test_under_mutual_tls_a_client_certificate_cannot_act_as_a_peer",
        ),
    ),
    "leave_unguarded": Break(
        "deltaflow/server/node.py",
        'caller = await self._peer_gate.admit(request, "leave")',
        'caller = __import__("deltaflow.server.peer_gate").server.peer_gate.Caller("n2", request.headers.get("X-Deltaflow-Peer", "@").split("@")[1] or "h:0", "0" * 32)',
        (
            "tests/test_roles.py::test_a_client_cannot_push_a_live_node_out_or_drain_one",
            "tests/test_roles.py::test_under_mutual_tls_a_client_certificate_cannot_act_as_a_peer",
        ),
    ),
    "status_unguarded": Break(
        "deltaflow/server/node.py",
        'caller = await self._peer_gate.admit(request, "status")',
        'caller = __import__("deltaflow.server.peer_gate").server.peer_gate.Caller("o", "h:0", "0" * 32)',
        ("tests/test_roles.py::test_under_mutual_tls_a_client_certificate_cannot_act_as_a_peer",),
    ),
    "leave_unconfirmed": Break(
        "deltaflow/server/topology.py",
        "        if not answer.draining:\n",
        "        if False:\n",
        ("tests/test_roles.py::test_a_leave_is_taken_only_from_the_leaving_node_itself",),
    ),
    "client_map_enrols_peers": Break(
        "deltaflow/server/node.py",
        "        return web.json_response(self._cluster_body())\n",
        '        peer = request.headers.get("X-Deltaflow-Peer", "")\n        if peer and self._membership is not None:\n            self._membership.observe(*peer.split("@", 1))\n        return web.json_response(self._cluster_body())\n',
        ("tests/test_roles.py::test_invented_peers_are_not_enrolled_and_learned_ones_are_capped",),
    ),
    "learned_peers_uncapped": Break(
        "deltaflow/server/topology.py",
        "            if learned >= MAX_LEARNED_PEERS:\n",
        "            if False:\n",
        ("tests/test_roles.py::test_invented_peers_are_not_enrolled_and_learned_ones_are_capped",),
    ),
    "token_without_tls_beyond_loopback": Break(
        "deltaflow/server/node_config.py",
        "        if (self.token or self.peer_token) and self.tls is None:\n",
        "        if False:\n",
        (
            "tests/test_roles.py::test_beyond_loopback_a_token_needs_tls_and_peers_a_credential_of_their_own",
        ),
    ),
    "empty_token_accepted": Break(
        "deltaflow/security.py",
        "    if not secret:\n        raise UsageError(",
        "    if secret is None:\n        raise UsageError(",
        ("tests/test_roles.py::test_an_empty_token_file_is_refused",),
    ),
    "table_name_prefix_match": Break(
        "deltaflow/names.py",
        "isinstance(name, str) and TABLE_NAME.fullmatch(name)",
        'isinstance(name, str) and re.match(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$", name)',
        ("tests/test_bad_input.py::test_a_table_name_with_a_trailing_newline_is_refused",),
    ),
    # The documented way to read a table back must not abort at exit (to_pyarrow_table does).
    "read_back_advice_aborts": Break(
        "docs/troubleshooting.md",
        'rows = pa.table(QueryBuilder().register("t", table).execute("SELECT * FROM t").read_all())',
        "rows = table.to_pyarrow_table()",
        ("tests/test_reading_back.py::test_the_documented_read_back_exits_cleanly_every_time",),
    ),
    # What a page says its example prints is what it prints: a stale claim fails the docs test.
    "docs_claim_an_output_never_printed": Break(
        "docs/cdc.md",
        "# [{'id': 1, 'lsn': 3, 'name': 'Ada L.'}]",
        "# [{'id': 1, 'lsn': 3, 'name': 'Ada (late)'}]",
        ("tests/test_docs_site.py::test_the_python_blocks_of_a_page_run[docs/cdc.md]",),
    ),
    # Delta's retention check: vacuum below the table's retention only when forced.
    "vacuum_without_retention_check": Break(
        "deltaflow/tables/maintenance.py",
        "        if not (dry_run or force):\n            _check_retention(",
        "        if False:\n            _check_retention(",
        (
            "tests/test_maintenance.py::test_vacuum_deletes_what_no_version_needs_and_keeps_deletion_vectors",
        ),
    ),
    # Errors say the cause in the system's words: a refused connection, an empty variable.
    "connect_failure_in_aiohttp_words": Break(
        "deltaflow/client/connection.py",
        "{connect_failure(exc)}",
        "{exc}",
        ("tests/test_stream_errors.py::test_a_failed_connect_says_why_in_the_systems_words",),
    ),
    "store_cause_unsaid": Break(
        "deltaflow/storage/conditional.py",
        "    connect = _CONNECT.search(text)\n",
        "    connect = None\n",
        ("tests/test_object_store.py::test_store_check_names_the_store_it_cannot_reach",),
    ),
    # The status page lists the tables this node wrote, not those a refusal never created.
    "status_lists_uncreated_tables": Break(
        "deltaflow/server/status.py",
        "            continue  # never created (its stream was refused): the errors say why\n",
        "            pass\n",
        ("tests/test_status_page.py::test_the_status_page_shows_the_cluster_tables_and_errors",),
    ),
    # A bad table name is the client's UsageError before a row is pulled, not the node's.
    "table_name_checked_late": Break(
        "deltaflow/client/client.py",
        "        if table is not None and (problem := table_name_problem(table)) is not None:\n",
        "        if False:\n",
        ("tests/test_bad_input.py::test_a_bad_table_name_is_refused_before_anything_is_sent",),
    ),
    # Rows without their key are quarantined by the client under on_bad_row="quarantine",
    # and not counted failed.
    "keyless_rows_fail_the_stream": Break(
        "deltaflow/client/admission.py",
        "        if keyless and self.quarantine is not None and not self._misnamed(1):\n",
        "        if False:\n",
        ("tests/test_bad_input.py::test_a_row_without_its_key_is_named_or_quarantined",),
    ),
    # A keyless row set aside costs no other row, at a chunk's or a page's end either.
    "keyless_row_takes_the_next_with_it": Break(
        "deltaflow/client/admission.py",
        "            return taken[bad + 1 :]\n",
        "            return taken[bad + 2 :]\n",
        (
            "tests/test_bad_input.py::test_rows_without_their_key_in_a_long_source_are_set_aside_where_they_stand",
        ),
    ),
    "unrouted_rows_counted_failed": Break(
        "deltaflow/client/stream.py",
        " + self.dead_letters.unrouted\n",
        "\n",
        ("tests/test_bad_input.py::test_a_row_without_its_key_is_named_or_quarantined",),
    ),
    # sequence_by: within a group the highest sequence of a key wins, not the last arrival.
    "sequence_last_arrival_wins": Break(
        "deltaflow/tables/commit/owner_state.py",
        "            return newest_per_key(data, self.key, self.sequence_by)\n",
        "            return last_per_key(data, self.key)\n",
        ("tests/test_cdc.py::test_changes_apply_by_sequence_and_deletes_stay_deleted[delta-rs]",),
    ),
    # ... against the table, a stored row of a sequence not lower stays (deltaflow's writers).
    "sequence_stored_row_ignored": Break(
        "deltaflow/tables/sequence.py",
        "    if group_sequence is None:\n        return hit, losers, group_of\n",
        "    if True:\n        return hit, losers, group_of\n",
        (
            "tests/test_cdc.py::test_changes_apply_by_sequence_and_deletes_stay_deleted[delta-rs-dv]",
            "tests/test_cdc.py::test_changes_apply_by_sequence_and_deletes_stay_deleted[spark]",
        ),
    ),
    # ... and in a MERGE (delta-rs's and Spark SQL's).
    "sequence_merge_ignored": Break(
        "deltaflow/tables/merging.py",
        "    newer = merge_condition(sequence, quote) if sequence else None\n",
        "    newer = None\n",
        ("tests/test_cdc.py::test_changes_apply_by_sequence_and_deletes_stay_deleted[delta-rs]",),
    ),
    "sequence_sql_merge_ignored": Break(
        "deltaflow/tables/merging.py",
        "    newer = merge_condition(sequence, quote) if sequence else None\n",
        "    newer = None\n",
        ("tests/test_cdc.py::test_changes_apply_by_sequence_and_deletes_stay_deleted[spark-sql]",),
    ),
    # A delete's tombstone keeps an older change arriving later from bringing the key back...
    "tombstones_ignored": Break(
        "deltaflow/tables/sequence.py",
        "        if not self._held or not data.num_rows:\n",
        "        if True:\n",
        ("tests/test_cdc.py::test_changes_apply_by_sequence_and_deletes_stay_deleted[delta-rs]",),
    ),
    # ... also on a node that starts later: the deletes are recorded in the commits.
    "tombstones_not_recorded": Break(
        "deltaflow/tables/marks.py",
        '        if deleted:\n            meta["deleted"] = deleted\n',
        '        if False:\n            meta["deleted"] = deleted\n',
        ("tests/test_cdc.py::test_changes_apply_by_sequence_and_deletes_stay_deleted[delta-rs]",),
    ),
    # ... and on the node that takes a SIGKILLed node's partitions: the deletes it recorded.
    "tombstones_lost_at_a_failover": Break(
        "deltaflow/tables/marks.py",
        "            if deleted is not None and self.tombstones is not None:\n",
        "            if False:\n",
        ("tests/test_failover.py::test_a_change_feed_through_a_sigkill_ends_at_the_source",),
    ),
    # The same on a cluster: producers out of order, nodes of both engines, a committer.
    "sequence_ignored_on_a_cluster": Break(
        "deltaflow/tables/sequence.py",
        "    if group_sequence is None:\n        return hit, losers, group_of\n",
        "    if True:\n        return hit, losers, group_of\n",
        (
            "tests/test_cdc_cluster.py::test_three_producers_out_of_order_end_at_the_highest_sequence",
        ),
    ),
    "tombstones_ignored_on_a_cluster": Break(
        "deltaflow/tables/sequence.py",
        "        if not self._held or not data.num_rows:\n",
        "        if True:\n",
        (
            "tests/test_cdc_cluster.py::test_three_producers_out_of_order_end_at_the_highest_sequence",
        ),
    ),
    # A table stream without a key routes each item by its bytes: a replay of the same input
    # cuts the same batches, and its lane marks skip what the first run applied.
    "append_routing_not_replayable": Break(
        "deltaflow/client/admission.py",
        "                parts = [zlib.crc32(data) % partitions for data in packed]\n",
        "                parts = [hash(object()) % partitions for data in packed]\n",
        (
            "tests/test_cdc_cluster.py::test_a_table_stream_without_a_key_appends_once_under_resends_and_a_replay",
        ),
    ),
    # Merge modes: a change merges with the stored row of its key (deltaflow's writers)...
    "merge_mode_ignored_against_the_table": Break(
        "deltaflow/tables/rewrite.py",
        "            if rule.folds and replaced.any():  # the stored rows the group merges with\n",
        "            if False:\n",
        ("tests/test_cdc.py::test_merge_modes_partial_first_and_aggregate[spark]",),
    ),
    # ... and within a group a key's changes fold.
    "merge_mode_not_folded": Break(
        "deltaflow/tables/commit/owner_state.py",
        "        if rule.folds:\n            return fold(data, self.key, self.sequence_by, rule)\n",
        "        if False:\n            return fold(data, self.key, self.sequence_by, rule)\n",
        ("tests/test_cdc.py::test_merge_modes_partial_first_and_aggregate[delta-rs]",),
    ),
    # A history table rebuilds a key's versions from the stored ones and the group's changes.
    "history_forgets_stored_versions": Break(
        "deltaflow/tables/history.py",
        "    for row in stored.to_pylist():\n        k = row[key]\n",
        "    for row in stored.to_pylist()[:0]:\n        k = row[key]\n",
        (
            "tests/test_cdc.py::test_a_history_table_keeps_every_version_and_slots_late_changes_in[delta-rs-dv]",
        ),
    ),
    # A quarantined row is left out alone: the rest of its batch applies.
    "quarantine_fails_the_batch": Break(
        "deltaflow/receivers/table.py",
        '        bad_rows = ctx.fail if args.get("on_bad_row") == "quarantine" else None\n',
        "        bad_rows = None\n",
        (
            "tests/test_cdc_cluster.py::test_quarantined_rows_go_to_the_dead_letters_and_their_batches_apply",
        ),
    ),
    # A null set on purpose replaces the stored value of a partial table.
    "set_null_keeps_the_stored_value": Break(
        "deltaflow/tables/merging.py",
        "            if explicit:  # set to null on purpose: null\n",
        "            if False:\n",
        ("tests/test_cdc.py::test_merge_modes_partial_first_and_aggregate[delta-rs-dv]",),
    ),
    # A row breaking a CHECK constraint is named when its batch is staged (and quarantined).
    "constraints_left_to_the_commit": Break(
        "deltaflow/tables/engine.py",
        '        if constraints and settings.merge == "last" and settings.history == "none":\n',
        "        if False:\n",
        (
            "tests/test_cdc.py::test_a_row_breaking_a_check_constraint_is_named_when_staged[delta-rs]",
        ),
    ),
    "config_precedence": Break(
        "deltaflow/server/config_layers.py",
        '    layers.append(("env", _from_env(env, problems)))\n    if flags is not None:\n        layers.append(("flag", _from_flags(flags, problems)))\n',
        '    if flags is not None:\n        layers.append(("flag", _from_flags(flags, problems)))\n    layers.append(("env", _from_env(env, problems)))\n',
        ("tests/test_config.py::test_flags_win_over_the_environment_which_wins_over_the_file",),
    ),
    "config_secret_shown": Break(
        "deltaflow/server/config_layers.py",
        "        return {k: MASK if is_secret_option(k) else v for k, v in value.items()}\n",
        "        return dict(value)\n",
        ("tests/test_config.py::test_secrets_are_masked_and_never_taken_from_the_command_line",),
    ),
    "config_secret_flag": Break(
        "deltaflow/server/config_layers.py",
        '                if s.kind == "map" and any(is_secret_option(k) for k in parsed):\n',
        "                if False:\n",
        ("tests/test_config.py::test_secrets_are_masked_and_never_taken_from_the_command_line",),
    ),
    "config_unknown_key": Break(
        "deltaflow/server/config_layers.py",
        '        problems.append(f"{where}: unknown key{_suggest(key, BY_KEY)}")\n',
        "        pass\n",
        ("tests/test_config.py::test_config_check_lists_every_problem_with_exit_78",),
    ),
    "ready_before_side_inputs": Break(
        "deltaflow/server/node.py",
        '            ready.mark("engine")\n',
        '            ready.mark("engine")\n            ready.mark("side_inputs")\n',
        ("tests/test_probes.py::test_a_starting_node_is_alive_but_not_ready_until_it_can_serve",),
    ),
    "ready_while_draining": Break(
        "deltaflow/server/probes.py",
        '        return self.state == "running" and all(self.passed.values()) and self.serving()\n',
        "        return all(self.passed.values())\n",
        ("tests/test_probes.py::test_a_draining_node_is_not_ready_and_its_peer_is",),
    ),
    "table_metrics_unlabelled": Break(
        "deltaflow/tables/commit/owner.py",
        "        for counted in (stats, table):\n",
        "        for counted in (stats,):\n",
        ("tests/test_observability.py::test_metrics_say_what_each_table_and_receiver_did",),
    ),
    "drain_logged_as_warning": Break(
        "deltaflow/server/node.py",
        "level=logging.WARNING if owned else logging.INFO",
        "level=logging.WARNING",
        ("tests/test_observability.py::test_a_node_logs_its_life_as_json_events",),
    ),
    "exit_through_teardown": Break(
        "deltaflow/cli_output.py",
        "    os._exit(code)\n",
        "    sys.exit(code)\n",
        ("tests/test_cli.py::test_leaving_survives_a_table_read_abandoned_mid_scan",),
    ),
    "broken_pipe_traceback": Break(
        "deltaflow/cli.py",
        "    except BrokenPipeError:  # `deltaflow table history | head`: the reader had enough\n",
        "    except ZeroDivisionError:\n",
        ("tests/test_cli.py::test_a_closed_pipe_ends_the_command_quietly",),
    ),
    "internal_columns_shown": Break(
        "deltaflow/cli_table.py",
        "if args.all_columns or not _internal(c)]",
        "if True]",
        ("tests/test_cli.py::test_table_commands_print_json",),
    ),
    "drained_node_shown_dead": Break(
        "deltaflow/server/topology.py",
        "            return PeerState.DRAINING if recent else PeerState.LEFT\n",
        "            return PeerState.DRAINING if recent else PeerState.DEAD\n",
        ("tests/test_cli.py::test_table_commands_print_json",),
    ),
    "status_page_markup": Break(
        "deltaflow/server/status_page/status.js",
        "  if (text !== undefined && text !== null) node.textContent = String(text);\n",
        "  if (text !== undefined && text !== null) node.innerHTML = String(text);\n",
        ("tests/test_status_page.py::test_a_table_name_with_markup_stays_text",),
    ),
    "log_values_unquoted": Break(
        "deltaflow/logs.py",
        '    if text and text.isprintable() and " " not in text and \'"\' not in text:\n',
        '    if text and " " not in text:\n',
        (
            "tests/test_operator_surfaces.py::test_wire_values_cannot_forge_a_log_line",
            "tests/test_operator_surfaces.py::test_every_control_character_is_escaped_in_text_logs_and_json_keeps_the_value",
        ),
    ),
    "log_message_unescaped": Break(
        "deltaflow/logs.py",
        "        line.msg, line.args = printable(record.getMessage()), None\n",
        "        line.msg, line.args = record.getMessage(), None\n",
        (
            "tests/test_operator_surfaces.py::test_every_control_character_is_escaped_in_text_logs_and_json_keeps_the_value",
        ),
    ),
    "cli_prints_markup": Break(
        "deltaflow/cli_output.py",
        "        table.add_row(*(Text(plain(v)) for v in row), style=style)\n",
        '        table.add_row(*("" if v is None else str(v) for v in row), style=style)\n',
        ("tests/test_operator_surfaces.py::test_table_show_prints_any_row_literally",),
    ),
    "history_trusts_commit_info": Break(
        "deltaflow/tables/maintenance.py",
        '                "time": _time(info.get("timestamp")),\n',
        '                "time": datetime.datetime.fromtimestamp(int(info["timestamp"]) / 1000, datetime.UTC),\n',
        ("tests/test_operator_surfaces.py::test_table_history_survives_any_commit_info",),
    ),
    "dead_letter_json_not_strict": Break(
        "deltaflow/receivers/dead_letter.py",
        "        return json.dumps(_jsonable(item), ensure_ascii=False, allow_nan=False)\n",
        "        return json.dumps(item, default=_text, ensure_ascii=False)\n",
        ("tests/test_input_isolation.py::test_dead_letters_store_any_wire_value_as_strict_json",),
    ),
    "debezium_truncate_ends_the_stream": Break(
        "deltaflow/client/changelog.py",
        "        elif isinstance(op, str) and op in _SKIPPED_OPS:\n            self.skipped.note(op, position)\n            return None\n",
        "",
        (
            "tests/test_input_isolation.py::test_debezium_truncate_and_message_events_are_skipped_and_the_stream_goes_on",
        ),
    ),
    "token_file_mode_unchecked": Break(
        "deltaflow/security.py",
        '    if os.name == "posix" and mode & 0o077:\n',
        '    if os.name == "posix" and mode & 0o000:\n',
        (
            "tests/test_operator_surfaces.py::test_a_token_file_others_can_read_is_used_with_a_warning",
        ),
    ),
    "status_without_token": Break(
        "deltaflow/server/status.py",
        '        if not node.check_token(header[7:] if header.startswith("Bearer ") else None):\n',
        "        if False:\n",
        ("tests/test_status_page.py::test_the_status_page_shows_the_cluster_tables_and_errors",),
    ),
    "jvm_noise_shown": Break(
        "deltaflow/spark_integration/session.py",
        '_JVM_NOISE: Final = (b"WARNING: Using incubator modules",)\n',
        '_JVM_NOISE: Final = (b"never printed",)\n',
        ("tests/test_demo.py",),
    ),
    "receiver_not_awaited": Break(
        "deltaflow/client/stream.py",
        "        if not self.receiver.startswith(BUILT_IN_RECEIVERS):\n",
        "        if False:\n",
        ("tests/test_receiver_rollout.py",),
    ),
    "starting_peer_not_down": Break(
        "deltaflow/server/topology.py",
        "        if silence not in (Silence.REFUSED, Silence.STARTING):\n",
        "        if silence is not Silence.REFUSED:\n",
        (
            "tests/test_probes.py::test_a_node_restarted_at_its_address_is_counted_down_while_it_starts",
        ),
    ),
    "peer_receivers_unbounded": Break(
        "deltaflow/server/peers.py",
        "        for name in given[:MAX_PEER_RECEIVERS]\n",
        "        for name in given\n",
        ("tests/test_receiver_rollout.py::test_a_peers_receiver_list_is_bounded",),
    ),
    "levels_searched_at_one_level": Break(
        "deltaflow/tables/footprint.py",
        "        if bucketed and levels is not None:\n",
        "        if bucketed and levels is not None and False:\n",
        ("tests/test_layout.py::test_a_growing_table_finds_every_key_at_any_level",),
    ),
    "levels_merged_rows_not_moved": Break(
        "deltaflow/tables/merging.py",
        "    if moved:\n",
        "    if moved and False:\n",
        ("tests/test_layout.py::test_a_growing_table_finds_every_key_at_any_level",),
    ),
    "lane_dies_on_a_bug": Break(
        "deltaflow/server/dispatcher.py",
        "                except Exception as exc:  # noqa: BLE001 - every batch gets an answer\n",
        "                except ServerError as exc:\n",
        (
            "tests/test_dispatcher.py::test_a_bug_outside_the_receiver_answers_its_batch_and_the_lane_goes_on",
        ),
    ),
    "stale_poll_undoes_a_drain": Break(
        "deltaflow/server/members.py",
        "    if asked < member.asked:\n",
        "    if False:\n",
        ("tests/test_handover.py::test_an_answer_from_before_a_drain_does_not_undo_the_drain",),
    ),
    "del_entries_unchecked": Break(
        "deltaflow/server/frames.py",
        "    if any(not isinstance(i, int) or not 0 <= i < len(items) for i in deletes):\n",
        "    if any(isinstance(i, int) and not 0 <= i < len(items) for i in deletes):\n",
        (
            "tests/test_dispatcher.py::test_a_batch_frame_that_makes_no_sense_is_refused_as_a_bad_frame",
        ),
    ),
    # Lane marks a checkpoint carries (txn actions): a node that starts from the checkpoint
    # still skips a replay whose commits are gone.
    "txn_marks_not_written_by_the_committer": Break(
        "deltaflow/tables/commit/committer.py",
        "            actions += self.marks.carrying(lanes, forgotten)  # where a checkpoint keeps them\n",
        "",
        (
            "tests/test_long_lived_tables.py::test_a_cluster_restarted_on_a_checkpointed_table_skips_a_replay",
        ),
    ),
    "txn_marks_not_written_by_an_owner": Break(
        "deltaflow/tables/commit/owner_writes.py",
        "                self.marks.carrying(lanes),\n",
        "                [],\n",
        (
            "tests/test_long_lived_tables.py::test_a_replay_after_a_restart_is_skipped_when_its_marks_are_only_in_a_checkpoint[upsert-delta-rs]",
            "tests/test_long_lived_tables.py::test_a_replay_after_a_restart_is_skipped_when_its_marks_are_only_in_a_checkpoint[upsert-spark]",
        ),
    ),
    "sql_writer_marks_not_carried": Break(
        "deltaflow/engines/spark.py",
        "        if group.transactions:\n            self._carry_marks(group)\n",
        "",
        (
            "tests/test_long_lived_tables.py::test_a_replay_after_a_restart_is_skipped_when_its_marks_are_only_in_a_checkpoint[upsert-spark-sql]",
        ),
    ),
    # A checkpoint of a table written before txn marks carries none of its marks.
    "any_checkpoint_trusted": Break(
        "deltaflow/tables/marks.py",
        "        if not pc.any(pc.equal(apps, CARRIED_APP)).as_py():\n",
        "        if False:\n",
        (
            "tests/test_long_lived_tables.py::test_a_table_written_before_txn_marks_is_read_whole_and_carried_once",
        ),
    ),
    # A commitInfo mark no txn carries (the SQL writer's) must reach the next commit's txns.
    "uncarried_marks_forgotten": Break(
        "deltaflow/tables/marks.py",
        "                self._uncarried[lane] = mark\n",
        "                pass\n",
        (
            "tests/test_long_lived_tables.py::test_a_starting_node_reads_the_checkpoint_and_the_commits_from_it_on",
        ),
    ),
    "checkpoint_commit_not_read": Break(
        "deltaflow/tables/marks.py",
        "        self._scanned = version - 1\n",
        "        self._scanned = version\n",
        (
            "tests/test_long_lived_tables.py::test_a_starting_node_reads_the_checkpoint_and_the_commits_from_it_on",
        ),
    ),
    # Memory bounded by retention, and a stream's lanes kept for theirs.
    "lanes_never_expire": Break(
        "deltaflow/tables/marks.py",
        "        if clock - self._expiry_checked < _EXPIRY_CHECK:\n            return\n",
        "        if True:\n            return\n",
        (
            "tests/test_long_lived_tables.py::test_idle_lanes_leave_memory_after_their_retention_and_not_before",
        ),
    ),
    "stream_lanes_expire_as_random_ones": Break(
        "deltaflow/tables/mark_store.py",
        "                if now - (held & MINUTES) <= (random if lane.startswith(prefix) else durable)\n",
        "                if now - (held & MINUTES) <= random\n",
        (
            "tests/test_long_lived_tables.py::test_idle_lanes_leave_memory_after_their_retention_and_not_before",
        ),
    ),
    "random_ids_not_marked": Break(
        "deltaflow/receivers/base.py",
        "    return f\"{RANDOM_LANE_PREFIX if random else ''}{stream_id}/{owned}{partition}\"\n",
        '    return f"{stream_id}/{owned}{partition}"\n',
        (
            "tests/test_long_lived_tables.py::test_a_cluster_restarted_on_a_checkpointed_table_skips_a_replay",
        ),
    ),
    # A table's log is read from its last checkpoint and probed by name, never listed whole.
    "log_listed_whole": Break(
        "deltaflow/tables/log.py",
        "    if after < 0:\n        last = None if every else last_checkpoint_version(directory)\n",
        "    if True:\n        return _listed(directory, after)\n    if after < 0:\n"
        "        last = None if every else last_checkpoint_version(directory)\n",
        (
            "tests/test_long_lived_tables.py::test_a_node_finds_new_commits_by_name_and_never_lists_a_long_log",
        ),
    ),
    # One store of marks per table on a node: a mark only rises, a checkpoint is read once.
    "store_lowers_a_mark": Break(
        "deltaflow/tables/mark_store.py",
        "            if held is None or version >= held >> MINUTE_BITS:\n",
        "            if True:\n",
        (
            "tests/test_long_lived_tables.py::test_a_node_s_readers_of_a_table_share_one_mark_per_lane",
        ),
    ),
    "checkpoint_marks_read_per_reader": Break(
        "deltaflow/tables/marks.py",
        "        txns = self.store.checkpoint != version and self.store.through < version\n",
        "        txns = True\n",
        (
            "tests/test_long_lived_tables.py::test_a_node_s_readers_of_a_table_share_one_mark_per_lane",
        ),
    ),
    # A sequence_by table's tombstones are snapshotted, so a start after the log's clean-up
    # still drops changes older than its deletes.
    "tombstones_not_snapshotted": Break(
        "deltaflow/tables/marks.py",
        "            write_snapshot(self._table, self._scanned, self.tombstones)\n",
        "            pass\n",
        (
            "tests/test_long_lived_tables.py::test_tombstones_hold_across_a_restart_whose_log_before_a_checkpoint_is_gone",
        ),
    ),
    "tombstone_snapshot_trusted": Break(
        "deltaflow/tables/tombstone_snapshots.py",
        "        if not isinstance(data, dict):\n            continue\n",
        "",
        (
            "tests/test_long_lived_tables.py::test_a_snapshot_keeps_every_tombstone_with_its_time_and_only_the_newest_two_stay",
        ),
    ),
    "tombstone_snapshot_not_read": Break(
        "deltaflow/tables/marks.py",
        "        snapshot = newest_snapshot(self._table) if self.tombstones is not None else None\n",
        "        snapshot = None\n",
        (
            "tests/test_long_lived_tables.py::test_tombstones_hold_across_a_restart_whose_log_before_a_checkpoint_is_gone",
        ),
    ),
    # A node's marks follow the streams open: a closed random id's lanes go, for good.
    "random_marks_kept_after_close": Break(
        "deltaflow/server/dispatcher.py",
        "        if stream.random and stream.tables and self._writer is not None:\n",
        "        if False:\n",
        (
            "tests/test_long_lived_tables.py::test_a_node_forgets_a_random_id_s_marks_when_its_client_closes_the_stream",
        ),
    ),
    "lanes_forgotten_in_every_table": Break(
        "deltaflow/tables/engine.py",
        "        for table in tables:\n            store = self.mark_stores.get(self.warehouse / table)\n",
        "        for table in {p.name for p in self.mark_stores._stores}:\n"
        "            store = self.mark_stores.get(self.warehouse / table)\n",
        (
            "tests/test_long_lived_tables.py::test_a_node_forgets_a_random_id_s_marks_when_its_client_closes_the_stream",
        ),
    ),
    "forgotten_lanes_kept_again": Break(
        "deltaflow/tables/mark_store.py",
        "            if forgotten and lane in forgotten:\n                continue\n",
        "",
        (
            "tests/test_long_lived_tables.py::test_a_node_forgets_a_random_id_s_marks_when_its_client_closes_the_stream",
            "tests/test_long_lived_tables.py::test_a_lane_forgotten_for_good_is_not_kept_again_by_a_late_reader",
        ),
    ),
    # A new committer whose store read past a newer checkpoint does not read its marks again.
    "covered_checkpoint_read_again": Break(
        "deltaflow/tables/marks.py",
        "        txns = self.store.checkpoint != version and self.store.through < version\n",
        "        txns = self.store.checkpoint != version\n",
        (
            "tests/test_long_lived_tables.py::test_a_node_s_readers_of_a_table_share_one_mark_per_lane",
        ),
    ),
    # A description read once holds across commits that change no metadata.
    "description_reloaded_every_version": Break(
        "deltaflow/tables/log_reader.py",
        "            if not _metadata_changed(path, kept[0], latest):\n",
        "            if False:\n",
        (
            "tests/test_long_lived_tables.py::test_a_description_holds_across_commits_that_change_no_metadata",
        ),
    ),
    "description_kept_across_a_schema_change": Break(
        "deltaflow/tables/log_reader.py",
        '        if any(line.startswith(TABLE_CHANGES) for line in text.split("\\n")):\n',
        "        if False:\n",
        (
            "tests/test_long_lived_tables.py::test_a_description_holds_across_commits_that_change_no_metadata",
        ),
    ),
    # A closed random-id stream's lanes are forgotten in the log: Delta drops their txn.
    "forgotten_lanes_not_logged": Break(
        "deltaflow/tables/marks.py",
        "            if lane not in marks and lane.startswith(RANDOM_LANE_PREFIX)\n",
        "            if False\n",
        (
            "tests/test_long_lived_tables.py::test_a_commit_that_forgets_a_lane_makes_every_reader_forget_it",
            "tests/test_long_lived_tables.py::test_a_closed_random_streams_marks_leave_the_log_and_its_checkpoints",
        ),
    ),
    "named_lanes_forgotten_in_the_log": Break(
        "deltaflow/tables/marks.py",
        "            if lane not in marks and lane.startswith(RANDOM_LANE_PREFIX)\n",
        "            if lane not in marks\n",
        (
            "tests/test_long_lived_tables.py::test_a_commit_that_forgets_a_lane_makes_every_reader_forget_it",
        ),
    ),
    "forgetting_txn_read_as_a_mark": Break(
        "deltaflow/tables/commit_file.py",
        '                if app.startswith(TXN_PREFIX) and txn.get("lastUpdated") == FORGOTTEN_AT:\n',
        "                if False:\n",
        (
            "tests/test_long_lived_tables.py::test_a_commit_that_forgets_a_lane_makes_every_reader_forget_it",
        ),
    ),
    "writers_forget_only_locally": Break(
        "deltaflow/tables/commit/owner_writes.py",
        "            forgotten=tuple(self.marks.store.unlogged()),\n",
        "            forgotten=(),\n",
        (
            "tests/test_long_lived_tables.py::test_a_closed_random_streams_marks_leave_the_log_and_its_checkpoints",
        ),
    ),
    "committer_ignores_writers_forgotten": Break(
        "deltaflow/tables/commit/committer.py",
        "            actions += self.marks.carrying(lanes, forgotten)",
        "            actions += self.marks.carrying(lanes)",
        (
            "tests/test_long_lived_tables.py::test_a_closed_random_streams_marks_leave_the_log_and_its_checkpoints",
        ),
    ),
    "foreign_lanes_forgotten": Break(
        "deltaflow/tables/commit/ownership.py",
        "    return [f[0] for f in found if f is not None and int(f[1]) in owned]\n",
        "    return [f[0] for f in found if f is not None]\n",
        (
            "tests/test_coordinator.py::test_a_committer_forgets_only_the_lanes_of_the_writers_own_partitions",
        ),
    ),
    "durable_lanes_forgettable_on_the_wire": Break(
        "deltaflow/tables/commit/prepared.py",
        "        if not lane.startswith(RANDOM_LANE_PREFIX):\n",
        "        if False:\n",
        (
            "tests/test_coordinator.py::test_a_malformed_prepared_commit_is_refused_naming_the_field",
        ),
    ),
    # A table kept open for months is opened afresh from a newer checkpoint.
    "kept_table_never_reopened": Break(
        "deltaflow/tables/log_reader.py",
        "        if checkpoint is not None and checkpoint > opened:\n",
        "        if False:\n",
        (
            "tests/test_long_lived_tables.py::test_a_table_kept_open_is_opened_afresh_from_a_newer_checkpoint",
        ),
    ),
    "last_checkpoint_read_every_commit": Break(
        "deltaflow/tables/log_reader.py",
        "        if latest < look:\n",
        "        if False:\n",
        (
            "tests/test_long_lived_tables.py::test_a_table_kept_open_is_opened_afresh_from_a_newer_checkpoint",
        ),
    ),
    # Lanes waiting to be forgotten in the log are held no longer than forgotten ones.
    "unlogged_lanes_held_for_ever": Break(
        "deltaflow/tables/mark_store.py",
        "            self._unlogged.pop(lane, None)\n",
        "",
        (
            "tests/test_long_lived_tables.py::test_a_lane_forgotten_for_good_is_not_kept_again_by_a_late_reader",
        ),
    ),
    # A failed call to a peer makes its peers poll it at once, not at the next heartbeat.
    "failed_calls_not_hinted": Break(
        "deltaflow/server/topology.py",
        "            self._hinted = now\n            self._wake.set()\n",
        "            self._hinted = now\n",
        (
            "tests/test_quick_failover.py::test_a_client_that_cannot_reach_a_killed_node_makes_its_peer_take_over",
            "tests/test_quick_failover.py::test_a_failed_commit_call_makes_the_writer_take_over_from_a_killed_committer",
        ),
    ),
    "client_does_not_name_unreachable": Break(
        "deltaflow/client/router.py",
        "            self._unreachable = address\n",
        "",
        (
            "tests/test_quick_failover.py::test_a_client_that_cannot_reach_a_killed_node_makes_its_peer_take_over",
        ),
    ),
    "commit_call_not_hinted": Break(
        "deltaflow/server/commits.py",
        "                    self._on_failed_call(address)\n",
        "                    pass\n",
        (
            "tests/test_quick_failover.py::test_a_failed_commit_call_makes_the_writer_take_over_from_a_killed_committer",
        ),
    ),
    # Compaction by the committer rewrites exactly the rows the files' vectors keep, and
    # removes what it rewrote.
    "compaction_ignores_vectors": Break(
        "deltaflow/tables/commit/compaction.py",
        '        vector = f["deletionVector"]\n        if vector is None:\n',
        "        vector = None\n        if vector is None:\n",
        (
            "tests/test_compaction.py::test_the_committer_compacts_small_files_beside_three_writers[delta-rs-dv]",
        ),
    ),
    "compaction_keeps_the_old_files": Break(
        "deltaflow/tables/commit/compaction.py",
        '            actions.append(_unchanged(remove_action(gone, now, f["deletionVector"])))\n',
        "            pass\n",
        (
            "tests/test_compaction.py::test_the_committer_compacts_small_files_beside_three_writers[delta-rs]",
        ),
    ),
    "dead_letter_window_ignored": Break(
        "deltaflow/client/stream.py",
        "                if not self.dead_letters.has_room:  # quarantined rows count against it too\n",
        "                if False:\n",
        ("tests/test_bad_input.py::test_rows_set_aside_wait_for_the_dead_letter_table",),
    ),
    "fold_groups_taken_in_arrival_order": Break(
        "deltaflow/tables/merging.py",
        "tail.group_by(list(key), use_threads=False).aggregate(aggregations).sort_by(by_key(key))",
        "tail.group_by(list(key), use_threads=False).aggregate(aggregations)",
        ("tests/test_cdc.py::test_a_large_group_folds_every_key_with_its_own_changes",),
    ),
    "column_sequences_off": Break(
        "deltaflow/tables/merging.py",
        "        stamps = gains_sequences(names, settings.key, settings.sequence_by, rule, sequenced)\n",
        "        return rule\n",
        (
            "tests/test_cdc_cluster.py::test_partial_updates_and_a_history_from_producers_out_of_order",
        ),
    ),
    "older_changes_lose_whole": Break(
        "deltaflow/tables/merging.py",
        "    return np.ones(data.num_rows, dtype=bool)\n",
        "    return None\n",
        (
            "tests/test_column_sequences.py::test_a_shuffled_feed_of_partial_changes_ends_as_applied_in_order[delta-rs]",
            "tests/test_column_sequences.py::test_a_shuffled_feed_of_partial_changes_ends_as_applied_in_order[delta-rs-dv]",
        ),
    ),
    "older_changes_lose_whole_in_a_merge": Break(
        "deltaflow/tables/merging.py",
        '        clauses.append((f"NOT {flag}", sets))\n',
        "        clauses.append((newer, sets))\n",
        (
            "tests/test_column_sequences.py::test_a_partial_change_sets_its_columns_in_any_arrival_order[spark-sql]",
        ),
    ),
    "fold_stamps_no_column_sequence": Break(
        "deltaflow/tables/merging.py",
        "            folded = stamp(folded, tail, key, sequence, own, floors)\n",
        "            pass\n",
        (
            "tests/test_column_sequences.py::test_a_partial_change_sets_its_columns_in_any_arrival_order[delta-rs]",
        ),
    ),
    "late_delete_nulls_nothing": Break(
        "deltaflow/tables/merging.py",
        "        data = wiped(data, rows, stored, sequence, rule.sequenced)\n",
        "        pass\n",
        (
            "tests/test_column_sequences.py::test_a_shuffled_feed_of_partial_changes_ends_as_applied_in_order[delta-rs]",
            "tests/test_column_sequences.py::test_a_shuffled_feed_of_partial_changes_ends_as_applied_in_order[delta-rs-dv]",
        ),
    ),
    "recorded_delete_floors_nothing": Break(
        "deltaflow/tables/commit/owner_state.py",
        "            data = floored(data, floors, settings.sequence_by, sequenced)\n",
        "            pass\n",
        (
            "tests/test_column_sequences.py::test_a_shuffled_feed_of_partial_changes_ends_as_applied_in_order[delta-rs]",
        ),
    ),
    "forged_column_sequence_accepted": Break(
        "deltaflow/tables/rows.py",
        "    return isinstance(column, str) and column.startswith(INTERNAL_PREFIXES)\n",
        '    return column == "_deltaflow_bucket"\n',
        ("tests/test_column_sequences.py::test_a_column_s_own_sequence_is_deltaflow_s_to_set",),
    ),
    # A recorded delete floors a row's columns in the sequence's own type (a date too).
    "sequences_decoded_as_int64": Break(
        "deltaflow/tables/sequence.py",
        "        return pa.array(values, type=width).cast(kind)  # (Arrow casts dates from int32 only)\n",
        "        return pa.array(values).cast(kind)\n",
        (
            "tests/test_column_sequences.py::test_a_deleted_key_changes_again_under_any_sequence_type",
        ),
    ),
    # A table made without columns that keep their last value gives the ones it gains theirs.
    "gained_columns_unsequenced": Break(
        "deltaflow/tables/column_sequences.py",
        "    return _applies(sequence, rule) and not any(",
        "    return False and not any(",
        (
            "tests/test_column_sequences.py::test_a_column_added_later_gets_its_own_sequence[delta-rs]",
        ),
    ),
    "reserved_columns_accepted_in_pages": Break(
        "deltaflow/tables/rows.py",
        "    reserved = [c for c in data.column_names if _reserved(c)]  # (the delete column is not here)\n",
        "    reserved: list[str] = []\n",
        ("tests/test_bad_input.py::test_an_arrow_page_may_not_set_deltaflow_s_columns",),
    ),
    "working_columns_accepted_in_rows": Break(
        "deltaflow/tables/rows.py",
        "    return isinstance(column, str) and column.startswith(INTERNAL_PREFIXES)\n",
        '    return isinstance(column, str) and column.startswith("_deltaflow_")\n',
        ("tests/test_column_sequences.py::test_a_column_s_own_sequence_is_deltaflow_s_to_set",),
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
                ".venv", "mutants", ".git", "__pycache__", ".*_cache", "bench", "site"
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
