"""Everything with more than one worker, above the single-worker server (:mod:`kvtier.serve`):

- :mod:`.router`: the OpenAI-compatible router in front of several workers (routing policy,
  proxy, the global KV view from the workers' KV events, the P/D prefill stage);
- :mod:`.disagg`: prefill/decode roles of a worker (block export/import, incremental transfer,
  the role's routes and engine thread);
- :mod:`.launch`, :mod:`.pd_launch`, :mod:`.ray_launch`: ``kvtier cluster``, a store, N
  ``kvtier serve`` workers and a router, as processes on one machine or placed by Ray;
- :mod:`.stores`: the remote tier's stores (Redis, Mooncake Store) started for a cluster.

Nothing below this room (``serve/``, ``cache/``, ...) imports it.
"""


class StartupError(RuntimeError):
    """A role of the cluster (store, worker, router) did not start; the message names it, where
    it was started and the tail of its log."""
