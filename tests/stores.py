"""Redis and Mooncake Store servers for tests: started on 127.0.0.1 free ports, stopped by PID.

Import the fixtures into a conftest or test module. A fixture skips only when the server binary
is not installed (``scripts/setup.sh`` installs both); an installed server that does not start
is an error.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.cluster.stores import StoreProcess, start_store, store_binary


def _start(kind: str, workdir: Path) -> StoreProcess:
    if store_binary(kind) is None:
        pytest.skip(f"the {kind} store is not installed (scripts/setup.sh installs it)")
    return start_store(kind, workdir)


def start_redis(workdir: Path) -> StoreProcess:
    return _start("redis", workdir)


def start_mooncake(workdir: Path) -> StoreProcess:
    return _start("mooncake", workdir)


@pytest.fixture(scope="session")
def redis_store(tmp_path_factory):
    store = start_redis(tmp_path_factory.mktemp("redis"))
    yield store
    store.stop()


@pytest.fixture(scope="session")
def mooncake_store(tmp_path_factory):
    store = start_mooncake(tmp_path_factory.mktemp("mooncake"))
    yield store
    store.stop()


@pytest.fixture(params=["redis", "mooncake"])
def any_store(request):
    """Each backend in turn (the session's server)."""
    return request.getfixturevalue(f"{request.param}_store")
