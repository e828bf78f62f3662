"""Tasks from the store: ``fulmen train --tasks-sql "SELECT TaskId FROM fulmen.rollouts WHERE ..."``.

Every dispatched request's task payload is stored (``fulmen consume``'s ``tasks`` sink: the ``tasks`` table, one
row per request, ``Input`` as JSON). The selection is any read-only SELECT returning one column of task ids (e.g.
the tasks whose rollouts failed last week), run through the store's read-only reader like ``fulmen sql``; each
selected task's payload is read back (the latest stored one, should a task id have been dispatched with two) and
the run dispatches those tasks as it would a task file's: groups of G, on-policy. Task ids the store has no payload
for are counted and named in the log; a selection that names none is a ConfigurationError.
"""

from __future__ import annotations

import json
import logging

from fulmen.algorithm.service.replay import StoreReader
from fulmen.schemas.ddl import TABLES
from fulmen.schemas.errors import ConfigurationError
from fulmen.schemas.task_file import TaskSpec

__all__ = ["load_stored_tasks"]

log = logging.getLogger(__name__)


def load_stored_tasks(reader: StoreReader, selection: str, *, database: str) -> list[TaskSpec]:
    """The tasks ``selection`` names, with their stored payloads, in the order the selection returned them."""
    selection = selection.strip().rstrip(";").strip()
    if not selection:
        raise ConfigurationError("--tasks-sql needs a SELECT that returns task ids")
    found = reader.query(selection, None, final=True, read_only=True)
    if len(found.columns) != 1:
        raise ConfigurationError(
            f"the --tasks-sql selection must return one column, the task ids; it returns "
            f"{len(found.columns)} ({', '.join(found.columns)})"
        )
    ids = list(dict.fromkeys(str(row[0]) for row in found.rows if row[0] is not None))
    if not ids:
        raise ConfigurationError("the --tasks-sql selection returned no task ids")
    stored = reader.query(
        f"SELECT TaskId, argMax(Input, CreatedAt) FROM {database}.{TABLES['tasks']} "
        "WHERE TaskId IN %(ids)s GROUP BY TaskId",
        {"ids": ids},
        final=True,
        read_only=True,
    )
    payloads = {str(task_id): text for task_id, text in stored.rows}
    missing = [task_id for task_id in ids if task_id not in payloads]
    if missing:
        log.warning(
            "%d of the %d selected task id(s) have no stored payload and are left out (%s%s)",
            len(missing),
            len(ids),
            ", ".join(missing[:5]),
            ", ..." if len(missing) > 5 else "",
        )
    tasks = [TaskSpec(task_id, json.loads(payloads[task_id])) for task_id in ids if task_id in payloads]
    if not tasks:
        raise ConfigurationError(
            f"none of the {len(ids)} selected task id(s) has a stored payload (the tasks table "
            "holds what was dispatched since `fulmen consume` stores it)"
        )
    return tasks
