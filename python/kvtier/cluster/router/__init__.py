"""``kvtier router``: an OpenAI-compatible front that sends each turn to one of several
``kvtier serve`` workers (:mod:`.routing` decides, :mod:`.app` proxies)."""
