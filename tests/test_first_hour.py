"""A newcomer's first hour, following the README's words and the pages it points to: install
into a fresh virtualenv, start a node, run the "Ten lines", the CDC example on its sample
events, the object-storage recipe, and read the tables back as the docs say."""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from deltaflow.testing import free_port

ROOT = Path(__file__).parent.parent
README = (ROOT / "README.md").read_text()

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def block_after(text: str, heading: str, lang: str) -> str:
    """The first ``lang`` code block after ``heading``."""
    after = text.split(heading, 1)[1]
    return after.split(f"```{lang}\n", 1)[1].split("```", 1)[0]


def command(line: str) -> str:
    """A command of a shell block, its comment dropped."""
    return line.split("  #", 1)[0].strip()


@dataclass(frozen=True)
class Newcomer:
    venv: Path
    env: dict[str, str]

    @property
    def python(self) -> str:
        return str(self.venv / "bin" / "python")

    def run(self, *args: str, **kwargs: object) -> subprocess.CompletedProcess[str]:
        return subprocess.run(  # type: ignore[call-overload, no-any-return]
            list(args), env=self.env, capture_output=True, text=True, timeout=300, **kwargs
        )


@pytest.fixture(scope="module")
def newcomer(tmp_path_factory: pytest.TempPathFactory) -> Newcomer:
    """A virtualenv made and filled as the README's "Install" says."""
    install = block_after(README, "## Install", "sh").splitlines()
    venv_line, pip_line = command(install[0]), command(install[1])
    assert venv_line == "python3 -m venv .venv && . .venv/bin/activate"
    assert pip_line == "pip install -e '.[deltars]'"
    venv = tmp_path_factory.mktemp("newcomer") / "venv"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DELTAFLOW_", "VIRTUAL_ENV"))}
    env["PYTHONWARNINGS"] = "ignore:Editable installation"  # as the Makefile does
    shell = (
        f"{sys.executable} -m venv {venv} && . {venv}/bin/activate && cd {ROOT} && "
        f"{pip_line} --quiet --progress-bar off"
    )
    installed = subprocess.run(["bash", "-c", shell], env=env, capture_output=True, text=True)
    assert installed.returncode == 0, installed.stderr[-3000:]
    return Newcomer(venv, env)


@pytest.fixture
def started(newcomer: Newcomer, tmp_path: Path) -> Iterator[list[subprocess.Popen[bytes]]]:
    """Processes a test starts in the background; stopped (SIGTERM, then SIGKILL) after."""
    processes: list[subprocess.Popen[bytes]] = []
    yield processes
    for process in reversed(processes):
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()


def wait_for(log: Path, text: str, process: subprocess.Popen[bytes]) -> None:
    """Until ``text`` is in ``log`` (what a process prints once it is ready)."""
    deadline = time.monotonic() + 90
    while text not in log.read_text():
        assert process.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.1)


def wait_for_port(port: int, process: subprocess.Popen[bytes]) -> None:
    """Until something accepts connections on 127.0.0.1:``port``."""
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            assert process.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)


def read_back(newcomer: Newcomer, table: str, options: str = "") -> str:
    """docs/troubleshooting.md's read-back snippet on ``table`` (its stdout)."""
    docs = (ROOT / "docs" / "troubleshooting.md").read_text()
    code = block_after(docs, "<!-- read-back -->", "python").replace("/data/wh/events", table)
    if options:
        code = code.replace(f'DeltaTable("{table}")', f'DeltaTable("{table}", {options})')
    read = newcomer.run(newcomer.python, "-c", code)
    assert read.returncode == 0, read.stderr
    return read.stdout


def ten_lines(newcomer: Newcomer, port: int) -> None:
    code = block_after(README, "## Ten lines", "python")
    assert len(code.strip().splitlines()) <= 10
    ran = newcomer.run(newcomer.python, "-c", code.replace("127.0.0.1:7700", f"127.0.0.1:{port}"))
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert ran.stdout == "10000 rows in a committed Delta version\n"


def test_the_readme_starts_a_node_streams_its_ten_lines_and_the_cdc_example(
    newcomer: Newcomer, started: list[subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    # "A node to stream to, started first: `deltaflow serve ...`", on a port of its own.
    serve = re.search(r"started first: `(deltaflow serve [^`]+)`", README.replace("\n", " "))
    assert serve is not None
    port, warehouse = free_port(), tmp_path / "wh"
    args = shlex.split(serve.group(1).replace("/data/wh", str(warehouse)))
    log = tmp_path / "node.log"
    with log.open("w") as sink:
        started.append(
            subprocess.Popen(
                [str(newcomer.venv / "bin" / args[0]), *args[1:], "--port", str(port)],
                env=newcomer.env,
                stdout=sink,
                stderr=subprocess.STDOUT,
            )
        )
    wait_for(log, "ready on", started[-1])
    ten_lines(newcomer, port)
    assert read_back(newcomer, str(warehouse / "events")) == "10000\n"

    # The CDC example on its sample events, as `make demo-cdc` runs it.
    makefile = (ROOT / "Makefile").read_text()
    recipe = makefile.split("\ndemo-cdc:", 1)[1].split("\n\n", 1)[0].split("\n", 1)[1]
    cdc_args = shlex.split(recipe.replace("\\\n", " ").replace("$(PY)", ""))
    cdc = newcomer.run(newcomer.python, *cdc_args, cwd=ROOT)
    assert cdc.returncode == 0, cdc.stdout + cdc.stderr
    assert cdc.stdout.splitlines()[-1] == (
        "OK: the table holds the source's 8 rows, whatever order the changes came in"
    )


def test_the_object_storage_recipe_puts_the_ten_lines_in_a_bucket(
    newcomer: Newcomer, started: list[subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    """docs/object-storage.md, "Try it on your machine", word for word but for its paths and
    ports (the S3 server is the one `make test` builds, as `make versitygw` does)."""
    docs = (ROOT / "docs" / "object-storage.md").read_text()
    recipe = block_after(docs, "## Try it on your machine", "sh").replace("\\\n", " ")
    lines = [command(line) for line in recipe.splitlines() if command(line)]
    assert lines[0] == "make versitygw"
    s3_port, node_port = free_port(), free_port()
    here = {"/tmp/s3": str(tmp_path / "s3"), "127.0.0.1:7070": f"127.0.0.1:{s3_port}"}
    script = []
    for line in lines[1:]:
        for old, new in here.items():
            line = line.replace(old, new)
        script.append(line)
    server, exports, check_and_serve = script[1], script[2], script[3]
    assert server.endswith("&") and exports.startswith("export AWS_ENDPOINT_URL=")
    subprocess.run(["bash", "-c", script[0]], check=True)  # the bucket's directory
    s3_log, node_log = tmp_path / "s3.log", tmp_path / "node.log"
    with s3_log.open("w") as sink:
        started.append(
            subprocess.Popen(
                ["bash", "-c", f"exec {server.removesuffix('&')}"],
                cwd=ROOT,
                stdout=sink,
                stderr=subprocess.STDOUT,
            )
        )
    wait_for_port(s3_port, started[-1])  # the recipe's `&`: the shell goes on at once
    check, serve = (part.strip() for part in check_and_serve.split("&&"))
    shell = f". {newcomer.venv}/bin/activate && {exports} && "
    with node_log.open("w") as sink:
        started.append(
            subprocess.Popen(
                ["bash", "-c", f"{shell}{check} && exec {serve} --port {node_port}"],
                env=newcomer.env,
                stdout=sink,
                stderr=subprocess.STDOUT,
            )
        )
    wait_for(node_log, "ready on", started[-1])
    assert "conditional writes: OK" in node_log.read_text()  # `store check` before `serve`
    ten_lines(newcomer, node_port)
    # The table is in the bucket: read back with the recipe's settings as storage options.
    settings = dict(part.split("=", 1) for part in shlex.split(exports.removeprefix("export ")))
    assert read_back(newcomer, "s3://lake/warehouse/events", f"storage_options={settings!r}") == (
        "10000\n"
    )
