"""Disaggregated serving: a context server prefills, a generation server pulls the KV and decodes.

- ``params``: the typed messages servers and router exchange (JSON, never pickled);
- ``transceiver``: whole KV slots over NIXL, and the pull-completion notification;
- ``context_only`` / ``generation_only``: the two ends of one request on the executor.

This module stays import-light (no torch): the user configs read the default below.
"""

# How long a context server holds a request's KV for a pull, and how long one pull may take.
DEFAULT_TRANSFER_TIMEOUT_S = 60.0
