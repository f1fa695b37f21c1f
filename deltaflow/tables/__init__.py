"""Engine-neutral Delta machinery: what a node does to a table whichever engine commits.

Table settings and the bucket layout (:mod:`.settings`), row validation and conversion
(:mod:`.conversion`, :mod:`.rows`), the commit wing (:mod:`.commit`: partition owners and
table committers), lane marks for exactly-once (:mod:`.marks`), the commit-atomicity seam
(:mod:`.atomicity`), the Delta log reader, merge-on-read, maintenance. The engines that commit
through it (delta-rs, Spark) and their factory are in :mod:`deltaflow.engines`; nothing here
imports them, Spark or the client.

Importing this package imports neither pyarrow nor delta-rs.
"""

from .settings import BUCKET_COLUMN, TableSettings, read_table_settings

__all__ = ["BUCKET_COLUMN", "TableSettings", "read_table_settings"]
