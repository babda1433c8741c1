"""kit.recipe.optim: the optimizer step and clipping on FSDP2's local shards compute what torch's
AdamW and clip_grad_norm_ compute, and keep the same optimizer state (checkpoints)."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_shard_adamw_and_clip_match_torch_on_two_ranks():
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         str(ROOT / "tests" / "optim_ranks.py")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["world"] == 2 and got["shard_path"]  # the shards' path ran, not torch's own
    # The global norm is the same over the two ranks' shards, before and after clipping bites
    # (step 1's loss is 10x: its norm is clipped to 0.5).
    for kit, ref in zip(got["kit_norms"], got["torch_norms"], strict=True):
        assert abs(kit - ref) <= 1e-6 * max(1.0, ref), (got["kit_norms"], got["torch_norms"])
    assert max(got["torch_norms"]) > 0.5 > min(got["torch_norms"])
    # Four steps of AdamW with weight decay on the clipped gradients: the same parameters.
    assert got["max_param_diff"] < 1e-6, got["max_param_diff"]
    # The optimizer state as torch.distributed.checkpoint sees it: the same keys and tensor
    # types (DTensors) for the two trainable weights and two biases, four steps each.
    assert got["same_state_layout"] and got["state_entries"] == 5 and got["steps"] == [4.0]
