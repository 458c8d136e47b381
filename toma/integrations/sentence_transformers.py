"""sentence-transformers with toma: its trainer's batches (one column per text, `anchor_input_ids`,
`anchor_attention_mask`, ...) and corpus encoding that adapts to memory.

Training: `class Trainer(TomaTrainerMixin, SentenceTransformerTrainer)` (`toma.integrations.transformers`). A loss
that couples rows (MultipleNegativesRankingLoss, CoSENT, GIST, Matryoshka around them, the `Cached*` losses whose
mini-batches do not fit) trains by gradient caching (`toma.accumulation.gradient_cache`): the model's calls cut,
each call's rows grouped by length and trimmed. A loss of independent rows (CosineSimilarityLoss) trains in
micro-batches; with column-prefixed masks its rows are packed by their summed length and each column of a micro-batch
trimmed to its longest row (`prefixed_masks`, `trimmed_columns`).

Encoding: `encode(model, inputs, **encode_kwargs)` is `model.encode(inputs, **encode_kwargs)` by a token budget:
inputs sorted by length, run in chunks through `model.encode` itself (prompts, normalisation, truncation as it does
them), each chunk as many rows as fit the budget, the budget shrinking on out-of-memory errors and remembered per call
site; embeddings back in the inputs' order. sentence-transformers is imported only when `encode` is called.
"""

from collections.abc import Mapping
from typing import Any, Dict, Hashable, List, Optional, Sequence

import torch

from toma.core.arguments import check_size
from toma.core.policy import SizePolicy
from toma.forms.namespace import toma

__all__ = ["MASK_SUFFIX", "prefixed_masks", "summed_lengths", "trimmed_columns", "encode"]

MASK_SUFFIX = "_attention_mask"  # sentence-transformers' collator names a column's mask `{column}_attention_mask`
_PREPROCESS_BLOCK = 1024  # inputs tokenized at once to count their tokens (the host holds one block padded)
_REFUSED = {  # encode's settings that do not come out of chunks as they come out of one call, and why
    "output_value": "only sentence embeddings ('sentence_embedding') are joined across chunks",
    "pool": "a multi-process pool runs its own chunks",
    "chunk_size": "a multi-process pool's chunks",
}


def prefixed_masks(inputs: Any) -> Dict[str, torch.Tensor]:
    """The `(rows, width)` attention masks of a batch's columns, by the column's prefix (`anchor_` for
    `anchor_attention_mask`); empty where the batch is not a mapping or holds a plain `attention_mask` only."""
    if not isinstance(inputs, Mapping):
        return {}
    found: Dict[str, torch.Tensor] = {}
    for key, value in inputs.items():
        if isinstance(key, str) and key.endswith(MASK_SUFFIX) and key != MASK_SUFFIX[1:]:
            if isinstance(value, torch.Tensor) and value.dim() == 2:
                found[key[: -len(MASK_SUFFIX) + 1]] = value
    return found


def summed_lengths(inputs: Any) -> torch.Tensor:
    """Each row's tokens over all its columns (the sum of its columns' masks): how much of the batch a row is."""
    masks = prefixed_masks(inputs)
    if not masks:
        raise ValueError("summed_lengths: the batch holds no column masks such as 'anchor_attention_mask'")
    return sum(mask.detach().to("cpu").long().sum(1) for mask in masks.values())  # type: ignore[return-value]


def _trimmed_width(mask: torch.Tensor) -> Optional[int]:
    """The width a column's micro-batch keeps: past its last real token in any row; None where nothing can go (no
    trailing padding, or a row padded on the left: dropping leading positions would move the others)."""
    present = mask != 0
    if not bool(present.any()) or bool((present[:, 0] == 0).logical_and(present.any(1)).any()):
        return None
    used = present.any(0).nonzero()
    width = int(used.max()) + 1
    return width if width < mask.shape[1] else None


def trimmed_columns(inputs: Any) -> Any:
    """A micro-batch of a column-prefixed batch with each column's tensors (`{prefix}input_ids`,
    `{prefix}token_type_ids`, ... as wide as its mask) narrowed to the column's longest row in it: right padding
    only, which the model's attention mask keeps out of every real token's output."""
    masks = prefixed_masks(inputs)
    widths = {prefix: _trimmed_width(mask) for prefix, mask in masks.items()}
    if not any(width is not None for width in widths.values()):
        return inputs
    trimmed = dict(inputs)
    for prefix, width in widths.items():
        if width is None:
            continue
        full = masks[prefix].shape[1]
        for key, value in inputs.items():
            if (
                isinstance(key, str)
                and key.startswith(prefix)
                and isinstance(value, torch.Tensor)
                and value.dim() >= 2
                and value.shape[1] == full
            ):
                trimmed[key] = value[:, :width]
    return type(inputs)(trimmed) if not isinstance(inputs, dict) else trimmed


def _check_model(model: Any) -> None:
    if not callable(getattr(model, "encode", None)) or not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"encode: model must be a sentence-transformers model (an nn.Module with .encode), got {type(model).__name__}"
        )


def _lengths(model: Any, inputs: Sequence[Any], prompt: Optional[str]) -> List[int]:
    """Each input's length in tokens as the model's preprocessing counts them (its prompt included), tokenized a
    block at a time; where the preprocessing gives no attention mask, sentence-transformers' own size estimate."""
    found: List[int] = []
    for start in range(0, len(inputs), _PREPROCESS_BLOCK):
        block = list(inputs[start : start + _PREPROCESS_BLOCK])
        features = model.preprocess(block, prompt=prompt) if prompt else model.preprocess(block)
        mask = features.get("attention_mask") if isinstance(features, Mapping) else None
        if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[0] == len(block):
            found.extend(int(n) for n in mask.sum(1).tolist())
        else:
            found.extend(max(1, int(model._input_length(item))) for item in block)
    return found


def encode(
    model: Any,
    inputs: Any,
    batch_size: Optional[int] = None,
    *,
    cache_type: Any = None,
    context: Optional[Hashable] = None,
    policy: Optional[SizePolicy] = None,
    **encode_kwargs: Any,
) -> Any:
    """`model.encode(inputs, **encode_kwargs)` that adapts to memory: the inputs sorted by their token length and
    encoded in chunks of a token budget (`batch_size` rows of the longest to start; all of them by default) that
    shrinks on out-of-memory errors (chunks done are kept) and is remembered per call site (or `context`); each chunk
    through `model.encode` itself, so prompts, `normalize_embeddings`, `truncate_dim` and the rest act as they do
    there; `precision` quantizes the joined embeddings, as `encode` does. The embeddings come back in the inputs'
    order, as `encode` returns them (numpy by default, a tensor with `convert_to_tensor=True`)."""
    _check_model(model)
    for name, why in _REFUSED.items():
        if name in encode_kwargs and not (name == "output_value" and encode_kwargs[name] == "sentence_embedding"):
            raise ValueError(f"encode: {name}={encode_kwargs[name]!r} is not supported here ({why})")
    device = encode_kwargs.get("device")
    if isinstance(device, (list, tuple)):
        raise ValueError("encode: device= a list of devices starts a multi-process pool; give one device")
    initial = None if batch_size is None else check_size(batch_size, "batch_size")
    single = isinstance(inputs, str) or not isinstance(inputs, Sequence)
    items: List[Any] = [inputs] if single else list(inputs)
    convert_to_tensor = bool(encode_kwargs.pop("convert_to_tensor", False))
    convert_to_numpy = bool(encode_kwargs.pop("convert_to_numpy", True))
    precision = encode_kwargs.pop("precision", "float32")
    encode_kwargs.pop("show_progress_bar", None)
    encode_kwargs.pop("output_value", None)
    if not items:
        return model.encode(items, convert_to_tensor=convert_to_tensor, convert_to_numpy=convert_to_numpy)
    resolve = getattr(model, "_resolve_prompt", None)
    prompt = (
        resolve(encode_kwargs.get("prompt"), encode_kwargs.get("prompt_name"))
        if callable(resolve)
        else encode_kwargs.get("prompt")
    )
    lengths = torch.tensor(_lengths(model, items, prompt), dtype=torch.long)

    def embed(rows: torch.Tensor) -> torch.Tensor:
        chunk = [items[i] for i in rows.tolist()]
        found = model.encode(
            chunk,
            batch_size=len(chunk),
            show_progress_bar=False,
            convert_to_tensor=True,
            convert_to_numpy=False,
            **encode_kwargs,
        )
        return found if isinstance(found, torch.Tensor) else torch.stack(list(found))

    target = model.device if convert_to_tensor else torch.device("cpu")
    embeddings = toma.map(
        embed,
        torch.arange(len(items)),
        device="cpu",
        initial_step=initial,
        output_device=target,
        cache_type=cache_type,
        context=context,
        policy=policy,
        lengths=lambda rows: lengths[rows],
    )
    if precision and precision != "float32":  # on the whole corpus's embeddings, as encode quantizes them
        from sentence_transformers.util.quantization import quantize_embeddings

        embeddings = quantize_embeddings(embeddings, precision=precision)
    if convert_to_tensor:
        embeddings = torch.as_tensor(embeddings)
    elif convert_to_numpy and isinstance(embeddings, torch.Tensor):
        embeddings = (embeddings.float() if embeddings.dtype == torch.bfloat16 else embeddings).cpu().numpy()
    elif not convert_to_numpy:
        embeddings = list(torch.from_numpy(embeddings) if not isinstance(embeddings, torch.Tensor) else embeddings)
    return embeddings[0] if single else embeddings
