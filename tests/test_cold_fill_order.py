"""A request's missing experts are queued for the readers in file order (the experts of one
tensor lie back to back), whatever order the router named them in."""
import pytest

from moecached.engine.cache import ExpertCache
from moecached.engine.index import open_index


@pytest.fixture
def model(model_factory):
    return model_factory("qwen3-30b-a3b-Q4_K_M", layers=[0, 6, 7, 8], experts=16)


def test_missing_set_is_queued_in_file_order(model, tmp_path):
    idx = open_index(model)
    with ExpertCache(idx, slots=64, readers=2, lock_memory=False, arena_dir=str(tmp_path)) as cache:
        seen = []
        submit = cache.readers.submit

        def spy(reads, **kw):
            seen.append((int(reads[0][0]), int(reads[0][1])))
            return submit(reads, **kw)
        cache.readers.submit = spy
        l0, l1 = idx.expert_layers[:2]
        cache.release(cache.acquire_many([(l1, [9, 2, 14, 5]), (l0, [12, 3, 7])], timeout=30))
        assert len(seen) == 7 and seen == sorted(seen)
        want = sorted((idx.parts(l, e)[0].file, idx.parts(l, e)[0].offset)
                      for l, es in ((l1, [9, 2, 14, 5]), (l0, [12, 3, 7])) for e in es)
        assert seen == want
        seen.clear()
        cache.release(cache.acquire(l1, [9, 2, 15, 0], timeout=30))   # two hits, two misses
        assert seen == sorted(seen) and len(seen) == 2
