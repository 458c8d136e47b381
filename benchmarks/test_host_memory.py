"""Host memory as the overflow, on the CPU: `toma.map` against the plain chunk loop it replaces, and a
`HostedEmbedding` training step against `nn.Embedding(sparse=True)` with `SparseAdam`.

Run: python -m pytest benchmarks/test_host_memory.py --benchmark-only --benchmark-group-by=group
The chunk size fits, so toma.map never retries: the ratio is its bookkeeping (split, moves that are no-ops on
the CPU, joining the outputs). The GPU figures (transfer GB/s, overlap) come from benchmarks/transfer_gpu.py.
"""

import pytest
import torch
from torch import nn

from toma import HostedEmbedding, NoBatchsizeCache
from toma import toma as tm

MAP = "map: an MLP over 65536 host rows in chunks of 4096"
EMBEDDING = "embedding step: 4096 lookups in a 200000 x 64 table, Adam"
ROWS, CHUNK = 65536, 4096
TABLE, WIDTH, LOOKUPS = 200_000, 64, 4096


@pytest.fixture(scope="module")
def mlp():
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 16))
    return model, torch.randn(ROWS, 64)


def chunk_loop(model, inputs):
    with torch.no_grad():
        return torch.cat([model(inputs[start : start + CHUNK]) for start in range(0, len(inputs), CHUNK)])


def toma_map(model, inputs):
    with torch.no_grad():
        return tm.map(model, inputs, device="cpu", initial_step=CHUNK, cache_type=NoBatchsizeCache)


def test_plain_chunk_loop(benchmark, mlp):
    benchmark.group = MAP
    benchmark(chunk_loop, *mlp)


def test_toma_map(benchmark, mlp):
    benchmark.group = MAP
    assert torch.equal(benchmark(toma_map, *mlp), chunk_loop(*mlp))


@pytest.fixture(scope="module")
def lookups():
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(0, TABLE, (LOOKUPS,), generator=generator) for _ in range(8)]


def sparse_step(state, lookups):
    embedding, optimizer = state[0], state[1]
    indices = lookups[state[2] % len(lookups)]
    state[2] += 1
    optimizer.zero_grad()
    embedding(indices).pow(2).sum().backward()
    optimizer.step()


def hosted_step(state, lookups):
    embedding = state[0]
    indices = lookups[state[1] % len(lookups)]
    state[1] += 1
    embedding(indices).pow(2).sum().backward()
    embedding.step()


def test_sparse_embedding_with_sparse_adam(benchmark, lookups):
    benchmark.group = EMBEDDING
    torch.set_num_threads(1)
    embedding = nn.Embedding(TABLE, WIDTH, sparse=True)
    benchmark(sparse_step, [embedding, torch.optim.SparseAdam(embedding.parameters(), lr=1e-3), 0], lookups)


def test_hosted_embedding_with_adam(benchmark, lookups):
    benchmark.group = EMBEDDING
    torch.set_num_threads(1)
    embedding = HostedEmbedding(TABLE, WIDTH, optimizer=lambda p: torch.optim.Adam(p, lr=1e-3), device="cpu")
    benchmark(hosted_step, [embedding, 0], lookups)
