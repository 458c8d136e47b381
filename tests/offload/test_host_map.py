"""toma.map: a function over row chunks of host inputs on a device, outputs joined along dim 0."""

import json
import logging
import os
import re

import pytest
import torch

import toma
from toma import FitToMemory, NoBatchsizeCache
from toma import toma as tm
from toma.batching import staging
from toma.batching.transfer import Transfers

import fake_cuda
from helpers import COLLECT_TOMA_LOG, REPO, raise_fake_oom, requires_cuda, run_python, run_script


def pair_function(x, extras):
    return x.sum(1, keepdim=True) * extras["scale"], {"doubled": x * 2, "ids": extras["ids"] + 1}


def nested_inputs(rows=103):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(rows, 5, generator=generator)
    extras = {"scale": torch.rand(rows, 1, generator=generator), "ids": torch.arange(rows)}
    return x, extras


def test_results_equal_a_plain_loop_with_nested_inputs_and_outputs():
    x, extras = nested_inputs()
    total, parts = tm.map(pair_function, x, extras, device="cpu", initial_step=10, cache_type=NoBatchsizeCache)
    reference = [pair_function(x[i : i + 10], {k: v[i : i + 10] for k, v in extras.items()}) for i in range(0, 103, 10)]
    assert torch.equal(total, torch.cat([r[0] for r in reference]))
    assert torch.equal(parts["doubled"], torch.cat([r[1]["doubled"] for r in reference]))
    assert torch.equal(parts["ids"], torch.arange(1, 104))


def test_the_package_exposes_map_too():
    x = torch.arange(12.0).reshape(6, 2)
    assert torch.equal(toma.map(lambda a: a + 1, x), x + 1)


def test_an_oom_keeps_the_finished_chunks_and_retries_the_failed_one_smaller():
    x = torch.arange(100.0).unsqueeze(1)
    calls = []

    def square(chunk):
        calls.append((int(chunk[0, 0]), len(chunk)))
        if len(chunk) > 16 and int(chunk[0, 0]) >= 32:
            raise_fake_oom()
        return chunk**2

    out = tm.map(square, x, initial_step=32, cache_type=NoBatchsizeCache)
    assert torch.equal(out, x**2)
    assert calls[:3] == [(0, 32), (32, 32), (32, 16)]  # rows 0-31 were not redone
    assert [start for start, _ in calls].count(0) == 1
    done = [(start, size) for start, size in calls if not (size > 16 and start >= 32)]
    assert sum(size for _, size in done) == 100  # every row computed once in a chunk that finished


def test_the_chunk_size_is_cached_per_call_site():
    sizes = []

    def record(chunk):
        sizes.append(len(chunk))
        if len(chunk) > 25:
            raise_fake_oom()
        return chunk

    x = torch.randn(100, 3)
    for _ in range(2):
        sizes.clear()
        tm.map(record, x)
    assert sizes == [25, 25, 25, 25]  # the second call starts at the size the first found


def test_policy_is_used():
    sizes = []

    def record(chunk):
        sizes.append(len(chunk))
        if len(chunk) > 40:
            raise_fake_oom()
        return chunk

    tm.map(record, torch.randn(100, 3), policy=toma.ShrinkByFactor(0.5), cache_type=NoBatchsizeCache)
    assert sizes[:3] == [100, 50, 25]
    tm.map(record, torch.randn(100, 3), policy=FitToMemory(), cache_type=NoBatchsizeCache)  # no meter: halving


def test_a_function_returning_none_gives_none():
    seen = []
    assert tm.map(lambda chunk: seen.append(len(chunk)), torch.randn(10, 2), initial_step=4) is None
    assert seen == [4, 4, 2]


@pytest.mark.parametrize(
    "output, message",
    [
        (lambda c: c.sum(), "one row per input row"),
        (lambda c: c[:1], "one row per input row"),
        (lambda c: 3, "returned 3"),
    ],
)
def test_an_output_that_cannot_be_joined_is_a_clear_error(output, message):
    with pytest.raises(TypeError, match=message):
        tm.map(output, torch.randn(10, 2), initial_step=4)


@pytest.mark.parametrize("initial_step", [None, 4])
def test_the_result_never_aliases_the_inputs_whether_one_chunk_or_several(initial_step):
    # a function that returns its input, a view of it, or a new tensor: the result is new memory either way
    data = torch.randn(10, 3)
    kept = data.clone()
    identity, view, computed = tm.map(
        lambda rows: (rows, rows[:, :2], rows * 2), data, device="cpu", initial_step=initial_step,
        cache_type=NoBatchsizeCache,
    )  # fmt: skip
    assert torch.equal(identity, kept) and torch.equal(view, kept[:, :2]) and torch.equal(computed, kept * 2)
    identity.add_(1)
    view.add_(1)
    assert torch.equal(data, kept), "writing to the result leaves the input as it was"


def test_chunks_whose_outputs_disagree_are_a_clear_error():
    with pytest.raises(TypeError, match="cannot be joined"):
        tm.map(lambda c: c[:, : int(c[0, 0]) % 2 + 1], torch.arange(8.0).reshape(8, 1).repeat(1, 2), initial_step=1)


def test_bad_input_fails_early_naming_the_argument():
    called = []
    func = lambda *a: called.append(a)  # noqa: E731
    with pytest.raises(ValueError, match="inputs"):
        tm.map(func)
    with pytest.raises(ValueError, match="inputs"):
        tm.map(func, 3, "text")
    with pytest.raises(ValueError, match=r"inputs\[1\] has 5"):
        tm.map(func, torch.randn(10, 2), torch.randn(5))
    with pytest.raises(ValueError, match="device"):
        tm.map(func, torch.randn(10, 2), device="cuda:99")
    with pytest.raises(ValueError, match="output_device"):
        tm.map(func, torch.randn(10, 2), output_device="nowhere")
    with pytest.raises(ValueError, match="initial_step"):
        tm.map(func, torch.randn(10, 2), initial_step=0)
    with pytest.raises(TypeError, match="toma.map"):
        tm.map(None, torch.randn(10, 2))
    assert called == []


def test_a_non_oom_error_passes_through_untouched():
    error = KeyError("mine")

    def fail(chunk):
        raise error

    with pytest.raises(KeyError) as raised:
        tm.map(fail, torch.randn(4, 2))
    assert raised.value is error


@pytest.mark.slow
def test_a_real_cpu_oom_shrinks_the_chunk_and_keeps_results_exact():
    out = run_python(
        COLLECT_TOMA_LOG
        + """
import json, torch, torch.nn as nn
torch.set_num_threads(1)
from toma import toma, NoBatchsizeCache
from toma.memory.cpu import predictable_heap, set_cpu_memory_headroom
predictable_heap()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 8192), nn.ReLU(), nn.Linear(8192, 4))
inputs = torch.randn(16384, 32)
with torch.no_grad():
    reference = torch.cat([model(inputs[i : i + 512]) for i in range(0, 16384, 512)])
    set_cpu_memory_headroom(160 / 1024)
    sizes = []
    def forward(chunk):
        sizes.append(len(chunk))
        return model(chunk)
    result = toma.map(forward, inputs, device="cpu", cache_type=NoBatchsizeCache)
print(json.dumps(dict(sizes=sizes, close=bool(torch.allclose(result, reference, rtol=1e-5, atol=1e-6)), messages=messages)))
""",
        timeout=240,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    ooms = [m for m in result["messages"] if "ran out of memory" in m]
    assert ooms and all("can't allocate memory" in m for m in ooms), result["messages"]
    assert result["sizes"][0] == 16384 and min(result["sizes"]) < 16384
    assert result["close"]


@pytest.mark.cuda
@requires_cuda
def test_on_cuda_results_equal_the_cpu_and_outputs_can_stay_on_the_device():
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 8).cuda()
    x = torch.randn(5000, 64)
    with torch.no_grad():
        reference = model(x.cuda()).cpu()
        out = tm.map(model, x, device="cuda", initial_step=512, cache_type=NoBatchsizeCache)
        kept = tm.map(model, x, device="cuda", initial_step=512, output_device="cuda", cache_type=NoBatchsizeCache)
    assert not out.is_cuda and torch.allclose(out, reference, atol=1e-5)
    assert kept.is_cuda and torch.allclose(kept.cpu(), reference, atol=1e-5)


@pytest.mark.cuda
@requires_cuda
def test_a_real_cuda_oom_keeps_finished_chunks():
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, (torch.cuda.memory_reserved() + (1 << 30)) / total))
    try:
        x = torch.randn(1 << 14, 256)
        sizes = []

        def big(chunk):  # 1 GiB cap: a chunk of rows r needs r x 65536 floats
            sizes.append(len(chunk))
            wide = chunk.repeat(1, 256)
            return wide[:, :256] * 2

        out = tm.map(big, x, device="cuda", cache_type=NoBatchsizeCache)
        assert torch.equal(out, x * 2) and sizes[0] == 1 << 14 and min(sizes) < 1 << 14
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()


# --- CUDA paths on the CPU (tests/fake_cuda.py) ----------------------------------------------------------


@pytest.fixture
def fake(monkeypatch):
    return fake_cuda.install(monkeypatch)


def count_places(monkeypatch):
    """Wrap `Transfers.place` (the once-per-call move): each call noted, the result a copy, as a device's is."""
    placed = []

    def place(self, tensor):
        placed.append(tensor)
        return tensor.clone()

    monkeypatch.setattr(Transfers, "place", place, raising=False)
    return placed


def test_with_fake_cuda_whole_values_move_once_per_call_and_only_rows_are_staged(fake, monkeypatch):
    placed = count_places(monkeypatch)
    x = torch.randn(40, 3)
    weights, scale = torch.randn(3, 2), torch.tensor(0.5)
    shift = torch.tensor([[0.0, 1.0], [2.0, 0.0]]).to_sparse()  # on main: "copy_() between dense and sparse"
    seen = []

    def project(chunk, w, s, sparse):
        seen.append((w, s, sparse))
        return chunk @ w * s + torch.sparse.sum(sparse)

    out = tm.map(
        project,
        x,
        toma.whole(weights),
        scale,
        toma.whole(shift),
        initial_step=10,
        cache_type=NoBatchsizeCache,
        device="cpu",  # what the fake treats as CUDA (the default would be a real GPU where there is one)
    )
    assert torch.allclose(out, x @ weights * scale + 3.0)
    assert len(seen) == 4 and [id(t) for t in placed] == [id(weights), id(shift)]  # once per call, not per chunk
    assert all(w is seen[0][0] and sparse is seen[0][2] for w, _, sparse in seen) and seen[0][2].is_sparse
    assert all(s is scale for _, s, _ in seen)  # a 0-dim tensor passes as given
    assert all(stream is fake.default for _, stream in fake.recorded)  # never onto the side stream


def test_with_fake_cuda_outputs_come_back_without_record_stream(fake):
    x = torch.randn(30, 4)
    out = tm.map(lambda chunk: chunk, x, initial_step=8, cache_type=NoBatchsizeCache)  # outputs are the inputs' views
    assert torch.equal(out, x)
    assert fake.recorded and all(stream is fake.default for _, stream in fake.recorded)


def test_with_fake_cuda_a_refused_pinning_never_shrinks_the_chunk(fake, monkeypatch, caplog):
    def refuse(nbytes):
        raise RuntimeError("CUDA error: out of memory")  # what cudaHostAlloc failing reads like

    monkeypatch.setattr(staging, "pinned_block", refuse)
    monkeypatch.setattr(staging, "_refusal_warned", False)
    sizes = []

    def double(chunk):
        sizes.append(len(chunk))
        return chunk * 2

    x = torch.randn(64, 3)
    with caplog.at_level(logging.WARNING, logger="toma"):
        out = tm.map(double, x, initial_step=16, cache_type=NoBatchsizeCache)
    assert torch.equal(out, x * 2) and sizes == [16, 16, 16, 16]
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1


@pytest.mark.cuda
@requires_cuda
def test_on_cuda_whole_values_move_once_per_call():
    x, weights = torch.randn(1000, 16), torch.randn(16, 4)
    seen = []

    def project(chunk, w):
        seen.append(w)
        return chunk @ w

    with torch.no_grad():
        out = tm.map(project, x, toma.whole(weights), device="cuda", initial_step=128, cache_type=NoBatchsizeCache)
    assert len(seen) == 8 and seen[0].is_cuda and all(w is seen[0] for w in seen)
    torch.testing.assert_close(out, x @ weights, rtol=1e-4, atol=1e-4)


# --- lengths=: rows sorted by length, chunked by a token budget, trimmed (issue 31) -------------------------------


def test_map_by_tokens_equals_the_untrimmed_call_in_the_inputs_order_with_outputs_padded_back():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=90, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    bert = transformers.BertModel(config).eval()
    generator = torch.Generator().manual_seed(1)
    lengths = torch.randint(2, 33, (23,), generator=generator)
    lengths[7] = 32
    mask = (torch.arange(32)[None] < lengths[:, None]).long()
    texts = dict(input_ids=torch.randint(1, 90, (23, 32), generator=generator) * mask, attention_mask=mask)

    def embed(batch):
        hidden = bert(**batch).last_hidden_state
        weights = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        return (hidden * weights).sum(1) / weights.sum(1), hidden  # mean pooling, and the token states

    with torch.no_grad():
        pooled, states = embed(texts)
        chunks = []
        by_tokens = tm.map(
            lambda batch: chunks.append(tuple(batch["input_ids"].shape)) or embed(batch),
            texts,
            lengths="attention_mask",
            initial_step=4,
            cache_type=NoBatchsizeCache,
            device="cpu",  # where the model is (the default is the GPU where there is one)
        )
    assert torch.allclose(by_tokens[0], pooled, atol=1e-5), "the inputs' row order, the full call's embeddings"
    real = mask.bool()
    assert by_tokens[1].shape == states.shape and torch.allclose(by_tokens[1][real], states[real], atol=1e-5)
    assert all(rows * width <= 4 * 32 for rows, width in chunks) and min(w for _, w in chunks) < 32


def test_map_by_tokens_retries_the_failed_chunk_at_a_smaller_budget_and_a_lone_row_re_raises():
    mask = (torch.arange(8)[None] < torch.tensor([8, 2, 5, 3, 8, 1])[:, None]).long()
    inputs = dict(values=torch.arange(48.0).reshape(6, 8) * mask, attention_mask=mask)
    seen = []

    def total(batch):
        seen.append(tuple(batch["values"].shape))
        if batch["values"].numel() > 8:
            raise_fake_oom()
        return batch["values"].sum(1)

    out = tm.map(total, inputs, lengths="attention_mask", initial_step=6, cache_type=NoBatchsizeCache)
    assert torch.equal(out, inputs["values"].sum(1)) and seen[0] == (3, 8), "rows of half the width or less apart"
    finished = [(rows, width) for rows, width in seen if rows * width <= 8]
    assert sum(rows for rows, _ in finished) == 6, "every row once: a finished chunk is never redone"
    assert [width for _, width in finished] == sorted((width for _, width in finished), reverse=True)

    def never(batch):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")

    with pytest.raises(torch.OutOfMemoryError, match="Tried to allocate 1.00 GiB") as raised:
        tm.map(never, inputs, lengths="attention_mask", initial_step=1, cache_type=NoBatchsizeCache)
    assert "smallest token budget" in "\n".join(raised.value.__notes__)


@pytest.mark.slow
def test_the_embedding_example_agrees_with_fixed_batches():
    pytest.importorskip("transformers")
    result = run_script(os.path.join(REPO, "examples", "embed_texts.py"), "--quick", timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    difference = float(re.search(r"largest difference between the embeddings: (\S+)", result.stdout).group(1))
    assert difference < 1e-4 and "speed-up:" in result.stdout


# --- padding-free inputs: chunks of packed sequences ------------------------------------------------------------


def packed_inputs(lengths=(5, 9, 3, 12, 7, 4), seed=0):
    """A padding-free batch as Hugging Face's and TRL's collators make it: one row, positions restarting at 0."""
    generator = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    ids = torch.randint(1, 50, (1, total), generator=generator)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    edges = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return {"input_ids": ids, "position_ids": positions, "cu_seq_lens_q": edges, "max_length_q": max(lengths)}


def test_a_padding_free_batch_maps_in_chunks_of_its_sequences_outputs_back_in_place():
    """Per-token outputs come back as one packed row, per-sequence outputs one row per sequence; a chunk that runs
    out of memory is redone with fewer sequences, never a part of one."""
    torch.manual_seed(0)
    embed = torch.nn.Embedding(50, 8)
    batch = packed_inputs()
    lengths = [5, 9, 3, 12, 7, 4]
    seen, capped = [], [False]

    def per_token_and_sequence(b):
        seen.append(b["input_ids"].shape[1])
        if capped[0] and b["input_ids"].shape[1] > 16:
            raise_fake_oom()
        assert b["cu_seq_lens_q"][-1] == b["input_ids"].shape[1] and b["max_length_q"] == max(
            b["cu_seq_lens_q"].diff().tolist()
        )
        hidden = embed(b["input_ids"]) * (b["position_ids"][..., None] + 1)  # each token's own position
        starts = b["cu_seq_lens_q"][:-1].long()
        return hidden, hidden[0, starts]  # (1, tokens, 8) and (sequences, 8)

    with torch.no_grad():
        expected_tokens, expected_firsts = per_token_and_sequence(batch)
        seen.clear()
        capped[0] = True
        tokens, firsts = tm.map(per_token_and_sequence, batch, lengths="position_ids", cache_type=NoBatchsizeCache)
    assert tokens.shape == (1, 40, 8) and firsts.shape == (6, 8)
    assert torch.equal(tokens, expected_tokens) and torch.equal(firsts, expected_firsts)
    fitting = [n for n in seen if n <= 16]
    assert sum(fitting) == sum(lengths) and seen[0] == 40, "every token mapped once, after the whole row failed"
    assert set(fitting) <= {5, 9, 3, 12, 7, 4, 14, 15, 11, 16, 8, 10, 12}


def test_a_padding_free_output_of_another_shape_is_a_clear_error():
    batch = packed_inputs()
    with pytest.raises(TypeError, match=r"one row per sequence or of shape \(1, tokens, ...\)"):
        tm.map(lambda b: torch.zeros(3), batch, lengths="position_ids", initial_step=1)
