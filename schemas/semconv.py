"""Every span name and attribute key Fulmen reads or writes, in one place.

Three families:

* ``gen_ai.*`` — the OpenTelemetry semantic conventions for generative AI, which the LLM gateway writes and
  which the common agent frameworks (OpenAI Agents SDK, AutoGen, LangChain/LangGraph instrumentations) write
  on their own spans. https://opentelemetry.io/docs/specs/semconv/gen-ai/
* OpenInference names (``openinference.*``, ``llm.*``, ``input.value``...) written by the Arize OpenInference
  instrumentations, which many LangGraph and Agents SDK users run instead.
* ``fulmen.*`` — our own: what training needs and no convention carries (exact token ids, logprobs, the
  serving model version, the rollout a span belongs to, rewards).

No other module may spell one of these strings; import the constant.
"""

from __future__ import annotations

from typing import Final

# --- OpenTelemetry gen_ai semantic conventions -------------------------------------------------------------
GEN_AI_OPERATION_NAME: Final = "gen_ai.operation.name"  # "chat", "text_completion", "invoke_agent", ...
GEN_AI_PROVIDER_NAME: Final = "gen_ai.provider.name"
GEN_AI_SYSTEM: Final = "gen_ai.system"  # older name of gen_ai.provider.name, still emitted by many
GEN_AI_REQUEST_MODEL: Final = "gen_ai.request.model"
GEN_AI_REQUEST_TEMPERATURE: Final = "gen_ai.request.temperature"
GEN_AI_REQUEST_TOP_P: Final = "gen_ai.request.top_p"
GEN_AI_REQUEST_MAX_TOKENS: Final = "gen_ai.request.max_tokens"
GEN_AI_REQUEST_SEED: Final = "gen_ai.request.seed"
GEN_AI_REQUEST_STOP_SEQUENCES: Final = "gen_ai.request.stop_sequences"
GEN_AI_REQUEST_CHOICE_COUNT: Final = "gen_ai.request.choice.count"
GEN_AI_RESPONSE_ID: Final = "gen_ai.response.id"
GEN_AI_RESPONSE_MODEL: Final = "gen_ai.response.model"
GEN_AI_RESPONSE_FINISH_REASONS: Final = "gen_ai.response.finish_reasons"
GEN_AI_USAGE_INPUT_TOKENS: Final = "gen_ai.usage.input_tokens"
GEN_AI_USAGE_OUTPUT_TOKENS: Final = "gen_ai.usage.output_tokens"
GEN_AI_INPUT_MESSAGES: Final = "gen_ai.input.messages"
GEN_AI_OUTPUT_MESSAGES: Final = "gen_ai.output.messages"
GEN_AI_SYSTEM_INSTRUCTIONS: Final = "gen_ai.system_instructions"
GEN_AI_TOOL_DEFINITIONS: Final = "gen_ai.tool.definitions"
GEN_AI_AGENT_NAME: Final = "gen_ai.agent.name"
GEN_AI_AGENT_ID: Final = "gen_ai.agent.id"
GEN_AI_CONVERSATION_ID: Final = "gen_ai.conversation.id"
GEN_AI_TOOL_NAME: Final = "gen_ai.tool.name"
GEN_AI_TOOL_CALL_ID: Final = "gen_ai.tool.call.id"
GEN_AI_EVALUATION_NAME: Final = "gen_ai.evaluation.name"
GEN_AI_EVALUATION_SCORE_VALUE: Final = "gen_ai.evaluation.score.value"
GEN_AI_EVALUATION_SCORE_LABEL: Final = "gen_ai.evaluation.score.label"
GEN_AI_EVALUATION_EXPLANATION: Final = "gen_ai.evaluation.explanation"

# Values of gen_ai.operation.name
OPERATION_CHAT: Final = "chat"
OPERATION_TEXT_COMPLETION: Final = "text_completion"
OPERATION_INVOKE_AGENT: Final = "invoke_agent"
OPERATION_EXECUTE_TOOL: Final = "execute_tool"

# --- OpenInference ---------------------------------------------------------------------------------------
OPENINFERENCE_SPAN_KIND: Final = "openinference.span.kind"  # "LLM", "AGENT", "TOOL", "CHAIN", ...
OPENINFERENCE_LLM_MODEL_NAME: Final = "llm.model_name"
OPENINFERENCE_LLM_TOKEN_COUNT_PROMPT: Final = "llm.token_count.prompt"
OPENINFERENCE_LLM_TOKEN_COUNT_COMPLETION: Final = "llm.token_count.completion"
OPENINFERENCE_INPUT_VALUE: Final = "input.value"
OPENINFERENCE_OUTPUT_VALUE: Final = "output.value"
OPENINFERENCE_AGENT_NAME: Final = "agent.name"
OPENINFERENCE_GRAPH_NODE_ID: Final = "graph.node.id"
OPENINFERENCE_GRAPH_NODE_NAME: Final = "graph.node.name"
OPENINFERENCE_METADATA: Final = "metadata"  # JSON; LangGraph puts "langgraph_node" in it

# --- OpenTelemetry resource and general conventions --------------------------------------------------------
SERVICE_NAME: Final = "service.name"
EXCEPTION_EVENT_NAME: Final = "exception"

# --- fulmen.* : ours ----------------------------------------------------------------------------------------
ROLLOUT_ID: Final = "fulmen.rollout.id"
ROLLOUT_ATTEMPT: Final = "fulmen.rollout.attempt"
ROLLOUT_GROUP_ID: Final = "fulmen.rollout.group_id"
TASK_ID: Final = "fulmen.task.id"
AGENT_NAME: Final = "fulmen.agent.name"
MODEL_VERSION: Final = "fulmen.model.version"
PROMPT_TOKEN_IDS: Final = "fulmen.llm.prompt_token_ids"  # int[]: exactly what the model was fed
RESPONSE_TOKEN_IDS: Final = "fulmen.llm.response_token_ids"  # int[]: exactly what the model sampled
RESPONSE_LOGPROBS: Final = "fulmen.llm.response_logprobs"  # double[]: one per response token
TOKEN_IDS_ABSENT_REASON: Final = "fulmen.llm.token_ids_absent"  # why a backend could not record token ids
TOKEN_ARRAY_INVALID: Final = "fulmen.llm.token_array_invalid"  # set by the spans consumer: kept as text instead
LLM_REPLICA: Final = "fulmen.llm.replica"  # which replica served the call (an upstream's URL without secrets)
LLM_AGENT: Final = "fulmen.llm.agent"  # the agent the call named in its URL (``.../agent/{name}/v1``)
LLM_ADAPTER: Final = "fulmen.llm.adapter"  # whose LoRA adapter served that call, or ADAPTER_NONE
ADAPTER_NONE: Final = "base"  # the call named an agent with no adapter: the model's own weights served it
PROMPT_BUNDLE: Final = "fulmen.prompt.bundle"  # the prompt bundle applied to the call (schemas/prompts.py)
PROMPT_SLOTS: Final = "fulmen.prompt.slots"  # the bundle's slots whose text replaced the agent's (string array)
PROMPT_BUNDLE_HEADER: Final = "X-Fulmen-Prompt-Bundle"  # the LLM gateway's response header: the bundle it applied
REWARD_VALUE: Final = "fulmen.reward.value"
REWARD_NAME: Final = "fulmen.reward.name"
ANNOTATION_PREFIX: Final = "fulmen.annotation."

# Span names we create
SPAN_ROLLOUT: Final = "fulmen.rollout"
SPAN_REWARD: Final = "fulmen.reward"
SPAN_ANNOTATION: Final = "fulmen.annotation"

# Attribute keys whose value is a list of token ids or logprobs (typed columns in the spans table).
TOKEN_ARRAY_KEYS: Final = (PROMPT_TOKEN_IDS, RESPONSE_TOKEN_IDS, RESPONSE_LOGPROBS)

# Where the agent name may be found, in order of preference.
AGENT_NAME_KEYS: Final = (AGENT_NAME, GEN_AI_AGENT_NAME, OPENINFERENCE_AGENT_NAME, OPENINFERENCE_GRAPH_NODE_NAME)

# Where a reward may be found on a span, in order of preference.
REWARD_KEYS: Final = (REWARD_VALUE, GEN_AI_EVALUATION_SCORE_VALUE)


def all_keys() -> dict[str, str]:
    """Every constant of this module by its Python name (for docs, and to check there are no duplicates)."""
    return {name: value for name, value in globals().items() if name.isupper() and isinstance(value, str)}
