"""Flux's distilled guidance is a setting of the run (``model.distilled_guidance`` in training,
``validation.distilled_guidance`` / ``sample --distilled-guidance`` in sampling), added to every
condition by ``Conditioning``: what the config says reaches the transformer's ``guidance`` input (a
forward hook on the tiny Flux transformer of tests/family_bases.py), and the text cache's entries hold
the text encoders' outputs alone (a store of the old layout, whose entries held the guidance, is
left aside and a new one built)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("diffusers")
pytest.importorskip("peft")

from difftrain.config import ConfigError, load_config  # noqa: E402
from difftrain.data import text_cache  # noqa: E402
from difftrain.families.flux import FluxDenoiser, FluxPromptEncoder  # noqa: E402
from difftrain.training.loop import train  # noqa: E402
from tests.family_bases import T5_LENGTH, write_tiny_flux_folder  # noqa: E402
from tests.integration.test_text_train import _captioned_folder  # noqa: E402


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    root = tmp_path_factory.mktemp("flux-guidance")
    _captioned_folder(root / "data", n=4, size=32)
    return write_tiny_flux_folder(root / "base"), root / "data"


@pytest.fixture()
def seen(monkeypatch):
    """Every ``guidance`` the Flux transformers built from now on are called with, as lists of floats."""
    calls: list[list[float]] = []
    original = FluxDenoiser.__init__

    def hooked(self, model):
        original(self, model)
        model.register_forward_pre_hook(
            lambda module, args, kwargs: calls.append(kwargs["guidance"].tolist()), with_kwargs=True)

    monkeypatch.setattr(FluxDenoiser, "__init__", hooked)
    return calls


class _OldFluxEncoder(FluxPromptEncoder):
    """The prompt encoder as difftrain wrote version-1 text caches: the guidance 3.5 in every entry."""

    def assemble(self, outputs, device="cpu"):  # what encode() and the text cache's staged fill return
        cond = super().assemble(outputs, device)
        return cond | {"guidance": torch.full((cond["pooled"].shape[0],), 3.5, device=device)}


def test_the_configured_guidance_reaches_the_transformer_and_not_the_text_cache(tmp_path, flux, seen):
    folder, data = flux
    cache = tmp_path / "cache"
    options = {"max_sequence_length": T5_LENGTH}
    with pytest.MonkeyPatch.context() as old_version:  # a store the old code wrote, guidance in every entry
        old_version.setattr(text_cache, "TEXT_CACHE_VERSION", 1)
        old = text_cache.TextCache.for_encoder(folder, "flux", options, cache)
        text_cache.CachedPromptEncoder(old, lambda: _OldFluxEncoder(folder, T5_LENGTH)).ensure(["a red square"])
    assert "guidance" in old.read(text_cache.entry_name("a red square"), "a red square")

    cfg = load_config(None, [
        f"model.init_from={folder}", f"data.path={data}", "data.resolution=32", "data.num_workers=0",
        f"data.cache_dir={cache}", f"model.max_sequence_length={T5_LENGTH}", "lora.rank=2", "train.batch_size=2",
        "train.total_steps=1", "train.progress_bar=false", "checkpoint.every_steps=1", "validation.every_steps=1",
        "validation.steps=1", "validation.num_images=1", "validation.prompts=['a red square']",
        "validation.memorization=off", "model.distilled_guidance=2.0", "validation.distilled_guidance=5.0"])
    assert cfg.text.cache == "auto"
    train(cfg, tmp_path / "run")
    values = {v for call in seen for v in call}
    assert values == {2.0, 5.0}, values  # the training step's, then the validation grid's
    assert seen[0] == [2.0, 2.0]  # the first call: the training step (batch 2)

    stores = sorted(p for p in cache.glob("text-flux-*") if p.is_dir())
    assert len(stores) == 2 and old.folder in stores  # the old store left aside, a new one built
    new = next(p for p in stores if p != old.folder)
    entries = list(new.glob("*.safetensors"))
    assert entries
    from safetensors import safe_open

    for entry in entries:
        with safe_open(str(entry), framework="pt") as f:
            assert set(f.keys()) == {"prompt_embeds", "pooled"}, entry  # the text encoders' outputs alone

    from difftrain.cli import main

    # sample: the run's validation value, or the option's
    for option, want in (([], 5.0), (["--distilled-guidance", "6.5"], 6.5)):
        seen.clear()
        assert main(["sample", "--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / f"out{want}"), "--num",
                     "1", "--steps", "1", "--sampler", "euler", "--prompt", "a red square", "--device", "cpu",
                     *option]) == 0
        assert {v for call in seen for v in call} == {want}
    from difftrain.generation.inference import load_model

    with pytest.raises(ConfigError, match="validation.distilled_guidance must be >= 0"):
        load_model(tmp_path / "run", device="cpu", distilled_guidance=-1.0)


def test_distilled_guidance_is_refused_for_a_model_without_a_guidance_input(tmp_path, capsys):
    """``sample --distilled-guidance`` on a model of difftrain's own UNet: one line, exit 2."""
    from difftrain.cli import main
    from tests.small_checkpoint import make_checkpoint

    make_checkpoint(tmp_path)
    assert main(["sample", "--checkpoint", str(tmp_path), "--out", str(tmp_path / "out"), "--num", "1", "--steps",
                 "1", "--distilled-guidance", "2", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--distilled-guidance given" in err[0] and "no guidance input" in err[0], err
