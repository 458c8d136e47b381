"""sentence-transformers through toma (`toma.integrations.sentence_transformers`, and `TomaTrainerMixin` on its
trainer): its losses that couple rows (MultipleNegativesRankingLoss, CoSENT, GIST, Matryoshka, the Cached* losses)
and one that does not, trained and evaluated under out-of-memory errors to the plain trainer's parameters and
eval_loss; the column-prefixed masks packed and trimmed; `encode` against `model.encode`.

A tiny BERT from a config (no dropout: a split run draws other dropout masks than the unsplit one; that both passes of
gradient caching draw the same masks is tests/accumulation/test_gradient_cache.py's), SGD, fp32.
"""

import json

import numpy as np
import pytest
import torch

pytest.importorskip("sentence_transformers", minversion="6.2")

from sentence_transformers import SentenceTransformerTrainer  # noqa: E402
from sentence_transformers.sentence_transformer import losses  # noqa: E402

from toma import NoBatchsizeCache  # noqa: E402
from toma.integrations.sentence_transformers import encode, prefixed_masks, summed_lengths, trimmed_columns  # noqa: E402
from toma.integrations.transformers import TomaTrainerMixin  # noqa: E402

from helpers import COLLECT_TOMA_LOG, run_python  # noqa: E402
from tiny_sentence_transformers import (  # noqa: E402
    largest_difference,
    pairs,
    rows_of,
    run,
    sentence_model,
    sentences,
)

TOLERANCE = 1e-5


class TomaSentenceTrainer(TomaTrainerMixin, SentenceTransformerTrainer):
    pass


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def guided_by_a_second_model(model):
    return losses.GISTEmbedLoss(model, sentence_model(seed=1))


LOSSES = {
    "MultipleNegativesRankingLoss": (losses.MultipleNegativesRankingLoss, False, True),
    "CoSENTLoss": (losses.CoSENTLoss, True, True),
    "GISTEmbedLoss": (guided_by_a_second_model, False, True),
    "MatryoshkaLoss": (
        lambda model: losses.MatryoshkaLoss(model, losses.MultipleNegativesRankingLoss(model), [32, 16, 8]),
        False,
        True,
    ),
    "CachedMultipleNegativesRankingLoss": (
        lambda model: losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size=16),
        False,
        True,
    ),
    "CosineSimilarityLoss": (losses.CosineSimilarityLoss, True, False),
}


@pytest.mark.parametrize("name", list(LOSSES))
def test_each_loss_trains_and_evaluates_as_the_plain_trainer_with_the_forward_refusing_more_than_5_rows(tmp_path, name):
    """Batches of 16 anchor/positive pairs, 4 SGD steps, the forward refusing more than 5 rows (in training and in
    evaluation): the plain trainer's parameters (within 1e-5) and eval_loss; a loss that couples rows trains by
    gradient caching, one that does not in micro-batches."""
    make_loss, scored, couples = LOSSES[name]
    data = pairs(64, score=scored)
    plain = run(SentenceTransformerTrainer, make_loss, str(tmp_path / "plain"), data)
    seen = []
    toma = run(TomaSentenceTrainer, make_loss, str(tmp_path / "toma"), data, oom_rows=5, seen=seen)
    assert largest_difference(plain["model"], toma["model"]) <= TOLERANCE
    assert toma["eval_loss"] == pytest.approx(plain["eval_loss"], rel=TOLERANCE)
    stats = toma["trainer"].toma_stats
    assert stats.split_check.coupled == couples and stats.oom_retries >= 1, str(stats)
    assert max(rows for rows, _ in seen) > 5 and any(rows <= 5 for rows, _ in seen)  # it ran out, then fitted
    assert ("gradient caching" in str(stats)) == couples


def test_a_cached_loss_whose_mini_batches_fit_is_left_alone(tmp_path):
    """`CachedMultipleNegativesRankingLoss(mini_batch_size=4)` under a forward that refuses more than 5 rows: its own
    mini-batches fit, so toma never splits nor caches: the plain trainer's run."""
    make_loss = lambda model: losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size=4)  # noqa: E731
    data = pairs(64)
    plain = run(SentenceTransformerTrainer, make_loss, str(tmp_path / "plain"), data)
    seen = []
    toma = run(TomaSentenceTrainer, make_loss, str(tmp_path / "toma"), data, oom_rows=5, seen=seen)
    assert largest_difference(plain["model"], toma["model"]) == 0.0
    assert toma["eval_loss"] == plain["eval_loss"]
    stats = toma["trainer"].toma_stats
    assert stats.oom_retries == 0 and not stats.split_check.coupled
    assert max(rows for rows, _ in seen) == 4


def test_a_loss_of_independent_rows_is_packed_by_its_columns_tokens_and_each_column_trimmed(tmp_path):
    """CosineSimilarityLoss on pairs of 2-30 words: the micro-batches are packed by each row's tokens over its columns
    (a token budget) and each column's tensors trimmed to its longest row there, so some calls are narrower than the
    batch's columns; the plain trainer's parameters."""
    data = pairs(64, score=True, longest=30)
    plain = run(SentenceTransformerTrainer, losses.CosineSimilarityLoss, str(tmp_path / "plain"), data)
    seen = []
    toma = run(TomaSentenceTrainer, losses.CosineSimilarityLoss, str(tmp_path / "toma"), data, oom_rows=5, seen=seen)
    assert largest_difference(plain["model"], toma["model"]) <= TOLERANCE
    stats = toma["trainer"].toma_stats
    assert str(stats).startswith("toma: token budget ")
    widest = max(width for _, width in seen)
    assert any(rows <= 5 and width < widest - 4 for rows, width in seen), seen


def test_column_masks_are_found_summed_and_trimmed_by_their_prefix():
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0]])
    batch = {
        "anchor_input_ids": torch.tensor([[5, 6, 0, 0], [7, 0, 0, 0]]),
        "anchor_attention_mask": mask,
        "positive_input_ids": torch.tensor([[5, 6, 7], [8, 9, 0]]),
        "positive_attention_mask": torch.tensor([[1, 1, 1], [1, 1, 0]]),
        "score": torch.tensor([0.5, 0.25]),
    }
    assert set(prefixed_masks(batch)) == {"anchor_", "positive_"}
    assert summed_lengths(batch).tolist() == [5, 3]
    trimmed = trimmed_columns(batch)
    assert trimmed["anchor_input_ids"].shape == (2, 2) and trimmed["anchor_attention_mask"].shape == (2, 2)
    assert trimmed["positive_input_ids"] is batch["positive_input_ids"]  # no trailing padding: nothing to trim
    assert trimmed["score"] is batch["score"] and batch["anchor_input_ids"].shape == (2, 4)  # the batch unchanged
    left = dict(batch, anchor_attention_mask=torch.tensor([[0, 1, 1, 0], [1, 0, 0, 0]]))
    assert trimmed_columns(left)["anchor_input_ids"].shape == (2, 4)  # a row padded on the left: never trimmed
    assert prefixed_masks({"attention_mask": mask}) == {}


def test_encode_equals_model_encode_in_the_inputs_order_under_oom():
    """200 texts of 1-40 words, the forward refusing more than 300 tokens: sorted, chunked by a token budget that
    shrinks, each chunk through `model.encode`; equal to `model.encode` within rounding, in the inputs' order, with
    its settings (prompt, normalize_embeddings, truncate_dim, convert_to_tensor, int8 precision, one text)."""
    model = sentence_model()
    model.eval()
    texts = sentences(200, seed=3, longest=40)
    expected = model.encode(texts, batch_size=7)
    seen = []

    def refuse(module, args, kwargs):
        features = args[0]
        seen.append(tuple(features["input_ids"].shape))
        if features["input_ids"].numel() > 300:
            raise torch.OutOfMemoryError("CUDA out of memory (a stand-in)")

    model[0].register_forward_pre_hook(refuse, with_kwargs=True)
    found = encode(model, texts, cache_type=NoBatchsizeCache)
    assert isinstance(found, np.ndarray) and found.shape == expected.shape
    np.testing.assert_allclose(found, expected, rtol=1e-5, atol=1e-6)
    assert seen[0][0] == 200 and all(rows * width <= 300 for rows, width in seen[-5:])
    assert len({width for _, width in seen}) > 3  # chunks trimmed to their own longest text

    settings = dict(prompt="w1 w2 ", normalize_embeddings=True, truncate_dim=16)
    with torch.no_grad():
        tensor = encode(model, texts, convert_to_tensor=True, **settings)
    reference = model.encode(texts, batch_size=4, convert_to_tensor=True, **settings)
    assert isinstance(tensor, torch.Tensor) and tensor.shape == (200, 16)
    torch.testing.assert_close(tensor, reference, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(encode(model, "w3 w4 w5"), model.encode("w3 w4 w5"), rtol=1e-5, atol=1e-6)
    quantized = encode(model, texts, precision="int8")
    assert quantized.dtype == np.int8 and np.array_equal(quantized, model.encode(texts, precision="int8", batch_size=3))


def test_encode_refuses_what_it_cannot_join_and_bad_sizes_by_name():
    model = sentence_model()
    with pytest.raises(ValueError, match="output_value"):
        encode(model, ["w1"], output_value="token_embeddings")
    with pytest.raises(ValueError, match="batch_size"):
        encode(model, ["w1"], batch_size=0)
    with pytest.raises(TypeError, match="model"):
        encode(torch.nn.Linear(2, 2), ["w1"])
    with pytest.raises(ValueError, match="device"):
        encode(model, ["w1"], device=["cpu", "cpu"])


def test_the_docs_stand_in_counts_the_rows_of_a_features_dict_and_of_keywords():
    assert rows_of(({"input_ids": torch.zeros(3, 4)},), {}) == 3
    assert rows_of((), {"input_ids": torch.zeros(5, 2)}) == 5


# Under a real cap: a BERT whose 64-pair batch with its graph does not fit 48 MiB above what the process holds; the
# plain trainer fails, toma trains the uncapped plain trainer's parameters by gradient caching. Then 512 texts of up
# to 60 words: `model.encode(batch_size=512)` fails, toma's `encode` gives the embeddings of `batch_size=16`.
UNDER_A_CAP = (
    COLLECT_TOMA_LOG
    + """
import json, sys, torch
sys.path.insert(0, "tests/integrations")
torch.set_num_threads(1)
torch.backends.mkldnn.enabled = False  # oneDNN reports an allocation failing under the cap as "could not create a primitive"
from toma.memory.cpu import predictable_heap, set_cpu_memory_headroom
predictable_heap()
from sentence_transformers import SentenceTransformerTrainer
from sentence_transformers.sentence_transformer import losses
from toma.integrations.transformers import TomaTrainerMixin
from tiny_sentence_transformers import pairs, run, largest_difference, sentence_model

class TomaSentenceTrainer(TomaTrainerMixin, SentenceTransformerTrainer):
    pass

SETTINGS = dict(hidden=HIDDEN)
import tiny_sentence_transformers as tiny
make = tiny.sentence_model
tiny.sentence_model = lambda **kw: make(**{**SETTINGS, **kw})
data = pairs(128, longest=60)
overrides = dict(per_device_train_batch_size=64, per_device_eval_batch_size=64, max_steps=2)
reference = run(SentenceTransformerTrainer, losses.MultipleNegativesRankingLoss, "reference", data, **overrides)
from toma.integrations.sentence_transformers import encode
from tiny_sentence_transformers import sentences
encoder = tiny.sentence_model()
encoder.eval()
texts = sentences(512, 5, 60)
expected = encoder.encode(texts, batch_size=16)
set_cpu_memory_headroom(CAP_MIB / 1024)
try:
    encoder.encode(texts, batch_size=512)
    plain_encode = None
except RuntimeError as error:
    plain_encode = str(error).splitlines()[0]
encoded = encode(encoder, texts, batch_size=512)
encode_difference = float(abs(encoded - expected).max())
try:
    run(SentenceTransformerTrainer, losses.MultipleNegativesRankingLoss, "plain", data, **overrides)
    plain = None
except RuntimeError as error:
    plain = str(error).splitlines()[0]
toma = run(TomaSentenceTrainer, losses.MultipleNegativesRankingLoss, "toma", data, **overrides)
stats = toma["trainer"].toma_stats
print(json.dumps(dict(plain=plain, difference=largest_difference(reference["model"], toma["model"]),
    eval=[reference["eval_loss"], toma["eval_loss"]], coupled=stats.split_check.coupled, retries=stats.oom_retries,
    summary=str(stats), plain_encode=plain_encode, encode_difference=encode_difference, messages=messages)))
"""
)


@pytest.mark.slow
def test_under_a_real_cpu_cap_the_plain_trainer_fails_and_toma_trains_its_parameters_by_gradient_caching(tmp_path):
    code = UNDER_A_CAP.replace("HIDDEN", "256").replace("CAP_MIB", "48")
    out = run_python(
        f"import os; os.chdir({str(tmp_path)!r})\n"
        + code.replace('"tests/integrations"', repr(__import__("os").path.dirname(__file__))),
        timeout=300,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["plain"] and "can't allocate memory" in result["plain"], "the plain trainer must run out of memory"
    assert result["coupled"] and result["retries"] >= 1, result["summary"]
    assert any("can't allocate memory" in m for m in result["messages"] if "ran out of memory" in m)
    assert result["difference"] <= TOLERANCE, result
    assert result["eval"][1] == pytest.approx(result["eval"][0], rel=TOLERANCE)
    # encode: model.encode(batch_size=512) fails under the cap; toma's gives its batch_size=16 embeddings
    assert result["plain_encode"] and "can't allocate memory" in result["plain_encode"]
    assert result["encode_difference"] <= 1e-5, result["encode_difference"]
    print(f"\n{result['summary']}; plain: {result['plain']}")


# --- found by sentence-transformers' own tests with toma inside (docs/development.md) ------------------------------


def test_losses_chosen_per_data_set_each_keep_their_own_split_check_in_training_and_evaluation(tmp_path):
    """A dict of losses (CosineSimilarityLoss for one data set, in-batch negatives for the other), the forward refusing
    more than one row: the cosine batches' verdict (independent rows) must not cut the MNRL batches into rows, whose
    loss is 0 (as sentence-transformers' test_trainer_call_model_init_multi_loss found); nor in evaluation."""
    from datasets import DatasetDict

    data = DatasetDict({"cosine": pairs(16, score=True, seed=3), "negatives": pairs(16, seed=4)})

    def make_loss(model):
        return {"cosine": losses.CosineSimilarityLoss(model), "negatives": losses.MultipleNegativesRankingLoss(model)}

    overrides = dict(per_device_train_batch_size=4, per_device_eval_batch_size=4, max_steps=6)
    plain = run(SentenceTransformerTrainer, make_loss, str(tmp_path / "plain"), data, **overrides)
    toma = run(TomaSentenceTrainer, make_loss, str(tmp_path / "toma"), data, oom_rows=1, **overrides)
    assert largest_difference(plain["model"], toma["model"]) <= TOLERANCE
    checks = toma["trainer"]._toma_loss_checks
    assert checks["negatives"][0].coupled and not checks["cosine"][0].coupled
    for key in ("eval_cosine_loss", "eval_negatives_loss"):  # evaluated at the end of each run, in chunks of 1 row
        assert toma["evaluated"][key] == pytest.approx(plain["evaluated"][key], rel=TOLERANCE), key


def static_embedding_model():
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import StaticEmbedding
    from tokenizers import Tokenizer, models, pre_tokenizers

    from tiny_sentence_transformers import WORDS

    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0, **{w: i + 1 for i, w in enumerate(WORDS)}}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    torch.manual_seed(0)
    return SentenceTransformer(modules=[StaticEmbedding(tokenizer, embedding_dim=16)], device="cpu")


def test_a_batch_that_cannot_be_cut_into_rows_runs_whole_as_the_plain_trainer_runs_it(tmp_path):
    """A StaticEmbedding model's columns come as flattened token ids with their offsets (dim 0 is not rows): toma runs
    the batch whole, as the plain trainer does (sentence-transformers' test_router_with_trainer found the refusal),
    and an out-of-memory error in it says why toma could not help."""
    from sentence_transformers import SentenceTransformerTrainer as Plain

    from tiny_sentence_transformers import arguments

    data = pairs(32)
    trained = []
    for cls in (Plain, TomaSentenceTrainer):
        model = static_embedding_model()
        trainer = cls(model=model, args=arguments(str(tmp_path / cls.__name__)), train_dataset=data,
                      loss=losses.MultipleNegativesRankingLoss(model))  # fmt: skip
        trainer.train()
        trained.append(model)
    assert largest_difference(*trained) == 0.0

    model = static_embedding_model()

    def refuse(module, args):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    model[0].register_forward_pre_hook(refuse)
    trainer = TomaSentenceTrainer(model=model, args=arguments(str(tmp_path / "oom")), train_dataset=data,
                                  loss=losses.MultipleNegativesRankingLoss(model))  # fmt: skip
    with pytest.raises(torch.OutOfMemoryError) as raised:
        trainer.train()
    assert any("cannot be cut into rows" in note for note in getattr(raised.value, "__notes__", []))
