"""``kvtier cluster``: a store, N ``kvtier serve`` workers and a router on one machine, as processes."""
