"""Agents written with real frameworks, each traced by the framework's own OpenTelemetry instrumentation, and
what their spans look like. (They import nothing of Fulmen's; ``show_spans`` prints a tree.)

* ``langgraph_agent:write_check_rewrite`` (sync): StateGraph write → check → rewrite, one ``ChatOpenAI`` call
  per node, traced by openinference ``LangChainInstrumentor``.
* ``openai_agents_agent:add_numbers`` (async): ``Agent`` "calculator" + ``@function_tool add``, Chat Completions
  model, ``max_turns=3``, traced by openinference ``OpenAIAgentsInstrumentor`` (exclusive: the SDK's exporter to
  OpenAI's servers is removed).
* ``autogen_agent:multiply_numbers`` (async): ``AssistantAgent`` "multiplier" + tool ``multiply``, reflection on,
  at most 2 calls; AutoGen's own spans plus, for the LLM calls, the ``openai`` client instrumentation.

Measured with langgraph 1.2.24, langchain-openai 1.7.4, openinference-instrumentation-langchain 0.1.80,
openai-agents 0.24.0, openinference-instrumentation-openai-agents 2.6.0, autogen-agentchat/core/ext 0.7.5,
openai 3.57, OTel SDK 1.45.2; every run under the runner's ``rollout`` span (``tests/unit/test_framework_agents``).

Common to all three
-------------------
* All spans stay in the trace of the runner's ``rollout`` span, the framework's top span is its child, and
  every span carries ``fulmen.rollout.*`` / ``fulmen.task.id`` from the rollout stamper, also with two rollouts
  running at once in one process (sync agent in a worker thread, async agents as tasks).
* No ``traceparent`` (nor any W3C header) reaches the LLM server, from any of them: nothing instruments httpx,
  and neither openinference nor ``opentelemetry-instrumentation-openai-v2`` injects context. So the gateway's
  own span for a call cannot be parented on the agent's span; it must be tied to the rollout by the URL path
  (``/rollout/<id>/attempt/<n>/v1``), and to a framework span by order/time within the rollout or, where the
  framework records it, by the completion id (see "join key" below). Getting traceparent would need
  ``opentelemetry-instrumentation-httpx`` (not a dependency today) turned on in the agent process.
* Request bodies differ: ChatOpenAI sends ``max_completion_tokens`` (not ``max_tokens``) and
  ``stream_options: {include_usage: true}`` when streaming; the Agents SDK sends ``tools[].function.strict: true``
  and no ``stream`` key; AutoGen sends ``max_tokens``, ``tool_choice: "auto"``, ``strict: false``, user messages
  with ``name: "user"``, and no tools on its reflection call. Assistant tool-call messages come back with
  ``content: null``; tool results as ``{"role": "tool", "tool_call_id", "content"}``.

LangGraph + openinference LangChainInstrumentor
-----------------------------------------------
All spans kind INTERNAL, scope ``openinference.instrumentation.langchain``::

    rollout
    └─ "write_check_rewrite"  CHAIN   (the compiled graph's name)   metadata={"ls_integration": "langgraph"}
       ├─ "write"    CHAIN   metadata={..., "langgraph_step": 1, "langgraph_node": "write", ...}
       │  └─ "ChatOpenAI"  LLM     metadata={..., "langgraph_node": "write", ...}
       ├─ "check"    CHAIN   └─ "ChatOpenAI" LLM  (langgraph_node "check")
       └─ "rewrite"  CHAIN   └─ "ChatOpenAI" LLM  (langgraph_node "rewrite")

* LLM-call span: name = the chat model class (``ChatOpenAI``), ``openinference.span.kind = "LLM"``, parent = the
  node's CHAIN span. Attributes: ``llm.model_name``, ``llm.provider``/``llm.system`` = "openai",
  ``llm.invocation_parameters`` (JSON: model, stream, max_completion_tokens...), ``llm.input_messages.<i>.
  message.role|content``, ``llm.output_messages.0.message.role|content`` (+ ``.tool_calls...`` when any),
  ``llm.token_count.prompt|completion|total``, ``llm.finish_reason``, ``input.value``/``output.value`` (JSON of
  the LangChain messages / LLMResult), ``metadata``. Streaming gives the same attributes (token counts only
  because the agent sets ``stream_usage=True``).
* Node name: NOT in ``graph.node.name`` / ``graph.node.id`` (this instrumentation never writes them). It is the
  ``langgraph_node`` key of the ``metadata`` JSON string, present on the node span AND copied onto the LLM span
  itself, so "only write and rewrite" is a filter on the LLM span alone:
  ``json.loads(attrs["metadata"])["langgraph_node"] in {"write", "rewrite"}``. The node span's name is the node
  name too. The graph span has ``langgraph_node`` absent. No agent name exists in this graph.
* Join key: the completion id (``chatcmpl-...``) is only inside ``output.value``
  (``llm_output.id`` / ``...response_metadata.id``), and only for non-streamed calls.
* Gotcha: openinference's LangChain spans are not made current. Spans opened inside a node by anything else
  (the ``openai`` client instrumentation, the user's own tracer) are children of the *rollout* span, not of the
  node span: with ``OpenAIInstrumentor`` on, each call also yields a ``chat <model>`` CLIENT span under
  ``rollout``, i.e. two LLM spans per call that are not parent and child.

OpenAI Agents SDK + openinference OpenAIAgentsInstrumentor
----------------------------------------------------------
All spans kind INTERNAL, scope ``openinference.instrumentation.openai_agents``, built from the SDK's own trace
(start/end times copied from it)::

    rollout
    └─ "add_numbers"  AGENT   (the SDK trace = RunConfig.workflow_name; NO agent.name)
       └─ "add_numbers"  CHAIN   (the SDK "task" span: one Runner.run)
          └─ "calculator"  AGENT   agent.name="calculator", graph.node.id="calculator"
             ├─ "turn"  CHAIN                     (one per agent-loop turn)
             │  ├─ "generation"  LLM              (one per chat completion)
             │  └─ "add"  TOOL   tool.name="add", input.value='{"a": 2, "b": 2}', output.value=4 (int)
             └─ "turn"  CHAIN
                └─ "generation"  LLM

* LLM-call span: name ``generation``, ``openinference.span.kind = "LLM"``, parent = ``turn``, grandparent = the
  agent span. Attributes: ``llm.system`` = "openai", ``llm.model_name``, ``llm.invocation_parameters`` = JSON
  ``{"base_url": ".../rollout/<id>/attempt/<n>/v1/"}`` (the rollout is readable from it),
  ``llm.input_messages.*``, ``llm.output_messages.*`` (tool calls as ``...tool_calls.<j>.tool_call.id|
  function.name|function.arguments``), ``input.value``/``output.value`` (JSON), ``llm.token_count.prompt|
  completion`` (no total). No ``gen_ai.*``, no response/completion id, no finish reason.
* Agent name: ``agent.name`` (and ``graph.node.id``) on the AGENT span that is an ancestor (two levels up) of
  the LLM span, never on the LLM span. Beware: the top span also has kind AGENT (the workflow) without
  ``agent.name``; select agents by the attribute, not by the kind. With handoffs, ``graph.node.parent_id``
  names the agent handed off from (not exercised here).
* Errors: a tool the model invents ends the run (``ModelBehaviorError``; ``turn`` span ERROR, 1 call); arguments
  that are not JSON are answered to the model as a tool error (TOOL span ERROR) until ``MaxTurnsExceeded`` (3
  calls; agent span ERROR). Spans are current while open, so other instrumentation nests under ``generation``.
* ``set_tracing_disabled(True)`` would silence these spans as well: it disables the SDK's tracing, which is
  what openinference listens to.

AutoGen AgentChat 0.7 (autogen_core's gen_ai spans)
---------------------------------------------------
AutoGen opens spans itself on the global provider (``trace.get_tracer("autogen-core")``), nothing to enable::

    rollout
    ├─ "create_agent multiplier"  CLIENT   (when AssistantAgent is constructed; ends at once)
    └─ "invoke_agent multiplier"  CLIENT   gen_ai.operation.name="invoke_agent", gen_ai.agent.name="multiplier"
       ├─ "chat <model>"  CLIENT   (only with the openai client instrumentation, see below)
       ├─ "execute_tool multiply"  INTERNAL   gen_ai.tool.name, gen_ai.tool.call.id, gen_ai.tool.description
       └─ "chat <model>"  CLIENT

* ``create_agent``/``invoke_agent`` carry ``gen_ai.operation.name``, ``gen_ai.system = "autogen"``,
  ``gen_ai.agent.name``, ``gen_ai.agent.description`` (and ``gen_ai.agent.id`` when run inside a team's
  runtime). In a team (RoundRobinGroupChat) the runtime adds many PRODUCER/CONSUMER spans
  ("autogen publish|process|create|ack <topic>", scope "autogen SingleThreadedAgentRuntime", with the whole
  message JSON in a ``message`` attribute); ``invoke_agent`` then sits under an "autogen process" span, and the
  LLM spans stay its children. ``AUTOGEN_DISABLE_RUNTIME_TRACING=true`` drops the runtime spans.
* LLM calls: AutoGen 0.7.5's ``OpenAIChatCompletionClient`` opens NO span (it only logs an ``LLMCallEvent``).
  AutoGen's tracing guide has users turn on the OpenAI client instrumentation; with
  ``opentelemetry-instrumentation-openai-v2`` each call is a ``chat <model>`` CLIENT span, child of
  ``invoke_agent``, with ``gen_ai.operation.name = "chat"``, ``gen_ai.system = "openai"``,
  ``gen_ai.request.model``, ``gen_ai.request.max_tokens``, ``gen_ai.response.model``, ``gen_ai.response.id``
  (= the completion id: a join key to the gateway's span), and, non-streamed only, ``gen_ai.response.finish_reasons``
  and ``gen_ai.usage.input_tokens|output_tokens``. Agent name: ``gen_ai.agent.name`` on the parent span.
* IN THIS ENVIRONMENT that instrumentation does not import: the lock pins
  ``opentelemetry-instrumentation-openai-v2==2.4b0`` with ``opentelemetry-util-genai==1.3b0``, and 2.4b0 imports
  ``opentelemetry.util.genai.instruments``, which 1.x renamed (``_instruments``). With util-genai 0.4b0 on the
  path it imports and works (checked; 2.3b0 of the instrumentation fails instead on wrapt 2). The agent logs a
  warning and runs without LLM spans; the test that needs them is skipped with that reason.
* Bad answers do not raise: an unknown tool or non-JSON arguments come back to the model as an error result (no
  ``execute_tool`` span), and the reflection call answers; 2 calls either way.
"""
