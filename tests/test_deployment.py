"""The deployment files in ``deploy/``: the systemd unit passes ``systemd-analyze verify``, the
example node config passes ``deltaflow config check`` (its files made real), and the
Containerfile (no image registry is reachable here to build it) is linted against the
product: its extras, port, probe and entry point."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from deltaflow.server.node_config import DEFAULT_PORT
from deltaflow.testing.certificates import CertificateAuthority

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
ROOT = DEPLOY.parent


def test_the_systemd_unit_verifies(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.fail("systemd-analyze is missing (Debian's systemd package)")
    unit = (DEPLOY / "deltaflow.service").read_text()
    assert "ExecStart=/opt/deltaflow/bin/deltaflow serve" in unit
    assert "RestartPreventExitStatus=78" in unit  # a configuration error is not retried
    assert "KillSignal=SIGTERM" in unit  # the signal that drains
    # Verified as installed here: this machine's deltaflow, and a user that exists.
    local = unit.replace(
        "/opt/deltaflow/bin/deltaflow", str(Path(sys.executable).parent / "deltaflow")
    )
    local = re.sub(r"^(User|Group)=deltaflow$", r"\1=root", local, flags=re.MULTILINE)
    path = tmp_path / "deltaflow.service"
    path.write_text(local)
    done = subprocess.run(
        [analyze, "verify", str(path)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip() == "", done.stderr  # no unknown key, no bad value


def test_the_example_node_config_is_valid(tmp_path: Path) -> None:
    text = (DEPLOY / "node.toml").read_text()
    config = tomllib.loads(text)
    assert config["host"] == "0.0.0.0" and config["advertise"].endswith(f":{DEFAULT_PORT}")
    # Its files, made real under tmp_path: tokens and the host's certificate.
    ca = CertificateAuthority(tmp_path / "ca")
    issued = ca.issue("hosta", ["hosta.internal"])
    files = {
        "/etc/deltaflow/token": "client-token",
        "/etc/deltaflow/peer-token": "peer-token",
    }
    local = text
    for name, secret in files.items():
        (tmp_path / Path(name).name).write_text(secret)
        local = local.replace(f'"{name}"', f'"{tmp_path / Path(name).name}"')
    local = local.replace('"/etc/deltaflow/hosta.pem"', f'"{issued.cert}"')
    local = local.replace('"/etc/deltaflow/hosta.key"', f'"{issued.key}"')
    local = local.replace('"/etc/deltaflow/ca.pem"', f'"{ca.cert}"')
    settings = [line for line in local.splitlines() if not line.lstrip().startswith("#")]
    assert not any("/etc/deltaflow" in line for line in settings)  # every file made real
    path = tmp_path / "node.toml"
    path.write_text(local)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DELTAFLOW_")}
    done = subprocess.run(
        [sys.executable, "-m", "deltaflow.cli", "config", "check", str(path), "--offline"],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_containerfile_builds_what_the_product_is() -> None:
    text = (DEPLOY / "Containerfile").read_text()
    # Continuation lines joined, comments dropped: one instruction a line.
    lines = [
        line.strip()
        for line in re.sub(r"\\\n\s*", " ", text).splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    known = {"FROM", "ENV", "RUN", "WORKDIR", "COPY", "USER", "EXPOSE", "HEALTHCHECK",
             "ENTRYPOINT", "CMD", "ARG", "LABEL"}  # fmt: skip
    assert {line.split()[0] for line in lines} <= known
    stages: dict[str, list[str]] = {}
    current = ""
    for line in lines:
        if line.startswith("FROM "):
            current = line.split(" AS ")[-1].strip()
            stages[current] = []
        stages[current].append(line)
    assert set(stages) == {"base", "deltars", "spark"}
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    for target in ("deltars", "spark"):
        body = stages[target]
        installs = [e for line in body for e in re.findall(r'"\.\[(\w+)\]"', line)]
        assert installs == [target] and target in extras
        assert f"EXPOSE {DEFAULT_PORT}" in body
        assert "USER deltaflow" in body  # never root
        [probe] = [line for line in body if line.startswith("HEALTHCHECK")]
        assert f"http://127.0.0.1:{DEFAULT_PORT}/healthz" in probe
        assert body[-1] == 'ENTRYPOINT ["deltaflow", "serve"]'
    for line in stages["base"]:
        if line.startswith("COPY "):
            for source in line.split()[1:-1]:
                assert (ROOT / source).exists(), source
    assert "DELTAFLOW_CONFIG=/etc/deltaflow/node.toml" in " ".join(stages["base"])
