"""FID, KID and feature statistics: closed forms, invariants, and the real network end to end."""

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from difftrain.evaluation import (
    FeatureStats,
    InceptionFeatures,
    compare,
    find_inception_weights,
    frechet_distance,
    image_folder_statistics,
    kernel_inception_distance,
    statistics_from_images,
)
from difftrain.evaluation import fid as fid_module


def _random_spd(rng, d, rank=None):
    """A random covariance, full rank unless rank < d."""
    w = rng.standard_normal((d, rank or d)) * rng.uniform(0.2, 2.0, rank or d)
    return w @ w.T / (rank or d) + (0 if rank else 0.05 * np.eye(d))


def _sqrtm_general(a):
    """Square root of a diagonalisable matrix with positive eigenvalues, via eig."""
    w, v = np.linalg.eig(a)
    root = (v * np.sqrt(w.astype(complex))) @ np.linalg.inv(v)
    return root.real


# ---- Frechet distance ------------------------------------------------------------------

def test_frechet_one_dimensional():
    # N(0, 1) vs N(1, 4): 1 + 1 + 4 - 2 * sqrt(1 * 4) = 2
    got = frechet_distance(np.zeros(1), np.eye(1), np.ones(1), 4 * np.eye(1))
    assert got == pytest.approx(2.0)


def test_frechet_against_a_point_mass():
    # A zero covariance has no range: the cross term vanishes, whichever side it is on.
    s = _random_spd(np.random.default_rng(9), 5)
    assert frechet_distance(np.zeros(5), np.zeros((5, 5)), np.ones(5), s) == pytest.approx(
        5 + np.trace(s), rel=1e-12)
    assert frechet_distance(np.ones(5), s, np.zeros(5), np.zeros((5, 5))) == pytest.approx(
        5 + np.trace(s), rel=1e-12)


def test_frechet_diagonal_closed_form():
    rng = np.random.default_rng(0)
    d = 64
    mu1, mu2 = rng.standard_normal(d), rng.standard_normal(d)
    s1, s2 = rng.uniform(0.01, 3, d), rng.uniform(0.01, 3, d)
    expected = np.sum((mu1 - mu2) ** 2) + np.sum(s1 + s2 - 2 * np.sqrt(s1 * s2))
    got = frechet_distance(mu1, np.diag(s1), mu2, np.diag(s2))
    assert got == pytest.approx(expected, rel=1e-10)


def test_frechet_full_covariances_against_direct_sqrtm():
    rng = np.random.default_rng(1)
    d = 48
    mu1, mu2 = rng.standard_normal(d), rng.standard_normal(d)
    a, b = _random_spd(rng, d), _random_spd(rng, d)
    root = _sqrtm_general(a @ b)
    np.testing.assert_allclose(root @ root, a @ b, atol=1e-9)  # the direct route is right
    expected = np.sum((mu1 - mu2) ** 2) + np.trace(a) + np.trace(b) - 2 * np.trace(root)
    assert frechet_distance(mu1, a, mu2, b) == pytest.approx(expected, rel=1e-9)


def test_frechet_singular_covariances_against_low_rank_formula():
    # Fewer samples than dimensions, as with FID on a few hundred 2048-d features. With
    # centred data X (n, d), sigma = X^T X / (n - 1), and tr sqrt(sigma1 sigma2) is the sum of
    # the singular values of X1 X2^T divided by sqrt((n1 - 1)(n2 - 1)).
    rng = np.random.default_rng(2)
    d, n1, n2 = 256, 40, 60
    x1 = rng.standard_normal((n1, d)) * rng.uniform(0.1, 2, d)
    x2 = rng.standard_normal((n2, d)) + 0.3
    c1, c2 = x1 - x1.mean(0), x2 - x2.mean(0)
    nuclear = np.linalg.svd(c1 @ c2.T, compute_uv=False).sum() / np.sqrt((n1 - 1) * (n2 - 1))
    s1, s2 = np.cov(x1, rowvar=False), np.cov(x2, rowvar=False)
    diff = x1.mean(0) - x2.mean(0)
    expected = diff @ diff + np.trace(s1) + np.trace(s2) - 2 * nuclear
    assert frechet_distance(x1.mean(0), s1, x2.mean(0), s2) == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("rank", [None, 30])
def test_frechet_to_itself_is_zero_and_distance_is_symmetric(rank):
    rng = np.random.default_rng(3)
    d = 128
    mu, a = rng.standard_normal(d), _random_spd(rng, d, rank)
    assert abs(frechet_distance(mu, a, mu, a)) < 1e-6
    mu2, b = rng.standard_normal(d), _random_spd(rng, d, rank)
    forward, backward = frechet_distance(mu, a, mu2, b), frechet_distance(mu2, b, mu, a)
    assert forward > 1 and forward == pytest.approx(backward, rel=1e-9)


def test_frechet_retries_with_eps_offset_when_the_decomposition_fails(monkeypatch):
    rng = np.random.default_rng(4)
    d, eps = 8, 1e-3
    s1, s2 = rng.uniform(0.5, 2, d), rng.uniform(0.5, 2, d)
    eigh, calls = torch.linalg.eigh, []

    def fail_once(a):
        calls.append(1)
        if len(calls) == 1:
            raise torch.linalg.LinAlgError("did not converge")
        return eigh(a)

    monkeypatch.setattr(torch.linalg, "eigh", fail_once)
    got = frechet_distance(np.zeros(d), np.diag(s1), np.zeros(d), np.diag(s2), eps=eps)
    # The offset enters only the cross term, as in pytorch-fid.
    expected = np.sum(s1 + s2 - 2 * np.sqrt((s1 + eps) * (s2 + eps)))
    assert len(calls) == 2 and got == pytest.approx(expected, rel=1e-10)


def test_frechet_rejects_bad_inputs():
    eye = np.eye(3)
    with pytest.raises(ValueError, match="shapes"):
        frechet_distance(np.zeros(3), eye, np.zeros(2), np.eye(2))
    with pytest.raises(ValueError, match="positive semi-definite"):
        frechet_distance(np.zeros(3), eye, np.zeros(3), -eye)
    with pytest.raises(ValueError, match="symmetric"):
        frechet_distance(np.zeros(3), np.triu(np.ones((3, 3))), np.zeros(3), eye)
    with pytest.raises(ValueError, match="NaN"):
        frechet_distance(np.full(3, np.nan), eye, np.zeros(3), eye)


# ---- KID -------------------------------------------------------------------------------

def _mmd2_by_loops(x, y):
    """Unbiased MMD^2 with k(a, b) = (a.b / d + 1)^3, written out term by term."""
    d, m = x.shape[1], len(x)
    k = lambda a, b: (a @ b / d + 1) ** 3  # noqa: E731
    xx = sum(k(x[i], x[j]) for i in range(m) for j in range(m) if i != j) / (m * (m - 1))
    yy = sum(k(y[i], y[j]) for i in range(m) for j in range(m) if i != j) / (m * (m - 1))
    xy = sum(k(x[i], y[j]) for i in range(m) for j in range(m)) / (m * m)
    return xx + yy - 2 * xy


def test_kid_matches_the_estimator_written_out():
    rng = np.random.default_rng(5)
    x, y = rng.standard_normal((7, 3)), rng.standard_normal((7, 3)) + 0.5
    # With subset_size = n every subset is the whole set, so the estimate is exact.
    mean, std = kernel_inception_distance(x, y, subset_size=7, num_subsets=3)
    assert mean == pytest.approx(_mmd2_by_loops(x, y), rel=1e-12) and std < 1e-12
    # A subset larger than a set is clipped to the smaller set: here all of both 5-row sets.
    mean5, _ = kernel_inception_distance(x[:5], y[2:], subset_size=100, num_subsets=2, seed=1)
    assert mean5 == pytest.approx(_mmd2_by_loops(x[:5], y[2:]), rel=1e-12)


def test_kid_is_near_zero_for_one_distribution_and_positive_for_two():
    rng = np.random.default_rng(6)
    d = 64
    a, b = rng.standard_normal((600, d)), rng.standard_normal((600, d))
    shifted = rng.standard_normal((600, d)) * 1.2 + 0.3
    same_mean, same_std = kernel_inception_distance(a, b, subset_size=200, num_subsets=50)
    diff_mean, diff_std = kernel_inception_distance(a, shifted, subset_size=200, num_subsets=50)
    assert abs(same_mean) < 0.01 and abs(same_mean) < 3 * same_std
    assert diff_mean > 0.1 and diff_mean > 10 * diff_std
    # torch input and a seed give the same numbers as numpy input.
    again = kernel_inception_distance(torch.from_numpy(a), torch.from_numpy(b),
                                      subset_size=200, num_subsets=50)
    assert again == (same_mean, same_std)


def test_kid_rejects_bad_inputs():
    with pytest.raises(ValueError, match="at least 2"):
        kernel_inception_distance(np.zeros((1, 4)), np.zeros((5, 4)))
    with pytest.raises(ValueError, match="feature sizes"):
        kernel_inception_distance(np.zeros((5, 4)), np.zeros((5, 3)))


# ---- FeatureStats ----------------------------------------------------------------------

def test_streaming_stats_equal_numpy():
    rng = np.random.default_rng(7)
    x = rng.standard_normal((301, 16)) * rng.uniform(0.01, 5, 16) + 1000.0  # large offset
    stats = FeatureStats(dim=16, max_features=0)
    start = 0
    for size in [1, 2, 50, 0, 99, 149]:
        stats.update(x[start:start + size])
        start += size
    assert stats.count == 301 and stats.features is None
    np.testing.assert_allclose(stats.mean, x.mean(axis=0), rtol=1e-13)
    np.testing.assert_allclose(stats.cov, np.cov(x, rowvar=False), rtol=1e-9, atol=1e-12)


def test_kept_features_are_a_uniform_sample_once_the_cap_is_reached():
    x = np.arange(2000, dtype=np.float64)[:, None]  # feature value = position in the stream
    stats = FeatureStats(dim=1, max_features=200, seed=3)
    for start in range(0, 2000, 64):
        stats.update(torch.from_numpy(x[start:start + 64]))
    kept = stats.features[:, 0]
    assert kept.shape == (200,) and len(np.unique(kept)) == 200
    assert set(kept) <= set(x[:, 0])
    assert 0.35 < np.mean(kept < 1000) < 0.65  # not just the first ones
    below_cap = FeatureStats(dim=1, max_features=5000)
    below_cap.update(x)
    np.testing.assert_array_equal(below_cap.features, x.astype(np.float32))


def test_stats_save_load_round_trip_and_resume(tmp_path):
    rng = np.random.default_rng(8)
    x = rng.standard_normal((120, 8))
    stats = FeatureStats(dim=8, max_features=50, metadata={"network": "test", "n": 1})
    stats.update(x[:70])
    path = tmp_path / "ref.stats"  # the name is kept as given
    stats.save(path)
    loaded = FeatureStats.load(path)
    assert path.exists() and loaded.count == 70 and loaded.metadata == {"network": "test", "n": 1}
    np.testing.assert_array_equal(loaded.mean, stats.mean)
    np.testing.assert_allclose(loaded.cov, stats.cov, rtol=1e-15)
    np.testing.assert_array_equal(loaded.features, stats.features)
    with np.load(path) as f:
        assert json.loads(str(f["metadata"]))["network"] == "test"
    loaded.update(x[70:])  # updates continue from the file
    np.testing.assert_allclose(loaded.cov, np.cov(x, rowvar=False), rtol=1e-12)


def test_loaded_sample_stays_a_sample(tmp_path):
    x = np.arange(100.0)[:, None]
    sampled = FeatureStats(dim=1, max_features=10)
    sampled.update(x)
    sampled.save(tmp_path / "sampled.npz")
    sampled.save(tmp_path / "bare.npz", include_features=False)
    again = FeatureStats.load(tmp_path / "sampled.npz")
    assert again.max_features == 10  # not refilled with later features only
    again.update(x)
    assert again.features.shape == (10, 1) and again.count == 200
    bare = FeatureStats.load(tmp_path / "bare.npz")
    bare.update(x)
    assert bare.features is None and bare.count == 200


def test_stats_load_pytorch_fid_file(tmp_path):
    mu, sigma = np.arange(3.0), np.diag([1.0, 2.0, 3.0])
    np.savez(tmp_path / "ref.npz", mu=mu, sigma=sigma)
    loaded = FeatureStats.load(tmp_path / "ref.npz")
    assert loaded.count is None and loaded.features is None
    np.testing.assert_array_equal(loaded.cov, sigma)
    with pytest.raises(ValueError, match="without a count"):
        loaded.update(np.zeros((2, 3)))
    other = FeatureStats(dim=3)
    other.update(np.random.default_rng(0).standard_normal((10, 3)))
    result = compare(loaded, other)
    assert result["count_a"] is None and "kid_mean" not in result


def test_stats_reject_bad_features():
    stats = FeatureStats(dim=4)
    with pytest.raises(ValueError, match=r"\(B, 4\)"):
        stats.update(np.zeros((2, 5)))
    with pytest.raises(ValueError, match="NaN"):
        stats.update(np.full((2, 4), np.inf))
    with pytest.raises(ValueError, match="no features"):
        stats.mean


def test_compare_refuses_stats_made_differently():
    a = FeatureStats(dim=2, metadata={"resize": "bilinear"})
    b = FeatureStats(dim=2, metadata={"resize": "bicubic"})
    for s in (a, b):
        s.update(np.random.default_rng(0).standard_normal((5, 2)))
    with pytest.raises(ValueError, match="resize"):
        compare(a, b)


# ---- With the real network -------------------------------------------------------------

@pytest.fixture(scope="module")
def inception():
    try:
        find_inception_weights()
    except FileNotFoundError as e:
        pytest.skip(f"FID Inception weights not available ({e})")
    return InceptionFeatures()


def synthetic_images(n: int, seed: int, size: int = 32) -> torch.Tensor:
    """(n, 3, size, size) uint8: smooth colour gradients with one coloured disc each."""
    g = torch.Generator().manual_seed(seed)
    background = F.interpolate(torch.rand(n, 3, 2, 2, generator=g), size=(size, size),
                               mode="bilinear", align_corners=True)
    yy, xx = torch.meshgrid(torch.arange(size), torch.arange(size), indexing="ij")
    centre = torch.rand(n, 2, 1, 1, generator=g) * size
    radius = (0.15 + 0.2 * torch.rand(n, 1, 1, generator=g)) * size
    disc = ((yy - centre[:, 0]) ** 2 + (xx - centre[:, 1]) ** 2 < radius ** 2)[:, None]
    colour = torch.rand(n, 3, 1, 1, generator=g)
    images = torch.where(disc, colour, background)
    return (images * 255).round().to(torch.uint8)


def test_features_shape_determinism_and_eval_mode(inception):
    images = synthetic_images(2, seed=0)
    inception.train()
    assert not inception.training and not inception.net.training
    first, second = inception(images), inception(images)
    assert first.shape == (2, 2048) and first.dtype == torch.float32
    assert not first.requires_grad
    torch.testing.assert_close(first, second, rtol=0, atol=0)
    torch.testing.assert_close(inception(images.float()), first)
    gray = images[:, :1]
    torch.testing.assert_close(inception(gray), inception(gray.repeat(1, 3, 1, 1)))


def _fid_halves_versus_noise(inception, n):
    data = synthetic_images(2 * n, seed=1)
    noise = torch.randint(0, 256, (n, 3, 32, 32), generator=torch.Generator().manual_seed(2),
                          dtype=torch.uint8)
    half1 = statistics_from_images(data[:n].split(50), inception)
    half2 = statistics_from_images(data[n:].split(50), inception)
    noisy = statistics_from_images(noise.split(50), inception)
    same, different = compare(half1, half2, subset_size=n), compare(half1, noisy, subset_size=n)
    assert same["count_a"] == same["count_b"] == n
    return same, different


def test_fid_between_halves_is_much_smaller_than_against_noise(inception):
    # 16 images in 2048 dimensions: FID is strongly biased upwards (about 100 here for two
    # samples of one distribution), but noise is still far away (about 400).
    same, different = _fid_halves_versus_noise(inception, n=16)
    assert different["fid"] > 2.5 * same["fid"] > 0
    assert different["kid_mean"] > 10 * abs(same["kid_mean"])


@pytest.mark.slow
def test_fid_between_halves_is_much_smaller_than_against_noise_200(inception):
    same, different = _fid_halves_versus_noise(inception, n=200)
    assert different["fid"] > 10 * same["fid"] > 0
    assert abs(compare(*[statistics_from_images([synthetic_images(50, seed=1)], inception)] * 2,
                       kid=False)["fid"]) < 1e-6
    assert different["kid_mean"] > 50 * abs(same["kid_mean"])


def test_image_folder_statistics_reads_what_statistics_from_images_sees(inception, tmp_path):
    images = synthetic_images(3, seed=3)
    (tmp_path / "sub").mkdir()
    Image.fromarray(images[0].permute(1, 2, 0).numpy()).save(tmp_path / "sub" / "a.PNG")
    Image.fromarray(images[1].permute(1, 2, 0).numpy()).save(tmp_path / "b.bmp")
    Image.fromarray(images[2, 0].numpy()).save(tmp_path / "c.png")  # grayscale file
    Image.fromarray(np.full((40, 20, 3), 200, np.uint8)).save(tmp_path / "d.jpg")  # other size
    (tmp_path / "notes.txt").write_text("not an image")
    (tmp_path / "._b.bmp").write_bytes(b"macOS resource fork")
    (tmp_path / ".cache").mkdir()
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(tmp_path / ".cache" / "hidden.png")
    stats = image_folder_statistics(tmp_path, inception, batch_size=3)
    # Sorted paths: b.bmp, c.png, d.jpg, sub/a.PNG; the JPEG is compared as decoded.
    jpeg = torch.from_numpy(np.array(Image.open(tmp_path / "d.jpg"))).permute(2, 0, 1)
    expected_images = [images[1], images[2, :1].repeat(3, 1, 1), jpeg, images[0]]
    expected = statistics_from_images([im[None] for im in expected_images], inception)
    assert stats.count == 4 and stats.metadata["num_images"] == 4
    np.testing.assert_allclose(stats.features, expected.features, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(stats.mean, expected.mean, rtol=1e-5, atol=1e-6)
    assert stats.metadata["resize"] == inception.metadata["resize"]


def test_sixteen_bit_images_are_refused_not_clipped(tmp_path):
    Image.fromarray(np.full((4, 4), 4000, np.uint16)).save(tmp_path / "deep.png")
    with pytest.raises(ValueError, match="16/32-bit"):
        fid_module._ImageFiles([tmp_path / "deep.png"])[0]


def test_image_folder_statistics_needs_images(inception, tmp_path):
    with pytest.raises(ValueError, match="holds 0 images"):
        image_folder_statistics(tmp_path, inception)
    with pytest.raises(FileNotFoundError):
        image_folder_statistics(tmp_path / "missing", inception)
    assert fid_module.IMAGE_EXTENSIONS == (".png", ".jpg", ".jpeg", ".webp", ".bmp")
