"""The commit wing: how a group of staged writes becomes one Delta version, and who does what.

Two roles per table, on two sides of ``POST /v1/peer/commit``:

* the **owner** of a partition (:class:`.TableOwner`, :mod:`.owner`) queues its writes
  (:mod:`.staging`), takes them as groups, drops what the table holds, writes the group's data
  files and sends them, as a :class:`.PreparedCommit` (:mod:`.prepared`), to the table's
  committer; or commits the group itself where no committer takes it. What it knows of the
  table is :class:`.TableState`'s (:mod:`.owner_state`), how a group applies while the table is
  held :class:`.TableWriter`'s (:mod:`.owner_writes`);
* the table's **committer** (:class:`.TableCommitter`, :mod:`.committer`), one live node chosen
  by the cluster map (``deltaflow.server.commits`` picks it and carries the groups), commits
  the prepared groups of every owner in one version each, after checking that each group stays
  within its writer's partitions (:mod:`.ownership`).

Both hold the table's commit atomicity and write checkpoints the same way (:mod:`.holding`);
what each needs of the node's engine is a protocol of its own (:mod:`.engine`).
"""
