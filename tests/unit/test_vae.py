"""The frozen autoencoder: loading (folder, SD folder), moments, scaling, decoding, digests, errors."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("diffusers")

from difftrain.models.vae import LatentCodec  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from text_components import assert_one_line_error, write_tiny_sd_folder, write_tiny_vae  # noqa: E402


@pytest.fixture(scope="module")
def vae_dir(tmp_path_factory) -> Path:
    return write_tiny_vae(tmp_path_factory.mktemp("vae") / "vae")


@pytest.fixture(scope="module")
def codec(vae_dir) -> LatentCodec:
    return LatentCodec.from_path(str(vae_dir))


def _images(n: int = 2, side: int = 16, seed: int = 0) -> torch.Tensor:
    return torch.rand(n, 3, side, side, generator=torch.Generator().manual_seed(seed)) * 2 - 1


def test_attributes_from_the_config(codec, vae_dir, tmp_path):
    assert (codec.latent_channels, codec.factor, codec.scaling_factor, codec.shift_factor) == (4, 2, 0.5, 0.0)
    assert codec.source == str(vae_dir)
    deeper = LatentCodec.from_path(str(write_tiny_vae(tmp_path / "deep", levels=3, scaling_factor=0.25)))
    assert (deeper.factor, deeper.scaling_factor) == (4, 0.25)
    assert not any(p.requires_grad for p in codec.parameters())


def test_moments_match_the_autoencoder(codec, vae_dir):
    from diffusers import AutoencoderKL

    x = _images()
    mean, std = codec.encode_moments(x)
    assert mean.shape == std.shape == (2, 4, 8, 8) and mean.dtype == std.dtype == torch.float32
    assert (std > 0).all() and not mean.requires_grad
    dist = AutoencoderKL.from_pretrained(str(vae_dir)).eval().encode(x).latent_dist
    torch.testing.assert_close(mean, dist.mean)
    torch.testing.assert_close(std, dist.std)
    again, _ = codec.encode_moments(x[:1])
    torch.testing.assert_close(again[0], mean[0], rtol=1e-5, atol=1e-5)


def test_scaling_and_shift(codec, vae_dir, tmp_path):
    z = torch.randn(2, 4, 8, 8)
    torch.testing.assert_close(codec.to_model(z), z * 0.5)
    torch.testing.assert_close(codec.from_model(codec.to_model(z)), z)
    shifted = tmp_path / "shifted"
    write_tiny_vae(shifted)
    config = json.loads((shifted / "config.json").read_text())
    (shifted / "config.json").write_text(json.dumps({**config, "shift_factor": 0.1}))
    s = LatentCodec.from_path(str(shifted))
    assert s.shift_factor == pytest.approx(0.1)
    torch.testing.assert_close(s.to_model(z), (z - 0.1) * 0.5)
    torch.testing.assert_close(s.from_model(s.to_model(z)), z)


def test_decode_shape_range_and_scaling(codec, vae_dir):
    from diffusers import AutoencoderKL

    mean, _ = codec.encode_moments(_images())
    y = codec.decode(codec.to_model(mean))
    assert y.shape == (2, 3, 16, 16) and y.dtype == torch.float32 and torch.isfinite(y).all()
    assert y.min() >= -1 and y.max() <= 1
    expected = AutoencoderKL.from_pretrained(str(vae_dir)).eval().decode(mean).sample.clamp(-1, 1)
    torch.testing.assert_close(y, expected)  # decode undoes to_model's scaling


def test_digest_stable_and_tells_weights_apart(codec, vae_dir, tmp_path):
    assert LatentCodec.from_path(str(vae_dir)).digest == codec.digest
    other = LatentCodec.from_path(str(write_tiny_vae(tmp_path / "other", seed=1)))
    assert other.digest != codec.digest
    assert len(codec.digest) == 64


def test_sd_folder(tmp_path):
    sd = write_tiny_sd_folder(tmp_path / "sd")
    from_sd, direct = LatentCodec.from_path(str(sd)), LatentCodec.from_path(str(sd / "vae"))
    assert from_sd.digest == direct.digest and from_sd.source == str(sd)
    assert (from_sd.latent_channels, from_sd.factor) == (4, 2)


def test_bad_images_are_refused(codec):
    with pytest.raises(ValueError, match="encodes"):
        codec.encode_moments(torch.zeros(1, 1, 16, 16))
    with pytest.raises(ValueError, match="multiples of 2"):
        codec.encode_moments(torch.zeros(1, 3, 15, 16))


def _one_line_error(path: str, *needles: str):
    assert_one_line_error(LatentCodec.from_path, path, *needles)


def test_errors_name_the_folder(tmp_path):
    _one_line_error(str(tmp_path / "nothing"), "no such folder")
    (tmp_path / "empty").mkdir()
    _one_line_error(str(tmp_path / "empty"), "config.json")
    folder = write_tiny_vae(tmp_path / "noweights")
    (folder / "diffusion_pytorch_model.safetensors").unlink()
    _one_line_error(str(folder), "no weights")
    unet = tmp_path / "unet"
    unet.mkdir()
    (unet / "config.json").write_text(json.dumps({"_class_name": "UNet2DModel"}))
    _one_line_error(str(unet), "'UNet2DModel'", "not an AutoencoderKL")
    corrupt = write_tiny_vae(tmp_path / "corrupt")
    (corrupt / "diffusion_pytorch_model.safetensors").write_bytes(b"not a safetensors file")
    _one_line_error(str(corrupt), "cannot load")


def test_weights_that_do_not_fit_are_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = write_tiny_vae(tmp_path / "vae")
    weights = folder / "diffusion_pytorch_model.safetensors"
    tensors = load_file(weights)
    save_file({k: v for k, v in tensors.items() if k != sorted(tensors)[0]}, weights, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"vae .*(do not fit|cannot load)") as info:
        LatentCodec.from_path(str(folder))
    assert "\n" not in str(info.value) and str(folder) in str(info.value)
