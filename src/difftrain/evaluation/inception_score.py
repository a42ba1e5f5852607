"""Inception Score (Salimans et al. 2016) with a local Inception-v3 and its 1008-way classifier.

IS = exp(E_x KL(p(y|x) || p(y))), computed on `splits` disjoint parts of the images and
reported as the mean and standard deviation (ddof=0) over the parts, as the original code.

The network is the FID Inception-v3 (TF "inception-2015-12-05" weights) with its classifier
head, read from a state dict in the key layout of pytorch-fid's
`pt_inception-2015-12-05-6726825d.pth` (`Conv2d_1a_3x3.conv.weight`, `Mixed_5b.branch1x1.bn.*`,
..., `fc.weight` (1008, 2048), `fc.bias` (1008,)). difftrain never downloads it: point
`evaluation.is_inception_path` at a copy. The architecture is written out here (torchvision
is not used) with the FID variant's pooling: the pool branches of the A, C and first E blocks
average with count_include_pad=False and the last E block max-pools.

Input preprocessing is the FID one (`inception.preprocess_for_inception`): [0, 255] -> /255 ->
bilinear resize to 299x299 (align_corners=False, no antialias) -> 2x - 1.

Logits: like the original TF code (which multiplies pool3 by the softmax weight only),
torch-fidelity and torchmetrics ("logits_unbiased"), the classifier's bias is left out by
default; `use_fc_bias=True` adds it. Scores are only comparable when made the same way.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .inception import FEATURE_DIM, preprocess_for_inception

NUM_CLASSES = 1008  # the TF graph's classifier: 1000 ImageNet classes and 8 unused


def inception_score(probs: torch.Tensor | np.ndarray, splits: int = 10) -> tuple[float, float]:
    """(mean, std) of exp(E_x KL(p(y|x) || p(y))) over `splits` parts of probs (N, K).

    Rows must be probability vectors. Part i holds rows [i*N//splits, (i+1)*N//splits);
    p(y) is the mean of the part's rows. Computed in float64; 0 * log 0 counts as 0.
    """
    p = torch.as_tensor(probs).detach().to("cpu", torch.float64)
    if p.ndim != 2:
        raise ValueError(f"probs must be (N, K), got shape {tuple(p.shape)}")
    n = p.shape[0]
    if splits < 1 or n < splits:
        raise ValueError(f"need 1 <= splits <= N, got splits={splits} for N={n} images")
    if (p < 0).any() or not torch.allclose(p.sum(1), torch.ones(n, dtype=p.dtype), atol=1e-4):
        raise ValueError("probs rows must be non-negative and sum to 1")
    scores = []
    for i in range(splits):
        part = p[i * n // splits:(i + 1) * n // splits]  # (n_i, K)
        marginal = part.mean(0, keepdim=True)  # p(y), (1, K)
        kl = torch.where(part > 0, part * (part.log() - marginal.log()), 0.0).sum(1)  # (n_i,)
        scores.append(float(kl.mean().exp()))
    return float(np.mean(scores)), float(np.std(scores))


# ---- The network ------------------------------------------------------------------------

class BasicConv2d(nn.Module):
    """Convolution without bias, batch norm with eps 1e-3 (TF's), ReLU."""

    def __init__(self, cin: int, cout: int, kernel, stride=1, padding=0):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, kernel, stride=stride, padding=padding, bias=False)
        self.bn = nn.BatchNorm2d(cout, eps=1e-3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn(self.conv(x)))


def _avg_pool_without_padding(x: torch.Tensor) -> torch.Tensor:
    """3x3 stride-1 average that leaves the zero padding out of the mean (TF's pooling)."""
    return F.avg_pool2d(x, 3, stride=1, padding=1, count_include_pad=False)


class InceptionA(nn.Module):
    """35x35 block: 1x1 | 1x1 -> 5x5 | 1x1 -> 3x3 -> 3x3 | avg pool -> 1x1."""

    def __init__(self, cin: int, pool_features: int):
        super().__init__()
        self.branch1x1 = BasicConv2d(cin, 64, 1)
        self.branch5x5_1 = BasicConv2d(cin, 48, 1)
        self.branch5x5_2 = BasicConv2d(48, 64, 5, padding=2)
        self.branch3x3dbl_1 = BasicConv2d(cin, 64, 1)
        self.branch3x3dbl_2 = BasicConv2d(64, 96, 3, padding=1)
        self.branch3x3dbl_3 = BasicConv2d(96, 96, 3, padding=1)
        self.branch_pool = BasicConv2d(cin, pool_features, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b5 = self.branch5x5_2(self.branch5x5_1(x))
        b3 = self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x)))
        pool = self.branch_pool(_avg_pool_without_padding(x))
        return torch.cat([self.branch1x1(x), b5, b3, pool], 1)


class InceptionB(nn.Module):
    """35 -> 17 reduction: 3x3/2 | 1x1 -> 3x3 -> 3x3/2 | max pool/2."""

    def __init__(self, cin: int):
        super().__init__()
        self.branch3x3 = BasicConv2d(cin, 384, 3, stride=2)
        self.branch3x3dbl_1 = BasicConv2d(cin, 64, 1)
        self.branch3x3dbl_2 = BasicConv2d(64, 96, 3, padding=1)
        self.branch3x3dbl_3 = BasicConv2d(96, 96, 3, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b3 = self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x)))
        return torch.cat([self.branch3x3(x), b3, F.max_pool2d(x, 3, stride=2)], 1)


class InceptionC(nn.Module):
    """17x17 block with 7x7 convolutions factorised into 1x7 and 7x1."""

    def __init__(self, cin: int, channels_7x7: int):
        super().__init__()
        c7 = channels_7x7
        row, col = dict(kernel=(1, 7), padding=(0, 3)), dict(kernel=(7, 1), padding=(3, 0))
        self.branch1x1 = BasicConv2d(cin, 192, 1)
        self.branch7x7_1 = BasicConv2d(cin, c7, 1)
        self.branch7x7_2 = BasicConv2d(c7, c7, **row)
        self.branch7x7_3 = BasicConv2d(c7, 192, **col)
        self.branch7x7dbl_1 = BasicConv2d(cin, c7, 1)
        self.branch7x7dbl_2 = BasicConv2d(c7, c7, **col)
        self.branch7x7dbl_3 = BasicConv2d(c7, c7, **row)
        self.branch7x7dbl_4 = BasicConv2d(c7, c7, **col)
        self.branch7x7dbl_5 = BasicConv2d(c7, 192, **row)
        self.branch_pool = BasicConv2d(cin, 192, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b7 = self.branch7x7_3(self.branch7x7_2(self.branch7x7_1(x)))
        b7dbl = x
        for layer in (self.branch7x7dbl_1, self.branch7x7dbl_2, self.branch7x7dbl_3,
                      self.branch7x7dbl_4, self.branch7x7dbl_5):
            b7dbl = layer(b7dbl)
        pool = self.branch_pool(_avg_pool_without_padding(x))
        return torch.cat([self.branch1x1(x), b7, b7dbl, pool], 1)


class InceptionD(nn.Module):
    """17 -> 8 reduction: 1x1 -> 3x3/2 | 1x1 -> 1x7 -> 7x1 -> 3x3/2 | max pool/2."""

    def __init__(self, cin: int):
        super().__init__()
        self.branch3x3_1 = BasicConv2d(cin, 192, 1)
        self.branch3x3_2 = BasicConv2d(192, 320, 3, stride=2)
        self.branch7x7x3_1 = BasicConv2d(cin, 192, 1)
        self.branch7x7x3_2 = BasicConv2d(192, 192, (1, 7), padding=(0, 3))
        self.branch7x7x3_3 = BasicConv2d(192, 192, (7, 1), padding=(3, 0))
        self.branch7x7x3_4 = BasicConv2d(192, 192, 3, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b3 = self.branch3x3_2(self.branch3x3_1(x))
        b7 = self.branch7x7x3_4(self.branch7x7x3_3(self.branch7x7x3_2(self.branch7x7x3_1(x))))
        return torch.cat([b3, b7, F.max_pool2d(x, 3, stride=2)], 1)


class InceptionE(nn.Module):
    """8x8 block whose 3x3 branches end in parallel 1x3 and 3x1 convolutions.

    pool: "avg" (without padding, Mixed_7b) or "max" (Mixed_7c of the FID network).
    """

    def __init__(self, cin: int, pool: str):
        super().__init__()
        if pool not in ("avg", "max"):
            raise ValueError(f"pool must be 'avg' or 'max', got {pool!r}")
        self.pool = pool
        self.branch1x1 = BasicConv2d(cin, 320, 1)
        self.branch3x3_1 = BasicConv2d(cin, 384, 1)
        self.branch3x3_2a = BasicConv2d(384, 384, (1, 3), padding=(0, 1))
        self.branch3x3_2b = BasicConv2d(384, 384, (3, 1), padding=(1, 0))
        self.branch3x3dbl_1 = BasicConv2d(cin, 448, 1)
        self.branch3x3dbl_2 = BasicConv2d(448, 384, 3, padding=1)
        self.branch3x3dbl_3a = BasicConv2d(384, 384, (1, 3), padding=(0, 1))
        self.branch3x3dbl_3b = BasicConv2d(384, 384, (3, 1), padding=(1, 0))
        self.branch_pool = BasicConv2d(cin, 192, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b3 = self.branch3x3_1(x)
        b3dbl = self.branch3x3dbl_2(self.branch3x3dbl_1(x))
        pooled = (F.max_pool2d(x, 3, stride=1, padding=1) if self.pool == "max"
                  else _avg_pool_without_padding(x))
        return torch.cat([self.branch1x1(x), self.branch3x3_2a(b3), self.branch3x3_2b(b3),
                          self.branch3x3dbl_3a(b3dbl), self.branch3x3dbl_3b(b3dbl),
                          self.branch_pool(pooled)], 1)


class InceptionClassifier(nn.Module):
    """FID Inception-v3 with its 1008-way classifier; frozen, always in eval mode.

    Attribute names follow pytorch-fid's pt_inception state dict. Usage:
    `net = InceptionClassifier.from_path(path).to(device); probs = net(images_uint8_nchw)`.
    """

    def __init__(self, use_fc_bias: bool = False):
        super().__init__()
        self.use_fc_bias = use_fc_bias
        self.source = ""
        self.Conv2d_1a_3x3 = BasicConv2d(3, 32, 3, stride=2)
        self.Conv2d_2a_3x3 = BasicConv2d(32, 32, 3)
        self.Conv2d_2b_3x3 = BasicConv2d(32, 64, 3, padding=1)
        self.Conv2d_3b_1x1 = BasicConv2d(64, 80, 1)
        self.Conv2d_4a_3x3 = BasicConv2d(80, 192, 3)
        self.Mixed_5b = InceptionA(192, pool_features=32)
        self.Mixed_5c = InceptionA(256, pool_features=64)
        self.Mixed_5d = InceptionA(288, pool_features=64)
        self.Mixed_6a = InceptionB(288)
        self.Mixed_6b = InceptionC(768, channels_7x7=128)
        self.Mixed_6c = InceptionC(768, channels_7x7=160)
        self.Mixed_6d = InceptionC(768, channels_7x7=160)
        self.Mixed_6e = InceptionC(768, channels_7x7=192)
        self.Mixed_7a = InceptionD(768)
        self.Mixed_7b = InceptionE(1280, pool="avg")
        self.Mixed_7c = InceptionE(2048, pool="max")
        self.fc = nn.Linear(FEATURE_DIM, NUM_CLASSES)
        self.requires_grad_(False)
        self.eval()

    @classmethod
    def from_path(cls, path: str | os.PathLike, use_fc_bias: bool = False
                  ) -> InceptionClassifier:
        """Load a state dict saved with torch.save (pt_inception-2015-12-05 layout), on CPU.

        `num_batches_tracked` buffers may be present or absent; every other key must match
        in name and shape.
        """
        file = Path(path).expanduser()
        if not file.is_file():
            raise ValueError(f"evaluation.is_inception_path: {file} is not a file")
        try:
            with warnings.catch_warnings():  # the TorchScript case is reported below
                warnings.filterwarnings("ignore", message=".*TorchScript", category=UserWarning)
                state = torch.load(file, map_location="cpu", weights_only=True)
        except Exception as e:  # torch raises several types for files that are not pickles
            if "TorchScript" in str(e):
                raise ValueError(
                    f"{file} is a TorchScript file (such as the FID feature network, which has "
                    "no classifier head); the Inception Score needs the state dict "
                    "pt_inception-2015-12-05-6726825d.pth") from e
            first = str(e).split(". ")[0].splitlines()[0] if str(e) else ""
            raise ValueError(f"{file} is not a PyTorch state dict file ({type(e).__name__}: "
                             f"{first})") from e
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor)
                                                  for v in state.values()):
            raise ValueError(f"{file} does not hold a state dict of tensors "
                             "(expected pytorch-fid's pt_inception-2015-12-05-6726825d.pth)")
        net = cls(use_fc_bias=use_fc_bias)
        expected = {k: v.shape for k, v in net.state_dict().items()
                    if not k.endswith("num_batches_tracked")}
        given = {k: v.shape for k, v in state.items() if not k.endswith("num_batches_tracked")}
        missing = sorted(set(expected) - set(given))
        unexpected = sorted(set(given) - set(expected))
        wrong = sorted(k for k in set(expected) & set(given) if expected[k] != given[k])
        if missing or unexpected or wrong:
            details = "; ".join(f"{label} {len(keys)} keys (e.g. {keys[0]})" for label, keys in
                                (("missing", missing), ("unexpected", unexpected),
                                 ("wrong shape in", wrong)) if keys)
            raise ValueError(f"{file} is not an Inception-v3 state dict in the pt_inception "
                             f"layout with a 1008-way fc: {details}")
        net.load_state_dict(state, strict=False)  # num_batches_tracked is optional
        net.source = str(file)
        return net

    def train(self, mode: bool = True) -> InceptionClassifier:
        """Stay in eval mode: the batch norm statistics are part of the fixed network."""
        return super().train(False)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, 3, 299, 299) float32 in [-1, 1] -> (B, 2048) pool3 features."""
        for layer in (self.Conv2d_1a_3x3, self.Conv2d_2a_3x3, self.Conv2d_2b_3x3):
            x = layer(x)
        x = F.max_pool2d(x, 3, stride=2)
        x = self.Conv2d_4a_3x3(self.Conv2d_3b_1x1(x))
        x = F.max_pool2d(x, 3, stride=2)
        for block in (self.Mixed_5b, self.Mixed_5c, self.Mixed_5d, self.Mixed_6a,
                      self.Mixed_6b, self.Mixed_6c, self.Mixed_6d, self.Mixed_6e,
                      self.Mixed_7a, self.Mixed_7b, self.Mixed_7c):
            x = block(x)
        return x.mean(dim=(2, 3))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, 3, 299, 299) in [-1, 1] -> (B, 1008) logits (bias only if use_fc_bias)."""
        feats = self.features(x)
        return F.linear(feats, self.fc.weight, self.fc.bias if self.use_fc_bias else None)

    @torch.no_grad()
    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """images: (B, 3 or 1, H, W) uint8 (or float in [0, 255]) -> (B, 1008) probabilities."""
        x = preprocess_for_inception(images.to(self.fc.weight.device))
        return self.logits(x).double().softmax(-1).float()


def images_inception_score(images: torch.Tensor | np.ndarray, classifier: InceptionClassifier,
                           batch_size: int = 50, device: str | torch.device = "cpu",
                           splits: int = 10) -> tuple[float, float, int]:
    """(IS mean, IS std, number of images) of images (N, H, W, 3 or 1) uint8.

    The classifier is moved to `device`; images go through it `batch_size` at a time.
    """
    x = torch.as_tensor(images)
    if x.ndim != 4 or x.shape[-1] not in (1, 3):
        raise ValueError(f"images must be (N, H, W, 1 or 3), got shape {tuple(x.shape)}")
    if x.dtype != torch.uint8:
        raise TypeError(f"images must be uint8, got {x.dtype}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    classifier = classifier.to(device)
    probs = [classifier(x[i:i + batch_size].permute(0, 3, 1, 2)).cpu()
             for i in range(0, len(x), batch_size)]
    if not probs:
        raise ValueError("Inception Score of no images")
    mean, std = inception_score(torch.cat(probs), splits=splits)
    return mean, std, len(x)
