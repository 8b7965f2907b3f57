"""Prompts and conversations whose routing tokens must equal vLLM's own (``/tokenize``).

Shared by the unit tests (against transformers' ``apply_chat_template``) and the real-vLLM tests
(against a live server's ``/tokenize``). Every body here is one vLLM 0.32 accepts.

- `build_tokenizer(path)` trains a byte-level BPE tokenizer offline (deterministic), with a BOS
  post-processor and the Llama-style `STRING_TEMPLATE`, and saves it (``save_pretrained``).
- `STRING_TEMPLATE` emits ``bos_token`` itself and reads content as a string (vLLM detects the
  "string" content format); it does not name the developer role, so vLLM turns developer messages
  into one merged system message. `RICH_TEMPLATE` loops over content parts (the "openai" format),
  names the developer role and prints every field and option vLLM passes (name, tool_calls,
  tool_call_id, reasoning_content, tools, documents, a custom kwarg). vLLM only takes a request's
  own template with ``--trust-request-chat-template``.
- `COMPLETIONS`: (id, body) for ``/v1/completions`` (the first prompt of a batch routes). For a text
  prompt, ``/tokenize`` with ``{"prompt": first, "add_special_tokens": ...}`` is the oracle; token
  ids route as they are.
- `CHATS`: (id, body) for ``/v1/chat/completions`` using only fields ``/tokenize`` also takes, so
  ``/tokenize`` with the same body is the oracle. `CHATS_RICH` are rendered with `RICH_TEMPLATE`
  (its body carries ``chat_template``).
- `REFUSED`: chat bodies vLLM answers with 400 (the proxy must too).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

STRING_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['content'] is string %}{% set c = message['content'] %}"
    "{% elif message['content'] is none %}{% set c = '' %}"
    "{% else %}{% set c = message['content'] | map(attribute='text') | join('\\n') %}{% endif %}"
    "{{ '<|' + message['role'] + '|>\\n' + c + eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

RICH_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}[tools]{{ tools | tojson }}\n{% endif %}"
    "{% if documents %}{% for d in documents %}[doc]{{ d['title'] }}: {{ d['text'] }}\n"
    "{% endfor %}{% endif %}"
    "{% if greeting is defined %}[greeting]{{ greeting }}\n{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'developer' %}[dev]{% endif %}"
    "<|{{ message['role'] }}|>"
    "{% if message.name %}({{ message.name }}){% endif %}"
    "{% if message.tool_call_id %}[id={{ message.tool_call_id }}]{% endif %}\n"
    "{% if message.reasoning_content %}<think>{{ message.reasoning_content }}</think>{% endif %}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}[part]"
    "{% endfor %}{% endif %}"
    "{% if message.tool_calls %}{% for call in message.tool_calls %}"
    "[call]{{ call['function']['name'] }}{{ call['function']['arguments'] | tojson }}"
    "{% endfor %}{% endif %}"
    "{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>"]

_SEED_TEXT = (
    "The quick brown fox jumps over the lazy dog. A router sends each request to the instance that "
    "already holds the longest matching prefix in its key value cache. Blocks of tokens are hashed "
    "with their parent hash, so equal prefixes give equal chains of block hashes. "
    "Hello world! How are you today? I am fine, thank you. What is the capital of France? Paris. "
    "0 1 2 3 4 5 6 7 8 9 10 100 1000 abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ "
    ".,;:!?'\"()[]{}<>-_=+*/\\|@#$%^&~` user assistant system tool developer message content role "
)


def build_tokenizer(path: str | Path, vocab_size: int = 768) -> Path:
    """Train and save the corpus tokenizer (byte-level BPE, BOS post-processor, STRING_TEMPLATE)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(1234)
    words = _SEED_TEXT.split()
    lines = [_SEED_TEXT] + [
        " ".join(rng.choice(words) for _ in range(rng.randint(5, 30))) for _ in range(400)
    ]
    raw = Tokenizer(models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    raw.train_from_iterator(lines, trainer=trainer)
    bos = raw.token_to_id("<s>")
    raw.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        model_max_length=4096,
    )
    fast.chat_template = STRING_TEMPLATE
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out))
    return out


LONG = " ".join(["the router sends each request to the longest matching prefix"] * 12)

COMPLETIONS: list[tuple[str, dict[str, Any]]] = [
    ("text", {"prompt": "hello world"}),
    ("text-long", {"prompt": LONG}),
    ("text-no-specials", {"prompt": "hello world", "add_special_tokens": False}),
    ("text-unicode", {"prompt": "héllo wörld 🙂 — ok\n\ttabs"}),
    ("text-special-inside", {"prompt": "a</s>b<s>c"}),
    ("batch-text", {"prompt": ["first prompt", "second"]}),
    ("token-ids", {"prompt": [1, 260, 79, 268, 560]}),
    ("batch-token-ids", {"prompt": [[5, 6, 7], [8, 9]]}),
]

_HELLO = [{"role": "user", "content": "Hello world! How are you today?"}]
_TOOL_CALLS = [
    {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'},
    },
    {"id": "call_2", "type": "function", "function": {"name": "noop", "arguments": ""}},
]
_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    },
    {"type": "function", "function": {"name": "noop"}},
]
_AGENT_TURNS: list[dict[str, Any]] = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the weather in Paris?", "name": "alice"},
    {"role": "assistant", "content": None, "tool_calls": _TOOL_CALLS},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 c"},
    {
        "role": "tool",
        "tool_call_id": "call_2",
        "content": [{"type": "text", "text": "ok"}, {"type": "text", "text": "done"}],
    },
    {"role": "assistant", "content": "It is sunny in Paris.", "reasoning": "The tool said so."},
    {"role": "user", "content": "Thanks!"},
]

CHATS: list[tuple[str, dict[str, Any]]] = [
    ("one-user", {"messages": _HELLO}),
    ("system-user", {"messages": [{"role": "system", "content": "be nice"}, *_HELLO]}),
    ("no-generation-prompt", {"messages": _HELLO, "add_generation_prompt": False}),
    (
        "continue-final",
        {
            "messages": [*_HELLO, {"role": "assistant", "content": "I am fine, th"}],
            "add_generation_prompt": False,
            "continue_final_message": True,
        },
    ),
    ("add-special-tokens", {"messages": _HELLO, "add_special_tokens": True}),
    (
        "parts-joined",
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "first part"},
                        "a bare string part",
                        {"type": "text", "text": ""},
                        {"type": "input_text", "text": "last part"},
                    ],
                }
            ]
        },
    ),
    (
        "content-null-missing",
        {
            "messages": [
                *_HELLO,
                {"role": "assistant", "content": None},
                {"role": "user", "content": "again"},
                {"role": "assistant"},
            ]
        },
    ),
    (
        "developer-merged",
        {
            "messages": [
                {"role": "system", "content": "rule one"},
                {"role": "user", "content": "hi"},
                {"role": "developer", "content": [{"type": "text", "text": "rule two"}]},
                {"role": "user", "content": "bye"},
            ]
        },
    ),
    ("developer-only", {"messages": [{"role": "developer", "content": "x"}, *_HELLO]}),
    ("custom-role", {"messages": [{"role": "banana", "content": "ripe"}, *_HELLO]}),
    ("agent-turns", {"messages": _AGENT_TURNS}),
    ("tools-ignored-by-template", {"messages": _HELLO, "tools": _TOOLS}),
    ("unused-kwargs", {"messages": _HELLO, "chat_template_kwargs": {"foo": 1}}),
    (
        "billing-header",
        {
            "messages": [
                {"role": "system", "content": "x-anthropic-billing-header: cch=123\nBe brief."},
                *_HELLO,
            ]
        },
    ),
    ("long", {"messages": [{"role": "system", "content": LONG}, *_HELLO]}),
]

CHATS_RICH: list[tuple[str, dict[str, Any]]] = [
    (name, {**body, "chat_template": RICH_TEMPLATE})
    for name, body in [
        ("rich-agent-turns", {"messages": _AGENT_TURNS, "tools": _TOOLS}),
        (
            "rich-parts",
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                    },
                    {"role": "developer", "content": "dev rule", "name": "ops"},
                ]
            },
        ),
        ("rich-kwargs", {"messages": _HELLO, "chat_template_kwargs": {"greeting": "hey"}}),
        ("rich-no-generation", {"messages": _HELLO, "add_generation_prompt": False}),
    ]
]

REFUSED: list[tuple[str, dict[str, Any]]] = [
    (
        "both-flags",
        {"messages": _HELLO, "add_generation_prompt": True, "continue_final_message": True},
    ),
    ("unknown-part", {"messages": [{"role": "user", "content": [{"type": "hologram"}]}]}),
    ("part-without-type", {"messages": [{"role": "user", "content": [{"text": "x"}]}]}),
    (
        "tool-call-not-function",
        {
            "messages": [
                {"role": "assistant", "content": "", "tool_calls": [{"type": "other", "x": 1}]}
            ]
        },
    ),
]
