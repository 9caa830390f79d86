"""The local Ray cluster the rollout workers run on, and a watchdog that ends it with the run.

`start_ray` joins a given cluster, or starts a local one: dashboard off, listening on loopback only.
Ray ties its GCS server and raylet to the driver (PR_SET_PDEATHSIG), so they die with the run even
after SIGKILL. The raylet's two agents do not: Ray starts a dashboard agent and a runtime-env agent
whatever `include_dashboard` says (no `ray.init` option leaves them out), and after the raylet's death
they spend about 60 s trying to report it to the GCS server, which is gone too, before they exit
(measured after `kill -9` of a run: both alive, about 180 MB, 60 s later).

So on Linux a local cluster comes with a watchdog: a small Python process (it imports nothing of tlt,
torch or Ray) that holds the read end of a pipe whose write end only the driver holds. However the
driver ends, the pipe then reads EOF, and the watchdog kills every process the cluster's start created
that is still alive. They are recorded at start as (pid, start time), so a pid the system has since
reused is never hit; the agents are all there by then (the raylet starts them before `ray.init`
returns), and the actors' worker processes exit on their own when the raylet dies. Elsewhere (no
/proc) nothing is recorded and Ray's own clean-up is all there is.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Callable

# Waits for EOF on stdin, then SIGKILLs each "pid:starttime" of argv whose start time still matches.
WATCHDOG = """
import os, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)
procs = [tuple(int(x) for x in a.split(":")) for a in sys.argv[1:]]
while True:
    try:
        if not os.read(0, 4096):
            break
    except InterruptedError:
        continue
for pid, start in procs:
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        if int(stat[stat.rindex(")") + 2:].split()[19]) == start:
            os.kill(pid, signal.SIGKILL)
    except (OSError, ValueError):
        pass
"""


def start_ray(address: str | None, cpus: int | None = None, log: Callable[[str], None] = print) -> None:
    """Join `address`, or start a local cluster (dashboard off, loopback only, ended with this process)
    once per process."""
    import ray

    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a loopback-only local cluster needs no token
    if address:
        log(f"joining the Ray cluster at {address}")
        ray.init(address=address, log_to_driver=False)
        return
    cpus = cpus or os.cpu_count() or 1
    log(f"starting a local Ray cluster ({cpus} CPUs, dashboard off, loopback only; this takes about 10 s)")
    start = time.perf_counter()
    before = set(descendants(os.getpid()))
    ray.init(num_cpus=cpus, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False,
             configure_logging=False)
    started = {pid: t for pid, t in descendants(os.getpid()).items() if pid not in before}
    if started:
        watch(started)
    log(f"Ray cluster up in {time.perf_counter() - start:.1f} s")


def descendants(root: int) -> dict[int, int]:
    """{pid: start time in clock ticks} of every live descendant of process `root` ({} without /proc)."""
    parents, starts = {}, {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return {}
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:  # it exited while we looked
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # the command name may hold spaces and parentheses
        parents.setdefault(int(fields[1]), []).append(int(name))
        starts[int(name)] = int(fields[19])
    out, todo = {}, [root]
    while todo:
        for child in parents.get(todo.pop(), []):
            out[child] = starts[child]
            todo.append(child)
    return out


def watch(processes: dict[int, int]) -> subprocess.Popen:
    """Start the watchdog for `processes` ({pid: start time}); it kills them once this process is gone.
    The pipe's write end stays with this process only (pipes are not inherited), and the watchdog runs
    in a session of its own, so a Ctrl-C in the terminal reaches the run, which shuts Ray down itself."""
    read, write = os.pipe()
    try:
        process = subprocess.Popen([sys.executable, "-c", WATCHDOG, *(f"{p}:{t}" for p, t in processes.items())],
                                   stdin=read, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                   start_new_session=True)
    finally:
        os.close(read)
    _WATCHDOGS.append((process, write))  # the write end must stay open as long as this process lives
    return process


_WATCHDOGS: list = []
