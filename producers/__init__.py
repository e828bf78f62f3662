"""What emits events: the OTLP gateway, the LLM gateway, the agent runner."""
