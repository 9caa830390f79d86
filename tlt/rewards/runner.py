"""`RewardRunner`: scores a batch with a reward function so that one bad row, or one hung call,
costs that row's reward and not the run.

The batch is cut into calls of `chunk_size` rows (by default one call per worker, or the whole batch
in-process); each call gets TRL's arguments, `f(prompts, completions, **columns, **reward_kwargs)`.
A call fails when it raises, returns something that is not a list of one value per row, or its worker
dies; a failed call of several rows is retried row by row, so only the rows that fail alone get 0.0.
A value that is not a finite number, or one too large for float32, fails its row only. A call still
running after `timeout_s` gets 0.0 for all its rows without a retry (a retry could hang as long
again): its worker is killed and a fresh one started. Every zero from a failure comes with an error
string in `RewardResult.errors` that names the row by its source and says what went wrong; the others
are None.

`workers=0` runs the function in this process: no start-up cost and any callable works, but nothing
can stop a call that hangs, so there is no timeout. `workers >= 1` runs it in worker processes made
with "spawn": the trainer holds torch threads and perhaps CUDA, which a forked child must not
inherit. A spec string (a registered name or `module:function`) is sent to the workers, which import
it themselves; spawned children get this process's `sys.path`, so a module that imports here imports
there. A callable is sent by reference, which works for module-level functions only. As with any
spawn pool, a script that starts one needs an `if __name__ == "__main__":` guard.

Between processes only plain records travel: the spec and keyword arguments once per worker, then
(prompts, completions, columns) per call and an `_Outcome` back.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import numbers
import pickle
import signal
import threading
import time
from collections import deque
from collections.abc import Mapping, Set
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import NamedTuple, Sequence

import numpy as np

from tlt.errors import ConfigError, TrainingError
from tlt.rewards.registry import RewardFn, get_reward

_START_TIMEOUT_S = 300.0  # a spawned worker imports torch via tlt; a slow disk can take a while
_STOP_TIMEOUT_S = 5.0
_REWARD_MAX = float(np.finfo(np.float32).max)  # rewards become a float32 tensor in the trainer


@dataclass
class RewardResult:
    """One reward per row (0.0 where it failed), the error per row (None where it did not), the wall
    time of the scoring in seconds, and one message per failure: a call that failed as a whole (a
    timeout) names its rows once, a row that failed alone is one message."""

    rewards: list[float]
    errors: list[str | None]
    seconds: float
    failures: list[str] = field(default_factory=list)


class _Outcome(NamedTuple):
    """What one call gave: `failure` says why the whole call failed (its values are then all 0.0);
    otherwise `errors` holds per-row problems with the values. `retry` is False for a failure that
    retrying row by row cannot help (a timeout); `fatal` marks a `ConfigError` from the function,
    a setup that no row can be scored under, which `score` raises."""

    values: list[float]
    errors: list[str | None]
    failure: str | None = None
    retry: bool = True
    fatal: bool = False


def _failed(rows: int, why: str, retry: bool = True, fatal: bool = False) -> _Outcome:
    return _Outcome([0.0] * rows, [None] * rows, why, retry, fatal)


def _invoke(fn: RewardFn, kwargs: dict, prompts: list, completions: list, columns: dict[str, list]) -> _Outcome:
    """Call the reward function once and check what it returned; never raises for the function's sake."""
    n = len(prompts)
    try:
        returned = fn(prompts, completions, **columns, **kwargs)
    except ConfigError as exc:
        return _failed(n, str(exc), retry=False, fatal=True)
    except (Exception, SystemExit) as exc:  # sys.exit() in a reward (or a library it calls) fails its rows, not the run
        return _failed(n, f"raised {type(exc).__name__}: {exc}")
    # A string would be read as one value per character, a mapping as its keys, a set out of order
    if isinstance(returned, (str, bytes, Mapping, Set)):
        return _failed(n, f"returned {type(returned).__name__} {_short(returned)}, not a list of {n} values")
    try:
        values = list(returned)
    except TypeError:
        return _failed(n, f"returned {type(returned).__name__}, not a list of {n} values")
    if len(values) != n:
        return _failed(n, f"returned {len(values)} values for {n} rows")
    checked = [_reward_value(v) for v in values]
    return _Outcome([0.0 if why else r for r, why in checked], [why for _, why in checked])


def _short(value: object, width: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= width else text[:width] + "..."


def _reward_value(value: object) -> tuple[float, str | None]:
    """(a returned value as a float, None), or (0.0, why it is no reward): not a finite real number,
    or one beyond float32's range, which the trainer's float32 rewards tensor would turn into inf."""
    returned = value
    if hasattr(value, "item") and not isinstance(value, numbers.Real):  # a 0-d torch tensor or numpy array
        try:
            value = value.item()
        except (ValueError, RuntimeError):
            pass
    if not isinstance(value, numbers.Real):
        return 0.0, f"returned {_short(returned)}, not a finite number"
    try:
        number = float(value)
    except OverflowError:  # an int or Fraction past float64's range
        number = math.inf if value > 0 else -math.inf
    if math.isnan(number) or (math.isinf(number) and not isinstance(value, numbers.Rational)):
        return 0.0, f"returned {_short(returned)}, not a finite number"
    if abs(number) > _REWARD_MAX:
        return 0.0, (f"returned {_short(returned)}, too large for the float32 tensor rewards are held in "
                     f"(at most {_REWARD_MAX:.4g} in size)")
    return number, None


def _serve(conn: Connection, spec: str | RewardFn, kwargs: dict) -> None:
    """A worker's loop: resolve the reward, say "ready" (or why not), then answer calls until None."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # when started from a thread, the parent could not
    try:
        fn = get_reward(spec)
    except Exception as exc:
        conn.send(f"{type(exc).__name__}: {exc}")
        return
    conn.send(None)
    while (call := conn.recv()) is not None:
        conn.send(_invoke(fn, kwargs, *call))


class _Worker:
    """One spawned worker process and its end of the pipe. It ignores SIGINT: a Ctrl-C in the terminal
    reaches the whole process group, and the trainer, not each worker, handles it (closing the pool);
    a worker would otherwise print its own KeyboardInterrupt traceback. The child is started with SIGINT
    ignored, so it stays ignored from the interpreter's start (Python installs its handler only over the
    default), through the imports, before `_serve` runs."""

    def __init__(self, ctx, spec: str | RewardFn, kwargs: dict):
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child, spec, kwargs), daemon=True)
        main = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
        try:
            self.process.start()
        finally:
            if main:
                signal.signal(signal.SIGINT, previous)
        child.close()
        self.started = time.monotonic()
        self.ready = False

    def kill(self) -> None:
        self.process.kill()
        self.process.join()
        self.conn.close()


class RewardRunner:
    """Scores batches with the reward `spec` (a name, `module:function`, or a callable), in this
    process (`workers=0`) or in `workers` processes with a per-call `timeout_s`. `chunk_size` rows go
    to one call; `reward_kwargs` are passed to every call."""

    def __init__(self, spec: str | RewardFn, workers: int = 0, timeout_s: float = 30.0,
                 chunk_size: int | None = None, **reward_kwargs: object):
        if not isinstance(workers, int) or workers < 0:
            raise ConfigError(f"reward workers {workers!r}: expected an integer >= 0")
        if not timeout_s > 0:
            raise ConfigError(f"reward timeout_s {timeout_s!r}: expected a positive number of seconds")
        if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
            raise ConfigError(f"reward chunk_size {chunk_size!r}: expected a positive integer or None")
        self.fn = get_reward(spec)  # here first, so a typo fails before any worker starts
        self.name = spec if isinstance(spec, str) else getattr(spec, "__qualname__", repr(spec))
        self.workers, self.timeout_s, self.chunk_size, self.kwargs = workers, timeout_s, chunk_size, reward_kwargs
        self._pool: list[_Worker] = []
        if workers:
            try:
                pickle.dumps((spec, reward_kwargs))
            except Exception as exc:
                raise ConfigError(f"reward {self.name!r}: cannot be sent to worker processes ({exc}); give it as "
                                  "'module:function' with picklable keyword arguments, or use workers=0") from exc
            self._ctx = mp.get_context("spawn")
            self._spec = spec
            self._pool = [_Worker(self._ctx, spec, reward_kwargs) for _ in range(workers)]

    def score(self, prompts: Sequence, completions: Sequence, columns: dict[str, Sequence],
              sources: Sequence[str] | None = None) -> RewardResult:
        """Rewards of `completions` for `prompts`; `columns` are lists aligned with them, and
        `sources` name the rows in error messages (by default "row i")."""
        if self.workers and not self._pool:
            raise RuntimeError(f"reward runner for {self.name!r} is closed")
        start = time.perf_counter()
        n = len(prompts)
        sources = list(sources) if sources is not None else [f"row {i}" for i in range(n)]
        for name, values in {"completions": completions, "sources": sources, **columns}.items():
            if len(values) != n:
                raise ConfigError(f"reward {self.name!r}: {name!r} has {len(values)} entries for {n} prompts")
        batch = (list(prompts), list(completions), {k: list(v) for k, v in columns.items()})
        size = self.chunk_size or max(1, -(-n // max(self.workers, 1)))
        calls = [list(range(i, min(i + size, n))) for i in range(0, n, size)]
        result = RewardResult([0.0] * n, [None] * n, 0.0)
        retries = []
        for rows, outcome in zip(calls, self._run(calls, batch)):
            if outcome.failure is not None and outcome.retry and len(rows) > 1:
                retries.extend([i] for i in rows)
            else:
                self._record(rows, outcome, sources, result)
        for rows, outcome in zip(retries, self._run(retries, batch)):
            self._record(rows, outcome, sources, result)
        result.seconds = time.perf_counter() - start
        return result

    def _record(self, rows: list[int], outcome: _Outcome, sources: list[str], result: RewardResult) -> None:
        if outcome.fatal:
            raise ConfigError(f"reward {self.name!r}: {outcome.failure}")
        if outcome.failure is not None:
            result.failures.append(f"{_names(rows, sources)}: reward {self.name!r} {outcome.failure}")
        for i, value, error in zip(rows, outcome.values, outcome.errors):
            result.rewards[i] = value
            why = outcome.failure or error
            if why is not None:
                together = f" (in a call with rows {_names(rows, sources)})" if len(rows) > 1 else ""
                result.errors[i] = f"{sources[i]}: reward {self.name!r} {why}{together}"
            if outcome.failure is None and error is not None:
                result.failures.append(result.errors[i])

    def _run(self, calls: list[list[int]], batch: tuple) -> list[_Outcome]:
        """The outcome of each call (a list of row indices into `batch`), in order."""
        if not self.workers:
            return [_invoke(self.fn, self.kwargs, *_select(batch, rows)) for rows in calls]
        outcomes: list[_Outcome | None] = [None] * len(calls)
        pending = deque(range(len(calls)))
        busy: dict[int, tuple[int, float]] = {}  # worker slot -> (call, deadline)
        while pending or busy:
            for slot, worker in enumerate(self._pool):
                if pending and worker.ready and slot not in busy:
                    call = pending.popleft()
                    try:
                        worker.conn.send(_select(batch, calls[call]))
                    except OSError:  # it died while idle (killed from outside): not the call's fault
                        self._restart(slot)
                        pending.appendleft(call)
                        continue
                    busy[slot] = (call, time.monotonic() + self.timeout_s)
            starting = [s for s, w in enumerate(self._pool) if not w.ready]
            deadlines = [d for _, d in busy.values()] + [self._pool[s].started + _START_TIMEOUT_S for s in starting]
            wait([self._pool[s].conn for s in [*busy, *starting]], timeout=max(0.0, min(deadlines) - time.monotonic()))
            for slot in starting:
                self._check_started(slot)
            for slot, (call, deadline) in list(busy.items()):
                outcome = self._collect(slot, len(calls[call]), deadline)
                if outcome is not None:
                    outcomes[call] = outcome
                    del busy[slot]
        return outcomes

    def _collect(self, slot: int, rows: int, deadline: float) -> _Outcome | None:
        """The outcome of the call running in `slot` if it is over (answered, crashed or past its
        deadline; the last two restart the worker), None while it may still answer."""
        worker = self._pool[slot]
        if worker.conn.poll():
            try:
                return worker.conn.recv()
            except (EOFError, OSError):
                code = self._restart(slot)
                return _failed(rows, f"crashed its worker process (exit code {code})")
        if time.monotonic() >= deadline:
            self._restart(slot)
            return _failed(rows, f"timed out after {self.timeout_s:g} s; its worker process was restarted", retry=False)
        return None

    def _check_started(self, slot: int) -> None:
        """Mark a starting worker ready once it says so. If it cannot resolve the reward, died or is
        still not up after `_START_TIMEOUT_S`, no row could be scored at all: kill every worker (so
        no answer to an abandoned call is read later as another's) and raise."""
        worker = self._pool[slot]
        problem = None
        if worker.conn.poll():
            try:
                problem = worker.conn.recv()
            except (EOFError, OSError):
                worker.process.join()
                problem = f"the process exited with code {worker.process.exitcode}"
            if problem is None:
                worker.ready = True
                return
        elif time.monotonic() - worker.started > _START_TIMEOUT_S:
            problem = f"it did not start in {_START_TIMEOUT_S:g} s"
        if problem is not None:
            for other in self._pool:
                other.kill()
            self._pool = []
            raise TrainingError(f"reward {self.name!r}: a worker process cannot load it ({problem})")

    def _restart(self, slot: int) -> int | None:
        """Kill the worker in `slot` and start a fresh one there; the old one's exit code."""
        old = self._pool[slot]
        old.kill()
        self._pool[slot] = _Worker(self._ctx, self._spec, self.kwargs)
        return old.process.exitcode

    def close(self) -> None:
        """Stop the worker processes (those that do not stop in a few seconds are killed)."""
        for worker in self._pool:
            try:
                worker.conn.send(None)
            except OSError:
                pass
        for worker in self._pool:
            worker.process.join(_STOP_TIMEOUT_S)
            worker.kill()
        self._pool = []

    def __enter__(self) -> RewardRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _select(batch: tuple, rows: list[int]) -> tuple[list, list, dict[str, list]]:
    prompts, completions, columns = batch
    return [prompts[i] for i in rows], [completions[i] for i in rows], {k: [v[i] for i in rows] for k, v in columns.items()}


def _names(rows: list[int], sources: list[str], shown: int = 3) -> str:
    names = ", ".join(sources[i] for i in rows[:shown])
    return names + (f" and {len(rows) - shown} more" if len(rows) > shown else "")
