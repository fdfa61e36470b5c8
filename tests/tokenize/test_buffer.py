"""The fused token buffer: its hashes always equal the from-scratch chain over its ids."""

import threading

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier import _C
from kvtier.cache import block_hashes, block_hashes_py
from kvtier.tokenize.buffer import TokenBuffer

U32_MAX = 2**32 - 1


def check_against_scratch(buf: TokenBuffer, model: list[int]) -> None:
    assert len(buf) == len(model)
    assert buf.ids().tolist() == model
    expected = block_hashes(model, buf.page_size, salt=buf.salt)
    assert buf.num_blocks == len(model) // buf.page_size == len(expected)
    assert buf.block_hashes() == expected
    assert buf.last_hash == (expected[-1] if expected else bytes(16))


ids_st = st.lists(st.integers(0, U32_MAX), max_size=70)
op_st = st.one_of(st.tuples(st.just("append"), ids_st, st.sampled_from(["list", "u32", "i64", "torch"])),
                  st.tuples(st.just("truncate"), st.floats(0, 1)))


@settings(max_examples=1000, deadline=None)
@given(page_size=st.sampled_from([1, 2, 7, 16, 64]), salt=st.sampled_from([b"", b"tenant-a", b"\x00\xff"]),
       ops=st.lists(op_st, max_size=25))
def test_random_appends_truncates_match_scratch(page_size, salt, ops):
    buf = TokenBuffer(page_size, salt)
    model: list[int] = []
    for op in ops:
        if op[0] == "append":
            _, ids, kind = op
            if kind == "u32":
                arg = np.array(ids, dtype=np.uint32)
            elif kind == "i64":
                arg = np.array(ids, dtype=np.int64)
            elif kind == "torch":
                arg = torch.tensor(ids, dtype=torch.int64)
            else:
                arg = ids
            buf.append(arg)
            model.extend(ids)
        else:
            n = int(op[1] * len(model))
            buf.truncate(n)
            del model[n:]
        check_against_scratch(buf, model)


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("salt", [b"", b"s1"])
def test_matches_python_twin_and_rolls_back(page_size, salt):
    rng = np.random.default_rng(page_size)
    ids = rng.integers(0, 2**32, size=10 * page_size + 3, dtype=np.uint64).tolist()
    buf = TokenBuffer(page_size, salt)
    buf.append(ids)
    full = block_hashes_py(ids, page_size, salt=salt)
    assert buf.block_hashes() == full
    assert buf.block_hashes(start=4) == full[4:]
    assert buf.block_hashes(start=buf.num_blocks) == []
    cut = 3 * page_size + page_size // 2
    buf.truncate(cut)
    assert buf.block_hashes() == full[: cut // page_size]
    buf.append(ids[cut:])  # re-append: the same chain
    assert buf.block_hashes() == full


def test_incremental_turns_hash_only_new_pages():
    buf = TokenBuffer(16)
    turns = [list(range(i * 100, i * 100 + 37 + i)) for i in range(20)]
    model: list[int] = []
    for t in turns:
        before = buf.num_blocks
        buf.append(t)
        model.extend(t)
        new = buf.block_hashes(start=before)
        assert new == block_hashes(model, 16)[before:]


def test_ids_view_is_zero_copy_and_read_only():
    buf = TokenBuffer(16)
    buf.reserve(1000)
    buf.append(list(range(100)))
    a = buf.ids()
    b = np.asarray(buf)
    m = memoryview(buf._buf)
    assert a.dtype == np.uint32 and a.shape == (100,) and not a.flags.writeable
    assert m.format == "I" and m.readonly and m.shape == (100,) and m.itemsize == 4
    ptr = a.__array_interface__["data"][0]
    assert b.__array_interface__["data"][0] == ptr == np.asarray(buf._buf).__array_interface__["data"][0]
    with pytest.raises(ValueError):
        a[0] = 5
    # Appends within capacity and truncation keep the storage; live views see the writes.
    buf.append([7] * 500)
    buf.truncate(50)
    buf.append([9] * 60)
    assert buf.ids().__array_interface__["data"][0] == ptr
    assert a[60] == 9 and a.shape == (100,)
    m.release()


def test_growth_refused_while_views_exist():
    buf = TokenBuffer(4)
    buf.append([1, 2, 3])
    view = buf.ids()
    assert buf.num_views == 1
    with pytest.raises(BufferError, match="view"):
        buf.append(list(range(buf.capacity + 1)))
    with pytest.raises(BufferError):
        buf.reserve(buf.capacity + 100)
    assert len(buf) == 3 and buf.ids().tolist() == [1, 2, 3]  # nothing appended on error
    del view
    assert buf.num_views == 0
    buf.append(list(range(10_000)))
    assert len(buf) == 10_003


@pytest.mark.parametrize("bad", [[-1], [2**32], [0, 2**70], np.array([5, -3]), np.array([2**32], dtype=np.uint64),
                                 torch.tensor([1, -1])])
def test_out_of_range_ids_raise_value_error(bad):
    buf = TokenBuffer(2)
    buf.append([1, 2, 3])
    with pytest.raises(ValueError, match=r"must be in \[0, 2\*\*32\)"):
        buf.append(bad)
    assert buf.ids().tolist() == [1, 2, 3] and buf.num_blocks == 1


@pytest.mark.parametrize("ids", [[7, 0, 2**32 - 1, 5], (7, 0, 2**32 - 1, 5), [np.int64(7), 0, np.uint32(2**32 - 1), 5]])
def test_lists_tuples_and_numpy_scalars_append_like_arrays(ids):
    buf, ref = TokenBuffer(2), TokenBuffer(2)
    buf.append(ids)
    ref.append(np.array([7, 0, 2**32 - 1, 5], dtype=np.uint32))
    assert buf.ids().tolist() == ref.ids().tolist() and buf.block_hashes() == ref.block_hashes()


def test_bad_list_item_names_its_index_and_appends_nothing():
    buf = TokenBuffer(2)
    with pytest.raises(ValueError, match=r"ids\[2\] must be in"):
        buf.append([1, 2, -5, 4])
    with pytest.raises(TypeError):
        buf.append([1, True])  # bool is not a token id
    assert len(buf) == 0


def test_bad_arguments():
    with pytest.raises(ValueError, match="page_size"):
        TokenBuffer(0)
    with pytest.raises(ValueError, match="page_size"):
        TokenBuffer(-4)
    buf = TokenBuffer(2)
    buf.append([1, 2, 3])
    with pytest.raises(ValueError, match="1-D"):
        buf.append(np.zeros((2, 2), dtype=np.int64))
    for bad in ([1.5], np.array([1.0]), np.array([True]), ["a"]):
        with pytest.raises(TypeError, match="integer"):
            buf.append(bad)
    with pytest.raises(ValueError, match="truncate"):
        buf.truncate(4)
    with pytest.raises(ValueError, match="truncate"):
        buf.truncate(-1)
    with pytest.raises(ValueError, match="start"):
        buf.block_hashes(start=2)
    with pytest.raises(ValueError, match="capacity"):
        buf.reserve(-1)
    buf.append([])  # empty is fine
    assert len(buf) == 3


def test_large_appends_from_threads():
    """Appends above the GIL-release threshold from several threads serialise correctly."""
    buf = _C.TokenBuffer(16)
    chunk = np.arange(50_000, dtype=np.uint32)
    threads = [threading.Thread(target=buf.append, args=(chunk,)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(buf) == 200_000
    ids = np.asarray(buf)
    assert (ids.reshape(4, -1) == chunk).all()
    assert buf.block_hashes() == block_hashes(ids, 16)


def test_chain_for_reads_the_hashes_only_for_its_own_ids_page_size_and_salt():
    buf = TokenBuffer(8, salt=b"s")
    ids = list(range(3, 3 + 8 * 3 + 5))
    buf.append(ids)
    assert buf.chain_for(np.asarray(ids, dtype=np.int64), 8, b"s") == block_hashes_py(ids, 8, salt=b"s")
    assert buf.chain_for(ids, 8, b"s") == buf.block_hashes()
    for args, match in [((ids, 16, b"s"), "page_size=8, expected page_size=16"),
                        ((ids, 8, b"t"), "salt"),
                        ((ids[:-1], 8, b"s"), "ids"),
                        ((ids[:-1] + [0], 8, b"s"), "ids")]:
        with pytest.raises(ValueError, match=match):
            buf.chain_for(*args)
    assert buf.num_views == 0  # the compare's view of the ids is gone: appends may grow the storage
