"""toma.generation.kv_cache: a Hugging Face DynamicCache cropped back to its last complete step, cut by rows as views
or copies, and compacted in place."""

import pytest
import torch

pytest.importorskip("transformers", minversion="5.23")

from transformers import DynamicCache  # noqa: E402

from toma.generation.kv_cache import compacted, cropped, length_of, moved, narrowed  # noqa: E402


def filled(rows: int = 4, lengths=(6, 5)) -> DynamicCache:
    """Two layers whose keys and values number each row and position; the first holds one position more (a step that
    failed in the second layer)."""
    cache = DynamicCache()
    for layer, length in enumerate(lengths):
        values = torch.arange(rows * length, dtype=torch.float32).reshape(rows, 1, length, 1).expand(rows, 2, length, 3)
        cache.update(values.clone(), -values.clone(), layer)
    return cache


def test_a_step_that_failed_part_way_is_cropped_back_to_the_shortest_layer():
    cache = filled()
    assert length_of(cache) == 5
    cropped(cache, length_of(cache))
    assert [layer.keys.shape[-2] for layer in cache.layers] == [5, 5]
    assert torch.equal(cache.layers[0].keys[:, 0, :, 0], torch.arange(24.0).reshape(4, 6)[:, :5])


def test_rows_as_views_share_the_cache_and_copies_do_not():
    cache = filled(lengths=(5, 5))
    view, copy = narrowed(cache, 1, 3), narrowed(cache, 1, 3, copied=True)
    for part in (view, copy):
        assert part.get_seq_length() == 5 and part.layers[1].values.shape[0] == 2
        assert torch.equal(part.layers[0].keys, cache.layers[0].keys[1:3])
    assert view.layers[0].keys.data_ptr() == cache.layers[0].keys[1:3].data_ptr()
    assert copy.layers[0].keys.data_ptr() != view.layers[0].keys.data_ptr()
    assert cache.layers[0].keys.shape[0] == 4  # the cache cut from is unchanged
    assert moved(copy, torch.device("cpu")) is copy


def test_compacting_keeps_the_rows_asked_for_in_order_without_a_new_cache():
    cache = filled(lengths=(5, 5))
    expected = [layer.keys[[0, 2, 3]].clone() for layer in cache.layers]
    pointer = cache.layers[0].keys.data_ptr()
    compacted(cache, [0, 2, 3])
    for layer, keys in zip(cache.layers, expected):
        assert torch.equal(layer.keys, keys) and torch.equal(layer.values, -keys)
    assert cache.layers[0].keys.data_ptr() == pointer  # in place
