"""CLIP score against CLIPModel's own feature functions, on a tiny random CLIP built here."""

import json

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
from transformers import CLIPConfig, CLIPModel, CLIPTokenizer  # noqa: E402

from difftrain.evaluation.clip_score import (  # noqa: E402
    CLIP_MEAN,
    CLIP_STD,
    CLIPScorer,
    ClipPreprocessing,
    preprocess_clip,
)

IMAGE_SIZE = 32  # pixels, the tiny vision tower's input


def _byte_chars() -> list[str]:
    """The 256 printable characters byte-level BPE uses for the 256 byte values (GPT-2's map)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = [], 0
    for b in range(256):
        if b in keep:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def write_tiny_clip(folder, seed=0, preprocessor=None):
    """A random CLIPModel (hidden 32, 2 layers) with a byte-level BPE tokenizer, saved."""
    chars = _byte_chars()
    vocab = {c: i for i, c in enumerate(chars)}
    vocab.update({c + "</w>": 256 + i for i, c in enumerate(chars)})
    merges = [("c", "a"), ("ca", "t</w>"), ("d", "o"), ("do", "g</w>")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    bos, eos = len(vocab), len(vocab) + 1
    vocab["<|startoftext|>"], vocab["<|endoftext|>"] = bos, eos
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text(
        "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    tokenizer = CLIPTokenizer(vocab=str(folder / "vocab.json"), merges=str(folder / "merges.txt"))
    tokenizer.save_pretrained(folder)
    text = dict(vocab_size=len(vocab), hidden_size=32, intermediate_size=64,
                num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=16,
                bos_token_id=bos, eos_token_id=eos, pad_token_id=eos)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, image_size=IMAGE_SIZE, patch_size=8)
    torch.manual_seed(seed)
    model = CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=16))
    model.save_pretrained(folder)
    if preprocessor is not None:
        (folder / "preprocessor_config.json").write_text(json.dumps(preprocessor))
    return model.eval(), CLIPTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def tiny_clip(tmp_path_factory):
    folder = tmp_path_factory.mktemp("clip")
    model, tokenizer = write_tiny_clip(folder)
    return folder, model, tokenizer


def _images(n, h=40, w=48, c=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, h, w, c), generator=g, dtype=torch.uint8)


def _features(out):
    """get_*_features returns a tensor in transformers 4 and an output object in 5."""
    return out if isinstance(out, torch.Tensor) else out.pooler_output


def _reference_scores(model, tokenizer, pixels, prompts):
    tokens = tokenizer(prompts, padding=True, return_tensors="pt")
    with torch.no_grad():
        img = _features(model.get_image_features(pixel_values=pixels))
        txt = _features(model.get_text_features(**tokens))
    cos = torch.nn.functional.cosine_similarity(img, txt, dim=-1)
    return 100 * cos.clamp(min=0), cos


PROMPTS = ["a cat", "a dog on grass", "cat cat dog", "the sky!"]


def test_tokenizer_is_real_bpe(tiny_clip):
    _, _, tokenizer = tiny_clip
    ids = tokenizer("a cat")["input_ids"]
    assert ids[0] == tokenizer.bos_token_id and ids[-1] == tokenizer.eos_token_id
    assert tokenizer.convert_ids_to_tokens(ids[1:-1]) == ["a</w>", "cat</w>"]


def test_score_matches_clip_model_features(tiny_clip):
    folder, model, tokenizer = tiny_clip
    scorer = CLIPScorer.from_path(folder)
    images = _images(4)
    pixels = preprocess_clip(images, scorer.preprocessing)
    seen_positive = seen_clipped = False
    for _ in range(2):  # then with every cosine negated, so both signs are checked
        got = scorer.score(images, PROMPTS, batch_size=3)
        expected, cos = _reference_scores(model, tokenizer, pixels, PROMPTS)
        assert got.shape == (4,) and got.dtype == torch.float32
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
        mean, n = scorer.mean_score(images, PROMPTS)
        assert n == 4 and mean == pytest.approx(float(expected.mean()), abs=1e-4)
        seen_positive |= bool((cos > 0.01).any())
        seen_clipped |= bool((cos < -0.01).any())
        with torch.no_grad():
            model.text_projection.weight.neg_()
            scorer.model.text_projection.weight.neg_()
    assert seen_positive and seen_clipped


def test_different_prompts_give_different_scores(tiny_clip):
    folder, _, _ = tiny_clip
    scorer = CLIPScorer.from_path(folder)
    image = _images(1).repeat(4, 1, 1, 1)
    scores = scorer.score(image, PROMPTS)
    # Scores can clip to 0; the cosines behind them must differ.
    cos = (scorer.image_embeddings(image) * scorer.text_embeddings(PROMPTS)).sum(-1)
    assert len(set(np.round(cos.numpy(), 5).tolist())) == 4
    assert torch.equal(scores, 100 * cos.clamp(min=0))


def test_negative_cosine_is_clipped_to_zero(tiny_clip):
    folder, _, _ = tiny_clip
    scorer = CLIPScorer.from_path(folder)
    images = _images(4, seed=3)
    before = (scorer.image_embeddings(images) * scorer.text_embeddings(PROMPTS)).sum(-1)
    scores_before = scorer.score(images, PROMPTS)
    with torch.no_grad():  # flipping the text projection negates every cosine
        scorer.model.text_projection.weight.neg_()
    after = scorer.score(images, PROMPTS)
    assert (after[before > 0] == 0).all() and (scores_before[before < 0] == 0).all()
    assert (scores_before > 1).any() or (after > 1).any()
    assert (scores_before == 0).any() or (after == 0).any()


def test_preprocessing_resizes_short_side_and_center_crops():
    prep = ClipPreprocessing(size=8, crop_height=8, crop_width=8, mean=CLIP_MEAN, std=CLIP_STD)
    image = np.zeros((1, 8, 16, 3), np.uint8)  # already short side 8: no resize
    image[0, :, 4:12] = 255  # the center 8 columns are white
    x = preprocess_clip(image, prep)
    assert x.shape == (1, 3, 8, 8)
    white = (1 - torch.tensor(CLIP_MEAN)) / torch.tensor(CLIP_STD)
    torch.testing.assert_close(x[0].mean(dim=(1, 2)), white)
    gray = np.full((2, 5, 7, 1), 128, np.uint8)  # C=1 -> 3, upscaled to short side 8
    y = preprocess_clip(gray, prep)
    expected = (128 / 255 - torch.tensor(CLIP_MEAN)) / torch.tensor(CLIP_STD)
    assert y.shape == (2, 3, 8, 8)
    torch.testing.assert_close(y.mean(dim=(2, 3)), expected.expand(2, 3), atol=1e-3, rtol=0)


def test_preprocessor_config_is_read(tmp_path):
    folder = tmp_path / "clip"
    write_tiny_clip(folder, preprocessor={
        "size": {"shortest_edge": 36}, "crop_size": {"height": 32, "width": 32},
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.25, 0.25, 0.25]})
    scorer = CLIPScorer.from_path(folder)
    assert scorer.preprocessing == ClipPreprocessing(36, 32, 32, (0.5,) * 3, (0.25,) * 3)
    assert scorer.score(_images(2), ["a cat", "a dog"]).shape == (2,)


def test_bad_folders_name_the_folder(tmp_path, tiny_clip):
    with pytest.raises(ValueError, match="missing-folder.*not a folder"):
        CLIPScorer.from_path(tmp_path / "missing-folder")
    other = tmp_path / "not-clip"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(ValueError, match="not-clip.*'bert'"):
        CLIPScorer.from_path(other)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="empty.*config.json"):
        CLIPScorer.from_path(empty)
    folder, _, _ = tiny_clip
    no_tok = tmp_path / "no-tokenizer"
    no_tok.mkdir()
    for name in ("config.json", "model.safetensors"):
        (no_tok / name).write_bytes((folder / name).read_bytes())
    with pytest.raises(ValueError, match="no-tokenizer.*vocab.json"):
        CLIPScorer.from_path(no_tok)


def test_input_checks(tiny_clip):
    folder, _, _ = tiny_clip
    scorer = CLIPScorer.from_path(folder)
    with pytest.raises(ValueError, match="one prompt per image"):
        scorer.score(_images(2), ["a cat"])
    with pytest.raises(ValueError, match="N, H, W"):
        scorer.score(_images(2).permute(0, 3, 1, 2), ["a", "b"])
    with pytest.raises(TypeError, match="uint8"):
        scorer.score(_images(2).float(), ["a", "b"])


def test_long_prompts_are_truncated_to_max_length(tiny_clip):
    folder, _, _ = tiny_clip
    scorer = CLIPScorer.from_path(folder)
    long_prompt = " ".join(["cat"] * 40)  # 42 tokens > max_position_embeddings 16
    capped = " ".join(["cat"] * 14)  # 16 tokens with bos and eos
    scores = scorer.score(_images(1).repeat(2, 1, 1, 1), [long_prompt, capped])
    torch.testing.assert_close(scores[0], scores[1])
