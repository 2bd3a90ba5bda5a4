"""Images of any size and mode reach a model's processor: `read_rgb` per PIL mode
against values computed here from the pixels written, then the size policy
(`data.image_resize`: refuse with a clear error, or resize) of the tiny and colour
processors."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image
from tolerances import elementwise_bound

from uniweave.data.images import GreyscaleProcessor, RGBProcessor, read_rgb


def write(tmp_path, image: Image.Image, fmt: str = "PNG"):
    path = tmp_path / f"x.{fmt.lower()}"
    image.save(path, format=fmt)
    return path


def test_every_mode_reads_as_rgb_in_unit_range(tmp_path):
    rng = np.random.default_rng(0)
    grey16 = rng.integers(0, 65536, (5, 7), dtype=np.uint16)
    got = read_rgb(write(tmp_path, Image.fromarray(grey16)))
    want = np.repeat((grey16 / 65535.0)[..., None], 3, axis=-1)
    # float32 of a float64 quotient: within half an ulp of values <= 1
    np.testing.assert_allclose(got, want, rtol=0, atol=np.finfo(np.float32).eps / 2)

    grey = rng.integers(0, 256, (4, 6), dtype=np.uint8)
    for mode, image in [
        ("L", Image.fromarray(grey)),
        ("LA", Image.fromarray(np.stack([grey, 255 - grey], -1), mode="LA")),
        ("P", Image.fromarray(grey).convert("P")),
    ]:
        got = read_rgb(write(tmp_path, image))
        assert got.shape == (4, 6, 3) and got.dtype == np.float32, mode
        np.testing.assert_array_equal(got, np.repeat(grey[..., None], 3, -1) / np.float32(255))

    rgba = rng.integers(0, 256, (3, 5, 4), dtype=np.uint8)
    got = read_rgb(write(tmp_path, Image.fromarray(rgba, mode="RGBA")))
    np.testing.assert_array_equal(got, rgba[..., :3] / np.float32(255))

    cmyk = Image.new("CMYK", (3, 2), (0, 255, 255, 0))  # no black, full magenta+yellow: red
    np.testing.assert_array_equal(read_rgb(write(tmp_path, cmyk, "TIFF"))[0, 0], [1, 0, 0])

    floats = rng.random((3, 4)).astype(np.float32)
    got = read_rgb(write(tmp_path, Image.fromarray(floats, mode="F"), "TIFF"))
    np.testing.assert_array_equal(got, np.repeat(floats[..., None], 3, -1))
    with pytest.raises(ValueError, match="outside"):
        read_rgb(write(tmp_path, Image.fromarray(floats * 3, mode="F"), "TIFF"))


def test_size_policy_refuses_or_resizes(tmp_path):
    rgb = read_rgb(write(tmp_path, Image.new("RGB", (13, 9), (10, 200, 30))))
    with pytest.raises(ValueError, match=r"is 9x13; the model takes 8x8 .*image_resize=resize"):
        GreyscaleProcessor((8, 8), "error")(rgb, "x.png")
    tiny = GreyscaleProcessor((8, 8), "resize")(rgb, "x.png")
    luma = (0.299 * 10 + 0.587 * 200 + 0.114 * 30) / 255
    assert tiny.shape == (8, 8)
    # a constant image stays constant under bicubic resampling, up to float32 rounding:
    # two passes of weights summing to 1 and the luma: <= 8 roundings of a value <= 1
    resampled = elementwise_bound(1.0, 8, paths=1)
    np.testing.assert_allclose(tiny, luma, rtol=0, atol=resampled)
    janus = RGBProcessor((384, 384), "resize")(rgb, "x.png")
    assert janus.shape == (384, 384, 3)
    np.testing.assert_allclose(janus[5, 7], np.array([10, 200, 30]) / 255, rtol=0, atol=resampled)
