"""The second process of the resume test: a new sender loads a checkpoint, then builds the
collector; prints each worker's first frame and transform state as JSON."""

from __future__ import annotations

import json
import multiprocessing as mp
import sys
from functools import partial

import torch
from helpers import make_vecnorm_env
from torchrl.collectors import MultiSyncCollector

from envsync import EnvStateSender


def main(path: str) -> None:
    mp.set_start_method("fork", force=True)
    sender = EnvStateSender(config={"difficulty": 0.0}, apply="set_difficulty", apply_at="step")
    sender.load_state_dict(torch.load(path, weights_only=False))
    collector = MultiSyncCollector(
        [sender.env_fn(partial(make_vecnorm_env, i)) for i in range(2)],
        None,
        frames_per_batch=4,
        total_frames=-1,
        weight_sync_schemes=sender.schemes(),
    )
    try:
        batch = next(iter(collector))
        stats = sender.gather(["stats"])
        out = {
            "difficulty": batch["observation"][:, 0, 0].tolist(),
            "count": stats["stats", "0", "observation", "count"].tolist(),
            "mean": stats["stats", "0", "observation", "mean"].tolist(),
        }
    finally:
        collector.shutdown()
        sender.close()
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
