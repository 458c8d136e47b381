"""Padding-free batches cut between their packed sequences: each micro-batch a padding-free row of its own."""

import pytest
import torch

from toma.batching.packed import PackedBatch, PackedTokens, is_packed

LENGTHS = [5, 9, 3, 12, 7, 4]


def flattened(lengths=LENGTHS, seed=0):
    """What TRL's and Hugging Face's padding-free collators make of sequences of these lengths."""
    generator = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    ids = torch.randint(4, 64, (1, total), generator=generator)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    labels = ids.clone()
    labels[positions == 0] = -100
    edges = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    index = torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int32), torch.tensor(lengths))[None]
    return {
        "input_ids": ids,
        "labels": labels,
        "position_ids": positions,
        "cu_seq_lens_q": edges,
        "cu_seq_lens_k": edges,
        "max_length_q": max(lengths),
        "max_length_k": max(lengths),
        "seq_idx": index,
    }


def test_a_flattened_batch_is_recognised_and_a_padded_one_is_not():
    batch = flattened()
    assert is_packed(batch)
    assert not is_packed({**batch, "attention_mask": torch.ones_like(batch["input_ids"])})
    assert not is_packed({"input_ids": batch["input_ids"]})


@pytest.mark.parametrize("key", ["position_ids", "cu_seq_lens_q", "seq_idx"])
def test_each_micro_batch_is_a_padding_free_row_of_whole_sequences_with_its_marks_rebuilt(key):
    batch = flattened()
    packed = PackedBatch((batch,), {}, key)
    assert packed.lengths == LENGTHS and packed.unit_count == len(LENGTHS)
    micro = PackedTokens(packed).micro_batches(16)
    assert [(start, stop) for _, start, stop, _ in micro] == [(0, 2), (2, 4), (4, 6)], "5+9, 3+12, 7+4 tokens"
    ((part,), _) = packed.arguments(1, 3)
    assert part["input_ids"].tolist() == batch["input_ids"][:, 5:17].tolist()
    assert part["input_ids"].data_ptr() == batch["input_ids"][:, 5:].data_ptr(), "a view, not a copy"
    assert part["position_ids"].tolist() == [list(range(9)) + list(range(3))]
    assert part["cu_seq_lens_q"].tolist() == part["cu_seq_lens_k"].tolist() == [0, 9, 12]
    assert part["cu_seq_lens_q"].dtype == torch.int32
    assert part["max_length_q"] == part["max_length_k"] == 9
    assert part["seq_idx"].tolist() == [[0] * 9 + [1] * 3] and part["seq_idx"].dtype == torch.int32
    ((whole,), _) = packed.arguments(0, len(LENGTHS))
    assert whole is batch, "the whole batch: the call's own arguments"


def test_a_sequence_longer_than_the_budget_runs_alone():
    packed = PackedBatch((flattened(),), {}, "position_ids")
    micro = PackedTokens(packed).micro_batches(4)
    assert [(start, stop) for _, start, stop, _ in micro] == [(i, i + 1) for i in range(len(LENGTHS))]


def test_marks_that_disagree_are_refused():
    batch = flattened()
    batch["cu_seq_lens_q"] = torch.tensor([0, 5, 20, 40], dtype=torch.int32)
    with pytest.raises(ValueError, match="disagree on where its sequences start"):
        PackedBatch((batch,), {}, "position_ids")


def test_a_label_at_a_sequence_start_that_is_a_target_is_refused():
    batch = flattened()
    batch["labels"][0, 5] = 7  # the first token of the second sequence, a target of the first's last token
    with pytest.raises(ValueError, match="-100 at the first position of each packed sequence"):
        PackedBatch((batch,), {}, "position_ids")


def test_a_tensor_that_is_not_per_token_is_refused_unless_whole():
    from toma import whole

    batch = {**flattened(), "weights": torch.ones(3)}
    with pytest.raises(ValueError, match=r"inputs\[0\]\['weights'\].*toma.whole"):
        PackedBatch((batch,), {}, "position_ids", name="inputs")
    batch["weights"] = whole(torch.ones(3))
    ((part,), _) = PackedBatch((batch,), {}, "position_ids").arguments(0, 2)
    assert part["weights"].shape == (3,)


def test_rows_of_packed_sequences_are_cut_within_each_row():
    first, second = flattened([3, 4, 5]), flattened([6, 6])
    rows = {key: torch.cat([first[key], second[key]]) for key in ("input_ids", "position_ids")}
    packed = PackedBatch((rows,), {}, "position_ids")
    assert [(s.row, s.begin, s.end) for s in packed.sequences] == [
        (0, 0, 3),
        (0, 3, 7),
        (0, 7, 12),
        (1, 0, 6),
        (1, 6, 12),
    ]
    micro = PackedTokens(packed).micro_batches(100)
    assert [(start, stop) for _, start, stop, _ in micro] == [(0, 3), (3, 5)], "never across two rows"
    ((part,), _) = packed.arguments(3, 5)
    assert part["input_ids"].tolist() == rows["input_ids"][1:2].tolist()


def test_the_keys_name_what_is_missing():
    with pytest.raises(ValueError, match="no tensor 'position_ids'"):
        PackedBatch(({"input_ids": torch.ones(1, 4)},), {}, "position_ids")
    padded = {**flattened(), "attention_mask": torch.ones(1, 40)}
    with pytest.raises(ValueError, match="has an attention_mask"):
        PackedBatch((padded,), {}, "position_ids")
