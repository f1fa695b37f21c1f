"""Object stores by URI, through ``obstore``: the Python face of the Rust ``object_store``
crate that delta-rs writes Delta tables with, so deltaflow's own reads and writes see a store
exactly as the tables' commits do (S3 and S3-compatible stores, GCS, Azure).

Credentials and endpoint come from the standard environment variables (``AWS_ACCESS_KEY_ID``,
``AWS_ENDPOINT_URL``...) and from ``options`` (the same names, as delta-rs's storage options
take them); they are never logged.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Final
from urllib.parse import urlsplit

__all__ = [
    "OBJECT_STORE_SCHEMES",
    "is_object_store",
    "is_secret_option",
    "open_store",
    "reach_store",
    "redacted",
]

log = logging.getLogger(__name__)

#: URI schemes of warehouses on object storage (``s3a`` is Hadoop's name for ``s3``).
OBJECT_STORE_SCHEMES: Final = frozenset({"s3", "s3a", "gs", "az", "abfs", "abfss"})


#: Storage options that object_store takes as HTTP client options, by the names delta-rs
#: takes them under.
_CLIENT_OPTIONS: Final = {
    "aws_allow_http": "allow_http",
    "allow_http": "allow_http",
    "aws_allow_invalid_certificates": "allow_invalid_certificates",
    "allow_invalid_certificates": "allow_invalid_certificates",
}


def is_object_store(uri: str) -> bool:
    """Whether ``uri`` names a location on object storage rather than a local path."""
    return urlsplit(str(uri)).scheme.lower() in OBJECT_STORE_SCHEMES


def open_store(uri: str, options: Mapping[str, str] | None = None) -> Any:
    """An ``obstore`` store rooted at ``uri`` (``s3://bucket/prefix``), configured from the
    environment and ``options``."""
    from obstore.exceptions import UnknownConfigurationKeyError
    from obstore.store import from_url

    if urlsplit(uri).scheme.lower() == "s3a":
        uri = "s3" + uri[3:]
    config: Any = {}
    client: Any = {}
    for name, value in (options or {}).items():
        key = name.lower()
        if key in _CLIENT_OPTIONS:
            client[_CLIENT_OPTIONS[key]] = value.lower() in ("1", "true", "yes")
        else:
            config[key] = value
    while True:
        try:
            return from_url(uri, config=config or None, client_options=client or None)
        except UnknownConfigurationKeyError as exc:
            # A delta-rs storage option object_store does not take (AWS_EC2_METADATA_DISABLED):
            # it concerns the tables' engine only.
            unknown = [name for name in config if f"'{name}'" in str(exc)]
            if not unknown:
                raise
            log.debug("store option %s is for delta-rs only", unknown[0].upper())
            del config[unknown[0]]


_SECRET_WORDS: Final = ("SECRET", "TOKEN", "KEY", "PASSWORD", "SAS", "CREDENTIAL")


def is_secret_option(name: str) -> bool:
    """Whether the storage option ``name`` holds a credential (``AWS_SECRET_ACCESS_KEY``,
    ``AWS_ACCESS_KEY_ID``, ``AWS_SESSION_TOKEN``...): masked when shown, refused on a command
    line."""
    return any(word in name.upper() for word in _SECRET_WORDS)


def redacted(options: Mapping[str, str]) -> dict[str, str]:
    """``options`` fit for a log or a status page: secrets and keys replaced."""
    return {name: ("***" if is_secret_option(name) else value) for name, value in options.items()}


def reach_store(uri: str, options: Mapping[str, str] | None = None) -> None:
    """Blocking: list one page under ``uri``, which fails if the store cannot be reached, the
    credentials are refused or the bucket does not exist.

    Raises:
        obstore.exceptions.BaseError: what the store answered.
    """
    import obstore

    store = open_store(uri, options)
    for _ in obstore.list(store, chunk_size=1):
        break
