"""The diversity figures in bounded memory (issue 26, item 4): the Vendi score from the D x D
feature covariance and the mean pairwise distance over tiles equal the whole-matrix formulas at
small n, and at an n whose n x n float64 matrix alone would take 1 GiB they stay in tens of MiB."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from difftrain.evaluation.diversity import mean_pairwise_distance, vendi_score


def _reference_vendi(features: torch.Tensor) -> float:
    """The Vendi score from the whole n x n cosine kernel (the formula before issue 26)."""
    x = features.double()
    eig = torch.linalg.eigvalsh(x @ x.T / x.shape[0]).clamp_min(0)
    eig = eig[eig > 1e-12]
    return float(torch.exp(-(eig * eig.log()).sum()))


def _reference_pairwise(features: torch.Tensor) -> float:
    """The mean pairwise distance from the whole n x n distance matrix (the formula before issue 26)."""
    n = features.shape[0]
    return float(torch.cdist(features.double(), features.double()).sum() / (n * (n - 1)))


@pytest.mark.parametrize("n,dim", [(300, 16), (50, 192), (1500, 8)])
def test_the_chunked_figures_equal_the_whole_matrix_formulas(n, dim):
    g = torch.Generator().manual_seed(n)
    x = F.normalize(torch.randn(n, dim, generator=g) + torch.randn(1, dim, generator=g), dim=1)
    assert vendi_score(x, chunk=128) == pytest.approx(_reference_vendi(x), rel=1e-9)
    assert mean_pairwise_distance(x, chunk=128) == pytest.approx(_reference_pairwise(x), rel=1e-9)
    assert mean_pairwise_distance(x) == pytest.approx(_reference_pairwise(x), rel=1e-9)


_PEAK = """
import json, resource, sys, torch
from difftrain.evaluation.diversity import mean_pairwise_distance, vendi_score
torch.set_num_threads(1)
n, dim = int(sys.argv[1]), int(sys.argv[2])
x = torch.nn.functional.normalize(torch.randn(n, dim, generator=torch.Generator().manual_seed(0)), dim=1)
vendi_score(x[:2000]), mean_pairwise_distance(x[:2000])  # warm up: the allocator, BLAS
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
vendi, pairwise = vendi_score(x), mean_pairwise_distance(x)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"extra_mib": (peak - before) / 1024, "vendi": vendi, "pairwise": pairwise}))
"""


def test_memory_stays_bounded_where_the_n_by_n_matrix_would_take_gigabytes():
    n, dim = 12_000, 8  # the old formulas: two n x n float64 matrices of 1.07 GiB each
    src = str(Path(__file__).resolve().parents[2] / "src")
    env = {**os.environ, "PYTHONPATH": src, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", _PEAK, str(n), str(dim)], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["extra_mib"] < 128, result  # n x n float64: 1,099 MiB
    assert 1 <= result["vendi"] <= dim and 1.2 < result["pairwise"] < 1.5, result  # random unit vectors in 8-d
