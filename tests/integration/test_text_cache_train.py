"""Training with the text-embedding cache (text.cache) and the caption tag options (text.*) on the
tiny SD and SDXL bases: a cached run equals an uncached one (to a stated tolerance), resumes bit for
bit, and never loads the text encoders once the cache is complete (their weights made garbage of the
same size and time, and a loading spy); shuffled tags run the encoders per step and resume exactly."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("diffusers")
pytest.importorskip("peft")

from difftrain.cli import main
from difftrain.config import load_config
from difftrain.data.text_cache import entry_name
from difftrain.families import family_named
from difftrain.checkpoints import checkpoint as ckpt
from difftrain.training.loop import train
from tests.family_bases import write_tiny_sdxl_folder
from tests.integration.test_text_train import _captioned_folder
from tests.text_components import write_tiny_sd_folder

RES = 32
# The text encoders' outputs move by up to ~1e-6 with the batch they are encoded in (CPU GEMM
# blocking; the cache encodes in its own batches), so a cached run's weights equal an uncached
# run's to this tolerance after 4 steps at lr 1e-2 (measured 3e-6 and, in a full-suite run, 1.4e-5:
# Adam's normalised steps amplify such differences where a gradient is near 0), while its LoRA B
# weights moved by ~1e-2.
WEIGHTS_ATOL = 1e-4


def _overrides(root, base="sdxl", *extra):
    return [f"model.init_from={root / base}", "lora.rank=4", f"data.path={root / 'data'}", f"data.resolution={RES}",
            "data.num_workers=0", "train.batch_size=4", "train.total_steps=4", "optim.lr=1e-2", "optim.warmup_steps=0",
            "model.class_dropout=0.5", "validation.every_steps=0", f"data.cache_dir={root / 'cache'}", *extra]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("text_cache_train")
    write_tiny_sdxl_folder(root / "sdxl")
    _captioned_folder(root / "data", n=8, size=RES)
    return root


def _model(run):
    return ckpt.load_checkpoint(run)["model"]


def _sha(run):
    return ckpt.state_dict_sha256(_model(run))


def _garbage_keeping_size_and_time(folder):
    """Every weights file of the folder's text encoders overwritten with zeros, sizes and mtimes kept."""
    for sub in ("text_encoder", "text_encoder_2"):
        for f in (folder / sub).glob("*.safetensors"):
            st = f.stat()
            f.write_bytes(b"\0" * st.st_size)
            os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_sdxl_with_the_cache_equals_without_and_never_loads_the_encoders_once_complete(root, monkeypatch):
    train(load_config(None, _overrides(root, "sdxl", "text.cache=off")), root / "uncached")
    train(load_config(None, _overrides(root)), root / "cached")  # builds the cache
    a, b = _model(root / "uncached"), _model(root / "cached")
    assert max((a[k] - b[k]).abs().max().item() for k in a) < WEIGHTS_ATOL
    assert max(b[k].abs().max().item() for k in b if "lora_B" in k) > 1e-3  # the adapter did move
    # A copy of the base (same relative paths, sizes, mtimes: the same store) whose text encoders are
    # garbage and whose loading is forbidden: the run needs neither, and gives the same weights bit for bit.
    shutil.copytree(root / "sdxl", root / "sdxl-copy", copy_function=shutil.copy2)
    _garbage_keeping_size_and_time(root / "sdxl-copy")
    family = family_named("sdxl")

    def forbidden(*args, **kwargs):
        raise AssertionError("the text encoders were loaded")

    monkeypatch.setattr(type(family), "load_prompt_encoder", forbidden)
    cfg = load_config(None, _overrides(root, "sdxl-copy"))
    train(cfg, root / "no-encoders")
    assert _sha(root / "no-encoders") == _sha(root / "cached")
    train(cfg, root / "resumed", stop_at_step=2)  # and a resume is exact
    assert train(cfg, root / "resumed").step == 4
    assert _sha(root / "resumed") == _sha(root / "cached")


def _cache_and_garbage_copy(root):
    """The SDXL cache of the module's data (built if no test built it yet) and a copy of the base whose
    text encoders are garbage of the same sizes and times (the same store)."""
    if not (root / "cached").exists():
        train(load_config(None, _overrides(root)), root / "cached")
    if not (root / "sdxl-copy").exists():
        shutil.copytree(root / "sdxl", root / "sdxl-copy", copy_function=shutil.copy2)
        _garbage_keeping_size_and_time(root / "sdxl-copy")
    (store,) = (root / "cache").glob("text-sdxl-*")
    return store


def test_a_damaged_entry_is_rebuilt_in_a_cli_run_or_one_line_and_exit_2_without_encoders(root, tmp_path, capsys):
    store = _cache_and_garbage_copy(root)
    entry = store / f"{entry_name('a red square on a dark background')}.safetensors"
    good = entry.read_bytes()
    entry.write_bytes(good[:-9])  # truncated
    args = lambda base, run: ["train", "--run-dir", str(tmp_path / run)] + [
        x for o in _overrides(root, base, "train.total_steps=1") for x in ("--set", o)]
    capsys.readouterr()
    assert main(args("sdxl-copy", "without")) == 2  # the rebuild needs the encoders, which cannot load
    err = capsys.readouterr().err.strip().splitlines()
    assert any(str(entry) in line and "rebuilt" in line for line in err)
    assert "text encoder" in err[-1] and "sdxl-copy" in err[-1]
    assert entry.read_bytes() == good[:-9]  # nothing else touched
    assert main(args("sdxl", "with")) == 0  # with the encoders: rebuilt, the run goes on
    from safetensors.torch import load, load_file

    rebuilt, before = load_file(str(entry)), load(good)
    assert all(torch.allclose(rebuilt[k], before[k], atol=1e-5, rtol=0) for k in before)


def test_sd_with_a_trigger_word_caches_the_captions_as_trained(root, tmp_path):
    write_tiny_sd_folder(tmp_path / "sd")
    overrides = _overrides(root, "sd", f"model.init_from={tmp_path / 'sd'}", f"data.cache_dir={tmp_path / 'cache'}",
                           "text.trigger_word=ohwx")
    train(load_config(None, overrides), tmp_path / "run")
    (store,) = (tmp_path / "cache").glob("text-sd-*")
    for colour in ("red", "blue"):
        assert (store / f"{entry_name(f'ohwx, a {colour} square on a dark background')}.safetensors").is_file()
        assert not (store / f"{entry_name(f'a {colour} square on a dark background')}.safetensors").exists()
    assert (store / "null.safetensors").is_file() and (store / "manifest.json").is_file()


def test_shuffled_tags_run_the_encoders_per_step_and_resume_exactly(root, tmp_path, capsys):
    data = tmp_path / "tags"
    _captioned_folder(data, n=8, size=RES)
    for i, txt in enumerate(sorted(data.glob("*.txt"))):
        txt.write_text(f"ohwx dog, tag{i}, grass, sunny, smiling, red collar")
    overrides = _overrides(root, "sdxl", f"data.path={data}", f"data.cache_dir={tmp_path / 'cache'}",
                           "text.shuffle_tags=true", "text.keep_tokens=1", "text.tag_dropout=0.2")
    cfg = load_config(None, overrides)
    train(cfg, tmp_path / "straight")
    train(cfg, tmp_path / "resumed", stop_at_step=2)
    train(cfg, tmp_path / "resumed")
    assert _sha(tmp_path / "straight") == _sha(tmp_path / "resumed")
    assert not list((tmp_path / "cache").glob("text-*"))  # auto: no cache of captions that change per sample
    capsys.readouterr()
    code = main(["train", "--run-dir", str(tmp_path / "refused")] + [x for o in overrides + ["text.cache=on"]
                                                                      for x in ("--set", o)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "text.cache='on' cannot cache captions" in err and len(err.splitlines()) == 1


@pytest.mark.slow
def test_two_ranks_build_the_cache_once_and_train_on_it(root, tmp_path):
    from tests.multiproc import run_ranks, train_on_rank

    overrides = _overrides(root, "sdxl", f"data.cache_dir={tmp_path / 'cache'}", "train.batch_size=2")
    assert run_ranks(train_on_rank, 2, str(tmp_path / "ddp"), overrides, None) == [4, 4]
    (store,) = (tmp_path / "cache").glob("text-sdxl-*")
    assert len(list(store.glob("*.safetensors"))) == 3  # two captions and the null condition, written once
    assert not list(store.glob("*.tmp"))
    frozen = ckpt.load_checkpoint(tmp_path / "ddp")["frozen"]["text_encoder"]
    assert frozen["digest"] == json.loads((store / "manifest.json").read_text())["digest"]
