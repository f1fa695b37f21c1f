"""The Prometheus endpoint: what an operator scraping ``/metrics`` of each node sees."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import aiohttp
import pytest
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

import deltaflow
from deltaflow import StreamerOptions
from deltaflow.server import Node, NodeConfig

from .support import StartCluster, read_delta

TOKEN = "scrape-secret"


async def scrape(node: Node, token: str | None = None) -> tuple[int, str, str]:
    """GET ``/metrics`` of ``node``: status, content type and body."""
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"http://{node.address}/metrics", headers=headers) as response,
    ):
        return response.status, response.headers["Content-Type"], await response.text()


def samples(text: str) -> dict[str, list[Sample]]:
    """Every sample of a scrape by sample name (counters with ``_total``, histograms with
    ``_bucket``/``_count``/``_sum``)."""
    by_name: dict[str, list[Sample]] = defaultdict(list)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            by_name[sample.name].append(sample)
    return by_name


def value(scraped: dict[str, list[Sample]], name: str, **labels: str) -> float:
    """The value of the one sample ``name`` whose labels include ``labels``."""
    [match] = [s for s in scraped[name] if labels.items() <= s.labels.items()]
    return match.value


async def test_two_nodes_report_what_they_applied_and_committed(
    warehouse: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, start_cluster: StartCluster
) -> None:
    rates = tmp_path / "vat.json"
    rates.write_text(json.dumps({"default": 0.2}))
    monkeypatch.setenv("VAT_RATES_FILE", str(rates))
    rows = [{"id": i, "value": float(i)} for i in range(3000)]
    nodes = await start_cluster(
        warehouse, engine="delta-rs", side_inputs=["examples.receivers.VatRates"]
    )
    try:
        async with deltaflow.connect([nodes[0].address]) as client:
            summary = await client.stream_data(
                rows, table="metered", key="id", options=StreamerOptions(page_size=100)
            )
        scrapes = [await scrape(node) for node in nodes]
    finally:
        for node in reversed(nodes):
            await node.stop()
    assert summary.items_acked == len(rows)
    assert len(read_delta(warehouse / "metered")) == len(rows)

    per_node = []
    for node, (status, content_type, text) in zip(nodes, scrapes, strict=True):
        assert status == 200
        assert content_type == CONTENT_TYPE_LATEST
        scraped = samples(text)
        per_node.append(scraped)
        # Every sample is labelled with the node that reported it.
        assert {s.labels["node"] for series in scraped.values() for s in series} == {node.node_id}
        assert value(scraped, "deltaflow_node_state", state="running") == 1
        assert value(scraped, "deltaflow_partition_map_version") > 0
        commits = value(scraped, "deltaflow_commits_total")
        assert value(scraped, "deltaflow_commit_seconds_count") == commits
        assert value(scraped, "deltaflow_commit_seconds_bucket", le="+Inf") == commits
        assert value(scraped, "deltaflow_group_rows_count") == commits
        assert value(scraped, "deltaflow_group_rows_sum") == value(
            scraped, "deltaflow_rows_committed_total"
        )
        if commits:
            assert value(scraped, "deltaflow_commit_seconds_sum") > 0
        # Every committed batch waited at least for its own commit.
        assert value(scraped, "deltaflow_batch_durable_seconds_count") == value(
            scraped, "deltaflow_batches_committed_total"
        )
        assert value(scraped, "deltaflow_batch_durable_seconds_sum") >= value(
            scraped, "deltaflow_commit_seconds_sum"
        )
        # A batch's time on the node by stage: its queue and its commit split its time to
        # table, and its whole stay (frame read to ack queued) holds both.
        durable = value(scraped, "deltaflow_batch_durable_seconds_sum")
        split = 0.0
        for stage in ("queued", "committing"):
            assert value(scraped, "deltaflow_batch_stage_seconds_count", stage=stage) == value(
                scraped, "deltaflow_batches_committed_total"
            )
            split += value(scraped, "deltaflow_batch_stage_seconds_sum", stage=stage)
        assert split == pytest.approx(durable)
        assert value(scraped, "deltaflow_batch_stage_seconds_count", stage="node") == value(
            scraped, "deltaflow_batches_acked_total"
        )
        assert value(scraped, "deltaflow_batch_stage_seconds_sum", stage="node") >= durable
        buckets = [s.value for s in scraped["deltaflow_group_rows_bucket"]]
        assert buckets == sorted(buckets), "buckets are cumulative"
        assert value(scraped, "deltaflow_side_input_version", side_input="vat_rates") >= 1

    def total(name: str, **labels: str) -> float:
        return sum(value(scraped, name, **labels) for scraped in per_node)

    assert total("deltaflow_items_applied_total") == len(rows)
    batches = sum(s.batches_acked for s in summary.per_node.values())
    assert total("deltaflow_batches_acked_total") == batches
    assert total("deltaflow_commits_total") > 0
    assert total("deltaflow_rows_committed_total") == len(rows)
    assert total("deltaflow_tables_created_total") == 1
    assert total("deltaflow_checkpoints_total") == 0  # a new table: far from its interval
    assert total("deltaflow_owned_partitions") == nodes[0].config.partitions
    assert total("deltaflow_side_input_leader", side_input="vat_rates") == 1
    # The leader's first retrieval published version 1; nothing failed anywhere.
    published = total(
        "deltaflow_side_input_retrievals_total", side_input="vat_rates", outcome="published"
    )
    assert published >= 1
    assert total("deltaflow_side_input_retrievals_total", outcome="failed") == 0


async def test_metrics_need_the_cluster_token(warehouse: Path, start_cluster: StartCluster) -> None:
    [node] = await start_cluster(warehouse, count=1, engine="delta-rs", token=TOKEN)
    try:
        missing = await scrape(node)
        wrong = await scrape(node, token="not-it")
        right = await scrape(node, token=TOKEN)
    finally:
        await node.stop()
    assert missing[0] == 401 and wrong[0] == 401
    assert "deltaflow" not in missing[2]
    assert right[0] == 200
    assert value(samples(right[2]), "deltaflow_owned_partitions") == node.config.partitions


def test_nodes_in_one_process_keep_their_metrics_apart(warehouse: Path) -> None:
    from prometheus_client import REGISTRY, generate_latest

    first, second = (
        Node(NodeConfig(node_id=name, warehouse=warehouse, engine="delta-rs"))
        for name in ("a", "b")
    )
    assert b"deltaflow" not in generate_latest(REGISTRY)
    for node in (first, second):
        assert {
            s.labels["node"]
            for series in samples(generate_latest(node.metrics).decode()).values()
            for s in series
        } == {node.node_id}


def test_the_collector_reads_only_the_snapshot_it_is_given() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from deltaflow.server.metrics import NodeCollector
    from deltaflow.server.statistics import (
        DispatcherStatistics,
        NodeStatistics,
        SideInputStatistics,
    )
    from deltaflow.tables.statistics import EngineStatistics

    side = SideInputStatistics(
        name="rates",
        version=3,
        leader="n9",
        is_leader=True,
        retrievals=6,
        published=3,
        declined=1,
        unchanged=1,
        failures=1,
        last_error="down",
    )
    snapshot = NodeStatistics(
        node_id="n9",
        state="running",
        connections=2,
        map_version=7,
        owned_partitions=5,
        dispatcher=DispatcherStatistics(batches_acked=4, node_retries=1),
        engine=EngineStatistics(commits=2),
        side_inputs=(side,),
    )
    registry = CollectorRegistry()
    registry.register(NodeCollector(lambda: snapshot))
    scraped = samples(generate_latest(registry).decode())
    assert value(scraped, "deltaflow_batches_acked_total") == 4
    assert value(scraped, "deltaflow_node_retries_total") == 1
    assert value(scraped, "deltaflow_commits_total") == 2
    assert value(scraped, "deltaflow_connections") == 2
    assert value(scraped, "deltaflow_partition_map_version") == 7
    assert value(scraped, "deltaflow_node_state", state="running") == 1
    assert value(scraped, "deltaflow_side_input_version", side_input="rates") == 3
    assert value(scraped, "deltaflow_side_input_leader", side_input="rates") == 1
    assert value(scraped, "deltaflow_side_input_retrievals_total", outcome="failed") == 1
