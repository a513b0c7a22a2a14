"""The crowd at a glance: one row of views per user, masks outlined."""

from __future__ import annotations

import math

import numpy as np
import torch
from PIL import Image, ImageDraw
from torch import Tensor

from fedfields.data.crowd.records import Crowd


def contact_sheet(crowd: Crowd, columns_of_users: int = 2, zoom: int = 2) -> Image.Image:
    """A grid with one row of views per user, tiles enlarged `zoom` times, masks outlined."""
    cameras = crowd.cameras
    tile_w, tile_h = zoom * cameras.width, zoom * cameras.height
    label_w = 28
    views = max(len(user.views) for user in crowd.users)
    rows = math.ceil(len(crowd.users) / columns_of_users)
    block_w = label_w + views * (tile_w + 2)
    sheet = Image.new("RGB", (columns_of_users * block_w, rows * (tile_h + 2)), "white")
    draw = ImageDraw.Draw(sheet)
    outline_colour = torch.tensor([1.0, 0.0, 1.0])
    for index, user in enumerate(crowd.users):
        x0 = (index // rows) * block_w
        y0 = (index % rows) * (tile_h + 2)
        draw.text((x0 + 2, y0 + tile_h // 2 - 5), f"{user.user:02d}", fill="black")
        for position in range(len(user.views)):
            rgba = user.rgba[position].repeat_interleave(zoom, 0).repeat_interleave(zoom, 1)
            mask = user.masks[position].repeat_interleave(zoom, 0).repeat_interleave(zoom, 1)
            rgb = rgba[..., :3] * rgba[..., 3:] + (1.0 - rgba[..., 3:])
            rgb[_outline(~mask)] = outline_colour  # just outside the mask
            tile = Image.fromarray((rgb.clamp(0, 1).numpy() * 255 + 0.5).astype(np.uint8))
            sheet.paste(tile, (x0 + label_w + position * (tile_w + 2), y0))
    return sheet


def _outline(mask: Tensor) -> Tensor:
    """Pixels of `mask` that touch a pixel outside it (8-neighbourhood; image edges don't count)."""
    padded = torch.nn.functional.pad(mask[None, None].float(), (1, 1, 1, 1), mode="replicate")
    eroded = -torch.nn.functional.max_pool2d(-padded, 3, stride=1)[0, 0]
    return mask & (eroded < 0.5)
