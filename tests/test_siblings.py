"""A batched env's envs as its group sees them on the link (envsync/worker/siblings.py): copies of
what each was published, reached and failed, receipt acknowledged once per target, requests
seen per env, and a failure reported for exactly the envs that wait."""

from __future__ import annotations

import torch

from envsync.links.local import LocalLink
from envsync.protocol import NO_FAILURE, Kind, Request
from envsync.worker.siblings import Siblings

LEVEL = ("config", "level")


def test_siblings_read_copies_acknowledge_each_target_once_and_fail_only_what_waits() -> None:
    link = LocalLink({LEVEL: torch.tensor(0)}, 4)
    try:
        envs = Siblings(link.handle(), 1, 3)  # slots 1..3: a worker's envs after another's
        link.write(2, 1, {LEVEL: torch.tensor(5)})
        link.write(3, 2, {LEVEL: torch.tensor(6)})
        assert envs.pending().tolist() == [1, 2]
        targets, reached, failed, ran, obs = envs.versions()
        assert targets.tolist() == [0, 1, 2] and reached.tolist() == [0, 0, 0]
        targets[0] = 9  # a copy
        assert envs.versions()[0].tolist() == [0, 1, 2]

        before = envs.targets()
        envs.notice()
        assert [link.status(w).received for w in range(4)] == [0, 0, 1, 2]
        envs.notice()  # nothing new: nothing acknowledged again
        assert envs.targets().tolist() == before.tolist()

        end = link.handle().open(2)  # env 1's own receiver applies its version
        end.ack_applied(1)
        assert envs.pending().tolist() == [2]
        link.send_request([3], Request(7, Kind.ENV_STATE, {"names": []}))
        assert envs.asked().tolist() == [2]

        envs.fail_pending("the batched env's group stopped")
        assert [link.status(w).failed for w in (1, 2, 3)] == [NO_FAILURE, NO_FAILURE, 2]
        assert "group stopped" in link.error_text(3)
        assert envs.pending().tolist() == []
    finally:
        link.close()


def test_the_rows_of_a_native_env_are_acknowledged_and_failed_as_columns_without_opening_their_ends() -> None:
    """Siblings over the rows of one natively batched env (a link made with ``group=``): a
    notice acknowledges every changed row's receipt in one write, failing the pending rows
    is one write too, and no row's own end is opened (nor claimed) for either."""
    link = LocalLink({LEVEL: torch.tensor(0)}, 6, group=3)
    try:
        envs = Siblings(link.handle(), 3, 3, rows=True)  # the second worker's rows
        for slot, version in ((3, 1), (5, 2)):
            link.write(slot, version, {LEVEL: torch.tensor(version)})
        envs.notice()
        assert [link.status(w).received for w in range(6)] == [0, 0, 0, 1, 0, 2]
        envs.fail_pending("the group stopped")
        assert [link.status(w).failed for w in (3, 4, 5)] == [1, NO_FAILURE, 2]
        assert "the group stopped" in link.error_text(5)
        assert link.table.counters["pid"][3:].tolist() == [0, 0, 0]  # looked at, not claimed
    finally:
        link.close()
