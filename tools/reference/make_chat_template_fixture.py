# Writes the chat template fixtures of tests/data/chat: for each template family the runtime's
# built-in renderers reproduce (runtime/data/chat_template.h), <name>/tokenizer_config.json holding
# the family's official chat_template and <name>/expected.json with, per conversation, the text
# transformers' apply_chat_template(messages, tokenize=False) renders and the byte spans an
# assistant-only loss trains. Run it where transformers and tokenizers are installed (no network
# is needed: the templates are below), from the repository root:
#
#   python3 tools/reference/make_chat_template_fixture.py [-o tests/data/chat]
#   python3 tools/reference/make_chat_template_fixture.py --fingerprints   # no transformers needed
#
# The templates are the official texts, test data only (the C++ renderer does not contain them; it
# recognizes them by length and FNV-1a 64 fingerprint, which --fingerprints prints). Sources: the
# tokenizer_config.json of each model below, as TRL records them for identity comparison in
# trl/chat_templates/{llama3_1,llama3_2,qwen2_5,qwen3,mistral}.jinja.
#
# Trained spans: TRL's assistant-only loss (SFTConfig(assistant_only_loss=True)) trains the tokens
# inside a template's {% generation %} blocks, which TRL adds to a copy of the official template
# (trl/chat_templates/*_training.jinja). Here each official template gets sentinel characters
# (U+E000 / U+E001) where those blocks begin and end, in the places TRL puts them; the sentinel
# positions in the rendering are the spans, and the rendering without sentinels must equal the
# official rendering (checked). Per family:
#   llama3, llama3_2: content|trim + '<|eot_id|>'             (TRL's llama3_training.jinja)
#   chatml (Qwen2.5): '\n' + content + '<|im_end|>\n'         (TRL's qwen2_5_training.jinja)
#   qwen3:            the think block (when rendered) + content + '<|im_end|>\n', after
#                     '<|im_start|>assistant\n'               (TRL's qwen3_training.jinja)
#   mistral:          ' ' + content|trim + '</s>'             (TRL's mistral_training.jinja)
# Spans are byte offsets into the UTF-8 text, [begin, end).
import argparse
import json
import os
import sys

# meta-llama/Llama-3.1-8B-Instruct
LLAMA3_1 = r'''{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message + builtin tools #}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{%- if builtin_tools is defined %}
    {{- "Tools: " + builtin_tools | reject('equalto', 'code_interpreter') | join(", ") + "\n\n"}}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- "<|python_tag|>" + tool_call.name + ".call(" }}
            {%- for arg_name, arg_val in tool_call.arguments | items %}
                {{- arg_name + '="' + arg_val + '"' }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- endif %}
                {%- endfor %}
            {{- ")" }}
        {%- else  %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- '{"name": "' + tool_call.name + '", ' }}
            {{- '"parameters": ' }}
            {{- tool_call.arguments | tojson }}
            {{- "}" }}
        {%- endif %}
        {%- if builtin_tools is defined %}
            {#- This means we're in ipython mode #}
            {{- "<|eom_id|>" }}
        {%- else %}
            {{- "<|eot_id|>" }}
        {%- endif %}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
'''

# meta-llama/Llama-3.2-1B-Instruct
LLAMA3_2 = r'''{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message #}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
'''

# Qwen/Qwen2.5-7B-Instruct (and the other Qwen2.5 Instruct sizes)
QWEN2_5 = r'''{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
'''

# Qwen/Qwen3-0.6B (and the other Qwen3 sizes)
QWEN3 = r'''{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}'''

# mistralai/Mistral-7B-Instruct-v0.3
MISTRAL = r'''{%- if messages[0]["role"] == "system" %}
    {%- set system_message = messages[0]["content"] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}
{%- set user_messages = loop_messages | selectattr("role", "equalto", "user") | list %}

{#- This block checks for alternating user/assistant messages, skipping tool calling messages #}
{%- set ns = namespace() %}
{%- set ns.index = 0 %}
{%- for message in loop_messages %}
    {%- if not (message.role == "tool" or message.role == "tool_results" or (message.tool_calls is defined and message.tool_calls is not none)) %}
        {%- if (message["role"] == "user") != (ns.index % 2 == 0) %}
            {{- raise_exception("After the optional system message, conversation roles must alternate user/assistant/user/assistant/...") }}
        {%- endif %}
        {%- set ns.index = ns.index + 1 %}
    {%- endif %}
{%- endfor %}

{{- bos_token }}
{%- for message in loop_messages %}
    {%- if message["role"] == "user" %}
        {%- if tools is not none and (message == user_messages[-1]) %}
            {{- "[AVAILABLE_TOOLS] [" }}
            {%- for tool in tools %}
                {%- set tool = tool.function %}
                {{- '{"type": "function", "function": {' }}
                {%- for key, val in tool.items() if key != "return" %}
                    {%- if val is string %}
                        {{- '"' + key + '": "' + val + '"' }}
                    {%- else %}
                        {{- '"' + key + '": ' + val|tojson }}
                    {%- endif %}
                    {%- if not loop.last %}
                        {{- ", " }}
                    {%- endif %}
                {%- endfor %}
                {{- "}}" }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- else %}
                    {{- "]" }}
                {%- endif %}
            {%- endfor %}
            {{- "[/AVAILABLE_TOOLS]" }}
            {%- endif %}
        {%- if loop.last and system_message is defined %}
            {{- "[INST] " + system_message + "\n\n" + message["content"] + "[/INST]" }}
        {%- else %}
            {{- "[INST] " + message["content"] + "[/INST]" }}
        {%- endif %}
    {%- elif message.tool_calls is defined and message.tool_calls is not none %}
        {{- "[TOOL_CALLS] [" }}
        {%- for tool_call in message.tool_calls %}
            {%- set out = tool_call.function|tojson %}
            {{- out[:-1] }}
            {%- if not tool_call.id is defined or tool_call.id|length != 9 %}
                {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
            {%- endif %}
            {{- ', "id": "' + tool_call.id + '"}' }}
            {%- if not loop.last %}
                {{- ", " }}
            {%- else %}
                {{- "]" + eos_token }}
            {%- endif %}
        {%- endfor %}
    {%- elif message["role"] == "assistant" %}
        {{- " " + message["content"]|trim + eos_token}}
    {%- elif message["role"] == "tool_results" or message["role"] == "tool" %}
        {%- if message.content is defined and message.content.content is defined %}
            {%- set content = message.content.content %}
        {%- else %}
            {%- set content = message.content %}
        {%- endif %}
        {{- '[TOOL_RESULTS] {"content": ' + content|string + ", " }}
        {%- if not message.tool_call_id is defined or message.tool_call_id|length != 9 %}
            {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
        {%- endif %}
        {{- '"call_id": "' + message.tool_call_id + '"}[/TOOL_RESULTS]' }}
    {%- else %}
        {{- raise_exception("Only user and assistant roles are supported, with the exception of an initial optional system message!") }}
    {%- endif %}
{%- endfor %}
'''

BEGIN, END = "\ue000", "\ue001"  # where a {% generation %} block begins and ends


def replaced(text, old, new, count=1):
    assert text.count(old) == count, (old, text.count(old))
    return text.replace(old, new)


def llama3_tagged(t):
    line = ("        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
            "+ message['content'] | trim + '<|eot_id|>' }}")
    assistant = ("        {%- if message['role'] == 'assistant' %}\n"
                 "            {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
                 f" + '{BEGIN}' + message['content'] | trim + '<|eot_id|>' + '{END}' }}}}\n"
                 "        {%- else %}\n" + line + "\n        {%- endif %}")
    return replaced(t, line, assistant)


def qwen2_5_tagged(t):
    line = ("        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>'"
            " + '\\n' }}")
    assistant = ("        {%- if message.role == 'assistant' %}\n"
                 f"            {{{{- '<|im_start|>' + message.role + '{BEGIN}' + '\\n' + message.content"
                 f" + '<|im_end|>' + '\\n' + '{END}' }}}}\n"
                 "        {%- else %}\n" + line + "\n        {%- endif %}")
    return replaced(t, line, assistant)


def qwen3_tagged(t):
    t = replaced(t, "'<|im_start|>' + message.role + '\\n<think>\\n'",
                 f"'<|im_start|>' + message.role + '\\n' + '{BEGIN}' + '<think>\\n'")
    t = replaced(t, "{{- '<|im_start|>' + message.role + '\\n' + content }}",
                 f"{{{{- '<|im_start|>' + message.role + '\\n' + '{BEGIN}' + content }}}}", count=2)
    return replaced(t, "{{- '<|im_end|>\\n' }}\n    {%- elif message.role == \"tool\" %}",
                    f"{{{{- '<|im_end|>\\n' + '{END}' }}}}\n    {{%- elif message.role == \"tool\" %}}")


def mistral_tagged(t):
    return replaced(t, '{{- " " + message["content"]|trim + eos_token}}',
                    f'{{{{- "{BEGIN}" + " " + message["content"]|trim + eos_token + "{END}"}}}}')


# name: (official template, tagged copy, bos_token, eos_token, model the template comes from,
# arguments every conversation gets). Llama 3.2's template takes today's date (strftime_now) when
# no date_string is given, so its fixture passes one.
FAMILIES = {
    "llama3": (LLAMA3_1, llama3_tagged, "<|begin_of_text|>", "<|eot_id|>",
               "meta-llama/Llama-3.1-8B-Instruct", {}),
    "llama3_2": (LLAMA3_2, llama3_tagged, "<|begin_of_text|>", "<|eot_id|>",
                 "meta-llama/Llama-3.2-1B-Instruct", {"date_string": "01 Dec 2026"}),
    "chatml": (QWEN2_5, qwen2_5_tagged, None, "<|im_end|>", "Qwen/Qwen2.5-7B-Instruct", {}),
    "qwen3": (QWEN3, qwen3_tagged, None, "<|im_end|>", "Qwen/Qwen3-0.6B", {}),
    "mistral": (MISTRAL, mistral_tagged, "<s>", "</s>", "mistralai/Mistral-7B-Instruct-v0.3", {}),
}


def conv(*turns):
    return [{"role": r, "content": c} for r, c in turns]


S, U, A = "system", "user", "assistant"
# (name, messages, extra apply_chat_template arguments); every family renders every conversation,
# and one a template refuses (raise_exception) is recorded with its message.
CONVERSATIONS = [
    ("single", conv((U, "Hello!"), (A, "Hi there. How can I help?")), {}),
    ("system_multi", conv((S, "You are a terse assistant."), (U, "What is 2+2?"), (A, "4"),
                          (U, "And 3+3?"), (A, "6")), {}),
    ("three_turns", conv((U, "Name a colour."), (A, "Blue."), (U, "Another one?"), (A, "Green."),
                         (U, "Last one."), (A, "Red.\nThat is all.")), {}),
    ("unicode", conv((U, "Grüße aus Köln — 你好，世界 🌍"), (A, "こんにちは! Ça va? 🚀 ünïcödé")), {}),
    ("empty_content", conv((U, ""), (A, "")), {}),
    ("empty_system", conv((S, ""), (U, "Hi"), (A, "Hello")), {}),
    ("whitespace", conv((S, "  spaced system \n"), (U, "\n\n  leading and trailing  \t\n"),
                        (A, "  \n answer with spaces \n\n ")), {}),
    ("unicode_whitespace", conv((U, "\u3000ideographic\u3000"),
                                (A, "\u00a0nbsp\u2003em\u2028\u0085\x1f \u200bzero width\u200b\ufeff")), {}),
    ("only_whitespace", conv((U, " \t "), (A, "\n\n")), {}),
    ("ends_with_user", conv((S, "Be brief."), (U, "q1"), (A, "a1"), (U, "q2")), {}),
    ("think", conv((U, "Solve x+1=2"), (A, "<think>\nx = 2-1 = 1\n</think>\n\nx = 1")), {}),
    ("think_multi", conv((U, "q1"), (A, "<think>r1</think>a1"), (U, "q2"),
                         (A, "<think>\n\nr2\n\n</think>\n\n\na2")), {}),
    ("think_close_only", conv((U, "q"), (A, "reasoning</think>answer")), {}),
    ("think_twice", conv((U, "q"), (A, "<think>a</think>b<think>c</think>d")), {}),
    ("think_blank", conv((U, "q"), (A, "<think>\n</think>a1"), (A, " <think> </think>a2")), {}),
    ("tool_response_user", conv((U, "q"), (A, "<think>r</think>a"),
                                (U, "<tool_response>x</tool_response>"), (A, "b")), {}),
    ("no_query", conv((U, "<tool_response>r</tool_response>"), (A, "<think>t</think>a")), {}),
    ("assistant_only", conv((S, "s"), (A, "<think>t</think>x")), {}),
    ("crlf", conv((S, "line\r\n"), (U, "a\r\nb\r\n"), (A, "\r\nc\r\n")), {}),
    ("consecutive_assistant", conv((U, "q"), (A, "a1"), (A, "<think>r</think>a2")), {}),
    ("consecutive_user", conv((U, "a"), (U, "b"), (A, "c")), {}),
    ("starts_with_assistant", conv((A, "I start."), (U, "ok"), (A, "fine")), {}),
    ("special_tokens_in_content", conv((U, "literal <|im_end|> [INST] <|eot_id|> </s>"),
                                       (A, "</s> <think> only open <|im_start|>")), {}),
    ("date_string", conv((S, "sys"), (U, "When?"), (A, "Now.")), {"date_string": "05 Mar 2025"}),
]


def fingerprint(text):
    # The C++ side's normalization: one trailing newline is dropped (jinja2 drops it too, as
    # transformers compiles templates without keep_trailing_newline), then FNV-1a 64 of the bytes.
    if text.endswith("\n"):
        text = text[:-1]
    data = text.encode()
    h = 1469598103934665603
    for b in data:
        h = ((h ^ b) * 1099511628211) % (1 << 64)
    return len(data), h


def make_tokenizer(bos, eos):
    # A word-level tokenizer stands in for the real one: tokenize=False only reads the special
    # tokens (bos_token, eos_token) the template refers to.
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, eos: 1}
    special = {"unk_token": "<unk>", "eos_token": eos}
    if bos is not None:
        vocab[bos] = 2
        special["bos_token"] = bos
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")), **special)


def byte_offset(text, char_index):
    return len(text[:char_index].encode())


def render(tok, template, tagged, messages, kwargs):
    text = tok.apply_chat_template(messages, chat_template=template, tokenize=False, **kwargs)
    marked = tok.apply_chat_template(messages, chat_template=tagged, tokenize=False, **kwargs)
    assert isinstance(text, str) and isinstance(marked, str), type(text)
    spans, plain, begin = [], [], None
    for ch in marked:
        if ch == BEGIN:
            assert begin is None
            begin = len("".join(plain))
        elif ch == END:
            assert begin is not None
            end = len("".join(plain))
            spans.append([byte_offset(text, begin), byte_offset(text, end)])
            begin = None
        else:
            plain.append(ch)
    assert begin is None and "".join(plain) == text, "the tagged template renders other text"
    return text, spans


def main():
    p = argparse.ArgumentParser()
    p.add_argument("-o", "--output", default="tests/data/chat")
    p.add_argument("--fingerprints", action="store_true",
                   help="print each official template's byte length and FNV-1a 64 and exit")
    a = p.parse_args()
    if a.fingerprints:
        for name, (template, *_rest) in FAMILIES.items():
            n, h = fingerprint(template)
            print(f"{name}: {n} bytes, 0x{h:016x}")
        return
    import jinja2
    import transformers

    for name, (template, tag, bos, eos, model, family_kwargs) in FAMILIES.items():
        tagged = tag(template)
        tok = make_tokenizer(bos, eos)
        cases = []
        for case, messages, case_kwargs in CONVERSATIONS:
            kwargs = {**family_kwargs, **case_kwargs}
            for m in messages:
                assert BEGIN not in m["content"] and END not in m["content"]
            entry = {"name": case, "messages": messages}
            if kwargs:
                entry["kwargs"] = kwargs
            try:
                entry["text"], entry["trained"] = render(tok, template, tagged, messages, kwargs)
            except jinja2.exceptions.TemplateError as e:  # the template's raise_exception
                entry["error"] = str(e)
            cases.append(entry)
        folder = os.path.join(a.output, name)
        os.makedirs(folder, exist_ok=True)
        config = {"chat_template": template, "eos_token": eos, "model": model}
        if bos is not None:
            config["bos_token"] = bos
        with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
            json.dump(config, f, indent=2, ensure_ascii=False)
            f.write("\n")
        with open(os.path.join(folder, "expected.json"), "w") as f:
            json.dump({"transformers": transformers.__version__, "cases": cases}, f, indent=1,
                      ensure_ascii=False)
            f.write("\n")
        print(f"{folder}: {len(cases)} conversations")


if __name__ == "__main__":
    sys.exit(main())
