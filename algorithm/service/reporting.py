"""Where a run's step metrics go, besides the metrics topic: files in the run directory and the tracker a user
already watches.

Every step (a :class:`~fulmen.schemas.events.TrainStep`) becomes one line of ``<run_dir>/metrics.jsonl`` and goes to
the tracker ``FULMEN_TRAIN_REPORT_TO`` names, as TRL's ``report_to`` does:

* ``tensorboard`` (default): event files in ``<run_dir>/tensorboard`` through tensorboardX's ``SummaryWriter``
  (``tensorboard --logdir <run_dir>/tensorboard``; a resumed run appends to the same directory);
* ``wandb`` / ``mlflow``: a run of that name in the project or experiment their own variables configure
  (``WANDB_PROJECT``, ``MLFLOW_TRACKING_URI``, ...); imported only when named, and a missing package is a
  ConfigurationError that says what to install;
* ``none``.

Scalars are named ``train/<field>`` (reward_mean, loss, kl, clip_fraction, tokens_per_s, the waits) and
``extra/<key>`` for the step's extra metrics (``extra/val_accuracy``, ...; the tracker also gets the accuracy
before the first update as ``extra/val_accuracy`` at step 0, so its held-out curve starts where the run did).
When the run ends, :meth:`RunReport.close` draws ``<run_dir>/curves.png`` from the whole ``metrics.jsonl`` (so a
resumed run's figure has every step): reward, held-out accuracy, loss, KL, entropy and tokens/s, each panel where
the run has that metric.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any, Protocol

from fulmen.algorithm.service.metrics import observe_step
from fulmen.schemas.errors import ConfigurationError
from fulmen.schemas.events import TrainStep

__all__ = ["CURVES", "SETTINGS_FILE", "RunReport", "Tracker", "read_metrics"]

SETTINGS_FILE = "train_settings.json"  # the run's FULMEN_TRAIN_* fields, as its last start had them

log = logging.getLogger(__name__)

_FIELDS = (
    "reward_mean",
    "reward_std",
    "advantage_mean",
    "loss",
    "clip_fraction",
    "kl",
    "tokens_per_s",
    "rollout_wait_s",
    "train_s",
    "publish_s",
    "num_transitions",
    "num_groups",
)
# curves.png: (title, the metric of each line: a TrainStep field, or a key of its extra)
CURVES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("reward (training rollouts, mean)", ("reward_mean",)),
    ("held-out accuracy (greedy)", ("val_accuracy",)),
    ("loss", ("loss",)),
    ("KL to the reference / sampler", ("kl", "approx_kl")),
    ("entropy", ("entropy",)),
    ("tokens/s (update)", ("tokens_per_s",)),
)


class Tracker(Protocol):
    def log(self, step: int, scalars: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class RunReport:
    """Writes each step of a run (module docstring); :meth:`close` when the run ends."""

    def __init__(self, run_dir: Path, run_id: str, report_to: str, config: dict[str, Any] | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics = self.run_dir / "metrics.jsonl"
        if config:  # what `fulmen runs` shows (the steps asked for, the model, the agent); a resume rewrites it
            (self.run_dir / SETTINGS_FILE).write_text(json.dumps(config, indent=1, default=str) + "\n")
        self.tracker = _tracker(report_to, self.run_dir, run_id, config or {})

    def step(self, event: TrainStep) -> None:
        observe_step(event)  # Prometheus (fulmen.algorithm.service.metrics)
        scalars = scalars_of(event)
        with self.metrics.open("a", encoding="utf-8") as out:
            out.write(json.dumps({"step": event.step, **scalars}) + "\n")
        if self.tracker is not None:
            try:
                if "extra/initial_val_accuracy" in scalars:  # the held-out curve starts before the first update
                    self.tracker.log(event.step - 1, {"extra/val_accuracy": scalars["extra/initial_val_accuracy"]})
                self.tracker.log(event.step, scalars)
            except Exception:  # a tracker's outage must not end the training run
                log.exception("could not send step %d's metrics to the tracker", event.step)

    def close(self) -> Path | None:
        """Close the tracker and draw ``curves.png`` (None: no step yet)."""
        if self.tracker is not None:
            self.tracker.close()
        try:
            return plot_curves(read_metrics(self.metrics), self.run_dir / "curves.png")
        except Exception:  # a figure is no reason to fail a run that trained
            log.exception("could not draw %s", self.run_dir / "curves.png")
            return None


def scalars_of(event: TrainStep) -> dict[str, float]:
    """A step's metrics by their TensorBoard names (finite values only)."""
    named = {f"train/{name}": getattr(event, name) for name in _FIELDS}
    named |= {f"extra/{key}": value for key, value in event.extra.items()}
    return {name: float(value) for name, value in named.items() if value is not None and math.isfinite(value)}


def read_metrics(path: Path) -> list[dict[str, float]]:
    """The rows of a ``metrics.jsonl`` (a torn last line, from a kill mid-write, is skipped)."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    by_step = {int(row["step"]): row for row in rows}  # a step written twice (a resumed run redid it): the last
    return [by_step[step] for step in sorted(by_step)]


def plot_curves(rows: list[dict[str, float]], path: Path) -> Path | None:
    """``curves.png``: one panel per metric of :data:`CURVES` the rows have; the held-out panel starts at step 0
    with the accuracy before the first step."""
    panels = [(title, series) for title, names in CURVES if (series := _series(rows, names))]
    if not panels:
        return None
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    columns = min(3, len(panels))
    lines = math.ceil(len(panels) / columns)
    figure, axes = pyplot.subplots(lines, columns, figsize=(4.2 * columns, 3.0 * lines), squeeze=False)
    for axis, (title, series) in zip(axes.flat, panels, strict=False):
        for name, points in series.items():
            axis.plot([s for s, _ in points], [v for _, v in points], marker="o" if len(points) < 30 else None)
            axis.set_title(title if len(series) == 1 else f"{title}: {name}", fontsize=9)
        axis.set_xlabel("step (= model version)", fontsize=8)
        axis.grid(alpha=0.3)
    for axis in list(axes.flat)[len(panels) :]:
        axis.set_visible(False)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    pyplot.close(figure)
    return path


def _series(rows: list[dict[str, float]], names: tuple[str, ...]) -> dict[str, list[tuple[int, float]]]:
    found = {}
    for name in names:
        keys = (f"train/{name}", f"extra/{name}")
        points = [(int(row["step"]), row[key]) for row in rows for key in keys if key in row]
        if name == "val_accuracy":
            first = next((row for row in rows if "extra/initial_val_accuracy" in row), None)
            if first is not None:
                points.insert(0, (int(first["step"]) - 1, first["extra/initial_val_accuracy"]))
        if points:
            found[name] = points
    return found


def _tracker(report_to: str, run_dir: Path, run_id: str, config: dict[str, Any]) -> Tracker | None:
    if report_to == "none":
        return None
    if report_to == "tensorboard":
        return _TensorBoard(run_dir / "tensorboard")
    if report_to == "wandb":
        return _Wandb(run_id, config)
    if report_to == "mlflow":
        return _Mlflow(run_id, config)
    raise ConfigurationError(f"report_to={report_to!r}: tensorboard, wandb, mlflow or none")


def _needs(package: str, report_to: str) -> Any:
    import importlib

    try:
        return importlib.import_module(package)
    except ImportError:
        raise ConfigurationError(
            f"FULMEN_TRAIN_REPORT_TO={report_to} needs the {package} package: pip install {package} "
            "(or report to tensorboard or none)"
        ) from None


class _TensorBoard:
    def __init__(self, logdir: Path) -> None:
        from tensorboardX import SummaryWriter

        self.writer = SummaryWriter(logdir=str(logdir))

    def log(self, step: int, scalars: dict[str, float]) -> None:
        for name, value in scalars.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()  # a step's metrics are on disk when the step is published

    def close(self) -> None:
        self.writer.close()


class _Wandb:
    def __init__(self, run_id: str, config: dict[str, Any]) -> None:
        self.wandb = _needs("wandb", "wandb")
        self.run = self.wandb.init(name=run_id, id=run_id, resume="allow", config=config)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


class _Mlflow:
    def __init__(self, run_id: str, config: dict[str, Any]) -> None:
        self.mlflow = _needs("mlflow", "mlflow")
        self.run = self.mlflow.start_run(run_name=run_id)
        self.mlflow.log_params({k: str(v)[:250] for k, v in config.items()})

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.mlflow.log_metrics({name.replace("/", "."): value for name, value in scalars.items()}, step=step)

    def close(self) -> None:
        self.mlflow.end_run()
