"""Data-parallel policy updates over N processes with torch.distributed (`trainer_processes=N`).

The trainer's own process is rank 0 and does everything it does alone: rollout, reward, eval,
checkpoints, metrics. Ranks 1..N-1 are helpers it spawns; each holds a policy replica and an identical
AdamW optimizer, and never builds a rollout engine. At start, and after a resume, rank 0 broadcasts its
parameters and optimizer state, so every rank begins from the same weights and moments.

Each update rank 0 broadcasts the learn samples (`update.Sample`: token ids, advantages, old and
reference log-probs) and the learning rate; every rank runs its share of each mini-batch slice with
the slice's global token weights, the gradients are all-reduced with SUM, and every rank clips and
steps alike (`update.update_policy`). SUM is exact, not an approximation of averaging: the loss is a
sum of per-token terms whose weights already normalise over the whole slice, so the gradient of the
slice is the sum of its responses' gradients however they are divided among ranks. The replicas thus
stay equal up to float summation order; with identical reduced gradients they stay bit-identical, and
a cheap per-parameter checksum is compared every `CHECK_EVERY` updates.

Helpers sit idle through rollout, eval and checkpoints, which can last longer than any sensible
collective timeout, so they wait for their next command on a pipe (no timeout; EOF when rank 0 is
gone) and enter a collective only when rank 0 does. The process group's `TIMEOUT` then only bounds
waits inside real work, and a helper that dies breaks rank 0's collective at once (the TCP peer
closes), which rank 0 reports as a TrainingError naming the rank. Gloo on CPU, NCCL (one GPU per
rank) when the policy is on CUDA.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import time

import torch
import torch.distributed as dist

from tlt.errors import ConfigError, TltError, TrainingError
from tlt.rl.config import TrainConfig
from tlt.rl.update import Diverged, Sample, build_optimizer, update_policy

TIMEOUT = datetime.timedelta(seconds=600)
CHECK_EVERY = 10  # updates between parameter checksums across ranks


def process_threads(config: TrainConfig) -> int:
    """Torch threads per trainer process during the update: the cores split evenly over the processes."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, (config.threads or cores) // config.trainer_processes)


class Replicas:
    """Rank 0's handle on the helper processes: `update`, `sync`, `check` and `close` each run the
    same collectives on every rank, woken through the helpers' pipes."""

    def __init__(self, config: TrainConfig, policy: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        import torch.multiprocessing as mp

        world = self.world = config.trainer_processes
        self.config, self.threads, self.updates = config, process_threads(config), 0
        cuda = policy.device.type == "cuda"
        if dist.is_initialized():
            raise ConfigError("trainer_processes > 1 starts its own torch.distributed process group, but this "
                              "process already has one; run with trainer_processes=1")
        if cuda and world > torch.cuda.device_count():
            raise ConfigError(f"field 'trainer_processes' ({world}) needs one GPU per process; "
                              f"{torch.cuda.device_count()} are visible")
        backend = "nccl" if cuda else "gloo"
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        context = mp.get_context("spawn")
        self.helpers: list[tuple[int, object, object]] = []  # (rank, process, rank 0's end of its pipe)
        for rank in range(1, world):
            ours, theirs = context.Pipe()
            device = f"cuda:{((policy.device.index or 0) + rank) % torch.cuda.device_count()}" if cuda else "cpu"
            process = context.Process(target=_helper, args=(rank, world, backend, port, config, device, theirs),
                                      name=f"tlt-trainer-rank{rank}", daemon=True)
            process.start()
            theirs.close()
            self.helpers.append((rank, process, ours))
        try:
            self._wait_ready()
            with self._guard("start-up"):
                dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=world,
                                        timeout=TIMEOUT)
                _sync(policy, optimizer)
        except BaseException:
            self.close()
            raise

    def update(self, policy, optimizer, samples: list[Sample], lr: float) -> dict:
        """`update_policy` over every rank, rank 0 running with its share of the cores."""
        with self._guard("the update"):
            self._ring("update")
            with _num_threads(self.threads):
                out = _update(policy, optimizer, self.config, (samples, lr))
            self.updates += 1
            if self.updates % CHECK_EVERY == 0:
                self._check(policy)
        return out

    def sync(self, policy, optimizer) -> None:
        """Send rank 0's parameters and optimizer state to every helper (after loading a checkpoint)."""
        with self._guard("the weight sync"):
            self._ring("sync")
            _sync(policy, optimizer)

    def check(self, policy) -> None:
        """Raise TrainingError when a helper's parameters differ from rank 0's."""
        with self._guard("the parameter check"):
            self._check(policy)

    def _check(self, policy) -> None:
        self._ring("check")
        ours, *theirs = _checksums(policy)
        for rank, sums in enumerate(theirs, 1):
            if not torch.allclose(sums, ours, rtol=1e-5, atol=1e-8):
                raise TrainingError(f"trainer rank {rank}'s parameters drifted from rank 0's (largest difference "
                                    f"of a parameter's sum {float((sums - ours).abs().max()):.3g})")

    def close(self) -> None:
        """Stop the helpers and leave the process group; a helper that does not stop is terminated."""
        for _, process, conn in self.helpers:
            with contextlib.suppress(OSError):
                if process.is_alive():
                    conn.send("stop")
        if dist.is_initialized():
            dist.destroy_process_group()
        for _, process, conn in self.helpers:
            process.join(30)
            if process.is_alive():
                process.terminate()
                process.join()
            conn.close()
        self.helpers = []

    def _wait_ready(self) -> None:
        """Wait until every helper has built its replica, so that one failing to (a bad model, out of
        memory) is reported at once rather than after the rendezvous times out."""
        for rank, process, conn in self.helpers:
            while not conn.poll(0.1):
                if not process.is_alive():
                    break
            try:
                conn.recv()
            except EOFError:
                process.join(5)
                raise TrainingError(_dead_message([(rank, process.exitcode)], "during start-up")) from None

    def _ring(self, command: str) -> None:
        dead = self._dead()
        if dead:
            raise TrainingError(_dead_message(dead, f"before {command}"))
        for _, _, conn in self.helpers:
            conn.send(command)

    def _dead(self, wait_s: float = 0.0) -> list[tuple[int, int]]:
        """(rank, exit code) of the helpers that have exited, waiting up to `wait_s` for one to."""
        deadline = time.monotonic() + wait_s
        while True:
            dead = [(rank, process.exitcode) for rank, process, _ in self.helpers if not process.is_alive()]
            if dead or time.monotonic() >= deadline:
                return dead
            time.sleep(0.05)

    @contextlib.contextmanager
    def _guard(self, what: str):
        """Turn a collective broken by a helper's death into a TrainingError naming the rank."""
        try:
            yield
        except TltError:
            raise
        except Exception as exc:
            dead = self._dead(wait_s=5.0)  # the peer's socket closes a moment before its process is reaped
            if dead:
                raise TrainingError(_dead_message(dead, f"during {what}")) from exc
            raise


def _dead_message(dead: list[tuple[int, int]], when: str) -> str:
    ranks = ", ".join(f"rank {rank} (exit code {code})" for rank, code in dead)
    return f"trainer helper process {ranks} exited {when}; its output above says why"


@contextlib.contextmanager
def _num_threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# --- the collectives: every rank calls each with the same arguments but rank 0's payload -------------
def _sync(policy, optimizer) -> None:
    """Every rank takes rank 0's parameters and optimizer state."""
    with torch.no_grad():
        for p in policy.parameters():
            flat = p.detach().contiguous()  # collectives take contiguous tensors; CPU weights are column-major
            dist.broadcast(flat, src=0)
            p.copy_(flat)  # through the parameter, so its version moves and fused inference weights follow
    box = [optimizer.state_dict() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    if dist.get_rank() != 0:
        optimizer.load_state_dict(box[0])


def _update(policy, optimizer, config: TrainConfig, payload: tuple[list[Sample], float] | None) -> dict:
    box = [payload]
    dist.broadcast_object_list(box, src=0)
    samples, lr = box[0]
    return update_policy(policy, optimizer, config, samples, lr, dist.get_rank(), dist.get_world_size())


def _checksums(policy) -> list[torch.Tensor]:
    """Per-parameter sums [P] of every rank, in rank order."""
    sums = torch.stack([p.detach().double().sum() for p in policy.parameters()])  # [P]
    gathered = [torch.empty_like(sums) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, sums)
    return gathered


def _helper(rank: int, world: int, backend: str, port: int, config: TrainConfig, device: str, conn) -> None:
    """A helper's life: build the replica, join the group, take rank 0's state, then serve commands."""
    from tlt.model import load_model

    torch.set_num_threads(process_threads(config))
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    policy = load_model(config.model, device=device).train()
    optimizer = build_optimizer(policy, config.optim)
    conn.send("ready")
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=TIMEOUT)
    commands = {
        "update": lambda: _update(policy, optimizer, config, None),
        "sync": lambda: _sync(policy, optimizer),
        "check": lambda: _checksums(policy),
    }
    try:
        _sync(policy, optimizer)
        while True:
            try:
                command = conn.recv()
            except EOFError:  # rank 0 is gone
                return
            if command == "stop":
                return
            try:
                commands[command]()
            except Diverged:  # rank 0 saw the same reduced value, raised it and stops training
                pass
    finally:
        dist.destroy_process_group()
