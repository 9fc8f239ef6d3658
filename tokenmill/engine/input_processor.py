"""The one way in: prompts and chats become validated token ids, for every front end.

HTTP, gRPC, the CLI and the offline `LLM` all render chats with `render_chat` and turn prompts into
engine input with `InputProcessor.process`, which checks them against the model (vocabulary,
context length, logit_bias ids) and raises the typed errors of `tokenmill.errors`.

Chat role injection: message contents are user data, so special-token strings inside them (e.g. a
literal `<|im_start|>system`) are tokenized as plain text, while the markers the chat template
writes stay control tokens (transformers' `sanitize_control_tokens`). transformers marks the
strings of messages and tools but not dict keys, which templates render too (tool parameter
names, `$defs` names, keys of tool-call arguments): tokenmill marks those keys the same way. Trusted deployments that
want the old behaviour pass `special_tokens_in_content=True` (server: --allow-special-tokens-in-messages).
Raw completion prompts are the caller's own template: their special-token strings are parsed
unless `escape_special=True` (server: --escape-special-tokens-in-prompts).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase
from transformers.utils.chat_template_utils import mark_control_tokens

from tokenmill.engine.pooling_params import PoolingParams
from tokenmill.engine.sampling_params import MAX_TOP_LOGPROBS, SamplingParams
from tokenmill.errors import ContextLengthExceeded, InvalidRequest

if TYPE_CHECKING:
    from tokenmill.lora.types import LoRAAdapter

Message = Mapping[str, Any]


@dataclass(frozen=True)
class PromptInput:
    """A validated prompt, ready to queue: its token ids and, when it was given as text, the text.
    `processing_start`/`processing_end` (time.time()) bracket the work that made it: chat rendering,
    tokenization and validation (request traces show them as the request's tokenize stage).
    `lora`: the LoRA adapter the request runs with (None: the base model). `priority`: its place
    under --scheduling-policy priority (lower first; vLLM's request priority)."""

    prompt_token_ids: list[int]
    prompt: str | None = None
    lora: LoRAAdapter | None = None
    priority: int = 0
    processing_start: float | None = field(default=None, compare=False)
    processing_end: float | None = field(default=None, compare=False)

    @property
    def processed(self) -> bool:
        """Checked by `InputProcessor.process` (a rendered chat is not, until it is)."""
        return self.processing_end is not None


# ---------------------------------------------------------------------------------------------- chat


def render_chat(
    tokenizer: Any,
    messages: Sequence[Message | Any],
    *,
    tools: list[dict] | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template_kwargs: dict[str, Any] | None = None,
    special_tokens_in_content: bool = False,
) -> list[int]:
    """A conversation -> prompt token ids, through the model's chat template (or a plain
    `role: content` fallback when it has none). The only chat renderer: every entry point uses it.

    `messages` are OpenAI-shaped dicts (or pydantic models of them): `role`, `content` (a string or
    a list of text parts), and whatever else the template reads (`tool_calls`, `tool_call_id`,
    `name`). `tools` are JSON-schema tool definitions passed to the template.
    `continue_final_message` leaves the last (assistant) message open for the model to continue.
    `special_tokens_in_content=True` parses special-token strings inside contents as control tokens
    (only for trusted input: it lets a message forge turns)."""
    if tokenizer is None:
        raise InvalidRequest("this model has no tokenizer: chat needs one", param="messages")
    turns = [_normalized_message(m, i) for i, m in enumerate(messages)]
    if not turns:
        raise InvalidRequest("messages must not be empty", param="messages")
    if add_generation_prompt and continue_final_message:
        raise InvalidRequest(
            "add_generation_prompt and continue_final_message cannot both be set", param="continue_final_message"
        )
    if continue_final_message and turns[-1].get("role") != "assistant":
        raise InvalidRequest("continue_final_message needs an assistant message last", param="messages")
    extra = dict(chat_template_kwargs or {})
    clash = sorted(set(extra) & _TEMPLATE_ARGUMENTS)
    if clash:
        raise InvalidRequest(f"chat_template_kwargs may not set {', '.join(clash)}", param="chat_template_kwargs")
    if getattr(tokenizer, "chat_template", None):
        ids = _apply_template(
            tokenizer,
            turns,
            tools,
            add_generation_prompt,
            continue_final_message,
            extra,
            sanitize=not special_tokens_in_content,
        )
    else:
        ids = _fallback_template(
            tokenizer, turns, add_generation_prompt, continue_final_message, escape=not special_tokens_in_content
        )
    if not ids:
        raise InvalidRequest("messages render to an empty prompt", param="messages")
    return list(ids)


# apply_chat_template's own arguments: chat_template_kwargs are template variables, never these.
_TEMPLATE_ARGUMENTS = frozenset(inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters) - {
    "self",
    "kwargs",
}


def _normalized_message(message: Message | Any, index: int) -> dict[str, Any]:
    if hasattr(message, "model_dump"):  # a pydantic message from the API layer
        message = message.model_dump(exclude_none=True)
    if not isinstance(message, Mapping) or "role" not in message:
        raise InvalidRequest(f"messages[{index}] must be an object with a role", param=f"messages[{index}]")
    turn = {k: v for k, v in message.items() if v is not None}
    content = turn.get("content")
    if isinstance(content, list):  # OpenAI content parts: tokenmill serves text models, so text parts only
        texts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidRequest(
                    f"messages[{index}].content: only text parts are supported", param=f"messages[{index}].content"
                )
            texts.append(part["text"])
        turn["content"] = "".join(texts)
    elif content is None:
        # Templates concatenate it, also on an assistant turn that only called tools (OpenAI clients
        # send null there, litellm leaves it out): empty text, as vLLM renders it.
        turn["content"] = ""
    if turn.get("tool_calls"):
        turn["tool_calls"] = [_template_tool_call(call) for call in turn["tool_calls"]]
    return turn


def _template_tool_call(call: Any) -> Any:
    """OpenAI sends a call's arguments as JSON text; chat templates expect the object (Qwen, Llama 3
    and Hermes render `arguments | tojson`), as vLLM passes them. Text that is no JSON object stays text."""
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping):
        return call
    arguments = function.get("arguments")
    if not isinstance(arguments, str):
        return call
    try:
        decoded = json.loads(arguments)
    except ValueError:
        return call
    if not isinstance(decoded, dict):
        return call
    return {**call, "function": {**function, "arguments": decoded}}


def _apply_template(
    tokenizer: Any,
    turns: list[dict[str, Any]],
    tools: list[dict] | None,
    add_generation_prompt: bool,
    continue_final_message: bool,
    extra: dict[str, Any],
    sanitize: bool,
) -> list[int]:
    if sanitize:  # (the top-level names of template variables stay: identifiers, never rendered)
        mark = _key_marker(tokenizer, tools)
        turns, tools, extra = mark(turns), mark(tools), {name: mark(value) for name, value in extra.items()}
    try:
        # tokenize=True with add_special_tokens off: the template places BOS and friends itself.
        return tokenizer.apply_chat_template(
            turns,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tokenize=True,
            return_dict=False,
            sanitize_control_tokens=sanitize,
            **extra,
        )
    except (TemplateError, ValueError, TypeError, KeyError, IndexError) as exc:
        # Templates raise on what they do not accept (non-alternating roles, a missing field): the client's to fix.
        raise InvalidRequest(f"The chat template rejected these messages: {exc}", param="messages") from None


def _key_marker(tokenizer: Any, tools: list[dict] | None) -> Callable[[Any], Any]:
    """A function that copies template input with the control tokens inside dict keys wrapped in
    transformers' markers, as `sanitize_control_tokens` wraps them in string values."""
    # The same control tokens as transformers picks for values: special tokens, and added tokens
    # the template writes itself.
    tokens = sorted(tokenizer._get_control_tokens(tokenizer.get_chat_template(None, tools)), key=len, reverse=True)
    pattern = re.compile("|".join(map(re.escape, tokens)) or "(?!)")

    def mark(node: Any) -> Any:
        if isinstance(node, Mapping):
            return {(mark_control_tokens(k, pattern) if isinstance(k, str) else k): mark(v) for k, v in node.items()}
        if isinstance(node, (list, tuple)):
            return [mark(v) for v in node]
        return node

    return mark


def _fallback_template(
    tokenizer: Any, turns: list[dict[str, Any]], add_generation_prompt: bool, continue_final_message: bool, escape: bool
) -> list[int]:
    """`role: content` lines, for tokenizers without a chat template (every special token in the text
    comes from a message, so escaping tokenizes all of them as text)."""
    text = "".join(f"{t['role']}: {t.get('content', '')}\n" for t in turns)
    if continue_final_message:
        text = text.removesuffix("\n")
    elif add_generation_prompt:
        text += "assistant:"
    return tokenizer.encode(text, add_special_tokens=False, split_special_tokens=escape)


# ---------------------------------------------------------------------------------------------- prompts


class InputProcessor:
    """Tokenization and validation against one model; thread-safe (holds no request state)."""

    def __init__(
        self, tokenizer: Any, vocab_size: int, max_model_len: int, max_logprobs: int = MAX_TOP_LOGPROBS
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_logprobs = max_logprobs  # --max-logprobs; -1: no limit

    def render_chat(self, messages: Sequence[Message | Any], **options: Any) -> list[int]:
        """`render_chat` with this model's tokenizer (see there for the options)."""
        return render_chat(self.tokenizer, messages, **options)

    def render_chat_input(self, messages: Sequence[Message | Any], **options: Any) -> PromptInput:
        """`render_chat`, as a PromptInput that remembers when rendering started (for `process`)."""
        start = time.time()
        return PromptInput(self.render_chat(messages, **options), processing_start=start)

    def tokenize(
        self, text: str, *, escape_special: bool = False, param: str = "prompt", add_special_tokens: bool = True
    ) -> list[int]:
        """A raw prompt's token ids, with the tokenizer's own BOS/EOS additions unless turned off."""
        if self.tokenizer is None:
            raise InvalidRequest("this model has no tokenizer: pass prompt token ids", param=param)
        return list(
            self.tokenizer.encode(text, add_special_tokens=add_special_tokens, split_special_tokens=escape_special)
        )

    def remaining_context(self, num_prompt_tokens: int, param: str = "messages") -> int:
        """How many tokens may follow a prompt of this length (OpenAI chat's default max_tokens)."""
        if num_prompt_tokens >= self.max_model_len:
            raise ContextLengthExceeded(
                f"The prompt is {num_prompt_tokens} tokens; this model's context length is {self.max_model_len}.",
                param=param,
            )
        return self.max_model_len - num_prompt_tokens

    def process(
        self,
        prompt: str | Sequence[int] | PromptInput,
        params: SamplingParams | PoolingParams,
        *,
        param: str = "prompt",
        escape_special: bool = False,
        lora: LoRAAdapter | None = None,
        priority: int = 0,
    ) -> PromptInput:
        """Tokenize (text) or check (token ids) a prompt and check it fits with `params` (an
        embedding's PoolingParams: the prompt alone must fit); `lora` goes with it (the adapter the
        front end resolved from the request's model name), and `priority` (the request's)."""
        result = self._process(prompt, params, param, escape_special)
        if lora is not None:
            result = dataclasses.replace(result, lora=lora)
        return dataclasses.replace(result, priority=priority) if priority else result

    def _process(
        self,
        prompt: str | Sequence[int] | PromptInput,
        params: SamplingParams | PoolingParams,
        param: str,
        escape_special: bool,
    ) -> PromptInput:
        start = time.time()
        if isinstance(params, SamplingParams):
            self.check_params(params)
        elif not isinstance(params, PoolingParams):
            raise InvalidRequest("params must be a SamplingParams or a PoolingParams")
        if isinstance(prompt, PromptInput):
            # Rendered but not yet processed (render_chat_input): its ids are checked like any others.
            result = (
                prompt
                if prompt.processed
                else dataclasses.replace(prompt, prompt_token_ids=self._checked_ids(prompt.prompt_token_ids, param))
            )
        elif isinstance(prompt, str):
            if not prompt:
                raise InvalidRequest("prompt must not be empty", param=param)
            result = PromptInput(self.tokenize(prompt, escape_special=escape_special, param=param), prompt)
        else:
            result = PromptInput(self._checked_ids(prompt, param))
        ids = result.prompt_token_ids
        if not ids:
            raise InvalidRequest("prompt must not be empty", param=param)
        if isinstance(params, PoolingParams):
            if len(ids) > self.max_model_len:
                raise ContextLengthExceeded(
                    f"this model's maximum context length is {self.max_model_len} tokens; "
                    f"the input has {len(ids)} tokens",
                    param=param,
                )
            return result
        if len(ids) + params.max_tokens > self.max_model_len:
            raise ContextLengthExceeded(
                f"this model's maximum context length is {self.max_model_len} tokens; the prompt has "
                f"{len(ids)} tokens and max_tokens is {params.max_tokens} "
                f"({len(ids) + params.max_tokens} in all): shorten the prompt or lower max_tokens",
                param=param,
            )
        if result.processed:  # processed before: as it was
            return result
        # A rendered chat keeps the start of its rendering.
        return dataclasses.replace(
            result, processing_start=result.processing_start or start, processing_end=time.time()
        )

    def _checked_ids(self, ids: Sequence[int], param: str) -> list[int]:
        ids = list(ids)
        if any(isinstance(t, bool) or not isinstance(t, int) for t in ids):
            raise InvalidRequest("prompt token ids must be integers", param=param)
        if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):
            raise InvalidRequest(f"prompt token ids must be in [0, {self.vocab_size})", param=param)
        return ids

    def check_params(self, params: SamplingParams) -> None:
        """What SamplingParams cannot check alone: logprobs against --max-logprobs, token ids against
        this model's vocabulary, and whether a structured-output spec parses (a bad schema is the
        request's fault: 400)."""
        for name, asked in (("logprobs", params.logprobs), ("prompt_logprobs", params.prompt_logprobs)):
            if asked is not None and self.max_logprobs != -1 and asked > self.max_logprobs:
                raise InvalidRequest(
                    f"{name}: {asked} requested; this server returns at most {self.max_logprobs} per token "
                    "(--max-logprobs)",
                    param=name,
                )
        bias = params.logit_bias
        if bias and (min(bias) < 0 or max(bias) >= self.vocab_size):
            raise InvalidRequest(f"logit_bias keys must be token ids in [0, {self.vocab_size})", param="logit_bias")
        if params.structured_outputs is not None:
            if self.tokenizer is None:
                raise InvalidRequest(
                    "structured outputs need the model's tokenizer; this model has none", param="structured_outputs"
                )
            params.structured_outputs.validate()  # parse the schema/regex/grammar (compiled later, off-thread)
