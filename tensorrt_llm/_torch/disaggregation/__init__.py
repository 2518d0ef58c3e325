"""Disaggregated serving: a context server prefills, a generation server pulls the KV and decodes.

- ``params``: the typed messages servers and router exchange (JSON, never pickled);
- ``transceiver``: whole KV slots over NIXL, and the pull-completion notification;
- ``context_only`` / ``generation_only``: the two ends of one request on the executor.
"""
