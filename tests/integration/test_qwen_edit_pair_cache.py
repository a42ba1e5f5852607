"""Issue 42 (editfit item 1): Qwen-Image-Edit's prompts, encoded with each pair's reference image, are cached per
(caption, reference file's content, crop, flip) (data/pair_cache.py), so that training runs without the Qwen2.5-VL
encoder loaded, as the other families run without theirs: a cached entry equals the live encoding of the caption
with the image the training item carries, a changed reference file is another entry, and a run with the cache
resumes exactly without ever loading the encoder again."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

pytest.importorskip("transformers")
pytest.importorskip("diffusers")
pytest.importorskip("peft")

from difftrain.config import load_config  # noqa: E402
from difftrain.data.cached_conditions import PairConditions, caption_batch  # noqa: E402
from difftrain.data.folder import ImageFolderDataset  # noqa: E402
from difftrain.data.pair_cache import CachedPairEncoder, PairCache  # noqa: E402
from difftrain.data.text_cache import entry_name  # noqa: E402
from difftrain.data.transforms import flip_decision  # noqa: E402
from difftrain.families.qwen_image_edit import QwenImageEditFamily, pil_images  # noqa: E402
from difftrain.training.loop import train  # noqa: E402
from tests.family_bases_qwen_image import QWEN_LENGTH  # noqa: E402
from tests.family_bases_qwen_image_edit import write_tiny_qwen_image_edit_folder  # noqa: E402
from tests.family_runs import run_digests  # noqa: E402

FAMILY = QwenImageEditFamily()
OPTIONS = {"max_sequence_length": QWEN_LENGTH}


def _reference(path, grey: int, size: int = 40) -> None:
    r = np.full((size, size, 3), 30, np.uint8)
    r[5:25, 3:20] = grey  # not symmetric: the mirrored view is another image
    Image.fromarray(r).save(path)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """A tiny edit base and 4 captioned 32 x 32 targets, each with its own reference (another grey) by name."""
    root = tmp_path_factory.mktemp("qwen-edit-pairs")
    data, refs = root / "data", root / "refs"
    data.mkdir()
    refs.mkdir()
    for i in range(4):
        a = np.full((32, 32, 3), 30, np.uint8)
        a[4:20, 4:20] = (220, 30, 30) if i % 2 else (30, 30, 220)
        Image.fromarray(a).save(data / f"img{i}.png")
        (data / f"img{i}.txt").write_text(f"make the square {'red' if i % 2 else 'blue'}\n")
        _reference(refs / f"img{i}.png", 60 + 40 * i)
    return {"base": write_tiny_qwen_image_edit_folder(root / "base"), "data": data, "refs": refs}


def _encoder(base, cache_dir, loads=None) -> CachedPairEncoder:
    store = PairCache.for_pairs(base, FAMILY.name, OPTIONS, cache_dir)

    def load():
        if loads is not None:
            loads.append(1)
        return FAMILY.load_prompt_encoder(base, "cpu", deferred=True, **OPTIONS)

    return CachedPairEncoder(store, load, "cpu", resolution=32, channels=3)


def _dataset(pairs, refs=None) -> ImageFolderDataset:
    return ImageFolderDataset(pairs["data"], 32, captions=True, random_flip=True, references=str(refs or pairs["refs"]))


def _seed(flip: bool) -> int:
    return next(s for s in range(100) if flip_decision(s) == flip)


def test_cached_conditioning_equals_the_live_encoding(pairs, tmp_path):
    """Every training item's entries, both views, read through the loader's PairConditions, equal the live
    encoder's ``encode_edit`` of its caption (and of "") with the reference the item carries (1e-5); the encoder
    is loaded once to fill the store, and not at all once it is complete."""
    loads: list = []
    text = _encoder(pairs["base"], tmp_path / "cache", loads)
    dataset = _dataset(pairs)
    assert text.run_entries(SimpleNamespace(train=dataset), None) == 4 * 2 * 2  # items x views x (caption, "")
    assert text._encoder is None and len(loads) == 1  # released after the fill
    live = FAMILY.load_prompt_encoder(pairs["base"], "cpu", **OPTIONS)
    served = PairConditions(dataset, text.store, text.views_of(dataset))
    for i in range(len(dataset)):
        for flip in (False, True):
            x, row, _ = dataset[(i, _seed(flip))]
            image = pil_images(x[3:6][None])  # the reference channels as the training item carries them
            served_row = served[(i, _seed(flip))][1]
            assert served_row.cond is not None and str(served_row) == row
            for caption, key in ((row, "prompt"), ("", "empty")):
                want = live.encode_edit([caption], image)
                got = {k: served_row.cond[f"{key}_{k.split('_')[1]}"] for k in ("prompt_embeds", "prompt_mask")}
                assert got["prompt_mask"].shape == want["prompt_mask"].shape
                assert torch.equal(got["prompt_mask"], want["prompt_mask"])
                assert (got["prompt_embeds"].float() - want["prompt_embeds"]).abs().max() < 1e-5
    # a batch of rows: the loader's collate gives the step its stacked entries
    batch = caption_batch([served[(i, _seed(False))][1] for i in range(2)])
    rows = text.training_rows(batch, "cpu")
    assert rows["prompt_embeds"].shape[0] == 2 and set(rows) == {"prompt_embeds", "prompt_mask", "empty_embeds",
                                                               "empty_mask"}
    # a complete store: nothing encoded, the encoder never loaded
    again: list = []
    assert _encoder(pairs["base"], tmp_path / "cache", again).run_entries(SimpleNamespace(train=dataset), None) == 0
    assert not again


def test_a_changed_reference_image_invalidates_its_entry(pairs, tmp_path):
    """Another image under the same reference name (its file's content changed): its pair's entries are encoded
    again (both views, caption and ""), the others are kept, and the new entry holds the new image's states."""
    refs = tmp_path / "refs"
    refs.mkdir()
    for f in pairs["refs"].iterdir():
        (refs / f.name).write_bytes(f.read_bytes())
    text = _encoder(pairs["base"], tmp_path / "cache")
    dataset = _dataset(pairs, refs)
    assert text.run_entries(SimpleNamespace(train=dataset), None) == 16
    before = text.training_rows([PairConditions(dataset, text.store, text.views_of(dataset))[1][1]], "cpu")
    _reference(refs / "img1.png", 250)
    changed = _dataset(pairs, refs)
    text = _encoder(pairs["base"], tmp_path / "cache")
    assert text.run_entries(SimpleNamespace(train=changed), None) == 4  # img1's: 2 views x (caption, "")
    after = text.training_rows([PairConditions(changed, text.store, text.views_of(changed))[1][1]], "cpu")
    assert (after["prompt_embeds"] - before["prompt_embeds"]).abs().max() > 1e-4


def _overrides(pairs, cache_dir, *extra):
    return ["data.resolution=32", "data.num_workers=0", f"data.path={pairs['data']}", f"data.references={pairs['refs']}",
            f"model.init_from={pairs['base']}", f"model.max_sequence_length={QWEN_LENGTH}", "optim.lr=1e-3",
            "optim.warmup_steps=1", "train.total_steps=4", "train.batch_size=2", "train.log_every_steps=2",
            "train.progress_bar=false", "checkpoint.every_steps=2", "checkpoint.keep_last=2", "lora.rank=4",
            "lora.alpha=4", "validation.every_steps=0", "model.class_dropout=0.5", "data.random_flip=true",
            f"data.cache_dir={cache_dir}", *extra]


def test_a_run_with_the_cache_resumes_exactly_without_the_encoder(pairs, tmp_path, monkeypatch):
    """The preset's default text.cache ('auto') caches the pairs: a run trains with the encoder behind the cache
    (its model read once, for the fill), and the same run stopped and resumed gives the same weights without
    loading it at all (the store complete)."""
    loads: list = []
    original = QwenImageEditFamily.load_prompt_encoder

    def counted(self, *args, **kwargs):
        loads.append(kwargs.get("deferred", False))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(QwenImageEditFamily, "load_prompt_encoder", counted)
    cfg = load_config(None, _overrides(pairs, tmp_path / "cache"))
    assert cfg.text.cache == "auto"  # the family no longer turns it off
    train(cfg, tmp_path / "straight")
    assert loads == [True]  # one deferred encoder, for the fill: never a live one for the steps
    loads.clear()
    train(cfg, tmp_path / "resumed", stop_at_step=2)
    assert train(cfg, tmp_path / "resumed").step == 4
    assert loads == []  # a complete store: the encoder is not even built
    assert run_digests(tmp_path / "straight") == run_digests(tmp_path / "resumed")


def test_estimate_counts_the_pair_fill_with_the_references_vision_tokens():
    """`estimate`'s text-cache fill figure of the edit base counts each prompt with a 1024 px reference's vision
    tokens, 4 pairs per encoder call (data/pair_cache.FILL_BATCH), not 100 prompts of text alone."""
    from difftrain.data.pair_cache import FILL_BATCH
    from difftrain.tools.base_memory import base_folder, text_cache_fill_bytes

    folder = base_folder("qwen-image-edit")
    cfg = load_config(None, ["train.precision=bf16", f"validation.heldout_batch_size={FILL_BATCH}"])
    text_alone, _ = text_cache_fill_bytes(folder, cfg)  # FILL_BATCH prompts of 512 tokens
    pairs, name = text_cache_fill_bytes(folder, cfg, FAMILY)
    assert pairs > text_alone and "Qwen2_5_VL" in name
    hundred, _ = text_cache_fill_bytes(folder, load_config(None, ["train.precision=bf16"]), FAMILY)
    assert hundred == pairs  # the pair fill's batch, whatever validation.heldout_batch_size says


def test_a_missing_or_damaged_entry_is_rebuilt_on_the_training_thread(pairs, tmp_path, capsys):
    """An entry deleted or damaged after the start: the loader's row comes without its entries (the worker cannot
    run the encoder) but with its pair, and ``training_rows`` encodes it again from the reference file (a damaged
    one with one warning line naming it): the same states as before."""
    text = _encoder(pairs["base"], tmp_path / "cache")
    dataset = _dataset(pairs)
    text.run_entries(SimpleNamespace(train=dataset), None)
    served = PairConditions(dataset, text.store, text.views_of(dataset))
    rows = [served[(i, _seed(False))][1] for i in range(2)]
    before = text.training_rows(caption_batch(rows), "cpu")
    item = rows[0].pair
    text.store.path(entry_name(item.prompt)).unlink()
    text.store.path(entry_name(item.empty)).write_bytes(b"not a safetensors file")
    fresh = _encoder(pairs["base"], tmp_path / "cache")
    served = PairConditions(dataset, fresh.store, fresh.views_of(dataset))
    rows = [served[(i, _seed(False))][1] for i in range(2)]
    assert rows[0].cond is None and rows[1].cond is not None
    batch = caption_batch(rows)
    assert not hasattr(batch, "cond") and batch[0].pair == item  # the pairs kept for the training thread
    after = fresh.training_rows(batch, "cpu")
    for k in before:
        assert (after[k] - before[k]).abs().max() < 1e-5, k
    err = capsys.readouterr().err
    assert err.count("it is rebuilt") == 1 and entry_name(item.empty) in err
