"""Datasets (COCO JSON, YOLO, Pascal VOC, CSV), the dataset catalog, transforms and augmentation pipelines,
samplers and loaders."""
from pet.data import mixing  # noqa: F401 - registers Mosaic, MixUp and CopyPaste in AUGMENTATIONS
from pet.data.augmentations import AUGMENTATIONS
from pet.data.build import build_label_space, build_test_loader, build_train_loader, collate_batch
from pet.data.catalog import (
    data_root,
    dataset_categories,
    get_dataset,
    list_datasets,
    register_coco_dataset,
    register_custom_datasets,
    register_dataset,
)
from pet.data.categories import LabelSpace, coco_categories
from pet.data.coco_json import COCODataset, load_coco_json
from pet.data.dataset import DetectionDataset, read_image
from pet.data.mapper import AugmentedMapper, DatasetMapper, build_augmentations, build_mapper
from pet.data.shapes import SHAPE_CLASSES, generate_shapes

__all__ = [
    "build_train_loader", "build_test_loader", "build_label_space", "collate_batch", "data_root", "get_dataset",
    "dataset_categories", "list_datasets", "register_coco_dataset", "register_custom_datasets", "register_dataset",
    "COCODataset", "DetectionDataset", "LabelSpace", "coco_categories", "load_coco_json", "read_image",
    "DatasetMapper", "AugmentedMapper", "AUGMENTATIONS", "build_augmentations", "build_mapper", "SHAPE_CLASSES",
    "generate_shapes",
]
