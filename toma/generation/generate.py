"""`toma.generate(model, **generate_kwargs)`: Hugging Face `model.generate` whose batch adapts to memory mid-decode.

Memory grows during generation (the KV cache gains a position per row per step), so a batch that starts fine can
fail at step 300. Here the batch is a queue of parts (rows of the batch, with what they generated so far and their
KV cache), each run through `model.generate` itself (its logits processors, stopping criteria, sampling). Where a
part runs out of memory in a decode step, what it generated in the complete steps is kept (a stopping criterion
records the sequences after every step), its cache is cropped back to the last complete step
(`toma.generation.kv_cache`), its finished rows leave the batch, and the engine's smaller size splits the rest: each
part continues from where it was, its cache cut by rows (the parts waiting their turn keep theirs on the host when
the model is on a GPU); no sequence is decoded from scratch again. An error in the prompt's forward pass (prefill)
splits the part before any token is lost.

Greedy search gives `generate`'s sequences on the whole batch (rows are independent; fp32); sampling with a seed
is reproducible for the same memory, but a split draws the later tokens from the random stream in another order
(the rows of a smaller part). Beam search and encoder-decoder models split too, by restarting the part that failed
at the smaller size (their search state or encoder outputs are not carried across a split). Rows come back in the
batch's order, padded on the right with the pad token to the longest, as `generate` pads them.
"""

import logging
from typing import Any, Dict, Hashable, List, Optional, Tuple

import torch

from toma.core.call_sites import call_site_key
from toma.core.oom import should_reduce_batch_size
from toma.core.runner import Runner
from toma.core.steps import Step
from toma.generation.kv_cache import compacted, cropped, moved, narrowed
from toma.sizing.defaults import CALLS

__all__ = ["generate", "GenerateStep", "UNSUPPORTED"]

log = logging.getLogger("toma")

# generate's settings whose outputs are per step and cannot be joined across parts yet
UNSUPPORTED = ("output_scores", "output_logits", "output_attentions", "output_hidden_states")
CPU = torch.device("cpu")


class _Part:
    """Rows of the batch on their way: what they hold so far (prompt and generated tokens, attention mask), their KV
    cache (None before the prompt's forward pass), the tokens they generated, and what an attempt that failed left
    to settle (`progress`: the sequences after its last complete step and the cache it filled)."""

    __slots__ = ("rows", "sequences", "mask", "cache", "new", "progress")

    def __init__(self, rows: torch.Tensor, sequences: torch.Tensor, mask: torch.Tensor) -> None:
        self.rows, self.sequences, self.mask = rows, sequences, mask
        self.cache: Any = None
        self.new = 0
        self.progress: Optional[Tuple[Optional[torch.Tensor], Any]] = None


def _progress_recorder() -> Any:
    """A stopping criterion that stops nothing and keeps the sequences after each step (built lazily: it imports
    transformers)."""
    from transformers import StoppingCriteria

    class Progress(StoppingCriteria):  # type: ignore[misc]
        def __init__(self) -> None:
            self.sequences: Optional[torch.Tensor] = None

        def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
            self.sequences = input_ids
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    return Progress()


class GenerateStep(Step):
    """One `toma.generate` call as a step of the engine: each attempt runs the first part of the queue at `size` rows
    (splitting it where it holds more), True once every row is done."""

    size_name = "generation batch"
    __slots__ = (
        "func", "model", "kwargs", "name", "prompt_width", "max_new", "min_new", "eos", "pad", "continues",
        "pending", "done", "cache_keyword", "restarts", "released", "dict_output", "_device",
    )  # fmt: skip

    def __init__(
        self,
        model: Any,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        kwargs: Dict[str, Any],
        settings: "Settings",
        name: Optional[str] = None,
    ) -> None:
        self.model, self.func, self.kwargs, self.name = model, model.generate, kwargs, name
        self.prompt_width = input_ids.shape[1]
        self.max_new, self.min_new = settings.max_new, settings.min_new
        self.eos, self.pad, self.continues = settings.eos, settings.pad, settings.continues
        self.cache_keyword, self.dict_output = settings.cache_keyword, settings.dict_output
        self._device = input_ids.device
        rows = torch.arange(input_ids.shape[0])
        self.pending: List[_Part] = [_Part(rows, input_ids, attention_mask)] if input_ids.shape[0] else []
        self.done: List[Tuple[torch.Tensor, torch.Tensor]] = []  # (rows, their sequences)
        self.restarts = 0  # parts decoded again from their prompt (beam search, encoder-decoder models)
        self.released = 0  # times the kept caches were dropped for memory (their tokens' keys and values recomputed)

    @property
    def finished(self) -> bool:
        return not self.pending

    @property
    def device(self) -> Optional[torch.device]:
        return self._device if self._device.type != "cpu" else None

    def effective(self, size: int) -> int:
        """The rows an attempt at `size` runs: the first part's, at most."""
        return min(size, len(self.pending[0].rows)) if self.pending else size

    def __call__(self, size: int) -> bool:
        part = self.pending[0]
        self._settle(part)
        if not len(part.rows):
            self.pending.pop(0)
            return not self.pending
        if len(part.rows) > size:
            self._split(size)
            part = self.pending[0]
        self._run(part)
        self.pending.pop(0)
        return not self.pending

    def _run(self, part: _Part) -> None:
        kwargs = dict(self.kwargs)
        kwargs["max_new_tokens"] = self.max_new - part.new
        if self.min_new:
            kwargs["min_new_tokens"] = max(0, self.min_new - part.new)
        progress = _progress_recorder()
        from transformers import StoppingCriteriaList

        kwargs["stopping_criteria"] = StoppingCriteriaList([progress, *(kwargs.get("stopping_criteria") or [])])
        cache = None
        if self.continues:
            cache = moved(part.cache, self._device) if part.cache is not None else _new_cache(self.model)
            kwargs[self.cache_keyword] = cache
        try:
            out = self.func(input_ids=part.sequences, attention_mask=part.mask, **kwargs)
        except BaseException as error:
            # settled at the next attempt, once the failed step's memory is gone with its traceback
            part.progress = (progress.sequences, cache) if self.continues and should_reduce_batch_size(error) else None
            if not self.continues and should_reduce_batch_size(error):
                self.restarts += 1
            raise
        sequences = out.sequences if hasattr(out, "sequences") else out
        self.done.append((part.rows, sequences))

    def _settle(self, part: _Part) -> None:
        """After a failed attempt: keep what its complete steps generated, the cache cropped to them; finished rows
        leave the batch."""
        if part.progress is None:
            return
        sequences, cache = part.progress
        width = part.sequences.shape[1]
        if sequences is None or sequences.shape[1] <= width:  # no step completed
            if any(waiting.cache is not None for waiting in self.pending):
                # the caches kept hold the memory this step needs (views of the batch's cache before its split):
                # every part drops its own and computes it again from its tokens when its turn comes
                for waiting in self.pending:
                    waiting.cache = None
                self.released += 1
            part.progress = None
            return
        added = sequences.shape[1] - width
        cropped(cache, sequences.shape[1] - 1)  # the last token's keys and values are computed by the next step
        mask = torch.cat([part.mask, part.mask.new_ones((part.mask.shape[0], added))], 1)
        new = part.new + added
        generated = sequences[:, self.prompt_width :]
        ended = torch.isin(generated, torch.tensor(self.eos, device=generated.device)).any(1) if self.eos else None
        if new >= self.max_new:  # every row has all its tokens
            self.done.append((part.rows, sequences))
            part.rows, part.cache, part.progress = part.rows[:0], None, None
            return
        rows, kept_cache = part.rows, cache
        if ended is not None and bool(ended.any()):
            keep = (~ended).nonzero().squeeze(1)
            finished = ended.nonzero().squeeze(1)
            done = (rows[finished.cpu()], sequences.index_select(0, finished))
            rows, sequences, mask = rows[keep.cpu()], sequences.index_select(0, keep), mask.index_select(0, keep)
            compacted(cache, keep.tolist())  # in place, last: nothing before it changed the part
            kept_cache = cache if len(keep) else None
            self.done.append(done)
        part.rows, part.sequences, part.mask, part.cache, part.new = rows, sequences, mask, kept_cache, new
        part.progress = None

    def _split(self, size: int) -> None:
        """The first part cut into its first `size` rows and the rest, each with its rows of the cache (the rest's on
        the host while it waits, where the model is on a GPU)."""
        part = self.pending[0]
        first, rest = _Part(*_rows(part, 0, size)), _Part(*_rows(part, size, len(part.rows)))
        for piece in (first, rest):
            piece.new = part.new
        if part.cache is not None:
            # Views: nothing allocated where memory just ran out (the part that goes on drops its view at its next
            # step, the first one that grows its cache). Beside a GPU the rest waits on the host, and the part that goes
            # on gets its rows copied where they fit, so that the cache they all shared is freed.
            if self._device.type == "cuda":
                rest.cache = narrowed(part.cache, size, len(part.rows), CPU)
                try:
                    first.cache = narrowed(part.cache, 0, size, copied=True)
                except Exception as error:
                    if not should_reduce_batch_size(error):
                        raise
                    first.cache = narrowed(part.cache, 0, size)
            else:
                rest.cache, first.cache = narrowed(part.cache, size, len(part.rows)), narrowed(part.cache, 0, size)
        part.cache = None
        self.pending[:1] = [first, rest]
        log.debug("toma: generation split %d rows into %d and %d", len(part.rows), len(first.rows), len(rest.rows))

    def result(self) -> Any:
        """The batch's sequences in its row order, right-padded with the pad token to the longest."""
        rows = sum(len(rows) for rows, _ in self.done)
        width = max((sequences.shape[1] for _, sequences in self.done), default=self.prompt_width)
        sample = self.done[0][1] if self.done else torch.zeros(0, dtype=torch.long)
        joined = torch.full((rows, width), self.pad, dtype=sample.dtype, device=sample.device)
        for indices, sequences in self.done:
            joined[indices.to(joined.device), : sequences.shape[1]] = sequences
        return joined


def _rows(part: _Part, start: int, stop: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return part.rows[start:stop], part.sequences[start:stop], part.mask[start:stop]


def _new_cache(model: Any) -> Any:
    from transformers import DynamicCache

    try:
        return DynamicCache(config=model.config)
    except TypeError:  # an older DynamicCache takes no config
        return DynamicCache()


class Settings:
    """What one `toma.generate` call resolved from its arguments and the model's generation config, checked once."""

    __slots__ = ("max_new", "min_new", "eos", "pad", "continues", "cache_keyword", "dict_output")

    def __init__(self, model: Any, prompt_width: int, kwargs: Dict[str, Any]) -> None:
        config = kwargs.get("generation_config") or getattr(model, "generation_config", None)

        def setting(name: str) -> Any:
            return kwargs[name] if kwargs.get(name) is not None else getattr(config, name, None)

        for name in UNSUPPORTED:
            if setting(name):
                raise ValueError(
                    f"toma.generate: {name}=True is not supported yet (its per-step outputs are not joined)"
                )
        max_new, max_length = setting("max_new_tokens"), kwargs.get("max_length")
        if max_new is None:
            max_length = max_length if max_length is not None else getattr(config, "max_length", None)
            if max_length is None:
                raise ValueError("toma.generate: give max_new_tokens= (or max_length=)")
            max_new = max_length - prompt_width
        if not isinstance(max_new, int) or max_new < 0:
            raise ValueError(f"toma.generate: max_new_tokens must be a whole number >= 0, got {max_new!r}")
        self.max_new, self.min_new = max_new, int(setting("min_new_tokens") or 0)
        eos = setting("eos_token_id")
        self.eos: List[int] = (
            [] if eos is None else [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]
        )
        pad = setting("pad_token_id")
        self.pad = int(pad) if pad is not None else (self.eos[0] if self.eos else 0)
        beams = setting("num_beams") or 1
        encoder_decoder = bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False))
        self.continues = beams == 1 and not encoder_decoder and not setting("num_beam_groups")
        self.cache_keyword = _cache_keyword()
        self.dict_output = bool(setting("return_dict_in_generate"))


def _cache_keyword() -> str:
    """generate's name for a cache given to it: `cache` where transformers has it (5.24 on), else the older one."""
    try:
        from transformers.generation import utils

        return "cache" if "cache" in getattr(utils, "ALL_CACHE_NAMES", ()) else "past_key_values"
    except ImportError:
        return "past_key_values"


def generate(
    model: Any,
    input_ids: Optional[torch.Tensor] = None,
    attention_mask: Optional[torch.Tensor] = None,
    *,
    initial_batch: Optional[int] = None,
    cache_type: Any = None,
    context: Optional[Hashable] = None,
    policy: Any = None,
    **generate_kwargs: Any,
) -> Any:
    """`model.generate(input_ids=..., attention_mask=..., **generate_kwargs)` that splits its batch where memory runs
    out, mid-decode: every part continues from the last complete step (greedy and sampling on decoder-only models),
    finished rows leave, and the rows come back in the batch's order, padded as `generate` pads them. The batch size
    (`initial_batch`, all rows by default) shrinks on out-of-memory errors and is remembered per call site (or
    `context`), as any toma size; `cache_type` and `policy` as the forms take them. With
    `return_dict_in_generate=True` the output is the model's output class holding `sequences`."""
    if not callable(getattr(model, "generate", None)):
        raise TypeError(f"toma.generate: model must have a generate method, got {type(model).__name__}")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError("toma.generate: input_ids must be a (rows, tokens) tensor of token ids")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    elif not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
        raise ValueError("toma.generate: attention_mask must be a tensor shaped like input_ids")
    for name in ("past_key_values", "cache"):
        if generate_kwargs.get(name) is not None:
            raise ValueError(f"toma.generate: {name}= is toma's to manage (each part of the batch gets its own)")
    if initial_batch is not None and (
        isinstance(initial_batch, bool) or not isinstance(initial_batch, int) or initial_batch < 1
    ):
        raise ValueError(f"toma.generate: initial_batch must be a whole number >= 1, got {initial_batch!r}")
    settings = Settings(model, input_ids.shape[1], generate_kwargs)
    kwargs = {k: v for k, v in generate_kwargs.items() if k not in ("max_new_tokens", "max_length", "min_new_tokens")}
    step = GenerateStep(
        model, input_ids, attention_mask, kwargs, settings, name=f"toma.generate({type(model).__name__})"
    )
    if step.finished:
        return input_ids.clone()
    runner = Runner(
        CALLS, cache_type=cache_type, context=context if context is not None else call_site_key(), policy=policy
    )
    runner.perform(step, initial_batch or input_ids.shape[0])
    sequences = step.result()
    if settings.dict_output:
        from transformers.generation.utils import GenerateDecoderOnlyOutput, GenerateEncoderDecoderOutput

        encoder_decoder = bool(getattr(model.config, "is_encoder_decoder", False))
        return (GenerateEncoderDecoderOutput if encoder_decoder else GenerateDecoderOnlyOutput)(sequences=sequences)
    return sequences
