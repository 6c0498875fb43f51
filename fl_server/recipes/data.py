"""A recipe's data: the user's arrays, an image folder, a torch ``Dataset`` or a built-in data set, as raw images
(the recipe's :class:`~edge_sdk._preprocess.Preprocess` turns them into the model's input, on the server as on
the device).

>>> import numpy as np
>>> from fl_server.recipes import DataSpec
>>> data = DataSpec.from_arrays(np.zeros((6, 8, 8, 1), np.uint8), np.array([0, 1, 2, 0, 1, 2]), layout="NHWC")
>>> data.num_classes, data.sample_shape
(3, (8, 8, 1))
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from edge_sdk import Preprocess
from edge_sdk.shared import LAYOUTS, RawInput, channel_values
from fl_server.data import ArrayDataset, load_dataset
from fl_server.data.federated import FederatedData
from fl_server.recipes.errors import RecipeError

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")
WIDE_MODES = ("I;16", "I;16B", "I;16L", "I;16N", "I", "F")  # Pillow modes of 16-bit and float pixels
# (C, H, W) and classes of the built-in data sets: a recipe is checked without loading them
BUILTINS: dict[str, tuple[tuple[int, int, int], int]] = {
    "digits": ((1, 8, 8), 10), "mnist": ((1, 28, 28), 10), "fashion_mnist": ((1, 28, 28), 10),
    "cifar10": ((3, 32, 32), 10)}
# the value ranges a raw float image set is recorded with (the first that holds all its values; none: unchecked)
NOMINAL_RANGES = ((0.0, 1.0), (-1.0, 1.0), (0.0, 255.0))


@dataclass(frozen=True, eq=False)
class DataSpec:
    """Labelled raw images. Build it with :meth:`from_arrays`, :meth:`from_image_folder`, :meth:`from_torch` or
    :meth:`builtin`. ``x``: a batch in ``layout`` (a list of single images when an image folder's sizes differ),
    ``client_ids``: the natural partition (one client id per sample) or None."""

    name: str
    layout: str = "NCHW"
    x: Any = None
    y: np.ndarray | None = None
    client_ids: np.ndarray | None = None
    classes: tuple[str, ...] | None = None
    builtin_name: str | None = None
    split: str = "all"
    data_dir: str | None = None
    _cache: dict[str, ArrayDataset] = field(default_factory=dict, repr=False)

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_arrays(cls, x: Any, y: Any, client_ids: Any = None, layout: str = "NHWC",
                    name: str = "arrays", classes: Sequence[str] | None = None) -> "DataSpec":
        """Images ``x`` (uint8 or float; ``[N, H, W, C]`` for NHWC, ``[N, C, H, W]`` for NCHW, ``[N, H, W]`` for
        one channel) with integer labels ``y`` [N] in 0..K-1, each class with a sample unless ``classes`` names
        every class; ``client_ids`` [N]: which client holds each sample."""
        if layout not in LAYOUTS:
            raise RecipeError(f"data: layout must be 'NHWC' or 'NCHW', got {layout!r}")
        images = x if isinstance(x, list) else np.asarray(x)
        labels = np.asarray(y)
        n = len(images)
        if labels.ndim != 1 or labels.dtype.kind not in "iu" or len(labels) != n:
            raise RecipeError(f"data: labels must be integers, one per image ({n}), got an array of "
                              f"{labels.dtype} with shape {list(labels.shape)}")
        if n == 0:
            raise RecipeError("data: no samples")
        if labels.min() < 0:
            raise RecipeError(f"data: labels must be 0..K-1, got {int(labels.min())}")
        batch = [np.asarray(im)[None] for im in images] if isinstance(images, list) else [images]
        for arr in batch:
            if arr.dtype.kind not in "uif":
                raise RecipeError(f"data: images must be uint8 or float arrays, got dtype {arr.dtype}")
        finite = np.concatenate([np.isfinite(a.reshape(len(a), -1)).all(axis=1) for a in batch])
        if not finite.all():
            bad = np.flatnonzero(~finite)
            raise RecipeError(f"data: {len(bad)} image(s) hold NaN or infinite values (first: sample {bad[0]}); "
                              f"drop or repair them before building the recipe")
        if (layout == "NHWC" and not isinstance(images, list) and images.ndim == 4 and images.shape[3] > 4
                and images.shape[1] in (1, 3) and images.shape[2] > 1):  # [N, 1, 1, D]: D features, as NHWC
            raise RecipeError(f"data: images of shape {list(images.shape)} read as NHWC would have "
                              f"{images.shape[3]} channels; they look like [N, C, H, W]: pass layout='NCHW'")
        if not isinstance(images, list) and images.ndim == 2:
            raise RecipeError(f"data: the samples are vectors of shape {list(images.shape)}, and the models take "
                              f"images: pass them as 1x1 images with a channel per feature, x.reshape(N, 1, 1, D) "
                              f"(layout NHWC; Preprocess(mean=..., std=...) then normalises each feature)")
        if not isinstance(images, list) and images.ndim not in (3, 4):
            raise RecipeError(f"data: images must be [N, H, W, C] or [N, C, H, W] ({layout}) or [N, H, W], got "
                              f"shape {list(images.shape)}")
        ids = None
        if client_ids is not None:
            ids = np.asarray(client_ids)
            if ids.shape != (n,):
                raise RecipeError(f"data: client_ids must give one client per sample ({n}), got shape "
                                  f"{list(ids.shape)}")
        num_classes = int(labels.max()) + 1
        if classes is not None and len(classes) < num_classes:
            raise RecipeError(f"data: {len(classes)} class names for labels up to {num_classes - 1}; name every "
                              f"class, one name per label 0..K-1")
        empty = np.flatnonzero(np.bincount(labels, minlength=num_classes) == 0)
        if classes is None and len(empty):  # labels 1..K, or gaps: outputs never trained, chance read as 1/K
            shown = ", ".join(str(int(c)) for c in empty[:5]) + (", ..." if len(empty) > 5 else "")
            raise RecipeError(f"data: labels 0..{num_classes - 1} leave {len(empty)} class(es) without a sample "
                              f"({shown}), so the model would learn {num_classes} outputs; relabel them 0..K-1 "
                              f"(np.unique(y, return_inverse=True)[1]) or, to keep classes absent from this data, "
                              f"name every class (classes=[...])")
        return cls(name=name, layout=layout, x=images, y=labels.astype(np.int64), client_ids=ids,
                   classes=None if classes is None else tuple(classes))

    @classmethod
    def from_image_folder(cls, path: str | Path, client_ids: Any = None) -> "DataSpec":
        """One subfolder per class (sorted names are labels 0..K-1), PNG/JPEG files (sorted) read with Pillow:
        grayscale stays one channel, anything else becomes RGB. Layout NHWC, uint8. Needs Pillow (the
        ``images`` extra: ``pip install 'fl-edge[images]'``; serving and training on arrays do not)."""
        try:
            from PIL import Image, UnidentifiedImageError
        except ImportError:
            raise RecipeError("data: reading an image folder needs Pillow; pip install 'fl-edge[images]' "
                              "(or Pillow)") from None

        root = Path(path)
        if not root.is_dir():
            raise RecipeError(f"data: image folder {root} does not exist or is not a directory")
        folders = sorted(p for p in root.iterdir() if p.is_dir())
        if not folders:
            raise RecipeError(f"data: image folder {root} has no class subfolders; put each class's images in "
                              f"a subfolder named after the class")
        images: list[np.ndarray] = []
        labels: list[int] = []
        for label, folder in enumerate(folders):
            files = sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
            if not files:
                raise RecipeError(f"data: class folder {folder} holds no PNG/JPEG images; add images or remove "
                                  f"the folder")
            for file in files:
                try:
                    with Image.open(file) as im:
                        im.load()
                        mode = im.mode
                        arr = np.asarray(im if im.mode in ("L", "RGB") else im.convert("RGB"))
                except (UnidentifiedImageError, OSError, ValueError) as exc:
                    raise RecipeError(f"data: cannot read image {file} ({type(exc).__name__}); replace or remove "
                                      f"it") from None
                if mode in WIDE_MODES:  # convert("RGB") would clip them to 0..255
                    raise RecipeError(f"data: image {file} has {mode} pixels (16-bit or float), which 8-bit images "
                                      f"would clip; convert the folder to 8-bit PNG/JPEG or load the pixels with "
                                      f"DataSpec.from_arrays")
                images.append(arr if arr.ndim == 3 else arr[:, :, None])
                labels.append(label)
        if len({im.shape[2] for im in images}) > 1:  # a mix of grayscale and colour images: all RGB
            images = [np.repeat(im, 3, axis=2) if im.shape[2] == 1 else im for im in images]
        same = len({im.shape for im in images}) == 1
        return cls.from_arrays(np.stack(images) if same else images, np.array(labels), client_ids, layout="NHWC",
                               name=root.name, classes=tuple(f.name for f in folders))

    @classmethod
    def from_torch(cls, dataset: Any, client_ids: Any = None, layout: str = "NCHW",
                   classes: Sequence[str] | None = None) -> "DataSpec":
        """A map-style ``torch.utils.data.Dataset`` of ``(image, label)``: tensors and numpy images in ``layout``
        (torchvision's tensors are CHW: NCHW), PIL images as HWC; ``classes``: every class's name, as
        :meth:`from_arrays`."""
        images, labels = [], []
        pil_seen = False
        for i in range(len(dataset)):
            img, label = dataset[i]
            if hasattr(img, "getbands"):  # a PIL image
                pil_seen = True
                img = np.asarray(img)
            elif hasattr(img, "detach"):
                img = img.detach().cpu().numpy()
            images.append(np.asarray(img))
            labels.append(int(label))
        if pil_seen:
            layout = "NHWC"
        same = len({im.shape for im in images}) == 1
        return cls.from_arrays(np.stack(images) if same else images, np.array(labels, np.int64), client_ids,
                               layout=layout, name=type(dataset).__name__, classes=classes)

    @classmethod
    def builtin(cls, name: str, data_dir: str | None = None, split: str = "all") -> "DataSpec":
        """A built-in data set (``digits`` needs no download; ``mnist``, ``fashion_mnist``, ``cifar10`` are read
        from ``data_dir``, else ``$FL_DATA_DIR``): float32 NCHW in [0, 1], loaded when first used."""
        key = name.strip().lower().replace("-", "_")
        if key not in BUILTINS:
            raise RecipeError(f"data: unknown built-in data set {name!r}; choose one of {', '.join(BUILTINS)}")
        return cls(name=key, layout="NCHW", builtin_name=key, split=split, data_dir=data_dir)

    # ------------------------------------------------------------------ properties
    @property
    def num_classes(self) -> int:
        if self.builtin_name:
            return BUILTINS[self.builtin_name][1]
        return len(self.classes) if self.classes is not None else int(self.y.max()) + 1  # type: ignore[union-attr]

    @property
    def sample_shape(self) -> tuple[int, ...] | None:
        """One raw image's shape in ``layout``; None when an image folder's sizes differ."""
        if self.builtin_name:
            return BUILTINS[self.builtin_name][0]
        if isinstance(self.x, list):
            return None
        return tuple(int(s) for s in self.x.shape[1:])

    def default_preprocess(self) -> Preprocess:
        """``layout`` as given, uint8 scaled to [0, 1], floats as they are."""
        uint8 = not self.builtin_name and np.asarray(self.x[0]).dtype == np.uint8
        return Preprocess(layout=self.layout, scale=1 / 255 if uint8 else 1.0)

    def raw_input(self, preprocess: Preprocess) -> RawInput:
        """What raw images this data holds (the bundle's ``preprocess.raw``, checked on the device): dtype; range:
        an integer dtype's own (uint8: [0, 255]), for floats the first of :data:`NOMINAL_RANGES` holding every
        value (built-in sets: float32 in [0, 1]); one image's shape, the axes ``preprocess`` resizes left free."""
        value_range: tuple[float, float] | None = (0.0, 1.0)
        if self.builtin_name:
            dtype, shape = "float32", BUILTINS[self.builtin_name][0]
        else:
            images = self.x if isinstance(self.x, list) else [self.x]
            kind = np.asarray(images[0]).dtype
            if kind.kind in "iu":
                value_range = (float(np.iinfo(kind).min), float(np.iinfo(kind).max))
            else:
                lo, hi = min(float(np.min(im)) for im in images), max(float(np.max(im)) for im in images)
                value_range = next(((a, b) for a, b in NOMINAL_RANGES if a <= lo and hi <= b), None)
            dtype, shape = kind.name, self.sample_shape  # None: sizes differ (resized to one)
        if shape is not None and preprocess.size is not None:  # any height and width: resized on the device
            hw = (0, 1) if len(shape) == 2 or self.layout == "NHWC" else (1, 2)
            shape = tuple(None if i in hw else s for i, s in enumerate(shape))
        moments = None if value_range is not None else self._channel_moments()
        return RawInput(dtype, value_range, shape, moments)

    def _channel_moments(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """Each channel's mean and standard deviation over every raw value (two passes in float64, a block of
        images at a time): a device compares a batch's scale with them where no value range tells raw from
        normalised data (:meth:`RawInput.check`)."""
        x = self.x
        blocks = [channel_values(b, self.layout) for b in  # views, no copies
                  ([np.asarray(im)[None] for im in x] if isinstance(x, list) else
                   [np.asarray(x)[i:i + 4096] for i in range(0, len(x), 4096)])]
        count = sum(len(b) for b in blocks)
        mean = sum(b.sum(0, dtype=np.float64) for b in blocks) / count
        square = sum(((b - mean) ** 2).sum(0) for b in blocks)
        return tuple(float(v) for v in mean), tuple(float(v) for v in np.sqrt(square / count))

    def describe(self) -> dict[str, Any]:
        """JSON facts for run records and manifests."""
        return {"name": self.name, "builtin": self.builtin_name, "split": self.split, "layout": self.layout,
                "classes": None if self.classes is None else list(self.classes),
                "natural_partition": self.client_ids is not None}

    # ------------------------------------------------------------------ materialise
    def dataset(self, preprocess: Preprocess, data_root: str | None = None) -> ArrayDataset:
        """The preprocessed data set (float32 NCHW), cached per preprocessing."""
        key = f"{preprocess.to_dict()}|{data_root}"
        if key not in self._cache:
            if self.builtin_name:
                ds = load_dataset(self.builtin_name, root=data_root or self.data_dir, split=self.split)
                x = ds.x if preprocess.is_identity else preprocess.apply(ds.x)
                self._cache[key] = ArrayDataset(ds.name, x, ds.y, ds.num_classes)
            else:
                x = (preprocess.apply(self.x) if not isinstance(self.x, list)
                     else np.concatenate([preprocess.apply(im[None]) for im in self.x]))
                self._cache[key] = ArrayDataset(self.name, x, self.y, self.num_classes)  # type: ignore[arg-type]
        return self._cache[key]


def new_clients_identity(fed: FederatedData) -> dict[str, Any]:
    """``run.json``'s ``new_clients`` (copied into the bundle's manifest): how many new clients and samples the
    run held out, and a sha256 of every new client's samples as the run saw them (preprocessed) and their labels,
    client by client. ``fl-server device-data`` rebuilds the clients and refuses unless it matches, so a changed
    recipe or other data never hands out a different split (training samples) as new clients."""
    h = hashlib.sha256(repr(tuple(fed.dataset.x.shape[1:])).encode())
    for c in fed.new:
        h.update(np.int64(len(c)).tobytes())
        h.update(np.ascontiguousarray(fed.dataset.x[c], dtype="<f4").tobytes())
        h.update(fed.dataset.y[c].astype("<i8").tobytes())
    return {"clients": len(fed.new), "samples": int(sum(len(c) for c in fed.new)), "sha256": h.hexdigest()}
