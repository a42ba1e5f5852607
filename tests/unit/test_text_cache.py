"""The text-embedding cache (data/text_cache.py) and the caption tag options (data/captions.py).

Built on the tiny SDXL base of tests/family_bases.py (two CLIP encoders, a pooled output, a null
condition of zeros): what the cache serves equals what the family's PromptEncoder computes, the
encoders are never loaded once it is complete, and every damaged entry is rebuilt with one line.
"""

from __future__ import annotations

import json
import os
import pickle
import struct

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("diffusers")

from difftrain.config import ConfigError, load_config
from difftrain.data.captions import CaptionOptions, TaggedCaptions
from difftrain.data.text_cache import (
    NULL_ENTRY,
    CachedPromptEncoder,
    TextCache,
    entry_name,
    store_key,
)
from difftrain.families import detect
from tests.family_bases import write_tiny_sdxl_folder

CAPTIONS = ["a red square", "a blue square, dark background", "", "a red square"]
# The encoders' own outputs differ by up to ~1e-6 with the batch they are encoded in (CPU GEMM
# blocking): the cache encodes in its own batches, so its values equal a step's to this tolerance.
ATOL = 1e-5


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return write_tiny_sdxl_folder(tmp_path_factory.mktemp("text_cache") / "sdxl")


@pytest.fixture(scope="module")
def encoder(base):
    return detect(base).load_prompt_encoder(base)


def _cached(base, cache_dir, encoder=None, options=None):
    """A CachedPromptEncoder over ``base``'s SDXL encoders; ``encoder`` None: loading fails loudly."""
    store = TextCache.for_encoder(base, "sdxl", options or {}, cache_dir)

    def load():
        if encoder is None:
            raise ValueError(f"{base}: the text encoders were loaded")
        return encoder

    return CachedPromptEncoder(store, load)


def test_the_cache_serves_the_families_condition_pooled_and_null_included(base, encoder, tmp_path):
    text = _cached(base, tmp_path, encoder)
    assert text.ensure(CAPTIONS, batch_size=2) == 3  # distinct captions; "" is one of them
    assert text.loads == 1
    served, direct = text.encode(CAPTIONS, "cpu"), encoder.encode(CAPTIONS, "cpu")
    assert set(served) == {"prompt_embeds", "pooled"}
    for key in direct:
        assert served[key].shape == direct[key].shape and served[key].dtype == torch.float32
        assert torch.allclose(served[key], direct[key], atol=ATOL, rtol=0)
    null = text.null(3, "cpu")  # SDXL's force_zeros_for_empty_prompt: the pipeline's negative prompt, zeros
    for key, value in encoder.null(3, "cpu").items():
        assert torch.equal(null[key], value)
    assert text.digest == encoder.digest and text.dim == encoder.dim and text.source == str(base)


def test_a_complete_cache_never_loads_the_encoders(base, encoder, tmp_path):
    _cached(base, tmp_path, encoder).ensure(CAPTIONS)
    again = _cached(base, tmp_path)  # loading raises
    assert again.ensure(CAPTIONS) == 0
    again.encode(CAPTIONS, "cpu"), again.null(2, "cpu")
    assert again.loads == 0 and again.digest == encoder.digest


def test_the_key_follows_the_encoder_files_and_the_prompt_options(base, tmp_path):
    key = store_key(base, "sdxl", {})
    assert store_key(base, "sdxl", {"max_sequence_length": 77}) != key
    assert store_key(base, "sd3", {}) != key
    weights = next((base / "text_encoder_2").glob("*.safetensors"))
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    try:
        assert store_key(base, "sdxl", {}) != key  # replaced weights: another store, built on first use
    finally:
        os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert store_key(base, "sdxl", {}) == key
    (base / "unet" / "extra.txt").write_text("the denoiser's files are not the text condition's")
    try:
        assert store_key(base, "sdxl", {}) == key
    finally:
        (base / "unet" / "extra.txt").unlink()


def _entry(text, caption):
    return text.store.path(entry_name(caption))


def _crafted(path):
    path.write_bytes(pickle.dumps({"prompt_embeds": 1}))


def _truncated(path):
    path.write_bytes(path.read_bytes()[:-7])


def _lying_header(path):
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    header["pooled"]["shape"] = [1, 10_000]
    header["pooled"]["data_offsets"][1] = header["pooled"]["data_offsets"][0] + 40_000
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n:])


def _non_finite(path, text=None):
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    tensors = load_file(str(path))
    tensors["prompt_embeds"][0, 0, 0] = float("nan")
    save_file(tensors, str(path), metadata=meta)


def _another_store(path):
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    save_file(load_file(str(path)), str(path), metadata={**meta, "key": "0" * 64})


def _another_caption(path):
    from safetensors.torch import load_file, save_file

    save_file(load_file(str(path)), str(path), metadata={"format": "difftrain-text-cache", "caption": "x"})


def _wrong_shape(path):
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    tensors = load_file(str(path))
    tensors["pooled"] = tensors["pooled"][:, :3].contiguous()
    save_file(tensors, str(path), metadata=meta)


DAMAGES = {"crafted (a pickle)": _crafted, "truncated": _truncated, "header lying about sizes": _lying_header,
           "non-finite values": _non_finite, "another encoder's store key": _another_store,
           "another caption": _another_caption, "another shape": _wrong_shape, "missing": lambda p: p.unlink()}

FOUND_WHEN_USED = {"non-finite values"}  # a whole header: found when the entry is first read, not at the start


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_damaged_entry_is_rebuilt_with_one_line_and_never_runs_code(base, encoder, tmp_path, capsys, damage):
    text = _cached(base, tmp_path, encoder)
    text.ensure(CAPTIONS)
    good = {k: v.clone() for k, v in text.encode([CAPTIONS[1]], "cpu").items()}
    DAMAGES[damage](_entry(text, CAPTIONS[1]))
    capsys.readouterr()
    fresh = _cached(base, tmp_path, encoder)  # a new run: nothing in memory
    if damage in FOUND_WHEN_USED:  # the start checks headers only: the values are checked when first read
        assert fresh.ensure(CAPTIONS) == 0 and capsys.readouterr().err == ""
        fresh.encode([CAPTIONS[1]], "cpu")
    else:
        assert fresh.ensure(CAPTIONS) == 1
    err = capsys.readouterr().err
    if damage != "missing":
        assert err.count("\n") == 1 and str(_entry(text, CAPTIONS[1])) in err and "rebuilt" in err
    for key, value in _cached(base, tmp_path).encode([CAPTIONS[1]], "cpu").items():
        assert torch.allclose(value, good[key], atol=ATOL, rtol=0)


def test_an_entry_damaged_during_a_run_is_rebuilt_when_read(base, encoder, tmp_path, capsys):
    text = _cached(base, tmp_path, encoder)
    text.ensure(CAPTIONS)
    later = _cached(base, tmp_path, encoder)
    _truncated(_entry(text, CAPTIONS[0]))
    _crafted(text.store.path(NULL_ENTRY))
    cond, null = later.encode(CAPTIONS[:1], "cpu"), later.null(1, "cpu")
    assert torch.allclose(cond["pooled"], encoder.encode(CAPTIONS[:1], "cpu")["pooled"], atol=ATOL, rtol=0)
    assert all(torch.equal(null[k], v) for k, v in encoder.null(1, "cpu").items())
    assert capsys.readouterr().err.count("rebuilt") == 2 and later.loads == 1


def test_a_damaged_entry_without_its_encoders_is_one_line(base, encoder, tmp_path):
    _cached(base, tmp_path, encoder).ensure(CAPTIONS)
    text = _cached(base, tmp_path)
    _crafted(_entry(text, CAPTIONS[0]))
    with pytest.raises(ValueError, match="the text encoders were loaded") as e:
        text.ensure(CAPTIONS)
    assert "\n" not in str(e.value)


def test_a_damaged_manifest_is_rebuilt_with_one_line(base, encoder, tmp_path, capsys):
    text = _cached(base, tmp_path, encoder)
    text.ensure(CAPTIONS)
    for junk in (b"\x80\x04not json", b'{"key": "other"}', b'{"key": 1, "shapes": []}'):
        (text.store.folder / "manifest.json").write_bytes(junk)
        again = _cached(base, tmp_path, encoder)
        assert "manifest.json is damaged" in capsys.readouterr().err
        assert again.digest == encoder.digest and again.loads == 1  # the encoders loaded to rewrite it
        assert again.ensure(CAPTIONS) == 0  # the entries themselves were fine


# ---------------------------------------------------------------------------------------------
# Caption tag options.


TAGS = "sks dog, on grass, sunny, smiling, red collar, outdoors"


def test_tags_shuffle_per_seed_with_the_first_keep_tokens_in_place():
    opts = CaptionOptions(trigger_word="ohwx", keep_tokens=2, shuffle_tags=True)
    seen = {opts.apply(TAGS, seed) for seed in range(40)}
    assert len(seen) > 10
    for caption in seen:
        tags = caption.split(", ")
        assert tags[:3] == ["ohwx", "sks dog", "on grass"] and sorted(tags[3:]) == sorted(TAGS.split(", ")[2:])
    assert opts.apply(TAGS, 7) == opts.apply(TAGS, 7)  # a function of the sample seed: resumes exactly
    assert opts.apply(TAGS, None) == "ohwx, " + TAGS  # unaugmented reads (validation, FID): the trigger alone


def test_tag_dropout_drops_each_other_tag_at_its_rate_and_never_the_kept_ones():
    opts = CaptionOptions(trigger_word="ohwx", keep_tokens=1, tag_dropout=0.25)
    kept = 0
    for seed in range(400):
        tags = opts.apply(TAGS, seed).split(", ")
        assert tags[:2] == ["ohwx", "sks dog"]
        assert tags[2:] == [t for t in TAGS.split(", ")[1:] if t in tags[2:]]  # order kept without shuffle_tags
        kept += len(tags) - 2
    assert abs(kept / (400 * 5) - 0.75) < 0.05
    assert CaptionOptions(trigger_word="ohwx").apply("", 3) == "ohwx"
    assert CaptionOptions().apply(TAGS, 3) == TAGS


class _Tags(torch.utils.data.Dataset):
    """Two items captioned TAGS, keyed as the sampler keys them."""

    files = ("a.png", "b.png")

    def __len__(self):
        return 2

    def __getitem__(self, key):
        index = key[0] if isinstance(key, tuple) else key
        return torch.zeros(1), TAGS, index

    def targets(self):
        return [TAGS, TAGS]


def test_tagged_captions_follow_the_samplers_keys_and_keep_the_base_attributes():
    from difftrain.data.sampler import InfiniteSampler

    data = TaggedCaptions(_Tags(), CaptionOptions(shuffle_tags=True))
    assert data.files == ("a.png", "b.png") and data.targets() == [TAGS, TAGS]
    stream = lambda start: [data[k][1] for k, _ in zip(InfiniteSampler(2, seed=5, start=start), range(6))]
    straight = stream(0)
    assert stream(4) == straight[4:] + stream(6)[:4] and len(set(straight)) > 1
    assert data[(1, 9)][2] == 1  # the item's other entries pass through
    assert pickle.loads(pickle.dumps(data))[(0, 9)] is not None  # DataLoader workers


@pytest.mark.parametrize("override, needle", [
    ("text.tag_dropout=1.0", "text.tag_dropout must be in [0, 1)"),
    ("text.tag_dropout=-0.1", "text.tag_dropout must be in [0, 1)"),
    ("text.keep_tokens=-1", "text.keep_tokens must be >= 0"),
    ("text.keep_tokens=2", "text.keep_tokens=2 keeps tags in place only with text.shuffle_tags"),
    ("text.trigger_word=a, b", "text.trigger_word must be one tag"),
    ("text.shuffle_tags=maybe", "text.shuffle_tags"),
    ("text.cache=sometimes", "text.cache must be one of 'auto', 'on', 'off'"),
])
def test_every_text_key_is_checked_with_one_line_naming_it(override, needle):
    with pytest.raises(ConfigError) as e:
        load_config(None, ["data.captions=true", "model.text_encoder=builtin:tiny-clip", override])
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_a_trigger_word_with_spaces_around_it_is_named():
    with pytest.raises(ConfigError, match="text.trigger_word must be one tag"):
        load_config(None, ["data.captions=true", "model.text_encoder=builtin:tiny-clip"],
                    values={"text": {"trigger_word": " ohwx"}})


def test_shuffled_captions_with_the_cache_on_are_refused_with_one_line():
    base = ["data.captions=true", "model.text_encoder=builtin:tiny-clip"]
    for extra in ("text.shuffle_tags=true", "text.tag_dropout=0.1"):
        with pytest.raises(ConfigError, match="text.cache='on' cannot cache captions"):
            load_config(None, base + [extra, "text.cache=on"])
        assert load_config(None, base + [extra]).text.cache == "auto"  # auto: the encoders run per step
    with pytest.raises(ConfigError, match="text.trigger_word changes captions, but this run has none"):
        load_config(None, ["text.trigger_word=ohwx"])
    with pytest.raises(ConfigError, match="dreambooth.instance_prompt"):
        load_config(None, base + ["text.trigger_word=ohwx", "dreambooth.instance_prompt=a photo of sks dog"])


def test_a_killed_builds_temporary_file_is_removed_by_the_next_build(base, encoder, tmp_path):
    text = _cached(base, tmp_path, encoder)
    text.ensure(CAPTIONS[:1])
    dead = text.store.folder / f"{entry_name(CAPTIONS[1])}.safetensors.{2**22 + 12345}.tmp"  # above pid_max's default
    mine = text.store.folder / f"{entry_name('another')}.safetensors.{os.getpid()}.tmp"  # a live builder's
    dead.write_bytes(b"half"), mine.write_bytes(b"half")
    assert text.ensure(CAPTIONS) == 2
    assert not dead.exists() and mine.exists()


def test_sd3_three_encoders_and_pooled_are_served_as_encoded(tmp_path):
    from tests.family_bases import write_tiny_sd3_folder

    folder = write_tiny_sd3_folder(tmp_path / "sd3")
    options = {"max_sequence_length": 8}
    encoder = detect(folder).load_prompt_encoder(folder, "cpu", **options)
    store = TextCache.for_encoder(folder, "sd3", options, tmp_path / "cache")
    text = CachedPromptEncoder(store, lambda: encoder)
    text.ensure(CAPTIONS)
    served, direct = text.encode(CAPTIONS, "cpu"), encoder.encode(CAPTIONS, "cpu")
    assert set(served) == {"prompt_embeds", "pooled"}
    assert all(torch.allclose(served[k], direct[k], atol=ATOL, rtol=0) for k in direct)
    assert all(torch.equal(v, encoder.null(2, "cpu")[k]) for k, v in text.null(2, "cpu").items())
    assert store.folder != TextCache.for_encoder(folder, "sd3", {"max_sequence_length": 16}, tmp_path / "cache").folder


def test_a_manifest_that_lies_about_the_shapes_is_rewritten_when_the_encoders_load(base, encoder, tmp_path, capsys):
    text = _cached(base, tmp_path, encoder)
    text.ensure(CAPTIONS)
    path = text.store.folder / "manifest.json"
    manifest = json.loads(path.read_text())
    path.write_text(json.dumps({**manifest, "shapes": {"prompt_embeds": [3, 3]}}))
    again = _cached(base, tmp_path, encoder)
    assert again.ensure(CAPTIONS) == 3  # every entry fails the lying manifest's shapes: rebuilt
    assert "does not describe" in capsys.readouterr().err
    assert json.loads(path.read_text())["shapes"] == manifest["shapes"]
    assert _cached(base, tmp_path).ensure(CAPTIONS) == 0


# ---------------------------------------------------------------------------------------------
# A fill that fits (one encoder part at a time, in the compute dtype), entries in that dtype, headers
# checked at the start, conditions read in the loader's workers (issue 41 item 4).


UNIQUE = list(dict.fromkeys(CAPTIONS))


@pytest.fixture(scope="module")
def sd3(tmp_path_factory):
    from tests.family_bases import write_tiny_sd3_folder

    return write_tiny_sd3_folder(tmp_path_factory.mktemp("text_cache_sd3") / "sd3")


def _sd3_text(folder, cache_dir, dtype=torch.float32, calls=None):
    """A CachedPromptEncoder over the tiny SD3 base's three encoders, each load a fresh copy; ``calls``
    records (part, its parameters' dtype, batch size) of every encoder model the fill runs."""
    options = {"max_sequence_length": 8}

    def load():
        encoder = detect(folder).load_prompt_encoder(folder, "cpu", **options)
        if calls is not None:
            run = encoder.encode_part

            def encode_part(name, captions):
                calls.append((name, next(encoder.get_submodule(name).parameters()).dtype, len(captions)))
                return run(name, captions)
            encoder.encode_part = encode_part
        return encoder

    return CachedPromptEncoder(TextCache.for_encoder(folder, "sd3", options, cache_dir, dtype), load)


def _stored(text, caption):
    return text.store.read(entry_name(caption), caption)


def test_the_fill_runs_each_encoder_over_every_caption_before_the_next_and_equals_the_whole_encoder(sd3, tmp_path):
    calls = []
    text = _sd3_text(sd3, tmp_path, calls=calls)
    assert text.ensure(UNIQUE, batch_size=2) == len(UNIQUE)
    batches = [1, 2, 1]  # the null's own batch (""), then the captions two at a time
    assert calls == [(part, torch.float32, n) for part in ("clip_l", "clip_g", "t5") for n in batches]
    whole = detect(sd3).load_prompt_encoder(sd3, "cpu", max_sequence_length=8)
    for i in range(0, len(UNIQUE), 2):  # float32: the same batches give the same values, bit for bit
        direct = whole.encode(UNIQUE[i:i + 2], "cpu")
        for row, caption in enumerate(UNIQUE[i:i + 2]):
            assert all(torch.equal(_stored(text, caption)[k], v[row:row + 1]) for k, v in direct.items())
    assert all(torch.equal(text.null(1, "cpu")[k], v) for k, v in whole.null(1, "cpu").items())


def test_a_bf16_run_fills_in_bf16_and_stores_bf16_entries_close_to_float32(sd3, tmp_path):
    calls = []
    text = _sd3_text(sd3, tmp_path, torch.bfloat16, calls)
    text.ensure(UNIQUE, batch_size=4)
    assert {dtype for _, dtype, _ in calls} == {torch.bfloat16}  # every encoder ran in the compute dtype
    full = _sd3_text(sd3, tmp_path)
    full.ensure(UNIQUE, batch_size=4)
    assert text.store.folder != full.store.folder  # a float32 run and a bf16 run never share entries
    assert json.loads((text.store.folder / "manifest.json").read_text())["dtype"] == "bfloat16"
    for caption in UNIQUE:
        low, high = _stored(text, caption), _stored(full, caption)
        for k, v in high.items():
            assert low[k].dtype == torch.bfloat16 and v.dtype == torch.float32
            assert (low[k].float() - v).abs().max() <= 0.05 * v.abs().max() + 1e-3  # bf16's 8 bits, through 3 models
    served = text.encode(UNIQUE, "cpu")
    assert all(v.dtype == torch.float32 for v in served.values())  # what the step takes, as before


def test_an_entry_of_another_dtype_is_refused_by_its_header(sd3, tmp_path, capsys):
    text = _sd3_text(sd3, tmp_path, torch.bfloat16)
    text.ensure(UNIQUE)
    path = _entry(text, UNIQUE[0])
    full = _sd3_text(sd3, tmp_path)
    full.ensure(UNIQUE)
    path.write_bytes(_entry(full, UNIQUE[0]).read_bytes().replace(full.store.key.encode(), text.store.key.encode()))
    capsys.readouterr()
    assert _sd3_text(sd3, tmp_path, torch.bfloat16).ensure(UNIQUE) == 1
    assert "F32" in capsys.readouterr().err


def test_a_float32_store_written_before_entries_had_a_dtype_keeps_working(base, encoder, tmp_path):
    text = _cached(base, tmp_path, encoder)
    text.ensure(CAPTIONS)
    path = text.store.folder / "manifest.json"
    old = json.loads(path.read_text())
    del old["dtype"]  # START's manifest
    path.write_text(json.dumps(old))
    assert text.store.key == store_key(base, "sdxl", {})  # and the same key
    assert _cached(base, tmp_path).ensure(CAPTIONS) == 0  # loading raises: never loaded


def test_the_start_checks_headers_only_and_reads_no_value(base, encoder, tmp_path, monkeypatch):
    _cached(base, tmp_path, encoder).ensure(CAPTIONS)

    def no_values(self, name, caption):
        raise AssertionError(f"{name}'s values read at the start")

    monkeypatch.setattr(TextCache, "read", no_values)
    import safetensors

    from difftrain.data import text_cache

    def no_mapping(*args, **kwargs):  # a mapped file reads ahead into its values: 10,000 entries thrash the page cache
        raise AssertionError("an entry mapped at the start")

    monkeypatch.setattr(safetensors, "safe_open", no_mapping)
    monkeypatch.setattr(text_cache, "safe_open", no_mapping)  # the name text_cache.py imported at its top
    assert _cached(base, tmp_path).ensure(CAPTIONS) == 0


def test_the_fill_runs_on_the_cpu_when_the_device_cannot_hold_the_largest_encoder(sd3, monkeypatch, capsys):
    from difftrain.data.text_cache import fill_device, part_bytes

    encoder = detect(sd3).load_prompt_encoder(sd3, "cpu", max_sequence_length=8)
    largest = max(part_bytes(encoder.get_submodule(n), torch.bfloat16) for n in encoder.parts)
    assert largest == max(sum(p.numel() * 2 for p in encoder.get_submodule(n).parameters())
                          + sum(b.numel() * (2 if b.is_floating_point() else b.element_size())
                                for b in encoder.get_submodule(n).buffers()) for n in encoder.parts)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (largest, 10 * largest))
    assert fill_device(encoder, "cuda:0", torch.bfloat16) == torch.device("cuda:0")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (largest - 1, 10 * largest))
    assert fill_device(encoder, "cuda:0", torch.bfloat16) == torch.device("cpu")
    assert "runs the text encoders on the CPU" in capsys.readouterr().err
    assert fill_device(encoder, "cpu", torch.float32) == torch.device("cpu")


class _Captioned(torch.utils.data.Dataset):
    """Items (x (1,), caption) of CAPTIONS, as a captioned dataset gives them."""

    bucket_shapes = None

    def __len__(self):
        return len(CAPTIONS)

    def __getitem__(self, index):
        index = index[0] if isinstance(index, tuple) else index
        return torch.tensor([float(index)]), CAPTIONS[index]


@pytest.mark.parametrize("workers", [0, 1])
def test_the_loader_brings_each_batchs_cached_conditions_read_in_its_workers(base, encoder, tmp_path, workers,
                                                                            monkeypatch):
    from difftrain.data.loader import build_loader
    from difftrain.data.cached_conditions import CaptionBatch, cached_conditions

    text = _cached(base, tmp_path, encoder)
    text.ensure(CAPTIONS)
    conditioning = type("C", (), {"text": text})()
    loader = build_loader(cached_conditions(_Captioned(), conditioning), batch_size=2, seed=0, start=0,
                          num_workers=workers, device=torch.device("cpu"))
    batches = iter(loader)
    x, captions = next(batches)
    assert isinstance(captions, CaptionBatch) and captions == [CAPTIONS[int(i)] for i in x[:, 0]]
    expected = text.encode(list(captions), "cpu")  # read here, as the training thread read them before
    served = _cached(base, tmp_path)  # a fresh run: nothing in memory
    monkeypatch.setattr(TextCache, "read", lambda *a: (_ for _ in ()).throw(AssertionError("read on this thread")))
    cond = served.encode(captions, "cpu")  # the step's call: nothing read on the training thread
    assert all(torch.equal(cond[k], v) for k, v in expected.items())
    del batches


def test_an_entry_the_worker_cannot_read_is_rebuilt_on_the_training_thread(base, encoder, tmp_path, capsys):
    from difftrain.data.loader import collate
    from difftrain.data.cached_conditions import CachedConditions

    text = _cached(base, tmp_path, encoder)
    text.ensure(CAPTIONS)
    _non_finite(_entry(text, CAPTIONS[1]))
    items = CachedConditions(_Captioned(), text.store)
    _, captions = collate([items[0], items[1]])
    assert type(captions) is list  # one row without its condition: the batch is read on the training thread
    capsys.readouterr()
    cond = _cached(base, tmp_path, encoder).encode(captions, "cpu")
    assert capsys.readouterr().err.count("rebuilt") == 1 and torch.isfinite(cond["prompt_embeds"]).all()


def test_estimate_counts_the_fills_peak_the_largest_encoder_in_the_compute_dtype():
    from transformers import T5Config, T5EncoderModel

    from difftrain.tools.base_memory import base_folder, text_cache_fill_bytes

    folder = base_folder("flux-dev")
    with torch.device("meta"):
        raw = {k: v for k, v in json.loads((folder / "text_encoder_2" / "config.json").read_text()).items()
               if not k.startswith("_")}
        t5 = sum(p.numel() for p in T5EncoderModel(T5Config.from_dict(raw)).parameters())
    bf16, name = text_cache_fill_bytes(folder, load_config(None, ["train.precision=bf16"]))
    fp32, _ = text_cache_fill_bytes(folder, load_config(None, ["train.precision=fp32"]))
    assert "T5EncoderModel" in name and fp32 == 2 * bf16
    batch = 100 * max(2 * 512 * raw["d_ff"], raw["num_heads"] * 512**2)  # validation.heldout_batch_size captions
    assert bf16 == 2 * (t5 + batch)  # T5-XXL alone: 9.5 GB in bf16, and one batch's attention scores
