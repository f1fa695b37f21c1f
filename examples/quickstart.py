"""Stream rows into a Delta table through a running node.

Start a node first:  deltaflow serve --node-id n1 --port 7700 --warehouse /tmp/wh
Then:                python examples/quickstart.py
"""

import asyncio

import deltaflow


async def main() -> None:
    rows = [{"id": i, "name": f"user-{i}", "score": i * 1.5} for i in range(10_000)]
    rows.append(deltaflow.Delete({"id": 42}))  # deletes are ordered with upserts of the key
    async with deltaflow.connect(["127.0.0.1:7700"]) as client:
        summary = await client.stream_data(rows, table="users", key="id")
    print(f"{summary.items_acked} rows applied at {summary.rows_per_second:,.0f} rows/s")


if __name__ == "__main__":
    asyncio.run(main())
