"""The turn-end save's copy on the engine thread, measured on the CPU it runs on.

A hybrid sequence's turn end is the state at its last decode page boundary: the runner packs the
state slot (every KDA layer's recurrent state and conv window) each time a decode crosses a page.
This times that pack for one Kimi K3-sized slot (69 KDA layers, fp32 recurrent states, bf16 conv
windows: 428.6 MiB) two ways:

- ``pack``: into a new tensor each time (the packed copy kept per decoding sequence before);
- ``pack_into``: into a row allocated once per slot (the host row the runner keeps now).

Method: one torch thread, one warm-up call, the median of ``--repeats`` calls. A ratio within one
run is what to compare; the absolute times depend on the machine's memory bandwidth and load.

    python perf/bench_turn_end_copy.py [--repeats 5]
"""

from __future__ import annotations

import argparse

import torch

from kvtier.model.kimi_linear_config import kimi_k3
from kvtier.model.state_slots import StateSlots
from timing import median_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    slots = StateSlots(kimi_k3(), 1, conv_dtype=torch.bfloat16)
    row = torch.empty(slots.checkpoint_bytes, dtype=torch.uint8)
    fresh = median_s(lambda: slots.pack(0), args.repeats)
    into = median_s(lambda: slots.pack_into(0, row), args.repeats)
    print(f"K3 state slot: {slots.checkpoint_bytes:,} bytes ({slots.checkpoint_bytes / 2**20:.1f} MiB)")
    print(f"pack into a new tensor: {fresh * 1e3:.1f} ms; pack_into a row kept per slot: {into * 1e3:.1f} ms; "
          f"ratio {fresh / into:.2f}x")


if __name__ == "__main__":
    main()
