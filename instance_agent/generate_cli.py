"""`kvherd generate`: run one prompt through the built-in paged engine and print the completion.

Contract: ``--model`` is a preset (``tiny``, ``small``) or a local HF checkpoint directory; the prompt
is text (``--prompt``, optionally wrapped in the chat template with ``--chat``) or token ids
(``--prompt-token-ids 1,2,3``). Sampling is seeded (``--seed``, default 0), so a command prints the
same output every time. Plain output streams the text; ``--json`` prints one object
``{"token_ids", "text", "finish_reason", "num_prompt_tokens"}``. Bad input prints a one-line
message on stderr and exits with status 2, without a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny", help="preset (tiny, small) or HF checkpoint dir")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="prompt text")
    source.add_argument("--prompt-token-ids", help="comma-separated prompt token ids, e.g. 1,2,3")
    parser.add_argument(
        "--chat", action="store_true", help="render --prompt as a user chat message"
    )
    parser.add_argument(
        "--max-tokens", type=int, default=16, help="tokens to generate (default 16)"
    )
    parser.add_argument("--temperature", type=float, default=1.0, help="0 is greedy (default 1.0)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0, help="0 disables top-k")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS")
    parser.add_argument("--weights-seed", type=int, default=0, help="seed of a preset's weights")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    parser.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16")
    parser.add_argument("--json", action="store_true", help="print token ids and text as JSON")


def _parse_token_ids(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(
            f"--prompt-token-ids must be comma-separated integers, got {text!r}"
        ) from None


def run(args: argparse.Namespace) -> int:
    from instance_agent.engine.core.request import SamplingParams
    from instance_agent.engine.llm_engine import EngineConfig, LLMEngine

    try:
        prompt: str | list[int] = (
            args.prompt
            if args.prompt_token_ids is None
            else _parse_token_ids(args.prompt_token_ids)
        )
        # One request: a KV pool sized for a single full-length sequence is enough.
        engine = LLMEngine(
            EngineConfig(
                model=args.model,
                seed=args.weights_seed,
                max_num_seqs=1,
                device=args.device,
                dtype=args.dtype,
            )
        )
        if args.chat and isinstance(prompt, str):
            from kvherd.chat_render import parse_chat
            from kvherd.tokenizer import chat_token_ids

            chat = parse_chat({"messages": [{"role": "user", "content": prompt}]})
            prompt = chat_token_ids(engine.tokenizer, chat)
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            stop=list(args.stop),
            ignore_eos=args.ignore_eos,
        )
        engine.add_request("generate-0", prompt, params)
    except ValueError as exc:  # InvalidRequestError included
        print(f"kvherd generate: error: {exc}", file=sys.stderr)
        return 2

    final = None
    while engine.has_unfinished():
        for out in engine.step():
            if not args.json and out.text_delta:
                sys.stdout.write(out.text_delta)
                sys.stdout.flush()
            if out.finished:
                final = out
    assert final is not None
    if args.json:
        print(
            json.dumps(
                {
                    "token_ids": final.output_token_ids,
                    "text": final.text,
                    "finish_reason": final.finish_reason,
                    "num_prompt_tokens": final.num_prompt_tokens,
                }
            )
        )
    else:
        sys.stdout.write("\n")
    return 0
