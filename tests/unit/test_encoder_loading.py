"""The text cache's fill loads each text encoder from its files, one at a time, in the compute dtype, and the
encoders' digest is of their files' stored bytes (issue 41, item 4 and 5; data/text_cache.py, families/*.py's
PromptEncoders, models/text.py ``files_digest``, networks/conditioning.py's references).

Built on the tiny SD3 base of tests/family_bases.py (CLIP-L, CLIP-G, T5).
"""

from __future__ import annotations

import gc
import weakref
from types import SimpleNamespace

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")
pytest.importorskip("diffusers")

from difftrain.data.text_cache import CachedPromptEncoder, TextCache, cached_prompt_encoder
from difftrain.families import base as family_base
from difftrain.families import detect
from difftrain.models.text import vocab_bytes, weights_digest
from difftrain.networks.conditioning import Conditioning
from difftrain.runtime import stored_digest
from tests.family_bases import write_tiny_sd3_folder

CAPTIONS = ["a red square", "a blue square, dark background", "", "a green disc"]
OPTIONS = {"max_sequence_length": 8}


@pytest.fixture(scope="module")
def sd3(tmp_path_factory):
    return write_tiny_sd3_folder(tmp_path_factory.mktemp("encoder_loading") / "sd3")


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DIFFTRAIN_CACHE", str(tmp_path / "cache"))  # the digests' cache: none taken before


def _cfg(folder, cache_dir, precision="bf16"):
    """What ``Family.run_prompt_encoder`` and ``cached_prompt_encoder`` read of a run's config."""
    return SimpleNamespace(model=SimpleNamespace(text_encoder=str(folder), max_sequence_length=8),
                           text=SimpleNamespace(cache="on", shuffle_tags=False, tag_dropout=0.0),
                           data=SimpleNamespace(cache_dir=str(cache_dir)), train=SimpleNamespace(precision=precision))


def _cached(folder, cache_dir, precision="bf16") -> CachedPromptEncoder:
    """The run's text encoders behind the cache, as training makes them (Conditioning.from_config)."""
    text = detect(folder).run_prompt_encoder(_cfg(folder, cache_dir, precision), "cpu", cached_prompt_encoder)
    assert isinstance(text, CachedPromptEncoder)
    return text


class _Loads:
    """Spy on ``families.base.load_part``: each model load's (folder, dtype asked, dtype held) and how many
    models loaded before were still alive (held by anyone) when it was loaded."""

    def __init__(self, monkeypatch):
        self.calls, self.live = [], []
        real = family_base.load_part

        def load_part(folder, sub, cls, what, dtype=torch.float32, **kwargs):
            part = real(folder, sub, cls, what, dtype=dtype, **kwargs)
            if isinstance(part, nn.Module):
                gc.collect()
                alive = sum(ref() is not None for ref in self.live)
                self.calls.append((sub, dtype, {p.dtype for p in part.parameters()}, alive))
                self.live.append(weakref.ref(part))
            return part

        monkeypatch.setattr(family_base, "load_part", load_part)


def test_the_fill_loads_each_encoder_from_its_files_in_the_compute_dtype_one_at_a_time(sd3, tmp_path, monkeypatch):
    loads = _Loads(monkeypatch)
    text = _cached(sd3, tmp_path)
    assert text.ensure(CAPTIONS, batch_size=2) == len(CAPTIONS)
    # each encoder read once, in bf16 from the files (never float32 first), none alive when the next is read
    assert loads.calls == [(sub, torch.bfloat16, {torch.bfloat16}, 0)
                           for sub in ("text_encoder", "text_encoder_2", "text_encoder_3")]
    gc.collect()
    assert all(ref() is None for ref in loads.live)  # and none held once the fill is done
    whole = detect(sd3).load_prompt_encoder(sd3, "cpu", **OPTIONS)  # float32, as a run without the cache
    served = text.encode(CAPTIONS, "cpu")
    for key, value in whole.encode(CAPTIONS, "cpu").items():
        assert (served[key] - value).abs().max() <= 0.05 * value.abs().max() + 1e-3  # bf16's 8 bits, through 3 models


def test_a_full_cache_loads_no_encoder_nor_tokenizer(sd3, tmp_path, monkeypatch):
    _cached(sd3, tmp_path).ensure(CAPTIONS)
    loads = _Loads(monkeypatch)
    called = []
    monkeypatch.setattr(family_base.Family, "load_prompt_encoder",
                        lambda *a, **k: called.append(a) or pytest.fail("the encoders were loaded"))
    again = _cached(sd3, tmp_path)
    assert again.ensure(CAPTIONS) == 0
    again.encode(CAPTIONS, "cpu"), again.null(2, "cpu")
    refs = Conditioning(text=again, family=detect(sd3)).references()
    assert refs["text_encoder"]["digest_kind"] == stored_digest.STORED
    assert again.loads == 0 and loads.calls == [] and called == []


def _to_bf16_files(folder, subs):
    from safetensors.torch import load_file, save_file

    for sub in subs:
        for file in (folder / sub).glob("*.safetensors"):
            tensors = load_file(str(file))
            save_file({k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in tensors.items()}, str(file))


def test_the_digest_is_of_the_files_as_stored_and_not_of_the_held_dtype(sd3, tmp_path, monkeypatch):
    import shutil

    folder = tmp_path / "sd3_bf16"
    shutil.copytree(sd3, folder)
    _to_bf16_files(folder, ["text_encoder_3"])  # T5 stored in bf16, the CLIPs in float32
    hashed = []
    real = stored_digest.compute
    monkeypatch.setattr(stored_digest, "compute", lambda source, on_read=None: real(source, hashed.append))
    eager = detect(folder).load_prompt_encoder(folder, "cpu", **OPTIONS)  # float32 on the host
    from safetensors import safe_open

    want = 0
    for sub in ("text_encoder", "text_encoder_2", "text_encoder_3"):
        for file in (folder / sub).glob("*.safetensors"):
            with safe_open(str(file), framework="pt") as f:
                for k in f.keys():  # noqa: SIM118 - a safe_open, not a dict
                    s = f.get_slice(k)
                    size = {"BF16": 2, "F32": 4, "I64": 8}[s.get_dtype()]
                    want += size * int(torch.tensor(s.get_shape()).prod()) if s.get_shape() else size
    assert sum(hashed) == want  # the T5's bytes as stored: 2 a weight, never upcast
    assert eager.digest_kind == stored_digest.STORED
    text = _cached(folder, tmp_path / "cache_bf16")
    text.ensure(CAPTIONS)
    assert text.digest == eager.digest  # the fill held them in bf16: the same digest
    eager.to(torch.bfloat16)  # what a LoRA run holds them in
    assert detect(folder).load_prompt_encoder(folder, "cpu", deferred=True, **OPTIONS).digest == eager.digest
    original = detect(sd3).load_prompt_encoder(sd3, "cpu", **OPTIONS)
    assert original.digest != eager.digest  # other bytes: another digest


def _float32_digest(encoder) -> str:
    """The digest records before the stored one hold (START's SD3PromptEncoder.digest)."""
    extra = f"t5_length={encoder.t5_length}".encode()
    vocab = vocab_bytes([encoder.tok_l, encoder.tok_g, encoder.tok_t5], pairs=True)
    return weights_digest(nn.ModuleList([encoder.clip_l, encoder.clip_g, encoder.t5]), vocab + extra)


@pytest.mark.parametrize("cached", [False, True], ids=["loaded", "cached"])
def test_a_record_with_the_old_float32_digest_resumes_and_another_is_refused(sd3, tmp_path, cached):
    eager = detect(sd3).load_prompt_encoder(sd3, "cpu", **OPTIONS)
    old = {"text_encoder": {"source": str(sd3), "digest": _float32_digest(eager)}}  # no kind: FLOAT32
    text = _cached(sd3, tmp_path) if cached else eager.to(torch.bfloat16)
    if cached:
        text.ensure(CAPTIONS)
    conditioning = Conditioning(text=text, family=detect(sd3))
    conditioning.check_references(old, "checkpoint old.pt")  # checked the old way (slow path), resumes
    mine = conditioning.references()["text_encoder"]
    assert mine["digest_kind"] == stored_digest.STORED and mine["digest"] == eager.digest
    conditioning.check_references({"text_encoder": mine}, "checkpoint new.pt")
    other = {"text_encoder": {"source": str(sd3), "digest": "0" * 64}}
    with pytest.raises(ValueError, match="holds different weights"):
        conditioning.check_references(other, "checkpoint other.pt")
    with pytest.raises(ValueError, match="holds different weights"):
        conditioning.check_references({"text_encoder": {**other["text_encoder"], "digest_kind": "stored"}}, "x")


def test_a_store_filled_before_the_stored_digest_keeps_its_float32_reference_and_checks_new_records(sd3, tmp_path):
    text = _cached(sd3, tmp_path)
    text.ensure(CAPTIONS)
    eager = detect(sd3).load_prompt_encoder(sd3, "cpu", **OPTIONS)
    manifest = text.store.manifest
    manifest.pop("digest_kind")
    text.store.write_manifest(_float32_digest(eager), manifest["dim"], manifest["shapes"], "float32")
    import json

    path = text.store.folder / "manifest.json"
    old = json.loads(path.read_text())
    del old["digest_kind"]  # START's manifest
    path.write_text(json.dumps(old))
    again = _cached(sd3, tmp_path)
    assert again.ensure(CAPTIONS) == 0 and again.loads == 0
    conditioning = Conditioning(text=again, family=detect(sd3))
    assert conditioning.references()["text_encoder"] == {"source": str(sd3), "digest": _float32_digest(eager)}
    conditioning.check_references({"text_encoder": eager.reference()}, "checkpoint new.pt")  # its stored digest


def test_the_fill_runs_on_the_cpu_by_the_files_headers_when_the_device_cannot_hold_a_deferred_encoder(sd3, monkeypatch):
    from difftrain.data.text_cache import fill_device

    deferred = detect(sd3).load_prompt_encoder(sd3, "cpu", deferred=True, **OPTIONS)
    eager = detect(sd3).load_prompt_encoder(sd3, "cpu", **OPTIONS)
    assert all(getattr(deferred, name) is None for name in deferred.parts)  # nothing loaded
    largest = max(sum(t.numel() for t in (*eager.get_submodule(n).parameters(), *eager.get_submodule(n).buffers()))
                  for n in eager.parts) * 2  # bf16
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (largest, 10 * largest))
    assert fill_device(deferred, "cuda:0", torch.bfloat16) == torch.device("cuda:0")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (largest - 1, 10 * largest))
    assert fill_device(deferred, "cuda:0", torch.bfloat16) == torch.device("cpu")


def test_a_float32_run_without_the_cache_keeps_its_encoders_loaded(sd3, tmp_path):
    cfg = _cfg(sd3, tmp_path, "fp32")
    cfg.text.cache = "off"
    text = detect(sd3).run_prompt_encoder(cfg, "cpu", cached_prompt_encoder)
    assert not isinstance(text, CachedPromptEncoder) and text.loaders == {}
    assert all(next(getattr(text, n).parameters()).dtype == torch.float32 for n in text.parts)
    assert TextCache  # the module's store class is the one the cache uses


def _write(family, path):
    from tests import family_bases
    from tests.text_components import write_tiny_sd_folder

    return {"sd": write_tiny_sd_folder, "sdxl": family_bases.write_tiny_sdxl_folder,
            "flux": family_bases.write_tiny_flux_folder}[family](path)


@pytest.mark.parametrize("family", ["sd", "sdxl", "flux"])
def test_every_familys_fill_reads_one_encoder_at_a_time_in_the_compute_dtype(family, tmp_path, monkeypatch):
    folder = _write(family, tmp_path / family)
    seen, live = [], []
    real = family_base.PromptEncoder.load_model

    def load_model(self, name, dtype):
        gc.collect()
        alive = sum(ref() is not None for ref in live)
        module = real(self, name, dtype)
        seen.append((name, {p.dtype for p in module.parameters()}, alive))
        live.append(weakref.ref(module))
        return module

    monkeypatch.setattr(family_base.PromptEncoder, "load_model", load_model)
    text = _cached(folder, tmp_path / "cache")
    assert text.ensure(CAPTIONS, batch_size=2) == len(CAPTIONS)
    parts = detect(folder).load_prompt_encoder(folder, "cpu", deferred=True,
                                               **detect(folder).prompt_options(_cfg(folder, tmp_path).model)).parts
    assert seen == [(name, {torch.bfloat16}, 0) for name in parts]
    gc.collect()
    assert all(ref() is None for ref in live)
    whole = detect(folder).run_prompt_encoder(_cfg(folder, tmp_path, "fp32"), "cpu")  # loaded, float32
    assert text.digest == whole.digest and text.reference()["digest_kind"] == "stored"
    served = text.encode(CAPTIONS, "cpu")
    for key, value in whole.encode(CAPTIONS, "cpu").items():
        assert (served[key] - value).abs().max() <= 0.05 * value.abs().max() + 1e-3
