"""Object storage: the real S3-compatible server the setup installs (versitygw), and
``deltaflow store check``, which tells a store that honours conditional writes (the property
commits without a shared lock rely on) from one that does not."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from deltaflow.storage import ConditionalWriteCheck
from deltaflow.testing import free_port
from deltaflow.testing.object_store import S3Server, UnconditionalS3

pytestmark = pytest.mark.slow


def _s3(server: S3Server) -> Any:
    import boto3

    options = server.storage_options
    return boto3.client(
        "s3",
        endpoint_url=server.endpoint,
        aws_access_key_id=options["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=options["AWS_SECRET_ACCESS_KEY"],
        region_name=options["AWS_REGION"],
    )


def _status(call: Any) -> int:
    """The HTTP status of an S3 call: 200, or the error's."""
    from botocore.exceptions import ClientError

    try:
        call()
        return 200
    except ClientError as exc:
        return int(exc.response["ResponseMetadata"]["HTTPStatusCode"])


def test_the_s3_server_honours_conditional_writes(s3_server: S3Server, bucket: str) -> None:
    """Checked with an S3 client of its own (boto3), independent of deltaflow: if the server
    the setup installed ever stopped honouring them, the object-storage tests could pass on a
    store where commits are lost, so this fails first."""
    s3, name = _s3(s3_server), bucket.removeprefix("s3://")
    first = s3.put_object(Bucket=name, Key="k", Body=b"1", IfNoneMatch="*")["ETag"]
    assert _status(lambda: s3.put_object(Bucket=name, Key="k", Body=b"2", IfNoneMatch="*")) == 412
    s3.put_object(Bucket=name, Key="k", Body=b"3")
    assert _status(lambda: s3.put_object(Bucket=name, Key="k", Body=b"4", IfMatch=first)) == 412
    assert s3.get_object(Bucket=name, Key="k")["Body"].read() == b"3"

    start, statuses = threading.Barrier(16), []

    def racer() -> None:
        start.wait()
        statuses.append(
            _status(lambda: s3.put_object(Bucket=name, Key="raced", Body=b"x", IfNoneMatch="*"))
        )

    threads = [threading.Thread(target=racer) for _ in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert statuses.count(200) == 1, statuses


def test_store_check_passes_on_the_server_and_shows_no_secret(
    s3_server: S3Server, bucket: str
) -> None:
    done = _deltaflow("store", "check", f"{bucket}/warehouse", env=s3_server.storage_options)
    as_json = _deltaflow(
        "store", "check", f"{bucket}/warehouse", "--json", env=s3_server.storage_options
    )
    assert as_json.returncode == 0, as_json.stderr
    report = json.loads(as_json.stdout)
    assert report["ok"] is True and report["problems"] == []
    assert (report["racers"], report["winners"]) == (16, 1)
    assert report["create_refused"] and report["stale_etag_refused"]
    assert done.returncode == 0, done.stdout + done.stderr
    assert "racing creates of one key:           1 of 16 won" in done.stdout
    assert "conditional writes: OK" in done.stdout
    assert s3_server.secret_key not in done.stdout + done.stderr
    # It cleans up after itself: nothing left under the location it checked.
    listed = _s3(s3_server).list_objects_v2(Bucket=bucket.removeprefix("s3://"))
    assert listed.get("KeyCount", 0) == 0, listed.get("Contents")


@pytest.fixture
def unconditional(s3_server: S3Server, tmp_path: Path) -> Iterator[UnconditionalS3]:
    """The S3 server behind a proxy that drops conditional headers: a store that overwrites."""
    with UnconditionalS3(tmp_path / "proxy", s3_server) as store:
        yield store.start()


def _deltaflow(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "deltaflow.cli", *args],
        capture_output=True, text=True, timeout=120, check=False, env={**os.environ, **env},
    )  # fmt: skip


def test_a_store_without_conditional_writes_is_found_out_and_refused(
    unconditional: UnconditionalS3, bucket: str, tmp_path: Path
) -> None:
    """On a store that lets a create overwrite, ``store check`` says what it did wrong, and a
    node will not start on it: it would lose commits without anyone noticing."""
    env = unconditional.storage_options
    checked = _deltaflow("store", "check", f"{bucket}/warehouse", env=env)
    assert checked.returncode == 2, checked.stdout + checked.stderr
    assert "racing creates of one key:           16 of 16 won" in checked.stdout
    assert checked.stderr.startswith(
        f"deltaflow: the store {bucket}/warehouse does not honour conditional writes, so "
        "commits to tables on it could be lost: a create of an existing key (If-None-Match: *) "
        "overwrote it; a write conditional on a stale ETag (If-Match) was accepted; 16 of 16 "
        "racing creates of one key succeeded"
    )
    served = _deltaflow(
        "serve", "--node-id", "n1", "--port", str(free_port()), "--engine", "delta-rs",
        "--warehouse", f"{bucket}/warehouse", env={**env, "TMPDIR": str(tmp_path)},
    )  # fmt: skip
    assert served.returncode != 0
    assert "does not honour conditional writes" in served.stderr, served.stderr[-2000:]
    assert "ready on" not in served.stdout
    assert unconditional.server.secret_key not in served.stdout + served.stderr
    # Nothing was written: the node stopped before the cluster record or any table.
    listed = _s3(unconditional.server).list_objects_v2(Bucket=bucket.removeprefix("s3://"))
    assert listed.get("KeyCount", 0) == 0, listed.get("Contents")


def test_spark_sql_writer_and_connect_are_refused_on_a_store(
    s3_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    """Not safe there yet (docs/object-storage.md): each says so and what to use instead."""
    base = ["serve", "--node-id", "n1", "--port", str(free_port()),
            "--warehouse", f"{bucket}/warehouse"]  # fmt: skip
    env = {**s3_server.storage_options, "TMPDIR": str(tmp_path)}
    sql = _deltaflow(*base, "--engine", "spark", "--spark-writer", "sql", env=env)
    assert sql.returncode != 0
    assert "the spark engine's SQL writer cannot commit to" in sql.stderr, sql.stderr[-2000:]
    assert "use --spark-writer direct" in sql.stderr
    connect = _deltaflow(
        *base, "--engine", "spark", "--spark-master", f"sc://127.0.0.1:{free_port()}", env=env
    )
    assert connect.returncode != 0
    assert "a Spark Connect server cannot commit to" in connect.stderr, connect.stderr[-2000:]


def test_a_store_without_conditional_writes_is_described_as_unsafe() -> None:
    check = ConditionalWriteCheck("s3://b/w", create_refused=False, stale_etag_refused=True,
                                  racers=16, winners=16)  # fmt: skip
    assert not check.ok
    assert check.problems() == [
        "a create of an existing key (If-None-Match: *) overwrote it",
        "16 of 16 racing creates of one key succeeded",
    ]


def test_store_check_names_the_store_it_cannot_reach(tmp_path: Path) -> None:
    port = free_port()  # nothing listens there
    options = [f"--storage-option=AWS_ENDPOINT_URL=http://127.0.0.1:{port}",
               "--storage-option=AWS_ALLOW_HTTP=true", "--storage-option=AWS_REGION=us-east-1",
               "--storage-option=AWS_MAX_RETRIES=0"]  # fmt: skip
    secrets = {"DELTAFLOW_STORAGE_OPTIONS_AWS_ACCESS_KEY_ID": "k",
               "DELTAFLOW_STORAGE_OPTIONS_AWS_SECRET_ACCESS_KEY": "s"}  # fmt: skip
    done = _deltaflow("store", "check", "s3://nowhere/w", *options, env=secrets)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.startswith("deltaflow: cannot check the store s3://nowhere/w: ")
    # The cause the store client keeps in its debug dump, said in the one line.
    assert f"error sending request: Connection refused at 127.0.0.1:{port}" in done.stderr
    assert "Traceback" not in done.stderr and "Debug" not in done.stderr
    # A variable set empty (a shell's `export AWS_ALLOW_HTTP=`): named, with what to do.
    empty = _deltaflow("store", "check", "s3://nowhere/w", *options[2:],
                       env={**secrets, "AWS_ALLOW_HTTP": ""})  # fmt: skip
    assert empty.returncode == 2
    assert (
        "failed to parse \"\" as boolean (AWS_ALLOW_HTTP='': set true or false, or unset it)"
        in empty.stderr
    ), empty.stderr


def test_a_missing_bucket_and_a_plain_http_endpoint_are_named(
    s3_server: S3Server, tmp_path: Path
) -> None:
    """What a new operator meets first: exit 2 with the store's own words, no debug dump."""
    env = s3_server.storage_options
    checked = _deltaflow("store", "check", "s3://no-such-bucket/w", env=env)
    served = _deltaflow(
        "serve", "--node-id", "n1", "--port", str(free_port()), "--engine", "delta-rs",
        "--warehouse", "s3://no-such-bucket/w", env={**env, "TMPDIR": str(tmp_path)},
    )  # fmt: skip
    for done in (checked, served):
        assert done.returncode == 2, done.stdout + done.stderr
        assert "404 Not Found: NoSuchBucket: The specified bucket does not exist" in done.stderr
        assert "Debug" not in done.stderr and "Traceback" not in done.stderr
        assert len(done.stderr.splitlines()) == 1
    plain = {k: v for k, v in env.items() if k != "AWS_ALLOW_HTTP"}
    refused = _deltaflow("store", "check", "s3://no-such-bucket/w", env=plain)
    assert refused.returncode == 2
    assert "needs AWS_ALLOW_HTTP=true" in refused.stderr
