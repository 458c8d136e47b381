"""toma.generate (`toma.generation.generate`): Hugging Face `generate` whose batch splits where memory runs out
mid-decode, every part continued from its last complete step; outputs equal to `model.generate` on the whole batch.

Tiny GPT-2 and BART from configs (fp32, no dropout in eval), prompts left-padded. The out-of-memory stand-ins grow
with the KV cache: a forward whose rows x (cached + new positions) passes a budget fails, at the model's entry or
inside its second block (after the first block's cache took the step's position: the cache is cropped back).
"""

import json

import pytest
import torch

pytest.importorskip("transformers", minversion="5.23")

from transformers import BartConfig, BartForConditionalGeneration, GPT2Config, GPT2LMHeadModel  # noqa: E402
from transformers import logging as hf_logging  # noqa: E402

import toma  # noqa: E402
from toma import NoBatchsizeCache  # noqa: E402

from helpers import run_python  # noqa: E402

hf_logging.set_verbosity_error()
EOS, PAD = 5, 0


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def gpt2(layers: int = 2) -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=64, n_positions=128, n_embd=32, n_layer=layers, n_head=2, bos_token_id=0, eos_token_id=EOS,
        pad_token_id=PAD,
    )  # fmt: skip
    return GPT2LMHeadModel(config).eval()


def prompts(rows: int = 12, width: int = 8, seed: int = 1):
    """Left-padded prompts of 3-8 tokens."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(6, 64, (rows, width), generator=generator)
    lengths = torch.randint(3, width + 1, (rows,), generator=generator)
    mask = (torch.arange(width)[None, :] >= (width - lengths)[:, None]).long()
    return ids * mask, mask


def cache_length(kwargs) -> int:
    cache = kwargs.get("cache") or kwargs.get("past_key_values")
    return cache.get_seq_length() if cache is not None else 0


class GrowingCache:
    """Raises an out-of-memory error (a stand-in) where a forward's rows x (cached + new positions) pass `budget`;
    `fed` counts the positions fed to the model. On `module` (the model, or a block inside it)."""

    def __init__(self, model, budget: int, module=None) -> None:
        self.budget, self.fed, self.failures = budget, 0, 0
        self.model = model
        self.past = 0
        model.register_forward_pre_hook(self.entry, with_kwargs=True)
        if module is not None:
            module.register_forward_pre_hook(self.inside, with_kwargs=True)
        self.at_entry = module is None

    def entry(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.rows, self.new, self.past = ids.shape[0], ids.shape[1], cache_length(kwargs)
        if self.at_entry:
            self.check()
        self.fed += ids.numel()

    def inside(self, module, args, kwargs):
        self.check()

    def check(self):
        if self.rows * (self.past + self.new) > self.budget:
            self.failures += 1
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (a stand-in)")


SETTINGS = dict(max_new_tokens=24, do_sample=False, pad_token_id=PAD, eos_token_id=EOS)


def unsplit_positions(reference: torch.Tensor, mask: torch.Tensor) -> int:
    """The positions `generate` feeds on the whole batch: the prompts, then one per row per step but the last."""
    return mask.numel() + reference.shape[0] * (reference.shape[1] - mask.shape[1] - 1)


@pytest.mark.parametrize("where", ["model", "second block"])
def test_greedy_equals_generate_when_the_cache_outgrows_memory_mid_decode(where):
    """12 prompts, 24 new tokens, an error where rows x cached length passes 150: the batch splits mid-decode (12, 6,
    3 rows) and each part continues from its last complete step: `generate`'s sequences, within 1.05x the token
    positions of the unsplit run. Raised inside the second block, the first block's cache holds the failed step's
    position, which is cropped back."""
    ids, mask = prompts()
    model = gpt2()
    reference = model.generate(input_ids=ids, attention_mask=mask, **SETTINGS)
    stand_in = GrowingCache(model, 150, model.transformer.h[1] if where == "second block" else None)
    out = toma.generate(model, ids, mask, cache_type=NoBatchsizeCache, **SETTINGS)
    assert torch.equal(out, reference)
    assert stand_in.failures >= 2
    assert stand_in.fed <= 1.05 * unsplit_positions(reference, mask), (stand_in.fed, unsplit_positions(reference, mask))


def test_rows_that_end_early_leave_the_batch_and_come_back_padded_as_generate_pads_them():
    ids, mask = prompts(rows=16, seed=4)
    model = gpt2()
    settings = dict(SETTINGS, eos_token_id=[EOS, 17, 23, 40])  # often met: rows end at different steps
    reference = model.generate(input_ids=ids, attention_mask=mask, **settings)
    generated = reference[:, ids.shape[1] :]
    ended = torch.isin(generated[:, :-1], torch.tensor([EOS, 17, 23, 40])).any(1)
    assert 0 < int(ended.sum()) < 16, "some rows end early, some run to the end"
    GrowingCache(model, 180)
    out = toma.generate(model, ids, mask, cache_type=NoBatchsizeCache, **settings)
    assert torch.equal(out, reference)


def test_sampling_with_a_seed_is_reproducible_for_the_same_memory_and_equals_generate_without_a_split():
    ids, mask = prompts()
    model = gpt2()
    settings = dict(SETTINGS, do_sample=True, top_k=20)
    torch.manual_seed(3)
    reference = model.generate(input_ids=ids, attention_mask=mask, **settings)
    torch.manual_seed(3)
    assert torch.equal(toma.generate(model, ids, mask, cache_type=NoBatchsizeCache, **settings), reference)
    GrowingCache(model, 150)
    runs = []
    for _ in range(2):
        torch.manual_seed(3)
        runs.append(toma.generate(model, ids, mask, cache_type=NoBatchsizeCache, **settings))
    assert torch.equal(runs[0], runs[1]) and runs[0].shape[0] == 12


def test_beam_search_splits_by_restarting_the_part_that_failed_and_gives_generates_beams():
    ids, mask = prompts(rows=8)
    model = gpt2()
    settings = dict(SETTINGS, num_beams=3, max_new_tokens=12)
    reference = model.generate(input_ids=ids, attention_mask=mask, **settings)
    stand_in = GrowingCache(model, 8 * 3 * 12)
    out = toma.generate(model, ids, mask, cache_type=NoBatchsizeCache, **settings)
    assert torch.equal(out, reference) and stand_in.failures >= 1


def test_an_encoder_decoder_model_splits_its_batch_and_gives_generates_sequences():
    torch.manual_seed(0)
    config = BartConfig(
        vocab_size=64, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=64,
        pad_token_id=PAD, bos_token_id=2, eos_token_id=EOS, decoder_start_token_id=2, forced_eos_token_id=None,
    )  # fmt: skip
    model = BartForConditionalGeneration(config).eval()
    ids, mask = prompts(rows=8)
    reference = model.generate(input_ids=ids, attention_mask=mask, **SETTINGS)
    failures = []

    def refuse(module, args, kwargs):
        if kwargs["input_ids"].shape[0] > 3:
            failures.append(1)
            raise torch.OutOfMemoryError("CUDA out of memory (a stand-in)")

    model.model.encoder.register_forward_pre_hook(refuse, with_kwargs=True)
    out = toma.generate(model, ids, mask, cache_type=NoBatchsizeCache, **SETTINGS)
    assert torch.equal(out, reference) and failures


def test_return_dict_in_generate_gives_the_output_class_with_the_sequences_and_per_step_outputs_are_refused():
    ids, mask = prompts(rows=4)
    model = gpt2()
    out = toma.generate(model, ids, mask, return_dict_in_generate=True, **SETTINGS)
    reference = model.generate(input_ids=ids, attention_mask=mask, return_dict_in_generate=True, **SETTINGS)
    assert type(out) is type(reference) and torch.equal(out.sequences, reference.sequences)
    with pytest.raises(ValueError, match="output_scores"):
        toma.generate(model, ids, mask, output_scores=True, return_dict_in_generate=True, **SETTINGS)


def test_bad_arguments_are_refused_early_by_name():
    model = gpt2()
    ids, mask = prompts(rows=2)
    with pytest.raises(ValueError, match="input_ids"):
        toma.generate(model, ids[0], **SETTINGS)
    with pytest.raises(ValueError, match="attention_mask"):
        toma.generate(model, ids, mask[:, :3], **SETTINGS)
    with pytest.raises(ValueError, match="initial_batch"):
        toma.generate(model, ids, mask, initial_batch=0, **SETTINGS)
    with pytest.raises(ValueError, match="past_key_values"):
        toma.generate(model, ids, mask, past_key_values=object(), **SETTINGS)
    with pytest.raises(TypeError, match="generate"):
        toma.generate(torch.nn.Linear(2, 2), ids, mask, **SETTINGS)


def test_an_error_that_is_not_out_of_memory_and_keyboard_interrupt_pass_through_untouched():
    model = gpt2()
    ids, mask = prompts(rows=4)
    calls = []

    def fail(module, args, kwargs):
        calls.append(1)
        raise error

    handle = model.register_forward_pre_hook(fail, with_kwargs=True)
    for error in (ValueError("a shape mismatch"), KeyboardInterrupt()):
        calls.clear()
        with pytest.raises(type(error)) as raised:
            toma.generate(model, ids, mask, **SETTINGS)
        assert raised.value is error and len(calls) == 1
    handle.remove()


def test_an_out_of_memory_error_with_one_row_left_is_raised_with_what_was_tried():
    model = gpt2()
    ids, mask = prompts(rows=4)
    GrowingCache(model, 20)  # one row's cache outgrows it at step 13
    with pytest.raises(torch.OutOfMemoryError) as raised:
        toma.generate(model, ids, mask, cache_type=NoBatchsizeCache, **SETTINGS)
    assert "generation batch" in str(raised.value) or any(
        "generation batch" in n for n in getattr(raised.value, "__notes__", [])
    )


UNDER_A_CAP = """
import json, torch
torch.set_num_threads(1)
torch.backends.mkldnn.enabled = False
from toma.memory.cpu import predictable_heap, set_cpu_memory_headroom
predictable_heap()
from transformers import GPT2Config, GPT2LMHeadModel, logging as hf_logging
hf_logging.set_verbosity_error()
import toma
torch.manual_seed(0)
config = GPT2Config(vocab_size=512, n_positions=512, n_embd=256, n_layer=4, n_head=4, bos_token_id=0, eos_token_id=1,
                    pad_token_id=0)
model = GPT2LMHeadModel(config).eval()
generator = torch.Generator().manual_seed(1)
ids = torch.randint(2, 512, (64, 16), generator=generator)
mask = torch.ones_like(ids)
settings = dict(max_new_tokens=200, do_sample=False, pad_token_id=0, eos_token_id=1)
with torch.no_grad():
    reference = model.generate(input_ids=ids, attention_mask=mask, **settings)
set_cpu_memory_headroom(CAP_MIB / 1024)
try:
    with torch.no_grad():
        model.generate(input_ids=ids, attention_mask=mask, **settings)
    plain = None
except RuntimeError as error:
    plain = str(error).splitlines()[0]
with torch.no_grad():
    out = toma.generate(model, ids, mask, **settings)
print(json.dumps(dict(plain=plain, equal=bool(torch.equal(out, reference)), width=out.shape[1])))
"""


@pytest.mark.slow
def test_under_a_real_cpu_cap_plain_generate_fails_and_toma_gives_its_uncapped_sequences(tmp_path):
    out = run_python(UNDER_A_CAP.replace("CAP_MIB", "40"), timeout=300)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["plain"] and "can't allocate memory" in result["plain"], result
    assert result["equal"], result
