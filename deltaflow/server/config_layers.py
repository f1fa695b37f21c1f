"""Where a node's settings come from: defaults, a TOML file, ``DELTAFLOW_*`` environment
variables and ``deltaflow serve`` flags, in rising precedence.

:data:`SETTINGS` is the one list of them: each has a key in the file (``port``,
``tls.cert``, ``spark.master``), an environment variable (``DELTAFLOW_PORT``,
``DELTAFLOW_TLS_CERT``), usually a flag (``--port``), a type and a default. :func:`resolve`
layers the sources and remembers where each value came from (``deltaflow config show``);
:func:`node_config` turns the result into a :class:`~deltaflow.server.NodeConfig`. Secrets
come from files (``token_file``) or the environment (``DELTAFLOW_TOKEN``), never from flags.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal

from ..errors import UsageError
from ..storage.stores import is_secret_option
from .node_settings import BY_KEY, SECTIONS, SETTINGS, Kind, Setting

__all__ = [
    "CONFIG_ENV",
    "EX_CONFIG",
    "ConfigError",
    "Resolved",
    "add_flags",
    "node_config",
    "resolve",
    "secret_on_command_line",
    "storage_options_from_env",
]

#: The environment variable naming the config file when ``--config`` is not given.
CONFIG_ENV: Final = "DELTAFLOW_CONFIG"
#: The exit code of a configuration that is not valid (sysexits' EX_CONFIG, as Vector's).
EX_CONFIG: Final = 78

Source = Literal["default", "file", "env", "flag"]


class ConfigError(UsageError):
    """The settings are not valid: every problem found, each naming its key and source.

    ``deltaflow serve`` and ``deltaflow config check`` exit with :data:`EX_CONFIG` on it.
    """

    def __init__(self, problems: Sequence[str], resolved: Resolved | None = None) -> None:
        self.problems = list(problems)
        #: What did resolve (the bad settings at their defaults): a check goes on with it.
        self.resolved = resolved
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"the configuration is not valid:\n{lines}")


@dataclass(frozen=True, slots=True)
class Value:
    value: Any
    source: Source


@dataclass(frozen=True, slots=True)
class Resolved:
    """Every setting's value and where it came from; ``file`` is the config file read."""

    values: Mapping[str, Value]
    file: Path | None = None

    def __getitem__(self, key: str) -> Any:
        return self.values[key].value

    def named(self, key: str) -> str:
        """How an error names the setting: by the flag or variable that set it, else by key."""
        setting, source = BY_KEY[key], self.values[key].source
        if source == "flag" and setting.option:
            return setting.option
        return setting.env if source == "env" else key

    def show(self) -> list[tuple[str, str, Source]]:
        """(key, value as TOML would write it, source) for every setting, secrets masked."""
        out = []
        for setting in SETTINGS:
            value = self.values[setting.key]
            out.append((setting.key, _shown(setting, value.value), value.source))
        return out

    def masked(self) -> dict[str, dict[str, Any]]:
        """``{key: {"value": ..., "source": ...}}`` with secrets masked, for ``--json``."""
        out: dict[str, dict[str, Any]] = {}
        for setting in SETTINGS:
            value = self.values[setting.key]
            out[setting.key] = {"value": _masked(setting, value.value), "source": value.source}
        return out


MASK: Final = "********"


def _masked(setting: Setting, value: Any) -> Any:
    if value is None:
        return None
    if setting.kind == "secret":
        return MASK
    if setting.kind == "map":
        return {k: MASK if is_secret_option(k) else v for k, v in value.items()}
    return value


def _shown(setting: Setting, value: Any) -> str:
    import json

    value = _masked(setting, value)
    if value is None:
        return "(unset)"
    if isinstance(value, dict):
        return (
            "{ " + ", ".join(f"{json.dumps(k)} = {json.dumps(v)}" for k, v in value.items()) + " }"
        )
    return json.dumps(value)


def add_flags(parser: argparse.ArgumentParser) -> None:
    """Add every setting that has a flag to ``parser``, with its default and variable in the
    help; a flag not given leaves no attribute, so the other sources show through."""
    parser.add_argument(
        "--config",
        metavar="FILE",
        default=argparse.SUPPRESS,
        help=f"a TOML file of settings (default: ${CONFIG_ENV}, else none)",
    )
    for s in SETTINGS:
        if s.option is None:
            continue
        shown = "none" if s.default in (None, [], {}) else s.default
        required = "required" if s.required else f"default: {shown}"
        text = f"{s.help} [{required}; {s.env}]"
        common: dict[str, Any] = {"dest": s.dest, "default": argparse.SUPPRESS, "help": text}
        if s.kind == "bool":
            parser.add_argument(s.option, action=argparse.BooleanOptionalAction, **common)
        elif s.kind in ("map", "int-map") or (s.kind == "list" and s.key != "peers"):
            parser.add_argument(s.option, action="append", metavar=s.metavar, **common)
        else:
            metavar = None if s.choices else (s.metavar or _METAVARS[s.kind])
            parser.add_argument(s.option, metavar=metavar, choices=s.choices or None, **common)


_METAVARS: Final = {"int": "N", "float": "SECONDS", "path": "FILE", "str": "TEXT"}


def resolve(
    flags: argparse.Namespace | None = None,
    env: Mapping[str, str] | None = None,
    file: str | os.PathLike[str] | None = None,
    *,
    require: bool = True,
) -> Resolved:
    """Layer defaults < file < environment < flags.

    ``file`` None: ``--config`` among the flags, else ``$DELTAFLOW_CONFIG``, else no file.
    ``require`` False: settings a node cannot start without may be missing (a command that
    reads only the warehouse).

    Raises:
        ConfigError: a file that cannot be read or parsed, unknown keys, values of the wrong
            type or outside their choices, a secret given on the command line, a required
            setting missing. Every problem is listed.
    """
    env = os.environ if env is None else env
    if file is None:
        file = getattr(flags, "config", None) or env.get(CONFIG_ENV) or None
    problems: list[str] = []
    values: dict[str, Value] = {s.key: Value(_copy(s.default), "default") for s in SETTINGS}
    path = Path(file) if file else None
    layers: list[tuple[Source, dict[str, Any]]] = []
    if path is not None:
        layers.append(("file", _read_file(path, problems)))
    layers.append(("env", _from_env(env, problems)))
    if flags is not None:
        layers.append(("flag", _from_flags(flags, problems)))
    for source, layer in layers:
        for key, value in layer.items():
            if isinstance(value, dict):  # a table's entries layer one by one
                value = {**values[key].value, **value}
            values[key] = Value(value, source)
    for s in SETTINGS:
        if require and s.required and values[s.key].value in (None, ""):
            how = f"{s.option}, " if s.option else ""
            problems.append(f"{s.key} is required: set it with {how}{s.env} or in the file")
    if problems:
        raise ConfigError(problems, Resolved(values, path))
    return Resolved(values, path)


def _copy(default: Any) -> Any:
    return type(default)(default) if isinstance(default, (list, dict)) else default


def _read_file(path: Path, problems: list[str]) -> dict[str, Any]:
    try:
        with path.open("rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        problems.append(f"{path}: cannot be read: {exc.strerror or exc}")
        return {}
    except tomllib.TOMLDecodeError as exc:
        problems.append(f"{path}: not TOML: {exc}")
        return {}
    out: dict[str, Any] = {}
    for name, value in data.items():
        if name in SECTIONS and isinstance(value, dict):
            for inner, item in value.items():
                _file_value(path, f"{name}.{inner}", item, out, problems)
        else:
            _file_value(path, name, value, out, problems)
    return out


def _file_value(path: Path, key: str, value: Any, out: dict[str, Any], problems: list[str]) -> None:
    setting = BY_KEY.get(key)
    where = f"{path}: {key}"
    if setting is None:
        problems.append(f"{where}: unknown key{_suggest(key, BY_KEY)}")
        return
    if setting.kind == "secret":
        problems.append(
            f"{where}: a secret is not kept in the config file; put it in a file named by "
            f"{key}_file, or in {setting.env}"
        )
        return
    checked = _typed(setting, value, where, problems)
    if checked is not _INVALID:
        out[key] = checked


_INVALID: Final = object()


def _typed(setting: Setting, value: Any, where: str, problems: list[str]) -> Any:
    """``value`` from a TOML file, checked against the setting's type."""
    kind = setting.kind
    ok: bool
    if kind == "bool":
        ok = isinstance(value, bool)
    elif kind == "int":
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind == "float":
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif kind == "list":
        ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
    elif kind == "map":
        ok = isinstance(value, dict) and all(isinstance(v, str) for v in value.values())
    elif kind == "int-map":
        ok = isinstance(value, dict) and all(
            isinstance(v, int) and not isinstance(v, bool) for v in value.values()
        )
    else:  # str, path
        ok = isinstance(value, str)
    if not ok:
        problems.append(f"{where}: expected {_EXPECTED[kind]}, got {_describe(value)}")
        return _INVALID
    return _chosen(setting, value, where, problems)


def _chosen(setting: Setting, value: Any, where: str, problems: list[str]) -> Any:
    """``value``, if it is one of the setting's choices (or it has none)."""
    if setting.choices and value not in setting.choices:
        problems.append(f"{where}: {value!r} is not one of {', '.join(setting.choices)}")
        return _INVALID
    return value


_EXPECTED: Final = {
    "bool": "true or false",
    "int": "an integer",
    "float": "a number",
    "list": "a list of strings",
    "map": "a table of strings",
    "int-map": "a table of integers",
    "str": "a string",
    "path": "a path (a string)",
    "secret": "a string",
}


def _describe(value: Any) -> str:
    kind = {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
            list: "a list", dict: "a table"}.get(type(value), type(value).__name__)  # fmt: skip
    return f"{kind} ({value!r:.60})"


def _suggest(name: str, known: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(known), n=1)
    return f" (did you mean {close[0]}?)" if close else ""


def _from_env(env: Mapping[str, str], problems: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    by_env = {s.env: s for s in SETTINGS}
    if options := storage_options_from_env(env):
        out["storage_options"] = options
    for name, text in env.items():
        setting = by_env.get(name)
        if setting is None or setting.kind == "map":
            continue
        value = _parsed(setting, text, name, problems)
        if value is not _INVALID:
            out[setting.key] = value
    return out


def storage_options_from_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The storage options the environment sets, one variable each:
    ``DELTAFLOW_STORAGE_OPTIONS_AWS_ENDPOINT_URL=...`` sets ``AWS_ENDPOINT_URL``."""
    env = os.environ if env is None else env
    prefix = BY_KEY["storage_options"].env + "_"
    return {name[len(prefix) :]: value for name, value in env.items() if name.startswith(prefix)}


def secret_on_command_line(flag: str, name: str) -> str:
    """The refusal of the secret storage option ``name`` given by ``flag``."""
    return (
        f"{flag} {name}=...: a secret is never given on the command line (it shows in ps and "
        f"shell history); set {BY_KEY['storage_options'].env}_{name} (or the store's own "
        f"variable, such as {name} for AWS_*) or put it in the config file"
    )


def _from_flags(flags: argparse.Namespace, problems: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for s in SETTINGS:
        if not hasattr(flags, s.dest):
            continue
        given = getattr(flags, s.dest)
        where = s.option or s.key
        if s.kind in ("map", "int-map") or (s.kind == "list" and s.key != "peers"):
            if s.kind == "list":
                out[s.key] = list(given)
                continue
            pairs: dict[str, Any] = {}
            for text in given:
                parsed = _parsed(s, text, where, problems)
                if parsed is _INVALID:
                    continue
                if s.kind == "map" and any(is_secret_option(k) for k in parsed):
                    problems.append(secret_on_command_line(where, text.partition("=")[0]))
                    continue
                pairs.update(parsed)
            out[s.key] = pairs
            continue
        value = given if s.kind == "bool" else _parsed(s, given, where, problems)
        if value is not _INVALID:
            out[s.key] = value
    return out


_TRUE: Final = ("1", "true", "yes", "on")
_FALSE: Final = ("0", "false", "no", "off")


def _parsed(setting: Setting, text: str, where: str, problems: list[str]) -> Any:
    """``text`` from an environment variable or a flag, as the setting's type."""
    try:
        value = _convert(setting.kind, text)
    except ValueError:
        problems.append(f"{where}: expected {_EXPECTED_TEXT[setting.kind]}, got {text!r:.60}")
        return _INVALID
    return _chosen(setting, value, where, problems)


def _convert(kind: Kind, text: str) -> Any:
    """Raises ValueError when ``text`` is not of ``kind``."""
    if kind == "int":
        return int(text)
    if kind == "float":
        return float(text)
    if kind == "bool":
        word = text.strip().lower()
        if word not in _TRUE + _FALSE:
            raise ValueError(text)
        return word in _TRUE
    if kind == "list":
        return [part.strip() for part in text.split(",") if part.strip()]
    if kind in ("map", "int-map"):
        value: dict[str, Any] = {}
        for part in (p for p in text.split(",") if p.strip()):
            name, sep, item = part.partition("=")
            if not (sep and name.strip()):
                raise ValueError(part)
            value[name.strip()] = int(item) if kind == "int-map" else item
            if kind == "int-map" and value[name.strip()] < 1:
                raise ValueError(part)
        return value
    return text


_EXPECTED_TEXT: Final = {
    **_EXPECTED,
    "bool": "true or false",
    "list": "comma-separated values",
    "map": "NAME=VALUE",
    "int-map": "NAME=N with N >= 1",
}


def node_config(resolved: Resolved) -> Any:
    """The :class:`~deltaflow.server.NodeConfig` the settings describe.

    Raises:
        ConfigError: the values do not make a node (each check of ``NodeConfig``, a token
            file that cannot be read, TLS files missing...).
    """
    try:
        return _node_config(resolved)
    except ConfigError:
        raise
    except UsageError as exc:
        raise ConfigError(getattr(exc, "problems", None) or [str(exc)], resolved) from exc


#: The settings that are SparkConfig's fields of the same name, after ``spark.``.
SPARK_CONFIG_KEYS: Final = tuple(
    k for k in BY_KEY if k.startswith("spark.") and k != "spark.writer"
)


def _node_config(r: Resolved) -> Any:
    """The node's config; every problem is found and each named by the key, variable or flag
    that set it (one pass of ``config check`` lists them all)."""
    from ..engines.options import SPARK, SparkOptions, engine_options
    from ..security import read_secret
    from ..spark_integration.session import SparkConfig
    from .node_config import NodeConfig

    problems: list[str] = []
    tls = _tls(r, problems)
    secrets: dict[str, str | None] = {}
    for name in ("token", "peer_token"):
        path = r[f"{name}_file"]
        if path and r[name]:
            problems.append(f"{r.named(name + '_file')} and {r.named(name)} are both set: keep one")
        try:
            secrets[name] = read_secret(path, r.named(f"{name}_file")) if path else r[name]
        except UsageError as exc:
            problems.append(str(exc))
            secrets[name] = "unread"  # judged as given by the checks below
    engine: Any = engine_options(r["engine"]) if r["engine"] != SPARK else None
    try:  # checked whatever the engine, as the Spark settings always were
        spark = SparkOptions(
            config=SparkConfig(
                app_name=f"deltaflow-{r['node_id']}",  # one application per node
                log_level=r["log.spark_level"],
                **{k.removeprefix("spark."): r[k] for k in SPARK_CONFIG_KEYS},
            ),
            writer=r["spark.writer"],
        )
        engine = engine or spark
    except UsageError as exc:
        problems.append(str(exc))
        engine = engine or engine_options("delta-rs")  # the other checks go on
    # Every other setting is named as NodeConfig's field it fills.
    fields = {f.name: r[f.name] for f in dataclasses.fields(NodeConfig) if f.name in BY_KEY}
    fields.update(secrets, tls=tls, engine=engine)
    if tls is None and (r["tls.cert"] or r["tls.key"]):
        fields["insecure"] = True  # its TLS is reported above: no second word on credentials
    try:
        config = NodeConfig(**fields)
    except UsageError as exc:
        problems.extend(getattr(exc, "problems", None) or [str(exc)])
    if problems:
        raise ConfigError(problems, r)
    return config


def _tls(r: Resolved, problems: list[str]) -> Any:
    """The node's TLS settings, or None (none given, or their problems added)."""
    from ..security import NodeTls

    cert, key, ca, client_auth = (
        r[k] for k in ("tls.cert", "tls.key", "tls.ca", "tls.client_auth")
    )
    if not (cert or key):
        if ca or client_auth:
            problems.append(
                f"{r.named('tls.ca')} and {r.named('tls.client_auth')} need "
                f"{r.named('tls.cert')} and {r.named('tls.key')}"
            )
        return None
    found = len(problems)
    if not (cert and key):
        problems.append(f"{r.named('tls.cert')} and {r.named('tls.key')} go together")
    problems.extend(
        f"{r.named(name)} {r[name]!r} is not a readable file"
        for name in ("tls.cert", "tls.key", "tls.ca")
        if r[name] and not os.path.isfile(r[name])
    )
    if client_auth and not ca:
        problems.append(
            f"{r.named('tls.client_auth')} needs {r.named('tls.ca')}: the CA whose "
            "certificates clients and peers must present"
        )
    return NodeTls(cert, key, ca, client_auth) if len(problems) == found else None
