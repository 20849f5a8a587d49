"""Stream a chat completion from a vLLM or SGLang server running dyntree (vllm_serve.sh, sglang_serve.sh).

    python examples/openai_client.py "Write a python function that returns the n-th fibonacci number."

Speculation is invisible to the client: the same API, the same tokens, sooner.
"""

from __future__ import annotations

import argparse

from openai import OpenAI


def main(prompt: str, base_url: str, model: str | None, max_tokens: int) -> str:
    client = OpenAI(base_url=base_url, api_key="EMPTY")
    model = model or client.models.list().data[0].id
    text = ""
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                            temperature=0, max_tokens=max_tokens, stream=True)
    for chunk in stream:
        piece = (chunk.choices[0].delta.content or "") if chunk.choices else ""
        print(piece, end="", flush=True)
        text += piece
    print()
    return text


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("prompt")
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--model", default=None, help="served model name (default: the server's first)")
    p.add_argument("--max-tokens", type=int, default=128)
    a = p.parse_args()
    main(a.prompt, a.base_url, a.model, a.max_tokens)
