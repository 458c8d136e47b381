"""Tiny sentence-transformers setups built in code (no downloads): a word-level tokenizer and a 2-layer BERT saved to a
folder, a SentenceTransformer (Transformer + mean Pooling) loaded from it, anchor/positive(/score) data, a trainer run
with SGD, and the forward's out-of-memory stand-in for a model that takes one features dict."""

import os
import random
import tempfile
from typing import Any, Callable, Dict, List, Optional

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

from datasets import Dataset  # noqa: E402
from sentence_transformers import (  # noqa: E402
    SentenceTransformer,
    SentenceTransformerTrainingArguments,
)
from sentence_transformers.base.modules import Transformer  # noqa: E402
from sentence_transformers.sentence_transformer.modules import Pooling  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import BertConfig, BertModel, PreTrainedTokenizerFast  # noqa: E402
from transformers import logging as hf_logging  # noqa: E402

hf_logging.set_verbosity_error()

WORDS = [f"w{i}" for i in range(60)]


def build(path: str, hidden: int = 32, layers: int = 2, dropout: float = 0.0, seed: int = 0) -> str:
    """A word-level tokenizer and a BERT (no dropout by default: a split run draws other masks) saved to `path`."""
    vocab = {"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3, **{word: i + 4 for i, word in enumerate(WORDS)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]"
    ).save_pretrained(path)
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=len(vocab),
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=2,
        intermediate_size=2 * hidden,
        max_position_embeddings=128,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
    )
    BertModel(config).save_pretrained(path)
    return path


_built: Dict[tuple, str] = {}


def model_dir(**settings: Any) -> str:
    """A folder holding the tokenizer and BERT built with `settings`, built once per process."""
    key = tuple(sorted(settings.items()))
    if key not in _built:
        _built[key] = build(tempfile.mkdtemp(prefix="toma-st-"), **settings)
    return _built[key]


def sentence_model(**settings: Any) -> SentenceTransformer:
    """A fresh SentenceTransformer (BERT + mean pooling) on the CPU, its weights as `build` made them."""
    transformer = Transformer(model_dir(**settings))
    return SentenceTransformer(modules=[transformer, Pooling(transformer.get_embedding_dimension())], device="cpu")


def sentences(count: int, seed: int, longest: int = 12) -> List[str]:
    generator = random.Random(seed)
    return [" ".join(generator.choice(WORDS) for _ in range(generator.randint(2, longest))) for _ in range(count)]


def pairs(count: int = 64, score: bool = False, seed: int = 1, longest: int = 12) -> Dataset:
    """Anchor/positive texts of 2-`longest` words (and a similarity score in [0, 1] with `score=True`)."""
    columns: Dict[str, list] = {
        "anchor": sentences(count, seed, longest),
        "positive": sentences(count, seed + 100, longest),
    }
    if score:
        columns["score"] = [random.Random(seed + i).random() for i in range(count)]
    return Dataset.from_dict(columns)


def rows_of(args: tuple, kwargs: dict) -> int:
    """The rows of a forward's call: its first argument's (a features dict's `input_ids`), or a keyword's."""
    first = args[0] if args else next(iter(kwargs.values()))
    if isinstance(first, dict):
        first = first["input_ids"]
    return int(first.shape[0])


def refuse_above(module: torch.nn.Module, rows: int, seen: Optional[list] = None) -> None:
    """`module`'s forward raises an out-of-memory error (a stand-in) on more than `rows` rows; `seen` records each
    call's `(rows, width)`."""

    def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        features = args[0] if args else kwargs
        if seen is not None:
            seen.append(tuple(features["input_ids"].shape))
        if rows_of(args, kwargs) > rows:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (a stand-in)")

    module.register_forward_pre_hook(hook, with_kwargs=True)


def arguments(output_dir: str, **overrides: Any) -> SentenceTransformerTrainingArguments:
    settings: Dict[str, Any] = dict(
        output_dir=output_dir,
        per_device_train_batch_size=16,
        per_device_eval_batch_size=16,
        max_steps=4,
        learning_rate=0.5,
        optim="sgd",
        lr_scheduler_type="constant",
        report_to=[],
        bf16=False,
        seed=0,
        data_seed=0,
        save_strategy="no",
        logging_steps=1,
        dataloader_drop_last=True,
        use_cpu=True,
        disable_tqdm=True,
    )
    settings.update(overrides)
    return SentenceTransformerTrainingArguments(**settings)


def run(
    cls: type,
    make_loss: Callable[[SentenceTransformer], Any],
    output_dir: str,
    data: Dataset,
    oom_rows: Optional[int] = None,
    seen: Optional[list] = None,
    **overrides: Any,
) -> Dict[str, Any]:
    """Train a fresh model 4 steps with `cls` (SentenceTransformerTrainer, or toma's mixin on it) and evaluate it on
    the same data; the model, its eval_loss and the trainer."""
    model = sentence_model()
    if oom_rows is not None or seen is not None:
        refuse_above(model[0], oom_rows if oom_rows is not None else 1 << 30, seen)
    trainer = cls(
        model=model,
        args=arguments(output_dir, **overrides),
        train_dataset=data,
        eval_dataset=data,
        loss=make_loss(model),
    )
    trainer.train()
    evaluated = trainer.evaluate()
    return dict(model=model, eval_loss=evaluated.get("eval_loss"), evaluated=evaluated, trainer=trainer)


def largest_difference(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max(float((p - q).detach().abs().max()) for p, q in zip(a.parameters(), b.parameters()))


__all__ = [
    "WORDS",
    "build",
    "model_dir",
    "sentence_model",
    "sentences",
    "pairs",
    "rows_of",
    "refuse_above",
    "arguments",
    "run",
    "largest_difference",
]
