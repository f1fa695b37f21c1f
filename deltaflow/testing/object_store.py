"""A real S3-compatible server for tests and benchmarks: versitygw over a local directory
(its ``posix`` backend), on 127.0.0.1 with fresh credentials, stopped by pid.

``make setup`` builds the pinned versitygw (:data:`VERSITYGW_VERSION`) into
``.tools/versitygw-<version>/``; ``DELTAFLOW_VERSITYGW`` names another binary.
"""

from __future__ import annotations

import os
import secrets
import sys
from pathlib import Path
from typing import Final

from .processes import free_port
from .servers import ServerProcesses, listening

__all__ = [
    "TOXIPROXY_VERSION",
    "VERSITYGW_VERSION",
    "LatencyS3",
    "S3Server",
    "UnconditionalS3",
    "toxiproxy_binary",
    "versitygw_binary",
]

#: The versitygw release ``make setup`` installs (``go install ...@v1.8.0``).
VERSITYGW_VERSION: Final = "v1.8.0"
_HOST = "127.0.0.1"


def _built_tool(name: str, version: str, variable: str, executable: str, package: str) -> Path:
    """A Go tool's binary: ``$variable``, else the one the Makefile built into
    ``.tools/<name>-<version>/<executable>``; FileNotFoundError (saying how) if absent."""
    default = Path(__file__).resolve().parents[2] / ".tools" / f"{name}-{version}" / executable
    binary = Path(os.environ.get(variable, default))
    if not binary.exists():
        raise FileNotFoundError(
            f"no {name} at {binary}: `make {name}` builds it (go install {package}@{version})"
        )
    return binary


def versitygw_binary() -> Path:
    """The versitygw binary: ``$DELTAFLOW_VERSITYGW``, else the one ``make setup`` built."""
    return _built_tool(
        "versitygw", VERSITYGW_VERSION, "DELTAFLOW_VERSITYGW", "versitygw",
        "github.com/versity/versitygw/cmd/versitygw",
    )  # fmt: skip


class S3Server(ServerProcesses):
    """versitygw serving the directory ``directory / "data"`` as S3 on 127.0.0.1 (or ``host``).

    ``endpoint`` is its URL; :attr:`storage_options` are what delta-rs, ``obstore`` and
    ``deltaflow --storage-option`` take to reach it; :meth:`create_bucket` makes a bucket.
    """

    def __init__(self, directory: Path, host: str = _HOST) -> None:
        super().__init__(directory)
        self.host = host
        self.port = free_port()
        self.endpoint = f"http://{host}:{self.port}"
        self.access_key = "deltaflow-" + secrets.token_hex(4)
        self.secret_key = secrets.token_hex(16)

    @property
    def storage_options(self) -> dict[str, str]:
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_REGION": "us-east-1",
            "AWS_ALLOW_HTTP": "true",
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def start(self) -> S3Server:
        data = self.directory / "data"
        data.mkdir(parents=True, exist_ok=True)
        command = [
            str(versitygw_binary()),
            "--access", self.access_key,
            "--secret", self.secret_key,
            "--port", f"{self.host}:{self.port}",
            "posix", str(data),
        ]  # fmt: skip
        self._start("versitygw", command, dict(os.environ))
        self._until(lambda: listening(self.host, self.port), "S3 server")
        return self

    def create_bucket(self, name: str) -> str:
        """Blocking: create bucket ``name`` (by the S3 API); its ``s3://`` URI."""
        import boto3  # type: ignore[import-untyped]

        client = boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name="us-east-1",
        )
        client.create_bucket(Bucket=name)
        return f"s3://{name}"


class UnconditionalS3(ServerProcesses):
    """A store that ignores conditional writes: :mod:`.unconditional`'s proxy in front of
    ``server``, in a process of its own on 127.0.0.1. :attr:`storage_options` reach ``server``'s
    buckets through it."""

    def __init__(self, directory: Path, server: S3Server) -> None:
        super().__init__(directory)
        self.server = server
        self.port = free_port()

    @property
    def storage_options(self) -> dict[str, str]:
        return {**self.server.storage_options, "AWS_ENDPOINT_URL": f"http://{_HOST}:{self.port}"}

    def start(self) -> UnconditionalS3:
        command = [
            sys.executable, "-m", "deltaflow.testing.unconditional",
            "--upstream", self.server.endpoint, "--port", str(self.port),
        ]  # fmt: skip
        self._start("unconditional", command, {**os.environ, **self.server.storage_options})
        self._until(lambda: listening(_HOST, self.port), "proxy ignoring conditional writes")
        return self


#: The Toxiproxy release ``make toxiproxy`` installs (Shopify's TCP proxy with injected
#: latency, ``go install github.com/Shopify/toxiproxy/v2/cmd/server@v2.12.0``).
TOXIPROXY_VERSION: Final = "v2.12.0"


def toxiproxy_binary() -> Path:
    """The Toxiproxy server: ``$DELTAFLOW_TOXIPROXY``, else the one ``make toxiproxy`` built."""
    return _built_tool(
        "toxiproxy", TOXIPROXY_VERSION, "DELTAFLOW_TOXIPROXY", "toxiproxy-server",
        "github.com/Shopify/toxiproxy/v2/cmd/server",
    )  # fmt: skip


class LatencyS3(ServerProcesses):
    """A store ``latency_ms`` further away: Toxiproxy in front of ``server`` on 127.0.0.1,
    delaying every answer by ``latency_ms`` (its ``latency`` toxic on the downstream, so each
    request's round trip grows by that much, as a remote store's would). :attr:`storage_options`
    reach ``server``'s buckets through it."""

    def __init__(self, directory: Path, server: S3Server, latency_ms: float) -> None:
        super().__init__(directory)
        self.server = server
        self.latency_ms = latency_ms
        self.port = free_port()
        self.api_port = free_port()

    @property
    def storage_options(self) -> dict[str, str]:
        return {**self.server.storage_options, "AWS_ENDPOINT_URL": f"http://{_HOST}:{self.port}"}

    def start(self) -> LatencyS3:
        command = [str(toxiproxy_binary()), "-host", _HOST, "-port", str(self.api_port)]
        self._start("toxiproxy", command, dict(os.environ))
        self._until(lambda: listening(_HOST, self.api_port), "Toxiproxy")
        self._api("/proxies", {
            "name": "s3", "listen": f"{_HOST}:{self.port}",
            "upstream": f"{self.server.host}:{self.server.port}", "enabled": True,
        })  # fmt: skip
        self._api("/proxies/s3/toxics", {
            "name": "latency", "type": "latency", "stream": "downstream", "toxicity": 1.0,
            "attributes": {"latency": round(self.latency_ms), "jitter": 0},
        })  # fmt: skip
        return self

    def _api(self, path: str, body: dict[str, object]) -> None:
        import json
        import urllib.request

        request = urllib.request.Request(
            f"http://{_HOST}:{self.api_port}{path}",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=10) as answer:
            answer.read()
