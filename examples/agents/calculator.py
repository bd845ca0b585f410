"""The calculator recipe's agent written as a team would write it against the OpenAI SDK, for
`rollout.agent` (configs/tools_smollm2_135m_sdk.yaml, `make smollm2-tools-sdk`): the same task and budget as
the built-in multi-turn loop of configs/tools_smollm2_135m.yaml, but the loop, the tool and its result are
this file's, and the model is reached over HTTP through the rollout worker's gateway.

    async def run(client, row) -> None     # client: openai.AsyncOpenAI bound to this sample's session

Each model turn ends at `</tool_call>` (as the built-in loop's turns do) or at the end of the turn; a call
is answered with the calculator's result as a `tool` message; at most 3 model turns and 2 calls. It returns
None: the row's reward rule scores the final answer (the last model turn's text), as in the built-in loop.
"""

import json

from megappo.agent.tools import Calculator

CALCULATOR = Calculator()
TOOLS = [CALCULATOR.schema()]  # what the built-in loop shows (the same system prompt, via rollout.multi_turn.tool_prompt)
MAX_TURNS, MAX_CALLS = 3, 2


async def run(client, row):
    messages = list(row["messages"])
    calls = 0
    for _ in range(MAX_TURNS):
        r = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS,
                                                 stop=["</tool_call>"])
        msg = r.choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        if not msg.tool_calls or calls >= MAX_CALLS or r.choices[0].finish_reason == "length":
            return None
        for call in msg.tool_calls:
            calls += 1
            try:
                result = CALCULATOR.call(json.loads(call.function.arguments)).text  # checked, never raises
            except json.JSONDecodeError as e:
                result = f"error: the arguments are not JSON ({e})"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return None
