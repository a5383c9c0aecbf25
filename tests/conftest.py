import pytest

from ringctx.parallel.launch import RankPool

_pools: dict[int, RankPool] = {}


@pytest.fixture(scope="session")
def rank_pool():
    """rank_pool(W) -> a RankPool of W gloo ranks, started once per session and world size."""

    def get(world_size: int) -> RankPool:
        if world_size not in _pools:
            _pools[world_size] = RankPool(world_size, backend="gloo")
        return _pools[world_size]

    yield get
    for pool in _pools.values():
        pool.close()
    _pools.clear()
