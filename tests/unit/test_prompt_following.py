"""The prompt-following judge: right on the drawn shapes, at chance on shuffled prompts."""

from __future__ import annotations

import numpy as np
import pytest

from difftrain.data.builtin import COLOUR_NAMES, SHAPE_CLASSES, describe_shape, draw_ring, draw_shape, shape_caption
from difftrain.evaluation.prompt_following import judge_image, parse_prompt, prompt_following


def ground_truth(n: int, resolution: int = 32) -> tuple[np.ndarray, list[str]]:
    """The first ``n`` shapes images (uint8 (N, H, W, 3)) and their captions."""
    images = np.stack([draw_shape(i, resolution, 3)[0] for i in range(n)])
    return images, [shape_caption(describe_shape(i, resolution, 3)) for i in range(n)]


def test_the_judge_reads_the_drawn_shapes_and_colours():
    images, prompts = ground_truth(300)
    r = prompt_following(images, prompts)
    assert r["n"] == 300
    assert r["shape_accuracy"] >= 0.95 and r["colour_accuracy"] >= 0.95, r
    assert r["both_accuracy"] >= 0.93, r
    assert r["shape_chance"] == pytest.approx(1 / 3) and r["colour_chance"] == pytest.approx(1 / len(COLOUR_NAMES))
    assert r["both_chance"] == pytest.approx(r["shape_chance"] * r["colour_chance"])


def test_shuffled_prompts_score_near_chance():
    images, prompts = ground_truth(300)
    order = np.random.default_rng(0).permutation(len(prompts))
    r = prompt_following(images, [prompts[k] for k in order])
    assert abs(r["shape_accuracy"] - 1 / 3) < 0.1, r
    # Hues are drawn uniformly and "green" spans the widest range, so matching colours by
    # chance is a little above 1/8; well below what the judge gets on the true prompts.
    assert r["colour_accuracy"] < 0.25 and r["both_accuracy"] < 0.12, r


def test_the_judge_survives_noise_and_finds_nothing_on_a_blank_image():
    images, prompts = ground_truth(90)
    noisy = np.clip(images + np.random.default_rng(1).normal(0, 12, images.shape), 0, 255).astype(np.uint8)
    r = prompt_following(noisy, prompts)
    assert r["shape_accuracy"] >= 0.9 and r["colour_accuracy"] >= 0.9, r
    assert judge_image(np.full((32, 32, 3), 40, dtype=np.uint8)) == (None, None)


def test_a_plain_square_and_disc_by_hand():
    square = np.full((32, 32, 3), 230, dtype=np.uint8)
    square[8:24, 6:22] = (0, 0, 255)
    assert judge_image(square) == ("square", "blue")
    yy, xx = np.mgrid[:32, :32]
    disc = np.full((32, 32, 3), 20, dtype=np.uint8)
    disc[(yy - 16) ** 2 + (xx - 15) ** 2 <= 9**2] = (255, 30, 30)
    assert judge_image(disc) == ("disc", "red")


def test_prompts_are_parsed_and_checked():
    assert parse_prompt("An Orange triangle, on a light background") == ("triangle", "orange")
    with pytest.raises(ValueError, match="names no shape"):
        parse_prompt("a red blob")
    with pytest.raises(ValueError, match="names no colour"):
        parse_prompt("a disc")
    images, prompts = ground_truth(2)
    with pytest.raises(ValueError, match="one prompt per image"):
        prompt_following(images, prompts[:1])
    with pytest.raises(ValueError, match="uint8"):
        prompt_following(images.astype(np.float32), prompts)
    assert set(SHAPE_CLASSES) == {"disc", "square", "triangle"}


def test_the_judge_knows_a_ring_and_sees_none_in_the_data(resolution=16):  # the demo's size
    rings = [draw_ring(i, resolution) for i in range(200)]
    assert np.mean([judge_image(r)[0] == "ring" for r in rings]) >= 0.97
    red = np.stack([draw_ring(i, resolution, hue_deg=(-10, 10), dark=True) for i in range(100)])
    r = prompt_following(red, ["a red ring on a dark background"] * 100)
    assert r["both_accuracy"] >= 0.97, r
    images, _ = ground_truth(300, resolution)  # no disc, square or triangle is taken for a ring
    assert not any(judge_image(image)[0] == "ring" for image in images)
    assert parse_prompt("a sks ring, pink") == ("ring", "pink")
