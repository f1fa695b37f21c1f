"""The status page in a real headless Chromium (Debian's, driven by Playwright): what a person
sees after a stream, after a refused one, with the token asked for; and a hostile table name
shown as text."""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

import deltaflow
from deltaflow.errors import DataStreamerError

from .support import StartCluster

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
TOKEN = "status-page-token"
HOSTILE = "t<img src=x onerror=alert(1)>"


@pytest.fixture
async def browser() -> AsyncIterator[Any]:
    from playwright.async_api import async_playwright

    async with async_playwright() as p:
        chromium = await p.chromium.launch(executable_path=CHROMIUM, headless=True)
        try:
            yield chromium
        finally:
            await chromium.close()


async def test_the_status_page_shows_the_cluster_tables_and_errors(
    tmp_path: Path, start_cluster: StartCluster, browser: Any
) -> None:
    nodes = await start_cluster(tmp_path, engine="delta-rs", token=TOKEN)
    async with deltaflow.connect([nodes[0].address], token=TOKEN) as client:
        await client.stream_data([{"id": i, "n": i} for i in range(300)], table="orders", key="id")
        with pytest.raises(DataStreamerError):  # refused by the node that owns the key
            await client.stream_data([{"id": None, "n": 1}], table="never", key="id")
    # The page is the node's own view: the one that refused the stream shows the error.
    [here] = [n for n in nodes if n.statistics().dispatcher.errors]
    other = next(n for n in nodes if n is not here)
    page = await browser.new_page(viewport={"width": 1280, "height": 800})
    alerts: list[str] = []
    page.on("dialog", lambda dialog: alerts.append(dialog.message))
    await page.goto(f"http://{here.address}/")
    # Without the token the page shows nothing but the form asking for it.
    await page.locator("#login").wait_for(state="visible")
    assert not await page.locator("#status").is_visible()
    await page.fill("#token", "wrong")
    await page.click("button[type=submit]")
    await page.get_by_text("That token was refused.").wait_for()
    await page.fill("#token", TOKEN)
    await page.click("button[type=submit]")
    await page.locator("#status").wait_for(state="visible")

    members = page.locator("#members tbody tr")
    await members.nth(1).wait_for()
    texts = await members.all_inner_texts()
    assert any(t.startswith(f"{here.node_id} (this node)") and "live" in t for t in texts)
    assert any(t.startswith(other.node_id) and "live" in t for t in texts)
    partitions = [int(t.split("\t")[3]) for t in texts]
    assert sum(partitions) == 64

    orders = page.locator("#tables tbody tr", has_text="orders")
    await orders.wait_for()
    cells = await orders.locator("td").all_inner_texts()
    assert cells[1] in ("node-1", "node-2")  # the table's committer
    rows_here = here.statistics().engine.tables["orders"].rows_committed
    assert cells[4] == f"{rows_here:,}"
    assert await orders.locator("svg.chart rect").count() >= 1
    # The count is rows written, and says so; the table its refusal never created is absent.
    header = page.locator("#tables th").nth(4)
    assert await header.inner_text() == "Rows written"
    assert "not the table's row count" in (await header.get_attribute("title") or "")
    assert await page.locator("#tables tbody tr", has_text="never").count() == 0
    assert "SCHEMA_MISMATCH" in await page.locator("#errors").inner_text()
    # At 1280 px the page does not scroll sideways.
    widths = await page.evaluate(
        "[document.documentElement.scrollWidth, document.documentElement.clientWidth]"
    )
    assert widths[0] <= widths[1], f"the page is {widths[0]} px wide in a {widths[1]} px window"
    assert await page.locator("#ready").inner_text() == "ready"
    shot = tmp_path / "status-page.png"
    await page.screenshot(path=str(shot), full_page=True)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert alerts == []


async def test_a_table_name_with_markup_stays_text(
    tmp_path: Path, start_cluster: StartCluster, browser: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    [node] = await start_cluster(tmp_path, count=1, engine="delta-rs")
    # A client that does not check names first (another language's, an old one): the node's
    # refusal quotes the name.
    monkeypatch.setattr("deltaflow.client.client.table_name_problem", lambda name: None)
    async with deltaflow.connect([node.address]) as client:
        # Refused (not a valid table name), but the refusal's message reaches the page.
        with pytest.raises(DataStreamerError):
            await client.stream_data([{"id": 1}], table=HOSTILE, key="id")
    async with aiohttp.ClientSession() as http:
        async with http.get(f"http://{node.address}/") as resp:
            csp = resp.headers["Content-Security-Policy"]
    script_src = next(d.strip() for d in csp.split(";") if d.strip().startswith("script-src"))
    assert script_src == "script-src 'self'"  # no inline script can run
    page = await browser.new_page()
    alerts: list[str] = []
    page.on("dialog", lambda dialog: alerts.append(dialog.message))
    await page.goto(f"http://{node.address}/")
    errors = page.locator("#errors li")
    await errors.first.wait_for()
    assert "<img" in await page.locator("#errors").inner_text()  # shown as text
    assert await page.locator("#errors img").count() == 0
    assert alerts == []
