"""The ChatML chat template with tools that Fulmen's tiny model ships, and that the LLM gateway can impose on any
model (``FULMEN_LLM_CHAT_TEMPLATE=chatml-tools``): tools listed in the system turn, a call written as
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (the Hermes / Qwen2.5 style the gateway parses back
into OpenAI ``tool_calls``), an assistant turn without content rendered as its calls alone.
"""

from __future__ import annotations

__all__ = ["CHAT_TEMPLATE"]

# Jinja, rendered by transformers' apply_chat_template (trim_blocks and lstrip_blocks on, and `-}}`:
# the template's own line breaks vanish, the text's come from `nl`). Kept compact: a character-level model
# pays for every character of the prompt.
CHAT_TEMPLATE = """\
{% set nl = "\\n" %}
{% if tools or messages[0].role == "system" %}
{{ "<|im_start|>system" ~ nl -}}
{% if messages[0].role == "system" %}{{ messages[0].content }}{% endif %}
{% if tools %}
{{ nl ~ "Tools:" -}}
{% for tool in tools %}
{{ nl ~ ((tool.function if tool.function is defined else tool) | tojson) -}}
{% endfor %}
{{ nl ~ 'Call one as <tool_call>{"name": ..., "arguments": {...}}</tool_call>' -}}
{% endif %}
{{ "<|im_end|>" ~ nl -}}
{% endif %}
{% for message in messages if message.role != "system" %}
{{ "<|im_start|>" ~ message.role ~ nl -}}
{% if message.content is string %}{{ message.content -}}
{% elif message.content %}{% for part in message.content %}{{ part.text }}{% endfor %}
{% endif %}
{% for call in message.tool_calls or [] %}
{% set fn = call.function if call.function is defined else call %}
{% set arguments = fn.arguments if fn.arguments is string else (fn.arguments | tojson) %}
{{ '<tool_call>{"name": ' ~ (fn.name | tojson) ~ ', "arguments": ' ~ arguments ~ "}</tool_call>" -}}
{% endfor %}
{{ "<|im_end|>" ~ nl -}}
{% endfor %}
{% if add_generation_prompt %}{{ "<|im_start|>assistant" ~ nl }}{% endif %}
"""
