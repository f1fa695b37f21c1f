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

__all__ = ["VERSITYGW_VERSION", "S3Server", "UnconditionalS3", "versitygw_binary"]

#: The versitygw release ``make setup`` installs (``go install ...@v1.8.0``).
VERSITYGW_VERSION: Final = "v1.8.0"
_HOST = "127.0.0.1"


def versitygw_binary() -> Path:
    """The versitygw binary: ``$DELTAFLOW_VERSITYGW``, else the one ``make setup`` built.

    Raises:
        FileNotFoundError: it is not there (says how to build it).
    """
    default = Path(__file__).resolve().parents[2] / ".tools" / f"versitygw-{VERSITYGW_VERSION}"
    binary = Path(os.environ.get("DELTAFLOW_VERSITYGW", default / "versitygw"))
    if not binary.exists():
        raise FileNotFoundError(
            f"no versitygw at {binary}: `make setup` builds it (go install "
            f"github.com/versity/versitygw/cmd/versitygw@{VERSITYGW_VERSION})"
        )
    return binary


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
