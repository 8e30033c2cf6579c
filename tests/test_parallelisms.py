"""Each shipped parallel layout trains for a few steps on CPU through the launcher (torchrun + gloo)."""

from __future__ import annotations

import math

import pytest

from conftest import launch, read_metrics

pytestmark = pytest.mark.multiprocess

LAYOUTS = {
    # config: (world size, dp_replicate, dp_shard, tp, pp)
    "debug_model": (2, 1, 2, 1, 1),  # FSDP2
    "tp": (2, 1, 1, 2, 1),
    "pp": (2, 1, 1, 1, 2),
    "fsdp_tp": (4, 1, 2, 2, 1),
    "fsdp_pp": (4, 1, 2, 1, 2),
    "tp_pp": (4, 1, 1, 2, 2),
    "hsdp": (4, 2, 2, 1, 1),
}
STEPS = 3


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_layout_trains(name, default_data, tmp_path):
    world, replicate, shard, tp, pp = LAYOUTS[name]
    proc = launch(
        f"train_configs/{name}.toml",
        "--model.flavor", "tiny",
        "--training.steps", str(STEPS),
        "--metrics.no_enable_wandb",
        "--dump_folder", str(tmp_path),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    expected = f"Layout(world_size={world}, dp_replicate={replicate}, dp_shard={shard}, cp=1, tp={tp}, pp={pp})"
    assert expected in proc.stdout + proc.stderr  # the mesh really had this shape
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    losses = [r["loss_metrics/global_avg_loss"] for r in records]
    assert all(math.isfinite(x) for x in losses)
    assert abs(losses[0] - math.log(2048)) < 1.5  # an untrained model over a 2048-token vocabulary
    assert all(r["grad_norm"] > 0 for r in records)
