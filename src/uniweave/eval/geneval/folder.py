"""A folder of generated images in GenEval's layout, read with nothing skipped silently.

The layout (GenEval's README; `uniweave eval --geneval` writes it, anything else may have):

    <root>/<index>/metadata.jsonl      one metadata row (`read_prompt_metadata`)
    <root>/<index>/samples/NNNN.png    the prompt's images, numbered from 0000

Prompt folders are the sub-folders of `<root>` whose name is all digits (in numeric
order); samples are the files of `samples/` named digits + `.png`; anything else (a
`grid.png`, other folders) is not part of the layout and is ignored, as by GenEval.

Which images are expected: `images_per_prompt` = N when given, else, per prompt, one
more than the highest sample number found (at least one). Each expected number without a
file is a *missing* image, a file that does not decode (opened and fully loaded with
PIL) an *unreadable* one; a sample numbered N or more (N given), or a second file of the
same number (`2.png` beside `0002.png`), is *unexpected*.
Each is a `FolderProblem` naming the path and what is wrong; none of them is scored.
A prompt folder without a readable, valid `metadata.jsonl` is not a problem to count but
an error (`MetadataError`, naming `FILE:LINE` and the field), as is a root with no prompt
folders.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageOps

from uniweave.rewards.geneval.metadata import MetadataError, MetadataRow, read_prompt_metadata

_SAMPLE = re.compile(r"(\d+)\.png")


@dataclass(frozen=True)
class FolderSample:
    """One readable image: its prompt folder's name, sample number, path and row."""

    index: str
    number: int
    path: Path
    row: MetadataRow


@dataclass(frozen=True)
class FolderProblem:
    """An expected image that cannot be scored: `kind` is "missing", "unreadable" or
    "unexpected"; `detail` says why."""

    kind: str
    path: Path
    detail: str

    def __str__(self) -> str:
        return f"{self.path}: {self.kind}: {self.detail}"


@dataclass(frozen=True)
class GenEvalFolder:
    """What `read_folder` found: the readable samples in order, and the problems."""

    root: Path
    samples: tuple[FolderSample, ...]
    problems: tuple[FolderProblem, ...]
    prompts: int

    def count(self, kind: str) -> int:
        """How many problems of `kind` ("missing", "unreadable", "unexpected")."""
        return sum(p.kind == kind for p in self.problems)

    @property
    def missing(self) -> int:
        return self.count("missing")

    @property
    def unreadable(self) -> int:
        return self.count("unreadable")


def load_image(path: str | Path) -> Image.Image:
    """The image at `path`, fully decoded and turned upright by its EXIF orientation (as
    GenEval opens it); raises OSError (or PIL's errors) when it does not decode."""
    with Image.open(path) as image:
        image.load()
        return ImageOps.exif_transpose(image)


def _unreadable(path: Path) -> str | None:
    try:
        load_image(path)
    except Exception as err:  # noqa: BLE001 - any decoder failure makes the file unreadable
        return f"{type(err).__name__}: {err}"
    return None


def read_folder(
    root: str | Path,
    classes: Collection[str] | None = None,
    images_per_prompt: int | None = None,
) -> GenEvalFolder:
    """The samples and problems of a GenEval-layout folder (module docstring); `classes`
    is the detector's class vocabulary the metadata is checked against."""
    root = Path(root)
    if images_per_prompt is not None and images_per_prompt < 1:
        raise ValueError(f"images_per_prompt: expected >= 1, got {images_per_prompt}")
    if not root.is_dir():
        raise MetadataError(f"{root}: not a folder")
    folders = sorted(
        (p for p in root.iterdir() if p.is_dir() and p.name.isdigit()),
        key=lambda p: (int(p.name), p.name),
    )
    if not folders:
        raise MetadataError(f"{root}: holds no prompt folders (<index>/metadata.jsonl)")
    samples: list[FolderSample] = []
    problems: list[FolderProblem] = []
    for folder in folders:
        row = read_prompt_metadata(folder / "metadata.jsonl", classes)
        sample_dir = folder / "samples"
        found: dict[int, Path] = {}
        if sample_dir.is_dir():
            for path in sorted(sample_dir.iterdir()):
                match = _SAMPLE.fullmatch(path.name)
                if not (match and path.is_file()):
                    continue
                number = int(match.group(1))
                if number in found:
                    problems.append(
                        FolderProblem(
                            "unexpected", path, f"sample {number} is also {found[number]}"
                        )
                    )
                else:
                    found[number] = path
        expected = images_per_prompt or max((n + 1 for n in found), default=1)
        for number in range(expected):
            listed = found.get(number)
            if listed is None:
                problems.append(
                    FolderProblem("missing", sample_dir / f"{number:04d}.png", "no such file")
                )
                continue
            path = listed
            why = _unreadable(path)
            if why is not None:
                problems.append(FolderProblem("unreadable", path, why))
            else:
                samples.append(FolderSample(folder.name, number, path, row))
        for number in sorted(n for n in found if n >= expected):
            problems.append(
                FolderProblem(
                    "unexpected",
                    found[number],
                    f"sample {number} beyond the {expected} images per prompt",
                )
            )
    return GenEvalFolder(root, tuple(samples), tuple(problems), len(folders))
