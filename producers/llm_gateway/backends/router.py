"""The router: the gateway's one backend, over one or more replicas of a kind (model copies or upstream servers).

Routing. A call with an affinity (the rollout id of ``/rollout/{id}/...``) goes to the replica that served that
rollout before, while that replica is up, so an upstream's prefix cache holds the rollout's growing prompt; any
other call, and a rollout's first, goes to the replica with the fewest calls in flight (ties in turn).

Health. A call that fails because of its replica (unreachable, too slow, a 5xx: ``REPLICA_FAILURE_KINDS``) takes
the replica out and is sent to another, up to ``FULMEN_LLM_REPLICA_ATTEMPTS`` replicas. The gateway asks the
upstream for the whole answer before it sends the agent a byte (it streams the recorded answer itself), so a
retried call has returned nothing yet, and the agent gets one answer and the store one span. A replica taken out
is probed again after ``FULMEN_LLM_REPLICA_RETRY_S``, doubled per failed probe up to ``_RETRY_MAX_S``; once it
answers it is brought to the version the others serve before calls reach it.

Versions. A new version rolls over the replicas: those that load beside the weights they serve (an in-process
copy, a LoRA adapter) load at once while serving; those that replace weights in place (vLLM's full-weight reload)
go one at a time: no new calls, the calls in flight finish on the version they started with, load, confirm,
serve again. While the roll is under way replicas serve different versions; every call records the version of
the replica that served it (an upstream vLLM reports it per choice, and that report wins), so no transition is
ever labelled with a version that did not produce it. :attr:`ReplicaRouter.model_version`, which ``/v1/models``
announces and the models follower compares with, is the oldest version a live replica serves: a version is
announced once every live replica confirmed it. A replica that refuses a version keeps serving its previous one;
one whose state is unknown after a failed load is out until a load succeeds.

Agents' adapters (``ModelVersion.adapter``: ``FULMEN_TRAIN_ADAPTERS=per_agent``) load beside the model on every live
replica at once, never drained; a replica that comes back loads the model's target and then every adapter's.
:meth:`ReplicaRouter.adapter_version` is, like ``model_version``, the oldest version of that adapter a live
replica serves. A call that names an agent (``ChatRequest.agent``) gets that agent's adapter on the replica that
serves it, and the model's own weights on a replica that has none (the call's result says which).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from fulmen.infra.retry import backoff_s
from fulmen.producers.llm_gateway.backends.base import (
    REPLICA_FAILURE_KINDS,
    CallResult,
    Replica,
    ReplicaUnavailableError,
    VersionRefusedError,
)
from fulmen.producers.llm_gateway.protocol import ApiError, ChatRequest, CompletionRequest
from fulmen.producers.llm_gateway.settings import LlmSection
from fulmen.schemas import ModelVersion
from fulmen.schemas.errors import ConfigurationError

__all__ = ["ReplicaRouter", "ReplicaState"]

log = logging.getLogger(__name__)

_STICKY_ROLLOUTS = 65536  # rollouts remembered (least recently used forgotten first)


class ReplicaState(StrEnum):
    UP = "up"  # takes calls
    DRAINING = "draining"  # takes no new calls: its weights are being replaced
    DOWN = "down"  # failed: probed again at ``retry_at``


@dataclass
class _Slot:
    index: int
    replica: Replica
    state: ReplicaState = ReplicaState.UP
    in_flight: int = 0
    failures: int = 0  # consecutive, for the probe backoff
    retry_at: float = 0.0
    reason: str = ""
    refused: int | None = None  # the last version it refused (it serves an older one on purpose)
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one load or probe at a time

    def __post_init__(self) -> None:
        self.idle.set()


class ReplicaRouter:
    """The :class:`~fulmen.producers.llm_gateway.backends.base.Backend` over ``replicas`` (see the module docstring)."""

    def __init__(self, replicas: Sequence[Replica], options: LlmSection) -> None:
        if not replicas:
            raise ValueError("a router needs at least one replica")
        self.name = replicas[0].name
        self.options = options
        self.slots = [_Slot(index, replica) for index, replica in enumerate(replicas)]
        self.target: ModelVersion | None = None  # the newest version handed to the router
        self.adapters: dict[str, ModelVersion] = {}  # per agent, the newest version of its adapter handed to it
        self.failovers = 0  # calls sent to another replica after theirs failed
        self._sticky: OrderedDict[str, int] = OrderedDict()
        self._turn = 0
        self._changed = asyncio.Event()  # a replica changed state (wakes waiting calls and the prober)
        self._prober: asyncio.Task[None] | None = None
        self._rolling = False  # a version is rolling over the replicas: some serve the older one for a while

    # --- what the gateway reads -----------------------------------------------------------------------------
    @property
    def model_version(self) -> int | None:
        versions = [s.replica.model_version for s in self.slots if s.state is not ReplicaState.DOWN]
        known = [v for v in versions if v is not None]
        return min(known) if known and len(known) == len(versions) else None

    @property
    def context_length(self) -> int | None:
        return next((s.replica.context_length for s in self.slots if s.replica.context_length is not None), None)

    def adapter_version(self, agent: str) -> int | None:
        versions = [s.replica.adapter_version(agent) for s in self.slots if s.state is not ReplicaState.DOWN]
        known = [v for v in versions if v is not None]
        return min(known) if known and len(known) == len(versions) else None

    def states(self) -> list[tuple[str, ReplicaState, int | None]]:
        """Each replica's label, state and version (for logs and tests)."""
        return [(s.replica.label, s.state, s.replica.model_version) for s in self.slots]

    # --- lifecycle ------------------------------------------------------------------------------------------
    async def start(self) -> None:
        await asyncio.gather(*(slot.replica.start() for slot in self.slots))
        for slot, outcome in zip(
            self.slots,
            await asyncio.gather(*(s.replica.probe() for s in self.slots), return_exceptions=True),
            strict=True,
        ):
            if isinstance(outcome, ReplicaUnavailableError):
                self._take_out(slot, outcome.message)
            elif isinstance(outcome, BaseException):
                raise outcome
        self._prober = asyncio.create_task(self._probe_loop(), name="llm-replica-prober")

    async def close(self) -> None:
        if self._prober is not None:
            self._prober.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._prober
        await asyncio.gather(*(slot.replica.close() for slot in self.slots), return_exceptions=True)

    # --- calls ----------------------------------------------------------------------------------------------
    async def chat(self, request: ChatRequest, affinity: str | None = None) -> CallResult:
        return await self._call(lambda replica: replica.chat(request), affinity)

    async def complete(self, request: CompletionRequest, affinity: str | None = None) -> CallResult:
        return await self._call(lambda replica: replica.complete(request), affinity)

    async def _call(self, send: Callable[[Replica], Awaitable[CallResult]], affinity: str | None) -> CallResult:
        tried: set[int] = set()
        failure: ApiError | None = None
        for _ in range(min(self.options.replica_attempts, len(self.slots))):
            slot = await self._pick(affinity, tried, failure)
            tried.add(slot.index)
            slot.in_flight += 1
            slot.idle.clear()
            try:
                result = await send(slot.replica)
            except ApiError as exc:
                if exc.kind not in REPLICA_FAILURE_KINDS:
                    raise  # the request's fault: another replica would refuse it too
                self._take_out(slot, exc.message)
                failure = exc
                self.failovers += 1
                continue
            finally:
                slot.in_flight -= 1
                if slot.in_flight == 0:
                    slot.idle.set()
            result.replica = slot.replica.label
            self._check_version(slot)
            return result
        if failure is None:  # pragma: no cover - the loop runs at least once
            raise ApiError(503, "no replica could serve the call")
        raise _exhausted(failure, len(tried))

    async def _pick(self, affinity: str | None, tried: set[int], failure: ApiError | None) -> _Slot:
        """The replica for the next attempt; waits while replicas swap weights, 503 when none can serve."""
        deadline = asyncio.get_running_loop().time() + self.options.replica_wait_s
        while True:
            self._changed.clear()
            up = [s for s in self.slots if s.state is ReplicaState.UP and s.index not in tried]
            if up:
                return self._choose(up, affinity)
            coming = [s for s in self.slots if s.state is ReplicaState.DRAINING and s.index not in tried]
            remaining = deadline - asyncio.get_running_loop().time()
            if not coming or remaining <= 0:
                if failure is not None:
                    raise _exhausted(failure, len(tried))
                raise _no_replica(self.slots, waited=bool(coming))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), remaining)

    def _choose(self, up: list[_Slot], affinity: str | None) -> _Slot:
        if affinity is not None:
            index = self._sticky.get(affinity)
            if index is not None and any(s.index == index for s in up):
                self._sticky.move_to_end(affinity)
                return self.slots[index]
        count = len(self.slots)
        slot = min(up, key=lambda s: (s.in_flight, (s.index - self._turn) % count))
        self._turn = (slot.index + 1) % count
        if affinity is not None:
            self._sticky[affinity] = slot.index
            self._sticky.move_to_end(affinity)
            while len(self._sticky) > _STICKY_ROLLOUTS:
                self._sticky.popitem(last=False)
        return slot

    # --- health ---------------------------------------------------------------------------------------------
    def _check_version(self, slot: _Slot) -> None:
        """A replica that serves another version than the target, though it did not refuse it (an upstream
        restarted with its start-up weights), is taken out and brought to the target before it serves again."""
        target = self.target
        if target is None or self._rolling or slot.state is not ReplicaState.UP or slot.lock.locked():
            return
        served = slot.replica.model_version
        if served != target.version and slot.refused != target.version:
            self._take_out(slot, f"it serves version {served}, not {target.version}")

    def _take_out(self, slot: _Slot, reason: str) -> None:
        if slot.state is ReplicaState.DOWN:
            return  # calls in flight on a dead replica fail together: one failure, one backoff
        slot.state = ReplicaState.DOWN
        slot.reason = reason
        self._schedule_probe(slot)
        log.warning(
            "replica %s taken out (%s); probed again in %.1fs",
            slot.replica.label,
            reason,
            slot.retry_at - asyncio.get_running_loop().time(),
        )
        self._changed.set()

    def _schedule_probe(self, slot: _Slot) -> None:
        wait = backoff_s(slot.failures, self.options.replica_retry_s, self.options.replica_retry_max_s)
        slot.failures += 1
        slot.retry_at = asyncio.get_running_loop().time() + wait

    async def _probe_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._changed.clear()
            now = loop.time()
            due = [s for s in self.slots if s.state is ReplicaState.DOWN and s.retry_at <= now]
            if due:
                await asyncio.gather(*(self._recover(slot) for slot in due))
                continue
            waits = [s.retry_at - now for s in self.slots if s.state is ReplicaState.DOWN]
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), min(waits) if waits else None)

    async def _recover(self, slot: _Slot) -> None:
        """Probe a replica that is out; bring it to the target version; put it back."""
        async with slot.lock:
            if slot.state is not ReplicaState.DOWN:
                return
            try:
                await slot.replica.probe()
                target = self.target
                if target is not None and slot.replica.model_version != target.version:
                    await slot.replica.load_version(target)  # it takes no calls: no drain needed
                for event in list(self.adapters.values()):  # the agents' adapters, on top of the model
                    if slot.replica.adapter_version(event.adapter) != event.version:
                        await slot.replica.load_version(event)
            except (VersionRefusedError, ConfigurationError) as exc:
                slot.refused = self.target.version if self.target else None
                log.error(
                    "replica %s refused version %s (%s); it serves version %s",
                    slot.replica.label,
                    self.target.version if self.target else None,
                    exc,
                    slot.replica.model_version,
                )
            except Exception as exc:  # unreachable still, or a load that left it unusable
                slot.reason = f"{type(exc).__name__}: {exc}"
                self._schedule_probe(slot)
                log.info("replica %s still out (%s)", slot.replica.label, slot.reason)
                return
            slot.state, slot.failures, slot.reason = ReplicaState.UP, 0, ""
            log.info("replica %s is back, serving version %s", slot.replica.label, slot.replica.model_version)
            self._changed.set()

    # --- versions -------------------------------------------------------------------------------------------
    async def load_version(self, event: ModelVersion) -> None:
        if event.adapter:
            await self._load_adapter(event)
            return
        in_place = [slot.replica.swaps_in_place(event) for slot in self.slots]  # ConfigurationError: nothing done
        self.target, self._rolling = event, True
        try:
            outcomes = await asyncio.gather(
                *(self._swap(slot, event, drain=False) for slot in self.slots if not in_place[slot.index])
            )
            for slot in self.slots:  # one at a time: the others keep serving
                if in_place[slot.index]:
                    outcomes.append(await self._swap(slot, event, drain=True))
        finally:
            self._rolling = False
        refused = [outcome for outcome in outcomes if outcome]
        serving = sum(1 for s in self.slots if s.state is ReplicaState.UP and s.replica.model_version == event.version)
        if refused:
            raise VersionRefusedError(
                f"model version {event.version} serves on {serving} of {len(self.slots)} replicas; "
                + "; ".join(refused)
            )
        log.info(
            "model version %d from %s serves on every live replica (%d of %d)",
            event.version,
            event.uri,
            serving,
            len(self.slots),
        )

    async def _load_adapter(self, event: ModelVersion) -> None:
        """Load an agent's adapter on every live replica at once (beside the model: no drain)."""
        for slot in self.slots:
            slot.replica.swaps_in_place(event)  # ConfigurationError (nothing done) when this kind cannot
        self.adapters[event.adapter] = event
        refused = [
            outcome for outcome in await asyncio.gather(*(self._add(slot, event) for slot in self.slots)) if outcome
        ]
        if refused:
            raise VersionRefusedError(
                f"version {event.version} of the adapter of agent {event.adapter}: " + "; ".join(refused)
            )
        log.info(
            "version %d of agent %s's adapter from %s serves on every live replica",
            event.version,
            event.adapter,
            event.uri,
        )

    async def _add(self, slot: _Slot, event: ModelVersion) -> str:
        async with slot.lock:
            if slot.state is ReplicaState.DOWN or slot.replica.adapter_version(event.adapter) == event.version:
                return ""  # one that is out loads it when it comes back
            try:
                await slot.replica.load_version(event)
            except (VersionRefusedError, ConfigurationError) as exc:
                return f"{slot.replica.label} refused it: {exc}"
            except Exception as exc:
                self._take_out(slot, f"loading agent {event.adapter}'s adapter failed: {type(exc).__name__}: {exc}")
            return ""

    async def _swap(self, slot: _Slot, event: ModelVersion, *, drain: bool) -> str:
        """Load ``event`` on one replica; what went wrong, or "" (also when the replica is out: it loads the
        target when it comes back)."""
        async with slot.lock:
            if slot.state is not ReplicaState.UP or slot.replica.model_version == event.version:
                return ""
            if drain:
                slot.state = ReplicaState.DRAINING
                self._changed.set()
                await slot.idle.wait()  # the calls in flight finish on the version they started with
                if slot.state is ReplicaState.DOWN:  # one of them found it dead: it loads when it comes back
                    return ""
            try:
                await slot.replica.load_version(event)
            except (VersionRefusedError, ConfigurationError) as exc:
                slot.state, slot.refused = ReplicaState.UP, event.version
                return f"{slot.replica.label} refused it: {exc}"
            except Exception as exc:  # unreachable, or in a state nobody knows: out until a load succeeds
                self._take_out(slot, f"loading version {event.version} failed: {type(exc).__name__}: {exc}")
                return ""  # it loads the target when it comes back
            finally:
                self._changed.set()
            slot.state = ReplicaState.UP
            return ""


def _exhausted(failure: ApiError, tried: int) -> ApiError:
    error = ApiError(failure.status, f"{failure.message} (tried {tried} replica(s))", kind=failure.kind)
    error.headers["Retry-After"] = "1"
    return error


def _no_replica(slots: list[_Slot], *, waited: bool) -> ApiError:
    if waited:
        message = "every replica is loading a new model version; retry"
    else:
        reasons = "; ".join(f"{s.replica.label}: {s.reason or s.state.value}" for s in slots)
        message = f"no replica is available ({reasons}); retry"
    error = ApiError(503, message, kind="upstream_unavailable")
    error.headers["Retry-After"] = "1"
    return error
