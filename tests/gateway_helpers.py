"""What the gateway tests share: the chat template they render with, and the agents they run against a real
server with the unmodified openai SDK."""

import asyncio

# a template that trims assistant text (as Qwen's do) and knows nothing of tool_calls
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n"
            "{% if m.role == 'assistant' %}{{ m.content | trim }}{% else %}{{ m.content }}{% endif %}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def run_two_turn_agents(url: str, keys: list[str], model: str, max_tokens: int) -> None:
    """One agent per key, all at once: two chat turns each (its reply sent back, then "go on"), seeded by its
    place, as concurrent users of an agent framework would load the engine."""
    import openai

    async def agent(key, k):
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
        msgs = [{"role": "user", "content": f"count to {k}"}]
        for _ in range(2):
            r = await client.chat.completions.create(model=model, messages=msgs, max_tokens=max_tokens, seed=k)
            msgs += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "go on"}]
        await client.close()

    async def main():
        await asyncio.gather(*(agent(key, k) for k, key in enumerate(keys)))

    asyncio.run(main())
