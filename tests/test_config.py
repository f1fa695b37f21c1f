"""A node's settings from a TOML file, ``DELTAFLOW_*`` variables and flags: precedence,
``deltaflow config show`` (secrets masked), ``deltaflow config check`` (exit codes as Vector's
``validate``), and a node served from a file alone."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp

from deltaflow.testing import free_port
from deltaflow.testing.object_store import S3Server


def deltaflow(
    *args: str, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("DELTAFLOW_")}
    return subprocess.run(
        [sys.executable, "-m", "deltaflow.cli", *args],
        capture_output=True, text=True, timeout=120, check=False, env={**clean, **(env or {})},
        cwd=cwd,
    )  # fmt: skip


def shown(*args: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    done = deltaflow("config", "show", "--json", *args, env=env)
    assert done.returncode == 0, done.stderr
    return dict(json.loads(done.stdout)["settings"])


def test_flags_win_over_the_environment_which_wins_over_the_file(tmp_path: Path) -> None:
    config = tmp_path / "node.toml"
    config.write_text(
        'node_id = "from-file"\nwarehouse = "/srv/w"\nport = 7001\npartitions = 16\n'
        'peers = ["a:1", "b:2"]\n[spark]\nmaster = "spark://m:7077"\n'
        '[storage_options]\nAWS_REGION = "eu-west-1"\nAWS_ENDPOINT_URL = "http://file"\n'
    )
    env = {
        "DELTAFLOW_CONFIG": str(config),
        "DELTAFLOW_PORT": "7002",
        "DELTAFLOW_PARTITIONS": "32",
        "DELTAFLOW_SPARK_MASTER": "local[2]",
        "DELTAFLOW_STORAGE_OPTIONS_AWS_ENDPOINT_URL": "http://env",
        "DELTAFLOW_INSECURE": "true",
    }
    got = shown("--port", "7003", "--no-insecure", "--peers", "c:3", env=env)
    assert got["node_id"] == {"value": "from-file", "source": "file"}
    assert got["port"] == {"value": 7003, "source": "flag"}
    assert got["partitions"] == {"value": 32, "source": "env"}
    assert got["spark.master"] == {"value": "local[2]", "source": "env"}
    assert got["insecure"] == {"value": False, "source": "flag"}
    assert got["peers"] == {"value": ["c:3"], "source": "flag"}
    assert got["max_group_rows"]["source"] == "default"
    # A table's entries layer one by one: the file's region stays beside the env's endpoint.
    assert got["storage_options"]["value"] == {
        "AWS_REGION": "eu-west-1",
        "AWS_ENDPOINT_URL": "http://env",
    }
    # Without the variables the file shows through.
    alone = shown("--config", str(config))
    assert alone["port"] == {"value": 7001, "source": "file"}
    assert alone["peers"]["value"] == ["a:1", "b:2"]


def test_secrets_are_masked_and_never_taken_from_the_command_line(tmp_path: Path) -> None:
    config = tmp_path / "node.toml"
    config.write_text(
        'node_id = "n1"\nwarehouse = "w"\n[storage_options]\nAWS_SECRET_ACCESS_KEY = "s3cr3t"\n'
    )
    env = {"DELTAFLOW_TOKEN": "client-secret", "DELTAFLOW_CONFIG": str(config)}
    table = deltaflow("config", "show", env=env)
    assert table.returncode == 0, table.stderr
    got = shown(env=env)
    assert got["token"] == {"value": "********", "source": "env"}
    assert got["storage_options"]["value"] == {"AWS_SECRET_ACCESS_KEY": "********"}
    for done in (table, deltaflow("config", "show", "--json", env=env)):
        assert "s3cr3t" not in done.stdout + done.stderr
        assert "client-secret" not in done.stdout + done.stderr
    refused = deltaflow(  # as serve would (the same layering), without starting a node
        "config",
        "check",
        str(config),
        "--offline",
        "--storage-option",
        "AWS_SECRET_ACCESS_KEY=other",
    )
    assert refused.returncode == 78, refused.stderr
    assert "a secret is never given on the command line" in refused.stderr
    assert "DELTAFLOW_STORAGE_OPTIONS_AWS_SECRET_ACCESS_KEY" in refused.stderr
    assert "other" not in refused.stderr
    # A token in the file is refused too: config files get committed and shared.
    config.write_text('node_id = "n1"\nwarehouse = "w"\ntoken = "t"\n')
    in_file = deltaflow("config", "check", str(config), "--offline")
    assert in_file.returncode == 78
    assert "token: a secret is not kept in the config file" in in_file.stderr


def test_config_check_lists_every_problem_with_exit_78(tmp_path: Path) -> None:
    config = tmp_path / "node.toml"
    config.write_text(
        'node_id = "n1"\nwarehouse = "w"\nprot = 7700\npartitions = "64"\n'
        'engine = "duckdb"\n[tls]\nclient_auth = "yes"\n[spark]\nmaster = 3\n'
    )
    done = deltaflow("config", "check", str(config), "--json")
    assert done.returncode == 78
    report = json.loads(done.stdout)
    assert report["valid"] is False
    assert report["exit_code"] == 78
    assert sorted(report["problems"]) == sorted([
        f"{config}: prot: unknown key (did you mean port?)",
        f"{config}: partitions: expected an integer, got a string ('64')",
        f"{config}: engine: 'duckdb' is not one of spark, delta-rs",
        f"{config}: tls.client_auth: expected true or false, got a string ('yes')",
        f"{config}: spark.master: expected a string, got an integer (3)",
    ])  # fmt: skip
    env_bad = deltaflow(
        "config", "check", str(config.with_name("none.toml")), env={"DELTAFLOW_PORT": "x"}
    )
    assert env_bad.returncode == 78
    assert "none.toml: cannot be read" in env_bad.stderr
    assert "DELTAFLOW_PORT: expected an integer, got 'x'" in env_bad.stderr
    missing = deltaflow("config", "check", "--offline")
    assert missing.returncode == 78
    assert "node_id is required: set it with --node-id, DELTAFLOW_NODE_ID" in missing.stderr
    no_warehouse = deltaflow("config", "check", "--offline", "--node-id", "n1")
    assert no_warehouse.returncode == 78, no_warehouse.stderr
    assert "warehouse is required" in no_warehouse.stderr
    assert "unexpected" not in no_warehouse.stderr and "None" not in no_warehouse.stderr


def test_config_check_validates_values_files_and_classes(tmp_path: Path) -> None:
    config = tmp_path / "node.toml"
    base = f'node_id = "n1"\nwarehouse = "{tmp_path / "w"}"\nengine = "delta-rs"\n'
    config.write_text(base)
    good = deltaflow("config", "check", str(config))
    assert good.returncode == 0, good.stdout + good.stderr
    assert "configuration valid" in good.stderr
    config.write_text(
        base + 'host = "0.0.0.0"\nadvertise = "h:1"\ntoken_file = "/nonexistent/token"\n'
    )
    unreadable = deltaflow("config", "check", str(config))
    assert unreadable.returncode == 78
    assert "token_file '/nonexistent/token' cannot be read" in unreadable.stderr
    config.write_text(base + 'receivers = ["deltaflow.testing.NoSuchReceiver"]\n')
    classes = deltaflow("config", "check", str(config))
    assert classes.returncode == 78
    assert "deltaflow.testing.NoSuchReceiver: module deltaflow.testing has no" in classes.stderr
    (tmp_path / "file").write_text("")
    config.write_text(base.replace(str(tmp_path / "w"), str(tmp_path / "file" / "w")))
    not_a_dir = deltaflow("config", "check", str(config))
    assert not_a_dir.returncode == 78
    assert "is not a writable directory" in not_a_dir.stderr


def test_config_check_lists_mistakes_of_every_kind_and_source_in_one_pass(
    tmp_path: Path,
) -> None:
    config = tmp_path / "node.toml"
    config.write_text(
        f'node_id = "n1"\nwarehouse = "{tmp_path / "w"}"\nengine = "delta-rs"\nprot = 7700\n'
        'receivers = ["deltaflow.testing.NoSuchReceiver"]\n'
        '[tls]\ncert = "/nonexistent/cert.pem"\nkey = "/nonexistent/key.pem"\n'
    )
    done = deltaflow(
        "config", "check", str(config), "--failure-timeout", "0.1",
        env={"DELTAFLOW_PARTITIONS": "x"},
    )  # fmt: skip
    assert done.returncode == 78, done.stdout + done.stderr
    said = [line.removeprefix("  - ") for line in done.stderr.splitlines()]
    for problem in (
        f"{config}: prot: unknown key (did you mean port?)",  # the file
        "DELTAFLOW_PARTITIONS: expected an integer, got 'x'",  # the environment
        "tls.cert '/nonexistent/cert.pem' is not a readable file",  # named as the file names it
        "tls.key '/nonexistent/key.pem' is not a readable file",
        "failure_timeout must exceed heartbeat_interval",  # a flag's value against a default
        "deltaflow.testing.NoSuchReceiver: module deltaflow.testing has no NoSuchReceiver",
    ):
        assert problem in said, done.stderr
    assert "--tls-cert" not in done.stderr
    assert said[-1] == "configuration NOT valid"


def test_config_check_reaches_the_store_and_names_a_missing_bucket(
    s3_server: S3Server, bucket: str, tmp_path: Path
) -> None:
    config = tmp_path / "node.toml"
    options = "\n".join(
        f'{k} = "{v}"' for k, v in s3_server.storage_options.items() if "SECRET" not in k
    )
    config.write_text(
        f'node_id = "n1"\nwarehouse = "{bucket}/w"\nengine = "delta-rs"\n'
        f"[storage_options]\n{options}\n"
    )
    secret = {"DELTAFLOW_STORAGE_OPTIONS_AWS_SECRET_ACCESS_KEY": s3_server.secret_key}
    good = deltaflow("config", "check", str(config), env=secret)
    assert good.returncode == 0, good.stdout + good.stderr
    assert f"{bucket}/w reachable" in good.stdout
    config.write_text(config.read_text().replace(bucket, "s3://no-such-bucket"))
    missing = deltaflow("config", "check", str(config), env=secret)
    assert missing.returncode == 69, missing.stdout + missing.stderr
    assert (
        "warehouse s3://no-such-bucket/w cannot be reached: 404 Not Found: NoSuchBucket: "
        "The specified bucket does not exist" in missing.stderr
    )
    assert "Traceback" not in missing.stderr
    # 69 is a valid configuration whose store is out of reach, and says so.
    assert missing.stderr.splitlines()[-1] == (
        "configuration valid, but the warehouse cannot be reached"
    )
    assert s3_server.secret_key not in missing.stdout + missing.stderr
    offline = deltaflow("config", "check", str(config), "--offline", env=secret)
    assert offline.returncode == 0, offline.stderr
    # A configuration that is not valid is 78, whatever the store: 69 promises it is valid.
    bad = deltaflow("config", "check", str(config), env={**secret, "DELTAFLOW_PARTITIONS": "x"})
    assert bad.returncode == 78, bad.stderr
    assert bad.stderr.splitlines()[-1] == "configuration NOT valid"


def test_version_is_printed() -> None:
    from importlib.metadata import version

    done = deltaflow("--version")
    assert done.returncode == 0
    assert done.stdout.strip() == f"deltaflow {version('deltaflow')}"


async def test_a_node_serves_from_a_config_file_and_the_environment(tmp_path: Path) -> None:
    port = free_port()
    config = tmp_path / "node.toml"
    config.write_text(
        f'node_id = "from-file"\nwarehouse = "{tmp_path / "w"}"\nengine = "delta-rs"\nport = 1\n'
    )
    token = tmp_path / "token"
    token.write_text("t0ken\n")
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("DELTAFLOW_")},
        "DELTAFLOW_CONFIG": str(config),
        "DELTAFLOW_PORT": str(port),
        "DELTAFLOW_TOKEN_FILE": str(token),
    }
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "deltaflow.cli", "serve", env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        async with asyncio.timeout(60):
            line = (await proc.stdout.readline()).decode()
        assert line.strip() == f"deltaflow node from-file ready on 127.0.0.1:{port}"
        async with aiohttp.ClientSession() as http:
            url = f"http://127.0.0.1:{port}/v1/cluster"
            async with http.get(url) as refused:
                assert refused.status == 401  # the token from the file's variable holds
            async with http.get(url, headers={"Authorization": "Bearer t0ken"}) as resp:
                assert resp.status == 200
                assert (await resp.json())["node"] == "from-file"
    finally:
        proc.terminate()
        await proc.wait()


def test_every_setting_is_in_the_configuration_reference() -> None:
    """docs/configuration.md lists each setting with its flag and variable: an operator reads
    the page, not the code."""
    from deltaflow.server.node_settings import SETTINGS

    page = (Path(__file__).parent.parent / "docs" / "configuration.md").read_text()
    rows = {line.split("|")[1].strip(" `"): line for line in page.splitlines() if "| `" in line}
    for setting in SETTINGS:
        row = rows.get(setting.key)
        assert row is not None, f"{setting.key} is missing from docs/configuration.md"
        assert setting.env in row, row
        assert setting.option is None or f"`{setting.option}`" in row, row
