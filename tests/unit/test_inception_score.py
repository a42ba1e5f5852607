"""Inception Score: the formula on closed-form cases, and the classifier network's layout."""

import math

import pytest
import torch

from difftrain.evaluation.inception import (
    InceptionFeatures,
    find_inception_weights,
    preprocess_for_inception,
)
from difftrain.evaluation.inception_score import (
    InceptionClassifier,
    images_inception_score,
    inception_score,
)

# ---- The formula --------------------------------------------------------------------------


def test_uniform_predictions_score_one():
    mean, std = inception_score(torch.full((20, 1008), 1 / 1008), splits=4)
    assert mean == pytest.approx(1.0, abs=1e-12) and std == pytest.approx(0.0, abs=1e-12)


def test_distinct_one_hot_predictions_score_their_number():
    probs = torch.eye(10)
    assert inception_score(probs, splits=1) == pytest.approx((10.0, 0.0))
    assert inception_score(probs, splits=2) == pytest.approx((5.0, 0.0))  # 5 per split
    # The same class everywhere: p(y|x) = p(y), KL = 0.
    assert inception_score(torch.eye(10)[[3] * 6], splits=2) == pytest.approx((1.0, 0.0))


def test_hand_computed_case():
    probs = torch.tensor([[1.0, 0.0], [0.5, 0.5]])  # p(y) = (0.75, 0.25)
    kl_1 = math.log(1 / 0.75)
    kl_2 = 0.5 * math.log(0.5 / 0.75) + 0.5 * math.log(0.5 / 0.25)
    mean, std = inception_score(probs, splits=1)
    assert mean == pytest.approx(math.exp((kl_1 + kl_2) / 2), rel=1e-12)  # about 1.2408
    assert std == 0.0


def test_splits_are_contiguous_parts_and_std_is_population():
    # N=7, 3 splits -> rows [0, 2), [2, 4), [4, 7): scores 1, 2 and 3.
    probs = torch.eye(4)[[0, 0, 1, 2, 1, 2, 3]]
    mean, std = inception_score(probs, splits=3)
    assert mean == pytest.approx(2.0) and std == pytest.approx(math.sqrt(2 / 3))


def test_formula_input_checks():
    with pytest.raises(ValueError, match="splits"):
        inception_score(torch.eye(3), splits=4)
    with pytest.raises(ValueError, match="sum to 1"):
        inception_score(torch.ones(4, 3), splits=1)
    with pytest.raises(ValueError, match="N, K"):
        inception_score(torch.ones(4), splits=1)


# ---- The network --------------------------------------------------------------------------

# From pytorch-fid's FID Inception (torchvision's Inception3 with num_classes=1008,
# aux_logits=False and the FID blocks): representative keys of pt_inception-2015-12-05.
EXPECTED_SHAPES = {
    "Conv2d_1a_3x3.conv.weight": (32, 3, 3, 3),
    "Conv2d_1a_3x3.bn.running_var": (32,),
    "Conv2d_2a_3x3.conv.weight": (32, 32, 3, 3),
    "Conv2d_2b_3x3.conv.weight": (64, 32, 3, 3),
    "Conv2d_3b_1x1.conv.weight": (80, 64, 1, 1),
    "Conv2d_4a_3x3.conv.weight": (192, 80, 3, 3),
    "Mixed_5b.branch1x1.conv.weight": (64, 192, 1, 1),
    "Mixed_5b.branch5x5_1.conv.weight": (48, 192, 1, 1),
    "Mixed_5b.branch5x5_2.conv.weight": (64, 48, 5, 5),
    "Mixed_5b.branch3x3dbl_3.conv.weight": (96, 96, 3, 3),
    "Mixed_5b.branch_pool.conv.weight": (32, 192, 1, 1),
    "Mixed_5c.branch_pool.conv.weight": (64, 256, 1, 1),
    "Mixed_5d.branch1x1.conv.weight": (64, 288, 1, 1),
    "Mixed_6a.branch3x3.conv.weight": (384, 288, 3, 3),
    "Mixed_6a.branch3x3dbl_3.conv.weight": (96, 96, 3, 3),
    "Mixed_6b.branch7x7_2.conv.weight": (128, 128, 1, 7),
    "Mixed_6b.branch7x7_3.conv.weight": (192, 128, 7, 1),
    "Mixed_6b.branch7x7dbl_2.conv.weight": (128, 128, 7, 1),
    "Mixed_6c.branch7x7dbl_1.conv.weight": (160, 768, 1, 1),
    "Mixed_6d.branch7x7_1.conv.weight": (160, 768, 1, 1),
    "Mixed_6e.branch7x7dbl_5.conv.weight": (192, 192, 1, 7),
    "Mixed_6e.branch_pool.conv.weight": (192, 768, 1, 1),
    "Mixed_7a.branch3x3_2.conv.weight": (320, 192, 3, 3),
    "Mixed_7a.branch7x7x3_4.conv.weight": (192, 192, 3, 3),
    "Mixed_7b.branch1x1.conv.weight": (320, 1280, 1, 1),
    "Mixed_7b.branch3x3_2a.conv.weight": (384, 384, 1, 3),
    "Mixed_7b.branch3x3dbl_1.conv.weight": (448, 1280, 1, 1),
    "Mixed_7c.branch3x3dbl_3b.conv.weight": (384, 384, 3, 1),
    "Mixed_7c.branch_pool.conv.weight": (192, 2048, 1, 1),
    "Mixed_7c.branch_pool.bn.bias": (192,),
    "fc.weight": (1008, 2048),
    "fc.bias": (1008,),
}
TOP_LEVEL = ["Conv2d_1a_3x3", "Conv2d_2a_3x3", "Conv2d_2b_3x3", "Conv2d_3b_1x1", "Conv2d_4a_3x3",
             "Mixed_5b", "Mixed_5c", "Mixed_5d", "Mixed_6a", "Mixed_6b", "Mixed_6c", "Mixed_6d",
             "Mixed_6e", "Mixed_7a", "Mixed_7b", "Mixed_7c", "fc"]
CONVS_PER_BLOCK = {"Mixed_5b": 7, "Mixed_6a": 4, "Mixed_6b": 10, "Mixed_7a": 6, "Mixed_7b": 9}
# torchvision documents 27,161,264 parameters for inception_v3 (1000 classes, with the aux
# classifier: 98,560 + 2,459,136 + 769,000 = 3,326,696); without it and with 1008 classes
# (+ 8 * 2048 + 8): 27,161,264 - 3,326,696 + 16,392.
NUM_PARAMETERS = 23_850_960


@pytest.fixture(scope="module")
def random_weights(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("inception") / "pt_inception-random.pth"
    torch.save(InceptionClassifier().state_dict(), path)
    return path


def test_state_dict_layout_is_pt_inception():
    net = InceptionClassifier()
    state = net.state_dict()
    for key, shape in EXPECTED_SHAPES.items():
        assert tuple(state[key].shape) == shape, key
    assert list(dict.fromkeys(k.split(".")[0] for k in state)) == TOP_LEVEL
    assert not any("AuxLogits" in k for k in state)
    for block, n in CONVS_PER_BLOCK.items():
        assert sum(k.startswith(block + ".") and k.endswith("conv.weight") for k in state) == n
    assert sum(k.endswith("conv.weight") for k in state) == 94
    assert all(".conv.bias" not in k for k in state)  # convolutions have no bias
    assert sum(p.numel() for p in net.parameters()) == NUM_PARAMETERS
    assert all(m.eps == 1e-3 for m in net.modules() if isinstance(m, torch.nn.BatchNorm2d))


def test_random_weights_load_back_and_give_probabilities(random_weights):
    net = InceptionClassifier.from_path(random_weights)
    saved = torch.load(random_weights)
    assert all(torch.equal(v, saved[k]) for k, v in net.state_dict().items())
    images = torch.randint(0, 256, (2, 3, 32, 32), generator=torch.Generator().manual_seed(0),
                           dtype=torch.uint8)
    probs = net(images)
    assert probs.shape == (2, 1008) and (probs >= 0).all()
    torch.testing.assert_close(probs.sum(1), torch.ones(2), atol=1e-5, rtol=0)
    logits = net.logits(torch.zeros(1, 3, 299, 299))
    with_bias = _logits_with_bias(net, torch.zeros(1, 3, 299, 299))
    torch.testing.assert_close(with_bias - logits, net.fc.bias[None])
    # num_batches_tracked is optional in the file (older torch versions did not save it).
    trimmed = random_weights.parent / "trimmed.pth"
    torch.save({k: v for k, v in saved.items() if "num_batches" not in k}, trimmed)
    InceptionClassifier.from_path(trimmed)


def _logits_with_bias(net, x):
    """The classifier's logits with fc.bias added."""
    return torch.nn.functional.linear(net.features(x), net.fc.weight, net.fc.bias)


def test_images_inception_score_batches_nhwc(random_weights):
    net = InceptionClassifier.from_path(random_weights, use_fc_bias=True)
    g = torch.Generator().manual_seed(1)
    images = torch.randint(0, 256, (4, 24, 20, 3), generator=g, dtype=torch.uint8)
    with torch.no_grad():  # random features are tiny (~1e-8): scale the head to make
        # predictions that differ between images, so the score is not ~1
        feats = net.features(preprocess_for_inception(images.permute(0, 3, 1, 2)))
        scale = feats.std(0).norm()  # size of the differences between images
        net.fc.weight.copy_(torch.randn(1008, 2048, generator=g) * 3 / scale)
    mean, std, n = images_inception_score(images, net, batch_size=3, splits=2)
    expected = inception_score(net(images.permute(0, 3, 1, 2)), splits=2)
    assert n == 4 and (mean, std) == pytest.approx(expected, abs=1e-4)
    assert mean > 1.01
    gray = images[..., :1]
    assert images_inception_score(gray, net, splits=1)[0] == pytest.approx(
        inception_score(net(gray.permute(0, 3, 1, 2)), splits=1)[0], rel=1e-5)


def test_wrong_files_give_one_line_naming_them(tmp_path):
    bogus = tmp_path / "bogus.pth"
    bogus.write_bytes(b"not a state dict")
    with pytest.raises(ValueError, match="bogus.pth is not a PyTorch state dict") as err:
        InceptionClassifier.from_path(bogus)
    assert "\n" not in str(err.value)
    wrong = tmp_path / "wrong.pth"
    state = InceptionClassifier().state_dict()
    state["fc.weight"] = torch.zeros(1000, 2048)  # torchvision's 1000-way head
    state["AuxLogits.fc.weight"] = torch.zeros(1000, 768)
    torch.save(state, wrong)
    with pytest.raises(ValueError, match=r"wrong.pth .*unexpected 1 keys.*wrong shape in 1 keys "
                                         r"\(e.g. fc.weight\)") as err:
        InceptionClassifier.from_path(wrong)
    assert "\n" not in str(err.value)
    try:
        torchscript = find_inception_weights()
    except FileNotFoundError:
        torchscript = None
    if torchscript is not None:
        with pytest.raises(ValueError, match="is a TorchScript file") as err:
            InceptionClassifier.from_path(torchscript)
        assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="is_inception_path.*missing.pth"):
        InceptionClassifier.from_path(tmp_path / "missing.pth")


def test_features_match_the_fid_network_with_its_weights():
    """Our architecture with the FID TorchScript's convolutions gives its pool3 features."""
    try:
        find_inception_weights()
    except FileNotFoundError as e:
        pytest.skip(f"FID Inception weights not available: {e}")
    scripted = InceptionFeatures()
    layers = [m for m in scripted.net.modules() if m.original_name == "Conv2dLayer"]
    net = InceptionClassifier()
    ours = [m for m in net.modules() if type(m).__name__ == "BasicConv2d"]
    assert len(ours) == len(layers) == 94
    with torch.no_grad():
        for mine, theirs in zip(ours, layers):  # both in the network's definition order
            assert mine.conv.weight.shape == theirs.weight.shape
            mine.conv.weight.copy_(theirs.weight)
            mine.bn.weight.fill_(1.0)  # TF's batch norm here has no scale
            mine.bn.bias.copy_(theirs.beta)
            mine.bn.running_mean.copy_(theirs.mean)
            mine.bn.running_var.copy_(theirs.var)
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (2, 3, 40, 36), generator=g, dtype=torch.uint8)
    with torch.no_grad():
        got = net.features(preprocess_for_inception(images))
    expected = scripted(images)
    assert expected.abs().max() > 0.5
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
