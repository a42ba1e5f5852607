"""Table-driven fuzzing of config values and image files (seeded, bounded to seconds).

Config: every option of every section gets each hostile value; it must either load (and then
be finite and survive config.toml) or fail with a ConfigError naming that option, never
anything else. Images: seeded mutations of valid files in every format (truncation, flipped
bytes, patched header sizes, appended garbage); the scan must name every file as good or bad,
never raise, and every good file must give a finite (C, H, W) tensor.
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
import random
import subprocess
import sys
import tomllib

import numpy as np
import pytest
from PIL import Image

from difftrain.config import Config, ConfigError, config_from_dict, config_to_toml, load_config
from difftrain.data.check import check_folder, prepare_dataset
from difftrain.data.folder import ImageFolderDataset

HOSTILE_VALUES = [
    "inf", "-inf", "nan", "-1", "0", "1e308", "-1e308", str(2**64), str(-(2**63) - 1), "1.5", '""', '"x"',
    '"../../etc"', "true", "[1]", "[]", "[inf, 1]", '"cuda:abc"', '"\\u0000"', "{a = 1}",
]


def _options() -> list[str]:
    cfg = Config()
    return [f"{s.name}.{f.name}" for s in dataclasses.fields(cfg) for f in dataclasses.fields(getattr(cfg, s.name))]


def test_fuzz_every_config_option_with_hostile_values():
    accepted = refused = 0
    for key in _options():
        for value in HOSTILE_VALUES:
            try:
                cfg = load_config(None, [f"{key}={value}"])
            except ConfigError as e:
                assert key in str(e), (key, value, str(e))
                refused += 1
                continue
            accepted += 1
            text = config_to_toml(cfg)  # written to the run folder and into checkpoints
            assert config_from_dict(tomllib.loads(text)) == cfg, (key, value)
            for section in dataclasses.fields(cfg):
                for f in dataclasses.fields(getattr(cfg, section.name)):
                    v = getattr(getattr(cfg, section.name), f.name)
                    for x in v if isinstance(v, tuple) else (v,):
                        assert not (isinstance(x, float) and not math.isfinite(x)), (key, value)
    assert refused > accepted > 0


def _seed_images() -> dict[str, bytes]:
    rng = np.random.default_rng(0)
    rgb = Image.fromarray(rng.integers(0, 256, (24, 32, 3), dtype=np.uint8))
    out = {}
    for ext, fmt, img in [
        (".png", "PNG", rgb), (".jpg", "JPEG", rgb), (".bmp", "BMP", rgb), (".webp", "WEBP", rgb),
        (".png", "PNG", rgb.convert("P")), (".png", "PNG", rgb.convert("RGBA")), (".jpg", "JPEG", rgb.convert("CMYK")),
        (".png", "PNG", Image.fromarray(rng.integers(0, 65536, (24, 32), dtype=np.uint16))),
        (".png", "PNG", rgb.convert("LA")), (".bmp", "BMP", rgb.convert("1")),
    ]:
        buf = io.BytesIO()
        img.save(buf, fmt)
        out[f"{fmt.lower()}_{img.mode.replace(';', '')}{ext}"] = buf.getvalue()
    return out


def _mutate(data: bytes, r: random.Random) -> bytes:
    b = bytearray(data)
    kind = r.randrange(5)
    if kind == 0:  # truncated
        return bytes(b[: r.randrange(len(b))])
    if kind == 1:  # a few flipped bytes anywhere
        for _ in range(r.randint(1, 8)):
            b[r.randrange(len(b))] = r.randrange(256)
        return bytes(b)
    if kind == 2:  # flipped bytes in the header, where sizes and chunk lengths live
        for _ in range(r.randint(1, 4)):
            b[r.randrange(min(64, len(b)))] = r.randrange(256)
        return bytes(b)
    if kind == 3:  # appended garbage
        return bytes(b) + r.randbytes(r.randint(1, 256))
    return r.randbytes(r.randint(0, 64))  # noise with an image's name


def test_fuzz_image_files_are_each_good_or_named_bad(tmp_path):
    root = tmp_path / "fuzz"
    root.mkdir()
    r = random.Random(11)
    seeds = _seed_images()
    names = []
    for name, data in seeds.items():
        (root / name).write_bytes(data)
        names.append(name)
        for k in range(40):
            mutated = f"{k:02d}_{name}"
            (root / mutated).write_bytes(_mutate(data, r))
            names.append(mutated)
    report = check_folder(root, 16)
    assert report.num_files == len(names)
    for name in seeds:
        assert name not in report.bad, (name, report.bad.get(name))
    assert all(reason.startswith(("unreadable", "empty", "too small")) for reason in report.bad.values())
    ds = prepare_dataset(ImageFolderDataset(root, 16), "skip", tmp_path / "run")
    assert len(ds) == report.num_good
    for i in range(len(ds)):
        x, *_ = ds[(i, i)]
        assert x.shape == (3, 16, 16) and bool(x.isfinite().all())
    # The command on the same folder: exit 1 (bad files found), no traceback.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    cli = subprocess.run([sys.executable, "-m", "difftrain", "data", "check", str(root), "--resolution", "16"],
                         capture_output=True, text=True, env=env)
    assert cli.returncode == (1 if report.bad else 0) and "Traceback" not in cli.stderr, cli.stderr


@pytest.fixture(autouse=True)
def _quiet_pil_warnings():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
