"""``kvtier bench``: replay coding-agent sessions through the engine under several cache
configurations and report TTFT, TPOT, throughput and where cached tokens came from."""
