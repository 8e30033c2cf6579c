"""Each shipped parallel layout trains for a few steps on CPU through the launcher (torchrun + gloo)."""

from __future__ import annotations

import pytest

from conftest import check_layout, launch, TP_REFERENCE_STEPS

pytestmark = pytest.mark.multiprocess

LAYOUTS = {
    # config: (world size, dp_replicate, dp_shard, tp, pp); debug_model.toml (FSDP2 over 2) is the default config,
    # trained by tests/test_end_to_end.py through ./run_train.sh with the same checks (LAYOUT_CHECKS)
    "tp": (2, 1, 1, 2, 1),
    "pp": (2, 1, 1, 1, 2),
    "fsdp_tp": (4, 1, 2, 2, 1),
    "fsdp_pp": (4, 1, 2, 1, 2),
    "tp_pp": (4, 1, 1, 2, 2),
    "hsdp": (4, 2, 2, 1, 1),
}
STEPS = 3


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_layout_trains(name, default_data, tmp_path, request):
    if name == "tp":  # the snapshot test's reference is this run
        folder, output = request.getfixturevalue("tp_reference")
        check_layout(output, folder, LAYOUTS[name], TP_REFERENCE_STEPS)
        return
    proc = launch(
        f"train_configs/{name}.toml",
        "--model.flavor", "tiny",
        "--training.steps", str(STEPS),
        "--metrics.no_enable_wandb",
        "--dump_folder", str(tmp_path),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    check_layout(proc.stdout + proc.stderr, tmp_path, LAYOUTS[name], STEPS)
