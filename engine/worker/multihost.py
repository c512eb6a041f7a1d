"""Multi-host serving: one process per host, one global device mesh (jax.distributed).

The leader (process 0) runs the server, the scheduler and the runner; every device call its runner
makes (a step, a swap copy, a warm-up) is also published, in order, through the coordination
service's key-value store, and each follower's runner replays it, so every process enters the same
jitted programs over the global mesh. Followers only execute. Every wait has a deadline: a follower
that loses its leader exits with an error, and a process that dies is caught by the coordination
service's heartbeat (`timeout_s`), which ends the others (JAX terminates a task whose peer failed).

    leader:   python -m engine.entrypoints.serve --model=M --tensor_parallel_size=2 \\
                  --coordinator_address=HOST0:1234 --num_processes=2 --process_id=0
    follower: the same command with --process_id=1
"""

import dataclasses
import logging
import pickle
import time

import jax

log = logging.getLogger("ferry")

_PREFIX = "ferry/"
_STOP = "stop"


@dataclasses.dataclass(frozen=True, slots=True)
class DistributedConfig:
    coordinator_address: str | None = None  # host:port of process 0; None: not distributed (or the
                                            # cluster's environment, with num_processes unset too)
    num_processes: int | None = None
    process_id: int | None = None
    timeout_s: int = 120                    # start-up wait and the heartbeat deadline of a dead peer


def initialize(config: DistributedConfig) -> bool:
    """jax.distributed.initialize from `config`; False (nothing done) when not distributed."""
    if config.coordinator_address is None and config.num_processes is None:
        return False
    jax.distributed.initialize(
        config.coordinator_address, config.num_processes, config.process_id,
        initialization_timeout=config.timeout_s, heartbeat_timeout_seconds=config.timeout_s)
    log.info("jax.distributed: process %d of %d, %d local and %d global devices", jax.process_index(),
             jax.process_count(), jax.local_device_count(), jax.device_count())
    return True


def _client():
    from jax._src import distributed  # noqa: PLC0415 (the coordination service's client has no public handle)

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("jax.distributed is not initialized")
    return client


class CallChannel:
    """The leader's device calls, numbered, as pickled (op, args) in the key-value store. Only the
    processes of one job talk here, so pickle is as trusted as the code itself."""

    GC_EVERY = 64  # calls between deletions of the ones every follower has replayed

    def __init__(self):
        self.client = _client()
        self.num_processes, self.process_id = jax.process_count(), jax.process_index()
        self._next = 0
        self._deleted = 0

    # -------------------------------------------------------------- the leader

    def publish(self, op: str, args: tuple) -> None:
        self.client.key_value_set_bytes(f"{_PREFIX}call/{self._next}", pickle.dumps((op, args)))
        self._next += 1
        if self._next % self.GC_EVERY == 0:
            self._collect_garbage()

    def close(self) -> None:
        """Tell the followers to exit."""
        self.publish(_STOP, ())

    def _collect_garbage(self) -> None:
        replayed = min(self._replayed(pid) for pid in range(1, self.num_processes))
        for n in range(self._deleted, replayed):
            self.client.key_value_delete(f"{_PREFIX}call/{n}")
        self._deleted = max(self._deleted, replayed)

    def _replayed(self, pid: int) -> int:
        try:
            return int(self.client.key_value_try_get(f"{_PREFIX}done/{pid}"))
        except Exception:  # noqa: BLE001 (NOT_FOUND: it has replayed nothing yet)
            return 0

    # -------------------------------------------------------------- a follower

    def receive(self, idle_poll_s: float = 1.0) -> tuple[str, tuple]:
        """The next call; waits as long as the leader is idle, raises if the leader is gone."""
        key = f"{_PREFIX}call/{self._next}"
        while True:
            try:
                data = self.client.blocking_key_value_get_bytes(key, int(idle_poll_s * 1000))
                break
            except Exception as e:  # noqa: BLE001 (the client raises one type for every status)
                if "DEADLINE_EXCEEDED" not in str(e):
                    raise RuntimeError(f"follower {self.process_id}: lost the leader ({e})") from e
        self._next += 1
        return pickle.loads(data)

    def acknowledge(self) -> None:
        self.client.key_value_set(f"{_PREFIX}done/{self.process_id}", str(self._next), allow_overwrite=True)


def agree_min(name: str, value: int, timeout_s: float = 120) -> int:
    """The smallest of every process's `value` (e.g. KV blocks: what fits on the fullest device)."""
    client = _client()
    client.key_value_set(f"{_PREFIX}agree/{name}/{jax.process_index()}", str(int(value)))
    return min(int(client.blocking_key_value_get(f"{_PREFIX}agree/{name}/{pid}", int(timeout_s * 1000)))
               for pid in range(jax.process_count()))


def lead(engine, channel: CallChannel) -> None:
    """Make `engine` (an LLMEngine on the global mesh, in process 0) publish its device calls."""
    engine.runner.publish = channel.publish


def follow(runner, channel: CallChannel) -> None:
    """Replay the leader's device calls on this process's `runner` until it says stop."""
    replayed, started = 0, time.monotonic()
    while True:
        op, args = channel.receive()
        if op == _STOP:
            log.info("follower %d: the leader stopped after %d calls (%.0f s)", channel.process_id, replayed,
                     time.monotonic() - started)
            return
        getattr(runner, op)(*args)
        replayed += 1
        channel.acknowledge()
