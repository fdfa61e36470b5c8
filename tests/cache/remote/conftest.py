from tests.stores import any_store, mooncake_store, redis_store  # noqa: F401
