"""Models for tool-calling tests: chat templates that offer tools (the bundled SmolLM2 template has
none) and a scripted model that writes a given reply to a given conversation.

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
    'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": '
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'user' or message.role == 'system' or (message.role == 'assistant' and not message.tool_calls) %}"  # noqa: E501
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant' }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- set call = tool_call.function if tool_call.function is defined else tool_call %}"
    '{{- \'\\n<tool_call>\\n{"name": "\' + call.name + \'", "arguments": \' }}{{- call.arguments | tojson }}'
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

# Qwen3's thinking switch on top of the Hermes layout: with enable_thinking false the generation
# prompt closes an empty <think> section, so the model answers at once.
QWEN3_TEMPLATE = HERMES_TEMPLATE.replace(
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}",
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}",
)

LLAMA3_TEMPLATE = (
    "{{- bos_token }}{%- if tools %}<|start_header_id|>system<|end_header_id|>\\n\\n"
    'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.'
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


def scripted_model(tokenizer_dir: Path, target: Path, template: str, prompt_ids: list[int], reply: str) -> Path:
    """A GPT-2 whose greedy reply to `prompt_ids` is `reply` followed by EOS (see `scripted_turns_model`)."""
    return scripted_turns_model(tokenizer_dir, target, template, [(len(prompt_ids), reply)])


def scripted_turns_model(tokenizer_dir: Path, target: Path, template: str, turns: list[tuple[int, str]]) -> Path:
    """A GPT-2 that answers any prompt of `n` tokens with `reply` followed by EOS, token for token, for
    each `(n, reply)` of `turns` (the turns of a tool loop: each request's prompt is longer).

    A random model cannot decide to call a tool; this one is told to. Attention and MLP write
    nothing, so the last hidden state is LayerNorm(wte[token] + wpe[position]): each reply position
    has an axis of its own, and the (untied) output row of the token it must write points along
    it, POSITION_GAIN strong, so the position picks the next token with probability ~1 even when
    sampled. The other half of the axes hold small random token embeddings and output rows: off the
    script (other prompts) the model writes random text, as a random model does. Runs through
    tokenmill's native GPT-2 path."""
    import torch
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    scripts = [(n, [*tokenizer.encode(reply, add_special_tokens=False), tokenizer.eos_token_id]) for n, reply in turns]
    positions = [n - 1 + k for n, script in scripts for k in range(len(script))]
    assert len(set(positions)) == len(positions), "two turns' replies overlap: their prompts are too close in length"
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=max(1024, max(positions) + 64),
        n_embd=2 * len(positions),  # twice the axes needed: LayerNorm's mean shift stays small
        n_layer=1,
        n_head=2,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    model = GPT2LMHeadModel(config)
    with torch.no_grad():
        for param in model.parameters():
            param.zero_()
        model.transformer.ln_f.weight.fill_(1.0)
        spare = slice(len(positions), config.n_embd)  # the axes no reply position uses
        generator = torch.Generator().manual_seed(0)
        model.transformer.wte.weight[:, spare] = 0.05 * torch.randn(len(tokenizer), len(positions), generator=generator)
        model.lm_head.weight[:, spare] = torch.randn(len(tokenizer), len(positions), generator=generator)
        axis = 0
        for n, script in scripts:
            for k, token in enumerate(script):
                model.transformer.wpe.weight[n - 1 + k, axis] = 1.0
                model.lm_head.weight[token, axis] = POSITION_GAIN
                axis += 1
    target.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(target, safe_serialization=True)
    tokenizer.chat_template = template
    tokenizer.save_pretrained(target)
    return target


POSITION_GAIN = 10.0
