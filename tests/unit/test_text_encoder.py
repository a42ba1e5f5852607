"""The frozen text encoder: loading (folder, SD folder, builtin), tokenizing, encoding, digests, errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from difftrain.models.text import BOS, EOS, TextEncoder, word_vocabulary  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from text_components import (  # noqa: E402
    assert_one_line_error,
    TEXT_HIDDEN, TEXT_LENGTH, write_tiny_sd_folder, write_tiny_text_encoder, write_tiny_tokenizer,
)

CAPTIONS = ["a red disc on a dark background", "a blue square on a light background", "a magenta triangle"]
# The digest of builtin:tiny-clip: its weights come from difftrain's own seeded generator, so
# this stays the same on every machine and transformers version. Changing the builtin (its
# words, sizes, seed or init) changes it, and checkpoints that reference the old one no longer
# match: do that on purpose only.
TINY_CLIP_DIGEST = "ae359fbc663687932662b368b17637e61662fe03bbe91c619b74c7f1594eb2d2"


@pytest.fixture(scope="module")
def tiny_clip() -> TextEncoder:
    return TextEncoder.from_path("builtin:tiny-clip")


def test_builtin_shapes_and_attributes(tiny_clip):
    assert (tiny_clip.dim, tiny_clip.max_length, tiny_clip.source) == (64, 16, "builtin:tiny-clip")
    ids = tiny_clip.tokenize(CAPTIONS)
    assert ids.shape == (3, 16) and ids.dtype == torch.long
    e = tiny_clip.encode(CAPTIONS)
    assert e.shape == (3, 16, 64) and e.dtype == torch.float32 and torch.isfinite(e).all()
    assert not e.requires_grad
    assert not any(p.requires_grad for p in tiny_clip.parameters())


def test_builtin_captions_are_whole_words(tiny_clip):
    """Each word of a built-in caption is one token: BOS, the words, EOS, then EOS padding."""
    vocab = tiny_clip.tokenizer.get_vocab()
    for caption in CAPTIONS:
        ids = tiny_clip.tokenize([caption])[0].tolist()
        words = caption.split()
        assert ids[: len(words) + 2] == [vocab[BOS]] + [vocab[w + "</w>"] for w in words] + [vocab[EOS]]
        assert set(ids[len(words) + 2 :]) == {vocab[EOS]}


def test_any_text_tokenizes_without_unknowns(tiny_clip):
    """Unknown words are spelled out from characters (every byte has a token)."""
    tok = tiny_clip.tokenizer
    ids = tiny_clip.tokenize(["zebra ü 4!"])[0].tolist()
    text = tok.decode(ids, skip_special_tokens=True)
    assert text.replace(" ", "") == "zebraü4!"


def test_empty_caption_is_bos_then_eos(tiny_clip):
    vocab = tiny_clip.tokenizer.get_vocab()
    ids = tiny_clip.tokenize([""])[0].tolist()
    assert ids == [vocab[BOS]] + [vocab[EOS]] * 15
    assert torch.isfinite(tiny_clip.encode([""])).all()


def test_long_captions_truncate_keeping_eos(tiny_clip):
    ids = tiny_clip.tokenize([" ".join(["red"] * 40)])
    assert ids.shape == (1, 16) and ids[0, -1].item() == tiny_clip.tokenizer.get_vocab()[EOS]


def test_tokenize_refuses_a_bare_string(tiny_clip):
    with pytest.raises(TypeError):
        tiny_clip.tokenize("a red disc")


def test_encode_is_deterministic_and_tells_captions_apart(tiny_clip):
    a, b = tiny_clip.encode(CAPTIONS), tiny_clip.encode(CAPTIONS)
    assert torch.equal(a, b)
    one = tiny_clip.encode(CAPTIONS[:1])
    torch.testing.assert_close(one[0], a[0], rtol=1e-5, atol=1e-5)  # batch-independent
    assert (a[0] - a[1]).abs().max() > 0.1
    assert torch.equal(tiny_clip.encode_ids(tiny_clip.tokenize(CAPTIONS)), a)


def test_stays_in_eval_mode(tiny_clip):
    parent = torch.nn.ModuleDict({"text": tiny_clip})
    parent.train()
    assert not tiny_clip.training and not tiny_clip.model.training


def test_builtin_digest_stable_across_loads_and_processes(tiny_clip):
    again = TextEncoder.from_path("builtin:tiny-clip")
    assert again.digest == tiny_clip.digest == TINY_CLIP_DIGEST
    for p, q in zip(again.parameters(), tiny_clip.parameters()):
        assert torch.equal(p, q)
    code = "from difftrain.models.text import TextEncoder; print(TextEncoder.from_path('builtin:tiny-clip').digest)"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip().splitlines()[-1] == TINY_CLIP_DIGEST


def test_builtin_leaves_the_global_rng_alone():
    state = torch.get_rng_state()
    TextEncoder.from_path("builtin:tiny-clip")
    assert torch.equal(torch.get_rng_state(), state)


def test_folder_matches_transformers(tmp_path):
    from transformers import CLIPTextModel, CLIPTokenizer

    folder = write_tiny_text_encoder(tmp_path / "clip")
    te = TextEncoder.from_path(str(folder))
    assert (te.dim, te.max_length) == (TEXT_HIDDEN, TEXT_LENGTH)
    ids = CLIPTokenizer.from_pretrained(str(folder))(CAPTIONS, padding="max_length", max_length=TEXT_LENGTH,
                                                     return_tensors="pt")["input_ids"]
    assert torch.equal(te.tokenize(CAPTIONS), ids)
    expected = CLIPTextModel.from_pretrained(str(folder)).eval()(input_ids=ids).last_hidden_state
    torch.testing.assert_close(te.encode(CAPTIONS), expected)
    assert TextEncoder.from_path(str(folder)).digest == te.digest
    other = TextEncoder.from_path(str(write_tiny_text_encoder(tmp_path / "clip2", seed=1)))
    assert other.digest != te.digest


def test_sd_folder(tmp_path):
    from diffusers import StableDiffusionPipeline

    folder = write_tiny_sd_folder(tmp_path / "sd")
    pipe = StableDiffusionPipeline.from_pretrained(str(folder))
    te = TextEncoder.from_path(str(folder))
    assert te.dim == pipe.unet.config.cross_attention_dim == TEXT_HIDDEN
    ids = pipe.tokenizer(CAPTIONS, padding="max_length", max_length=TEXT_LENGTH, return_tensors="pt").input_ids
    assert torch.equal(te.tokenize(CAPTIONS), ids)
    torch.testing.assert_close(te.encode(CAPTIONS), pipe.text_encoder(ids)[0])


def test_tokenizer_builder_makes_each_word_one_token(tmp_path):
    """Overlapping words (prefixes of each other, shared parts) each stay one token."""
    from transformers import CLIPTokenizer

    words = ["re", "red", "redder", "ed", "reed", "deer", "a", "aa", "aaa", "background", "round"]
    tok = CLIPTokenizer.from_pretrained(str(write_tiny_tokenizer(tmp_path / "tok", words)))
    for w in words:
        assert tok.tokenize(w) == [w + "</w>"], w
    vocab, merges = word_vocabulary(words)
    assert len(set(vocab.values())) == len(vocab) and max(vocab.values()) == len(vocab) - 1


def _one_line_error(path: str, *needles: str):
    assert_one_line_error(TextEncoder.from_path, path, *needles)


def test_errors_name_the_folder_and_what_is_missing(tmp_path):
    _one_line_error(str(tmp_path / "nothing"), "no such folder")
    (tmp_path / "empty").mkdir()
    _one_line_error(str(tmp_path / "empty"), "config.json")
    folder = write_tiny_text_encoder(tmp_path / "clip")
    (folder / "vocab.json").unlink()
    _one_line_error(str(folder), "tokenizer", "vocab.json")
    folder = write_tiny_text_encoder(tmp_path / "noweights")
    (folder / "model.safetensors").unlink()
    _one_line_error(str(folder), "no weights")
    bert = tmp_path / "bert"
    bert.mkdir()
    (bert / "config.json").write_text(json.dumps({"model_type": "bert"}))
    _one_line_error(str(bert), "'bert'", "not a CLIP text model")
    sd = write_tiny_sd_folder(tmp_path / "sd")
    for f in (sd / "tokenizer").iterdir():
        f.unlink()
    (sd / "tokenizer").rmdir()
    _one_line_error(str(sd), "tokenizer/")
    _one_line_error("builtin:huge-clip", "tiny-clip")


def test_whole_clip_model_folder_gives_its_text_half(tmp_path):
    from transformers import CLIPConfig, CLIPModel

    folder = write_tiny_tokenizer(tmp_path / "clip")
    vocab = json.loads((folder / "vocab.json").read_text())
    text = dict(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                max_position_embeddings=TEXT_LENGTH, bos_token_id=vocab[BOS], eos_token_id=vocab[EOS])
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32,
                  patch_size=8)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        clip = CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)).eval()
    clip.save_pretrained(folder)
    te = TextEncoder.from_path(str(folder))
    ids = te.tokenize(CAPTIONS)
    torch.testing.assert_close(te.encode_ids(ids), clip.text_model(input_ids=ids).last_hidden_state)


def test_weights_that_do_not_fit_are_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = write_tiny_text_encoder(tmp_path / "clip")
    tensors = load_file(folder / "model.safetensors")
    dropped = sorted(tensors)[0]
    kept = {k: v for k, v in tensors.items() if k != dropped}
    save_file(kept, folder / "model.safetensors", metadata={"format": "pt"})
    _one_line_error(str(folder), "do not fit", "1 tensors missing")
