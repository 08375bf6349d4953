"""What a container check finds of a damaged image, against what only decoding finds: the reason the checking pass
under `skip_bad_rows` decodes WebP bitstreams (docs/datasets.md, item 6).

    python benchmarks/image_damage.py [--damages 200] [--format WEBP] [--width 1280 --height 960]

One photograph-like image (colour gradients plus Gaussian noise, sigma 6) is saved lossy and lossless; each of
`--damages` copies gets 8 random bytes overwritten at a random place (`random.Random(1)`); each copy is checked by
the pass's container check (`integrity_problem`, data/encoded_images.py) and decoded whole by Pillow. Printed per
encoding: how many copies fail each way, how many fail the decode only, and where those damages lie.
"""

from __future__ import annotations

import argparse
import io
import random
import time
from collections.abc import Callable

import numpy as np
from common import report
from PIL import Image

from vision_grpo.data.encoded_images import integrity_problem


def photograph(width: int, height: int) -> Image.Image:
    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:height, 0:width]
    smooth = np.stack([x * 255 / width, y * 255 / height, (x + y) * 127 / (width + height)], -1)
    return Image.fromarray(np.clip(smooth + rng.normal(0, 6, smooth.shape), 0, 255).astype("uint8"))


def fails(check: Callable[[bytes], bool], data: bytes) -> bool:
    """Whether `check` refuses `data`: it says so, or raises."""
    try:
        return check(data)
    except Exception:  # noqa: BLE001 - any exception is a refusal, as the pass counts it
        return True


def container_fails(data: bytes) -> bool:
    return integrity_problem(Image.open(io.BytesIO(data)), data) is not None


def decode_fails(data: bytes) -> bool:
    Image.open(io.BytesIO(data)).load()
    return False


def damages(good: bytes, count: int) -> dict[str, object]:
    chance = random.Random(1)
    container = decode = only_decode = 0
    where = []
    for _ in range(count):
        data = bytearray(good)
        at = chance.randrange(0, len(data) - 8)
        data[at : at + 8] = bytes(chance.randrange(256) for _ in range(8))
        by_container, by_decode = fails(container_fails, bytes(data)), fails(decode_fails, bytes(data))
        container, decode = container + by_container, decode + by_decode
        if by_decode and not by_container:
            only_decode += 1
            where.append(at)
    return {"container_fails": container, "decode_fails": decode, "decode_only": only_decode, "at": sorted(where)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--damages", type=int, default=200)
    parser.add_argument("--format", default="WEBP", choices=["WEBP", "JPEG", "PNG"])
    parser.add_argument("--width", type=int, default=1280)
    parser.add_argument("--height", type=int, default=960)
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args()
    image = photograph(args.width, args.height)
    figures = {}
    encodings = {"lossy": {"quality": 85}, "lossless": {"lossless": True}} if args.format == "WEBP" else {"": {}}
    for name, options in encodings.items():
        buffer = io.BytesIO()
        image.save(buffer, args.format, **options)
        good = buffer.getvalue()
        start = time.perf_counter()
        Image.open(io.BytesIO(good)).load()
        decode_ms = (time.perf_counter() - start) * 1e3
        found = damages(good, args.damages)
        figures[name or args.format] = {"bytes": len(good), "decode_ms": decode_ms, **found}
        print(f"{args.format} {name} {args.width}x{args.height}, {len(good):,} bytes, decode {decode_ms:.1f} ms: of "
              f"{args.damages} damages, {found['decode_fails']} fail to decode, {found['container_fails']} fail the "
              f"container check, {found['decode_only']} the decode only (at bytes {found['at'][:3]} .. "
              f"{found['at'][-1:]})")  # fmt: skip
    report("image_damage", figures, args.json)


if __name__ == "__main__":
    main()
