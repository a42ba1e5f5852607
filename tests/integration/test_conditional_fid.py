"""FID of class-conditional, text and latent models: during training and by `difftrain eval`.

The FID network is stood in by a small TorchScript file (as in test_evaluation_commands.py); what
is checked is what the samples are conditioned on, that it is recorded beside the number, that
the draws of labels and captions depend on (seed, batch) alone, and that they reach the samples.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from difftrain import cli
from difftrain.networks.conditioning import Conditioning
from difftrain.config import load_config
from difftrain.diffusion.objective import build_objective
from difftrain.evaluation.evaluate import DatasetCaptions, FIDConditions, sample_features
from difftrain.training.loop import train
from tests.fid_standin import use_standin, write_standin
from difftrain.models import build_model

DIM = 32
TEXT = ["data.captions=true", "model.text_encoder=builtin:tiny-clip"]
FID = ["evaluation.fid_every_steps=3", "evaluation.fid_num_samples=5", "evaluation.fid_steps=2",
       "evaluation.fid_ref_num=8", "evaluation.fid_batch_size=4", "validation.every_steps=0",
       "validation.guidance_scale=2.0", "train.total_steps=3", "checkpoint.every_steps=3"]


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    return write_standin(tmp_path_factory.mktemp("net") / "standin.pt", DIM)


@pytest.fixture
def env(weights, tmp_path, monkeypatch):
    use_standin(monkeypatch, weights, DIM, tmp_path / "cache")
    return tmp_path


def _fid_rows(run) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "fid" in r]


def _latent(tmp_path) -> list[str]:
    pytest.importorskip("diffusers")
    from tests.text_components import write_tiny_vae

    return [f"model.vae={write_tiny_vae(tmp_path / 'vae')}", "model.attention_resolutions=[4]"]


@pytest.mark.parametrize("kind", ["class", "text", "latent text"])
def test_fid_during_training_says_what_its_samples_were_conditioned_on(env, tiny_overrides, kind):
    extra = {"class": ["data.class_conditional=true"], "text": TEXT,
             "latent text": TEXT + (_latent(env) if kind == "latent text" else [])}[kind]
    train(load_config(None, tiny_overrides + FID + extra), env / "run")
    (row,) = _fid_rows(env / "run")
    assert row["step"] == 3 and np.isfinite(row["fid"])
    assert row["fid_num_samples"] == 5 and row["fid_num_reference"] == 8 and row["fid_guidance_scale"] == 2.0
    expected = "labels uniform over 3 classes" if kind == "class" else "captions of data.path builtin:shapes"
    assert row["fid_conditioned_on"].startswith(expected), row["fid_conditioned_on"]


def test_unconditional_fid_during_training_says_so(env, tiny_overrides):
    train(load_config(None, tiny_overrides + FID), env / "run")
    (row,) = _fid_rows(env / "run")
    assert row["fid_conditioned_on"] == "nothing (unconditional)" and row["fid_guidance_scale"] == 1.0


def test_eval_of_class_and_text_models(env, tiny_overrides, capsys):
    common = ["--num", "5", "--steps", "2", "--ref-num", "8", "--batch-size", "4", "--no-kid"]
    for name, extra in (("class", ["data.class_conditional=true"]), ("text", TEXT)):
        cfg = load_config(None, tiny_overrides + ["train.total_steps=2", "validation.every_steps=0"] + extra)
        train(cfg, env / name)
    out = env / "class.json"
    assert cli.main(["eval", "--checkpoint", str(env / "class"), *common, "--guidance-scale", "1.5",
                     "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "conditioned on labels uniform over 3 classes, guidance 1.5" in printed and "5 samples" in printed
    result = json.loads(out.read_text())
    assert (result["conditioned_on"], result["guidance_scale"]) == ("labels uniform over 3 classes", 1.5)

    assert cli.main(["eval", "--checkpoint", str(env / "text"), *common, "--guidance-scale", "3"]) == 0
    assert "conditioned on captions of data.path builtin:shapes" in capsys.readouterr().out
    captions = env / "captions.txt"
    captions.write_text("a red disc on a dark background\n\na blue square on a light background\n")
    assert cli.main(["eval", "--checkpoint", str(env / "text"), *common, "--captions", str(captions)]) == 0
    assert f"conditioned on captions of {captions} (2), drawn uniformly, guidance 1" in capsys.readouterr().out

    # Options that do not fit the model fail, naming them.
    assert cli.main(["eval", "--checkpoint", str(env / "class"), *common, "--captions", str(captions)]) == 2
    assert "--captions" in capsys.readouterr().err


def test_eval_refuses_guidance_for_an_unconditional_model(env, tiny_overrides, capsys):
    train(load_config(None, tiny_overrides + ["train.total_steps=2", "validation.every_steps=0"]), env / "run")
    assert cli.main(["eval", "--checkpoint", str(env / "run"), "--num", "4", "--steps", "2", "--ref-num", "8",
                     "--guidance-scale", "2"]) == 2
    assert "unconditional" in capsys.readouterr().err


# ---- The draws ---------------------------------------------------------------------------------


def test_label_and_caption_draws_depend_on_seed_and_batch_alone(tiny_cfg):
    classes = FIDConditions(Conditioning(3, channels=3, resolution=16))
    labels, null = classes.draw(6, seed=4, k=2)
    assert labels.shape == (6,) and null.tolist() == [3] and int(labels.max()) < 3
    assert torch.equal(labels, FIDConditions(Conditioning(3)).draw(6, seed=4, k=2)[0])  # a fresh object, same draw
    many = torch.cat([classes.draw(64, seed=4, k=k)[0] for k in range(8)])
    assert not torch.equal(many[:64], many[64:128]) and set(many.tolist()) == {0, 1, 2}

    captions = [f"caption {i}" for i in range(100)]
    text = _TextStub()
    drawn = FIDConditions(text, captions=captions)
    first, again = drawn.draw(5, seed=0, k=1), drawn.draw(5, seed=0, k=1)
    assert text.seen[0] == text.seen[1] and len(set(text.seen[0])) > 1  # the same captions each time
    drawn.draw(5, seed=0, k=2)
    assert text.seen[2] != text.seen[0]
    assert torch.equal(first[0], again[0])


class _TextStub(Conditioning):
    """A text conditioning that records the captions it encodes (as one number each)."""

    def __init__(self):
        super().__init__()
        self.seen: list[list[str]] = []
        self.text = torch.nn.Linear(1, 1)  # kind "text"; its parameters name the device

    def prompts(self, prompts, device="cpu"):
        self.seen.append(list(prompts))
        return torch.tensor([[[float(p.split()[-1])]] for p in prompts])

    def null(self, n, device="cpu"):
        return torch.zeros(n, 1, 1)


def test_dataset_captions_are_read_once_and_through_a_latent_cache():
    class Items:
        targets = None

        def __init__(self):
            self.reads = 0

        def __len__(self):
            return 4

        def __getitem__(self, i):
            self.reads += 1
            return torch.zeros(1), f"item {i}"

    items = Items()
    captions = DatasetCaptions(items)
    assert [captions[i] for i in (2, 2, 3)] == ["item 2", "item 2", "item 3"] and items.reads == 2

    class Latents:  # a LatentDataset keeps its captions in targets: no moments are read
        targets = ["a", "b", "c"]

        def __len__(self):
            return 3

        def __getitem__(self, i):
            raise AssertionError("read the moments")

    assert len(DatasetCaptions(Latents())) == 3 and DatasetCaptions(Latents())[1] == "b"


def test_the_labels_reach_the_samples(tiny_cfg):
    """Two label draws over the same noise give different features: the condition is used."""
    torch.manual_seed(0)
    model = build_model(tiny_cfg, 3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    d = tiny_cfg.data
    conditioning = Conditioning(3, channels=d.channels, resolution=d.resolution)

    class Shifted(FIDConditions):
        def draw(self, n, seed, k):
            labels, null = super().draw(n, seed, k)
            return (labels + 1) % 3, null

    inception = lambda images: images.float().flatten(1)[:, :64]  # noqa: E731
    options = dict(objective=build_objective(tiny_cfg.diffusion), shape=(d.channels, d.resolution, d.resolution),
                   num=4, sampler="ddim", steps=2, seed=0, batch_size=4)
    a = torch.cat(list(sample_features(model, inception, conditions=FIDConditions(conditioning), **options)))
    b = torch.cat(list(sample_features(model, inception, conditions=Shifted(conditioning), **options)))
    again = torch.cat(list(sample_features(model, inception, conditions=FIDConditions(conditioning), **options)))
    assert torch.equal(a, again) and not torch.equal(a, b)
