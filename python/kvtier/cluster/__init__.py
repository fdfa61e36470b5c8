"""``kvtier cluster``: a store, N ``kvtier serve`` workers and a router, as processes on one
machine (:mod:`.launch`) or placed by Ray across machines (:mod:`.ray_launch`)."""


class StartupError(RuntimeError):
    """A role of the cluster (store, worker, router) did not start; the message names it, where
    it was started and the tail of its log."""
