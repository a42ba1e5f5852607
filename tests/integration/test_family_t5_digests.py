"""The single-T5 prompt encoders (Chroma, PixArt-Sigma, AuraFlow: one mmdit.T5PromptEncoder) keep the digests
checkpoints already record: the STORED digest of text_encoder/ and tokenizer/ with each family's settings string,
and the FLOAT32 (legacy) digest of the float32 weights then the vocabulary and the same string. Each formula is
written out here from transformers' own classes, so that a change to the shared class that moves a digest fails."""

from __future__ import annotations

import json

import pytest
import torch

from tests.family_bases_auraflow import write_tiny_auraflow_folder
from tests.family_bases_chroma import write_tiny_chroma_folder
from tests.family_bases_pixart import write_tiny_pixart_folder

transformers = pytest.importorskip("transformers")
pytest.importorskip("diffusers")

from difftrain.families import family_named  # noqa: E402
from difftrain.models.text import files_digest, streamed_digest, vocab_bytes  # noqa: E402

# family: (its folder writer, the encoder's class, the settings string after "t5_length=N,"); the tokenizer's
# class is the one model_index.json names
CASES = {
    "chroma": (write_tiny_chroma_folder, "T5EncoderModel", "mask=chroma"),
    "pixart-sigma": (write_tiny_pixart_folder, "T5EncoderModel", "text=lower-strip,mask"),
    "auraflow": (write_tiny_auraflow_folder, "UMT5EncoderModel", "padding=zero"),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("t5_bases")
    return {name: write(root / name) for name, (write, *_) in CASES.items()}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("length", [0, 7])
def test_the_single_t5_encoders_digests_are_the_recorded_formulas(folders, name, length):
    folder, (_, encoder_class, settings) = folders[name], CASES[name]
    enc = family_named(name).load_prompt_encoder(folder, max_sequence_length=length)
    extra = f"t5_length={enc.t5_length},{settings}".encode()
    assert length == 0 or enc.t5_length == length
    assert enc.digest == files_digest([folder / "text_encoder"], [folder / "tokenizer"], extra)
    assert enc.digest_kind == "stored"
    tokenizer_class = json.loads((folder / "model_index.json").read_text())["tokenizer"][1]
    tokenizer = getattr(transformers, tokenizer_class).from_pretrained(folder / "tokenizer")

    def load():
        return getattr(transformers, encoder_class).from_pretrained(folder / "text_encoder", dtype=torch.float32)

    assert enc.legacy_digest() == streamed_digest([load], vocab_bytes([tokenizer], pairs=True) + extra)


def test_the_three_families_digests_differ(folders):
    """The settings strings keep two families' digests apart even on the same T5 files."""
    digests = {family_named(name).load_prompt_encoder(folders[name]).digest for name in CASES}
    assert len(digests) == 3
