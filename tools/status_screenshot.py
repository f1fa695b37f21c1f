"""Take docs/images/status-page.png: three delta-rs nodes in this process, a few streams into
two tables and one refused stream, and the first node's status page in headless Chromium.

    .venv/bin/python tools/status_screenshot.py
"""

from __future__ import annotations

import asyncio
import shutil
import sys
import tempfile
from pathlib import Path

import deltaflow
from deltaflow.errors import DataStreamerError
from deltaflow.server import NodeConfig, start_local_nodes

OUT = Path(__file__).resolve().parent.parent / "docs" / "images" / "status-page.png"


async def main() -> int:
    from playwright.async_api import async_playwright

    with tempfile.TemporaryDirectory() as tmp:
        config = NodeConfig(node_id="n", warehouse=Path(tmp), port=0, engine="delta-rs")
        nodes = await start_local_nodes(3, config)
        try:
            async with deltaflow.connect([nodes[0].address]) as client:
                for round_ in range(6):
                    rows = [
                        {"id": i, "amount": i * 3 + round_}
                        for i in range(2000 * round_, 2000 * round_ + 4000)
                    ]
                    await client.stream_data(rows, table="orders", key="id")
                    await client.stream_data(
                        [
                            {"id": i, "name": f"c{i}"}
                            for i in range(500 * round_, 500 * round_ + 500)
                        ],
                        table="customers",
                        key="id",
                    )
                try:  # refused by a node: shown among its recent errors
                    await client.stream_data([{"id": 1}], table="bad/name", key="id")
                except DataStreamerError:
                    pass
            async with async_playwright() as p:
                browser = await p.chromium.launch(
                    executable_path=shutil.which("chromium") or "/usr/bin/chromium"
                )
                page = await browser.new_page(viewport={"width": 1400, "height": 760})
                [here] = [n for n in nodes if n.statistics().dispatcher.errors] or nodes[:1]
                await page.goto(f"http://{here.address}/")
                await page.locator("#tables tbody tr", has_text="orders").wait_for()
                await page.screenshot(path=str(OUT), full_page=True)
                await browser.close()
        finally:
            for node in reversed(nodes):
                await node.stop()
    print(OUT)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
