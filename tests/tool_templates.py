"""Chat templates that offer tools, for tool-calling tests (the bundled SmolLM2 template has none).

HERMES_TEMPLATE follows the layout of Qwen 2.5's template (tools as JSON in <tools>, calls in
<tool_call> with the arguments object, tool results as <tool_response> in a user turn), written
for these tests; LLAMA3_TEMPLATE only has the markers the default-parser choice looks at.
"""

from __future__ import annotations

import shutil
from pathlib import Path

HERMES_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'user' or message.role == 'system' or (message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant' }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- set call = tool_call.function if tool_call.function is defined else tool_call %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + call.name + '\", \"arguments\": ' }}{{- call.arguments | tojson }}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

LLAMA3_TEMPLATE = (
    "{{- bos_token }}{%- if tools %}<|start_header_id|>system<|end_header_id|>\\n\\n"
    "Respond in the format {\"name\": function name, \"parameters\": dictionary of argument name and its value}."
    "{%- for t in tools %}{{ t | tojson }}{%- endfor %}<|eot_id|>{%- endif %}"
    "{%- for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\\n\\n"
    "{%- if m.tool_calls %}<|python_tag|>{{ m.tool_calls[0].function | tojson }}{%- else %}{{ m.content }}{%- endif %}"
    "<|eot_id|>{%- endfor %}"
    "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\\n\\n{%- endif %}"
)


def with_chat_template(model_dir: Path, target: Path, template: str) -> Path:
    """A copy of `model_dir` (weights linked, not copied) whose tokenizer has `template`."""
    from transformers import AutoTokenizer

    target.mkdir(parents=True, exist_ok=True)
    for item in model_dir.iterdir():
        if item.suffix == ".safetensors":
            (target / item.name).symlink_to(item)
        elif item.is_file():
            shutil.copy(item, target / item.name)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = template
    tokenizer.save_pretrained(target)
    return target
