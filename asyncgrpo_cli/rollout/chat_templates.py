"""Prefix-preserving training chat templates for tool use (SPEC §13.1, §13.3, Appendix B.27).

A multi-turn rollout renders the whole conversation every turn. The rendering of turn ``k+1`` should start
with turn ``k``'s prompt followed by the tokens the model generated; otherwise the turn forks a new
sample (``rollout/fork_frac``). ChatML-family templates break that in two ways this module fixes:

- Qwen3's template renders an earlier assistant message without its ``<think>`` block (and, with
  ``enable_thinking=False``, without the empty block the generation prompt had);
- ChatML templates without tool support (e.g. SmolLM2's) drop ``tool_calls`` from assistant messages.

`TOOLS_CHATML_TEMPLATE` is our own ChatML template with tools (written for this project from the family's
layout: ``<tools>`` schemas in the system turn, ``<tool_call>{json}</tool_call>`` in assistant turns,
``<tool_response>`` blocks in a user turn), which renders every assistant message exactly as it was
generated, its think block included. `training_chat_template` picks it for the families it fits.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["TOOLS_CHATML_TEMPLATE", "training_chat_template"]

TOOLS_CHATML_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- set no_think = enable_thinking is defined and enable_thinking is false -%}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if messages and messages[0].role == 'system' -%}{{- messages[0].content + '\\n\\n' -}}{%- endif -%}"
    "{{- '# Tools\\n\\nThese functions are available. Their JSON signatures:\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    "{{- '\\n</tools>\\n\\nTo call one, write a JSON object with its name and arguments between tags:\\n"
    "<tool_call>\\n{\"name\": <function name>, \"arguments\": <arguments object>}\\n</tool_call><|im_end|>\\n' -}}"
    "{%- elif messages and messages[0].role == 'system' -%}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'system' and loop.first -%}"
    "{%- elif m.role == 'assistant' -%}"
    "{%- set content = m.content if m.content is string else '' -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if m.reasoning_content is defined and m.reasoning_content is not none -%}"
    "{{- '<think>\\n' + m.reasoning_content + '\\n</think>\\n\\n' -}}"
    "{%- elif no_think and loop.index0 > ns.last_user -%}{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
    "{{- content -}}"
    "{%- for call in m.tool_calls or [] -%}"
    "{%- set fn = call.function if call.function is defined else call -%}"
    "{%- if content or not loop.first -%}{{- '\\n' -}}{%- endif -%}"
    "{{- '<tool_call>\\n{\"name\": \"' + fn.name + '\", \"arguments\": ' -}}"
    "{%- if fn.arguments is string -%}{{- fn.arguments -}}{%- else -%}{{- fn.arguments | tojson -}}{%- endif -%}"
    "{{- '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- elif m.role == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' -}}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- else -%}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if no_think -%}{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}{%- endif -%}"
)
"""ChatML with tools and think blocks, prefix-preserving: appending a message never changes how the earlier
ones render. Honours ``enable_thinking=False`` (``chat_template_kwargs``) like Qwen3."""


def _family(template: str) -> str | None:
    if "<|im_start|>" not in template:
        return None
    if "<tool_call>" in template and ("last_query_index" in template or "reasoning_content" in template):
        return "qwen3"
    if "tools" not in template and "tool_calls" not in template:
        return "chatml-without-tools"
    return None


def training_chat_template(tokenizer: Any) -> str | None:
    """The training template to use with tools for ``tokenizer``'s family, or None to keep its own.

    Qwen3-family templates (ChatML with ``<tool_call>`` and think-block stripping) and ChatML templates that
    cannot render tools get `TOOLS_CHATML_TEMPLATE`; other templates (already ours, other families) are kept,
    and a fork caused by them shows in ``rollout/fork_frac``.
    """
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str) or template == TOOLS_CHATML_TEMPLATE:
        return None
    family = _family(template)
    if family is None:
        return None
    logger.info("tools are on: the %s chat template is replaced by the prefix-preserving training template "
                "(README: Agent training)", family)
    return TOOLS_CHATML_TEMPLATE
