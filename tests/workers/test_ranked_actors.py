"""The failure words every group shares (`workers.group.ranked.RankedActors`, the base of WorkerGroup and
RolloutGroup), without a cluster: which of several failed ranks an error names, in what words, with which
log lines, and which errors a rollout group passes on as they are. The same words on real actors:
tests/workers/test_group.py, tests/driver/test_failures.py, tests/rollout/test_weight_sync.py."""

from __future__ import annotations

import ray
from ray.exceptions import ActorDiedError

from workers.group.errors import WorkerDiedError, WorkerGroupError
from workers.group.ranked import RankedActors


class Ranks(RankedActors):
    """Two ranks of role `role` that reported their node and pid, each logging to a file under `log_dir`."""

    def __init__(self, role: str, log_dir) -> None:
        self.role, self.name = role, role
        self.names = [f"{role}/dp0-tp0-pp0", f"{role}/dp1-tp0-pp0"]
        self.infos = [{"node_ip": "127.0.0.1", "node_id": "", "pid": 4240 + r} for r in range(2)]
        self.logs = [log_dir / f"{r}.log" for r in range(2)]
        for r, path in enumerate(self.logs):
            path.write_text(f"rank {r} started\nrank {r} working\n")
        self._use_pool(None, 1.0, 0.0)

    def ranks_role(self) -> str:
        return self.role

    def rank_log(self, rank: int) -> str:
        return str(self.logs[rank])


class WrappedError(Exception):
    """What a Ray task error looks like from the driver: the user's exception in `cause`."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(f"wrapped: {cause}")
        self.cause = cause


def test_a_dead_rank_is_named_before_one_that_raised(tmp_path):
    ranks = Ranks("policy", tmp_path)
    failures = [(0, RuntimeError("boom")), (1, ActorDiedError())]
    err, rank, died = ranks._failure_error("policy.train", failures, WorkerDiedError, WorkerGroupError)
    assert (rank, died, type(err)) == (1, True, WorkerDiedError)
    msg = str(err)
    assert msg.startswith("policy.train failed on role 'policy' rank 1 (policy/dp1-tp0-pp0) on node 127.0.0.1")
    assert "pid 4241: the actor died (ActorDiedError" in msg
    assert "(also failed on ranks [0])" in msg
    assert f"--- last log lines of policy/dp1-tp0-pp0 ({ranks.logs[1]}) ---\nrank 1 started\nrank 1 working" in msg
    assert "rank 0 working" not in msg  # only the named rank's log
    assert isinstance(err.__cause__, ActorDiedError)


def test_a_raising_rank_names_the_exception_inside_the_wrapper_and_errors_of_its_own_pass(tmp_path):
    ranks = Ranks("rollout", tmp_path)
    kw = dict(cause=lambda e: getattr(e, "cause", None) or e,
              passthrough=lambda e: e.cause if isinstance(getattr(e, "cause", None), ValueError) else None)
    err, rank, died = ranks._failure_error("rollout.generate", [(1, WrappedError(KeyError("k")))],
                                           WorkerDiedError, WorkerGroupError, **kw)
    assert (rank, died, type(err)) == (1, False, WorkerGroupError)
    assert str(err).startswith("rollout.generate failed on role 'rollout' rank 1 (rollout/dp1-tp0-pp0) on node "
                               "127.0.0.1 (), pid 4241: KeyError: 'k'")
    bad_input = ValueError("prompt 3 is empty")
    err, _, _ = ranks._failure_error("rollout.generate", [(0, WrappedError(bad_input))], WorkerDiedError,
                                     WorkerGroupError, **kw)
    assert err is bad_input and isinstance(err.__cause__, WrappedError)


def test_without_a_pool_a_rank_is_placed_wherever_ray_puts_it_and_named_as_given(tmp_path):
    ranks = Ranks("critic", tmp_path)
    assert ranks._reserve(0, "critic rank 0") == {}
    assert ranks._at_nodes(ranks.names) == ranks.names
    ranks._release()  # nothing booked: nothing to give back, twice
    ranks._release()
    assert not ray.is_initialized()  # none of this needed a cluster
