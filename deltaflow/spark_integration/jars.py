"""Resolve Delta Lake's JVM jars from Maven Central into a local cache, once.

Spark finds Delta through two jars (``delta-spark`` and ``delta-storage``) whose version must
match the installed ``delta-spark`` Python package. Since Delta 4.1 the ``delta-spark`` jar is
built per Spark minor and Scala version (``delta-spark_4.2_2.13``); before, per Scala version
(``delta-spark_2.12``). Both are read from the installed pyspark. They are fetched with Maven
(``mvn dependency:copy``) when it is installed, else straight from Maven Central over HTTPS
with the published SHA-1 checked, into ``$DELTAFLOW_JARS_DIR`` (default
``~/.cache/deltaflow/jars``). ``deltaflow jars`` does it ahead of time.
"""

from __future__ import annotations

import hashlib
import importlib.util
import itertools
import logging
import os
import shutil
import subprocess
import urllib.request
from importlib import metadata
from pathlib import Path

__all__ = ["delta_artifacts", "ensure_artifacts", "ensure_jars", "jars_dir", "pyspark_jars"]

log = logging.getLogger(__name__)

MAVEN_CENTRAL = "https://repo1.maven.org/maven2"
#: The first Delta release whose jar names carry the Spark minor version.
_PER_SPARK_MINOR = (4, 1)


def jars_dir() -> Path:
    default = Path.home() / ".cache" / "deltaflow" / "jars"
    return Path(os.environ.get("DELTAFLOW_JARS_DIR", default)).expanduser().resolve()


def pyspark_jars() -> Path | None:
    """The directory of the jars the installed pyspark ships (None without pyspark)."""
    spec = importlib.util.find_spec("pyspark")
    for location in (spec.submodule_search_locations or []) if spec else []:
        if (Path(location) / "jars").is_dir():
            return Path(location) / "jars"
    return None


def scala_binary() -> str:
    """The Scala binary version (``2.13``) the installed pyspark is built for, read from the
    ``scala-library`` jar it ships; by its major version if that is missing."""
    shipped = pyspark_jars()
    for jar in shipped.glob("scala-library-*.jar") if shipped else []:
        return ".".join(jar.stem.removeprefix("scala-library-").split(".")[:2])
    return "2.13" if _release(metadata.version("pyspark")) >= (4, 0) else "2.12"


def delta_artifacts() -> list[tuple[str, str, str]]:
    """(group, artifact, version) of the jars matching the installed delta-spark and pyspark."""
    version = metadata.version("delta-spark")
    scala = scala_binary()
    if _release(version) >= _PER_SPARK_MINOR:
        spark = ".".join(str(n) for n in _release(metadata.version("pyspark"))[:2])
        artifact = f"delta-spark_{spark}_{scala}"
    else:
        artifact = f"delta-spark_{scala}"
    return [("io.delta", artifact, version), ("io.delta", "delta-storage", version)]


def _release(version: str) -> tuple[int, ...]:
    """The numeric release of a version string (``4.2.0.dev1`` -> ``(4, 2, 0)``)."""
    numbers = []
    for part in version.split("."):
        digits = "".join(itertools.takewhile(str.isdigit, part))
        if not digits:
            break
        numbers.append(int(digits))
    return tuple(numbers)


def _jar_name(artifact: str, version: str) -> str:
    return f"{artifact}-{version}.jar"


def ensure_jars(directory: Path | None = None) -> list[Path]:
    """Paths of the Delta jars, fetching any that are missing.

    Raises:
        RuntimeError: a jar could not be fetched (says which and how to fetch it by hand).
    """
    return ensure_artifacts(delta_artifacts(), directory)


def ensure_artifacts(
    artifacts: list[tuple[str, str, str]], directory: Path | None = None
) -> list[Path]:
    """Paths of the jars of ``artifacts`` (group, artifact, version) in the cache, fetching
    any that are missing."""
    directory = directory or jars_dir()
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for group, artifact, version in artifacts:
        path = directory / _jar_name(artifact, version)
        if not path.exists():
            _fetch(group, artifact, version, path)
        paths.append(path)
    return paths


def _fetch(group: str, artifact: str, version: str, path: Path) -> None:
    coordinate = f"{group}:{artifact}:{version}"
    if shutil.which("mvn"):
        cmd = [
            "mvn",
            "-q",
            "-B",
            "dependency:copy",
            f"-Dartifact={coordinate}:jar",
            f"-DoutputDirectory={path.parent}",
        ]
        log.info("fetching %s with Maven", coordinate)
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode == 0 and path.exists():
            return
        log.warning("mvn could not fetch %s (%s); trying HTTPS", coordinate, done.stdout[-500:])
    url = f"{MAVEN_CENTRAL}/{group.replace('.', '/')}/{artifact}/{version}/{path.name}"
    try:
        with urllib.request.urlopen(url, timeout=120) as resp:
            data = resp.read()
        with urllib.request.urlopen(url + ".sha1", timeout=60) as resp:
            expected = resp.read().decode().split()[0].strip()
    except OSError as exc:
        raise RuntimeError(
            f"cannot fetch jar {coordinate} from Maven Central ({exc}); fetch it with "
            f"'mvn dependency:copy -Dartifact={coordinate}:jar -DoutputDirectory={path.parent}'"
        ) from exc
    if hashlib.sha1(data).hexdigest() != expected:  # SHA-1 because that is what Maven publishes
        raise RuntimeError(f"checksum mismatch for {url}; refusing to use it")
    tmp = path.with_suffix(".part")
    tmp.write_bytes(data)
    tmp.replace(path)
