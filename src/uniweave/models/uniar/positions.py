"""M-RoPE positions of UniAR streams: always Qwen3-VL's `get_rope_index`, passed explicitly
(the model's cached `rope_deltas` are never read).

Every image run of a row is an image for `get_rope_index` (`mm_token_type_ids` 1): an
understanding image (its `<|image_pad|>` placeholders, TEXT modality) with the grid the
image processor gave it, and a generated image (VISUAL positions) of H x W composite
positions with the grid an image of that many merged tokens has, (1, H*m, W*m) patches
for merge size m. So a generated H x W image gets position (s, s + i // W, s + i % W) at
raster index i, where s is the position after its `<|vision_start|>`, and the text after
it continues at s + max(H, W). The H x W of a generated image is read from its header
(`parse_image_header` on the tokens before its `<|vision_start|>`). A row that stops
inside an image (a rollout cap) gets the positions of the full image, truncated.

`MRopeDecodePositions` continues a prefill token by token under the same rule, for the
KV-cached rollout.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from uniweave.core.types import Modality

ParseHeader = Callable[[Sequence[int]], "tuple[int, int] | None"]


def true_runs(flags: list[bool]) -> list[tuple[int, int]]:
    """(start, end) of every maximal run of True."""
    runs, t = [], 0
    while t < len(flags):
        if flags[t]:
            s = t
            while t < len(flags) and flags[t]:
                t += 1
            runs.append((s, t))
        else:
            t += 1
    return runs


def generated_grid(ids: Sequence[int], start: int, parse_header: ParseHeader, where: str):
    """(H, W) of the generated image whose first visual position is `start` (its header
    ends at `start - 1`, the `<|vision_start|>`)."""
    grid = parse_header(list(ids[: max(start - 1, 0)]))
    if grid is None:
        raise ValueError(f"{where}: a generated image at position {start} has no valid header")
    return grid


def row_positions(
    rope_index: Callable,
    ids: torch.Tensor,
    modality: torch.Tensor,
    image_token_id: int,
    understanding: Sequence[Sequence[int]],
    parse_header: ParseHeader,
    merge: int,
    where: str,
) -> torch.Tensor:
    """long [3, n] positions of one row's n real positions (module docstring) from
    `rope_index` (= `Qwen3VLModel.get_rope_index`); `understanding` lists the (t, h, w)
    grid of each understanding image in order."""
    id_list = ids.tolist()
    visual = (modality == Modality.VISUAL).tolist()
    image = [v or t == image_token_id for t, v in zip(id_list, visual)]
    grids, extra, k = [], 0, 0
    for s, e in true_runs(image):
        if visual[s]:
            h, w = generated_grid(id_list, s, parse_header, where)
            if e - s > h * w or (e - s < h * w and e < len(id_list)):
                raise ValueError(f"{where}: a {h}x{w} image at {s} holds {e - s} positions")
            extra = h * w - (e - s)
            grids.append([1, h * merge, w * merge])
        else:
            if k >= len(understanding):
                raise ValueError(f"{where}: more image placeholder runs than images")
            grid = list(understanding[k])
            k += 1
            if (e - s) != grid[0] * (grid[1] // merge) * (grid[2] // merge):
                raise ValueError(f"{where}: an image at {s} holds {e - s} placeholders for {grid}")
            grids.append(grid)
    if k != len(understanding):
        raise ValueError(f"{where}: {len(understanding)} images for {k} placeholder runs")
    full = torch.tensor(id_list + [image_token_id] * extra, dtype=torch.long)
    types = torch.tensor(image + [True] * extra, dtype=torch.int)
    thw = torch.tensor(grids, dtype=torch.long) if grids else None
    pos, _ = rope_index(full[None], types[None], image_grid_thw=thw)
    return pos[:, 0, : len(id_list)]


def batch_positions(
    rope_index: Callable,
    token_ids: torch.Tensor,
    modality: torch.Tensor,
    attention_mask: torch.Tensor,
    image_token_id: int,
    understanding: Sequence[Sequence[Sequence[int]]],
    parse_header: ParseHeader,
    merge: int,
) -> torch.Tensor:
    """long [3, B, T]: `row_positions` of each row's real positions (left or right
    padding), 0 on padding."""
    B, T = token_ids.shape
    out = torch.zeros(3, B, T, dtype=torch.long)
    ids, mod, mask = token_ids.cpu(), modality.cpu(), attention_mask.bool().cpu()
    for b in range(B):
        grids = understanding[b] if b < len(understanding) else []
        out[:, b, mask[b]] = row_positions(
            rope_index, ids[b][mask[b]], mod[b][mask[b]], image_token_id, grids,
            parse_header, merge, f"row {b}",
        )  # fmt: skip
    return out.to(token_ids.device)


class MRopeDecodePositions:
    """Next M-RoPE positions of a KV-cached decode (the `DecodePositions` contract).

    Per row: `next_text` (one past the largest position so far), and for the image being
    generated its start s and grid (H, W), read from the header when its first visual
    position is fed. A text position gets next_text on all three axes; visual index i
    gets (s, s + i // W, s + i % W); after the last one next_text = s + max(H, W).
    """

    def __init__(
        self,
        prefill_ids: torch.Tensor,
        prefill_mask: torch.Tensor,
        prefill_positions: torch.Tensor,
        parse_header: ParseHeader,
    ) -> None:
        mask = prefill_mask.bool()
        top = prefill_positions.max(0).values.masked_fill(~mask, -1)
        self.next_text = top.max(-1).values + 1
        self.history: list[torch.Tensor] = [prefill_ids.masked_fill(~mask, -1)]
        self.parse_header = parse_header
        B, device = prefill_ids.shape[0], prefill_ids.device
        self.start = torch.zeros(B, dtype=torch.long, device=device)
        self.height = torch.ones(B, dtype=torch.long, device=device)
        self.width = torch.ones(B, dtype=torch.long, device=device)

    def _open_images(self, rows: torch.Tensor) -> None:
        ids = torch.cat(self.history, dim=1).cpu()
        for b in rows.tolist():
            row = [t for t in ids[b].tolist() if t >= 0]
            grid = self.parse_header(row[:-1])  # row ends with <|vision_start|>
            if grid is None:
                raise ValueError(f"decode row {b}: a generated image without a valid header")
            self.height[b], self.width[b] = grid
            self.start[b] = self.next_text[b]

    def next(
        self,
        modality: torch.Tensor,
        image_position: torch.Tensor,
        token_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """long [3, B, 1] positions of the fed positions (modality/index/token [B, 1])."""
        if token_ids is None:
            raise ValueError("M-RoPE decoding needs the fed token ids")
        vis = (modality[:, 0] == Modality.VISUAL).to(self.next_text.device)
        idx = image_position[:, 0].to(self.next_text.device)
        opening = vis & (idx == 0)
        if bool(opening.any()):
            self._open_images(opening.nonzero()[:, 0])
        text = self.next_text
        t = torch.where(vis, self.start, text)
        h = torch.where(vis, self.start + idx // self.width, text)
        w = torch.where(vis, self.start + idx % self.width, text)
        last = vis & (idx == self.height * self.width - 1)
        after = self.start + torch.maximum(self.height, self.width)
        self.next_text = torch.where(vis, torch.where(last, after, text), text + 1)
        self.history.append(torch.where(vis[:, None], -1, token_ids.to(text.device)))
        return torch.stack([t, h, w])[:, :, None]

    def select(self, rows: torch.Tensor) -> None:
        rows = rows.to(self.next_text.device)
        self.next_text, self.start = self.next_text[rows], self.start[rows]
        self.height, self.width = self.height[rows], self.width[rows]
        self.history = [torch.cat(self.history, dim=1)[rows]]
