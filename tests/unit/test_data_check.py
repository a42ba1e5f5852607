"""The dataset scan: bad files found and named, modes counted, skip/fail, cache, mid-run skips."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
from PIL import Image

from difftrain.cli import main
from difftrain.data.check import BAD_LOG_NAME, cached_check, check_folder, prepare_dataset
from difftrain.data.folder import ImageFolderDataset


def _rgb(size=(24, 24), seed=0) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def make_messy_folder(root, good: int = 4):
    """Good images of every awkward mode, plus one file of each kind of bad one."""
    root.mkdir(parents=True, exist_ok=True)
    for i in range(good):
        _rgb(seed=i).save(root / f"good_{i}.png")
    _rgb(seed=10).convert("P").save(root / "palette.png")
    _rgb(seed=11).convert("RGBA").save(root / "rgba.png")
    _rgb(seed=12).convert("L").save(root / "gray.png")
    _rgb(seed=13).convert("CMYK").save(root / "cmyk.jpg")
    Image.fromarray((np.arange(24 * 24, dtype=np.uint16).reshape(24, 24) * 100)).save(root / "deep16.png")
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 degrees
    _rgb((24, 40), seed=14).save(root / "rotated.jpg", exif=exif)
    buf = io.BytesIO()
    _rgb(seed=15).save(buf, format="JPEG")
    (root / "truncated.jpg").write_bytes(buf.getvalue()[: len(buf.getvalue()) // 2])
    (root / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4)
    (root / "empty.png").write_bytes(b"")
    (root / "notes.jpg").write_text("this is not an image")
    _rgb((8, 8), seed=16).save(root / "tiny.png")
    return root


BAD = {"truncated.jpg", "corrupt.png", "empty.png", "notes.jpg", "tiny.png"}


def test_check_names_every_bad_file_and_counts_modes(tmp_path):
    report = check_folder(make_messy_folder(tmp_path / "d"), resolution=16)
    assert set(report.bad) == BAD
    assert "0 bytes" in report.bad["empty.png"] and "too small" in report.bad["tiny.png"]
    assert "unreadable" in report.bad["notes.jpg"] and "unreadable" in report.bad["truncated.jpg"]
    assert report.num_files == 4 + 6 + len(BAD) and report.num_good == 10
    for mode in ("RGB", "P", "RGBA", "L", "CMYK", "I;16"):
        assert report.modes.get(mode, 0) >= 1, (mode, report.modes)


def test_cli_data_check_lists_bad_files_and_exits_1(tmp_path, capsys):
    root = make_messy_folder(tmp_path / "d")
    assert main(["data", "check", str(root), "--resolution", "16"]) == 1
    out = capsys.readouterr().out
    assert all(name in out for name in BAD) and "modes:" in out
    assert main(["data", "check", str(root), "--resolution", "16", "--json"]) == 1
    assert set(json.loads(capsys.readouterr().out)["bad"]) == BAD
    for name in BAD:
        (root / name).unlink()
    assert main(["data", "check", str(root), "--resolution", "16"]) == 0


def test_cli_data_check_with_captions_names_images_without_a_usable_caption(tmp_path, capsys):
    root = tmp_path / "d"
    root.mkdir()
    for i in range(3):
        _rgb(seed=i).save(root / f"img{i}.png")
    (root / "img0.txt").write_text("a red disc\n")
    (root / "img1.txt").write_bytes(b"\xff\xfe not utf-8")
    assert main(["data", "check", str(root), "--resolution", "16"]) == 0  # images alone are fine
    capsys.readouterr()
    assert main(["data", "check", str(root), "--resolution", "16", "--captions", "--json"]) == 1
    bad = json.loads(capsys.readouterr().out)["bad"]
    assert set(bad) == {"img1.png", "img2.png"} and all(reason.startswith("caption: ") for reason in bad.values())
    (root / "img1.txt").write_text("a blue square")
    (root / "img2.txt").write_text("")  # an empty caption is a caption
    assert main(["data", "check", str(root), "--resolution", "16", "--captions"]) == 0


def test_scan_is_cached_until_a_file_changes(tmp_path):
    root = make_messy_folder(tmp_path / "d")
    cache = tmp_path / "run" / "data_check.json"
    first, cached = cached_check(root, 16, cache)
    assert not cached
    again, cached = cached_check(root, 16, cache)
    assert cached and again == first
    _rgb(seed=99).save(root / "new.png")
    third, cached = cached_check(root, 16, cache)
    assert not cached and third.num_files == first.num_files + 1


def test_skip_mode_drops_and_logs_bad_files(tmp_path):
    root = make_messy_folder(tmp_path / "d")
    ds = prepare_dataset(ImageFolderDataset(root, 16), "skip", tmp_path / "run")
    assert len(ds) == 10
    names = {p.name for p in ds.paths}
    assert not names & BAD
    log = (tmp_path / "run" / BAD_LOG_NAME).read_text()
    assert all(name in log for name in BAD)
    for i in range(len(ds)):  # every remaining image converts to (3, 16, 16) in [-1, 1]
        x, *_ = ds[i]
        assert x.shape == (3, 16, 16) and x.min() >= -1 and x.max() <= 1


def test_the_scan_gives_the_sizes_and_a_resume_takes_them_from_the_file_list(tmp_path, monkeypatch):
    from difftrain.data import folder

    root = make_messy_folder(tmp_path / "d")
    ds = prepare_dataset(ImageFolderDataset(root, 16), "skip", tmp_path / "run")
    assert dict(zip(ds.files, ds.image_sizes.tolist()))["rotated.jpg"] == [40, 24]  # after EXIF rotation
    saved = json.loads((tmp_path / "run" / "data_files.json").read_text())
    assert saved["sizes"] == ds.image_sizes.tolist() and saved["files"] == ds.files
    (tmp_path / "run" / "checkpoints").mkdir()
    (tmp_path / "run" / "checkpoints" / "step_00000002.pt").write_bytes(b"")  # what makes the next start a resume
    _rgb(seed=20).save(root / "good_9.png")  # added since: the resume keeps the first start's list
    monkeypatch.setattr(folder, "image_size", lambda path: pytest.fail(f"read the header of {path}"))
    resumed = prepare_dataset(ImageFolderDataset(root, 16), "skip", tmp_path / "run")
    assert resumed.files == ds.files and resumed.sizes().tolist() == ds.image_sizes.tolist()


def test_a_file_list_saved_without_sizes_still_resumes(tmp_path):
    """An older run's data_files.json (square crops: no sizes in it) resumes with its files; sizes from the headers."""
    root = make_messy_folder(tmp_path / "d")
    ds = prepare_dataset(ImageFolderDataset(root, 16), "skip", tmp_path / "run")
    listed = tmp_path / "run" / "data_files.json"
    saved = json.loads(listed.read_text())
    del saved["sizes"]
    listed.write_text(json.dumps(saved))
    (tmp_path / "run" / "checkpoints").mkdir()
    (tmp_path / "run" / "checkpoints" / "step_00000002.pt").write_bytes(b"")
    resumed = prepare_dataset(ImageFolderDataset(root, 16), "skip", tmp_path / "run")
    assert resumed.files == ds.files and resumed.image_sizes is None
    assert resumed.sizes().tolist() == ds.image_sizes.tolist()


def test_use_keeps_what_was_read_of_a_selection_and_reads_a_new_list(tmp_path):
    root = tmp_path / "d"
    root.mkdir()
    for i in range(3):
        _rgb(seed=i).save(root / f"{i}.png")
        (root / f"{i}.txt").write_text(f"caption {i}")
    ds = ImageFolderDataset(root, 16, captions=True)
    (root / "0.txt").write_text("changed")  # what was read when the folder was listed is kept
    (root / "1.txt").write_text("caption one")
    ds.use(["0.png", "2.png"], [], sizes=[[24, 24], [24, 24]], shapes=[[16, 16], [16, 16]], stats=[[1, 2], [3, 4]])
    assert ds.files == ["0.png", "2.png"] and ds.targets() == ["caption 0", "caption 2"]
    assert ds.bucket_shapes.tolist() == [[16, 16], [16, 16]] and ds.file_stats == [(1, 2), (3, 4)]
    ds.use(["1.png", "0.png"], [])  # another list (a resume's): 1.png left out before, so read now
    assert ds.targets() == ["caption one", "caption 0"] and ds.bucket_shapes is None and ds.image_sizes is None


def test_fail_mode_names_the_option_and_the_files(tmp_path):
    root = make_messy_folder(tmp_path / "d")
    with pytest.raises(ValueError, match=r"on_bad_image") as e:
        prepare_dataset(ImageFolderDataset(root, 16), "fail", tmp_path / "run")
    assert all(name in str(e.value) for name in BAD)


def test_a_file_that_goes_bad_mid_run_is_replaced_deterministically(tmp_path):
    root = tmp_path / "d"
    root.mkdir()
    for i in range(4):
        _rgb(seed=i).save(root / f"{i}.png")
    ds = prepare_dataset(ImageFolderDataset(root, 16), "skip", tmp_path / "run")
    expected, label, _ = ds[(2, 7)]
    (root / "1.png").write_bytes(b"garbage")  # goes bad after the scan
    got, *_ = ds[(1, 7)]  # the next readable image (2), with this sample's seed
    assert (got == expected).all()
    assert "mid-run\t1.png" in (tmp_path / "run" / BAD_LOG_NAME).read_text()
    ds.on_bad_image = "fail"
    with pytest.raises(OSError, match="1.png"):
        ds[1]


def test_the_scan_runs_in_worker_processes_and_is_reused_by_another_run(tmp_path, monkeypatch):
    """A parallel scan gives the serial report; a second run of the same folder takes the scan
    from the shared cache instead of decoding again, and a changed file scans anew."""
    from difftrain.data import check

    root = make_messy_folder(tmp_path / "d", good=300)  # enough files for the worker pool
    serial = check.check_folder(root, 16)
    parallel = check.check_folder(root, 16, num_workers=2)
    assert parallel == serial and parallel.bad
    monkeypatch.setenv("DIFFTRAIN_CACHE", str(tmp_path / "cache"))
    first, cached = check.cached_check(root, 16, tmp_path / "run1" / check.CACHE_NAME, num_workers=2)
    assert not cached and first == serial
    monkeypatch.setattr(check, "check_folder", lambda *a: pytest.fail("scanned again"))
    second, cached = check.cached_check(root, 16, tmp_path / "run2" / check.CACHE_NAME)
    assert cached and second == first and (tmp_path / "run2" / check.CACHE_NAME).is_file()
    (root / "good_0.png").write_bytes(b"changed")
    with pytest.raises(pytest.fail.Exception, match="scanned again"):
        check.cached_check(root, 16, tmp_path / "run3" / check.CACHE_NAME)


def test_a_folder_that_cannot_be_listed_is_a_bad_entry_of_data_check(tmp_path):
    """A real permission denial: chmod 000, and (as root, who reads everything) the check run
    without the capabilities that bypass file permissions."""
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    root = tmp_path / "d"
    (root / "locked").mkdir(parents=True)
    for i in range(2):
        _rgb(seed=i).save(root / f"{i}.png")
    _rgb(seed=9).save(root / "locked" / "x.png")
    (root / "locked").chmod(0)
    prefix = []
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("running as root, and no setpriv to drop the capabilities that ignore permissions")
        prefix = ["setpriv", "--inh-caps=-all", "--bounding-set=-all"]
    src = str(Path(__file__).resolve().parents[2] / "src")
    cmd = prefix + [sys.executable, "-m", "difftrain", "data", "check", str(root), "--resolution", "16", "--workers", "0"]
    try:
        text = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": src})
        as_json = subprocess.run(cmd + ["--json"], capture_output=True, text=True, env={**os.environ, "PYTHONPATH": src})
    finally:
        (root / "locked").chmod(0o755)
    if text.stderr.startswith("setpriv:"):
        pytest.skip(f"cannot drop capabilities here: {text.stderr.strip()}")
    assert text.returncode == 1, text.stderr
    first = text.stdout.splitlines()[0]
    assert "2 image files, 2 usable, 1 bad" in first, text.stdout
    assert "bad: locked/ (folder, not searched): unreadable folder: Permission denied" in text.stdout
    assert as_json.returncode == 1
    assert json.loads(as_json.stdout)["bad"] == {"locked/": "unreadable folder: Permission denied"}
