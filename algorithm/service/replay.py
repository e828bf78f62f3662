"""Replay: train on transitions the store already holds, without running the agent again.

``fulmen train --replay "SELECT RolloutId FROM fulmen.rollouts WHERE ..."`` (``FULMEN_TRAIN_REPLAY_SQL``): the
selection is any read-only SELECT returning a column of rollout ids, and optionally a second, numeric column that
orders them (below), run through the store's read-only reader (the guard of ``fulmen sql``). :func:`load_replay`
then reads, for those rollouts, the transitions (prompt and response token ids, the behaviour logprobs, the model
version that served each call, the rewards), the late feedback (the ``feedback`` table), the calls recorded without
token ids (spans) and the model versions' base models, and builds :class:`ReplayBuffer`, the groups the training
loop takes instead of dispatching (:class:`~fulmen.algorithm.service.loop.TrainingLoop`; with a dataset too,
``replay_fraction`` of each step's groups).

Rules:

- latest attempt: only each rollout's highest stored attempt is trained on (as the collector does);
- groups: rollouts keep the group they were dispatched in (same task, same ``GroupId``): GRPO compares the
  answers to one task. A rollout without a group (an agent in production calls the gateway; no dispatcher) has no
  peers to compare with: such rollouts are taken in the order they were stored and cut into batches of
  ``group_size``, and each batch is one group, so its baseline is the mean (and, for ``grpo``, the spread) of the
  returns of those ``group_size`` rollouts: a batch baseline;
- rewards: a feedback row for a call (its span) replaces that call's observed reward (its intermediate reward,
  which credit assignment combines with the episode's), one for a rollout or a trace (no span) replaces the
  episode reward; several for one target and name: the latest wins (``Timestamp``), and
  feedback, arriving after the run, wins over what was recorded at run time. Only feedback named ``reward``
  counts;
- refused, and counted by reason (:attr:`ReplayBuffer.refused`): ``no_token_ids`` (calls recorded without
  token ids: an ``openai`` upstream, counted per call), ``no_reward`` (rollouts with no reward at all: no episode
  reward, no call reward, no feedback; replay cannot tell good from bad there, so it does not guess),
  ``other_base_model`` (rollouts with a call served by a version of another base model, or whose token ids do
  not fit this model's vocabulary), ``not_found`` (selected ids the store has no transitions or calls for);
- order: groups are replayed in the order they were stored (their earliest transition); with a second column,
  in the order of its values (a group's smallest, then the order stored). ``train_steps.GroupIds`` records the
  groups each step trained on, so joining it replays another run's batches in its order (examples/train.py's
  ``--replay-store`` does); when every group was taken, the buffer starts again (``passes``).

Off-policy by construction: each transition keeps its behaviour logprobs (``Sample.old_logprobs``), and a replay
run corrects with ``tis`` unless ``FULMEN_TRAIN_CORRECTION`` says otherwise; the loop drops transitions older
than ``max_staleness`` versions (this run's version minus the stored call's version; a call of a version above
this run's counts as fresh), like any other.

Reported in each ``TrainStep.extra``: ``replayed_groups``, ``replay_passes``, ``replay_rollouts`` and
``replay_refused_<reason>``. A buffer none of whose groups is trainable any more ends the run with a
ConfigurationError rather than spinning.
"""

from __future__ import annotations

import json
import logging
import math
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from fulmen.algorithm.service.groups import ClosedGroup
from fulmen.schemas import semconv
from fulmen.schemas.ddl import TABLES
from fulmen.schemas.errors import ConfigurationError, PoisonInputError
from fulmen.schemas.events import IDENTIFIER_PATTERN, RolloutMode, RolloutStatus, Transition, TransitionBatch

__all__ = ["REFUSAL_REASONS", "ReplayBuffer", "ReplayRows", "StoreReader", "build_buffer", "load_replay"]

log = logging.getLogger(__name__)

REFUSAL_REASONS = ("no_token_ids", "no_reward", "other_base_model", "not_found")

FEEDBACK_NAME = "reward"
"""The feedback name replay trains on."""

BATCH_GROUP = "replay-batch"
"""Group id prefix of the batches of rollouts stored without a group."""


class StoreReader(Protocol):
    """What replay needs of the store: :class:`fulmen.infra.store.Store` and the read endpoint's client have it."""

    def query(self, sql: str, parameters: Any = None, *, final: bool = True, read_only: bool = True) -> Any: ...


@dataclass
class ReplayBuffer:
    """The replayed groups, in replay order, and what was refused. :meth:`take` hands them out, cycling."""

    groups: list[ClosedGroup]
    refused: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REFUSAL_REASONS, 0))
    selected: int = 0
    feedback_applied: int = 0
    passes: int = 0
    _next: int = 0

    @property
    def rollouts(self) -> int:
        return sum(len(g.rollouts) for g in self.groups)

    @property
    def transitions(self) -> int:
        return sum(g.num_transitions for g in self.groups)

    def take(self) -> ClosedGroup:
        """The next group (after the last one, the first again: another pass)."""
        if not self.groups:
            raise ConfigurationError("the replay buffer is empty")
        group = self.groups[self._next]
        self._next += 1
        if self._next == len(self.groups):
            self._next = 0
            self.passes += 1
        return group

    def save_position(self, run_dir: Path, version: int, selection: str) -> None:
        """Where the next group comes from once version ``version`` is trained (``<run_dir>/replay/v<N>.json``,
        written before the version's checkpoint), so a run resumed from that checkpoint with the same
        ``selection`` goes on past the groups it trained on instead of taking them again."""
        folder = run_dir / "replay"
        folder.mkdir(parents=True, exist_ok=True)
        position = {"next": self._next, "passes": self.passes, "groups": len(self.groups), "selection": selection}
        staging = folder / f".v{version}.json.tmp"
        staging.write_text(json.dumps(position))
        staging.replace(folder / f"v{version}.json")

    def restore_position(self, run_dir: Path, version: int, selection: str) -> bool:
        """Go on from where the run was once version ``version`` was trained; False when nothing says where: no
        position was saved, or it was for another selection (a new round of ``fulmen improve``) or another buffer."""
        path = run_dir / "replay" / f"v{version}.json"
        if not path.is_file():
            return False
        position = json.loads(path.read_text())
        if position.get("selection") != selection or position.get("groups") != len(self.groups):
            return False
        self._next, self.passes = int(position["next"]), int(position["passes"])
        return True

    def summary(self) -> str:
        refused = ", ".join(f"{n} {reason.replace('_', ' ')}" for reason, n in self.refused.items() if n) or "none"
        return (
            f"{self.selected} rollout(s) selected: {self.rollouts} replayed in {len(self.groups)} group(s), "
            f"{self.transitions} transition(s), {self.feedback_applied} late reward(s) applied; refused: "
            f"{refused}"
        )


@dataclass
class ReplayRows:
    """What :func:`load_replay` read from the store, for :func:`build_buffer` (no I/O there)."""

    selected: list[str]
    transitions: list[dict[str, Any]]
    no_token_ids: dict[str, int] = field(default_factory=dict)  # rollout id -> calls without token ids
    feedback: dict[tuple[str, str], float] = field(default_factory=dict)  # (rollout id, span id or '') -> value
    version_bases: dict[int, set[str]] = field(default_factory=dict)  # model version -> base models it names
    order: dict[str, float] = field(default_factory=dict)  # rollout id -> the selection's order key, when it has one


_TRANSITION_COLUMNS = (
    "RolloutId",
    "Attempt",
    "TaskId",
    "GroupId",
    "Mode",
    "Status",
    "CallIndex",
    "TraceId",
    "SpanId",
    "AgentName",
    "ModelVersion",
    "PromptTokenIds",
    "ResponseTokenIds",
    "ResponseLogprobs",
    "Reward",
    "IntermediateReward",
    "EpisodeReward",
    "CreatedAt",
)


def load_replay(
    reader: StoreReader,
    selection: str,
    *,
    database: str,
    model_name: str,
    base_model: str,
    vocab_size: int | None,
    group_size: int,
    require_reward: bool = True,
    allow_empty: bool = False,
) -> ReplayBuffer:
    """Run ``selection`` and read what replay needs of the rollouts it names; the buffer (:func:`build_buffer`;
    ``require_reward=False`` keeps the rollouts with no reward too: a supervised warm-up imitates what the selection
    chose and reads no reward).

    Raises :class:`ConfigurationError` for a selection that is not one or two columns (the second numbers), or
    that names nothing trainable (saying what was refused; with ``allow_empty`` the empty buffer comes back
    instead: a round of ``fulmen improve`` whose window has nothing new), and the reader's errors
    (``ReadOnlyError`` for a statement that is not a read)."""
    selection = selection.strip().rstrip(";").strip()
    if not selection:
        raise ConfigurationError("--replay needs a SELECT that returns rollout ids")
    found = _read(reader, selection)
    if len(found.columns) not in (1, 2):
        raise ConfigurationError(
            f"the replay selection must return the rollout ids, and optionally a second column that orders them; "
            f"it returns {len(found.columns)} columns ({', '.join(found.columns)})"
        )
    selected = list(dict.fromkeys(str(row[0]) for row in found.rows if row[0] is not None))
    rows = ReplayRows(selected=selected, transitions=[], order=_order(found))
    if selected:
        ids = {"ids": selected}
        columns = ", ".join(_TRANSITION_COLUMNS)
        result = _read(
            reader, f"SELECT {columns} FROM {database}.{TABLES['transitions']} WHERE RolloutId IN %(ids)s", ids
        )
        rows.transitions = [dict(zip(result.columns, row, strict=True)) for row in result.rows]
        absent = _read(
            reader,
            f"SELECT RolloutId, count() FROM {database}.{TABLES['spans']} WHERE RolloutId IN "
            "%(ids)s AND mapContains(SpanAttributes, %(absent)s) GROUP BY RolloutId",
            {**ids, "absent": semconv.TOKEN_IDS_ABSENT_REASON},
        )
        rows.no_token_ids = {str(r[0]): int(r[1]) for r in absent.rows}
        rows.feedback = _feedback(reader, database, ids)
        bases = _read(
            reader,
            f"SELECT Version, BaseModel FROM {database}.{TABLES['model_versions']} WHERE ModelName = %(name)s",
            {"name": model_name},
        )
        for version, base in bases.rows:
            rows.version_bases.setdefault(int(version), set()).add(str(base))
    buffer = build_buffer(
        rows, base_model=base_model, vocab_size=vocab_size, group_size=group_size, require_reward=require_reward
    )
    if not buffer.groups and not allow_empty:
        raise ConfigurationError(f"nothing to replay: {buffer.summary()}")
    return buffer


def _order(found: Any) -> dict[str, float]:
    """The selection's second column, per rollout id (its smallest value); none with one column."""
    if len(found.columns) == 1:
        return {}
    order: dict[str, float] = {}
    for rollout_id, value in found.rows:
        if rollout_id is None:
            continue
        key = _number(value) if isinstance(value, int | float) else None
        if key is None:
            raise ConfigurationError(
                f"the replay selection's second column ({found.columns[1]}) orders the rollouts and must be finite "
                f"numbers; rollout {rollout_id} has {value!r}"
            )
        order[str(rollout_id)] = min(order.get(str(rollout_id), key), key)
    return order


def _read(reader: StoreReader, sql: str, parameters: dict[str, Any] | None = None) -> Any:
    return reader.query(sql, parameters, final=True, read_only=True)


def _feedback(reader: StoreReader, database: str, ids: dict[str, Any]) -> dict[tuple[str, str], float]:
    """The latest ``reward`` feedback per (rollout, span); none when the store predates the feedback table."""
    try:
        result = _read(
            reader,
            f"SELECT RolloutId, SpanId, argMax(Value, Timestamp) FROM {database}."
            f"{TABLES['feedback']} WHERE Name = %(name)s AND RolloutId IN %(ids)s "
            "GROUP BY RolloutId, SpanId",
            {**ids, "name": FEEDBACK_NAME},
        )
    except PoisonInputError as exc:
        if "feedback" in str(exc) and ("UNKNOWN_TABLE" in str(exc) or "does not exist" in str(exc)):
            log.warning(
                "the store has no feedback table yet (start `fulmen consume` once to migrate it): replaying "
                "the rewards recorded at run time only"
            )
            return {}
        raise
    return {(str(r[0]), str(r[1])): float(r[2]) for r in result.rows}


def build_buffer(
    rows: ReplayRows, *, base_model: str, vocab_size: int | None, group_size: int, require_reward: bool = True
) -> ReplayBuffer:
    """The replay buffer of ``rows`` by the rules of the module docstring (``require_reward=False``: the
    ``no_reward`` rule off)."""
    buffer = ReplayBuffer(groups=[], selected=len(rows.selected))
    latest: dict[str, int] = {}
    for row in rows.transitions:
        latest[row["RolloutId"]] = max(latest.get(row["RolloutId"], 0), int(row["Attempt"]))
    calls: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in rows.transitions:
        if int(row["Attempt"]) == latest[row["RolloutId"]]:
            calls[row["RolloutId"]].append(row)
    buffer.refused["no_token_ids"] = sum(rows.no_token_ids.values())
    buffer.refused["not_found"] = sum(1 for r in rows.selected if r not in calls and r not in rows.no_token_ids)
    fits = _base_model_check(base_model, rows.version_bases, vocab_size)
    batches: list[TransitionBatch] = []
    for rollout_id, stored in calls.items():
        stored.sort(key=lambda r: int(r["CallIndex"]))
        if not all(fits(row) for row in stored):
            buffer.refused["other_base_model"] += 1
            continue
        batch, applied = _batch(rollout_id, stored, rows.feedback)
        if require_reward and not _has_reward(batch):
            buffer.refused["no_reward"] += 1
            continue
        buffer.feedback_applied += applied
        batches.append(batch)
    stored_at = {r: (rows.order.get(r, math.inf), min(row["CreatedAt"] for row in calls[r])) for r in calls}
    buffer.groups = _groups(batches, stored_at, group_size)
    return buffer


def _base_model_check(
    base_model: str, version_bases: dict[int, set[str]], vocab_size: int | None
) -> Callable[[dict[str, Any]], bool]:
    """Whether a stored call fits the model trained here: the version that served it (when the store knows it)
    was trained from this base model, and its token ids are inside this model's vocabulary."""
    ours = _same_model_key(base_model)

    def fits(row: dict[str, Any]) -> bool:
        version = row["ModelVersion"]
        bases = version_bases.get(int(version)) if version is not None else None
        if bases and ours not in {_same_model_key(b) for b in bases if b}:
            return False
        if vocab_size is not None:
            ids = list(row["PromptTokenIds"]) + list(row["ResponseTokenIds"])
            if ids and max(ids) >= vocab_size:
                return False
        return True

    return fits


def _same_model_key(name: str) -> str:
    """A base model's identity for comparison: a directory's resolved path, else the name as given."""
    path = Path(name)
    return str(path.resolve()) if name and path.exists() else name


def _batch(
    rollout_id: str, stored: list[dict[str, Any]], feedback: dict[tuple[str, str], float]
) -> tuple[TransitionBatch, int]:
    """The rollout's batch with the late feedback applied; how many feedback values it took."""
    first = stored[0]
    applied = 0
    episode = _number(first["EpisodeReward"])
    if (rollout_id, "") in feedback:
        episode, applied = feedback[(rollout_id, "")], applied + 1
    transitions = []
    for row in stored:
        observed = _number(row["IntermediateReward"])  # the call's own reward, as credit reads it
        if (rollout_id, row["SpanId"]) in feedback:
            observed, applied = feedback[(rollout_id, row["SpanId"])], applied + 1
        logprobs = [float(x) for x in row["ResponseLogprobs"]] or None
        transitions.append(
            Transition(
                rollout_id=rollout_id,
                attempt=int(row["Attempt"]),
                index=int(row["CallIndex"]),
                trace_id=row["TraceId"],
                span_id=row["SpanId"],
                agent_name=row["AgentName"],
                model_version=row["ModelVersion"],
                prompt_token_ids=list(row["PromptTokenIds"]),
                response_token_ids=list(row["ResponseTokenIds"]),
                response_logprobs=logprobs,
                reward=_number(row["Reward"]),
                intermediate_reward=observed,
            )
        )
    versions = [t.model_version for t in transitions if t.model_version is not None]
    batch = TransitionBatch(
        rollout_id=rollout_id,
        attempt=int(first["Attempt"]),
        task_id=_identifier(first["TaskId"], rollout_id),
        group_id=_identifier(first["GroupId"], BATCH_GROUP),  # no group: cut into batch groups later
        mode=_mode(first["Mode"]),
        status=_status(first["Status"]),
        episode_reward=episode,
        model_version=min(versions) if versions else None,
        transitions=transitions,
    )
    return batch, applied


def _groups(batches: list[TransitionBatch], stored_at: dict[str, Any], group_size: int) -> list[ClosedGroup]:
    """Closed groups in the order of ``stored_at`` (the selection's order key, then when stored): the dispatched
    groups as they were, the rollouts without a group cut into batches of ``group_size`` (module docstring)."""
    by_group: dict[str, list[TransitionBatch]] = defaultdict(list)
    loose: list[TransitionBatch] = []
    for batch in sorted(batches, key=lambda b: (stored_at[b.rollout_id], b.rollout_id)):
        (loose if batch.group_id == BATCH_GROUP else by_group[batch.group_id]).append(batch)
    ordered: list[tuple[Any, ClosedGroup]] = []
    for group_id, members in by_group.items():
        ordered.append((stored_at[members[0].rollout_id], _closed(group_id, members)))
    for start in range(0, len(loose), group_size):
        members = [
            b.model_copy(update={"group_id": f"{BATCH_GROUP}-{start // group_size}"})
            for b in loose[start : start + group_size]
        ]
        ordered.append((stored_at[members[0].rollout_id], _closed(members[0].group_id, members)))
    ordered.sort(key=lambda pair: (pair[0], pair[1].group_id))
    return [group for _, group in ordered]


def _closed(group_id: str, members: Iterable[TransitionBatch]) -> ClosedGroup:
    rollouts = tuple(sorted(members, key=lambda b: b.rollout_id))
    tasks = Counter(b.task_id for b in rollouts)
    return ClosedGroup(
        group_id=group_id,
        task_id=tasks.most_common(1)[0][0],
        mode=RolloutMode.TRAIN,
        expected=len(rollouts),
        rollouts=rollouts,
    )


def _has_reward(batch: TransitionBatch) -> bool:
    return batch.episode_reward is not None or any(
        t.reward is not None or t.intermediate_reward is not None for t in batch.transitions
    )


def _number(value: Any) -> float | None:
    if value is None:
        return None
    number = float(value)
    return number if math.isfinite(number) else None


def _is_identifier(value: Any) -> bool:
    return isinstance(value, str) and bool(IDENTIFIER_PATTERN.fullmatch(value))


def _identifier(value: Any, fallback: str) -> str:
    return value if _is_identifier(value) else fallback


def _mode(value: str) -> RolloutMode:
    try:
        return RolloutMode(value)
    except ValueError:
        return RolloutMode.TRAIN


def _status(value: str) -> RolloutStatus:
    try:
        return RolloutStatus(value)
    except ValueError:
        return RolloutStatus.SUCCEEDED
