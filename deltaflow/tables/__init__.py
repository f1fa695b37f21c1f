"""Engine-neutral Delta machinery: what a node does to a table whichever engine commits.

Table settings and the bucket layout (:mod:`.settings`), row validation and conversion
(:mod:`.conversion`, :mod:`.rows`), the group commit (:mod:`.committer`), lane marks for
exactly-once (:mod:`.marks`), the commit-atomicity seam (:mod:`.atomicity`), the Delta log
reader, merge-on-read, maintenance, and the delta-rs engine (:mod:`.deltars_engine`). Spark
lives in :mod:`deltaflow.spark_integration`; choosing between the two, in
:mod:`deltaflow.engines`. Nothing here imports the client.

Importing this package imports neither pyarrow nor delta-rs.
"""

from .settings import BUCKET_COLUMN, TableSettings, read_table_settings

__all__ = ["BUCKET_COLUMN", "TableSettings", "read_table_settings"]
