"""docs/kernels.md's example of mapping an engine's metadata onto the ops runs as written."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "docs" / "kernels.md"
MARKER = "<!-- example: engine-mapping"


def test_readme_engine_mapping_example_runs():
    text = README.read_text()
    block = re.search(r"```python\n(.*?)```", text[text.index(MARKER):], re.S)
    assert block is not None, "no python block after the example marker"
    scope: dict = {}
    exec(compile(block.group(1), f"{README}:engine-mapping", "exec"), scope)  # its own asserts check the results
    assert scope["out"].shape == (2, 16, 512) and scope["plan"].num_pages == 8
