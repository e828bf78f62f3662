"""The ``fulmen`` command line: the services, the local broker and store, submit and train, the demo.

The CLI is the composition root: it loads settings, builds objects and calls ``run()``. It sits above every
layer (schemas, infra, producers, consumers, algorithm) and is the only code that reaches into all the
components; it imports them inside the commands that use them, so ``fulmen config show`` never imports torch.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from fulmen.cli.base import UtcOption, WideOption, console, err, friendly, load_settings, read_query
from fulmen.cli.help_text import flow_help
from fulmen.cli.improve import improve_command
from fulmen.cli.init import init_command
from fulmen.cli.models import models_app
from fulmen.cli.optimize import optimize_prompt_command
from fulmen.cli.prompts import prompts_app
from fulmen.cli.rollouts import rollouts_command
from fulmen.cli.runs import runs_app
from fulmen.cli.settings_options import SectionOptions, with_options
from fulmen.cli.train import train_command
from fulmen.infra.settings import CliProcessSettings, DashboardSettings, FulmenSettings
from fulmen.producers.llm_gateway.settings import LlmSection
from fulmen.producers.otlp_gateway.settings import OtlpSection
from fulmen.producers.runner.settings import RunnerSection
from fulmen.schemas.errors import FulmenError

app = typer.Typer(
    no_args_is_help=True, add_completion=False, help="Fulmen: reinforcement learning for agents you already run."
)
kafka_app = typer.Typer(no_args_is_help=True, help="The local Kafka broker and Fulmen's topics.")
config_app = typer.Typer(no_args_is_help=True, help="Settings in force.")
schemas_app = typer.Typer(no_args_is_help=True, help="The event contracts.")
store_app = typer.Typer(no_args_is_help=True, help="The ClickHouse store.")
app.add_typer(kafka_app, name="kafka")
app.add_typer(config_app, name="config")
app.add_typer(schemas_app, name="schemas")
app.add_typer(store_app, name="store")
app.add_typer(models_app, name="models")  # fulmen/cli/models.py
app.add_typer(prompts_app, name="prompts")  # fulmen/cli/prompts.py
app.add_typer(runs_app, name="runs")  # fulmen/cli/runs.py

_settings = load_settings  # the commands' name for it


# --- kafka ---------------------------------------------------------------------------------------------------
@kafka_app.command("up")
@friendly
def kafka_up(
    brokers: Annotated[
        int | None, typer.Option(help="nodes of the local KRaft cluster (FULMEN_BROKER_NODES, default 1)", min=1)
    ] = None,
) -> None:
    """Start the local Kafka (unless FULMEN_KAFKA_BOOTSTRAP points elsewhere) and create the topics."""
    from fulmen.infra.services import ensure_kafka

    settings = _settings()
    if brokers is not None:
        if not settings.local_kafka:
            raise FulmenError(
                f"--brokers starts a local cluster, but FULMEN_KAFKA_BOOTSTRAP={settings.bootstrap} points at an "
                "existing one: unset it to start a local cluster"
            )
        settings.broker.nodes = brokers
        settings = FulmenSettings.model_validate(settings.model_dump())  # re-check (ports of every node)
    with console.status("starting Kafka and creating topics..."):
        ready = ensure_kafka(settings)
    nodes = settings.broker.nodes
    where = "local broker" if nodes == 1 else f"local cluster of {nodes} nodes"
    where = where if settings.local_kafka else "cluster"
    console.print(f"Kafka {where} ready at [bold]{ready.bootstrap}[/]")
    if settings.local_kafka and nodes > 1:
        console.print(
            f"other processes: FULMEN_BROKER_NODES={nodes} (local mode: starts what is missing) or "
            f"FULMEN_KAFKA_BOOTSTRAP={ready.bootstrap} (use it as it is)"
        )
    _print_topics(ready.topics)


@kafka_app.command("down")
@friendly
def kafka_down() -> None:
    """Stop the local Kafka: every node that runs from the data directory, single node or cluster (controlled
    shutdown)."""
    from fulmen.infra.kafka.cluster import stop_all

    settings = _settings()
    if not settings.local_kafka:
        console.print(f"FULMEN_KAFKA_BOOTSTRAP={settings.bootstrap}: not a local broker, nothing to stop")
        return
    stopped = stop_all(settings.broker_data_dir)
    if not stopped:
        console.print("local Kafka was not running")
    elif len(stopped) == 1 and stopped[0].data_dir == settings.broker_data_dir:
        console.print("local Kafka stopped")
    else:
        console.print("local Kafka stopped: " + ", ".join(f"node {s.node_id} ({s.bootstrap})" for s in stopped))


@kafka_app.command("status")
@friendly
def kafka_status(
    brokers: Annotated[int | None, typer.Option(help="nodes of the local cluster (FULMEN_BROKER_NODES)", min=1)] = None,
) -> None:
    """Whether the local Kafka's nodes run and the cluster answers, and where their data and logs are."""
    from fulmen.infra.kafka.admin import cluster_info
    from fulmen.infra.kafka.cluster import LocalCluster, running_layouts

    settings = _settings()
    if brokers is not None:
        settings.broker.nodes = brokers
    if settings.local_kafka:
        local = LocalCluster.from_settings(settings)
        status = local.status()
        for node in status.nodes:
            state = f"running (pid {node.pid})" if node.running else "stopped"
            name = "local Kafka" if len(status.nodes) == 1 else f"local Kafka node {node.node_id}"
            console.print(f"{name}: {state} at {node.bootstrap}\n  data: {node.data_dir}\n  log:  {node.log_file}")
        others = {n: s for n, s in running_layouts(settings.broker_data_dir).items() if n != len(status.nodes)}
        for size, nodes in others.items():
            what = "a single-node local Kafka" if size == 1 else f"a cluster of {size} nodes"
            pids = ", ".join(str(n.pid) for n in nodes)
            console.print(
                f"[yellow]also running from {settings.broker_data_dir}:[/] {what} (pid {pids}): "
                f"`fulmen kafka status --brokers {size}`"
            )
        if not status.any_running:
            raise typer.Exit(3)
        if len(status.nodes) > 1:
            leader = local.quorum_leader()
            shown = f"node {leader}" if leader else "none running (an election is under way)"
            console.print(f"controller quorum leader: {shown}")
    info = asyncio.run(cluster_info(settings))
    brokers_seen = ", ".join(f"{b['node_id']}={b['host']}:{b['port']}" for b in info["brokers"])
    console.print(f"cluster {info['cluster_id']}: controller {info['controller_id']}, brokers {brokers_seen}")
    if settings.local_kafka and not status.running:
        raise typer.Exit(4)  # answers, but a node is down


@kafka_app.command("topics")
@friendly
def kafka_topics(create: Annotated[bool, typer.Option(help="create missing topics, apply settings")] = False) -> None:
    """Fulmen's topics as the cluster has them."""
    from fulmen.infra.kafka.admin import describe_topics, ensure_topics

    settings = _settings()
    states = asyncio.run(ensure_topics(settings) if create else describe_topics(settings))
    _print_topics(states)


@kafka_app.command("fetch")
@friendly
def kafka_fetch() -> None:
    """Download the Kafka jars from Maven Central into the cache (done automatically by `up`)."""
    from fulmen.infra.kafka.cluster import LocalCluster

    console.print(f"Kafka jars in {LocalCluster.from_settings(_settings()).fetch()}")


def _print_topics(states: list[Any]) -> None:
    table = Table("topic", "partitions", "replicas", "in sync", "settings", "state")
    for s in states:
        config = ", ".join(f"{k}={v}" for k, v in sorted(s.config.items()))
        state = s.action or ("exists" if s.exists else "[red]missing[/]")
        in_sync = str(s.in_sync) if s.in_sync >= s.replicas else f"[red]{s.in_sync}[/]"
        shown = (str(s.partitions), str(s.replicas), in_sync) if s.exists else ("-", "-", "-")
        table.add_row(s.name, *shown, config, state)
    console.print(table)


# --- store ---------------------------------------------------------------------------------------------------
@store_app.command("migrate")
@friendly
def store_migrate() -> None:
    """Create or upgrade the tables (idempotent)."""
    from fulmen.infra.store import Store

    store = Store.open(_settings())
    applied = store.migrate()
    console.print(
        f"store {store.location} database {store.database}: "
        + (", ".join(f"{m.version} {m.name}" for m in applied) + " applied" if applied else "up to date")
    )


@app.command("sql")
@friendly
def sql(
    query: Annotated[str, typer.Argument(help="a SELECT (writes and DDL are refused)")],
    fmt: Annotated[str, typer.Option("--format", "-f", help="table, csv, json or jsonl")] = "table",
    raw: Annotated[bool, typer.Option(help="do not deduplicate (show rows a redelivery wrote twice)")] = False,
    wide: WideOption = False,
    utc: UtcOption = False,
) -> None:
    """Query the store with SQL. Results are deduplicated unless --raw.

    With the embedded store, a running `fulmen consume` owns it and answers the query; otherwise the store is
    opened here. With FULMEN_CLICKHOUSE_URL the server is queried. A table fits the terminal: ids as unique
    prefixes, times to the second (--wide: whole); csv and json carry every value whole.
    """
    from fulmen.cli.render import FORMATS, render, table_style
    from fulmen.infra.store import open_reader

    if fmt not in FORMATS:
        raise typer.BadParameter(f"--format must be one of {', '.join(FORMATS)}")
    settings = _settings(CliProcessSettings)
    result = read_query(open_reader(settings), query, final=not raw)
    render(result, fmt, console, table_style(settings.cli, wide=wide, utc=utc))


# --- consumers -----------------------------------------------------------------------------------------------
@app.command("consume")
@friendly
def consume(
    sinks: Annotated[list[str] | None, typer.Option("--sink", help="only these sinks (repeatable)")] = None,
) -> None:
    """Materialise Kafka topics into the store until interrupted (SIGINT/SIGTERM flush and exit)."""
    from fulmen.consumers import ConsumersApp, consume_sinks
    from fulmen.consumers.settings import ConsumersSettings
    from fulmen.infra.services import ensure_store

    settings = _settings(ConsumersSettings, service=True)
    available = {s.name: s for s in consume_sinks(settings)}
    unknown = set(sinks or []) - set(available)
    if unknown:
        raise FulmenError(f"unknown sink(s) {', '.join(sorted(unknown))}; valid: {', '.join(available)}")
    chosen = [available[n] for n in sinks] if sinks else list(available.values())
    _kafka_for(settings, "fulmen consume")
    store = ensure_store(settings)
    _run_until_signal(lambda: ConsumersApp(settings, store, chosen))


def _kafka_for(settings: FulmenSettings, command: str) -> None:
    """Kafka for a command that needs it; a local broker it had to start keeps running for the next commands, and
    the command says so and how to stop it."""
    from fulmen.infra.services import ensure_kafka

    if ensure_kafka(settings).started is not None:
        err.print(
            f"{command}: started a local Kafka at {settings.bootstrap}; it keeps running for the next commands "
            "(`fulmen down` or `fulmen kafka down` stops it)",
            highlight=False,
            soft_wrap=True,
        )


# --- producers -----------------------------------------------------------------------------------------------
# Each service's options are its settings section's fields (fulmen.cli.settings_options), secrets excepted.
OTLP_OPTIONS = SectionOptions(OtlpSection, "otlp")
LLM_OPTIONS = SectionOptions(LlmSection, "llm")
DASHBOARD_OPTIONS = SectionOptions(DashboardSettings, "dashboard")
RUNNER_OPTIONS = SectionOptions(RunnerSection, "runner")


@app.command("otlp-gateway")
@with_options(OTLP_OPTIONS)
@friendly
def otlp_gateway(**options: Any) -> None:
    """Receive OTLP/HTTP traces at /v1/traces and publish them to the spans topic until interrupted."""
    from fulmen.producers.otlp_gateway import OtlpGateway, OtlpGatewaySettings

    settings = _settings(OtlpGatewaySettings, service=True, overrides=OTLP_OPTIONS.overrides(options))
    _run_until_signal(lambda: OtlpGateway(settings))


@app.command("llm-gateway")
@with_options(LLM_OPTIONS)
@friendly
def llm_gateway(**options: Any) -> None:
    """Serve an OpenAI-compatible API at /v1 that records every call (token ids included) as a span in Kafka."""
    from fulmen.producers.llm_gateway import LlmGateway, LlmGatewaySettings

    settings = _settings(LlmGatewaySettings, service=True, overrides=LLM_OPTIONS.overrides(options))
    if settings.llm.model == "tiny" and settings.llm.backend in ("transformers", "llamacpp"):  # a model directory
        from fulmen.algorithm.tiny_model import build_tiny_model
        from fulmen.producers.llm_gateway.tiny import build_once, tiny_model_dir

        settings.llm.model = str(build_once(tiny_model_dir(settings.home), build_tiny_model))
    _run_until_signal(lambda: LlmGateway(settings))


@app.command("dashboard")
@with_options(DASHBOARD_OPTIONS)
@friendly
def dashboard(**options: Any) -> None:
    """Serve the read-only dashboard over the store (the read endpoint of `fulmen consume`, or the ClickHouse
    server): runs and their steps, rollouts and their traces, model versions and promotions, prompt bundles, dead
    letters (pages /, /rollouts, /models, /prompts, /dead-letters; JSON under /api). GET /healthz answers when
    ready."""
    from fulmen.dashboard import Dashboard
    from fulmen.infra.settings import DashboardProcessSettings

    settings = _settings(DashboardProcessSettings, service=True, overrides=DASHBOARD_OPTIONS.overrides(options))
    _run_until_signal(lambda: Dashboard.from_settings(settings))


def _run_until_signal(build: Callable[[], Any]) -> None:
    """Build the component inside the event loop (aiokafka clients need one), run it until SIGINT/SIGTERM."""

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await build().run(stop)

    asyncio.run(main())


@app.command("runner")
@with_options(RUNNER_OPTIONS)
@friendly
def runner(**options: Any) -> None:
    """Run rollouts from the tasks topic through the agent until interrupted (SIGTERM finishes or hands back)."""
    import os

    from fulmen.producers.runner import Runner, RunnerSettings, load_agent

    settings = _settings(RunnerSettings, service=True, overrides=RUNNER_OPTIONS.overrides(options))
    if not settings.runner.agent:
        raise FulmenError("which agent? pass --agent package.module:function (or set FULMEN_RUNNER_AGENT)")
    sys.path.insert(0, os.getcwd())  # agents next to where the runner starts, as `python -m` would find them
    function = load_agent(settings.runner.agent)
    _kafka_for(settings, "fulmen runner")
    _run_until_signal(lambda: Runner(settings, function))


@app.command("submit")
@friendly
def submit(
    tasks: Annotated[Path, typer.Argument(help="JSONL: one task per line")],
    group_size: Annotated[int, typer.Option("--group-size", "-g", help="rollouts per task (GRPO's G)")] = 1,
    mode: Annotated[str | None, typer.Option(help="train or val (overrides the file)")] = None,
) -> None:
    """Publish the tasks of a JSONL file as rollout requests (validated whole before anything is sent)."""
    from fulmen.infra.kafka.broker import kafka_broker
    from fulmen.infra.kafka.clients import close_quietly, start_or_raise
    from fulmen.infra.kafka.publish import EventPublisher
    from fulmen.producers.submit import SENDER, publish, requests_for
    from fulmen.schemas.events import RolloutMode
    from fulmen.schemas.task_file import load_task_file

    settings = _settings()
    modes = [m.value for m in RolloutMode if m.dispatched]  # production rollouts are recorded, never submitted
    if mode is not None and mode not in modes:
        raise FulmenError(f"--mode must be one of {', '.join(modes)}")
    submission = requests_for(load_task_file(tasks), group_size, mode=RolloutMode(mode) if mode else None)
    _kafka_for(settings, "fulmen submit")

    async def send() -> None:
        broker = kafka_broker(settings)
        try:
            await start_or_raise(broker, settings, "submit")
            await publish(EventPublisher(broker, SENDER), submission)
        finally:
            await close_quietly([broker])

    asyncio.run(send())
    console.print(f"submitted {len(submission.requests)} rollouts in {len(submission.groups)} groups")


@app.command("feedback")
@friendly
def feedback(
    value: Annotated[float, typer.Option(help="the score: a finite number")],
    response_id: Annotated[str | None, typer.Option(help="an LLM call: the id the gateway answered with")] = None,
    rollout_id: Annotated[str | None, typer.Option(help="a rollout: its latest attempt, as a whole")] = None,
    trace_id: Annotated[str | None, typer.Option(help="a trace (32 hex digits): its episode, as a whole")] = None,
    name: Annotated[str, typer.Option(help="what is scored; training reads 'reward'")] = "reward",
    comment: Annotated[str, typer.Option(help="free text kept with the score")] = "",
) -> None:
    """Send a reward for an LLM call, a rollout or a trace (exactly one), any time after it; prints its feedback id.
    The latest feedback of a name wins; one whose target never reaches the store is dead-lettered, saying why."""
    from fulmen.cli.feedback import send_feedback

    request = {
        "response_id": response_id,
        "rollout_id": rollout_id,
        "trace_id": trace_id,
        "value": value,
        "name": name,
        "comment": comment,
    }
    console.print(send_feedback(_settings(), request).feedback_id)


app.command("rollouts")(rollouts_command)  # fulmen/cli/rollouts.py


# --- the stack -----------------------------------------------------------------------------------------------
@app.command("up")
@friendly
def up(
    model: Annotated[
        str | None, typer.Option(help="model directory, 'tiny', or the upstream's model (FULMEN_LLM_MODEL, or tiny)")
    ] = None,
    backend: Annotated[
        str | None, typer.Option(help="transformers, llamacpp, vllm or openai (FULMEN_LLM_BACKEND)")
    ] = None,
    detach: Annotated[bool, typer.Option("--detach", help="run in the background; `fulmen down` stops it")] = False,
    max_restarts: Annotated[int, typer.Option(help="restarts of one service within --window, then stop", min=0)] = 3,
    window: Annotated[float, typer.Option(help="seconds of the restart window", min=1.0)] = 60.0,
) -> None:
    """Start the stack an agent needs: Kafka (unless FULMEN_KAFKA_BOOTSTRAP), `fulmen consume`, the OTLP and LLM
    gateways and the dashboard (when installed); print the two settings for the agent; restart a service that
    dies (at most --max-restarts within --window seconds, then stop everything); stop on Ctrl-C / SIGTERM."""
    from fulmen.cli.stack import StackOptions, supervise
    from fulmen.cli.stack import detach as run_detached
    from fulmen.producers.llm_gateway import LlmGatewaySettings
    from fulmen.producers.otlp_gateway import OtlpGatewaySettings

    settings = _settings(service=True)
    llm, otlp = _settings(LlmGatewaySettings, service=True).llm, _settings(OtlpGatewaySettings, service=True).otlp
    if backend is not None and backend not in ("transformers", "llamacpp", "vllm", "openai"):
        raise FulmenError("--backend must be transformers, llamacpp, vllm or openai")
    options = StackOptions(
        model=model or llm.model or "tiny", backend=backend, max_restarts=max_restarts, window_s=window
    )

    def say(line: str) -> None:
        print(line, flush=True)  # plain lines: the daemon's log and a test read them as they are

    if detach:
        raise typer.Exit(run_detached(settings, options, say))
    raise typer.Exit(supervise(settings, _stack_ports(settings, llm.port, otlp.port), options, say))


def _stack_ports(settings: FulmenSettings, llm_port: int, otlp_port: int) -> Any:
    """The ports the services' own settings name (0: a free one)."""
    import os

    from fulmen.infra.processes import free_port
    from fulmen.infra.stack import DASHBOARD_PORT, StackPorts

    read_port = settings.clickhouse.read_port
    dashboard = os.environ.get("FULMEN_DASHBOARD_PORT", "")  # the dashboard's own section names it
    if dashboard and not dashboard.isdigit():
        raise FulmenError(f"FULMEN_DASHBOARD_PORT={dashboard!r} is not a port number")
    ports = [read_port, otlp_port, llm_port, int(dashboard or DASHBOARD_PORT)]
    return StackPorts(*(port or free_port() for port in ports))


@app.command("down")
@friendly
def down() -> None:
    """Stop what Fulmen runs on this machine: the stack `fulmen up --detach` started (and the local Kafka it
    started), its pid files removed; with no stack, a local Kafka that another command (`fulmen submit`, `runner`,
    `consume`, `kafka up`) left running."""
    from fulmen.cli.stack import down as stop_stack

    raise typer.Exit(stop_stack(_settings(), console.print))


@app.command("status")
@friendly
def status(wide: WideOption = False, utc: UtcOption = False) -> None:
    """Each service of the stack `fulmen up` runs: pid, state, URL, uptime and what its metrics say it did (calls,
    spans, rows stored, lag, dead letters; its /metrics is beside its URL). Exit 1 when one is down, 3 when no stack
    runs."""
    from fulmen.cli.render import render, table_style
    from fulmen.cli.stack import stack_dir, status_rows
    from fulmen.infra.store import QueryResult

    settings = _settings(CliProcessSettings)
    rows, code = status_rows(settings)
    if not rows:
        console.print(f"no stack runs ({stack_dir(settings)} has no up.pid): start one with `fulmen up`")
        raise typer.Exit(code)
    result = QueryResult(["service", "pid", "state", "url", "uptime"], [list(row[:5]) for row in rows])
    render(
        result,
        "table",
        console,
        table_style(settings.cli, wide=wide, utc=utc),
        cell_styles={"state": lambda state: None if state == "up" else "red"},
    )
    said = [(row[0], row[5]) for row in rows if row[5] != "-"]
    if said:
        console.print("what each did (its /metrics; rates since it started):", highlight=False)
        for name, activity in said:
            console.print(f"  {name:<13} {activity}", highlight=False, soft_wrap=True)
    console.print(f"stack directory: {stack_dir(settings)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


# --- algorithm: fulmen train (fulmen/cli/train.py) ------------------------------------------------------------
app.command("train")(train_command)
app.command("improve")(improve_command)  # fulmen/cli/improve.py
app.command("init")(init_command)  # fulmen/cli/init.py
app.command("optimize-prompt")(optimize_prompt_command)  # fulmen/cli/optimize.py


# --- config and schemas --------------------------------------------------------------------------------------
@config_app.command("show")
@friendly
def config_show() -> None:
    """Print the settings in force, secrets masked: the shared sections (home, kafka, broker, clickhouse, log) and
    every process's own (runner, otlp, llm, transitions, feedback, production, train, dashboard, cli)."""
    from fulmen.algorithm.settings import TrainSettings
    from fulmen.consumers.settings import ConsumersSettings
    from fulmen.infra.settings import DashboardProcessSettings
    from fulmen.producers.llm_gateway.settings import LlmGatewaySettings
    from fulmen.producers.otlp_gateway.settings import OtlpGatewaySettings
    from fulmen.producers.runner.settings import RunnerSettings

    shown: dict[str, Any] = {}
    for cls in (
        RunnerSettings,
        OtlpGatewaySettings,
        LlmGatewaySettings,
        ConsumersSettings,
        TrainSettings,
        DashboardProcessSettings,
        CliProcessSettings,
    ):
        shown.update(_settings(cls).masked())  # each has the shared sections too
    console.print_json(json.dumps(shown))


@schemas_app.command("export")
@friendly
def schemas_export(
    out: Annotated[Path, typer.Option(help="directory to write into")] = Path("schemas-export"),
) -> None:
    """Write a JSON Schema per event and an AsyncAPI 3.0 document of the topics, generated by faststream from the
    components' declared publishers and subscribers."""
    from fulmen.asyncapi import asyncapi_document
    from fulmen.schemas.export import json_schemas

    settings = _settings()
    out.mkdir(parents=True, exist_ok=True)
    schemas = json_schemas()
    for name, schema in schemas.items():
        (out / f"{name}.schema.json").write_text(json.dumps(schema, indent=2) + "\n")
    (out / "asyncapi.json").write_text(json.dumps(asyncapi_document(settings), indent=2) + "\n")
    console.print(f"wrote {len(schemas)} JSON Schemas and asyncapi.json to {out}/")


# --- demo ----------------------------------------------------------------------------------------------------
@app.command("demo")
@friendly
def demo(
    as_json: Annotated[bool, typer.Option("--json", help="print the report as JSON on the last line")] = False,
    steps: Annotated[int | None, typer.Option(help="GRPO steps (default 30)", min=1)] = None,
    shuffle_rewards: Annotated[
        bool, typer.Option("--shuffle-rewards", help="CONTROL run: rewards shuffled within each step")
    ] = False,
    algorithm: Annotated[
        str, typer.Option(help="grpo, dr_grpo, rloo, dapo, gspo or cispo (FULMEN_TRAIN_ALGORITHM's recipes)")
    ] = "grpo",
    mode: Annotated[str, typer.Option(help="sync, or async: generation and training overlap fully")] = "sync",
    stop_at_accuracy: Annotated[
        float | None,
        typer.Option(help="stop early once the held-out accuracy (validated every 5 steps) reaches this", min=0, max=1),
    ] = None,
) -> None:
    """An agent visibly learning through the whole system: warm up a tiny model, start Kafka, the store, the
    gateways and a runner, train with GRPO (or --algorithm) on arithmetic word problems, report held-out
    accuracy before and after, the curves and the SQL to explore the stored data; stop everything it started."""
    from fulmen.cli.demo import run_demo_command

    run_demo_command(
        _settings(),
        console,
        steps=steps,
        shuffle_rewards=shuffle_rewards,
        as_json=as_json,
        algorithm=algorithm,
        mode=mode,
        stop_at_accuracy=stop_at_accuracy,
    )


@app.command("smoke")
@friendly
def smoke(
    as_json: Annotated[bool, typer.Option("--json", help="print the report as JSON on the last line")] = False,
) -> None:
    """A fast check of the plumbing: one event of each kind through Kafka into the store, read back with SQL."""
    from fulmen.cli.smoke import run_smoke
    from fulmen.infra.services import ensure_kafka, ensure_store

    settings = _settings(CliProcessSettings)  # its tables print as FULMEN_CLI_* says
    with console.status("starting Kafka (first run downloads its jars) and the store..."):
        ready = ensure_kafka(settings)
        store = ensure_store(settings)
    console.print(f"[green]✓[/] Kafka at {ready.bootstrap}" + (" (started for this check)" if ready.started else ""))
    console.print(f"[green]✓[/] store {store.location}, database {store.database}")
    try:
        with console.status("publishing one event of each kind and materialising them..."):
            report = asyncio.run(run_smoke(settings, store))
    finally:
        if ready.started is not None:
            ready.started.stop()
    _print_smoke(report, ready.started is not None, settings.cli)
    if as_json:
        print(json.dumps(report.as_dict()))
    ok = report.task_read_back and report.dead_letter is not None and all(r.rows for _, _, r in report.queries)
    if not ok:
        raise FulmenError("the smoke run did not see every event come back; see the output above")


def _print_smoke(report: Any, stopped: bool, cli: Any) -> None:
    from fulmen.cli.render import render, table_style

    console.print(
        f"[green]✓[/] published (run id {report.run_id}): " + ", ".join(f"{k} {v}" for k, v in report.published.items())
    )
    console.print(f"[green]✓[/] task read back from Kafka: {report.task_read_back}")
    if report.dead_letter:
        d = report.dead_letter
        where = f"{d.source_topic}[{d.source_partition}]@{d.source_offset}"
        console.print(f"[green]✓[/] poison record dead-lettered: {where}: {d.error}")
    for title, query, result in report.queries:
        console.print(f'\n[bold]{title}[/]  [dim]fulmen sql "{query}"[/]')
        render(result, "table", console, table_style(cli))
    console.print(
        f"\ndone in {report.wall_s:.1f}s" + ("; the broker this demo started is stopped." if stopped else ".")
    )


@app.command("export")
@friendly
def export(
    run: Annotated[str, typer.Argument(help="the run: its id (a directory under FULMEN_HOME/runs) or its directory")],
    target: Annotated[Path, typer.Argument(help="where to write: a new (or empty) directory")],
    version: Annotated[
        int | None, typer.Option(help="the model version; default: the latest checkpoint", min=0)
    ] = None,
    gguf: Annotated[str | None, typer.Option(help="also a GGUF for llama.cpp: f32, f16, bf16 or q8_0")] = None,
    merge_adapters: Annotated[
        bool, typer.Option("--merge-adapters", help="per-agent adapters: one whole model per agent, its adapter merged")
    ] = False,
) -> None:
    """Write a run's trained model where other tools serve it: its Hugging Face directory (transformers, vLLM), and a
    GGUF with --gguf (llama.cpp, Ollama); per-agent adapters as they are, or merged into whole models with
    --merge-adapters. Prints how to serve what it wrote."""
    from fulmen.export import export_model

    settings = _settings()
    with console.status(f"exporting {run}..."):
        report = export_model(
            run, target, version=version, gguf=gguf, merge_adapters=merge_adapters, home=settings.home
        )
    console.print(f"version {report.version} ({report.checkpoint}) exported to {report.target}", highlight=False)
    for line in report.how_to_serve():
        console.print(f"  {line}", highlight=False, soft_wrap=True)


flow_help(app)  # after every command is registered: help wraps as paragraphs (fulmen/cli/help_text.py)


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
