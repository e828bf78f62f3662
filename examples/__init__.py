"""Fulmen's examples: three agents written with three frameworks, trained through the whole system.

* ``sql_agent`` (LangGraph): write -> check -> rewrite over a generated SQLite database;
* ``rag_agent`` (OpenAI Agents SDK): multi-hop questions over a generated corpus with a BM25 ``search`` tool;
* ``calc_agent`` (AutoGen AgentChat): arithmetic word problems with a calculator tool.

Each folder holds the agent, its data generator, its reward and a README; ``python -m examples.train NAME``
trains one of them (see ``examples/README.md``).
"""
