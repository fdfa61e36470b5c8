"""The token budget of the K2VV tool-call replay tests."""

MAX_TOKENS = 192  # room for the shortest complete turn of each request plus free choices
