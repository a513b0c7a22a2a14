"""Leakage of personal content in a crowd's scene field (DecentNeRF, Sec. 5 and Fig. 7a).

A field the server can read is rendered at each user's views and scored inside the masks of
the user's own (static) person against the photo: higher PSNR there means the field
reproduces the person, i.e. leaks it. The floor is what a field that renders no person at
all scores, the clean view against the photo inside the same masks, so leakage is told
apart from none. Clean-view PSNR/SSIM is the utility measured on the same renders.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from fedfields.data import Scene
from fedfields.data.crowd import CrowdUser
from fedfields.metrics import lpips, psnr, ssim

UPLOAD_LEAK = "upload-personal-psnr"
"""Metric: PSNR inside each user's masks of its plaintext upload, mean over the round's uploads."""
PERSONAL_FLOOR = "personal-psnr-floor"
"""Metric: PSNR inside the masks of the clean views against the photos (no person rendered)."""


def score_crowd(
    render: Callable[[Scene, int], torch.Tensor],
    users: Sequence[CrowdUser],
    views: Sequence[int] | None = None,
    perceptual: bool = False,
) -> dict[str, float]:
    """Clean-view PSNR/SSIM and PSNR inside the personal masks (leakage) over users' views,
    with the leakage floor: the clean view against the photo inside the masks, i.e. what a
    field that renders no person scores, so leakage is told apart from none.

    `render(scene, view)` gives an [H, W, 3] image; `views` None scores every view. With
    `perceptual` the clean views' LPIPS too ("clean-lpips"; left out where LPIPS is
    unavailable, which warns once).
    """
    clean, personal, floor, predictions, targets = [], [], [], [], []
    for user in users:
        for view in views if views is not None else range(len(user.scene)):
            image = render(user.scene, view)
            photo, mask = user.scene.images[view], user.personal_masks[view]
            clean.append(psnr(image, user.clean_images[view]))
            personal.append(psnr(image, photo, mask))
            floor.append(psnr(user.clean_images[view], photo, mask))
            predictions.append(image)
            targets.append(user.clean_images[view])
    scores = {
        "clean-psnr": float(np.mean(clean)),
        "clean-ssim": ssim(torch.stack(predictions), torch.stack(targets)),
        "personal-psnr": float(np.mean(personal)),
        PERSONAL_FLOOR: float(np.mean(floor)),
    }
    perceptual_distance = (
        lpips(torch.stack(predictions), torch.stack(targets)) if perceptual else None
    )
    if perceptual_distance is not None:
        scores["clean-lpips"] = perceptual_distance
    return scores
