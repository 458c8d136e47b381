"""TRL's trainers with TomaTrainerMixin first among their bases, against the plain TRL trainers on the same data and
seed: SFT (padded, completion-only, padding-free, packed), DPO, reward modelling and LoRA, with and without
out-of-memory errors. Parameters within 1e-5 of their movement (fp32, SGD) and every value the trainers log
(loss, grad_norm, num_tokens, entropy, token accuracy, rewards, ...) within 1e-4."""

import copy
import functools
import gc

import pytest
import torch

pytest.importorskip("transformers", minversion="5.23")
trl = pytest.importorskip("trl", minversion="1.16")

from trl import (  # noqa: E402
    DPOConfig,
    DPOTrainer,
    GRPOConfig,
    GRPOTrainer,
    RewardConfig,
    RewardTrainer,
    SFTConfig,
    SFTTrainer,
)

from toma import Halving  # noqa: E402
from toma.integrations.transformers import TomaTrainerMixin  # noqa: E402

from tiny_trl import (  # noqa: E402
    assert_same_logs,
    common_args,
    llama,
    logged,
    preference_dataset,
    prompt_completion_dataset,
    prompt_dataset,
    refuse_more_than,
    relative_distance,
    text_dataset,
    tokenizer,
    word_reward,
)

CLOSE = 1e-5  # of the parameters' movement


class MicroSFT(TomaTrainerMixin, SFTTrainer):
    pass


class MicroDPO(TomaTrainerMixin, DPOTrainer):
    pass


class MicroReward(TomaTrainerMixin, RewardTrainer):
    pass


@pytest.fixture(autouse=True, scope="module")
def one_thread_and_frozen_imports():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    gc.collect()
    gc.freeze()  # after an OOM toma collects garbage: the frameworks' million objects are not garbage
    yield
    gc.unfreeze()
    torch.set_num_threads(threads)


SFT_CASES = {
    "padded": (text_dataset, {}),
    "completion_only": (prompt_completion_dataset, {}),
    "padding_free": (text_dataset, {"padding_free": True, "max_length": None}),
    "packing": (text_dataset, {"packing": True, "max_length": 64}),
}


def run(trainer_class, config_class, data, model, hook=None, **settings):
    """Train; the trainer and its log."""
    if hook is not None:
        model.register_forward_pre_hook(hook, with_kwargs=True)
    options = dict(toma_policy=Halving()) if issubclass(trainer_class, TomaTrainerMixin) else {}
    extra = settings.pop("trainer", {})
    trainer = trainer_class(
        model=model,
        args=config_class(**common_args(**settings)),
        train_dataset=data,
        processing_class=tokenizer(),
        **extra,
        **options,
    )
    trainer.train()
    return trainer, logged(trainer)


@functools.lru_cache(maxsize=None)
def plain_sft(case):
    data, settings = SFT_CASES[case]
    model = llama()
    trainer, log = run(SFTTrainer, SFTConfig, data(), model, **settings)
    return model, log


@pytest.mark.slow
@pytest.mark.parametrize("oom", [False, True], ids=["fits", "out-of-memory"])
@pytest.mark.parametrize("case", list(SFT_CASES))
def test_sft_trains_and_logs_as_the_plain_sft_trainer(case, oom):
    reference, expected = plain_sft(case)
    data, settings = SFT_CASES[case]
    model = llama()
    hook = refuse_more_than(150, once_at=2) if oom else None
    trainer, found = run(MicroSFT, SFTConfig, data(), model, hook=hook, **settings)
    distance = relative_distance(model, reference, llama())
    assert distance < CLOSE, distance
    assert_same_logs(found, expected)
    assert (trainer.toma_stats.oom_retries >= 2) == oom, trainer.toma_stats


@pytest.mark.slow
def test_a_batch_that_fits_runs_whole_through_the_sft_trainer():
    """No out-of-memory error: one compute_loss call per step, the plain trainer's own (padding-free: no padding to
    save, nothing split)."""
    data, settings = SFT_CASES["padding_free"]
    calls = []

    class Counting(MicroSFT):
        def compute_loss(self, model, inputs, *args, **kwargs):
            calls.append(inputs["input_ids"].shape)
            return super().compute_loss(model, inputs, *args, **kwargs)

    run(Counting, SFTConfig, data(), llama(), **settings)
    assert len(calls) == 2 and all(shape[0] == 1 for shape in calls)


@pytest.mark.slow
def test_lora_under_sft_trains_the_plain_adapters():
    peft = pytest.importorskip("peft")

    def lora():
        return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)

    data, settings = SFT_CASES["padded"]
    torch.manual_seed(1)
    plain, expected = run(SFTTrainer, SFTConfig, data(), llama(), trainer=dict(peft_config=lora()))
    torch.manual_seed(1)
    mine, found = run(
        MicroSFT, SFTConfig, data(), llama(), hook=refuse_more_than(150, once_at=2), trainer=dict(peft_config=lora())
    )
    trained = [(n, p) for n, p in plain.model.named_parameters() if p.requires_grad]
    ours = dict(mine.model.named_parameters())
    assert trained and all(torch.allclose(ours[n], p, rtol=1e-5, atol=1e-7) for n, p in trained)
    assert_same_logs(found, expected)
    assert mine.toma_stats.oom_retries >= 1


def dpo_settings(loss_type="sigmoid"):
    return dict(per_device_train_batch_size=8, loss_type=[loss_type])


@functools.lru_cache(maxsize=None)
def plain_dpo(loss_type="sigmoid"):
    model = llama()
    trainer, log = run(
        DPOTrainer,
        DPOConfig,
        preference_dataset(),
        model,
        trainer=dict(ref_model=llama(seed=1)),
        **dpo_settings(loss_type),
    )
    return model, log


@pytest.mark.slow
@pytest.mark.parametrize("oom", [False, True], ids=["fits", "out-of-memory"])
def test_dpo_keeps_each_chosen_row_with_its_rejected_row_and_logs_as_the_plain_dpo_trainer(oom):
    reference, expected = plain_dpo()
    model = llama()
    seen = []

    def pairs(module, args, kwargs):
        seen.append(kwargs["input_ids"].shape[0])

    model.register_forward_pre_hook(pairs, with_kwargs=True)
    hook = refuse_more_than(200, once_at=3) if oom else None
    trainer, found = run(
        MicroDPO,
        DPOConfig,
        preference_dataset(),
        model,
        hook=hook,
        trainer=dict(ref_model=llama(seed=1)),
        **dpo_settings(),
    )
    distance = relative_distance(model, reference, llama())
    assert distance < CLOSE, distance
    assert_same_logs(found, expected)
    assert all(rows % 2 == 0 for rows in seen), "a chosen row never leaves its rejected row"
    assert (trainer.toma_stats.oom_retries >= 1) == oom


@pytest.mark.slow
@pytest.mark.parametrize("oom", [False, True], ids=["fits", "out-of-memory"])
def test_a_reward_model_trains_its_pairs_and_logs_as_the_plain_reward_trainer(oom):
    data = preference_dataset()
    reference = llama(labels=1)
    start = copy.deepcopy(reference)
    _, expected = run(RewardTrainer, RewardConfig, data, reference, per_device_train_batch_size=8)
    model = llama(labels=1)
    hook = refuse_more_than(200, once_at=3) if oom else None
    trainer, found = run(MicroReward, RewardConfig, data, model, hook=hook, per_device_train_batch_size=8)
    distance = relative_distance(model, reference, start)
    assert distance < CLOSE, distance
    assert_same_logs(found, expected)
    assert (trainer.toma_stats.oom_retries >= 1) == oom


@pytest.mark.slow
def test_dpo_losses_that_relate_the_pairs_of_a_batch_are_refused_when_split_and_plain_when_whole():
    """`aot` sorts the batch's pairs against each other: split, it would train something else. It trains as the
    plain trainer when the batch fits; when it does not, its out-of-memory error is raised, with a note saying
    why, before anything of the batch trained."""

    reference, expected = plain_dpo("aot")
    model = llama()
    _, found = run(
        MicroDPO, DPOConfig, preference_dataset(), model, trainer=dict(ref_model=llama(seed=1)), **dpo_settings("aot")
    )
    distance = relative_distance(model, reference, llama())
    assert distance < CLOSE, distance
    assert_same_logs(found, expected)
    model = llama()
    with pytest.raises(torch.OutOfMemoryError) as raised:
        run(
            MicroDPO,
            DPOConfig,
            preference_dataset(),
            model,
            hook=refuse_more_than(200),
            trainer=dict(ref_model=llama(seed=1)),
            **dpo_settings("aot"),
        )
    assert "groups='batch': the batch is never split" in "".join(raised.value.__notes__)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), llama().parameters())), "nothing trained"


class MicroGRPO(TomaTrainerMixin, GRPOTrainer):
    pass


def grpo_settings(loss_type="grpo", **more):
    return dict(per_device_train_batch_size=8, num_generations=4, max_completion_length=8, loss_type=loss_type, **more)


def grpo_run(trainer_class, model, hook=None, **settings):
    """Train with GRPO; the trainer, its log and how many times it generated."""
    generated = []

    class Counting(trainer_class):
        def _generate_and_score_completions(self, *args, **kwargs):
            generated.append(self.state.global_step)
            return super()._generate_and_score_completions(*args, **kwargs)

    if hook is not None:
        model.register_forward_pre_hook(hook, with_kwargs=True)
    options = dict(toma_policy=Halving()) if issubclass(trainer_class, TomaTrainerMixin) else {}
    torch.manual_seed(0)
    trainer = Counting(
        model=model,
        reward_funcs=word_reward,
        args=GRPOConfig(**common_args(**settings)),
        train_dataset=prompt_dataset(),
        processing_class=tokenizer(),
        **options,
    )
    trainer.train()
    return trainer, logged(trainer), generated


@pytest.mark.slow
@pytest.mark.parametrize("oom", [False, True], ids=["fits", "out-of-memory"])
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dapo"])
def test_grpo_generates_once_per_step_and_trains_and_logs_as_the_plain_grpo_trainer(loss_type, oom):
    reference = llama()
    plain, expected, plain_generated = grpo_run(GRPOTrainer, reference, **grpo_settings(loss_type))
    model = llama()
    hook = refuse_more_than(40, once_at=2) if oom else None
    trainer, found, generated = grpo_run(MicroGRPO, model, hook=hook, **grpo_settings(loss_type))
    distance = relative_distance(model, reference, llama())
    assert distance < CLOSE, distance
    assert_same_logs(found, expected)
    assert generated == plain_generated == [0, 1], "generation runs once per step, never again on a retry"
    assert trainer._step == plain._step == 2, "GRPO's own step counter"
    assert (trainer.toma_stats.oom_retries >= 1) == oom


def test_grpo_settings_whose_loss_cannot_be_split_are_refused_by_name():
    with pytest.raises(ValueError, match="top_entropy_quantile=0.5"):
        MicroGRPO(
            model=llama(),
            reward_funcs=word_reward,
            args=GRPOConfig(**common_args(**grpo_settings(top_entropy_quantile=0.5))),
            train_dataset=prompt_dataset(),
            processing_class=tokenizer(),
        )


# --- two ranks (gloo): TRL's gathers inside compute_loss, micro-batches that differ per rank -------------------

RANKS_RUN = """
import json, os, sys
sys.path.insert(0, {helpers!r})
import torch
torch.set_num_threads(1)
from tiny_trl import *
from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer
from toma import Halving
from toma.integrations.transformers import TomaTrainerMixin

rank = int(os.environ["RANK"])

class MicroSFT(TomaTrainerMixin, SFTTrainer):
    pass

class MicroDPO(TomaTrainerMixin, DPOTrainer):
    pass

def run(cls, config, data, oom, **settings):
    model = llama()
    if oom:  # rank 0 only: the other rank's micro-batches are its own
        model.register_forward_pre_hook(refuse_more_than(150, once_at=2), with_kwargs=True)
    extra = settings.pop("trainer", {{}})
    options = dict(toma_policy=Halving()) if issubclass(cls, TomaTrainerMixin) else {{}}
    trainer = cls(model=model, args=config(**common_args(**settings)), train_dataset=data, processing_class=tokenizer(),
                  **extra, **options)
    trainer.train()
    return trainer, model

results = {{}}
cases = {{
    "sft padded": (SFTTrainer, MicroSFT, SFTConfig, text_dataset(64), {{}}),
    "sft padding-free": (SFTTrainer, MicroSFT, SFTConfig, text_dataset(64), dict(padding_free=True, max_length=None)),
    "dpo": (DPOTrainer, MicroDPO, DPOConfig, preference_dataset(32), dict(per_device_train_batch_size=8, trainer=dict(ref_model=llama(seed=1)))),
}}
for name, (plain_class, toma_class, config, data, settings) in cases.items():
    plain, reference = run(plain_class, config, data, False, **dict(settings, trainer=dict(settings.get("trainer", {{}}))))
    if "trainer" in settings:
        settings["trainer"] = dict(ref_model=llama(seed=1))
    mine, model = run(toma_class, config, data, rank == 0, **settings)
    try:
        assert_same_logs(logged(mine), logged(plain))
        logs = "same"
    except AssertionError as error:
        logs = str(error)[:300]
    results[name] = dict(distance=relative_distance(model, reference, llama()), logs=logs,
                         retries=mine.toma_stats.oom_retries)
print(json.dumps(dict(rank=rank, results=results)), flush=True)
os._exit(0)
"""


@pytest.mark.slow
@pytest.mark.multiprocess
def test_on_two_ranks_trls_gathers_inside_compute_loss_do_not_hang_and_the_runs_equal_the_plain_ddp_runs():
    """Rank 0 alone runs out of memory, and the ranks' rows pack into different micro-batches: TRL's gathers in
    compute_loss, made local while the micro-batches run, cannot be left unmatched; the metrics are combined over
    the ranks once per batch, as the plain trainer's gathers combine them."""
    import json
    import os

    from helpers import run_ranks

    here = os.path.dirname(os.path.abspath(__file__))
    outputs = run_ranks(RANKS_RUN.format(helpers=here), 2, timeout=400)
    reports = [json.loads(line) for out in outputs for line in out.splitlines() if line.startswith('{"rank"')]
    assert sorted(report["rank"] for report in reports) == [0, 1]
    for report in reports:
        for name, result in report["results"].items():
            assert result["distance"] < CLOSE, (report["rank"], name, result)
            assert result["logs"] == "same", (report["rank"], name, result)
            assert result["retries"] >= 1, (report["rank"], name, "every rank retries with rank 0")


@pytest.mark.slow
@pytest.mark.parametrize("case", ["padded", "padding_free"])
def test_sft_evaluation_in_chunks_reports_what_the_plain_evaluation_reports(case):
    """Evaluation batches that do not fit run in chunks (a padding-free batch's in chunks of its sequences); the
    loss and TRL's metrics come out as the plain evaluation's, one value per batch."""
    data, settings = SFT_CASES[case]

    passes = []

    def evaluate(trainer_class, refuse):
        model = llama()
        if refuse:

            def too_big(module, args, kwargs):
                if kwargs["input_ids"].numel() > 150:
                    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
                passes.append(kwargs["input_ids"].numel())

            model.register_forward_pre_hook(too_big, with_kwargs=True)
        options = dict(toma_policy=Halving()) if refuse else {}
        trainer = trainer_class(
            model=model,
            args=SFTConfig(**common_args(per_device_eval_batch_size=16, **settings)),
            train_dataset=data(),
            eval_dataset=data(48),
            processing_class=tokenizer(),
            **options,
        )
        return trainer, trainer.evaluate()

    _, expected = evaluate(SFTTrainer, False)
    trainer, found = evaluate(MicroSFT, True)
    keys = ["eval_loss", "eval_entropy", "eval_mean_token_accuracy", "eval_num_tokens"]
    assert all(key in expected for key in keys), expected
    assert_same_logs([{k: found[k] for k in keys}], [{k: expected[k] for k in keys}])
    assert len(passes) > 3, "three batches of 16 rows, each in chunks"


@pytest.mark.slow
def test_a_batch_that_fits_is_split_to_save_padding_unless_told_to_keep_it_whole():
    """Packing by tokens may split a padded batch that fits where the padding saved pays for another micro-batch;
    `toma_split_for_padding=False` keeps it whole: one compute_loss call per step, the plain trainer's loss and
    metrics bit for bit."""
    from toma.batching.micro_batch_cost import MicroBatchCost

    data, settings = SFT_CASES["padded"]
    _, expected = plain_sft("padded")
    calls = {}

    for whole in (False, True):

        class Counting(MicroSFT):
            def compute_loss(self, model, inputs, *args, **kwargs):
                calls.setdefault(whole, []).append(tuple(inputs["input_ids"].shape))
                return super().compute_loss(model, inputs, *args, **kwargs)

        model = llama()
        trainer = Counting(
            model=model,
            args=SFTConfig(**common_args(**settings)),
            train_dataset=data(),
            processing_class=tokenizer(),
            toma_split_for_padding=not whole,
        )
        trainer.toma_stats.packing = MicroBatchCost(0)  # every position of padding saved pays for a split
        trainer.train()
        if whole:
            assert logged(trainer) == expected, "bit for bit"
    assert len(calls[False]) > 2, "split to save padding"
    assert len(calls[True]) == 2 and all(rows == 16 for rows, _ in calls[True])


@pytest.mark.slow
@pytest.mark.parametrize("precomputed", [False, True], ids=["reference model", "precomputed reference"])
def test_dpo_evaluation_in_chunks_keeps_pairs_together_and_reports_the_plain_evaluation(precomputed):
    """An evaluation batch of pairs that does not fit runs in chunks of whole pairs (each its chosen rows, then
    their rejected rows; one reference log-probability per pair with them): the plain trainer's metrics and
    predictions, in the batch's row order."""
    settings = dict(per_device_eval_batch_size=4, precompute_ref_log_probs=precomputed)
    seen = []

    def too_big(module, args, kwargs):
        ids = kwargs.get("input_ids")
        if ids is not None and not torch.is_grad_enabled():
            seen.append(ids.shape[0])
            if ids.shape[0] > 2:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    def evaluate(trainer_class, refuse):
        model = llama()
        trainer = trainer_class(
            model=model,
            ref_model=llama(seed=1),
            args=DPOConfig(**common_args(**settings)),
            train_dataset=preference_dataset(8),
            eval_dataset=preference_dataset(8),
            processing_class=tokenizer(),
            **(dict(toma_policy=Halving()) if refuse else {}),
        )
        if refuse:
            model.register_forward_pre_hook(too_big, with_kwargs=True)
        metrics = trainer.evaluate()
        predictions = trainer.predict(trainer.eval_dataset).predictions
        return {k: v for k, v in metrics.items() if "runtime" not in k and "per_second" not in k}, predictions

    expected, expected_predictions = evaluate(DPOTrainer, False)
    found, predictions = evaluate(MicroDPO, True)
    assert max(seen) > 2 and 2 in seen, "the batches were split into chunks of one pair"
    assert_same_logs([found], [expected])
    assert torch.allclose(torch.as_tensor(predictions), torch.as_tensor(expected_predictions), rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_dpo_with_precomputed_reference_log_probabilities_splits_them_with_their_pairs():
    """One reference log-probability per pair (4 values beside 8 rows): each micro-batch takes its pairs'."""
    # a reference other than the policy: while they are the same, every reward is rounding noise around 0 and the
    # reward accuracy (the share of pairs whose noise has one sign) is noise too
    settings = dict(per_device_train_batch_size=8, precompute_ref_log_probs=True)
    reference = llama()
    _, expected = run(
        DPOTrainer, DPOConfig, preference_dataset(), reference, trainer=dict(ref_model=llama(seed=1)), **settings
    )
    model = llama()
    trainer, found = run(
        MicroDPO,
        DPOConfig,
        preference_dataset(),
        model,
        hook=refuse_more_than(200, once_at=3),
        trainer=dict(ref_model=llama(seed=1)),
        **settings,
    )
    distance = relative_distance(model, reference, llama())
    assert distance < CLOSE, distance
    assert_same_logs(found, expected)
    assert trainer.toma_stats.oom_retries >= 1
