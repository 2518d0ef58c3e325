"""The executors of several ranks, above the single-rank ``PyExecutor``: tensor parallelism's
leader and followers kept in step by rank commands (``ranks``, ``commands``) and attention data
parallelism's executor with its prefix-affinity router (``data_parallel``, ``affinity``)."""
