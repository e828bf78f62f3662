"""The demo: an agent visibly learning arithmetic word problems through the whole system (``fulmen demo``).

Modules: ``tasks`` (the generated problems), ``agent`` (the two-call tool-using agent the runners run),
``calc`` (the safe expression evaluator), ``warmup`` (the tiny model and its short supervised warm-up),
``services`` (the processes the demo starts and stops), ``run`` (the orchestration), ``report`` (plot, queries).
"""

__all__: list[str] = []
