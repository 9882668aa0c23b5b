"""A finished generation frees its caches when its last user lets go, not whenever Python's cycle collector next
runs: a cache in a reference cycle kept gigabytes alive between decode benchmarks' arms (16 rows x 4k positions
of SmolLM2 is 3 GB a cache) until the machine ran out of memory."""

from __future__ import annotations

import gc

import pytest

from sparserl.engine import KVConfig, RolloutEngine
from sparserl.engine.cache import KVCache
from sparserl.models import tiny_model

KVS = [
    KVConfig(),
    KVConfig(method="block_topk", budget=16, page_size=4, dense_layers=[0]),
    KVConfig(method="snapkv", budget=16, window=4, interval=4),
]


@pytest.mark.parametrize("share_prompts", [True, False])
@pytest.mark.parametrize("kv", KVS, ids=lambda kv: kv.method)
def test_no_cache_outlives_its_generation_without_the_cycle_collector(kv, share_prompts):
    model, tok = tiny_model("llama", seed=0)
    gc.collect()
    gc.disable()
    try:
        engine = RolloutEngine(model, tok, kv=kv, share_prompts=share_prompts)
        engine.generate([[1, 2, 3] * 10], n=3, max_new_tokens=8, seed=0)
        del engine
        alive = [type(o).__name__ for o in gc.get_objects() if isinstance(o, KVCache)]
    finally:
        gc.enable()
    assert alive == []
