"""A Hugging Face KV cache cut by rows and cropped back to its last complete step, without copying what is not kept.

An out-of-memory error in a decode step can leave a `DynamicCache` part-way through that step: the layers before the
one that failed hold one position more than the others. `cropped(cache, length)` puts every layer back to `length`
positions (the tokens whose keys and values were computed in complete steps). `narrowed(cache, start, stop)` is a cache
of the same kind holding rows `[start, stop)` (a part of the batch that goes on decoding) as views, or copies on the
host for a part that waits its turn; `compacted(cache, keep)` drops the rows of finished sequences in place. Nothing
the size of the cache is allocated: memory has just run out.
"""

import copy
from typing import Any, Iterator, List, Optional

import torch

__all__ = ["layers_of", "cropped", "narrowed", "compacted", "moved", "length_of"]


def layers_of(cache: Any) -> Iterator[Any]:
    """The cache's layers with keys and values (an encoder-decoder cache's self-attention layers)."""
    inner = getattr(cache, "self_attention_cache", cache)
    for layer in getattr(inner, "layers", []):
        if getattr(layer, "keys", None) is not None and isinstance(layer.keys, torch.Tensor):
            yield layer


def length_of(cache: Any) -> int:
    """The positions every layer holds (the shortest layer's: a step that failed part-way left others longer)."""
    lengths = [layer.keys.shape[-2] for layer in layers_of(cache)]
    return min(lengths) if lengths else 0


def cropped(cache: Any, length: int) -> None:
    """Every layer cut back to its first `length` positions, in place (views: nothing is copied)."""
    for layer in layers_of(cache):
        if layer.keys.shape[-2] > length:
            layer.keys = layer.keys[..., :length, :]
            layer.values = layer.values[..., :length, :]


def narrowed(cache: Any, start: int, stop: int, device: Optional[torch.device] = None, copied: bool = False) -> Any:
    """A cache of the same kind holding rows `[start, stop)` of the batch: views of the given one's keys and values
    (nothing allocated; they keep its memory alive), copies (`copied`: their own memory), or copies on `device`
    where given (the host, for a part that waits its turn)."""
    part = copy.copy(cache)
    part.layers = []
    for layer in getattr(cache, "layers", []):
        layer = copy.copy(layer)
        if getattr(layer, "keys", None) is not None and isinstance(layer.keys, torch.Tensor):
            layer.keys, layer.values = layer.keys[start:stop], layer.values[start:stop]
            if device is not None and layer.keys.device != device:
                layer.keys, layer.values = layer.keys.to(device), layer.values.to(device)
                if hasattr(layer, "device"):
                    layer.device = device
            elif copied:
                layer.keys, layer.values = layer.keys.clone(), layer.values.clone()
        part.layers.append(layer)
    return part


def compacted(cache: Any, keep: List[int]) -> None:
    """Only the rows `keep` (ascending) left in the cache, in place: each kept row copied down over a row that goes,
    then the layers narrowed to them, so that nothing the size of the cache is allocated (memory is short here)."""
    for layer in layers_of(cache):
        for position, row in enumerate(keep):
            if row != position:
                layer.keys[position].copy_(layer.keys[row])
                layer.values[position].copy_(layer.values[row])
        layer.keys, layer.values = layer.keys[: len(keep)], layer.values[: len(keep)]


def moved(cache: Any, device: torch.device) -> Any:
    """The cache with every layer on `device` (a part's cache brought back from the host), in place."""
    inner = getattr(cache, "self_attention_cache", None)
    if inner is not None:
        moved(inner, device)
        moved(cache.cross_attention_cache, device)
        return cache
    for layer in getattr(cache, "layers", []):
        if getattr(layer, "keys", None) is not None and isinstance(layer.keys, torch.Tensor):
            if layer.keys.device != device:
                layer.keys, layer.values = layer.keys.to(device), layer.values.to(device)
                if hasattr(layer, "device"):
                    layer.device = device
    return cache
