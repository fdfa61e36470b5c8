"""The native block hash (kvtier._C) against its pure-Python twin, and the chain's properties."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier import _C
from kvtier.cache import BLOCK_HASH_BYTES, block_hashes, block_hashes_py

token_lists = st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=300)


@settings(max_examples=200, deadline=None)
@given(tokens=token_lists, page_size=st.sampled_from([1, 3, 16, 64]), salt=st.binary(max_size=12))
def test_native_matches_python_twin(tokens, page_size, salt):
    assert block_hashes(tokens, page_size, salt=salt) == block_hashes_py(tokens, page_size, salt=salt)


def test_known_value_pins_the_definition():
    # sha256(16 zero bytes || le32(0) || le32(1) le32(2))[:16], computed independently with hashlib.
    import hashlib
    import struct
    want = hashlib.sha256(bytes(16) + struct.pack("<I", 0) + struct.pack("<2I", 1, 2)).digest()[:16]
    assert block_hashes([1, 2, 3], 2) == [want]
    assert len(want) == BLOCK_HASH_BYTES == 16


def test_chain_continues_from_parent_and_ignores_partial_block():
    tokens = list(range(1000, 1037))
    full = block_hashes(tokens, 8)
    assert len(full) == 4
    assert block_hashes(tokens[16:], 8, parent=full[1]) == full[2:]


def test_prefix_property_and_salt_isolation():
    a = list(range(64))
    b = a[:40] + [7] * 24
    ha, hb = block_hashes(a, 16), block_hashes(b, 16)
    assert ha[:2] == hb[:2] and ha[2] != hb[2] and ha[3] != hb[3]
    assert not set(block_hashes(a, 16, salt=b"tenant-1")) & set(ha)


def test_accepts_numpy_and_rejects_bad_input():
    arr = np.arange(32, dtype=np.int32)
    assert block_hashes(arr, 16) == block_hashes(arr.tolist(), 16)
    with pytest.raises(ValueError, match=r"token_ids\[1\]"):
        block_hashes([1, -5, 3], 2)
    with pytest.raises(ValueError, match="page_size"):
        block_hashes([1, 2], 0)
    with pytest.raises(ValueError, match="parent"):
        block_hashes([1, 2], 2, parent=b"short")
    with pytest.raises(ValueError, match="page_size"):
        block_hashes_py([1, 2], 0)


def test_module_is_the_native_build():
    assert _C.__file__.endswith(".so")
