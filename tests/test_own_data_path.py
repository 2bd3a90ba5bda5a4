"""A new user's own data, SFT -> eval -> GRPO -> eval, with the installed package.

From a temporary folder outside the checkout, with the wheel installed
(`installed_uniweave`, shared with tests/test_readme_commands.py): write a dataset of
its own (12 train / 6 test rows, 16x16 colour PNGs of a circle or a square, task label
`shape_qa`, answers "circle" / "square"), then do what README.md's own-data block says:
`uniweave recipes copy` the own-data templates, edit only the lines marked `# EDIT:` (the
data paths), run SFT, eval, GRPO, eval. Every command exits 0 with no other edit, the
task label is read from the rows (and said so), and the GRPO progress lines show the
reward.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from installed import README, marked_block
from PIL import Image

SHAPES = ("circle", "square")


def write_shapes(root: Path) -> tuple[Path, Path]:
    """`root/train.jsonl` (12 rows) and `root/test.jsonl` (6 rows), images under
    `root/images/`: a filled circle or square in a random colour on black, 16x16 RGB."""
    (root / "images").mkdir(parents=True)
    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[:16, :16]
    masks = {
        "circle": np.hypot(yy - 7.5, xx - 7.5) <= 6,
        "square": (np.abs(yy - 7.5) <= 5) & (np.abs(xx - 7.5) <= 5),
    }
    paths = []
    for split, n in (("train", 12), ("test", 6)):
        rows = []
        for i in range(n):
            shape = SHAPES[i % 2]
            image = np.zeros((16, 16, 3), dtype=np.uint8)
            image[masks[shape]] = rng.integers(80, 256, size=3)
            name = f"images/{split}-{i:02d}.png"
            Image.fromarray(image).save(root / name)
            question = [{"type": "image", "path": name}, {"type": "text", "text": "Which shape?"}]
            rows.append(
                {
                    "id": f"{split}-{i}",
                    "task": "shape_qa",
                    "answer": shape,
                    "messages": [
                        {"role": "user", "content": question},
                        {"role": "assistant", "content": shape},
                    ],
                }
            )
        path = root / f"{split}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        paths.append(path)
    return paths[0], paths[1]


def edit_marked_lines(recipe: Path, values: dict[str, str]) -> None:
    """What the user does by hand: on each line marked `# EDIT:`, replace the value of its
    key (`key: value  # EDIT: ...`) with `values[key]`; every marked key must be given,
    and nothing else changes."""
    lines = recipe.read_text().splitlines(keepends=True)
    marked = []
    for k, line in enumerate(lines):
        m = re.match(r"^(\s*)(\w+): (\S+)(\s+# EDIT:.*)$", line.rstrip("\n"))
        if m:
            marked.append(m.group(2))
            lines[k] = f"{m.group(1)}{m.group(2)}: {values[m.group(2)]}{m.group(4)}\n"
    assert sorted(marked) == sorted(values), (recipe, marked)
    recipe.write_text("".join(lines))


@pytest.mark.slow
def test_own_shapes_sft_eval_grpo_eval_with_only_the_data_paths_edited(
    installed_uniweave, tmp_path
):
    block = marked_block(README.read_text(), "own-data")
    copy, edit, rest = block[0], block[1], block[2:]
    assert copy.startswith("uniweave recipes copy ") and edit.startswith("# edit"), block
    assert all(line.startswith("uniweave ") for line in rest), rest
    run = installed_uniweave.run

    train, test = write_shapes(tmp_path / "shapes")
    out = run([copy], tmp_path)
    recipes = tmp_path / "my_recipes"
    assert sorted(p.name for p in recipes.iterdir()) == ["grpo.yaml", "sft.yaml"], out
    assert "# EDIT:" not in (recipes / "grpo.yaml").read_text()  # its data is sft.yaml's
    edit_marked_lines(recipes / "sft.yaml", {"path": str(train), "test_path": str(test)})

    out = run(rest, tmp_path)
    assert re.search(
        r"data\.tasks not set: \[shape_qa\].*reward\.plugins\.0 \(text_exact\)", out
    ), out
    grpo = out[out.index("training 4 updates into runs/own_grpo") :]
    progress = [line for line in grpo.splitlines() if line.startswith("update ")]
    assert len(progress) == 4, grpo
    assert all(re.search(r"\breward -?\d", line) for line in progress), progress
    for run_dir in ("own_sft", "own_grpo"):
        assert (tmp_path / "runs" / run_dir / "model").is_dir()
        summary = json.loads(
            (tmp_path / "runs" / run_dir / "eval-test" / "summary.json").read_text()
        )
        assert "shape_qa" in json.dumps(summary), summary
