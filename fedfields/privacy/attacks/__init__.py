"""Attacks that measure what a split-learning server learns.

The Surrogate Model Attack (offline and online) and its scene-aided variant on SplitNeRF
(paper 000, Sec. 4) and SDAR on any split PyTorch model (paper 001); the digits task of
SDAR's audit lives in `fedfields.privacy.attacks.sdar_digits` (it needs scikit-learn's
load_digits).
"""

from fedfields.privacy.attacks.scene_aided import (
    PoseSearch,
    SceneAidedConfig,
    SceneAidedResult,
    fine_tune,
    pose_error,
    posed_cameras,
    scene_aided_attack,
    search_pose,
    sphere_poses,
)
from fedfields.privacy.attacks.sdar import (
    AttackerModels,
    LabelConditioned,
    SDARAttack,
    SDARAuditReport,
    SDARConfig,
    SplitStepRecord,
    run_sdar_audit,
    save_reconstruction_png,
)
from fedfields.privacy.attacks.sdar_nerf import (
    SDARNeRFConfig,
    SDARNeRFResult,
    procedural_scene,
    sdar_nerf_attack,
)
from fedfields.privacy.attacks.surrogate import (
    SurrogateAttackConfig,
    SurrogateResult,
    balanced_loss,
    depth_view,
    gradient_distance,
    grey_view,
    make_surrogate_head,
    online_surrogate_attack,
    paper_online_config,
    render_depth_and_grey,
    render_split_view,
    score_attack,
    spectral_init,
    surrogate_losses,
    surrogate_model_attack,
)

__all__ = [
    "SDARNeRFConfig",
    "SDARNeRFResult",
    "procedural_scene",
    "sdar_nerf_attack",
    "AttackerModels",
    "LabelConditioned",
    "SDARAttack",
    "SDARAuditReport",
    "SDARConfig",
    "SplitStepRecord",
    "run_sdar_audit",
    "save_reconstruction_png",
    "PoseSearch",
    "SceneAidedConfig",
    "SceneAidedResult",
    "SurrogateAttackConfig",
    "SurrogateResult",
    "balanced_loss",
    "depth_view",
    "fine_tune",
    "gradient_distance",
    "grey_view",
    "make_surrogate_head",
    "online_surrogate_attack",
    "paper_online_config",
    "pose_error",
    "posed_cameras",
    "render_depth_and_grey",
    "render_split_view",
    "scene_aided_attack",
    "score_attack",
    "search_pose",
    "spectral_init",
    "sphere_poses",
    "surrogate_losses",
    "surrogate_model_attack",
]
