"""Common image corruptions for test-time-adaptation benchmarks (CIFAR-10-C style).

Re-implementation, in numpy + scipy only, of the corruptions of
Hendrycks & Dietterich, "Benchmarking Neural Network Robustness to Common
Corruptions and Perturbations", ICLR 2019 (CIFAR-10-C), using the severity
parameters of the public CIFAR generator (``make_cifar_c.py``).

Implemented (14 of 15): gaussian_noise, shot_noise, impulse_noise, defocus_blur,
glass_blur, motion_blur, zoom_blur, snow, fog, brightness, contrast,
elastic_transform, pixelate, jpeg_compression.  ``frost`` is not implemented:
it blends in photographs of frost that are not part of this package, and a
procedural stand-in would not reproduce its distribution.

Images are float arrays shaped [N, C, H, W] in [0, 1] with C in {1, 3}.
Parameters given in pixels (blur radii, sigmas, offsets) are tuned for 32x32
and are multiplied by ``min(H, W) / 32`` so 28x28 MNIST gets the same relative
strength.  Grayscale images get the single-channel equivalent of RGB-defined
operations (HSV value == intensity, luma == intensity).

Deviations from the reference code (which relies on PIL / OpenCV / ImageMagick):
* glass_blur: the sequential per-pixel swap loop is replaced by a vectorised
  random gather from the same offset range (no long swap chains).
* jpeg_compression: baseline JPEG in float (YCbCr, 4:2:0 chroma with box
  down- and libjpeg-style triangle up-sampling, 8x8 orthonormal DCT,
  IJG-scaled standard tables); entropy coding is lossless and omitted, and
  there is no uint8 rounding.
* defocus_blur: the 32x32 reference disk kernel is rendered at the target
  scale with bilinear splatting (identical to the reference at 32x32).
* No uint8 / PNG quantisation between steps.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable

import numpy as np
from scipy import fft, ndimage

__all__ = ["CORRUPTIONS", "corrupt", "corrupt_dataset"]

Array = np.ndarray
Rng = np.random.Generator

# ---------------------------------------------------------------- helpers


def _scale(x: Array) -> float:
    """Pixel-parameter scale relative to the 32x32 CIFAR reference."""
    return min(x.shape[-2:]) / 32.0


def _luma(x: Array) -> Array:
    """ITU-R 601 luma [N,1,H,W]; the image itself for grayscale."""
    if x.shape[1] == 1:
        return x
    w = np.array([0.299, 0.587, 0.114]).reshape(1, 3, 1, 1)
    return (x * w).sum(axis=1, keepdims=True)


def _gaussian(x: Array, sigma: float, mode: str = "nearest", truncate: float = 4.0) -> Array:
    """Spatial Gaussian blur of every [H, W] plane (skimage.filters.gaussian defaults)."""
    if sigma <= 0:
        return x.copy()
    return ndimage.gaussian_filter(x, sigma=(0, 0, sigma, sigma), mode=mode, truncate=truncate)


def _zoom_matrix(n: int, zoom: float) -> Array:
    """[n, n] linear map of the reference ``clipped_zoom`` along one axis.

    Centre-crop ceil(n / zoom) samples, ``scipy.ndimage.zoom`` them (order 1),
    trim back to n.  Bilinear zoom is separable, so 2-D = Zh @ img @ Zw.T.
    """
    crop_n = int(np.ceil(n / zoom))
    top = (n - crop_n) // 2
    out = ndimage.zoom(np.eye(n)[top:top + crop_n], (zoom, 1), order=1)
    trim = (out.shape[0] - n) // 2
    return out[trim:trim + n]


def _clipped_zoom(x: Array, zoom: float) -> Array:
    """Zoom into the centre by ``zoom`` (bilinear), cropping back to [H, W]."""
    h, w = x.shape[-2:]
    return _zoom_matrix(h, zoom) @ x @ _zoom_matrix(w, zoom).T


def _motion_blur(x: Array, radius: float, sigma: float, angles: Array) -> Array:
    """ImageMagick-style one-sided motion blur, one angle (degrees) per sample.

    Equivalent to correlating each image with a Gaussian-weighted line kernel
    (edge-replicated borders).  Implemented as a gather per kernel tap so that
    per-sample angles need no loop over samples (at most ~2*radius+1 taps).
    """
    n, _, h, w = x.shape
    taps = np.arange(2 * int(np.ceil(radius)) + 1)
    weights = np.exp(-(taps ** 2) / (2.0 * sigma ** 2))
    weights /= weights.sum()
    theta = np.deg2rad(angles)[:, None]
    off_x = np.ceil(taps * np.cos(theta) - 0.5).astype(int)  # [N, taps]
    off_y = np.ceil(taps * np.sin(theta) - 0.5).astype(int)
    xt = x.transpose(0, 2, 3, 1)  # [N, H, W, C] for fancy indexing
    nn = np.arange(n)[:, None, None]
    rows, cols = np.arange(h)[None, :, None], np.arange(w)[None, None, :]
    out = np.zeros_like(xt)
    for t, wt in enumerate(weights):
        r = np.clip(rows + off_y[:, t, None, None], 0, h - 1)
        c = np.clip(cols + off_x[:, t, None, None], 0, w - 1)
        out += wt * xt[nn, r, c]
    return out.transpose(0, 3, 1, 2)


def _plasma_fractal(n: int, mapsize: int, decay: float, rng: Rng) -> Array:
    """Diamond-square height maps [N, mapsize, mapsize] in [0, 1] (mapsize: power of 2)."""
    m = np.zeros((n, mapsize, mapsize))
    step, wibble = mapsize, 100.0

    def wibbled(a: Array) -> Array:
        return a / 4 + wibble * rng.uniform(-wibble, wibble, a.shape)

    while step >= 2:
        half = step // 2
        corner = m[:, 0::step, 0::step]  # squares
        sq = corner + np.roll(corner, -1, axis=1)
        sq += np.roll(sq, -1, axis=2)
        m[:, half::step, half::step] = wibbled(sq)
        dr = m[:, half::step, half::step]  # diamonds
        ul = m[:, 0::step, 0::step]
        lt = dr + np.roll(dr, 1, axis=1) + ul + np.roll(ul, -1, axis=2)
        m[:, 0::step, half::step] = wibbled(lt)
        tt = dr + np.roll(dr, 1, axis=2) + ul + np.roll(ul, -1, axis=1)
        m[:, half::step, 0::step] = wibbled(tt)
        step //= 2
        wibble /= decay
    m -= m.min(axis=(1, 2), keepdims=True)
    return m / m.max(axis=(1, 2), keepdims=True)


def _disk_kernel(radius: float, alias_blur: float, s: float) -> Array:
    """Reference 17x17 aliased disk, rendered at scale ``s``, then 3x3 Gaussian anti-aliased."""
    grid = np.arange(-8, 9)
    yy, xx = np.meshgrid(grid, grid, indexing="ij")
    inside = xx ** 2 + yy ** 2 <= radius ** 2
    py, px = yy[inside] * s, xx[inside] * s
    half = int(np.ceil(8 * s)) + 1
    k = np.zeros((2 * half + 1, 2 * half + 1))
    y0, x0 = np.floor(py).astype(int), np.floor(px).astype(int)
    fy, fx = py - y0, px - x0
    for dy, dx, wt in ((0, 0, (1 - fy) * (1 - fx)), (0, 1, (1 - fy) * fx),
                       (1, 0, fy * (1 - fx)), (1, 1, fy * fx)):  # bilinear splat
        np.add.at(k, (y0 + dy + half, x0 + dx + half), wt)
    g = np.exp(-np.arange(-1, 2) ** 2 / (2.0 * (alias_blur * s) ** 2))
    k = ndimage.correlate(k, np.outer(g, g) / g.sum() ** 2, mode="constant")
    nz = np.argwhere(k > 1e-12)
    (r0, c0), (r1, c1) = nz.min(axis=0), nz.max(axis=0)
    r = max(half - r0, r1 - half, half - c0, c1 - half)  # keep centred
    k = k[half - r:half + r + 1, half - r:half + r + 1]
    return k / k.sum()


def _box_resize_matrix(n_in: int, n_out: int) -> Array:
    """PIL ``Image.BOX`` resampling as an [n_out, n_in] matrix."""
    scale = n_in / n_out
    fscale = max(scale, 1.0)
    support = 0.5 * fscale
    mat = np.zeros((n_out, n_in))
    for i in range(n_out):
        centre = (i + 0.5) * scale
        lo = max(int(centre - support + 0.5), 0)
        hi = min(int(centre + support + 0.5), n_in)
        j = np.arange(lo, hi)
        u = (j - centre + 0.5) / fscale
        wts = ((u > -0.5) & (u <= 0.5)).astype(float)  # PIL box_filter
        mat[i, lo:hi] = wts / wts.sum()
    return mat


_JPEG_LUMA = np.array([
    [16, 11, 10, 16, 24, 40, 51, 61], [12, 12, 14, 19, 26, 58, 60, 55],
    [14, 13, 16, 24, 40, 57, 69, 56], [14, 17, 22, 29, 51, 87, 80, 62],
    [18, 22, 37, 56, 68, 109, 103, 77], [24, 35, 55, 64, 81, 104, 113, 92],
    [49, 64, 78, 87, 103, 121, 120, 101], [72, 92, 95, 98, 112, 100, 103, 99]], float)
_JPEG_CHROMA = np.full((8, 8), 99.0)
_JPEG_CHROMA[:4, :4] = [[17, 18, 24, 47], [18, 21, 26, 66], [24, 26, 56, 99], [47, 66, 99, 99]]


def _quant_table(base: Array, quality: int) -> Array:
    """IJG quality scaling of a base quantisation table."""
    scale = 5000 / quality if quality < 50 else 200 - 2 * quality
    return np.clip(np.floor((base * scale + 50) / 100), 1, 255)


def _jpeg_plane(p: Array, q: Array) -> Array:
    """8x8 block DCT quantise/dequantise of [N, H, W] planes in 0..255 (edge-padded to x8)."""
    n, h, w = p.shape
    ph, pw = -h % 8, -w % 8
    p = np.pad(p, ((0, 0), (0, ph), (0, pw)), mode="edge") - 128.0
    blocks = p.reshape(n, p.shape[1] // 8, 8, p.shape[2] // 8, 8)
    coef = fft.dctn(blocks, type=2, axes=(2, 4), norm="ortho")
    qb = q[None, None, :, None, :]
    blocks = fft.idctn(np.round(coef / qb) * qb, type=2, axes=(2, 4), norm="ortho")
    return (blocks.reshape(p.shape) + 128.0)[:, :h, :w]


def _upsample2_fancy(p: Array, axis: int) -> Array:
    """libjpeg "fancy" 2x up-sampling along ``axis``: 3/4 nearest + 1/4 next sample."""
    prev = np.concatenate([p.take([0], axis), p.take(np.arange(p.shape[axis] - 1), axis)], axis)
    nxt = np.concatenate([p.take(np.arange(1, p.shape[axis]), axis), p.take([-1], axis)], axis)
    out = np.stack([0.75 * p + 0.25 * prev, 0.75 * p + 0.25 * nxt], axis=axis + 1)
    shape = list(p.shape)
    shape[axis] *= 2
    return out.reshape(shape)


# ------------------------------------------------------------ corruptions


def gaussian_noise(x: Array, severity: int, rng: Rng) -> Array:
    # additive N(0, sigma) with sigma = [0.04, 0.06, 0.08, 0.09, 0.10]
    c = [0.04, 0.06, 0.08, 0.09, 0.10][severity - 1]
    return x + rng.normal(scale=c, size=x.shape)


def shot_noise(x: Array, severity: int, rng: Rng) -> Array:
    # Poisson(x * lam) / lam with lam = [500, 250, 100, 75, 50]
    c = [500, 250, 100, 75, 50][severity - 1]
    return rng.poisson(x * c) / c


def impulse_noise(x: Array, severity: int, rng: Rng) -> Array:
    # salt & pepper (50/50) on a fraction amount = [0.01, 0.02, 0.03, 0.05, 0.07] of values
    c = [0.01, 0.02, 0.03, 0.05, 0.07][severity - 1]
    flip = rng.random(x.shape) <= c
    salt = rng.random(x.shape) <= 0.5
    return np.where(flip, salt.astype(x.dtype), x)


def defocus_blur(x: Array, severity: int, rng: Rng) -> Array:
    # disk (radius, alias_blur) = [(0.3,0.4), (0.4,0.5), (0.5,0.6), (1,0.2), (1.5,0.1)] px@32
    r, a = [(0.3, 0.4), (0.4, 0.5), (0.5, 0.6), (1, 0.2), (1.5, 0.1)][severity - 1]
    k = _disk_kernel(r, a, _scale(x))
    return ndimage.correlate(x, k[None, None], mode="mirror")


def glass_blur(x: Array, severity: int, rng: Rng) -> Array:
    # (sigma px, max_delta px, iters) = [(.05,1,1), (.25,1,1), (.4,1,1), (.25,1,2), (.4,1,2)]
    sigma, delta, iters = [(0.05, 1, 1), (0.25, 1, 1), (0.4, 1, 1),
                           (0.25, 1, 2), (0.4, 1, 2)][severity - 1]
    s = _scale(x)
    sigma, delta = sigma * s, max(1, int(round(delta * s)))
    n, c, h, w = x.shape
    x = _gaussian(x, sigma)
    # Local shuffle: pixels in the reference's visited region take the value of a
    # random neighbour at offset randint(-delta, delta) (vectorised stand-in for
    # the reference's sequential swaps).
    rows = np.arange(delta + 1, h - delta + 1)
    cols = np.arange(delta + 1, w - delta + 1)
    nn = np.arange(n)[:, None, None, None]
    cc = np.arange(c)[None, :, None, None]
    for _ in range(iters if rows.size and cols.size else 0):
        dy, dx = rng.integers(-delta, delta, size=(2, n, 1, rows.size, cols.size))
        src = x[nn, cc, rows[:, None] + dy, cols[None, :] + dx]  # gathered copy
        x[:, :, rows[0]:rows[-1] + 1, cols[0]:cols[-1] + 1] = src
    return _gaussian(x, sigma)


def motion_blur(x: Array, severity: int, rng: Rng) -> Array:
    # (radius, sigma) = [(6,1), (6,1.5), (6,2), (8,2), (9,2.5)] px@32, angle ~ U(-45, 45) deg
    r, sg = [(6, 1), (6, 1.5), (6, 2), (8, 2), (9, 2.5)][severity - 1]
    s = _scale(x)
    return _motion_blur(x, r * s, sg * s, rng.uniform(-45, 45, size=x.shape[0]))


def zoom_blur(x: Array, severity: int, rng: Rng) -> Array:
    # zoom factors np.arange(1, e, 0.01) with e = [1.06, 1.11, 1.16, 1.21, 1.26] (relative)
    zooms = np.arange(1, [1.06, 1.11, 1.16, 1.21, 1.26][severity - 1], 0.01)
    h, w = x.shape[-2:]
    zh = np.stack([np.eye(h)] + [_zoom_matrix(h, z) for z in zooms])  # [K, H, H]
    zw = np.stack([np.eye(w)] + [_zoom_matrix(w, z) for z in zooms])  # [K, W, W]
    # mean over k of zh[k] @ img @ zw[k].T as one [HW, HW] operator: sum_k kron(zh[k], zw[k])
    op = (zh.reshape(len(zh), -1).T @ zw.reshape(len(zw), -1)) / len(zh)
    op = op.reshape(h, h, w, w).transpose(0, 2, 1, 3).reshape(h * w, h * w)
    return (x.reshape(-1, h * w) @ op.T).reshape(x.shape)


def snow(x: Array, severity: int, rng: Rng) -> Array:
    # (loc, scale, zoom, threshold, blur radius px, blur sigma px, blend) =
    # [(.1,.2,1,.6,8,3,.95), (.1,.2,1,.5,10,4,.9), (.15,.3,1.75,.55,10,4,.9),
    #  (.25,.3,2.25,.6,12,6,.85), (.3,.3,1.25,.65,14,12,.8)]; angle ~ U(-135, -45) deg
    loc, scl, zoom, thr, rad, sg, blend = [
        (0.1, 0.2, 1, 0.6, 8, 3, 0.95), (0.1, 0.2, 1, 0.5, 10, 4, 0.9),
        (0.15, 0.3, 1.75, 0.55, 10, 4, 0.9), (0.25, 0.3, 2.25, 0.6, 12, 6, 0.85),
        (0.3, 0.3, 1.25, 0.65, 14, 12, 0.8)][severity - 1]
    n, _, h, w = x.shape
    s = _scale(x)
    layer = _clipped_zoom(rng.normal(loc, scl, size=(n, 1, h, w)), zoom)
    layer = np.clip(np.where(layer < thr, 0.0, layer), 0, 1)
    layer = _motion_blur(layer, rad * s, sg * s, rng.uniform(-135, -45, size=n))
    x = blend * x + (1 - blend) * np.maximum(x, _luma(x) * 1.5 + 0.5)
    return x + layer + np.rot90(layer, 2, axes=(2, 3))


def fog(x: Array, severity: int, rng: Rng) -> Array:
    # (strength, wibble decay) = [(.2,3), (.5,3), (.75,2.5), (1,2), (1.5,1.75)]; 32px plasma map
    a, decay = [(0.2, 3), (0.5, 3), (0.75, 2.5), (1, 2), (1.5, 1.75)][severity - 1]
    n, _, h, w = x.shape
    size = 1 << int(np.ceil(np.log2(max(h, w, 2))))
    frac = _plasma_fractal(n, size, decay, rng)[:, None, :h, :w]
    max_val = x.max(axis=(1, 2, 3), keepdims=True)
    return (x + a * frac) * max_val / (max_val + a)


def brightness(x: Array, severity: int, rng: Rng) -> Array:
    # HSV value += [0.05, 0.1, 0.15, 0.2, 0.3] (hue/saturation kept; grayscale: x + c)
    c = [0.05, 0.1, 0.15, 0.2, 0.3][severity - 1]
    v = x.max(axis=1, keepdims=True)
    v_new = np.clip(v + c, 0, 1)
    ratio = np.divide(v_new, v, out=np.zeros_like(v), where=v > 0)
    return np.where(v > 0, x * ratio, v_new)  # black has S=0 -> becomes gray v_new


def contrast(x: Array, severity: int, rng: Rng) -> Array:
    # (x - mean) * c + mean, per image & channel, c = [0.75, 0.5, 0.4, 0.3, 0.15]
    c = [0.75, 0.5, 0.4, 0.3, 0.15][severity - 1]
    means = x.mean(axis=(2, 3), keepdims=True)
    return (x - means) * c + means


def elastic_transform(x: Array, severity: int, rng: Rng) -> Array:
    # (alpha, sigma, affine)*size: [(0,0,.08), (.05,.2,.07), (.08,.06,.06), (.1,.04,.05), (.1,.03,.03)]
    n, c, h, w = x.shape
    size = min(h, w)
    alpha, sigma, aff = (size * v for v in [
        (0, 0, 0.08), (0.05, 0.2, 0.07), (0.08, 0.06, 0.06),
        (0.1, 0.04, 0.05), (0.1, 0.03, 0.03)][severity - 1])
    # random affine from 3 jittered control points (cv2.getAffineTransform + warpAffine)
    ctr, sq = np.array([w // 2, h // 2], float), size // 3
    pts1 = np.array([ctr + sq, [ctr[0] + sq, ctr[1] - sq], ctr - sq])  # (x, y)
    pts2 = pts1 + rng.uniform(-aff, aff, size=(n, 3, 2))
    src = np.concatenate([pts2, np.ones((n, 3, 1))], axis=2)  # dst = M @ src -> invert
    inv = np.linalg.solve(src, np.broadcast_to(pts1, (n, 3, 2)))  # [N, 3(x,y,1), 2]
    yy, xx = np.mgrid[0:h, 0:w].astype(float)
    grid = np.stack([xx, yy, np.ones_like(xx)], axis=-1)  # [H, W, 3]
    sxy = np.einsum("hwk,nkj->nhwj", grid, inv)  # source (x, y) per output pixel
    planes = x.reshape(n * c, h, w)
    idx = np.broadcast_to(np.arange(n * c, dtype=float)[:, None, None], planes.shape)
    coords = np.stack([idx, np.repeat(sxy[..., 1], c, 0), np.repeat(sxy[..., 0], c, 0)])
    planes = ndimage.map_coordinates(planes, coords, order=1, mode="mirror")
    # smooth random displacement field (skimage gaussian, reflect, truncate=3)
    dxy = rng.uniform(-1, 1, size=(2, n, h, w))
    if sigma > 0:
        dxy = ndimage.gaussian_filter(dxy, (0, 0, sigma, sigma), mode="reflect", truncate=3)
    dx, dy = np.repeat(dxy[0] * alpha, c, 0), np.repeat(dxy[1] * alpha, c, 0)
    coords = np.stack([idx, yy + dy, xx + dx])
    return ndimage.map_coordinates(planes, coords, order=1, mode="reflect").reshape(x.shape)


def pixelate(x: Array, severity: int, rng: Rng) -> Array:
    # BOX down-sample to int(size * c) then BOX up-sample, c = [0.95, 0.9, 0.85, 0.75, 0.65]
    c = [0.95, 0.9, 0.85, 0.75, 0.65][severity - 1]
    h, w = x.shape[-2:]
    dh, dw = int(h * c), int(w * c)
    rh = _box_resize_matrix(dh, h) @ _box_resize_matrix(h, dh)  # [H, H]
    rw = _box_resize_matrix(dw, w) @ _box_resize_matrix(w, dw)  # [W, W]
    return rh @ x @ rw.T


def jpeg_compression(x: Array, severity: int, rng: Rng) -> Array:
    # JPEG quality = [80, 65, 58, 50, 40] (IJG-scaled standard luma/chroma tables, 4:2:0)
    quality = [80, 65, 58, 50, 40][severity - 1]
    ql, qc = _quant_table(_JPEG_LUMA, quality), _quant_table(_JPEG_CHROMA, quality)
    p = x * 255.0
    if x.shape[1] == 1:
        return _jpeg_plane(p[:, 0], ql)[:, None] / 255.0
    r, g, b = p[:, 0], p[:, 1], p[:, 2]
    y = 0.299 * r + 0.587 * g + 0.114 * b
    cb = 128 - 0.168736 * r - 0.331264 * g + 0.5 * b
    cr = 128 + 0.5 * r - 0.418688 * g - 0.081312 * b
    y = _jpeg_plane(y, ql)
    h, w = y.shape[1:]
    chroma = []
    for ch in (cb, cr):  # 4:2:0: 2x2 box down-sample, code, triangle up-sample
        ch = np.pad(ch, ((0, 0), (0, h % 2), (0, w % 2)), mode="edge")
        ch = ch.reshape(ch.shape[0], ch.shape[1] // 2, 2, ch.shape[2] // 2, 2).mean(axis=(2, 4))
        ch = _upsample2_fancy(_upsample2_fancy(_jpeg_plane(ch, qc), 1), 2)
        chroma.append(ch[:, :h, :w] - 128.0)
    cb, cr = chroma
    rgb = np.stack([y + 1.402 * cr, y - 0.344136 * cb - 0.714136 * cr, y + 1.772 * cb], axis=1)
    return rgb / 255.0


_FUNCS: dict[str, Callable[[Array, int, Rng], Array]] = {
    f.__name__: f for f in (
        gaussian_noise, shot_noise, impulse_noise, defocus_blur, glass_blur,
        motion_blur, zoom_blur, snow, fog, brightness, contrast,
        elastic_transform, pixelate, jpeg_compression)
}

CORRUPTIONS: tuple[str, ...] = tuple(_FUNCS)

# ------------------------------------------------------------- public API


def _validate(x: Array, name: str, severity: int) -> None:
    if not isinstance(name, str) or name not in _FUNCS:
        raise ValueError(f"unknown corruption {name!r}; valid names: {', '.join(CORRUPTIONS)}")
    is_int = isinstance(severity, (int, np.integer)) and not isinstance(severity, bool)
    if not (is_int and 1 <= severity <= 5):
        raise ValueError(f"severity must be an integer in 1..5, got {severity!r}")
    if not isinstance(x, np.ndarray):
        raise ValueError(f"x must be a numpy array, got {type(x).__name__}")
    if x.ndim != 4:
        raise ValueError(f"x must have shape [N, C, H, W] (4 dims), got shape {x.shape}")
    if not np.issubdtype(x.dtype, np.floating):
        raise ValueError(f"x must be a floating-point array in [0, 1], got dtype {x.dtype}")
    if x.shape[1] not in (1, 3):
        raise ValueError(f"x must have 1 (grayscale) or 3 (RGB) channels, got C={x.shape[1]}")
    if x.size and not (x.min() >= 0.0 and x.max() <= 1.0):
        raise ValueError(f"x values must lie in [0, 1], got min={x.min()!r} max={x.max()!r}")


def corrupt(x: Array, name: str, severity: int,
            seed: int | np.random.Generator = 0) -> Array:
    """Apply corruption ``name`` at ``severity`` (1..5) to a batch [N, C, H, W] in [0, 1].

    Returns a new float32 array of the same shape, clipped to [0, 1].  The output
    is a deterministic function of ``seed`` (an int or a numpy Generator, which
    is advanced).
    """
    _validate(x, name, severity)
    if x.size == 0:
        return x.astype(np.float32, copy=True)
    rng = np.random.default_rng(seed)
    out = _FUNCS[name](x.astype(np.float64), int(severity), rng)
    return np.clip(out, 0.0, 1.0).astype(np.float32)


def corrupt_dataset(x: Array, names: Iterable[str] | None = None, severity: int = 3,
                    seed: int = 0) -> dict[str, Array]:
    """Corrupt ``x`` with each of ``names`` (default: all); independent seeded stream per name."""
    return {n: corrupt(x, n, severity, np.random.default_rng([seed, zlib.crc32(n.encode())]))
            for n in (CORRUPTIONS if names is None else names)}
