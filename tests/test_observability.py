"""What an operator watches: per-table and per-receiver metrics after a stream, and the JSON
log events of a node's life (start, ready, streams, commits, membership, drain, stop)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

import deltaflow
from deltaflow.errors import DataStreamerError
from deltaflow.testing import NodeProcess, wait_for_members

from .support import StartCluster, open_table

TOKEN = "observability-token"
Samples = dict[tuple[str, frozenset[Any]], float]


async def scrape(address: str, token: str | None = None) -> Samples:
    """Every sample of a node's /metrics, by (name, labels)."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with aiohttp.ClientSession() as http:
        async with http.get(f"http://{address}/metrics", headers=headers) as resp:
            assert resp.status == 200
            text = await resp.text()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def total(
    samples: list[dict[tuple[str, frozenset[Any]], float]], name: str, **labels: str
) -> float:
    want = set(labels.items())
    return sum(
        v for scraped in samples for (n, ls), v in scraped.items() if n == name and want <= ls
    )


async def test_metrics_say_what_each_table_and_receiver_did(
    tmp_path: Path, start_cluster: StartCluster
) -> None:
    nodes = await start_cluster(tmp_path, engine="delta-rs")
    orders = [{"id": i, "amount": i * 10} for i in range(300)]
    customers = [{"id": i, "name": f"c{i}"} for i in range(120)]
    async with deltaflow.connect([nodes[0].address]) as client:
        await client.stream_data(orders, table="orders", key="id")
        await client.stream_data(customers, table="customers", key="id")
        with pytest.raises(DataStreamerError, match="SCHEMA_MISMATCH"):  # refused by a node
            await client.stream_data([{"id": None, "amount": 1}], table="orders", key="id")
    samples = [await scrape(n.address) for n in nodes]
    receiver = "deltaflow.receivers.TableUpsert"
    assert total(samples, "deltaflow_table_rows_committed_total", table="orders") == 300
    assert total(samples, "deltaflow_table_rows_committed_total", table="customers") == 120
    assert total(samples, "deltaflow_receiver_items_applied_total", receiver=receiver) == 420
    assert total(samples, "deltaflow_receiver_items_failed_total", receiver=receiver) == 0
    batches = total(samples, "deltaflow_table_batches_committed_total", table="orders")
    assert batches >= 2  # both nodes own partitions of the keys
    # Every committed batch has its time to table observed, and every commit its duration.
    assert total(samples, "deltaflow_table_time_to_table_seconds_count", table="orders") == batches
    commits = total(samples, "deltaflow_table_commits_total", table="orders")
    assert commits >= 1
    assert total(samples, "deltaflow_table_commit_seconds_count", table="orders") == commits
    assert total(samples, "deltaflow_table_rows_per_commit_sum", table="orders") == 300
    assert total(samples, "deltaflow_table_in_flight_batches", table="orders") == 0
    assert total(samples, "deltaflow_table_queued_rows", table="orders") == 0
    versions = [
        v for s in samples for (n, ls), v in s.items()
        if n == "deltaflow_table_version" and ("table", "orders") in ls
    ]  # fmt: skip
    assert max(versions) == open_table(tmp_path / "orders").version()
    assert total(samples, "deltaflow_errors_total", code="SCHEMA_MISMATCH") == 1


async def test_a_node_logs_its_life_as_json_events(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text(TOKEN)
    extra = ["--engine", "delta-rs", "--log-format", "json", "--log-level", "info",
             "--token-file", str(token)]  # fmt: skip
    first = NodeProcess("n1", tmp_path / "w", extra=extra)
    second = NodeProcess("n2", tmp_path / "w", extra=extra, peers=[first.address])
    try:
        await first.start(timeout=60)
        await second.start(timeout=60)
        await wait_for_members([first.address, second.address], token=TOKEN)
        async with deltaflow.connect([first.address], token=TOKEN) as client:
            await client.stream_data(
                [{"id": i} for i in range(50)], table="events", key="id", stream_id="s-1"
            )
        await second.stop()  # SIGTERM: it drains; stop() returns once its output is read
    finally:
        await first.stop()
        await second.stop()
    logs = {p.node_id: events(p) for p in (first, second)}
    every = [e for lines in logs.values() for e in lines]
    assert all(TOKEN not in json.dumps(e) for e in every)
    assert all({"time", "level", "logger", "event", "message"} <= e.keys() for e in every)
    one = by_event(logs["n1"])
    two = by_event(logs["n2"])
    assert one["node.start"][0]["engine"] == "delta-rs"
    assert one["node.ready"][0]["node"] == "n1"
    assert any(e["joined"] == ["n2"] for e in one["membership.changed"])
    opened = [e for lines in logs.values() for e in by_event(lines).get("stream.opened", [])]
    assert {e["stream"] for e in opened} == {"s-1"}
    assert {e["table"] for e in opened} == {"events"}
    commits = [e for lines in logs.values() for e in by_event(lines).get("commit", [])]
    assert sum(e["rows"] for e in commits) == 50
    assert all(e["table"] == "events" and e["seconds"] >= 0 for e in commits)
    closed = [e for lines in logs.values() for e in by_event(lines).get("stream.closed", [])]
    assert {e["stream"] for e in closed} == {"s-1"}
    assert two["node.drain"][0]["asked_by"] == "signal"
    assert two["node.drain"][0]["level"] == "info"  # a routine drain is no warning
    assert two["node.drained"][0]["seconds"] >= 0
    assert "node.stop" in two
    assert one["member.left"][0]["peer"] == "n2"


def events(proc: NodeProcess) -> list[dict[str, Any]]:
    return [json.loads(line) for line in proc.output if line.startswith("{")]


def by_event(lines: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for line in lines:
        out.setdefault(str(line["event"]), []).append(line)
    return out


async def test_every_metric_a_node_serves_is_in_the_reference(
    tmp_path: Path, start_cluster: StartCluster
) -> None:
    [node] = await start_cluster(tmp_path, count=1, engine="delta-rs")
    async with deltaflow.connect([node.address]) as client:
        await client.stream_data([{"id": 1}], table="t", key="id")
    async with aiohttp.ClientSession() as http:
        async with http.get(f"http://{node.address}/metrics") as resp:
            text = await resp.text()
    page = (Path(__file__).parent.parent / "docs" / "configuration.md").read_text()
    names = {family.name for family in text_string_to_metric_families(text)}
    assert len(names) > 50
    missing = sorted(
        n for n in names
        if f"`{n}`" not in page and f"`{n}_total`" not in page
    )  # fmt: skip
    assert missing == [], "add them to docs/configuration.md, Metrics"


def test_the_grafana_dashboard_charts_metrics_a_node_serves() -> None:
    """Every query of docs/grafana-dashboard.json names metrics of the reference (so a renamed
    metric cannot leave a panel empty)."""
    import re

    docs = Path(__file__).parent.parent / "docs"
    dashboard = json.loads((docs / "grafana-dashboard.json").read_text())
    page = (docs / "configuration.md").read_text()
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    assert len(exprs) >= 10
    for expr in exprs:
        for name in re.findall(r"deltaflow_[a-z_]+", expr):
            family = re.sub(r"_(bucket|sum|count)$", "", name)
            assert f"`{family}`" in page or f"`{name}`" in page, (name, expr)
