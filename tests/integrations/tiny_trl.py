"""Tiny TRL setups built in code (no downloads): a word-level tokenizer, a 2-layer Llama from a config, data sets of
texts, prompt/completion pairs and preferences, and the comparisons the TRL tests make against the plain trainer."""

import math
import os
import tempfile
from typing import Any, Dict, List, Optional

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

from datasets import Dataset  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402

WORDS = [f"w{i}" for i in range(60)]
VOCAB = 64  # 4 special tokens and the words

# What the trainers log per step that the plain trainer's must equal.
LOGGED = (
    "loss",
    "grad_norm",
    "num_tokens",
    "entropy",
    "mean_token_accuracy",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
    "logits/chosen",
    "logits/rejected",
    "min_reward",
    "mean_reward",
    "max_reward",
    "accuracy",
    "margin",
    "kl",
    "reward",
    "reward_std",
    "completions/mean_length",
    "clip_ratio/low_mean",
    "clip_ratio/high_mean",
    "clip_ratio/region_mean",
    "clip_ratio/low_min",
    "clip_ratio/high_max",
)


def tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{word: i + 4 for i, word in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def llama(seed: int = 0, labels: Optional[int] = None) -> torch.nn.Module:
    """A 2-layer Llama of width 32 (a sequence classifier with `labels` outputs when given)."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    if labels is None:
        return LlamaForCausalLM(config)
    from transformers import LlamaForSequenceClassification

    config.num_labels = labels
    return LlamaForSequenceClassification(config)


def texts(count: int, seed: int = 0, shortest: int = 3, longest: int = 40) -> List[str]:
    generator = torch.Generator().manual_seed(seed)
    found = []
    for length in torch.randint(shortest, longest, (count,), generator=generator).tolist():
        words = torch.randint(0, len(WORDS), (length,), generator=generator).tolist()
        found.append(" ".join(WORDS[i] for i in words))
    return found


def text_dataset(count: int = 32) -> Dataset:
    return Dataset.from_dict({"text": texts(count)})


def prompt_completion_dataset(count: int = 32) -> Dataset:
    found = texts(2 * count, seed=1, longest=20)
    return Dataset.from_dict({"prompt": [p + " " for p in found[:count]], "completion": found[count:]})


def preference_dataset(count: int = 16) -> Dataset:
    found = texts(3 * count, seed=2, longest=16)
    prompts = [p + " " for p in found[:count]]  # the completion starts at a word
    return Dataset.from_dict({"prompt": prompts, "chosen": found[count : 2 * count], "rejected": found[2 * count :]})


def prompt_dataset(count: int = 16) -> Dataset:
    return Dataset.from_dict({"prompt": texts(count, seed=3, longest=8)})


def word_reward(completions: List[str], **kwargs: Any) -> List[float]:
    """A reward function for GRPO: how often a completion says "w1"."""
    return [float(completion.count("w1")) for completion in completions]


def output_dir() -> str:
    return tempfile.mkdtemp(prefix="toma-trl-")


def common_args(**overrides: Any) -> Dict[str, Any]:
    """fp32 (TRL's configs default to bf16, also on the CPU), SGD, a log line per step, nothing saved."""
    args: Dict[str, Any] = dict(
        output_dir=output_dir(),
        per_device_train_batch_size=16,
        max_steps=2,
        learning_rate=0.5,
        optim="sgd",
        report_to="none",
        use_cpu=True,
        bf16=False,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    args.update(overrides)
    return args


def refuse_more_than(tokens: int, once_at: Optional[int] = None):
    """A forward pre-hook standing in for the GPU's out-of-memory error: a training forward pass over more than
    `tokens` positions (rows x width) runs out of memory, and so does the `once_at`-th pass that fits (once), so
    that an attempt fails after some micro-batches already ran. Passes without gradients (generation, reference
    log-probabilities) are left alone."""
    seen = {"fitting": 0}

    def hook(module: Any, args: Any, kwargs: Dict[str, Any]) -> None:
        ids = kwargs.get("input_ids")
        if ids is None or not torch.is_grad_enabled():
            return
        if ids.numel() > tokens:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        seen["fitting"] += 1
        if once_at is not None and seen["fitting"] == once_at:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    return hook


def logged(trainer: Any) -> List[Dict[str, float]]:
    """The training log entries, the keys the comparison reads."""
    return [{k: v for k, v in entry.items() if k in LOGGED} for entry in trainer.state.log_history if "loss" in entry]


def relative_distance(model: torch.nn.Module, reference: torch.nn.Module, start: torch.nn.Module) -> float:
    """How far `model`'s parameters are from `reference`'s, over how far training moved `reference`'s from
    `start`'s."""
    apart = sum(
        float((p - q).detach().double().pow(2).sum()) for p, q in zip(model.parameters(), reference.parameters())
    )
    moved = sum(
        float((q - s).detach().double().pow(2).sum()) for q, s in zip(reference.parameters(), start.parameters())
    )
    return math.sqrt(apart) / math.sqrt(moved)


def assert_same_logs(found: List[Dict[str, float]], expected: List[Dict[str, float]], rtol: float = 1e-4) -> None:
    assert len(found) == len(expected), (found, expected)
    for step, (mine, theirs) in enumerate(zip(found, expected), start=1):
        assert mine.keys() == theirs.keys(), (step, mine, theirs)
        for key, value in theirs.items():
            assert math.isclose(mine[key], value, rel_tol=rtol, abs_tol=1e-6), (step, key, mine[key], value)
