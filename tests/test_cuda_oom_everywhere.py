"""Real CUDA out-of-memory errors in every part of toma (issue 33, items 2 and 3).

Each test runs in a fresh process that caps its own CUDA memory with `torch.cuda.set_per_process_memory_fraction`
(other processes share the GPU: the cap is a fraction of the device's total, computed from what the process holds),
computes its reference before the cap (or in pieces known to fit), and checks that the errors were the allocator's
own "CUDA out of memory". TF32 is off, so float32 results compare to rtol 1e-4 or tighter.

The subprocess code is a preamble (`COMMON`, and `CUDA_CAP`: DEVICE, `cap`, `uncap`, `held`) and a body per test;
the bodies use the preamble's names only, so the same bodies run on the CPU with a preamble that raises the OOMs
itself (how they were checked before they first ran on a GPU). Each body's first line holds its sizes.
"""

import importlib.metadata
import importlib.util
import json

import pytest

from helpers import COLLECT_TOMA_LOG, requires_cuda, run_python

# Subprocess code: imports, and `cuda_ooms(messages, start)`, toma's retry lines checked to be CUDA's errors. What the
# imports made is frozen (`freeze()`, again after a framework's imports): toma collects garbage after each
# out-of-memory error, and scanning torch's objects every time would cost most of a test's time.
COMMON = (
    COLLECT_TOMA_LOG
    + """
import gc, json
import torch
import torch.nn.functional as F
from toma import toma, explicit, simple, NoBatchsizeCache, Trainer, HostedEmbedding

def freeze():
    gc.collect()
    gc.freeze()

freeze()

def cuda_ooms(messages, start=""):
    retries = [m for m in messages if "ran out of memory" in m]
    return dict(retries=len(retries), cuda=all("CUDA out of memory" in m for m in retries),
                named=all(m.startswith(start) for m in retries), sample=retries[:2])
"""
)

# `cap(headroom)`: from here on the process may hold `headroom` bytes of CUDA memory more than it holds now (the
# allocator's cached free blocks emptied first, so what it holds is what its tensors use); `uncap()`; `held()`: the
# bytes its tensors hold; `settle()`: the bytes the process holds once the cached free blocks are emptied. cuBLAS
# takes its workspace at the first matmul: taken here, before any cap.
CUDA_CAP = """
DEVICE = "cuda"
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
torch.cuda.init()
TOTAL = torch.cuda.get_device_properties(0).total_memory
(torch.ones(64, 64, device=DEVICE) @ torch.ones(64, 64, device=DEVICE)).sum().item()

def settle():
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved()

def cap(headroom):
    torch.cuda.set_per_process_memory_fraction(min(1.0, (settle() + headroom) / TOTAL))

def uncap():
    torch.cuda.set_per_process_memory_fraction(1.0)

def held():
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()
"""


def run(body: str, timeout: float = 180) -> dict:
    """The body after the CUDA preamble, in a fresh process; its last printed line, as JSON."""
    out = run_python(COMMON + CUDA_CAP + body, timeout=timeout)
    return json.loads(out.stdout.strip().splitlines()[-1])


def assert_cuda_ooms(found: dict, start: str = "") -> None:
    assert found["retries"] >= 1, "the search must run into a real out-of-memory error"
    assert found["cuda"], f"not the CUDA allocator's error: {found['sample']}"
    assert found["named"], f"a retry line from elsewhere than {start}: {found['sample']}"


# --- the forms ---------------------------------------------------------------------------------------------------

# A row of `a @ b.T` is N floats (64 KiB); the whole product is 1 GiB and the cap leaves room for 3/16 of it, so
# every form starts at N rows, runs out of memory at N, N/2 and N/4 and finishes at N/8. Each form's function
# notes the errors it met; the batch forms return the rows, the others write them into `out`.
FORMS = """
N, K = 16384, 64
torch.manual_seed(0)
a, b = torch.randn(N, K, device=DEVICE), torch.randn(N, K, device=DEVICE)

def rows(start, end):
    return (a[start:end] @ b.T).amax(1)

reference = torch.cat([rows(s, s + 512) for s in range(0, N, 512)])
out = torch.zeros(N, device=DEVICE)
ooms, sizes, results = {}, {}, {}

def work(form, start, end):
    sizes.setdefault(form, []).append(end - start)
    try:
        return rows(start, end)
    except torch.OutOfMemoryError as error:
        ooms.setdefault(form, []).append(str(error).splitlines()[0][:100])
        raise

def batch_of(form):
    def run(batchsize):
        return torch.cat([work(form, s, min(s + batchsize, N)) for s in range(0, N, batchsize)])
    return run

def range_of(form):
    def run(start, end):
        out[start:end] = work(form, start, end)
    return run

def chunk_of(form):
    def run(chunk, start, end):
        chunk.copy_(work(form, start, end))
    return run

def check(form, result=None):
    got = out.clone() if result is None else result
    results[form] = dict(close=bool(torch.allclose(got, reference, rtol=1e-5, atol=1e-5)), ooms=ooms.get(form, []),
                         sizes=sorted(set(sizes.get(form, [])), reverse=True))
    out.zero_()

cap(3 * N * N * 4 // 16)
check("toma.batch", toma.batch(initial_batchsize=N)(batch_of("toma.batch"))())
toma.range(initial_step=N)(range_of("toma.range"))(0, N)
check("toma.range")
toma.chunked(initial_step=N)(chunk_of("toma.chunked"))(out)
check("toma.chunked")

@toma.execute.batch(N)
def executed(batchsize):
    return batch_of("toma.execute.batch")(batchsize)

check("toma.execute.batch", executed)

@toma.execute.range(0, N, N)
def executed(start, end):
    range_of("toma.execute.range")(start, end)

check("toma.execute.range")

@toma.execute.chunked(out, N)
def executed(chunk, start, end):
    chunk_of("toma.execute.chunked")(chunk, start, end)

check("toma.execute.chunked")
check("explicit.batch", explicit.batch(batch_of("explicit.batch"), N))
explicit.range(range_of("explicit.range"), 0, N, N)
check("explicit.range")
explicit.chunked(chunk_of("explicit.chunked"), out, N)
check("explicit.chunked")
check("simple.batch", simple.batch(batch_of("simple.batch"), N))
simple.range(range_of("simple.range"), 0, N, N)
check("simple.range")
simple.chunked(chunk_of("simple.chunked"), out, N)
check("simple.chunked")
uncap()
print(json.dumps(dict(results=results, N=N)))
"""

ALL_FORMS = [
    f"{namespace}.{form}"
    for namespace in ("toma", "toma.execute", "explicit", "simple")
    for form in ("batch", "range", "chunked")
]


@pytest.mark.cuda
@requires_cuda
def test_every_form_under_a_real_cuda_oom_gives_the_reference_rows():
    result = run(FORMS)
    results, n = result["results"], result["N"]
    assert sorted(results) == sorted(ALL_FORMS)
    for form, outcome in results.items():
        assert outcome["ooms"], f"{form} never ran out of memory: {outcome}"
        assert all("CUDA out of memory" in message for message in outcome["ooms"]), (form, outcome["ooms"])
        assert outcome["sizes"][0] == n and outcome["sizes"][-1] < n, (form, outcome["sizes"])
        assert outcome["close"], f"{form}: the rows differ from the reference"


# --- toma.accumulate: 100 logical batches, each out of memory -------------------------------------------------

# An MLP whose logical batch's backward pass needs three N x WIDTH activations (128 MiB each) where the cap leaves
# room for two: with NoBatchsizeCache every call starts at N and runs out of memory for real. The gradients
# accumulate across the 100 calls (never zeroed), as the reference's do over the same batches in pieces of 1024.
ACCUMULATE_100 = """
N, WIDTH, BATCHES, PIECE = 8192, 4096, 100, 1024
ACTIVATION = N * WIDTH * 4

def make_model():
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(32, WIDTH), torch.nn.ReLU(), torch.nn.Linear(WIDTH, 10)).to(DEVICE)

torch.manual_seed(0)
inputs = torch.randn(BATCHES, N, 32, device=DEVICE)
targets = torch.randint(0, 10, (BATCHES, N), device=DEVICE)
reference, reference_losses = make_model(), []
for x, y in zip(inputs, targets):
    total = 0.0
    for s in range(0, N, PIECE):
        loss = F.cross_entropy(reference(x[s:s + PIECE]), y[s:s + PIECE], reduction="sum") / N
        loss.backward()
        total += float(loss)
    reference_losses.append(total)
reference_grads = [p.grad.clone() for p in reference.parameters()]
del reference, loss

model = make_model()
for p in model.parameters():
    p.grad = torch.zeros_like(p)
sizes = []

@toma.accumulate(model=model, initial_micro_batch=N, cache_type=NoBatchsizeCache)
def compute_loss(x, y):
    sizes.append(len(x))
    return F.cross_entropy(model(x), y)

cap(2 * ACTIVATION)
baseline, baseline_settled = held(), settle()
losses, drift = [], []
for x, y in zip(inputs, targets):
    losses.append(float(compute_loss(x, y)))
    drift.append(held() - baseline)
settled = settle() - baseline_settled
uncap()
close = [bool(torch.allclose(p.grad, r, rtol=1e-4, atol=1e-6)) for p, r in zip(model.parameters(), reference_grads)]
losses_close = all(abs(a - b) <= 1e-4 * abs(b) + 1e-6 for a, b in zip(losses, reference_losses))
print(json.dumps(dict(close=close, losses_close=losses_close, drift=sorted(set(drift)), settled=settled,
                      at_n=sizes.count(N),
                      retries=compute_loss.stats.oom_retries, batches=BATCHES, N=N, ooms=cuda_ooms(messages),
                      micro_batch=compute_loss.stats.micro_batch)))
"""


@pytest.mark.cuda
@requires_cuda
def test_accumulate_through_100_real_cuda_ooms_keeps_memory_at_its_baseline_and_the_reference_gradients():
    result = run(ACCUMULATE_100)
    assert_cuda_ooms(result["ooms"])
    assert result["at_n"] == result["batches"], "every logical batch must start whole and run out of memory"
    assert result["retries"] >= result["batches"] and result["ooms"]["retries"] >= result["batches"]
    assert result["drift"] == [0], "a failed attempt left CUDA memory allocated after its call"
    assert result["settled"] == 0, "the allocator holds more than at the start once its cache is emptied"
    assert 0 < result["micro_batch"] < result["N"]
    assert all(result["close"]), "the gradients accumulated over 100 calls differ from the reference"
    assert result["losses_close"]


# toma.accumulate(lengths=): a per-token model on long-tailed rows (most 8-64 tokens, every 64th 512), the whole
# batch's padded area (512 x 512 tokens, ~12 GiB of activations) far above a cap of 768 MiB; the reference is the
# token mean of the whole batch, computed in pieces of 8 rows before the cap.
ACCUMULATE_TOKENS = """
ROWS, WIDTH, HIDDEN, VOCAB = 512, 512, 4096, 64
torch.manual_seed(0)
lengths = torch.randint(8, 65, (ROWS,))
lengths[::64] = WIDTH
mask = (torch.arange(WIDTH)[None] < lengths[:, None]).long().to(DEVICE)
ids = torch.randint(1, VOCAB, (ROWS, WIDTH)).to(DEVICE) * mask
labels = ids.masked_fill(mask == 0, -100)

def make_model():
    torch.manual_seed(1)
    layers = [torch.nn.Embedding(VOCAB, 64), torch.nn.Linear(64, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, VOCAB)]
    return torch.nn.Sequential(*layers).to(DEVICE)

reference, tokens = make_model(), int((labels != -100).sum())
for s in range(0, ROWS, 8):
    summed = F.cross_entropy(reference(ids[s:s + 8]).flatten(0, 1), labels[s:s + 8].flatten(), ignore_index=-100,
                             reduction="sum")
    (summed / tokens).backward()
reference_grads = [p.grad.clone() for p in reference.parameters()]
del reference, summed

model, shapes = make_model(), []

@toma.accumulate(model=model, lengths="attention_mask", initial_tokens=ROWS * WIDTH,
                 weight=lambda input_ids, attention_mask, labels: (labels != -100).sum())
def compute_loss(input_ids, attention_mask, labels):
    shapes.append(tuple(input_ids.shape))
    return F.cross_entropy(model(input_ids).flatten(0, 1), labels.flatten(), ignore_index=-100)

cap(768 * 2**20)
compute_loss(input_ids=ids, attention_mask=mask, labels=labels)
uncap()
close = [bool(torch.allclose(p.grad, r, rtol=1e-4, atol=1e-6)) for p, r in zip(model.parameters(), reference_grads)]
print(json.dumps(dict(close=close, ooms=cuda_ooms(messages), widths=sorted({w for _, w in shapes}),
                      budget=compute_loss.stats.micro_batch, area=ROWS * WIDTH)))
"""


@pytest.mark.cuda
@requires_cuda
def test_accumulate_by_tokens_under_a_real_cuda_oom_trains_the_full_batchs_token_mean():
    result = run(ACCUMULATE_TOKENS)
    assert_cuda_ooms(result["ooms"])
    assert 0 < result["budget"] < result["area"] and min(result["widths"]) < 512, "a learned budget, trimmed"
    assert all(result["close"]), "the gradients differ from the full batch's token mean"


# --- padding-free rows and pairs (issue 40) ----------------------------------------------------------------------

# One padding-free row of 24 packed sequences (256 to 1,024 tokens each) through a Llama from a config with a
# vocabulary of 32,768: the row's logits alone are 1.5 to 3 GiB (fp32), and with their softmax and gradients the
# row needs about four times that; the cap leaves a third of the logits, about two sequences. Cut between its
# sequences, it trains the whole row's gradients (the reference: each sequence on its own, weighted by its tokens).
PADDING_FREE = """
SEQUENCES, LENGTH, VOCAB = 24, 1024, 32768
from transformers import LlamaConfig, LlamaForCausalLM
freeze()
def make_model():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=LENGTH)
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config).to(DEVICE)
torch.manual_seed(1)
lengths = torch.randint(LENGTH // 4, LENGTH + 1, (SEQUENCES,)).tolist()
ids = torch.randint(1, VOCAB, (1, sum(lengths)), device=DEVICE)
positions = torch.cat([torch.arange(n) for n in lengths])[None].to(DEVICE)
labels = ids.masked_fill(positions == 0, -100)
batch = {"input_ids": ids, "position_ids": positions, "labels": labels, "use_cache": False}
tokens = int((labels[:, 1:] != -100).sum())
reference = make_model()
start = 0
for n in lengths:  # each sequence alone, weighted by its label tokens: the row's token mean
    part = {"input_ids": ids[:, start:start + n], "labels": labels[:, start:start + n], "use_cache": False}
    (reference(**part).loss * (n - 1) / tokens).backward()
    start += n
expected = [p.grad.detach().clone() for p in reference.parameters()]
del reference
model = make_model()
label_tokens = lambda b: (b["labels"][:, 1:] != -100).sum()
widths = []
@toma.accumulate(model=model, lengths="position_ids", initial_tokens=sum(lengths), weight=label_tokens)
def compute_loss(b):
    widths.append(b["input_ids"].shape[1])
    return model(**b).loss
cap(VOCAB * 4 * sum(lengths) // 3)
compute_loss(batch)
uncap()
close = [bool(torch.allclose(p.grad, e, rtol=1e-4, atol=1e-6)) for p, e in zip(model.parameters(), expected)]
print(json.dumps(dict(close=close, ooms=cuda_ooms(messages), budget=compute_loss.stats.micro_batch,
                      tokens=sum(lengths), longest=max(widths))))
"""


@pytest.mark.cuda
@requires_cuda
def test_a_padding_free_row_under_a_real_cuda_oom_trains_in_chunks_of_its_sequences():
    result = run(PADDING_FREE, timeout=300)
    assert_cuda_ooms(result["ooms"])
    assert 0 < result["budget"] < result["tokens"] and result["longest"] < result["tokens"]
    assert all(result["close"]), "the gradients differ from the whole row's"


# A preference loss over N pairs (chosen rows first, rejected second): N x WIDTH activations of 2 x 2 GiB do not
# fit; cut by pairs it trains the full batch's gradients, and cut by rows (no groups=) the split check finds the rows
# coupled and gradient caching trains the full batch's gradients too.
PAIRS = """
N, WIDTH = 65536, 8192
def make_model():
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(32, WIDTH), torch.nn.ReLU(), torch.nn.Linear(WIDTH, 1)).to(DEVICE)
torch.manual_seed(0)
inputs = torch.randn(N, 32, device=DEVICE)
def preference(net, x):
    chosen, rejected = net(x).squeeze(-1).chunk(2)
    return -F.logsigmoid(chosen - rejected).mean()
reference = make_model()
half = N // 2
for s in range(0, half, 4096):  # the reference in pieces of pairs known to fit
    rows = torch.cat([inputs[s:s + 4096], inputs[half + s:half + s + 4096]])
    (preference(reference, rows) * min(4096, half - s) / half).backward()
expected = [p.grad.detach().clone() for p in reference.parameters()]
del reference
model = make_model()
cap(2**30)
cached = toma.accumulate(model=model, initial_micro_batch=N, cache_type=NoBatchsizeCache)(lambda x: preference(model, x))
cached(inputs)  # cut by rows: coupled, trained by gradient caching
cached_close = [bool(torch.allclose(p.grad, e, rtol=1e-4, atol=1e-6)) for p, e in zip(model.parameters(), expected)]
coupled = cached.stats.split_check.coupled
model.zero_grad(set_to_none=True)
step = toma.accumulate(model=model, initial_micro_batch=N, groups="pairs")(lambda x: preference(model, x))
step(inputs)
uncap()
close = [bool(torch.allclose(p.grad, e, rtol=1e-4, atol=1e-6)) for p, e in zip(model.parameters(), expected)]
print(json.dumps(dict(close=close, cached_close=cached_close, coupled=coupled, ooms=cuda_ooms(messages), micro_batch=step.stats.micro_batch, N=N)))
"""


@pytest.mark.cuda
@requires_cuda
def test_pairs_under_a_real_cuda_oom_train_the_full_batch_and_rows_alone_by_gradient_caching():
    result = run(PAIRS, timeout=300)
    assert_cuda_ooms(result["ooms"])
    assert result["coupled"] and all(result["cached_close"]), "cut by rows: gradient caching, the full batch's"
    assert 0 < result["micro_batch"] < result["N"] and all(result["close"])


# --- toma.Trainer ----------------------------------------------------------------------------------------------

# The same MLP, trained for 4 steps of N rows from a loader on the host; the reference takes the same steps with
# each logical batch's gradient computed in pieces of 1024, without toma.
TRAINER = """
N, WIDTH, STEPS, PIECE = 8192, 4096, 4, 1024
ACTIVATION = N * WIDTH * 4

def make_model():
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(32, WIDTH), torch.nn.ReLU(), torch.nn.Linear(WIDTH, 10)).to(DEVICE)

def optimizer_for(model):
    return torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)

torch.manual_seed(0)
data = torch.utils.data.TensorDataset(torch.randn(STEPS * N, 32), torch.randint(0, 10, (STEPS * N,)))
loader = torch.utils.data.DataLoader(data, batch_size=N)
reference = make_model()
optimizer = optimizer_for(reference)
for x, y in loader:
    optimizer.zero_grad()
    x, y = x.to(DEVICE), y.to(DEVICE)
    for s in range(0, N, PIECE):
        (F.cross_entropy(reference(x[s:s + PIECE]), y[s:s + PIECE], reduction="sum") / N).backward()
    optimizer.step()

model = make_model()
trainer = Trainer(model, optimizer_for(model), torch.nn.CrossEntropyLoss(), loader, batch_size=N, device=DEVICE,
                  verbose=0)
cap(2 * ACTIVATION)
trainer.fit(1)
uncap()
close = [bool(torch.allclose(p, r, rtol=1e-4, atol=1e-6)) for p, r in zip(model.parameters(), reference.parameters())]
print(json.dumps(dict(close=close, N=N, rows=[s["rows"] for s in trainer.history.steps],
                      micro_batch=trainer.micro_batch, retries=trainer.oom_retries,
                      ooms=cuda_ooms(messages, "Trainer.step ran out of memory at micro-batch size"))))
"""


@pytest.mark.cuda
@requires_cuda
def test_the_trainer_under_a_real_cuda_oom_trains_the_reference_steps():
    result = run(TRAINER)
    assert_cuda_ooms(result["ooms"], "Trainer.step")
    assert result["rows"] == [result["N"]] * 4 and result["retries"] >= 1
    assert 0 < result["micro_batch"] < result["N"]
    assert all(result["close"]), "the parameters differ from the steps taken without toma"


# --- TomaTrainer (Hugging Face) --------------------------------------------------------------------------------

# A 2-layer GPT-2 with a vocabulary of 16384: a batch's logits (32 rows x 64 tokens) are 128 MiB, and the loss's
# log-softmax as many again; the cap leaves room for 1.5 times the logits. The plain Trainer trains the reference
# before the cap; TomaTrainer (made before the cap, its model on the GPU) trains under it.
TOMA_TRAINER = """
VOCAB, LENGTH, ROWS, BATCH = 16384, 64, 96, 32
LOGITS = BATCH * LENGTH * VOCAB * 4
from transformers import GPT2Config, GPT2LMHeadModel, Trainer as PlainTrainer, TrainingArguments
from transformers import logging as hf_logging
from toma.integrations.transformers import TomaTrainer
hf_logging.set_verbosity_error()
freeze()

def make():
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=LENGTH, n_embd=32, n_layer=2, n_head=2, bos_token_id=0,
                        eos_token_id=0)
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0
    return GPT2LMHeadModel(config)

generator = torch.Generator().manual_seed(0)
data = [{"input_ids": row, "labels": row} for row in torch.randint(0, VOCAB, (ROWS, LENGTH), generator=generator)]

def trainer_of(cls, output_dir):
    args = TrainingArguments(
        output_dir=output_dir, per_device_train_batch_size=BATCH, num_train_epochs=1, learning_rate=0.5, optim="sgd",
        lr_scheduler_type="constant", max_grad_norm=0.0, report_to="none", use_cpu=DEVICE == "cpu", logging_steps=1,
        save_strategy="no", seed=0, disable_tqdm=True, dataloader_drop_last=True)
    model = make()
    return model, cls(model=model, args=args, train_dataset=data)

reference, plain = trainer_of(PlainTrainer, OUTPUT + "/plain")
plain.train()
reference_params = [p.detach().clone() for p in reference.parameters()]
steps = plain.state.global_step
del reference, plain

model, trainer = trainer_of(TomaTrainer, OUTPUT + "/toma")
on_device = str(next(model.parameters()).device)
cap(3 * LOGITS // 2)
trainer.train()
uncap()
stats = trainer.toma_stats
close = [bool(torch.allclose(p.detach().cpu(), r.cpu(), rtol=1e-4, atol=1e-6))
         for p, r in zip(model.parameters(), reference_params)]
print(json.dumps(dict(close=close, steps=[steps, trainer.state.global_step], micro_batch=stats.micro_batch,
                      retries=stats.oom_retries, batch=BATCH, device=on_device, ooms=cuda_ooms(messages))))
"""


def transformers_or_skip() -> None:
    """TomaTrainer needs transformers >= 5.23 (setup.cfg's `transformers` extra) and accelerate."""
    from packaging.version import Version

    try:
        version = importlib.metadata.version("transformers")
        importlib.metadata.version("accelerate")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("needs transformers and accelerate")
    if Version(version) < Version("5.23"):
        pytest.skip(f"TomaTrainer needs transformers >= 5.23; transformers {version} is installed")


@pytest.mark.cuda
@requires_cuda
def test_toma_trainer_under_a_real_cuda_oom_trains_the_plain_trainers_parameters(tmp_path):
    transformers_or_skip()
    result = run(f"OUTPUT = {str(tmp_path)!r}\n" + TOMA_TRAINER, timeout=240)
    assert result["device"].startswith("cuda")
    assert_cuda_ooms(result["ooms"])
    assert 0 < result["micro_batch"] < result["batch"] and result["retries"] >= 1
    assert result["steps"] == [3, 3]
    assert all(result["close"]), "TomaTrainer under the cap must give the uncapped plain Trainer's parameters"


# --- MicroBatching (Lightning) ---------------------------------------------------------------------------------

# The MLP of the accumulation tests as a LightningModule on one GPU, 2 steps of N rows; the reference steps are
# computed by hand in pieces, and a small fit before the cap has Lightning build what it keeps.
MICRO_BATCHING = """
N, WIDTH, STEPS, PIECE = 8192, 4096, 2, 1024
ACTIVATION = N * WIDTH * 4
import logging
import lightning.pytorch as pl
from toma.integrations.lightning import MicroBatching
logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
freeze()
devices = set()  # where the training steps' batches were

def make_model():
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(32, WIDTH), torch.nn.ReLU(), torch.nn.Linear(WIDTH, 10))

class Wide(pl.LightningModule):
    def __init__(self, net):
        super().__init__()
        self.net = net

    def training_step(self, batch, batch_idx):
        x, y = batch
        devices.add(str(x.device))
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)

def fit(net, x, y, callbacks):
    module = Wide(net)
    trainer = pl.Trainer(accelerator="gpu" if DEVICE == "cuda" else "cpu", devices=1, max_steps=STEPS,
                         callbacks=callbacks, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False)
    trainer.fit(module, torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=N))
    return module

torch.manual_seed(0)
inputs, targets = torch.randn(STEPS * N, 32), torch.randint(0, 10, (STEPS * N,))
reference = make_model().to(DEVICE)
optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
for step in range(STEPS):
    optimizer.zero_grad()
    x, y = inputs[step * N:(step + 1) * N].to(DEVICE), targets[step * N:(step + 1) * N].to(DEVICE)
    for s in range(0, N, PIECE):
        (F.cross_entropy(reference(x[s:s + PIECE]), y[s:s + PIECE], reduction="sum") / N).backward()
    optimizer.step()
fit(torch.nn.Linear(32, 10), inputs[:64], targets[:64], [MicroBatching()])

callback = MicroBatching()
devices.clear()
cap(2 * ACTIVATION)
module = fit(make_model(), inputs, targets, [callback])
uncap()
close = [bool(torch.allclose(p.detach().cpu(), r.detach().cpu(), rtol=1e-4, atol=1e-6))
         for p, r in zip(module.net.parameters(), reference.parameters())]
print(json.dumps(dict(close=close, micro_batch=callback.stats.micro_batch, retries=callback.stats.oom_retries, N=N,
                      devices=sorted(devices), ooms=cuda_ooms(messages, "MicroBatching"))))
"""


@pytest.mark.cuda
@requires_cuda
def test_micro_batching_on_a_gpu_under_a_real_cuda_oom_trains_the_reference_steps():
    if importlib.util.find_spec("lightning") is None:
        pytest.skip("needs lightning")
    result = run(MICRO_BATCHING)
    assert result["devices"] and all(device.startswith("cuda") for device in result["devices"])
    assert_cuda_ooms(result["ooms"], "MicroBatching")
    assert 0 < result["micro_batch"] < result["N"] and result["retries"] >= 1
    assert all(result["close"]), "the steps must equal the reference steps"


# --- HostedEmbedding -------------------------------------------------------------------------------------------

# Adam over 65536 touched rows of 512 floats: the rows and their gradient (128 MiB each) are on the GPU when step()
# starts; moving their Adam state (twice as much) does not fit in the 1.5 times 128 MiB the cap leaves, so the step
# runs out of memory and updates the rows in parts. The first batch trains before the cap (the state tables are
# made then); the forward and backward passes run uncapped, the step under the cap.
HOSTED = """
ROWS, WIDTH, TOUCHED = 80_000, 512, 65_536
PART = TOUCHED * WIDTH * 4

def make(device):
    torch.manual_seed(0)
    return HostedEmbedding(ROWS, WIDTH, optimizer=lambda p: torch.optim.Adam(p, lr=1e-2), device=device)

generator = torch.Generator().manual_seed(1)
batches = [torch.randperm(ROWS, generator=generator)[:TOUCHED] for _ in range(3)]
step_rows = []

def train(module, batches, capped=False):
    for indices in batches:
        module(indices).sum().backward()
        if capped:
            cap(3 * PART // 2)
        module.step()
        if capped:
            uncap()
            step_rows.append(module.step_rows)
    return module

on_cpu = train(make("cpu"), batches).weight.clone()
uncapped = train(make(DEVICE), batches).weight.clone()
capped = train(make(DEVICE), batches[:1])
train(capped, batches[1:], capped=True)
weight = capped.weight
print(json.dumps(dict(
    step_rows=step_rows, touched=TOUCHED, exact=bool(torch.equal(weight, uncapped)),
    close=bool(torch.allclose(weight, uncapped, rtol=1e-6, atol=1e-7)),
    close_to_cpu=bool(torch.allclose(weight, on_cpu, rtol=1e-4, atol=1e-5)),
    ooms=cuda_ooms(messages, "HostedEmbedding.step"))))
"""


@pytest.mark.cuda
@requires_cuda
def test_hosted_embedding_steps_in_parts_under_a_real_cuda_oom_and_trains_as_without_one():
    result = run(HOSTED)
    assert_cuda_ooms(result["ooms"], "HostedEmbedding.step")
    assert all(0 < rows < result["touched"] for rows in result["step_rows"]), result["step_rows"]
    assert result["close"], "the rows differ from the same training without an out-of-memory error"
    assert result["close_to_cpu"], "the rows differ from the same training on the CPU"


# --- mixed precision: out of memory in the middle of a backward pass (item 3) ----------------------------------

# `Hog` is the identity whose backward pass needs HOG_ROW bytes of device memory per row (as a recomputing
# checkpoint's does). It sits before the head, so a backward pass gives the head its gradient, then asks for the
# memory: at N rows (256 MiB) more than the cap leaves, after part of the gradients were accumulated (in an attempt's
# first micro-batch: later ones reuse autocast's cast of the head's weight, whose gradient then comes after Hog's).
# Each of 3 steps starts the reference from the parameters toma's model has (AMP's rounding moves with the smallest
# change of a weight), compares the accumulated, unscaled gradients with those of one unsplit autocast pass
# (uncapped) by norm, and the GradScaler's scale and growth tracker (growth every 2 steps) with the reference
# scaler's, before and after step/update.
AMP = """
N, WIDTH, HOG_ROW, STEPS = 4096, 1024, 65536, 3
partial, watched = [], []

class Hog(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        try:
            workspace = torch.empty(len(grad) * HOG_ROW, dtype=torch.uint8, device=grad.device)
        except torch.OutOfMemoryError:
            partial.append([p.grad is not None for p in watched])
            raise
        del workspace
        return grad

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.body = torch.nn.Sequential(torch.nn.Linear(32, WIDTH), torch.nn.ReLU(), torch.nn.Linear(WIDTH, WIDTH),
                                        torch.nn.ReLU())
        self.head = torch.nn.Linear(WIDTH, 10)

    def forward(self, x):
        return self.head(Hog.apply(self.body(x)))

def scaler_for():
    if DTYPE is not torch.float16:
        return None
    return torch.amp.GradScaler(DEVICE, init_scale=2.0**8, growth_interval=2)

def scaler_state(scaler):
    if scaler is None:
        return None
    state = scaler.state_dict()
    return [state["scale"], state["_growth_tracker"]]

def relative_errors(model, grads):
    return [float((p.grad - r).norm() / r.norm()) for p, r in zip(model.parameters(), grads)]

torch.manual_seed(0)
inputs = torch.randn(STEPS, N, 32, device=DEVICE)
targets = torch.randint(0, 10, (STEPS, N), device=DEVICE)
reference, model = Net().to(DEVICE), Net().to(DEVICE)
reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
reference_scaler, scaler = scaler_for(), scaler_for()
watched[:] = [model.head.weight, model.head.bias]

@toma.accumulate(model=model, initial_micro_batch=N, scaler=scaler, cache_type=NoBatchsizeCache)
def compute_loss(x, y):
    return F.cross_entropy(model(x), y)

steps = []
for x, y in zip(inputs, targets):
    reference.load_state_dict(model.state_dict())
    reference_optimizer.zero_grad()
    with torch.autocast(DEVICE, dtype=DTYPE):
        reference_loss = F.cross_entropy(reference(x), y)
    (reference_loss if reference_scaler is None else reference_scaler.scale(reference_loss)).backward()
    reference_before = scaler_state(reference_scaler)
    if reference_scaler is not None:
        reference_scaler.unscale_(reference_optimizer)
    grads = [p.grad.clone() for p in reference.parameters()]
    if reference_scaler is None:
        reference_optimizer.step()
    else:
        reference_scaler.step(reference_optimizer)
        reference_scaler.update()

    optimizer.zero_grad()
    retries = compute_loss.stats.oom_retries
    cap(N * HOG_ROW // 2 + 16 * N * WIDTH)
    with torch.autocast(DEVICE, dtype=DTYPE):
        loss = compute_loss(x, y)
    uncap()
    before = scaler_state(scaler)
    if scaler is not None:
        scaler.unscale_(optimizer)
    errors = relative_errors(model, grads)
    if scaler is None:
        optimizer.step()
    else:
        scaler.step(optimizer)
        scaler.update()
    steps.append(dict(errors=errors, loss=[float(loss), float(reference_loss)],
                      retries=compute_loss.stats.oom_retries - retries,
                      scaler=[before, reference_before, scaler_state(scaler), scaler_state(reference_scaler)]))
print(json.dumps(dict(steps=steps, partial=partial, micro_batch=compute_loss.stats.micro_batch, N=N,
                      ooms=cuda_ooms(messages))))
"""

# Gradient error allowed, as the norm of the difference over the reference's: each micro-batch's matmuls round
# on their own (fp16 keeps 11 bits, bf16 8); a micro-batch counted twice or left out is off by far more.
AMP_TOLERANCE = {"float16": 1e-2, "bfloat16": 3e-2}


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_an_oom_inside_an_autocast_backward_keeps_amps_gradients_and_the_scalers_state(dtype):
    result = run(f"DTYPE = torch.{dtype}\n" + AMP)
    assert_cuda_ooms(result["ooms"])
    assert any(any(seen) for seen in result["partial"]), (
        f"no error came in a backward pass after the head received its gradient: {result['partial']}"
    )
    assert 0 < result["micro_batch"] < result["N"]
    for step, outcome in enumerate(result["steps"]):
        assert outcome["retries"] >= 1, f"step {step} must run out of memory"
        assert max(outcome["errors"]) < AMP_TOLERANCE[dtype], (step, outcome["errors"])
        loss, reference_loss = outcome["loss"]
        assert abs(loss - reference_loss) <= AMP_TOLERANCE[dtype] * abs(reference_loss)
        before, reference_before, after, reference_after = outcome["scaler"]
        assert before == reference_before, f"step {step}: the failed attempts changed the scaler: {outcome['scaler']}"
        assert after == reference_after, f"step {step}: {outcome['scaler']}"
    if dtype == "float16":  # growth every 2 steps without an inf: the scale doubled once, as the reference's did
        assert result["steps"][-1]["scaler"][2] == [2.0**9, 1]
