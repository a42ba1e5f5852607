"""Evaluation: FID and KID with the standard FID Inception-v3, and feature statistics files."""

from .fid import (
    IMAGE_EXTENSIONS,
    compare,
    frechet_distance,
    image_folder_statistics,
    kernel_inception_distance,
    list_images,
    statistics_from_images,
)
from .inception import (
    WEIGHTS_ENV_VAR,
    InceptionFeatures,
    find_inception_weights,
    preprocess_for_inception,
)
from .stats import FeatureStats

__all__ = [
    "IMAGE_EXTENSIONS",
    "WEIGHTS_ENV_VAR",
    "FeatureStats",
    "InceptionFeatures",
    "compare",
    "find_inception_weights",
    "frechet_distance",
    "image_folder_statistics",
    "kernel_inception_distance",
    "list_images",
    "preprocess_for_inception",
    "statistics_from_images",
]
