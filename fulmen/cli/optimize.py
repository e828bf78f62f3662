"""``fulmen optimize-prompt``: search better texts for the prompts an agent already sends (registered by
``fulmen.cli.main``); :func:`fulmen.optimize_prompt` does the work, this prints its progress and report. The search
options are :class:`fulmen.prompt_optimization.PromptSearchOptions`' fields (one declaration each)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from fulmen.cli.base import console, friendly, load_settings
from fulmen.cli.settings_options import SectionOptions, with_options
from fulmen.prompt_optimization import PromptSearchOptions

__all__ = ["SEARCH_OPTIONS", "optimize_prompt_command"]

SEARCH_OPTIONS = SectionOptions(
    PromptSearchOptions,
    "search",
    aliases={"slots": "--slot", "roles": "--role", "agents": "--only-agent", "rollout_timeout_s": "--rollout-timeout"},
    panel="Search",
    variables=False,
)


@with_options(SEARCH_OPTIONS)
@friendly
def optimize_prompt_command(
    agent: Annotated[str, typer.Option(help="module:function the runners run (the agent, unchanged)")],
    dataset: Annotated[Path, typer.Option(help="JSONL of training tasks (the search's minibatches)")],
    val: Annotated[Path, typer.Option(help="JSONL of validation tasks (the candidates' scores)")],
    test: Annotated[Path, typer.Option(help="JSONL of test tasks (the report; never used to choose)")],
    optimizer_url: Annotated[
        str, typer.Option(help="an OpenAI-compatible URL ending in /v1 (key: FULMEN_OPTIMIZER_API_KEY)")
    ],
    max_rollouts: Annotated[int, typer.Option(help="the budget: agent rollouts at most, the report's included", min=1)],
    model: Annotated[
        str, typer.Option(help="the policy: 'tiny', a model directory, or the upstream's name (FULMEN_LLM_BACKEND)")
    ] = "tiny",
    local: Annotated[
        bool, typer.Option("--local/--deployed", help="start the stack for this run, or use the deployment in force")
    ] = True,
    runners: Annotated[int, typer.Option(help="--local: runner processes of the agent", min=1)] = 1,
    concurrency: Annotated[int, typer.Option(help="--local: rollouts at once per runner", min=1)] = 32,
    train_steps: Annotated[
        int,
        typer.Option(
            help="then this many GRPO steps on rollouts naming the best bundle (the FULMEN_TRAIN_* in force; "
            "needs a model the trainer loads: 'tiny' or a directory)",
            min=0,
        ),
    ] = 0,
    json_out: Annotated[bool, typer.Option("--json", help="print the report as one JSON line")] = False,
    **options: Any,
) -> None:
    """Optimise the prompts AGENT already sends, with no change to it: candidates are prompt bundles the LLM
    gateway applies to each rollout's calls, scored by the agent's own rewards through the whole system; the
    optimiser LLM reads the failing episodes from the store. Reports the best bundle on --test. With --train-steps
    N it then trains the model N GRPO steps on the best bundle's rollouts (prompts first, then weights)."""
    from fulmen.prompt_optimization import optimize_prompt

    report = optimize_prompt(
        agent,
        dataset,
        val,
        test,
        optimizer_url,
        max_rollouts,
        model=model,
        runners=runners,
        concurrency=concurrency,
        local=local,
        train_steps=train_steps,
        settings=load_settings(),
        on_phase=None if json_out else (lambda text: console.print(f"[green]•[/] {text}")),
        **SEARCH_OPTIONS.overrides(options).get("search", {}),
    )
    if json_out:
        typer.echo(json.dumps(report.summary() | {"run_dir": str(report.run_dir), "best_slots": report.best_slots}))
    else:
        _print_report(report)


def _print_report(report: Any) -> None:
    table = Table("bundle", "parents", "validation", "found at rollout", "texts")
    for row in report.lineage:
        texts = " | ".join(" ".join(text.split())[:60] for text in row["slots"].values())
        best = " (best)" if row["id"] == report.best_bundle else ""
        table.add_row(
            row["id"] + best,
            ", ".join(row["parents"]) or "-",
            f"{row['mean']:.3f}",
            str(row["found_at_rollouts"]),
            texts,
        )
    console.print(table)
    console.print(
        f"test split: {report.heldout_before:.3f} with the agent's own prompts, {report.heldout_after:.3f} "
        f"with {report.best_bundle}"
    )
    console.print(
        f"rollouts used: {report.rollouts_used} of {report.max_rollouts} ({report.stopped_by}); calls whose "
        f"span names another bundle than their rollout's: {report.bundle_mismatches} of "
        f"{report.calls_checked}"
    )
    for name, text in sorted(report.best_slots.items()):
        console.print(f"\n[bold]{name}[/bold]", highlight=False)
        console.print(text, highlight=False, markup=False)
    served = f"promoted {report.promoted}" if report.promoted else f"fulmen prompts promote {report.best_bundle}"
    if report.train is not None:
        console.print(
            f"GRPO on {report.best_bundle}'s rollouts: {report.train.steps} step(s), rewards "
            + ", ".join(f"{r:.3f}" for _, r in report.train.reward_curve)
        )
        console.print(
            f"final model: {report.train.final_model or '- (no step trained)'}", soft_wrap=True, highlight=False
        )
    console.print(f"\nrun {report.run_id} in {report.wall_s:.0f}s; {served}")
